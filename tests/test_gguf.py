"""GGUF export, checked against references: transformers' GGUF reader (model, config and tokenizer rebuilt from the
file alone), llama.cpp's own `gguf` package (reader, tensor name map, dequantization) and sentencepiece.

Tiny models of every supported family: llama (sentencepiece tokenizer, chat template), llama3 (tied embeddings,
Llama 3.1 rope scaling, one kv head, Llama 3's pre-tokenizer), mistral (GPT-2's pre-tokenizer), qwen2 (biases,
tied, Qwen2's pre-tokenizer, a vocabulary smaller than the embedding), qwen3 (QK-norm, head_dim != hidden / heads),
phi3 (fused attn_qkv and ffn_up, a sliding window), gemma2 (soft-caps that clip, norms of 1 + weight, post norms) and
gemma3 (QK-norm, 5:1 sliding / full layers with their own RoPE bases), and the mixtures of experts qwen3_moe
(llama.cpp's qwen3moe, read by transformers' GGUF reader) and mixtral (llama.cpp's llama with experts, which
transformers' GGUF reader does not read: checked through llama.cpp's tensor name map and transformers' Mixtral).
gpt-oss, which transformers' GGUF reader cannot read either: tests/test_gguf_gptoss.py.
"""
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
import torch
from helpers import make_tiny_hf_model, random_adapter
from helpers_tokenizer import make_hf_bpe_tokenizer, make_sentencepiece_tokenizer, tokenizer_test_corpus
from helpers_train import ROOT, assert_one_line_error, run_script

from lit_qlora.adapter import Adapter
from lit_qlora.checkpoint import lit_param_shapes
from lit_qlora.convert import convert_hf_checkpoint, lit_to_hf_plan
from lit_qlora.export.gguf_export import export_gguf
from lit_qlora.loader import load_model, load_model_with_adapter
from lit_qlora.tokenizer import Tokenizer
from lit_qlora.utils import UserError

EXPORT = ROOT / "scripts" / "export_gguf.py"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"

# Logit tolerances, as a multiple of the unit roundoff u of the stored weights times the largest |logit|. Each weight
# is rounded once, with a relative error <= u (2^-11 for f16, 2^-8 for bf16). q8_0 rounds each weight to a step of
# 1/127 of its 32-value block's largest magnitude (~2.5 sigma): an rms error ~3.5x bf16's for a typical weight, so
# its bound is in bf16's u. Rounding errors of a dot product are independent and partly cancel; through two layers
# they come out at <= 1.8 u * scale (f16, bf16) and <= 4.7 u * scale (q8_0), as
# `pytest tests/test_gguf.py -k logits_match -s` prints. A wrong layout (a missing q/k permutation, swapped or
# missing rope factors) is off by ~10% of the scale (~25 u of bf16).
TOLERANCE = {"f32": None, "f16": 4 * 2**-11, "bf16": 4 * 2**-8, "q8_0": 10 * 2**-8}
F32_TOLERANCE = 1e-4  # absolute, as for the HF export


def _model(base: Path, kind: str, tokenizer, name: str = "", **overrides) -> SimpleNamespace:
    # not a bare "mistral": transformers' reader then asks gguf for a "mistral" arch
    folder = base / f"tiny-{name or kind}"
    # weights of std 0.05 instead of 0.02: attention far from uniform, so a wrong q/k layout or rope moves the logits
    # by ~10% of their scale instead of ~1%, beyond the bf16 / q8_0 tolerances
    make_tiny_hf_model(kind, folder, initializer_range=0.05, **overrides)
    tokenizer(folder)
    convert_hf_checkpoint(folder)
    return SimpleNamespace(kind=kind, folder=folder, config=load_model(folder, precision="32-true").config)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, SimpleNamespace]:
    base = tmp_path_factory.mktemp("gguf_models")
    return {
        "llama": _model(base, "llama", lambda f: make_sentencepiece_tokenizer(f, chat_template=TEMPLATE),
                        vocab_size=512),
        "llama3": _model(base, "llama3", lambda f: make_hf_bpe_tokenizer(f, vocab_size=320, split_regex=LLAMA3_SPLIT)),
        "mistral": _model(base, "mistral", lambda f: make_hf_bpe_tokenizer(f, vocab_size=320)),
        "qwen2": _model(base, "qwen2", lambda f: make_hf_bpe_tokenizer(
            f, vocab_size=300, split_regex=QWEN2_SPLIT, bos_in_post_processor=False, add_bos_token=None)),
        # transformers' qwen3 reader takes no head_dim from the file (Qwen3Config's default, 128, is the real models')
        "qwen3": _model(base, "qwen3", lambda f: make_hf_bpe_tokenizer(
            f, vocab_size=300, split_regex=QWEN2_SPLIT, bos_in_post_processor=False, add_bos_token=None),
                        head_dim=128),
        # Phi-3-mini-4k's kind: fused qkv and gate_up, full rotary, no rope scaling, a sliding window
        "phi3": _model(base, "phi3", lambda f: make_hf_bpe_tokenizer(f, vocab_size=320), partial_rotary_factor=1.0,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        # Phi-3.5 / Phi-4-mini's kind: longrope on a partial rotary (and Phi-4-mini's tied head)
        "phi3_longrope": _model(base, "phi3", lambda f: make_hf_bpe_tokenizer(f, vocab_size=320), name="phi3-longrope"),
        "phi4_mini": _model(base, "phi4_mini", lambda f: make_hf_bpe_tokenizer(f, vocab_size=320)),
        # soft-caps that clip; queries scaled by 1/sqrt(head_dim), as llama.cpp scales them below 27B; tied, as every
        # Gemma 2 (llama.cpp's gemma2 has no output tensor)
        "gemma2": _model(base, "gemma2", lambda f: make_hf_bpe_tokenizer(f, vocab_size=320), query_pre_attn_scalar=16,
                         tie_word_embeddings=True),
        # llama.cpp's Gemma 3: 5 sliding layers then a full one, the sliding layers' RoPE base 10000, no scaling
        # experts in every layer (llama.cpp's qwen3moe has no dense layers), of width 768: transformers' qwen3moe
        # reader takes no expert width from the file (Qwen3MoeConfig's default, 768, is Qwen3-30B-A3B's)
        "qwen3_moe": _model(base, "qwen3_moe", lambda f: make_hf_bpe_tokenizer(
            f, vocab_size=300, split_regex=QWEN2_SPLIT, bos_in_post_processor=False, add_bos_token=None),
                            mlp_only_layers=[], moe_intermediate_size=768),
        "mixtral": _model(base, "mixtral", lambda f: make_hf_bpe_tokenizer(f, vocab_size=320)),
        "gemma3": _model(base, "gemma3", lambda f: make_hf_bpe_tokenizer(f, vocab_size=320), query_pre_attn_scalar=32,
                         num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    }


ARCH = {"llama3": "llama", "qwen3_moe": "qwen3moe", "mixtral": "llama"}  # kind -> llama.cpp's architecture


def export(model: SimpleNamespace, out_dir: Path, **kw) -> Path:
    """Export into a folder of its own: transformers reads tokenizer_config.json / config.json next to the file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return export_gguf(model.folder, out_dir / "model.gguf", **kw)


def hf_from_gguf(path: Path):
    """transformers' model of a GGUF file. What its reader leaves at the defaults is taken from the file as llama.cpp
    takes it: for phi3 the rotated share of each head and longrope (factor tensors, attention factor, original length);
    for the Gemmas the soft-caps written there and queries scaled by 1/sqrt(head_dim)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    arch = field(gguf.GGUFReader(path), "general.architecture")
    if arch == "phi3":  # its reader takes neither the rotated share nor longrope: as llama.cpp reads them
        reader, factors = gguf.GGUFReader(path), tensors_of(path)
        head = config.hidden_size // config.num_attention_heads
        rope = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"],
                "partial_rotary_factor": field(reader, "phi3.rope.dimension_count") / head}
        if "rope_factors_long.weight" in factors:
            original = field(reader, "phi3.rope.scaling.original_context_length")
            rope.update(rope_type="longrope", original_max_position_embeddings=original,
                        attention_factor=field(reader, "phi3.rope.scaling.attn_factor"),
                        **{f"{k}_factor": factors[f"rope_factors_{k}.weight"].tolist() for k in ("long", "short")})
            config.original_max_position_embeddings = original
        config.rope_parameters = rope
    if arch in ("gemma2", "gemma3"):
        reader = gguf.GGUFReader(path)
        config.query_pre_attn_scalar = config.head_dim
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            setattr(config, key, field(reader, f"{arch}.{key}"))
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                             dtype=torch.float32).eval()


def apply_rope_freqs(hf_model, path: Path) -> None:
    """transformers' reader drops llama.cpp's rope_freqs tensor (Llama 3.1 scaling): apply it as llama.cpp does,
    every default rotary frequency divided by its factor."""
    factors = tensors_of(path).get("rope_freqs.weight")
    if factors is not None:
        rope = hf_model.model.rotary_emb
        inv_freq, _ = rope.compute_default_rope_parameters(hf_model.config)
        rope.inv_freq = inv_freq / factors


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file, dequantized by the gguf package, in torch order."""
    reader = gguf.GGUFReader(path)
    return {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()) for t in reader.tensors}


def field(reader: gguf.GGUFReader, key: str):
    f = reader.get_field(key)
    return None if f is None else f.contents()


def tokens(config, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def seq_len(model) -> int:  # the GGUF has no sliding window (llama.cpp's llama arch): compare within it
    return min(12, model.config.sliding_window_size or 12)


# ---- weights: logits through transformers' GGUF reader -------------------------------------------
# the newer families at f32 (their layout) and q8_0 (blocks of their shapes); the dtypes' encoding is the same for all
@pytest.mark.parametrize("kind, dtype", [(k, d) for k in ("llama", "llama3", "mistral", "qwen2") for d in TOLERANCE] +
                         [(k, d) for k in ("qwen3", "phi3", "phi3_longrope", "phi4_mini", "gemma2", "gemma3")
                          for d in ("f32", "q8_0")] + [("qwen3_moe", "f32")])
@torch.no_grad()
def test_logits_match(models, kind, dtype, tmp_path):
    model = models[kind]
    idx = tokens(model.config, 2, seq_len(model))
    ours = load_model(model.folder, precision="32-true")(idx)
    path = export(model, tmp_path, dtype=dtype)
    hf = hf_from_gguf(path)
    assert hf.config.tie_word_embeddings == model.config.tie_embeddings
    apply_rope_freqs(hf, path)
    diff = (hf(idx).logits - ours).abs().max().item()
    scale = ours.abs().max().item()
    bound = F32_TOLERANCE if TOLERANCE[dtype] is None else TOLERANCE[dtype] * scale
    print(f"{kind} {dtype}: max |logit diff| {diff:.2e} (max |logit| {scale:.2f}, bound {bound:.2e})")
    assert diff <= bound, (diff, bound)

    _assert_tensor_types(gguf.GGUFReader(path), dtype)


def _assert_tensor_types(reader: gguf.GGUFReader, dtype: str) -> None:
    """Weights (2-D, and 3-D stacked experts) in the asked type; 1-D tensors and a mixture's router in f32, as
    llama.cpp writes them."""
    want = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[dtype]
    router = [t for t in reader.tensors if ".ffn_gate_inp." in t.name]
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2 and t not in router} == {want}
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 1 or t in router} == {"F32"}


@torch.no_grad()
@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
@torch.no_grad()
def test_mixtral_through_llama_cpps_names(models, dtype, tmp_path):
    """Mixtral is llama.cpp's "llama" with experts, which transformers' GGUF reader does not read (its llama has no
    experts). The file's tensors, read and dequantized by the gguf package and named back by llama.cpp's own map of the
    HF tensor names (each stacked ffn_*_exps split into the HF checkpoint's one tensor per expert; q and k rows back
    from llama.cpp's rotary order by transformers' GGUF reader's un-permutation), form an HF checkpoint that
    transformers' Mixtral loads with our logits (q8_0: within its rounding; the router stays f32)."""
    import transformers
    from safetensors.torch import save_file

    model, c = models["mixtral"], models["mixtral"].config
    idx = tokens(c, 2, 12)
    ours = load_model(model.folder, precision="32-true")(idx)
    path = export(model, tmp_path / "gguf", dtype=dtype)
    _assert_tensor_types(gguf.GGUFReader(path), dtype)
    file = tensors_of(path)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.n_layer)
    sd, used = {}, set()
    for hf_key, _, _ in lit_to_hf_plan(c):
        module, _, param = hf_key.rpartition(".")
        expert = re.search(r"\.experts\.(\d+)\.", module)
        stacked = re.sub(r"\.experts\.\d+\.", ".experts.", module)
        name = names.get_name(stacked) + "." + param
        t = file[name][int(expert.group(1))] if expert else file[name]
        if module.endswith(("q_proj", "k_proj")):
            t = _reverse_permute(t, c.n_head if module.endswith("q_proj") else c.n_query_groups)
        sd[hf_key] = t.contiguous()
        used.add(name)
    assert used == set(file)  # every tensor of the file is an HF tensor of the checkpoint
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    shutil.copy(model.folder / "config.json", hf_dir)
    save_file(sd, hf_dir / "model.safetensors")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    diff, scale = (hf(idx).logits - ours).abs().max().item(), ours.abs().max().item()
    bound = F32_TOLERANCE if TOLERANCE[dtype] is None else TOLERANCE[dtype] * scale
    assert diff <= bound, (diff, bound)


def test_longrope_long_factors_through_the_file(models, tmp_path):
    """Past original_max_position_embeddings (32) longrope's long factors apply: 40 tokens of the Phi-4-mini-like model
    give our logits through the file too (the short factors are what test_logits_match sees)."""
    model = models["phi4_mini"]
    idx = tokens(model.config, 1, 40, seed=4)
    ours = load_model(model.folder, precision="32-true")(idx)
    hf = hf_from_gguf(export(model, tmp_path, dtype="f32"))
    assert (hf(idx).logits - ours).abs().max().item() <= F32_TOLERANCE


def test_rope_factors_match_transformers_llama3(models, tmp_path):
    """llama.cpp stores Llama 3.1 rope scaling as per-frequency divisors; transformers computes the scaled
    frequencies from the config: the two agree."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = models["llama3"]
    cfg = transformers.AutoConfig.from_pretrained(model.folder)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
    default, _ = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    factors = tensors_of(export(model, tmp_path, dtype="f32"))["rope_freqs.weight"]
    assert factors.shape == default.shape and (factors != 1).any()
    torch.testing.assert_close(factors, default / scaled, rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "qwen3", "phi3", "qwen3_moe", "mixtral"])
def test_metadata_and_names(models, kind, tmp_path):
    """The config transformers rebuilds from the file equals the original config.json, and the tensor names are the
    ones llama.cpp's name map gives for the HF tensors (no more, no fewer)."""
    import transformers

    model = models[kind]
    path = export(model, tmp_path, dtype="f16")
    original = transformers.AutoConfig.from_pretrained(model.folder)
    rebuilt = transformers.AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(rebuilt, key) == getattr(original, key), key
    # llama.cpp keeps these floats in f32
    assert rebuilt.rms_norm_eps == pytest.approx(original.rms_norm_eps, rel=1e-7)
    assert rebuilt.rope_parameters["rope_theta"] == pytest.approx(original.rope_parameters["rope_theta"], rel=1e-7)
    assert rebuilt.bos_token_id == 1 and rebuilt.eos_token_id == 2

    reader = gguf.GGUFReader(path)
    arch = ARCH.get(kind, kind)
    assert field(reader, "general.architecture") == arch and field(reader, "general.type") == "model"
    assert field(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_F16
    head = {"qwen3": 128, "qwen3_moe": 24}.get(kind, 16)
    assert field(reader, f"{arch}.rope.dimension_count") == model.config.head_size == head
    if kind in ("qwen3", "qwen3_moe"):  # head_dim != hidden / heads: written for llama.cpp, which assumes that else
        assert field(reader, f"{arch}.attention.key_length") == field(reader, f"{arch}.attention.value_length") == head
    c = model.config
    experts = {"qwen3_moe": (4, 2, 768), "mixtral": (4, 2, None)}.get(kind, (None, None, None))
    assert (field(reader, f"{arch}.expert_count"), field(reader, f"{arch}.expert_used_count"),
            field(reader, f"{arch}.expert_feed_forward_length")) == experts
    if kind == "qwen3_moe":  # what transformers reads of them (it reads no expert width: its default, here the same)
        assert (rebuilt.num_experts, rebuilt.num_experts_per_tok) == (original.num_experts,
                                                                      original.num_experts_per_tok)
        assert rebuilt.norm_topk_prob and rebuilt.mlp_only_layers == [] and rebuilt.head_dim == head
    if kind == "mixtral":  # llama.cpp's llama reads the experts' width from feed_forward_length
        assert field(reader, "llama.feed_forward_length") == c.moe_intermediate_size == original.intermediate_size
    if kind == "phi3":  # llama.cpp's phi3 attends within the window, as transformers does
        assert field(reader, "phi3.attention.sliding_window") == model.config.sliding_window_size == 8
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch],
                                     original.num_hidden_layers)
    # the HF files hold one tensor per expert, which llama.cpp's converter stacks: its name map names the stack
    hf_keys = {re.sub(r"\.experts\.\d+\.", ".experts.", k) for k, _, _ in lit_to_hf_plan(model.config)}
    expected = {names.get_name(k.rpartition(".")[0]) + "." + k.rpartition(".")[2] for k in hf_keys}
    expected |= {"rope_freqs.weight"} if model.config.rope_scaling else set()
    assert {t.name for t in reader.tensors} == expected


# ---- tokenizer ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "llama3", "mistral", "qwen2"])
def test_tokenizer_matches(models, kind, tmp_path):
    """transformers' tokenizer rebuilt from the file alone encodes like ours: ASCII, accents, CJK, emoji, code,
    leading spaces, newlines (240 texts), and has the same special tokens and chat template."""
    import transformers

    model = models[kind]
    path = export(model, tmp_path, dtype="f16")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = Tokenizer(model.folder)
    assert (ref.bos_token_id, ref.eos_token_id) == (ours.bos_id, ours.eos_id) == (1, 2)
    assert ref.pad_token_id == 3 and ref.unk_token_id == 0
    assert ref.chat_template == ours.chat_template == (TEMPLATE if kind == "llama" else None)
    reader = gguf.GGUFReader(path)
    assert field(reader, "tokenizer.ggml.add_bos_token") == ours.add_bos
    assert field(reader, "tokenizer.ggml.add_eos_token") is ours.add_eos is False
    assert field(reader, "tokenizer.ggml.model") == ("llama" if kind == "llama" else "gpt2")
    assert field(reader, "tokenizer.ggml.pre") == {"llama": None, "llama3": "llama-bpe", "mistral": "gpt-2",
                                                   "qwen2": "qwen2"}[kind]
    assert len(field(reader, "tokenizer.ggml.tokens")) == model.config.vocab_size  # qwen2: padded 300 -> 320

    plain = transformers.AutoTokenizer.from_pretrained(model.folder) if kind == "llama" else None
    texts = tokenizer_test_corpus()
    quirks = 0
    for text in texts:
        got = ref(text)["input_ids"]
        if kind == "llama" and text.startswith(" "):
            # transformers 5 builds every sentencepiece tokenizer with Metaspace(prepend_scheme="first"), which takes a
            # leading space as the dummy prefix: " x" is encoded like "x". Its tokenizer from the original
            # tokenizer.model does the same; llama.cpp (add_space_prefix) and sentencepiece prepend "▁" as we do.
            quirks += got != ours.encode(text).tolist()
            assert got == plain(text)["input_ids"], repr(text)
            continue
        assert got == ours.encode(text).tolist(), repr(text)
    assert quirks < 40


def _with_pre_tokenizer(model, folder: Path, pre_tokenizer: dict) -> SimpleNamespace:
    """A copy of `model` whose tokenizer.json splits text with `pre_tokenizer`."""
    import json

    shutil.copytree(model.folder, folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    data["pre_tokenizer"] = pre_tokenizer
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return SimpleNamespace(kind=model.kind, folder=folder, config=model.config)


def test_smollm_and_unknown_pre_tokenizers(models, tmp_path):
    """SmolLM2 splits digits one by one before GPT-2's regex: llama.cpp's "smollm". transformers' GGUF reader has no
    split for that name (it keeps GPT-2's regex), so it can only check texts without digits, where the two agree.
    A pre-tokenizer llama.cpp has no name for is refused, as llama.cpp's converter does."""
    import transformers

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    smollm = _with_pre_tokenizer(models["mistral"], tmp_path / "smollm", {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, byte_level]})
    path = export(smollm, tmp_path / "out", dtype="f16")
    assert field(gguf.GGUFReader(path), "tokenizer.ggml.pre") == "smollm"
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = Tokenizer(smollm.folder)
    texts = [t for t in tokenizer_test_corpus() if not any(c.isdigit() for c in t)]
    assert len(texts) > 100 and all(ref(t)["input_ids"] == ours.encode(t).tolist() for t in texts)
    assert ours.encode("2048").tolist() == [1, *[ours.token_to_id(c) for c in "2048"]]  # the split is real

    odd = _with_pre_tokenizer(models["mistral"], tmp_path / "odd", dict(byte_level, add_prefix_space=True))
    with pytest.raises(UserError, match=r"pre-tokenizer of .* \(ByteLevel\) is not one llama.cpp knows"):
        export(odd, tmp_path / "odd-out")
    assert not any((tmp_path / "odd-out").iterdir())


def test_sentencepiece_vocabulary_is_sentencepiece(models, tmp_path):
    """The "llama" vocabulary in the file is sentencepiece's own: pieces, scores, token types, dummy prefix."""
    import sentencepiece

    model = models["llama"]
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model.folder / "tokenizer.model"))
    reader = gguf.GGUFReader(export(model, tmp_path, dtype="f16"))
    assert field(reader, "tokenizer.ggml.tokens") == [sp.id_to_piece(i) for i in range(sp.vocab_size())]
    assert field(reader, "tokenizer.ggml.scores") == pytest.approx([sp.get_score(i) for i in range(sp.vocab_size())])
    types = field(reader, "tokenizer.ggml.token_type")
    T = gguf.TokenType
    assert types[:4] == [T.UNKNOWN, T.CONTROL, T.CONTROL, T.CONTROL]  # <unk> <s> </s> <pad>
    assert all(types[i] == (T.BYTE if sp.is_byte(i) else T.NORMAL) for i in range(4, sp.vocab_size()))
    assert sum(t == T.BYTE for t in types) == 256
    assert field(reader, "tokenizer.ggml.add_space_prefix") is True
    assert field(reader, "tokenizer.ggml.merges") is None  # llama.cpp merges sentencepiece pieces by score


# ---- adapters ----------------------------------------------------------------------------------
ALL = dict(query=True, key=True, value=True, projection=True, mlp=True, head=True)


def make_adapter(model, seed: int = 0, **targets) -> Adapter:
    return random_adapter(model.folder, seed, **{**{k: False for k in ALL}, **targets})


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen3", "phi3", "qwen3_moe"])
@torch.no_grad()
def test_merged_adapter_through_the_script(models, kind, tmp_path):
    """--lora_path: merged in full precision (on llama3 and qwen3 the LoRA on the tied head unties it: an output
    tensor; on phi3 the LoRAs of fc_1 and fc_2 land in the two halves of one ffn_up; on qwen3_moe a pair per expert
    on every projection of the experts, and the router's, merged into ffn_*_exps and ffn_gate_inp)."""
    import runpy
    import sys

    model = models[kind]
    moe = dict(mlp=False, experts=True, router=True)
    adapter = make_adapter(model, **(ALL if not model.config.moe_n_expert else {**ALL, **moe}))
    adapter.save(tmp_path / "adapter.pth")
    idx = tokens(model.config, 2, seq_len(model), seed=1)  # phi3: transformers' reader drops its window
    ours = load_model_with_adapter(model.folder, adapter, precision="32-true")(idx)
    out = tmp_path / "out" / "model.gguf"
    argv = sys.argv
    sys.argv = [str(EXPORT), "--checkpoint_dir", str(model.folder), "--lora_path", str(tmp_path / "adapter.pth"),
                "--out_file", str(out), "--dtype", "f32"]
    try:
        runpy.run_path(str(EXPORT), run_name="__main__")
    finally:
        sys.argv = argv
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.gguf"]  # no temporary left behind
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # not the temporary file's private 0600
    assert "output.weight" in {t.name for t in gguf.GGUFReader(out).tensors}
    hf = hf_from_gguf(out)
    assert not hf.config.tie_word_embeddings
    apply_rope_freqs(hf, out)
    assert (hf(idx).logits - ours).abs().max().item() <= F32_TOLERANCE


def _reverse_permute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' undoing of llama.cpp's q/k row order (its GGUF reader's LlamaTensorProcessor)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    return torch.from_numpy(LlamaTensorProcessor()._reverse_permute_weights(rows.numpy(), heads, heads).copy())


@pytest.mark.parametrize("kind,targets", [("llama", ALL), ("llama3", dict(query=True, key=True, mlp=True)),
                                          ("qwen2", dict(query=True, key=True, value=True, projection=True)),
                                          ("qwen3", dict(query=True, key=True, value=True, mlp=True)),
                                          ("qwen3_moe", dict(query=True, key=True, value=True, projection=True,
                                                             head=True))],
                         ids=["llama-all", "llama3-qk-mlp", "qwen2-qkvo", "qwen3-qkv-mlp", "qwen3moe-qkvo-head"])
@torch.no_grad()
def test_lora_only(models, kind, targets, tmp_path):
    """--lora_only: llama.cpp's LoRA file. Its tensors (read back by the gguf package) give B @ A * alpha / r equal to
    our merged update once transformers undoes llama.cpp's q/k order, and the base GGUF plus those updates (added the
    way llama.cpp applies them) gives our adapted model's logits."""
    model, config = models[kind], models[kind].config
    adapter = make_adapter(model, seed=2, **targets)
    path = export(model, tmp_path / "lora", adapter=adapter, lora_only=True, dtype="f32")
    reader = gguf.GGUFReader(path)
    assert field(reader, "general.type") == "adapter" and field(reader, "adapter.type") == "lora"
    assert field(reader, "adapter.lora.alpha") == 8.0
    assert field(reader, "general.architecture") == ARCH.get(kind, kind)
    file = tensors_of(path)

    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[ARCH.get(kind, kind)]
    names = gguf.get_tensor_name_map(arch, config.n_layer)
    lora = adapter.config
    shapes = lit_param_shapes(config)
    hf_deltas = {}  # HF weight name -> our update, split like the HF tensors
    for hf_key, (key, *_), j in lit_to_hf_plan(config):  # one key of ours each (no fused gate_up here)
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and module + ".lora_A" in adapter.lora:
            delta = adapter.delta(module, tuple(shapes[key]))
            hf_deltas[hf_key] = delta.split(config.qkv_sizes)[j] if j is not None else delta
    hf_deltas = {k: v for k, v in hf_deltas.items() if v.abs().max() > 0}  # k/v rows without LoRA
    assert len(file) == 2 * len(hf_deltas)

    base_path = export(model, tmp_path / "base", dtype="f32")
    base = hf_from_gguf(base_path)
    apply_rope_freqs(base, base_path)
    params = dict(base.named_parameters())
    ne = {t.name: list(t.shape) for t in [*reader.tensors, *gguf.GGUFReader(base_path).tensors]}
    for hf_key, expected in hf_deltas.items():
        gguf_name = names.get_name(hf_key.removesuffix(".weight")) + ".weight"
        # the shape checks of llama.cpp's adapter loader, in ggml's order: a [in, r], b [r, out] for a base [in, out]
        a_ne, b_ne = ne[gguf_name + ".lora_a"], ne[gguf_name + ".lora_b"]
        assert a_ne[0] == ne[gguf_name][0] and b_ne[1] == ne[gguf_name][1] and a_ne[1] == b_ne[0] == lora.r
        a, b = file[gguf_name + ".lora_a"], file[gguf_name + ".lora_b"]
        delta = b @ a * (lora.alpha / lora.r)
        if arch == gguf.MODEL_ARCH.LLAMA and hf_key.endswith(("q_proj.weight", "k_proj.weight")):
            delta = _reverse_permute(delta, config.n_head if "q_proj" in hf_key else config.n_query_groups)
        torch.testing.assert_close(delta, expected, rtol=0, atol=1e-6)
        params[hf_key].add_(delta)
    idx = tokens(config, 2, seq_len(model), seed=3)
    ours = load_model_with_adapter(model.folder, adapter, precision="32-true")(idx)
    assert (base(idx).logits - ours).abs().max().item() <= F32_TOLERANCE


def test_lora_only_refusals(models, tmp_path):
    with pytest.raises(UserError, match="tied"):  # llama.cpp applies no LoRA to a head that is the embedding
        export(models["qwen2"], tmp_path, adapter=make_adapter(models["qwen2"], head=True, query=True), lora_only=True)
    with pytest.raises(UserError, match="needs --lora_path"):
        export(models["llama"], tmp_path, lora_only=True)
    with pytest.raises(UserError, match="q8_0 is for model files"):
        export(models["llama"], tmp_path, adapter=make_adapter(models["llama"], query=True), lora_only=True,
               dtype="q8_0")
    assert not any(tmp_path.iterdir())


# ---- bad input through the script --------------------------------------------------------------
def _gemma3_rope(full: dict, sliding_base: float) -> dict:
    return dict(rope_parameters={"full_attention": {"rope_theta": 1e6, **full},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": sliding_base}})


GEMMA3_PATTERN = dict(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                      query_pre_attn_scalar=32)
DEFAULT = {"rope_type": "default"}


@pytest.mark.parametrize("kind, overrides, message", [
    ("gemma2", dict(query_pre_attn_scalar=16), "has tie_embeddings=False, which the GGUF export of llama.cpp's "
                                               "'gemma2'"),
    ("gemma2", dict(tie_word_embeddings=True), "has attention_scale=0.2041"),  # query_pre_attn_scalar 24, head_dim 16
    ("gemma3", dict(query_pre_attn_scalar=32, **_gemma3_rope(DEFAULT, 1e4)),
     "has layer_types=.*'full_attention', 'sliding_attention'"),
    ("gemma3", dict(GEMMA3_PATTERN, **_gemma3_rope({"rope_type": "linear", "factor": 4.0}, 1e4)),
     "has rope_type='linear'"),
    ("gemma3", dict(GEMMA3_PATTERN, **_gemma3_rope(DEFAULT, 100.0)), "has rope_local_base=100.0"),
    # llama.cpp's qwen3moe has experts in every layer and renormalizes the top-k routing weights
    ("qwen3_moe", dict(mlp_only_layers=[1]), "has moe_dense_layers=.1., which the GGUF export of llama.cpp's "
                                             "'qwen3moe'"),
    ("qwen3_moe", dict(mlp_only_layers=[], norm_topk_prob=False), "has moe_norm_topk=False"),
])
def test_features_no_reader_checks_are_refused(kind, overrides, message, tmp_path):
    """What llama.cpp computes otherwise, or transformers' GGUF reader cannot take from the file: an untied Gemma 2 (no
    output tensor there), a query scale other than llama.cpp's, Gemma 3 layer kinds off its fixed 5:1 pattern, RoPE
    scaling or another sliding-layer base, a Qwen3-MoE with dense layers or without renormalized routing weights.
    Refused in one line, before anything is converted or written."""
    folder = tmp_path / f"tiny-{kind}"
    make_tiny_hf_model(kind, folder, **overrides)
    make_hf_bpe_tokenizer(folder, vocab_size=320)
    with pytest.raises(UserError, match=message):
        export_gguf(folder, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists() and not (folder / "lit_model.safetensors").exists()


def test_phi3_lora_only_is_refused(models, tmp_path):
    """llama.cpp's phi3 has one fused attn_qkv and ffn_up: a LoRA file for them is not written (merged export is)."""
    model = models["phi3"]
    adapter = make_adapter(model, seed=2, query=True, value=True, mlp=True)
    with pytest.raises(UserError, match="fused attn_qkv and ffn_up.*drop --lora_only"):
        export(model, tmp_path, adapter=adapter, lora_only=True)


def test_bad_input_one_line_and_nothing_written(models, tmp_path):
    gemma = tmp_path / "tiny-gemma"
    make_tiny_hf_model("gemma", gemma)
    make_hf_bpe_tokenizer(gemma, vocab_size=320)
    no_tok = tmp_path / "no-tokenizer"
    shutil.copytree(models["mistral"].folder, no_tok)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tok / name).unlink()
    out = tmp_path / "out"
    out.mkdir()
    (out / "taken.gguf").write_bytes(b"keep me")
    ok = models["mistral"].folder
    cases = [
        ([gemma, out / "a.gguf"], ["GGUF export supports Llama 2/3/3.x", "Mistral", "Qwen2", "not GemmaForCausalLM"]),
        ([ok, out / "a.gguf", "--dtype", "q4_k"], ["--dtype 'q4_k' is not supported", "f16, bf16, f32, q8_0"]),
        ([no_tok, out / "a.gguf"], ["no tokenizer found in", "copy the tokenizer files"]),
        ([ok, out / "taken.gguf"], ["taken.gguf exists", "--overwrite"]),
    ]
    for (ckpt, out_file, *extra), expect in cases:
        r = run_script(EXPORT, ["--checkpoint_dir", ckpt, "--out_file", out_file, *extra])
        assert_one_line_error(r, *expect)
        assert sorted(p.name for p in out.iterdir()) == ["taken.gguf"], expect  # nothing written, no temporaries
    assert (out / "taken.gguf").read_bytes() == b"keep me"
    export_gguf(ok, out / "taken.gguf", dtype="q8_0", overwrite=True)
    assert gguf.GGUFReader(out / "taken.gguf").get_field("general.architecture").contents() == "llama"
