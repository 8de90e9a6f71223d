"""gpt-oss (GptOssForCausalLM) beyond the parity tests its row in tests/helpers.py TINY_HF_CONFIGS runs on the
dense checkpoint transformers saves (logits, gradients, KV cache, greedy tokens, packed and unpadded rows, conversion
both ways, every --quantize mode per expert, the decode kernel, LoRA exported to PEFT: there and in test_moe.py).

Here: its published layout, experts in MXFP4. The bytes are made in this file from the format's definition (32 E2M1
codes of 4 bits per block, two per byte low nibble first, one E8M0 power-of-two scale per block) and read by our
converter and by transformers (which dequantizes them on CPU): the values equal the definition's and transformers'
bit for bit, the model's logits, greedy tokens and KV-cache decoding equal transformers' model of those bytes, the
experts are re-quantized expert by expert (never a whole stack dequantized), the HF export writes the same bytes
back, a LoRA on attention exports to PEFT, one on experts and router too (merged: dense experts), QLoRA trains from
the CLI; and gpt-oss config fields we do not implement are refused in one line before any weight is read."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import make_tiny_hf_model, random_tokens
from helpers_bounds import SEQUENCES, assert_logits_as_close_as, assert_merged_as_close_as
from safetensors.torch import load_file, save_file

from lit_qlora.convert import convert_hf_checkpoint
from lit_qlora.loader import load_model
from lit_qlora.utils import UserError

transformers = pytest.importorskip("transformers")

E, C, INNER = 4, 64, 32  # tests/helpers.py's gpt_oss row: experts, hidden, expert width
UNCONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


# ---- MXFP4 by its definition ---------------------------------------------------------------------------------------
def e2m1(code: int) -> float:
    """A 4-bit E2M1 code's value: bit 3 the sign, bits 2-1 the exponent (bias 1; 0 is subnormal: 0 or 0.5), bit 0
    the mantissa."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa / 2 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
    return -magnitude if sign else magnitude


def by_definition(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., G, 16] bytes and [..., G] scales -> [..., G * 32] fp32, element by element: value 2i of a block is byte
    i's low nibble, value 2i + 1 its high nibble, each times 2^(scale - 127)."""
    b, s = blocks.reshape(-1, 16).tolist(), scales.reshape(-1).tolist()
    out = [[e2m1(byte & 15 if j % 2 == 0 else byte >> 4) * 2.0 ** (sc - 127) for byte in row for j in (0, 1)]
           for row, sc in zip(b, s)]
    return torch.tensor(out, dtype=torch.float32).reshape(*scales.shape[:-1], -1)


def random_mxfp4(rows: int, cols: int, gen: torch.Generator, scales=(121, 125)) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 bytes of E stacked [rows, cols] weights: every code, scales 2^-6 .. 2^-3 (the tiny model's size)."""
    blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
    return blocks, torch.randint(*scales, (E, rows, cols // 32), generator=gen, dtype=torch.uint8)


def make_mxfp4_gpt_oss(folder: Path, seed: int = 0, **overrides) -> dict[str, torch.Tensor]:
    """A tiny gpt-oss folder in the published layout: transformers' tiny model with each layer's experts replaced by
    random MXFP4 bytes (`mlp.experts.gate_up_proj_blocks` [E, 2 * inner, hidden / 32, 16] with gate and up rows
    interleaved, `_scales`, and `down_proj_*`), config.json's quantization_config as published. Returns the file's
    tensors."""
    make_tiny_hf_model("gpt_oss", folder, seed=seed, initializer_range=0.2, **overrides)
    sd = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for i in range(transformers.AutoConfig.from_pretrained(folder).num_hidden_layers):
        pre = f"model.layers.{i}.mlp.experts."
        for name, rows, cols in (("gate_up_proj", 2 * INNER, C), ("down_proj", C, INNER)):
            del sd[pre + name]
            sd[pre + name + "_blocks"], sd[pre + name + "_scales"] = random_mxfp4(rows, cols, gen)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": UNCONVERTED}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return sd


def hf_of(folder: Path):
    """transformers' model of `folder` in fp32 (MXFP4 experts: dequantized by transformers, as it does on CPU)."""
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def mxfp4_ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4") / "gpt-oss-tiny"
    sd = make_mxfp4_gpt_oss(folder)
    convert_hf_checkpoint(folder)
    return folder, sd, hf_of(folder)


def test_mxfp4_values_are_the_formats_and_transformers(mxfp4_ckpt):
    """Our dequantization of MXFP4 bytes equals the format's definition element by element and transformers' own
    (integrations.mxfp4.convert_moe_packed_tensors), bit for bit: every code, extreme scales included."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from lit_qlora.quant.mxfp4 import dequantize

    gen = torch.Generator().manual_seed(1)
    blocks, scales = random_mxfp4(6, 64, gen, scales=(100, 160))  # 2^-27 .. 2^32
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # both nibbles of every code
    want = by_definition(blocks, scales)  # [E, rows, cols]
    assert want[0, 0, :32:2].tolist() == [e2m1(c) * 2.0 ** (int(scales[0, 0, 0]) - 127) for c in range(16)]
    ours = dequantize(blocks, scales, torch.float32)
    assert torch.equal(ours, want)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # [E, rows, cols]
    assert torch.equal(ours, theirs)
    assert torch.equal(dequantize(blocks, scales, torch.bfloat16).float(), ours)  # exact in bf16 too
    # the published files' bytes, as our converter stored them (gate and up rows apart), read back
    folder, sd, hf = mxfp4_ckpt
    model = load_model(folder, precision="32-true")
    experts = hf.model.layers[1].mlp.experts
    ours = model.transformer.h[1].mlp.experts
    assert torch.equal(ours.fc_1.weight, experts.gate_up_proj[..., 0::2].transpose(1, 2))
    assert torch.equal(ours.fc_2.weight, experts.gate_up_proj[..., 1::2].transpose(1, 2))
    assert torch.equal(ours.proj.weight, experts.down_proj.transpose(1, 2))


@torch.no_grad()
def test_mxfp4_checkpoint_computes_what_transformers_computes(mxfp4_ckpt):
    """The published layout converted and loaded dense (fp32): the logits of transformers' model of the same bytes
    (ours at least as close to the exact ones as transformers' own, tests/helpers_bounds.py; 24 tokens: past the
    sliding window of 8), the same greedy tokens, and KV-cache decoding equal to the full forward. The converted file
    keeps the MXFP4 bytes (as small as the published one), not dense weights."""
    from lit_qlora.checkpoint import LIT_WEIGHTS, safetensors_specs
    from lit_qlora.generation import generate

    folder, sd, hf = mxfp4_ckpt
    model = load_model(folder, precision="32-true").eval()
    assert model.config.moe_mxfp4
    idx = random_tokens(SEQUENCES, 24, seed=7)
    got = model(idx)
    assert_logits_as_close_as(got, hf, idx)
    stored = {k: (s, d) for k, s, d in safetensors_specs(folder / LIT_WEIGHTS) if ".experts." in k}
    assert stored["transformer.h.0.mlp.experts.fc_1.weight_blocks"] == (torch.Size((E, INNER, C // 32, 16)),
                                                                        torch.uint8)
    assert not [k for k in stored if k.endswith(".weight")]

    prompt = random_tokens(8, seed=2)
    expected = hf.generate(prompt[None], attention_mask=torch.ones(1, 8, dtype=torch.long), do_sample=False,
                           max_new_tokens=12, eos_token_id=None, pad_token_id=0)[0]
    assert len(set(expected[8:].tolist())) >= 3
    assert generate(model, prompt, max_new_tokens=12, temperature=0.0).tolist() == expected.tolist()

    model.set_kv_cache(batch_size=SEQUENCES, max_seq_length=24)
    steps = [model(idx[:, :10], input_pos=torch.arange(10))]
    steps += [model(idx[:, t:t + 1], input_pos=torch.tensor([t])) for t in range(10, 24)]
    model.clear_kv_cache()
    assert_logits_as_close_as(torch.cat(steps, dim=1), hf, idx, "KV-cache decoding")


@pytest.mark.parametrize("mode", ["bnb.nf4-dq", "bnb.int8"])
@torch.no_grad()
def test_mxfp4_experts_are_requantized_expert_by_expert(mxfp4_ckpt, mode, monkeypatch):
    """--quantize from MXFP4: each expert's layer holds what bitsandbytes stores for that expert's weight as
    transformers dequantizes it, and the load dequantized one expert's [out, in] at a time (no stack, no model)."""
    from helpers import assert_same_stored, reference_layer

    from lit_qlora.quant import mxfp4
    from lit_qlora.quant.quantize import QuantizedExpertWeights

    folder, _, hf = mxfp4_ckpt
    shapes = []
    real = mxfp4.dequantize
    monkeypatch.setattr(mxfp4, "dequantize", lambda b, s, d: shapes.append(tuple(b.shape)) or real(b, s, d))
    monkeypatch.setattr(mxfp4.Mxfp4Tensor, "load", lambda *a: pytest.fail("a whole stack was dequantized"))
    model = load_model(folder, precision="32-true", quantize=mode)
    assert shapes and all(len(s) == 3 for s in shapes)  # [out, G, 16]: one expert
    assert len(shapes) == 3 * E * 2  # each expert of each projection of both layers, once
    for i, block in enumerate(model.transformer.h):
        experts = hf.model.layers[i].mlp.experts
        dense = {"fc_1": experts.gate_up_proj[..., 0::2], "fc_2": experts.gate_up_proj[..., 1::2],
                 "proj": experts.down_proj}
        for name, w in dense.items():
            q = getattr(block.mlp.experts, name)
            assert isinstance(q, QuantizedExpertWeights)
            for e, layer in enumerate(q.layers):
                assert_same_stored(layer, reference_layer(mode, w[e].t().contiguous(), torch.float32))


@torch.no_grad()
def test_mxfp4_export_writes_the_same_bytes_and_loads_in_transformers(mxfp4_ckpt, tmp_path):
    """Our checkpoint -> HF: the experts written back as MXFP4, bit-identical to the published file (gate and up
    rows interleaved again), with the quantization_config transformers reads them by; transformers' model of the
    export computes the original's logits."""
    from lit_qlora.convert import convert_lit_checkpoint

    folder, sd, hf = mxfp4_ckpt
    out = convert_lit_checkpoint(folder, tmp_path / "export")
    exported = load_file(out / "model.safetensors")
    assert set(exported) == set(sd)
    for key, t in sd.items():
        assert torch.equal(exported[key], t), key
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    idx = random_tokens(2, 16, seed=4)
    assert torch.equal(hf_of(out)(idx).logits, hf(idx).logits)


@torch.no_grad()
def test_the_dequantized_checkpoint_transformers_saves_is_read_as_the_same_model(mxfp4_ckpt, tmp_path):
    """transformers loads the MXFP4 folder (dequantizing), saves it in bf16: that folder (dense stacked experts, no
    quantization_config) converts to the same expert weights, exactly (MXFP4 values are exact in bf16)."""
    folder, _, hf = mxfp4_ckpt
    out = tmp_path / "dequantized"
    transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(out)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    convert_hf_checkpoint(out)
    dense, ours = load_model(out, precision="32-true"), load_model(folder, precision="32-true")
    assert not dense.config.moe_mxfp4
    for name, p in ours.named_parameters():
        if ".experts." in name and name.endswith(".weight"):
            assert torch.equal(dict(dense.named_parameters())[name], p), name


@torch.no_grad()
def test_attention_lora_exports_to_peft_and_merges_into_an_mxfp4_folder(mxfp4_ckpt, tmp_path):
    """A LoRA on attention and head over the MXFP4 checkpoint: PEFT over transformers' model gives the same logits,
    and the merged HF export (experts still MXFP4, attention merged) loaded by transformers alone computes what model
    + adapter computes."""
    from helpers import adapter_of, lora_cfg, randomize_lora
    from peft import PeftModel

    from lit_qlora.export.merge import export_hf

    folder, _, hf = mxfp4_ckpt
    lora = lora_cfg(query=True, key=True, value=True, projection=True, head=True)
    model = load_model(folder, precision="32-true", lora=lora, seed=0).eval()
    randomize_lora(model, seed=4)
    idx = random_tokens(SEQUENCES, 12, seed=3)
    expected = model(idx)
    adapter = adapter_of(model, lora)
    adapter.export_peft(model.config, tmp_path / "peft", base_model_name_or_path=str(folder))
    peft_model = PeftModel.from_pretrained(hf_of(folder), tmp_path / "peft").eval()
    assert_logits_as_close_as(expected, peft_model, idx, "against PEFT")
    out = export_hf(folder, tmp_path / "hf", adapter)
    assert "gate_up_proj_blocks" in "".join(load_file(out / "model.safetensors"))
    assert_merged_as_close_as(hf_of(out)(idx).logits, peft_model, idx)


@torch.no_grad()
def test_expert_and_router_lora_over_mxfp4_experts_export_to_peft_and_merge_dense(mxfp4_ckpt, tmp_path):
    """LoRA on the experts and router (and q, v) over the MXFP4 checkpoint: transformers + PEFT (target_parameters
    on the experts transformers dequantized) computes our logits (ours at least as close to the exact ones as PEFT's
    own fp32 logits, tests/helpers_bounds.py), the adapter imports back the same; merged, W + s B A is no MXFP4 grid,
    so the HF export stores every expert dense in the checkpoint's dtype (no _blocks, no quantization_config) and
    transformers alone computes model + adapter's logits (by the same rule)."""
    from helpers import adapter_of, lora_cfg, randomize_lora
    from peft import PeftModel

    from lit_qlora.adapter import Adapter
    from lit_qlora.export.merge import export_hf

    folder, _, hf = mxfp4_ckpt
    lora = lora_cfg(query=True, value=True, experts=True, router=True)
    model = load_model(folder, precision="32-true", lora=lora, seed=0).eval()
    randomize_lora(model, seed=4)
    idx = random_tokens(SEQUENCES, 12, seed=3)
    expected = model(idx)
    assert (expected - hf(idx).logits).abs().max() > 0.05
    adapter = adapter_of(model, lora)
    adapter.export_peft(model.config, tmp_path / "peft", base_model_name_or_path=str(folder))
    peft_model = PeftModel.from_pretrained(hf_of(folder), tmp_path / "peft").eval()
    assert_logits_as_close_as(expected, peft_model, idx, "against PEFT")
    back = Adapter.load(tmp_path / "peft", model.config)
    assert back.lora.keys() == adapter.lora.keys()
    assert all(torch.equal(back.lora[k], v) for k, v in adapter.lora.items())
    out = export_hf(folder, tmp_path / "hf", adapter)
    stored = load_file(out / "model.safetensors")
    assert "model.layers.0.mlp.experts.gate_up_proj" in stored and not any(k.endswith("_blocks") for k in stored)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert_merged_as_close_as(hf_of(out)(idx).logits, peft_model, idx)


def test_qlora_on_an_mxfp4_checkpoint_trains_from_the_cli_and_generates(tmp_path):
    """The user's path on a published-layout gpt-oss: finetune/lora.py --quantize bnb.nf4 (the MXFP4 experts
    re-quantized to nf4, LoRA on attention, head, experts and router) learns (the loss falls) and records the expert
    load, and generate/lora.py answers with the adapter merged and with --merge false."""
    import math

    from helpers_tokenizer import make_hf_bpe_tokenizer
    from helpers_train import GENERATE_LORA, VOCAB, make_records, read_metrics, run_script, train

    ckpt = tmp_path / "gpt-oss"
    make_mxfp4_gpt_oss(ckpt, vocab_size=VOCAB)
    make_hf_bpe_tokenizer(ckpt, vocab_size=VOCAB)
    data = tmp_path / "data"
    data.mkdir()
    (data / "tasks.json").write_text(json.dumps(make_records()))
    out = tmp_path / "out"
    train({"ckpt": ckpt, "data": data}, out, max_iters=8, quantize="bnb.nf4", lora_projection="true",
          lora_head="true", lora_experts="true", lora_router="true", learning_rate=1e-2)
    losses = [float(r["loss"]) for r in read_metrics(out)]
    assert len(losses) == 8 and all(map(math.isfinite, losses)) and sum(losses[-4:]) / 4 < 0.9 * losses[0]
    load = json.loads((out / "metrics.json").read_text())["expert_load"]  # top 2 of E = 4 in both layers
    assert load["layers"] == [0, 1] and all(math.isclose(sum(row), 2, rel_tol=1e-4) for row in load["all_steps"])
    for merge in ("true", "false"):
        r = run_script(GENERATE_LORA, ["--checkpoint_dir", ckpt, "--lora_path", out / "lit_model_lora_finetuned.pth",
                                       "--quantize", "bnb.nf4", "--precision", "32-true", "--prompt", "kind",
                                       "--max_new_tokens", "4", "--merge", merge, "--temperature", "0"])
        assert r.returncode == 0, r.stderr


def test_the_published_config_reads_as_transformers_reads_it():
    """openai/gpt-oss-20b's config.json (lit_qlora/config.py's named entry): the sizes, layer kinds, window, top-k,
    clamp and MXFP4 storage as transformers' GptOssConfig has them, 20.9B parameters, and its YaRN (factor 32, not
    truncated) giving transformers' inverse frequencies and cos/sin factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lit_qlora.checkpoint import lit_param_shapes
    from lit_qlora.config import _HF_CONFIGS, Config
    from lit_qlora.model import rope_inv_freq

    published = _HF_CONFIGS["gpt-oss-20b"]
    ours, theirs = Config.from_hf_config(published), transformers.GptOssConfig(**published)
    assert ours.moe_mxfp4 and not Config.from_name("gpt-oss-20b").moe_mxfp4  # a name is the model, not a folder
    assert (ours.n_layer, ours.moe_n_expert, ours.moe_top_k, ours.moe_intermediate_size, ours.head_size) == (
        theirs.num_hidden_layers, theirs.num_local_experts, theirs.num_experts_per_tok, theirs.intermediate_size,
        theirs.head_dim)
    assert (ours.layer_types, ours.sliding_window_size) == (theirs.layer_types, theirs.sliding_window)
    assert (ours.moe_swiglu_limit, ours.moe_swiglu_alpha) == (theirs.swiglu_limit, theirs.swiglu_alpha)
    ours.moe_mxfp4 = False
    assert round(sum(s.numel() for s in lit_param_shapes(ours).values()) / 1e9, 1) == 20.9
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu")
    got, got_factor = rope_inv_freq(ours.rope_n_elem, ours.rope_base, ours.rope_scaling, torch.device("cpu"))
    torch.testing.assert_close(got, inv_freq.float(), rtol=1e-6, atol=0)
    assert got_factor == pytest.approx(factor)


# ---- bad input --------------------------------------------------------------------------------------------------
BAD_FIELDS = [
    (dict(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}),
     "quant_method='bitsandbytes'"),
    (dict(quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": UNCONVERTED[1:]}),
     "quantizes 'model.layers.*.self_attn'"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "rope scaling 'dynamic'"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer type 'chunked_attention'"),
    (dict(hidden_size=48, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": UNCONVERTED}),
     "hidden_size=48 is not a multiple of 32"),
    (dict(swiglu_limit="seven"), "swiglu_limit is 'seven', expected a finite number > 0"),
    (dict(quantization_config="mxfp4"), "quantization_config is 'mxfp4', expected an object"),
]


@pytest.mark.parametrize("change, message", BAD_FIELDS)
def test_unimplemented_fields_are_refused_before_any_weight_is_read(tmp_path, change, message):
    """A gpt-oss config.json field that changes the math and is not implemented: one line naming it, from the
    conversion, before the weights (here unreadable bytes) are opened."""
    from helpers import TINY_HF_CONFIGS

    (tmp_path / "config.json").write_text(json.dumps({**TINY_HF_CONFIGS["gpt_oss"], **change}))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match=message) as e:
        convert_hf_checkpoint(tmp_path)
    assert "\n" not in str(e.value) and "safetensors" not in str(e.value)


def test_weights_that_are_not_what_config_json_says_are_refused_in_one_line(tmp_path):
    """A config.json that says MXFP4 over dense weights (or the reverse) names the missing tensor and the mismatch."""
    folder = tmp_path / "m"
    make_mxfp4_gpt_oss(folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["quantization_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"gate_up_proj'.*stored dense \(no quantization_config\)"):
        convert_hf_checkpoint(folder)
    assert not (folder / "lit_model.safetensors").exists()
    shutil.rmtree(folder)
