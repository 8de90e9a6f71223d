"""Export to GGUF, the file format of llama.cpp (and of Ollama and LM Studio, which run on it).

Two kinds of file:
- a model: our checkpoint, with an adapter merged in full precision (`merge.merged_tensors`: base + update in fp32,
  never into 4-bit weights), in f32, f16, bf16 or q8_0, with the architecture and the tokenizer as metadata;
- a LoRA adapter alone, for llama.cpp's `--lora` on top of a model file exported without it.

Tensors get llama.cpp's names and the layout its converter (`convert_hf_to_gguf.py`) writes, so the file is the one
llama.cpp would have made from the Hugging Face export of the same weights. They are streamed one at a time: the
header is computed from shapes alone, then each tensor is read, converted and written. The `gguf` package
(llama.cpp's own Python writer) writes the format.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import gguf
import numpy as np
import sentencepiece
import torch

from lit_qlora.adapter import Adapter
from lit_qlora.checkpoint import LIT_CONFIG, as_tensor
from lit_qlora.config import Config
from lit_qlora.convert import ensure_converted
from lit_qlora.export.merge import merged_tensors
from lit_qlora.families import SPECS
from lit_qlora.model import llama3_scale_inv_freq, rope_inv_freq
from lit_qlora.quant.mxfp4 import BLOCK, BLOCKS_SUFFIX, SCALES_SUFFIX, Mxfp4Tensor, join_stacks
from lit_qlora.readers import read_json, read_side_json
from lit_qlora.tokenizer import Tokenizer
from lit_qlora.utils import UserError, atomic_write

Q = gguf.GGMLQuantizationType

# HF architecture -> llama.cpp architecture. Mistral is plain "llama" to llama.cpp (its converter maps
# MistralForCausalLM there too); TinyLlama and SmolLM2 are LlamaForCausalLM.
# llama.cpp architecture of each family whose spec names one (lit_qlora/families.py)
ARCHITECTURES = {a: s.gguf for a, s in SPECS.items() if s.gguf}
SUPPORTED = ("Llama 2/3/3.x, TinyLlama, SmolLM2 (LlamaForCausalLM), Mistral (MistralForCausalLM), "
             "Qwen2/2.5 (Qwen2ForCausalLM), Qwen3 (Qwen3ForCausalLM), Qwen3-MoE (Qwen3MoeForCausalLM), Mixtral "
             "(MixtralForCausalLM), gpt-oss (GptOssForCausalLM), Phi-3 / Phi-4 (Phi3ForCausalLM), Gemma 2 "
             "(Gemma2ForCausalLM) and Gemma 3 text (Gemma3ForCausalLM)")
# llama.cpp architectures whose q|k|v and gate|up are one tensor each (`attn_qkv`, `ffn_up`), as in the HF weights
_FUSED = ("phi3",)
# llama.cpp's Gemmas: norms stored as 1 + weight (its converter adds the 1), sliding windows in a fixed pattern
_GEMMA = ("gemma2", "gemma3")
# llama.cpp architectures that attend within the sliding window written to the file
_WINDOWED = ("phi3", "gpt-oss", *_GEMMA)
ANY = object()  # in `_arch_fields`: whatever the model has (it is written to the file)
# llama.cpp architectures with mixtures of experts (a router `ffn_gate_inp` and the experts stacked [E, out, in] per
# projection, `ffn_{gate,up,down}_exps`) -> what their MoE computes besides the counts and sizes written to the file:
# all renormalize the top-k routing weights, and have experts in every layer
_MOE = {"qwen3moe": dict(moe_norm_topk=True, moe_dense_layers=None),
        "llama": dict(moe_norm_topk=True, moe_dense_layers=None),  # Mixtral
        "gpt-oss": dict(moe_norm_topk=True, moe_dense_layers=None)}  # (its softmax over the top-k logits is the same)
_EXPERT_FFN_KEY = ("qwen3moe", "gpt-oss")  # those whose experts' width is its own key (expert_feed_forward_length)
# always write the head size (llama.cpp assumes n_embd / n_head otherwise; transformers' qwen3moe reader takes it too)
_KEY_LENGTH = ("gemma2", "gemma3", "qwen3moe", "gpt-oss")


def _arch_fields(arch: str, config: Config) -> dict:
    """What llama.cpp's `arch` computes differently from its llama baseline (Config field -> the value it needs)."""
    if arch in ("qwen3", "qwen3moe"):
        return dict(qk_norm="head")
    if arch == "gpt-oss":
        # llama.cpp's gpt-oss: biases on q, k, v, o, the router and the experts, a sink per head, layers alternating
        # sliding (first) and full (its fixed pattern), the clamped SwiGLU's limit and gain fixed at the published
        # models' 7 and 1.702 (constants in llama.cpp), RoPE plain or YaRN (rope.scaling.* keys)
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config.n_layer)]
        return dict(bias=True, attn_sinks=True, moe_bias=True, moe_swiglu_limit=7.0, moe_swiglu_alpha=1.702,
                    layer_types=types, rope_type=(None, "yarn"))
    if arch == "phi3":  # rope.dimension_count and longrope's factors and attention factor are written (`rope_tensors`)
        return dict(rope_n_elem=ANY, rope_type=(None, "longrope"))
    if arch not in _GEMMA:
        return {}
    period = 2 if arch == "gemma2" else 6  # llama.cpp's fixed pattern: every period-th layer attends to everything
    types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(config.n_layer)]
    # llama.cpp scales queries by 1/sqrt(head_dim), but by 1/sqrt(n_embd / n_head) for the 27B models (by layer count)
    big = config.n_layer == (46 if arch == "gemma2" else 62)
    fields = dict(norm_unit_offset=True, scale_embeddings=True, activation="gelu_tanh", post_norms=True,
                  attention_scale=float(config.n_embd // config.n_head if big else config.head_size) ** -0.5,
                  layer_types=types if config.sliding_window_size else None, attn_softcap=ANY, final_softcap=ANY)
    if arch == "gemma2":  # its GGUF has no output tensor (llama.cpp's gemma2 tensor list): the head is the embedding
        fields.update(tie_embeddings=True)
    if arch == "gemma3":  # and the sliding layers' RoPE base is llama.cpp's fixed 10000
        fields.update(qk_norm="head", rope_local_base=10000.0, attn_softcap=None, final_softcap=None)
    return fields

# --dtype -> (type of the 2-D weights, general.file_type). Norms, biases and rope factors always stay f32.
DTYPES: dict[str, tuple[Q, gguf.LlamaFileType]] = {
    "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "f32": (Q.F32, gguf.LlamaFileType.ALL_F32),
    "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}

# Our tensor names -> llama.cpp's. The fused qkv is split into attn_q / attn_k / attn_v by `gguf_parts` (but for the
# architectures of _FUSED).
_LAYER_NAMES = {"norm_1": "attn_norm", "attn.proj": "attn_output", "norm_2": "ffn_norm", "mlp.fc_1": "ffn_gate",
                "mlp.fc_2": "ffn_up", "mlp.proj": "ffn_down", "attn.q_norm": "attn_q_norm",
                "attn.k_norm": "attn_k_norm", "post_attention_norm": "post_attention_norm",
                "post_mlp_norm": "post_ffw_norm", "mlp.router": "ffn_gate_inp", "mlp.experts.fc_1": "ffn_gate_exps",
                "mlp.experts.fc_2": "ffn_up_exps", "mlp.experts.proj": "ffn_down_exps"}
_GLOBAL_NAMES = {"transformer.wte": "token_embd", "transformer.ln_f": "output_norm", "lm_head": "output"}

# Pre-tokenizer regexes of tokenizer.json files (a Split before a regex-free ByteLevel) -> llama.cpp's name for them
_SPLIT_REGEX_NAMES = {
    # Llama 3 / 3.x
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": "llama-bpe",
    # Qwen2 / 2.5: single digits instead of groups of three
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": "qwen2",
    # o200k (gpt-oss, Phi-4): words split before capitals, contractions kept on the word, digits in groups of three
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+": "gpt-4o",
}


# ---- the model's shape ------------------------------------------------------------------------
def gguf_architecture(config: Config) -> str:
    """llama.cpp's architecture name for `config`; a one-line refusal for anything the export cannot write exactly."""
    arch = ARCHITECTURES.get(config.hf_architecture)
    if arch is None:
        raise UserError(f"GGUF export supports {SUPPORTED}, not {config.hf_architecture}; export one of those, or use "
                        "scripts/export_hf.py and llama.cpp's convert_hf_to_gguf.py")
    expected = dict(norm_class="RMSNorm", mlp_class="LLaMAMLP", activation="silu", bias=False, lm_head_bias=False,
                    parallel_residual=False, scale_embeddings=False, norm_unit_offset=False,
                    rope_n_elem=config.head_size, qk_norm=None, pre_norms=True, post_norms=False, attn_softcap=None,
                    final_softcap=None, attention_scale=None, nope_layers=None, rope_local_base=None,
                    rope_type=None, moe_n_expert=ANY if arch in _MOE else 0, attn_sinks=False, moe_bias=False,
                    moe_swiglu_limit=None, moe_swiglu_alpha=None)
    if config.moe_n_expert and arch in _MOE:
        expected.update(_MOE[arch])
    expected.update(_arch_fields(arch, config))
    for key, want in expected.items():
        have = (config.rope_scaling or {}).get("rope_type") if key == "rope_type" else getattr(config, key)
        if want is ANY or (isinstance(want, tuple) and have in want):  # anything / one of these
            continue
        if have != want:
            raise UserError(f"this {config.hf_architecture} has {key}={have!r}, which the GGUF export of llama.cpp's "
                            f"{arch!r} architecture does not write ({want!r} needed); export it with "
                            "scripts/export_hf.py")
    scaling = config.rope_scaling or {}
    odd = [k for k in ("mscale", "mscale_all_dim") if scaling.get("rope_type") == "yarn" and scaling.get(k) is not None]
    if odd:  # llama.cpp's converter writes no YaRN mscale: its attention factor would be another
        raise UserError(f"this {config.hf_architecture} has a YaRN rope_scaling with {odd[0]}={scaling[odd[0]]!r}, "
                        f"which the GGUF export of llama.cpp's {arch!r} architecture does not write; export it with "
                        "scripts/export_hf.py")
    return arch


def gguf_parts(config: Config, arch: str, name: str) -> list[tuple[str, Optional[tuple[int, int]], Optional[int]]]:
    """Our tensor `name` -> [(llama.cpp name, (first row, rows) taken from ours or None for all,
    heads to permute for llama.cpp's rotary or None)]."""
    module, _, param = name.rpartition(".")
    if not module.startswith("transformer.h."):
        return [(f"{_GLOBAL_NAMES[module]}.{param}", None, None)]
    i, _, sub = module[len("transformer.h."):].partition(".")
    if param == "sinks":  # gpt-oss: one learned logit per head, a tensor of its own in llama.cpp
        return [(f"blk.{i}.attn_sinks.weight", None, None)]
    if arch == "gpt-oss" and sub == "norm_2":  # llama.cpp's gpt-oss names the norm before the MLP so
        return [(f"blk.{i}.post_attention_norm.{param}", None, None)]
    if arch in _FUSED and sub in ("attn.qkv", "mlp.fc_1", "mlp.fc_2"):  # fc_1 then fc_2 stack into one ffn_up
        return [(f"blk.{i}.{'attn_qkv' if sub == 'attn.qkv' else 'ffn_up'}.{param}", None, None)]
    if sub != "attn.qkv":
        return [(f"blk.{i}.{_LAYER_NAMES[sub]}.{param}", None, None)]
    q, k, v = config.qkv_sizes
    # llama.cpp's "llama" rope rotates adjacent pairs of a head's channels, HF's rotates channel j with j + head/2:
    # llama.cpp's converter reorders q and k rows (weights and biases) to match. "qwen2" uses the HF (NeoX)
    # convention in llama.cpp, so nothing moves there.
    rotary = arch == "llama"
    return [(f"blk.{i}.attn_q.{param}", (0, q), config.n_head if rotary else None),
            (f"blk.{i}.attn_k.{param}", (q, k), config.n_query_groups if rotary else None),
            (f"blk.{i}.attn_v.{param}", (q + k, v), None)]


def rotate_half_to_interleaved(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the q or k rows of every head from HF's rotate-half order (channel j pairs with j + head/2) to
    llama.cpp's interleaved order (channel 2j pairs with 2j + 1): row j of a head goes to 2j, row j + head/2 to 2j + 1.
    Works for weights [rows, in], biases [rows] and LoRA B matrices [rows, r]."""
    head = rows.shape[0] // n_heads
    return rows.reshape(n_heads, 2, head // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def split_gguf(config: Config, arch: str, name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Our tensor -> the llama.cpp tensors it becomes, in llama.cpp's layout."""
    gemma_norm = arch in _GEMMA and name.rpartition(".")[0].endswith(("norm_1", "norm_2", "_norm", "ln_f"))
    for gguf_name, rows, heads in gguf_parts(config, arch, name):
        part = t[rows[0]:rows[0] + rows[1]] if rows else t
        if gemma_norm:  # ours scales by 1 + weight, llama.cpp's Gemma by its stored weight
            part = part.float() + 1
        yield gguf_name, rotate_half_to_interleaved(part, heads) if heads else part


def rope_tensors(config: Config) -> list[tuple[str, torch.Tensor]]:
    """RoPE scaling as llama.cpp stores it: Llama 3.1's one divisor per rotary frequency (`rope_freqs`), longrope's
    short and long factors (`rope_factors_short` / `rope_factors_long`, as its phi3 converter writes them)."""
    s = config.rope_scaling or {}
    if s.get("rope_type") == "longrope":
        return [(f"rope_factors_{kind}.weight", torch.tensor(s[f"{kind}_factor"], dtype=torch.float32))
                for kind in ("long", "short")]
    factors = rope_factors(config)
    return [] if factors is None else [("rope_freqs.weight", factors)]


def rope_factors(config: Config) -> Optional[torch.Tensor]:
    """Llama 3.1 rope scaling as llama.cpp stores it: one divisor per rotary frequency (`rope_freqs.weight`)."""
    if not config.rope_scaling or config.rope_scaling.get("rope_type", "llama3") != "llama3":
        return None
    n = config.rope_n_elem
    inv_freq = 1.0 / (config.rope_base ** (torch.arange(0, n, 2, dtype=torch.float32) / n))
    return inv_freq / llama3_scale_inv_freq(inv_freq, config.rope_scaling)


def tensor_type(shape: tuple[int, ...], dtype: str, name: str = "") -> Q:
    # norms, biases, rope factors: small, and llama.cpp keeps them in f32 too; so is a mixture's router (its
    # converter and quantizer never round ffn_gate_inp: a small error there sends tokens to other experts)
    if len(shape) == 1 or ".ffn_gate_inp." in name:
        return Q.F32
    qtype = DTYPES[dtype][0]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block:  # a q8_0 block is 32 values of one row; llama.cpp's converter falls back to f16 too
        return Q.F16
    return qtype


def mxfp4_to_ggml(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 as gpt-oss's checkpoints (and ours) store it -> ggml's MXFP4 blocks, the same values bit for bit.

    Ours: blocks [..., G, 16] (value 2i in byte i's low nibble, value 2i + 1 in its high nibble) beside scales [..., G].
    ggml's: [..., G, 17], each block its E8M0 scale byte then 16 bytes, value j in byte j's low nibble and value j + 16
    in its high nibble. The E2M1 codes and the scale bytes are the same numbers in both."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32]: the values' codes in order
    return torch.cat((scales.unsqueeze(-1), codes[..., :16] | (codes[..., 16:] << 4)), dim=-1)


def _encode(t: torch.Tensor, qtype: Q) -> np.ndarray:
    """The bytes of `t` in ggml type `qtype`, as a uint8 array of the byte shape (an MXFP4 `t` is its bytes already,
    `mxfp4_to_ggml`)."""
    if qtype == Q.MXFP4:
        return t.contiguous().numpy().reshape(*t.shape[:-2], -1)
    if qtype == Q.Q8_0:
        x = t.detach().float().cpu()
        out = np.empty(gguf.quant_shape_to_byte_shape(tuple(x.shape), qtype), dtype=np.uint8)
        rows, out_rows = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
        step = max(1, 2**24 // x.shape[-1])  # 16M values at a time keep the quantizer's temporaries small
        for i in range(0, rows.shape[0], step):
            out_rows[i:i + step] = gguf.quants.quantize(rows[i:i + step].numpy(), qtype)
        return out
    torch_dtype = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}[qtype]
    return t.detach().to(device="cpu", dtype=torch_dtype).contiguous().view(torch.uint8).numpy()


# ---- the tokenizer ----------------------------------------------------------------------------
@dataclass
class GGUFVocab:
    """What llama.cpp needs to rebuild the tokenizer (the tokenizer.* metadata)."""

    model: str  # "llama" (sentencepiece) or "gpt2" (byte-level BPE)
    tokens: list[str]
    types: list[int]
    scores: Optional[list[float]] = None
    merges: Optional[list[str]] = None
    pre: Optional[str] = None
    add_space_prefix: Optional[bool] = None
    special: dict[str, Optional[int]] = field(default_factory=dict)  # bos / eos / unk / pad -> id
    add_bos: bool = False
    add_eos: bool = False
    chat_template: Optional[str] = None
    notes: list[str] = field(default_factory=list)

    def write(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model(self.model)
        if self.pre is not None:
            w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        w.add_token_types(self.types)
        if self.scores is not None:
            w.add_token_scores(self.scores)
        if self.merges:
            w.add_token_merges(self.merges)
        if self.add_space_prefix is not None:
            w.add_add_space_prefix(self.add_space_prefix)
        adders = dict(bos=w.add_bos_token_id, eos=w.add_eos_token_id, unk=w.add_unk_token_id, pad=w.add_pad_token_id)
        for kind, token_id in self.special.items():
            if token_id is not None:
                adders[kind](token_id)
        w.add_add_bos_token(self.add_bos)
        w.add_add_eos_token(self.add_eos)
        if self.chat_template:
            w.add_chat_template(self.chat_template)


def read_vocab(checkpoint_dir: Path, vocab_size: int) -> GGUFVocab:
    """The tokenizer of `checkpoint_dir` as GGUF metadata, padded to the model's `vocab_size` rows."""
    checkpoint_dir = Path(checkpoint_dir)
    tok = Tokenizer(checkpoint_dir)  # a one-line UserError when there is no tokenizer
    tok_json = checkpoint_dir / "tokenizer.json"
    data = read_json(tok_json, dict, "tokenizer file") if tok_json.is_file() else None  # checked by Tokenizer too
    if data is not None and _is_byte_level(data):
        vocab = _bpe_vocab(data, tok_json, tok)
    elif (checkpoint_dir / "tokenizer.model").is_file():
        # llama.cpp's sentencepiece tokenizer needs the pieces' scores, which only tokenizer.model has
        vocab = _sentencepiece_vocab(checkpoint_dir / "tokenizer.model", checkpoint_dir)
    else:
        kind = (data or {}).get("model", {}).get("type", "?")
        raise UserError(f"{tok_json} is a {kind} tokenizer that is not byte-level BPE, and there is no "
                        f"tokenizer.model; copy the model's sentencepiece tokenizer.model into {checkpoint_dir}")
    if len(vocab.tokens) > vocab_size:
        raise UserError(f"the tokenizer in {checkpoint_dir} has {len(vocab.tokens)} tokens, more than the model's "
                        f"{vocab_size} embedding rows; use the tokenizer the model was trained with")
    for i in range(len(vocab.tokens), vocab_size):  # rows no token uses (padded vocabularies): as llama.cpp pads
        vocab.tokens.append(f"[PAD{i}]")
        vocab.types.append(gguf.TokenType.UNUSED)
        if vocab.scores is not None:
            vocab.scores.append(-1000.0)

    tok_config = _read_json(checkpoint_dir / "tokenizer_config.json")
    model_config = _read_json(checkpoint_dir / "config.json")

    def config_id(key: str) -> Optional[int]:
        value = tok_config.get(f"{key}_token")
        token = value.get("content") if isinstance(value, dict) else value
        token_id = tok.token_to_id(token) if isinstance(token, str) else None
        fallback = model_config.get(f"{key}_token_id")
        return token_id if token_id is not None else fallback if isinstance(fallback, int) else None

    # our Tokenizer decides bos/eos and whether encode() adds them: the GGUF says the same
    own = {kind: vocab.special.get(kind) for kind in ("unk", "pad")}  # what the tokenizer file itself says
    vocab.special = dict(bos=tok.bos_id, eos=tok.eos_id,
                         **{kind: config_id(kind) if i is None else i for kind, i in own.items()})
    vocab.add_bos, vocab.add_eos = tok.add_bos, tok.add_eos
    vocab.chat_template = tok.chat_template
    return vocab


def _read_json(path: Path) -> dict:
    return read_side_json(path, {})  # {} without it; a damaged one is a one-line UserError naming it


def _pre_tokenizers(data: dict) -> list[dict]:
    pre = data.get("pre_tokenizer") or {}
    return list(pre.get("pretokenizers", [])) if pre.get("type") == "Sequence" else [pre] if pre else []


def _is_byte_level(data: dict) -> bool:
    byte_level = any(p.get("type") == "ByteLevel" for p in _pre_tokenizers(data))
    return (data.get("model") or {}).get("type") == "BPE" and byte_level


def _pre_name(data: dict, path: Path) -> str:
    """llama.cpp's name for the way a byte-level BPE tokenizer.json splits text before merging.

    llama.cpp's converter recognises a tokenizer by hashing how it encodes a test text; we read the pre-tokenizer
    from tokenizer.json instead (same answer, and no transformers needed), and refuse what we cannot name, as it does.
    """
    parts = _pre_tokenizers(data)
    kinds = [p.get("type") for p in parts]
    byte_level = parts[-1] if kinds and kinds[-1] == "ByteLevel" else {}
    name = None
    if not byte_level.get("add_prefix_space", False):
        if kinds == ["ByteLevel"] and byte_level.get("use_regex", True):
            name = "gpt-2"  # GPT-2's own regex, inside ByteLevel
        elif kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
            name = "smollm" if byte_level.get("use_regex", True) else None  # every digit alone, then GPT-2's regex
        elif kinds == ["Split", "ByteLevel"] and not byte_level.get("use_regex", True) and not parts[0].get("invert"):
            name = _SPLIT_REGEX_NAMES.get((parts[0].get("pattern") or {}).get("Regex"))
    if name is None:
        raise UserError(f"the pre-tokenizer of {path} ({' + '.join(map(str, kinds)) or 'none'}) is not one llama.cpp "
                        "knows by name (GPT-2, Llama 3, Qwen2, SmolLM2, GPT-4o); export with scripts/export_hf.py and "
                        "convert with llama.cpp's convert_hf_to_gguf.py")
    return name


def _bpe_vocab(data: dict, path: Path, tok: Tokenizer) -> GGUFVocab:
    model = data["model"]
    by_id = {int(i): token for token, i in model["vocab"].items()}
    # the added tokens as the loaded tokenizer has them: tokenizer.json's list and the special tokens
    # tokenizer_config.json names (Tokenizer adds those as transformers does, and llama.cpp's converter reads them)
    added = {i: {"content": t.content, "special": t.special}
             for i, t in tok.processor.get_added_tokens_decoder().items()}
    by_id.update({i: t["content"] for i, t in added.items()})
    n = max(by_id) + 1 if by_id else 0
    tokens, types = [], []
    for i in range(n):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL if i not in added else
                         gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
    # tokenizers writes merges as "a b" (older files) or ["a", "b"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    vocab = GGUFVocab(model="gpt2", tokens=tokens, types=types, merges=merges, pre=_pre_name(data, path))
    unk = model.get("unk_token")
    vocab.special["unk"] = model["vocab"].get(unk) if unk else None
    if data.get("normalizer"):
        vocab.notes.append(f"{path.name} normalizes text ({data['normalizer'].get('type')}) before tokenizing and "
                           "llama.cpp does not: text not already in that form may get other ids there")
    return vocab


def _sentencepiece_vocab(path: Path, checkpoint_dir: Path) -> GGUFVocab:
    sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        types.append(gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i)
                     else gguf.TokenType.UNUSED if sp.is_unused(i) else gguf.TokenType.BYTE if sp.is_byte(i)
                     else gguf.TokenType.NORMAL)
    # tokens added on top of the sentencepiece model (chat markers): they follow its pieces
    decoder = _read_json(checkpoint_dir / "tokenizer_config.json").get("added_tokens_decoder") or {}
    extra = {int(i): t for i, t in decoder.items() if int(i) >= len(tokens)}
    for i in range(len(tokens), max(extra, default=len(tokens) - 1) + 1):
        t = extra.get(i)
        tokens.append(t["content"] if t else f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED if t is None else
                     gguf.TokenType.CONTROL if t.get("special") else gguf.TokenType.USER_DEFINED)
    # llama.cpp prepends the "▁" of a dummy prefix itself when add_space_prefix is set: probe the model for it
    first = sp.encode("a", out_type=str)
    vocab = GGUFVocab(model="llama", tokens=tokens, types=types, scores=scores,
                      add_space_prefix=bool(first) and first[0].startswith("\u2581"))
    vocab.special["unk"] = sp.unk_id() if sp.unk_id() >= 0 else None
    vocab.special["pad"] = sp.pad_id() if sp.pad_id() >= 0 else None
    return vocab


# ---- writing ----------------------------------------------------------------------------------
Plan = list[tuple[str, tuple[int, ...], Q]]


def _write(path: Path, arch: str, metadata: Callable[[gguf.GGUFWriter], None], plan: Plan,
           tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Write a GGUF file atomically: header and tensor table from `plan`, then the tensors as `tensors` yields them."""

    def write(tmp: Path) -> None:
        w = gguf.GGUFWriter(tmp, arch)
        try:
            metadata(w)
            for name, shape, qtype in plan:
                byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
                w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for (name, shape, qtype), (got, t) in zip(plan, tensors, strict=True):
                got_shape = (*t.shape[:-2], t.shape[-2] * 32) if qtype == Q.MXFP4 else tuple(t.shape)
                if got != name or got_shape != shape:
                    raise RuntimeError(f"tensor stream mismatch at {name} {shape}: got {got} {got_shape}")
                w.write_tensor_data(_encode(t, qtype))
        finally:
            w.close()

    atomic_write(path, write)


def _shape_metadata(w: gguf.GGUFWriter, config: Config, arch: str, name: str, file_type: int) -> None:
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(config.vocab_size)
    w.add_context_length(config.block_size)
    w.add_embedding_length(config.n_embd)
    w.add_block_count(config.n_layer)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.n_head)
    w.add_head_count_kv(config.n_query_groups)
    w.add_rope_dimension_count(config.rope_n_elem)
    w.add_rope_freq_base(config.rope_base)
    w.add_layer_norm_rms_eps(config.norm_eps)
    if config.head_size * config.n_head != config.n_embd or arch in _KEY_LENGTH:  # else llama.cpp takes n_embd / n_head
        w.add_key_length(config.head_size)
        w.add_value_length(config.head_size)
    if config.moe_n_expert:
        w.add_expert_count(config.moe_n_expert)
        w.add_expert_used_count(config.moe_top_k)
        if arch in _EXPERT_FFN_KEY:  # (else feed_forward_length is the experts' width, as in Mixtral's config)
            w.add_expert_feed_forward_length(config.moe_intermediate_size)


def write_model(checkpoint_dir: Path, config: Config, out_file: Path, dtype: str, adapter: Optional[Adapter],
                vocab: GGUFVocab) -> None:
    arch = gguf_architecture(config)
    specs, stream = merged_tensors(checkpoint_dir, adapter, config)
    extra = rope_tensors(config)
    plan: Plan = [(name, tuple(t.shape), Q.F32) for name, t in extra]
    pieces: dict[str, int] = {}  # llama.cpp tensor -> how many of ours stack into it (2 for Phi-3's ffn_up)
    for name, shape, _ in specs:
        if name.endswith(SCALES_SUFFIX):  # (planned with its blocks)
            continue
        if name.endswith(BLOCKS_SUFFIX):  # experts stored in MXFP4 (gpt-oss as published) stay MXFP4, bit for bit
            stack = name.removesuffix(BLOCKS_SUFFIX) + ".weight"
            [(gguf_name, _, _)] = gguf_parts(config, arch, stack)
            plan.append((gguf_name, (*shape[:2], shape[2] * BLOCK), Q.MXFP4))
            pieces[gguf_name] = 1
            continue
        for gguf_name, rows, _ in gguf_parts(config, arch, name):
            gguf_shape = (rows[1], *shape[1:]) if rows else tuple(shape)
            if gguf_name in pieces:  # the next rows of a tensor already planned
                j = next(j for j, (n, _, _) in enumerate(plan) if n == gguf_name)
                gguf_shape = (plan[j][1][0] + gguf_shape[0], *gguf_shape[1:])
                plan[j] = (gguf_name, gguf_shape, tensor_type(gguf_shape, dtype, gguf_name))
            else:
                plan.append((gguf_name, gguf_shape, tensor_type(gguf_shape, dtype, gguf_name)))
            pieces[gguf_name] = pieces.get(gguf_name, 0) + 1

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        yield from extra
        held: dict[str, list[torch.Tensor]] = {}
        for name, t in join_stacks(stream):
            if isinstance(t, Mxfp4Tensor):
                [(gguf_name, _, _)] = gguf_parts(config, arch, name)
                yield gguf_name, mxfp4_to_ggml(as_tensor(t.blocks), as_tensor(t.scales))
                continue
            for gguf_name, part in split_gguf(config, arch, name, t):
                held.setdefault(gguf_name, []).append(part)
                if len(held[gguf_name]) == pieces[gguf_name]:
                    parts = held.pop(gguf_name)
                    yield gguf_name, torch.cat(parts) if len(parts) > 1 else parts[0]

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_type(gguf.GGUFType.MODEL)
        _shape_metadata(w, config, arch, config.name or Path(checkpoint_dir).name, DTYPES[dtype][1])
        if arch in _WINDOWED and config.sliding_window_size:  # llama.cpp attends within it, as transformers does
            w.add_sliding_window(config.sliding_window_size)
        if (config.rope_scaling or {}).get("rope_type") == "longrope":  # what llama.cpp's phi3 reads beside the factors
            _, attention_factor = rope_inv_freq(config.rope_n_elem, config.rope_base, config.rope_scaling,
                                                torch.device("cpu"))
            w.add_rope_scaling_attn_factors(attention_factor)
            w.add_rope_scaling_orig_ctx_len(config.rope_scaling["original_max_position_embeddings"])
        if (config.rope_scaling or {}).get("rope_type") == "yarn":  # the keys llama.cpp's converter writes for YaRN
            s = config.rope_scaling
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(s["factor"])
            w.add_rope_scaling_orig_ctx_len(s["original_max_position_embeddings"])
            if s.get("attention_factor") is not None:
                w.add_rope_scaling_yarn_attn_factor(s["attention_factor"])
            if s.get("beta_fast") is not None:
                w.add_rope_scaling_yarn_beta_fast(s["beta_fast"])
            if s.get("beta_slow") is not None:
                w.add_rope_scaling_yarn_beta_slow(s["beta_slow"])
        if config.attn_softcap is not None:
            w.add_attn_logit_softcapping(config.attn_softcap)
        if config.final_softcap is not None:
            w.add_final_logit_softcapping(config.final_softcap)
        vocab.write(w)

    _write(out_file, arch, metadata, plan, tensors())


def write_lora(config: Config, out_file: Path, dtype: str, adapter: Adapter) -> None:
    """The adapter as llama.cpp's LoRA file: per adapted weight `<name>.lora_a` [r, in] and `<name>.lora_b` [out, r],
    applied as W + alpha / r * B @ A (our scaling)."""
    arch = gguf_architecture(config)
    if arch in _FUSED:
        raise UserError(f"a LoRA file for llama.cpp's {arch!r} architecture (one fused attn_qkv and ffn_up per layer) "
                        "is not written; export the merged model instead (drop --lora_only)")
    lora = adapter.config
    if lora.experts:  # (a router's LoRA is one 2-D pair, on ffn_gate_inp, which llama.cpp's MoE applies)
        raise UserError("a LoRA on a mixture's experts (one pair per expert) is not written as llama.cpp's LoRA file; "
                        "export the merged model instead (drop --lora_only)")
    q, k, _ = config.qkv_sizes
    pairs: list[tuple[str, torch.Tensor]] = []
    for module, parts in adapter.targets().items():
        if module == "lm_head" and config.tie_embeddings:
            raise UserError("the adapter trains the head of a model whose head is its embedding (tied), and llama.cpp "
                            "applies no LoRA to a tied head; export the merged model instead (drop --lora_only)")
        try:
            A, B = adapter.lora[module + ".lora_A"].float(), adapter.lora[module + ".lora_B"].float()
        except KeyError as e:
            raise UserError(f"the adapter has no tensor {e.args[0]}; it is incomplete: use another checkpoint "
                            "of it") from None
        gguf_names = {rows[0] if rows else 0: (name, heads)
                      for name, rows, heads in gguf_parts(config, arch, module + ".weight")}
        b_row = 0
        # our fused qkv stacks the A of each adapted part and the B rows of each: one llama.cpp pair per part
        for i, (start, n) in enumerate(parts or [(0, B.shape[0])]):
            name, heads = gguf_names[start]
            a, b = A[i * lora.r:(i + 1) * lora.r], B[b_row:b_row + n]
            b_row += n
            # B @ A has B's rows: the q/k row order llama.cpp expects is B's
            pairs += [(name + ".lora_a", a), (name + ".lora_b", rotate_half_to_interleaved(b, heads) if heads else b)]
    plan: Plan = [(name, tuple(t.shape), tensor_type(tuple(t.shape), dtype)) for name, t in pairs]

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(lora.alpha))
        w.add_name(config.name or "adapter")
        w.add_file_type(DTYPES[dtype][1])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    _write(out_file, arch, metadata, plan, iter(pairs))


def export_gguf(checkpoint_dir: Path, out_file: Path, adapter: Optional[Adapter | Path] = None, dtype: str = "f16",
                lora_only: bool = False, overwrite: bool = False) -> Path:
    """Our checkpoint (merged with `adapter` if given) -> one GGUF model file; with `lora_only`, the adapter alone
    as a GGUF LoRA file. Every check runs before `out_file` is touched (an HF folder is converted on first use, as
    everywhere)."""
    checkpoint_dir, out_file = Path(checkpoint_dir), Path(out_file)
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if lora_only and adapter is None:
        raise UserError("--lora_only writes an adapter file and needs --lora_path; pass the adapter, or drop "
                        "--lora_only to export the model")
    if lora_only and dtype == "q8_0":
        raise UserError("--dtype q8_0 is for model files; write the adapter (it is small) with --dtype f16, bf16 "
                        "or f32")
    if out_file.is_dir():
        raise UserError(f"--out_file {out_file} is a folder; pass a file name such as {out_file / 'model.gguf'}")
    if out_file.exists() and not overwrite:
        raise UserError(f"{out_file} exists; pass --overwrite to replace it, or another --out_file")
    if (checkpoint_dir / "config.json").is_file() and not (checkpoint_dir / LIT_CONFIG).is_file():
        gguf_architecture(Config.from_hf_config(checkpoint_dir / "config.json"))  # refuse before converting
    config = ensure_converted(checkpoint_dir)
    gguf_architecture(config)
    if adapter is not None and not isinstance(adapter, Adapter):
        adapter = Adapter.load(Path(adapter), config)
    if lora_only:
        write_lora(config, out_file, dtype, adapter)
        return out_file
    vocab = read_vocab(checkpoint_dir, config.vocab_size)
    notes = list(vocab.notes)
    if config.sliding_window_size and config.sliding_window_size < config.block_size and \
            gguf_architecture(config) not in _WINDOWED:
        notes.append(f"llama.cpp's {gguf_architecture(config)!r} architecture has no sliding-window attention: the "
                     f"GGUF model attends to the whole context (the same as this one up to "
                     f"{config.sliding_window_size} tokens)")
    if (config.rope_scaling or {}).get("rope_type") == "yarn" and config.rope_scaling.get("truncate") is False:
        notes.append("this model's YaRN keeps its correction range unrounded (truncate=false, as gpt-oss publishes "
                     "it) and llama.cpp rounds it to whole dimensions (ggml_rope_yarn_corr_dims): the rotary "
                     "frequencies of the few dimensions at its edges differ slightly there")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    write_model(checkpoint_dir, config, out_file, dtype, adapter, vocab)
    return out_file
