"""GGUF export of gpt-oss (llama.cpp's "gpt-oss" architecture), checked against transformers' GptOss.

transformers 5.24's GGUF reader cannot read a gpt-oss file as llama.cpp's converter writes it: it fails on the
rope.scaling keys (it reads a field's first part, the key's length, as the value), and past that it takes no head
size, sliding window, sinks or experts from the file. So, as for Mixtral in test_gguf.py, the file is read the way
llama.cpp reads it: every tensor dequantized by the gguf package (MXFP4 included) and named back through llama.cpp's
own tensor name map for gpt-oss, the experts' gate and up re-interleaved into transformers' gate_up_proj, the shape
and RoPE from the file's keys, the SwiGLU's limit and gain llama.cpp's constants (7, 1.702). transformers' GptOss of
that must give the logits of transformers' GptOss of the original folder (dense, or experts in MXFP4 dequantized by
transformers), within 1e-5 in f32.

Broken on purpose, these go red: gate and up swapped in the file, the sinks left out, the window not written, the
MXFP4 nibbles in our order instead of ggml's.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
import torch
from helpers import make_tiny_hf_model, random_adapter
from helpers_chat import make_chat_checkpoint
from safetensors.torch import load_file
from test_gguf import F32_TOLERANCE, _assert_tensor_types, export, field, tensors_of
from test_gptoss import by_definition, make_mxfp4_gpt_oss

from lit_qlora.checkpoint import lit_param_shapes
from lit_qlora.convert import convert_hf_checkpoint, lit_to_hf_plan
from lit_qlora.export.gguf_export import export_gguf
from lit_qlora.loader import load_model, load_model_with_adapter
from lit_qlora.utils import UserError

transformers = pytest.importorskip("transformers")

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
# What llama.cpp computes (the SwiGLU constants) and what its YaRN does (rounds the correction range: truncate)
LLAMA_CPP = dict(swiglu_limit=7.0, swiglu_alpha=1.702,
                 rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": True, "original_max_position_embeddings": 4096, "rope_theta": 150000.0})
# gpt-oss's tokenizer.json splits text with o200k's regex before a regex-free ByteLevel: llama.cpp's "gpt-4o"
O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _harmony_tokenizer(folder: Path) -> None:
    """gpt-oss's kind of tokenizer: harmony's special tokens, its chat template, o200k's split."""
    make_chat_checkpoint("harmony", folder, (TEMPLATES / "gpt_oss.jinja").read_text())
    data = json.loads((folder / "tokenizer.json").read_text())
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": O200K}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    (folder / "tokenizer.json").write_text(json.dumps(data))


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    """A tiny gpt-oss as transformers saves it (dense experts): sinks, a sliding layer (window 8) then a full one,
    biases on q/k/v/o, router and experts, 4 experts top 2."""
    folder = tmp_path_factory.mktemp("gguf_gpt_oss") / "tiny-gpt-oss"
    make_tiny_hf_model("gpt_oss", folder, initializer_range=0.1, vocab_size=704, **LLAMA_CPP)
    _harmony_tokenizer(folder)
    convert_hf_checkpoint(folder)
    return folder


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory) -> Path:
    """The same model as published: experts in MXFP4 (bytes from the format's definition, test_gptoss.py)."""
    folder = tmp_path_factory.mktemp("gguf_gpt_oss_mxfp4") / "tiny-gpt-oss-mxfp4"
    make_mxfp4_gpt_oss(folder, seed=3, vocab_size=704, **LLAMA_CPP)
    _harmony_tokenizer(folder)
    convert_hf_checkpoint(folder)
    return folder


def hf_of_gguf(path: Path):
    """transformers' GptOss of a gpt-oss GGUF file, read as llama.cpp reads it (see the module's docstring)."""
    reader, file = gguf.GGUFReader(path), tensors_of(path)
    assert field(reader, "general.architecture") == "gpt-oss"

    def key(name: str):
        return field(reader, f"gpt-oss.{name}")

    rope = {"rope_type": "default", "rope_theta": key("rope.freq_base")}
    if key("rope.scaling.type") == "yarn":
        rope.update(rope_type="yarn", factor=key("rope.scaling.factor"), truncate=True,
                    original_max_position_embeddings=key("rope.scaling.original_context_length"),
                    **{b: key(f"rope.scaling.yarn_{b}") for b in ("beta_fast", "beta_slow")
                       if key(f"rope.scaling.yarn_{b}") is not None})
    n = key("block_count")
    # layer_types left to GptOssConfig's default, sliding first then alternating: llama.cpp's fixed pattern
    config = transformers.GptOssConfig(
        vocab_size=key("vocab_size"), hidden_size=key("embedding_length"), num_hidden_layers=n,
        intermediate_size=key("expert_feed_forward_length"), num_attention_heads=key("attention.head_count"),
        num_key_value_heads=key("attention.head_count_kv"), head_dim=key("attention.key_length"),
        sliding_window=key("attention.sliding_window"), max_position_embeddings=key("context_length"),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"), num_local_experts=key("expert_count"),
        num_experts_per_tok=key("expert_used_count"), rope_parameters=rope, swiglu_limit=7.0, swiglu_alpha=1.702,
        tie_word_embeddings="output.weight" not in file, attention_bias=True)
    model = transformers.GptOssForCausalLM(config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, n)
    sd, used = {}, set()

    def take(hf_module: str, suffix: str) -> torch.Tensor:
        name = names.get_name(hf_module) + suffix
        used.add(name)
        return file[name]

    for hf_key in model.state_dict():
        if ".mlp.experts." in hf_key:  # llama.cpp: gate, up, down stacked [E, out, in] with biases [E, out]
            stack, bias = hf_key.removesuffix("_bias"), hf_key.endswith("_bias")
            suffix = ".bias" if bias else ".weight"
            if stack.endswith("down_proj"):
                t = take(stack, suffix)
                sd[hf_key] = t if bias else t.transpose(-1, -2)
                continue
            gate = take(stack.replace("gate_up_proj", "gate_proj"), suffix)
            up = take(stack.replace("gate_up_proj", "up_proj"), suffix)
            rows = torch.stack((gate, up), dim=2 if not bias else -1).flatten(1, 2)  # gate and up rows alternating
            sd[hf_key] = rows if bias else rows.transpose(-1, -2)  # transformers keeps them [E, in, 2 * inner]
        elif hf_key.endswith(".sinks"):
            sd[hf_key] = take(hf_key, ".weight")
        else:
            module, _, param = hf_key.rpartition(".")
            sd[hf_key] = take(module, "." + param)
    model.load_state_dict({k: v.contiguous() for k, v in sd.items()}, strict=True)
    assert used == set(file), set(file) - used  # every tensor of the file is one of the model's
    return model.eval()


def hf_of(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def tokens(n: int = 2, length: int = 14, seed: int = 0) -> torch.Tensor:  # longer than the window (8)
    return torch.randint(0, 704, (n, length), generator=torch.Generator().manual_seed(seed))


# ---- the model -------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_logits_match_transformers_of_the_original_folder(dense, tmp_path):
    idx = tokens()
    path = export(SimpleNamespace(folder=dense), tmp_path, dtype="f32")
    diff = (hf_of_gguf(path)(idx).logits - hf_of(dense)(idx).logits).abs().max().item()
    print(f"gpt-oss f32: max |logit diff| {diff:.2e}")
    assert diff <= 1e-5, diff
    _assert_tensor_types(gguf.GGUFReader(path), "f32")


@pytest.mark.parametrize("dtype", ["bf16", "q8_0"])
def test_rounded_dtypes_round_the_f32_files_tensors(dense, dtype, tmp_path):
    """bf16 and q8_0: each weight is the f32 file's rounded once (bf16: exactly its nearest bf16; q8_0: within half
    a step of 1/127 of its 32-value block's largest magnitude, plus the f16 scale's rounding); norms, biases, sinks and
    the router stay f32 as llama.cpp keeps them. (Logits are compared in f32 only: a weight rounded in bf16 moves a
    token whose top-2 experts nearly tie to another expert, a jump no tolerance on the logits bounds.)"""
    f32 = tensors_of(export(SimpleNamespace(folder=dense), tmp_path / "f32", dtype="f32"))
    path = export(SimpleNamespace(folder=dense), tmp_path / dtype, dtype=dtype)
    _assert_tensor_types(gguf.GGUFReader(path), dtype)
    rounded = tensors_of(path)
    assert rounded.keys() == f32.keys()
    for name, t in rounded.items():
        ref = f32[name]
        if t.dim() == 1 or ".ffn_gate_inp." in name:
            assert torch.equal(t, ref), name
        elif dtype == "bf16":
            assert torch.equal(t, ref.bfloat16().float()), name
        else:
            blocks = ref.reshape(-1, 32)
            step = blocks.abs().amax(-1, keepdim=True) / 127
            # half a step, and the f16 scale's relative 2^-11 times up to 127 steps
            assert ((t.reshape(-1, 32) - blocks).abs() <= step * (0.5 + 127 * 2**-11)).all(), name


def test_metadata_is_what_llama_cpps_converter_writes(dense, tmp_path):
    """The keys llama.cpp's convert_hf_to_gguf.py writes for gpt-oss (its GptOssModel and the shared YaRN keys), the
    vocabulary of a byte-level BPE with o200k's split ("gpt-4o"), harmony's special tokens and its chat template."""
    reader = gguf.GGUFReader(export(SimpleNamespace(folder=dense), tmp_path, dtype="f16"))
    hf = json.loads((dense / "config.json").read_text())
    want = {"general.architecture": "gpt-oss", "gpt-oss.block_count": 2, "gpt-oss.embedding_length": 64,
            "gpt-oss.feed_forward_length": 32, "gpt-oss.expert_feed_forward_length": 32,
            "gpt-oss.expert_count": 4, "gpt-oss.expert_used_count": 2, "gpt-oss.attention.head_count": 4,
            "gpt-oss.attention.head_count_kv": 2, "gpt-oss.attention.key_length": 16,
            "gpt-oss.attention.value_length": 16, "gpt-oss.attention.sliding_window": 8,
            "gpt-oss.context_length": hf["max_position_embeddings"], "gpt-oss.rope.freq_base": 150000.0,
            "gpt-oss.rope.scaling.type": "yarn", "gpt-oss.rope.scaling.factor": 32.0,
            "gpt-oss.rope.scaling.original_context_length": 4096, "gpt-oss.rope.scaling.yarn_beta_fast": 32.0,
            "gpt-oss.rope.scaling.yarn_beta_slow": 1.0, "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "gpt-4o"}
    assert {k: field(reader, k) for k in want} == want
    tok = json.loads((dense / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    # as in llama.cpp's gpt-oss-20b GGUF: bos <|startoftext|>, eos <|return|>, pad <|endoftext|>
    assert [field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")] == \
        [ids["<|startoftext|>"], ids["<|return|>"], ids["<|endoftext|>"]]
    assert field(reader, "tokenizer.chat_template") == (TEMPLATES / "gpt_oss.jinja").read_text()
    assert field(reader, "tokenizer.ggml.tokens")[ids["<|channel|>"]] == "<|channel|>"
    assert field(reader, "tokenizer.ggml.token_type")[ids["<|channel|>"]] == gguf.TokenType.CONTROL


# ---- experts in MXFP4 ------------------------------------------------------------------------------------------
@torch.no_grad()
def test_mxfp4_experts_stay_mxfp4_bit_for_bit(mxfp4, tmp_path):
    """The published layout's experts are written as ggml MXFP4, as llama.cpp's converter writes them: the values
    the gguf package dequantizes are the format's definition of the checkpoint's bytes (gate: its even rows, up: its
    odd rows), and the file's model gives transformers' logits of the MXFP4 folder (which dequantizes them itself)."""
    path = export(SimpleNamespace(folder=mxfp4), tmp_path, dtype="f32")
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert {n: t for n, t in types.items() if re.search(r"ffn_\w+_exps\.weight", n)} == \
        {f"blk.{i}.ffn_{p}_exps.weight": "MXFP4" for i in range(2) for p in ("gate", "up", "down")}
    file, sd = tensors_of(path), load_file(mxfp4 / "model.safetensors")
    for i in range(2):
        pre = f"model.layers.{i}.mlp.experts."
        gate_up = by_definition(sd[pre + "gate_up_proj_blocks"], sd[pre + "gate_up_proj_scales"])
        assert torch.equal(file[f"blk.{i}.ffn_gate_exps.weight"], gate_up[:, 0::2])
        assert torch.equal(file[f"blk.{i}.ffn_up_exps.weight"], gate_up[:, 1::2])
        down = by_definition(sd[pre + "down_proj_blocks"], sd[pre + "down_proj_scales"])
        assert torch.equal(file[f"blk.{i}.ffn_down_exps.weight"], down)
    idx = tokens(seed=1)
    diff = (hf_of_gguf(path)(idx).logits - hf_of(mxfp4)(idx).logits).abs().max().item()
    assert diff <= 1e-5, diff


# ---- adapters --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("experts", [True, False], ids=["experts-made-dense", "experts-kept-mxfp4"])
@torch.no_grad()
def test_merged_adapter_over_mxfp4_experts(mxfp4, experts, tmp_path):
    """A LoRA over the MXFP4 checkpoint merged into the file gives our adapted logits. On attention, head, router and
    experts: the adapted experts are written dense (W + s B A is not an MXFP4 grid); without experts: they stay
    MXFP4."""
    model = SimpleNamespace(folder=mxfp4)
    adapter = random_adapter(mxfp4, seed=1, query=True, value=True, projection=True, head=True, experts=experts,
                           router=True)
    idx = tokens(seed=2)
    ours = load_model_with_adapter(mxfp4, adapter, precision="32-true")(idx)
    path = export(model, tmp_path, adapter=adapter, dtype="f32")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {n for n, t in types.items() if t != "F32"} == \
        (set() if experts else {f"blk.{i}.ffn_{p}_exps.weight" for i in range(2) for p in ("gate", "up", "down")})
    assert (hf_of_gguf(path)(idx).logits - ours).abs().max().item() <= F32_TOLERANCE


@torch.no_grad()
def test_lora_only_on_attention_and_router(dense, tmp_path):
    """--lora_only: llama.cpp's LoRA file of an adapter on q, k, v, o (llama.cpp's gpt-oss rotates NeoX-style, so no
    row moves) and the router (ffn_gate_inp, which llama.cpp's MoE adapts too): B @ A * alpha / r is our update, and
    the base file's model plus those updates gives ours."""
    model = SimpleNamespace(folder=dense)
    config = load_model(dense, precision="32-true").config
    adapter = random_adapter(dense, seed=2, query=True, key=True, value=True, projection=True, router=True)
    path = export(model, tmp_path / "lora", adapter=adapter, lora_only=True, dtype="f32")
    reader = gguf.GGUFReader(path)
    assert field(reader, "general.architecture") == "gpt-oss" and field(reader, "adapter.type") == "lora"
    file = tensors_of(path)
    base = hf_of_gguf(export(model, tmp_path / "base", dtype="f32"))
    params = dict(base.named_parameters())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, config.n_layer)
    shapes, lora, seen = lit_param_shapes(config), adapter.config, 0
    for hf_key, (key, *_), j in lit_to_hf_plan(config):
        module = key.removesuffix(".weight")
        if not key.endswith(".weight") or module + ".lora_A" not in adapter.lora:
            continue
        delta = adapter.delta(module, tuple(shapes[key]))
        expected = delta.split(config.qkv_sizes)[j] if j is not None else delta
        gguf_name = names.get_name(hf_key.removesuffix(".weight")) + ".weight"
        got = file[gguf_name + ".lora_b"] @ file[gguf_name + ".lora_a"] * (lora.alpha / lora.r)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        params[hf_key].add_(got)
        seen += 2
    assert seen == len(file) == 2 * 5 * config.n_layer
    idx = tokens(seed=3)
    ours = load_model_with_adapter(dense, adapter, precision="32-true")(idx)
    assert (base(idx).logits - ours).abs().max().item() <= F32_TOLERANCE


def test_lora_only_on_experts_is_refused(dense, tmp_path):
    with pytest.raises(UserError, match=r"LoRA on a mixture's experts .*\(drop --lora_only\)"):
        export(SimpleNamespace(folder=dense), tmp_path, adapter=random_adapter(dense, query=True, experts=True),
               lora_only=True)
    assert not any(tmp_path.iterdir())


# ---- what llama.cpp computes otherwise ---------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (dict(swiglu_limit=2.0), "has moe_swiglu_limit=2.0, which the GGUF export of llama.cpp's 'gpt-oss'"),
    (dict(swiglu_alpha=1.5), "has moe_swiglu_alpha=1.5"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "has layer_types=.'full_attention'"),
])
def test_what_llama_cpp_computes_otherwise_is_refused(overrides, message, tmp_path):
    """llama.cpp's gpt-oss has the SwiGLU constants 7 and 1.702 and sliding layers first: anything else is refused in
    one line, before anything is converted or written."""
    folder = tmp_path / "tiny-gpt-oss"
    make_tiny_hf_model("gpt_oss", folder, vocab_size=704, **{**LLAMA_CPP, **overrides})
    _harmony_tokenizer(folder)
    with pytest.raises(UserError, match=message):
        export_gguf(folder, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists() and not (folder / "lit_model.safetensors").exists()


def test_unrounded_yarn_is_written_with_a_note(dense, tmp_path, capsys):
    """gpt-oss publishes YaRN with truncate=false; llama.cpp rounds the correction range: the file is written (every
    real gpt-oss has it) and a note says where llama.cpp's RoPE differs."""
    folder = tmp_path / "tiny-gpt-oss"
    shutil.copytree(dense, folder)
    hf = json.loads((folder / "config.json").read_text())
    hf["rope_parameters"]["truncate"] = False
    (folder / "config.json").write_text(json.dumps(hf))
    (folder / "lit_model.safetensors").unlink()
    (folder / "model_config.json").unlink()
    export_gguf(folder, tmp_path / "model.gguf")
    assert "truncate=false" in capsys.readouterr().err
    assert (tmp_path / "model.gguf").is_file()
