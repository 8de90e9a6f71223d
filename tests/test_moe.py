"""Mixtures of experts (Qwen3-MoE, Mixtral, gpt-oss as transformers saves it; its MXFP4 files: test_gptoss.py)
beyond the per-family parity tests that their rows in tests/helpers.py TINY_HF_CONFIGS run (logits, gradients, KV
cache, greedy tokens, conversion both ways): experts quantized under every --quantize mode as bitsandbytes quantizes
each expert's weight, only the experts that receive tokens computed, and a LoRA over a quantized MoE model trained
from the CLI, merged and exported to PEFT."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import assert_same_stored, converted_tiny, random_tokens, reference_layer

from lit_qlora.loader import load_model
from lit_qlora.model import MoE
from lit_qlora.quantize import QuantizedExpertWeights, dequantize_weight, validation_mode

MODES = ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8"]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "gpt_oss"])
def moe_ckpt(request, tmp_path_factory):
    return converted_tiny(tmp_path_factory, request.param, f"tiny-{request.param}")


@pytest.mark.parametrize("mode", MODES)
@torch.no_grad()
def test_experts_are_quantized_as_bitsandbytes_quantizes_each_expert(moe_ckpt, mode):
    """Every expert's [out, in] of every projection holds what bitsandbytes' own layer stores for that weight (the
    packed codes, block scales and their double quantization, or the int8 rows and row scales); the router stays a
    dense Linear with the checkpoint's weights. The quantized model computes what our dense model computes with
    bitsandbytes' dequantization of those weights (int8 in its dequantizing matmul, `validation_mode`). (The reference
    is bitsandbytes' layer per expert: transformers 5.24's BitsAndBytesConfig leaves these models' stacked experts
    dense, quantizing only their Linear layers, so it has no quantized experts to compare with.)"""
    dense = load_model(moe_ckpt.folder, precision="32-true").eval()
    quantized = load_model(moe_ckpt.folder, precision="32-true", quantize=mode)
    validation_mode(quantized)  # eval, with int8's dequantize-then-matmul (LLM.int8 inference rounds the inputs too)
    n = 0
    for name, q in quantized.named_modules():
        if ".layers." in name or name.endswith(".layers"):  # (inside a QuantizedExpertWeights: below)
            continue
        d = dense.get_submodule(name)
        if isinstance(q, MoE):
            assert type(q.router) is nn.Linear and torch.equal(q.router.weight, d.router.weight)
        elif isinstance(q, QuantizedExpertWeights):
            for e, layer in enumerate(q.layers):
                assert_same_stored(layer, reference_layer(mode, d.weight[e], torch.float32))
                d.weight[e] = dequantize_weight(layer)
                n += 1
        elif type(d) is nn.Linear and type(q) is not nn.Linear:  # the attention's and dense MLPs' quantized layers
            d.weight.copy_(dequantize_weight(q))
    c = moe_ckpt.config
    assert n == c.moe_n_expert * 3 * sum(map(c.is_moe_layer, range(c.n_layer)))
    idx = random_tokens(2, 16, seed=3)
    want = dense(idx)
    assert (quantized(idx) - want).abs().max().item() <= 1e-4 * want.std().item()


@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.int8"])
@torch.no_grad()
def test_only_the_experts_that_receive_tokens_run(moe_ckpt, mode, monkeypatch):
    """One token through a quantized MoE model: in each MoE layer exactly top_k experts run their three projections,
    each once (the others are never dequantized); a longer sequence runs each active expert once, not per token."""
    model = load_model(moe_ckpt.folder, precision="32-true", quantize=mode).eval()
    calls: list[tuple[str, int]] = []
    for name, m in model.named_modules():
        if isinstance(m, QuantizedExpertWeights):
            for e, layer in enumerate(m.layers):
                real = layer.forward
                monkeypatch.setattr(layer, "forward", lambda x, _n=name, _e=e, _f=real: calls.append((_n, _e)) or _f(x))
    k, moe_layers = moe_ckpt.config.moe_top_k, sum(map(moe_ckpt.config.is_moe_layer, range(moe_ckpt.config.n_layer)))
    model(random_tokens(1, 1, seed=1))
    assert len(calls) == len(set(calls)) == 3 * k * moe_layers
    calls.clear()
    model(random_tokens(1, 24, seed=1))
    assert len(calls) == len(set(calls)) <= 3 * moe_ckpt.config.moe_n_expert * moe_layers


ATTENTION_AND_HEAD = dict(query=True, key=True, value=True, projection=True, head=True)


@torch.no_grad()
def test_attention_lora_exports_to_peft_and_merges_into_an_hf_folder(moe_ckpt, tmp_path):
    """A LoRA on attention and head of a MoE model: PEFT loads our export over transformers' model with the same
    logits, and the merged HF export, loaded by transformers alone, computes what model + adapter computes."""
    from helpers import adapter_of, hf_model, lora_cfg, randomize_lora
    from peft import PeftModel

    from lit_qlora.merge import export_hf

    lora = lora_cfg(**ATTENTION_AND_HEAD)
    model = load_model(moe_ckpt.folder, precision="32-true", lora=lora, seed=0).eval()
    randomize_lora(model, seed=4)
    idx = random_tokens(2, 12, seed=3)
    expected = model(idx)
    adapter = adapter_of(model, lora)
    adapter.export_peft(model.config, tmp_path / "peft", base_model_name_or_path=str(moe_ckpt.folder))
    peft_model = PeftModel.from_pretrained(hf_model(moe_ckpt.folder), tmp_path / "peft").eval()
    assert (peft_model(idx).logits - expected).abs().max().item() <= 1e-4
    out = export_hf(moe_ckpt.folder, tmp_path / "hf", adapter)
    assert (hf_model(out)(idx).logits - expected).abs().max().item() <= 1e-4


def test_lora_on_experts_is_refused_in_one_line(moe_ckpt):
    from helpers import lora_cfg

    from lit_qlora.utils import UserError

    with pytest.raises(UserError, match="--lora_mlp on a mixture of experts"):
        load_model(moe_ckpt.folder, precision="32-true", lora=lora_cfg(mlp=True))


def test_qlora_on_a_moe_model_trains_from_the_cli_and_generates(tmp_path):
    """The user's path on Qwen3-MoE, as subprocesses: finetune/lora.py with --quantize bnb.nf4 (LoRA on attention
    and head over 4-bit experts) learns (the loss falls), then generate/lora.py answers with the adapter merged and
    with --merge false."""
    import json
    import math

    from helpers import make_tiny_hf_model
    from helpers_tokenizer import make_hf_bpe_tokenizer
    from helpers_train import GENERATE_LORA, VOCAB, make_records, read_metrics, run_script, train

    ckpt = tmp_path / "qwen3_moe"
    make_tiny_hf_model("qwen3_moe", ckpt, initializer_range=0.2, vocab_size=VOCAB)
    make_hf_bpe_tokenizer(ckpt, vocab_size=VOCAB)
    data = tmp_path / "data"
    data.mkdir()
    (data / "tasks.json").write_text(json.dumps(make_records()))
    out = tmp_path / "out"
    train({"ckpt": ckpt, "data": data}, out, max_iters=8, quantize="bnb.nf4", lora_projection="true",
          lora_head="true", learning_rate=1e-2)
    losses = [float(r["loss"]) for r in read_metrics(out)]
    assert len(losses) == 8 and all(map(math.isfinite, losses)) and sum(losses[-4:]) / 4 < 0.9 * losses[0]
    for merge in ("true", "false"):
        r = run_script(GENERATE_LORA, ["--checkpoint_dir", ckpt, "--lora_path", out / "lit_model_lora_finetuned.pth",
                                       "--quantize", "bnb.nf4", "--precision", "32-true", "--prompt", "kind",
                                       "--max_new_tokens", "4", "--merge", merge, "--temperature", "0"])
        assert r.returncode == 0, r.stderr


def test_what_does_not_know_experts_yet_refuses_in_one_line(moe_ckpt, tmp_path):
    """The memory estimator (its MLP terms are a dense MLP's) and the GGUF export (no expert tensors) refuse a MoE
    model in one line naming it, instead of a wrong figure or file."""
    from lit_qlora.gguf_export import export_gguf
    from lit_qlora.memory import estimate_training_memory
    from lit_qlora.utils import UserError

    with pytest.raises(UserError, match="does not know mixtures of experts"):
        estimate_training_memory(moe_ckpt.config, quantize="bnb.nf4", seq_length=16)
    with pytest.raises(UserError, match=moe_ckpt.config.hf_architecture):
        export_gguf(moe_ckpt.folder, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_a_checkpoint_of_stacked_experts_is_refused_in_one_line(tmp_path):
    """Experts saved as transformers holds them in memory (one gate_up_proj / down_proj per layer) are refused
    naming the tensor, not reported as an incomplete download."""
    from helpers import make_tiny_hf_model
    from safetensors.torch import load_file, save_file

    from lit_qlora.convert import convert_hf_checkpoint
    from lit_qlora.utils import UserError

    make_tiny_hf_model("mixtral", tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    for i in range(2):
        pre = f"model.layers.{i}.block_sparse_moe.experts."
        w1, w2, w3 = ([sd.pop(f"{pre}{e}.{n}.weight") for e in range(4)] for n in ("w1", "w2", "w3"))
        sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([torch.stack(w1), torch.stack(w3)], dim=1)
        sd[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(w2)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(UserError, match="stores its experts stacked .'model.layers.0.mlp.experts"):
        convert_hf_checkpoint(tmp_path)
