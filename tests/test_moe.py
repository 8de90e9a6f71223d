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


class _OutputSizes(torch.utils._python_dispatch.TorchDispatchMode):
    """The element count of every tensor the ops inside it return."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numels += [t.numel() for t in (out if isinstance(out, (tuple, list)) else [out])
                        if isinstance(t, torch.Tensor)]
        return out


def test_expert_backward_makes_no_tensor_of_all_routed_rows_per_expert():
    """The backward of a MoE layer's experts handles the N*k routed rows a few times in all, not once per expert: the
    rows are split per expert (whose backward concatenates the experts' gradients once), not sliced (whose backward
    makes a zero tensor of all N*k rows for each expert: with 64 experts most of a training step's time)."""
    from lit_qlora.config import Config
    from lit_qlora.model import Experts

    E, k, N, C = 16, 2, 64, 32
    config = Config(name="moe", n_layer=1, n_embd=C, n_head=2, intermediate_size=64, vocab_size=64, moe_n_expert=E,
                    moe_top_k=k, moe_intermediate_size=16, hf_architecture="Qwen3MoeForCausalLM")
    experts = Experts(config)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, C, generator=g, requires_grad=True)
    chosen = torch.rand(N, E, generator=g).topk(k, dim=-1).indices
    y = experts(x, chosen, torch.full((N, k), 0.5))
    with _OutputSizes() as sizes:
        y.sum().backward()
    assert len(torch.unique(chosen)) == E and x.grad is not None
    assert sizes.numels.count(N * k * C) < E // 2, sizes.numels  # 4 (torch 2.13); sliced: 2 per expert and more


@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4"])
@pytest.mark.parametrize("in_features", [128, 96])  # whole blocks per row; blocks straddling rows
@pytest.mark.parametrize("dtype,fp32_kernels", [(torch.float32, None), (torch.bfloat16, False),
                                                (torch.bfloat16, True)])
def test_expert_matmul_equals_the_bitsandbytes_layer(mode, in_features, dtype, fp32_kernels):
    """A quantized expert's training matmul (quantize._ExpertMatmul: its own allocation order, see there) computes what
    the expert's bitsandbytes layer computes, forward and the input's gradient, at 32-true and bf16-true (with the CPU's
    bf16 kernels and with lit_qlora/cpu_half.py's fp32 kernels)."""
    from lit_qlora import cpu_half
    from lit_qlora.model import ExpertWeights
    from lit_qlora.quantize import quantize_experts

    dense = ExpertWeights(3, 48, in_features)
    nn.init.normal_(dense.weight, std=0.1)
    experts = QuantizedExpertWeights(dense, mode, dtype)
    quantize_experts(experts, dense.weight.detach(), torch.device("cpu"), dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, in_features, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(20, 48, generator=g).to(dtype)
    with cpu_half.forced(fp32_kernels):
        y = experts(x, 1)
        assert y.grad_fn is not None and "ExpertMatmul" in type(y.grad_fn).__name__
        (gx,) = torch.autograd.grad(y, x, grad)
        x2 = x.detach().clone().requires_grad_()
        y2 = experts.layers[1](x2)
        (gx2,) = torch.autograd.grad(y2, x2, grad)
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y, y2, **tol)
    torch.testing.assert_close(gx, gx2, **tol)
