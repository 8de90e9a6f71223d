"""One `Config` dataclass describes every supported model; named entries cover the common sizes.

`Config.from_hf_config(config.json)` maps a Hugging Face config of a supported architecture onto it,
so any local HF folder works without a named entry.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, Optional

from lit_qlora.families import SPECS, architecture_of, spec
from lit_qlora.utils import UserError


@dataclass
class Config:
    name: str = ""
    hf_architecture: str = "LlamaForCausalLM"  # what `convert_lit_checkpoint.py` writes back
    block_size: int = 4096  # longest sequence the model was trained for
    vocab_size: int = 32000  # rows of the embedding / lm_head
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    n_query_groups: Optional[int] = None  # key/value heads: == n_head (MHA), 1 (MQA) or between (GQA)
    head_size: Optional[int] = None  # defaults to n_embd // n_head (Gemma differs)
    rotary_percentage: float = 1.0  # share of each head that RoPE rotates (partial rotary)
    rope_base: float = 10000.0
    # RoPE scaling of the (full-attention) layers. Without "rope_type": Llama 3.1's (factor, low/high_freq_factor,
    # original_max_position_embeddings); else "linear", "yarn" or "longrope" with transformers' parameters
    rope_scaling: Optional[dict] = None
    parallel_residual: bool = False  # x + attn(norm(x)) + mlp(norm(x)) instead of sequential blocks
    shared_attention_norm: bool = False  # parallel blocks that feed attn and mlp from one norm
    norm_class: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    norm_eps: float = 1e-5
    norm_unit_offset: bool = False  # Gemma's RMSNorm scales by (1 + weight)
    bias: bool = False  # biases on every linear layer
    attn_bias: bool = False  # biases on q, k, v only (Qwen2, StableLM 2)
    lm_head_bias: bool = False
    mlp_class: Literal["GptNeoxMLP", "LLaMAMLP"] = "LLaMAMLP"
    activation: Literal["silu", "gelu", "gelu_tanh"] = "silu"
    intermediate_size: Optional[int] = None
    tie_embeddings: bool = False
    scale_embeddings: bool = False  # Gemma multiplies embeddings by sqrt(n_embd)
    sliding_window_size: Optional[int] = None
    # Per-layer attention kinds, "sliding_attention" or "full_attention" (Gemma 2/3, Qwen, SmolLM3): only the
    # sliding layers use `sliding_window_size`. None: every layer does (Mistral), or none when it is None
    layer_types: Optional[list] = None
    rope_local_base: Optional[float] = None  # RoPE base of the sliding layers, unscaled (Gemma 3); None: rope_base
    nope_layers: Optional[list] = None  # layers without RoPE (SmolLM3)
    qk_norm: Optional[Literal["head", "full"]] = None  # RMSNorm on q and k before RoPE: per head (Qwen3, Gemma 3)
    # or over the whole projection (OLMo 2)
    pre_norms: bool = True  # norm_1 / norm_2 before attention and MLP (OLMo 2 has none)
    post_norms: bool = False  # a norm on the attention and MLP outputs before each residual add (Gemma 2/3, OLMo 2)
    norm_fp32_scale: bool = False  # RMSNorm multiplies by its weight in fp32, then casts (OLMo 2; Gemma always)
    attention_scale: Optional[float] = None  # softmax scale; None: 1/sqrt(head_size) (Gemma 2/3: query_pre_attn)
    attn_softcap: Optional[float] = None  # attention logits -> cap * tanh(logits / cap) (Gemma 2)
    final_softcap: Optional[float] = None  # output logits -> cap * tanh(logits / cap) (Gemma 2)
    # Mixture of experts (Qwen3-MoE, Mixtral): the MLP of a layer is `moe_n_expert` gated MLPs of
    # `moe_intermediate_size` and a router; each token runs through the `moe_top_k` experts its router scores highest
    moe_n_expert: int = 0  # 0: no mixture of experts
    moe_top_k: int = 0
    moe_intermediate_size: Optional[int] = None  # None: intermediate_size
    moe_norm_topk: bool = False  # the top-k routing weights renormalized to sum to 1 (Mixtral; norm_topk_prob)
    moe_dense_layers: Optional[list] = None  # layers with a dense MLP of intermediate_size (Qwen3-MoE mlp_only_layers)
    moe_bias: bool = False  # biases on the router and on every expert's projections (gpt-oss)
    # gpt-oss's clamped SwiGLU in the experts: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
    # g = min(gate, limit), instead of silu(gate) * up. None: the plain gated MLP
    moe_swiglu_limit: Optional[float] = None
    moe_swiglu_alpha: Optional[float] = None
    # The checkpoint file stores each expert stack as MXFP4 (`{stack}.weight_blocks` / `.weight_scales`, gpt-oss's
    # published weights) instead of a dense `{stack}.weight`; the loader dequantizes it expert by expert
    moe_mxfp4: bool = False
    attn_sinks: bool = False  # a learned logit per head in every attention softmax, whose value is zero (gpt-oss)
    hf_extra: dict = field(default_factory=dict)  # HF-only details kept for an exact export

    def __post_init__(self) -> None:
        from lit_qlora.readers import check_config_values

        check_config_values(self)  # sizes, divisibility, names: before anything is derived from them
        if self.n_query_groups is None:
            self.n_query_groups = self.n_head
        if self.head_size is None:
            self.head_size = self.n_embd // self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.n_embd
        if self.n_head % self.n_query_groups:
            raise UserError(f"n_head={self.n_head} is not a multiple of n_query_groups={self.n_query_groups}; fix the "
                            "model config")
        if self.moe_n_expert:
            if self.moe_intermediate_size is None:
                self.moe_intermediate_size = self.intermediate_size
            if not 0 < self.moe_top_k <= self.moe_n_expert or self.mlp_class != "LLaMAMLP":
                raise UserError(f"moe_top_k={self.moe_top_k} of moe_n_expert={self.moe_n_expert} experts (gated "
                                "LLaMAMLP experts) is not a mixture of experts this model has; fix the model config")
        if (self.moe_swiglu_limit is None) != (self.moe_swiglu_alpha is None):
            raise UserError("moe_swiglu_limit and moe_swiglu_alpha go together (gpt-oss's clamped SwiGLU): give both "
                            "or neither; fix the model config")

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts."""
        return self.moe_n_expert > 0 and i not in (self.moe_dense_layers or ())

    def layer_window(self, i: int) -> Optional[int]:
        """The sliding window of layer i, or None for full attention."""
        if self.layer_types is not None and self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window_size

    def layer_rope(self, i: int) -> Optional[bool]:
        """Which RoPE layer i uses: False the model's, True the sliding layers' own (Gemma 3: another base, no
        scaling), None none (a NoPE layer, SmolLM3)."""
        if self.nope_layers and i in self.nope_layers:
            return None
        return self.rope_local_base is not None and self.layer_window(i) is not None

    @property
    def rope_n_elem(self) -> int:
        return int(self.rotary_percentage * self.head_size)

    @property
    def qkv_sizes(self) -> tuple[int, int, int]:
        """Output rows of q, k and v inside the fused qkv projection."""
        kv = self.n_query_groups * self.head_size
        return self.n_head * self.head_size, kv, kv

    # ---- named configs and files -------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "Config":
        if name not in NAME_TO_CONFIG:
            close = [n for n in NAME_TO_CONFIG if name.lower() in n.lower()][:8]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UserError(f"unknown model name {name!r}{hint}; pass one of `lit_qlora.config.NAMES` or a checkpoint "
                            "folder with config.json")
        return replace(cls(**NAME_TO_CONFIG[name]), **overrides)

    @classmethod
    def from_file(cls, path: Path) -> "Config":
        from lit_qlora.readers import check_config_dict, read_json  # every file goes through readers

        fix = "it is damaged: convert the checkpoint again"
        data = check_config_dict(read_json(path, dict, fix=fix), path, fix)  # every field there: no silent defaults
        try:
            return cls.from_dict(data)
        except UserError as e:
            raise UserError(f"{path} is damaged: {e}") from None

    @classmethod
    def from_dict(cls, data: dict) -> "Config":
        """Our config from its `to_dict()` form (unknown keys, e.g. from a newer version, are ignored)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf_config(cls, path: Path | dict) -> "Config":
        """Map a transformers `config.json` (path or dict) to our Config."""
        from lit_qlora.readers import read_hf_config

        hf = read_hf_config(path)  # a UserError naming the file and field for anything unreadable or of a wrong type
        arch = architecture_of(hf)
        try:
            kw = spec(arch).from_hf(hf, arch)
        except UserError as e:
            where = path if not isinstance(path, dict) else "config.json"
            raise UserError(f"{where}: {e}") from None
        kw.setdefault("name", hf.get("_name_or_path", "") or arch)
        kw["hf_architecture"] = arch
        return cls(**kw)


SUPPORTED_ARCHITECTURES = tuple(sorted(SPECS))


# ---- named configs ---------------------------------------------------------------------------
def _llama(name: str, **kw: Any) -> dict:
    return dict(name=name, hf_architecture="LlamaForCausalLM", norm_eps=1e-5, **kw)


_llama3_scaling = lambda factor: dict(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,  # noqa: E731
                                      original_max_position_embeddings=8192)

configs: list[dict] = []
for chat in ("", "-chat"):
    configs += [
        _llama(f"Llama-2-7b{chat}-hf", n_layer=32, n_head=32, n_embd=4096, intermediate_size=11008),
        _llama(f"Llama-2-13b{chat}-hf", n_layer=40, n_head=40, n_embd=5120, intermediate_size=13824),
        _llama(f"Llama-2-70b{chat}-hf", n_layer=80, n_head=64, n_query_groups=8, n_embd=8192, intermediate_size=28672),
    ]
for suffix in ("", "-Instruct"):
    l3 = dict(vocab_size=128256, rope_base=500000.0)
    configs += [
        _llama(f"Meta-Llama-3-8B{suffix}", block_size=8192, n_layer=32, n_head=32, n_query_groups=8, n_embd=4096,
               intermediate_size=14336, **l3),
        _llama(f"Meta-Llama-3-70B{suffix}", block_size=8192, n_layer=80, n_head=64, n_query_groups=8, n_embd=8192,
               intermediate_size=28672, **l3),
        _llama(f"Llama-3.1-8B{suffix}", block_size=131072, n_layer=32, n_head=32, n_query_groups=8, n_embd=4096,
               intermediate_size=14336, rope_scaling=_llama3_scaling(8.0), **l3),
        _llama(f"Llama-3.1-70B{suffix}", block_size=131072, n_layer=80, n_head=64, n_query_groups=8, n_embd=8192,
               intermediate_size=28672, rope_scaling=_llama3_scaling(8.0), **l3),
        _llama(f"Llama-3.2-1B{suffix}", block_size=131072, n_layer=16, n_head=32, n_query_groups=8, n_embd=2048,
               head_size=64, intermediate_size=8192, rope_scaling=_llama3_scaling(32.0), tie_embeddings=True, **l3),
        _llama(f"Llama-3.2-3B{suffix}", block_size=131072, n_layer=28, n_head=24, n_query_groups=8, n_embd=3072,
               head_size=128, intermediate_size=8192, rope_scaling=_llama3_scaling(32.0), tie_embeddings=True, **l3),
    ]
configs += [
    _llama("TinyLlama-1.1B-intermediate-step-1431k-3T", block_size=2048, n_layer=22, n_head=32, n_query_groups=4,
           n_embd=2048, intermediate_size=5632),
    _llama("TinyLlama-1.1B-Chat-v1.0", block_size=2048, n_layer=22, n_head=32, n_query_groups=4, n_embd=2048,
           intermediate_size=5632),
    dict(name="Mistral-7B-v0.1", hf_architecture="MistralForCausalLM", block_size=32768, n_layer=32, n_head=32,
         n_query_groups=8, n_embd=4096, intermediate_size=14336, sliding_window_size=4096),
    dict(name="Mistral-7B-Instruct-v0.1", hf_architecture="MistralForCausalLM", block_size=32768, n_layer=32, n_head=32,
         n_query_groups=8, n_embd=4096, intermediate_size=14336, sliding_window_size=4096),
]
for size, (layers, heads, groups, embd, inter) in {"135M": (30, 9, 3, 576, 1536), "360M": (32, 15, 5, 960, 2560),
                                                   "1.7B": (24, 32, 32, 2048, 8192)}.items():
    for suffix in ("", "-Instruct"):
        configs.append(_llama(f"SmolLM2-{size}{suffix}", block_size=8192, vocab_size=49152, n_layer=layers,
                              n_head=heads,
                              n_query_groups=groups, n_embd=embd, intermediate_size=inter, tie_embeddings=True,
                              rope_base=130000.0 if size == "1.7B" else 100000.0))
for size, (layers, heads, groups, embd, inter, vocab, tied) in {
    "0.5B": (24, 14, 2, 896, 4864, 151936, True), "1.5B": (28, 12, 2, 1536, 8960, 151936, True),
    "3B": (36, 16, 2, 2048, 11008, 151936, True), "7B": (28, 28, 4, 3584, 18944, 152064, False),
}.items():
    for suffix in ("", "-Instruct"):
        configs.append(dict(name=f"Qwen2.5-{size}{suffix}", hf_architecture="Qwen2ForCausalLM", block_size=32768,
                            vocab_size=vocab,
                            n_layer=layers, n_head=heads, n_query_groups=groups, n_embd=embd, intermediate_size=inter,
                            attn_bias=True, rope_base=1000000.0, norm_eps=1e-6, tie_embeddings=tied))
for size, (layers, heads, groups, embd, inter) in {"2b": (18, 8, 1, 2048, 16384),
                                                   "7b": (28, 16, 16, 3072, 24576)}.items():
    for suffix in ("", "-it"):
        configs.append(dict(name=f"gemma-{size}{suffix}", hf_architecture="GemmaForCausalLM", block_size=8192,
                            vocab_size=256000,
                            n_layer=layers, n_head=heads, n_query_groups=groups, n_embd=embd, head_size=256,
                            intermediate_size=inter,
                            norm_eps=1e-6, norm_unit_offset=True, scale_embeddings=True, tie_embeddings=True,
                            activation="gelu_tanh"))
_neox = dict(hf_architecture="GPTNeoXForCausalLM", norm_class="LayerNorm", bias=True, mlp_class="GptNeoxMLP",
             activation="gelu", parallel_residual=True, rotary_percentage=0.25)
for size, (layers, heads, embd) in {"14m": (6, 4, 128), "31m": (6, 8, 256), "70m": (6, 8, 512), "160m": (12, 12, 768),
                                    "410m": (24, 16, 1024), "1b": (16, 8, 2048), "1.4b": (24, 16, 2048),
                                    "2.8b": (32, 32, 2560), "6.9b": (32, 32, 4096), "12b": (36, 40, 5120)}.items():
    configs.append(dict(name=f"pythia-{size}", block_size=2048,
                        vocab_size={"6.9b": 50432, "12b": 50688}.get(size, 50304),
                        n_layer=layers, n_head=heads, n_embd=embd, intermediate_size=4 * embd, **_neox))
for size, (layers, heads, embd) in {"3b": (16, 32, 4096), "7b": (16, 48, 6144)}.items():
    for kind in ("base", "tuned"):
        configs.append(dict(name=f"stablelm-{kind}-alpha-{size}", block_size=4096, vocab_size=50688, n_layer=layers,
                            n_head=heads, n_embd=embd, intermediate_size=4 * embd, **_neox))
configs += [
    dict(name="stablelm-2-1_6b", hf_architecture="StableLmForCausalLM", block_size=4096, vocab_size=100352, n_layer=24,
         n_head=32, n_embd=2048, intermediate_size=5632, rotary_percentage=0.25, norm_class="LayerNorm",
         attn_bias=True),
    dict(name="phi-1_5", hf_architecture="PhiForCausalLM", block_size=2048, vocab_size=51200, n_layer=24, n_head=32,
         n_embd=2048, intermediate_size=8192, rotary_percentage=0.5, parallel_residual=True, shared_attention_norm=True,
         norm_class="LayerNorm", bias=True, lm_head_bias=True, mlp_class="GptNeoxMLP", activation="gelu_tanh"),
    dict(name="phi-2", hf_architecture="PhiForCausalLM", block_size=2048, vocab_size=51200, n_layer=32, n_head=32,
         n_embd=2560,
         intermediate_size=10240, rotary_percentage=0.4, parallel_residual=True, shared_attention_norm=True,
         norm_class="LayerNorm", bias=True, lm_head_bias=True, mlp_class="GptNeoxMLP", activation="gelu_tanh"),
    dict(name="falcon-7b", hf_architecture="FalconForCausalLM", block_size=2048, vocab_size=65024, n_layer=32,
         n_head=71,
         n_query_groups=1, n_embd=4544, intermediate_size=18176, parallel_residual=True, shared_attention_norm=True,
         norm_class="LayerNorm", mlp_class="GptNeoxMLP", activation="gelu", tie_embeddings=True,
         hf_extra={"new_decoder_architecture": False, "multi_query": True}),
    dict(name="falcon-40b", hf_architecture="FalconForCausalLM", block_size=2048, vocab_size=65024, n_layer=60,
         n_head=128,
         n_query_groups=8, n_embd=8192, intermediate_size=32768, parallel_residual=True, norm_class="LayerNorm",
         mlp_class="GptNeoxMLP", activation="gelu", tie_embeddings=True,
         hf_extra={"new_decoder_architecture": True, "multi_query": True}),
]
# Newer families: the published config.json fields the mapping reads, copied as they are, and turned into Config
# fields by the family's own `from_hf`, so a named entry equals what loading the real checkpoint folder gives.
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], attention_bias=False, head_dim=128, hidden_act="silu",
              max_position_embeddings=40960, rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000,
              sliding_window=None, use_sliding_window=False, vocab_size=151936)
# the fields every published Gemma 2 config.json shares (each entry below adds its own shape)
_GEMMA2 = dict(architectures=["Gemma2ForCausalLM"], attention_bias=False, attn_logit_softcapping=50.0,
               final_logit_softcapping=30.0, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
               max_position_embeddings=8192, rms_norm_eps=1e-06, rope_theta=10000.0, sliding_window=4096,
               vocab_size=256000)
# google/gemma-3-270m and -it (one shape): invergent-ai/surogate: surogate/serve/tools/convert/gemma3/inventory.py
# (GEMMA3_270M: "google/gemma-3-270m-it, ... member for member" with its config.h) and that converter's test config
# ("google/gemma-3-270m-it's own config.json, member for member for everything this converter reads", with no
# tie_word_embeddings: tied, Gemma3TextConfig's default); each field as in the whole re-saved copy
# huggingface.co/Codingstark/gemma3-270m-leetcode config.json (an Unsloth fine-tune of gemma-3-270m-it)
_GEMMA3_270M = dict(architectures=["Gemma3ForCausalLM"], attention_bias=False, attn_logit_softcapping=None,
                    final_logit_softcapping=None, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                    hidden_size=640, intermediate_size=2048,
                    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3, max_position_embeddings=32768,
                    num_attention_heads=4, num_hidden_layers=18, num_key_value_heads=1, query_pre_attn_scalar=256,
                    rms_norm_eps=1e-06, rope_local_base_freq=10000.0, rope_scaling=None, rope_theta=1000000.0,
                    sliding_window=512, use_bidirectional_attention=False, vocab_size=262144)
# Gemma 3 4B / 12B / 27B ship as the multimodal Gemma3ForConditionalGeneration, whose config.json names in its
# text_config only what differs from transformers' Gemma3TextConfig defaults; these entries are that text part, the
# model this tool fine-tunes (Gemma3ForCausalLM: text-only copies of it load as such), with every field written out
_GEMMA3_TEXT = dict(architectures=["Gemma3ForCausalLM"], attention_bias=False, attn_logit_softcapping=None,
                    final_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh",
                    max_position_embeddings=131072, rms_norm_eps=1e-06, rope_local_base_freq=10000.0,
                    rope_scaling={"factor": 8.0, "rope_type": "linear"}, rope_theta=1000000.0, sliding_window=1024,
                    sliding_window_pattern=6, vocab_size=262208)
# huggingface.co/Creekside/gemma-3 config.json: the text part of gemma-3-4b(-it) as transformers 4.50 writes it
_GEMMA3_4B = dict(_GEMMA3_TEXT, head_dim=256, hidden_size=2560, intermediate_size=10240, num_attention_heads=8,
                  num_hidden_layers=34, num_key_value_heads=4, query_pre_attn_scalar=256)
# huggingface.co/OpenPipe/gemma-3-12b-it-text-only config.json (the text part of gemma-3-12b-it, transformers 4.50)
_GEMMA3_12B = dict(_GEMMA3_TEXT, head_dim=256, hidden_size=3840, intermediate_size=15360, num_attention_heads=16,
                   num_hidden_layers=48, num_key_value_heads=8, query_pre_attn_scalar=256)
# NVIDIA/TensorRT-LLM: tests/unittest/_torch/modeling/test_modeling_gemma3.py, GEMMA3_27B_CONFIG (gemma-3-27b-it's
# config.json; that test cuts num_hidden_layers to 6 and sliding_window to 4, published 62 and 1024 as other copies
# of it have them), the rest Gemma3TextConfig's defaults as in the two copies above
_GEMMA3_27B = dict(_GEMMA3_TEXT, head_dim=128, hidden_size=5376, intermediate_size=21504, num_attention_heads=32,
                   num_hidden_layers=62, num_key_value_heads=16, query_pre_attn_scalar=168)
_OLMO2_13B = dict(architectures=["Olmo2ForCausalLM"], attention_bias=False, hidden_act="silu", hidden_size=5120,
                  intermediate_size=13824, max_position_embeddings=4096, num_attention_heads=40, num_hidden_layers=40,
                  num_key_value_heads=40, rms_norm_eps=1e-06, rope_scaling=None, rope_theta=500000,
                  tie_word_embeddings=False, vocab_size=100352)
# longrope factors of the Phi configs below, as published (one per rotated channel pair)
_PHI35_SHORT = [
    1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842, 1.0499999523162842,
    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979, 1.0999999046325684,
    1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
    1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083, 1.8499997854232788,
    1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745, 2.0199997425079346,
    2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0799996852874756,
    2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533, 2.729999542236328,
    2.749999523162842, 2.8399994373321533]
_PHI35_LONG = [
    1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
    1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
    4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
    17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
    32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
    50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457, 62.61000442504883,
    62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457, 63.77000427246094, 63.93000411987305,
    63.96000289916992, 63.970001220703125, 64.02999877929688, 64.06999969482422, 64.08000183105469,
    64.12000274658203, 64.41000366210938, 64.4800033569336, 64.51000213623047, 64.52999877929688, 64.83999633789062]
_PHI4_MINI_LONG = [
    1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649, 2.446418898,
    2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533, 5.984965424,
    6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
    16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6,
    32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77]
_HF_CONFIGS: dict[str, dict] = {
    # mephisto1484/Neko-LoRA-Build-Your-AI-Catgirl: Qwen3-1.7B/config.json (a re-saved copy: dtype and layer_types
    # added by a newer transformers, the architecture fields as published)
    "Qwen3-1.7B": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, max_window_layers=28, tie_word_embeddings=True),
    # citsjtu2020/LLM-Prof: sglang/Model_Config.md (Qwen3-8B also sanjithudupa/compute-aware-arch-search:
    # Qwen3-8B/config.json)
    "Qwen3-4B": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, max_window_layers=36, tie_word_embeddings=True),
    "Qwen3-8B": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, max_window_layers=36, tie_word_embeddings=False),
    "Qwen3-14B": dict(_QWEN3, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=8, max_window_layers=40, tie_word_embeddings=False),
    "Qwen3-32B": dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, max_window_layers=64, tie_word_embeddings=False),
    # kevinstephano/thunder_model_blocks: thunder_model_blocks/gemma2/gemma2_config.py (google/gemma-2-9b-it)
    "gemma-2-9b-it": dict(_GEMMA2, head_dim=256, hidden_size=3584, intermediate_size=14336, num_attention_heads=16,
                          num_hidden_layers=42, num_key_value_heads=8, query_pre_attn_scalar=256),
    # Liwink/gemma-jax: models/README.md (gemma-3-1b-it)
    "gemma-3-1b-it": dict(architectures=["Gemma3ForCausalLM"], attention_bias=False, attn_logit_softcapping=None,
                          final_logit_softcapping=None, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                          hidden_size=1152, intermediate_size=6912, max_position_embeddings=32768,
                          num_attention_heads=4, num_hidden_layers=26, num_key_value_heads=1,
                          query_pre_attn_scalar=256, rms_norm_eps=1e-06, rope_local_base_freq=10000,
                          rope_scaling=None, rope_theta=1000000, sliding_window=512, sliding_window_pattern=6,
                          vocab_size=262144),
    "gemma-3-270m": _GEMMA3_270M,
    "gemma-3-270m-it": _GEMMA3_270M,
    "gemma-3-4b-pt": _GEMMA3_4B,
    "gemma-3-4b-it": _GEMMA3_4B,
    "gemma-3-12b-pt": _GEMMA3_12B,
    "gemma-3-12b-it": _GEMMA3_12B,
    "gemma-3-27b-pt": _GEMMA3_27B,
    "gemma-3-27b-it": _GEMMA3_27B,
    # mauer4/Attention-From-Scratch: weights/allenai/OLMo-2-1124-13B/config.json and
    # weights/allenai/OLMo-2-1124-13B-Instruct/config.json (the same shape)
    "OLMo-2-1124-13B": _OLMO2_13B,
    "OLMo-2-1124-13B-Instruct": _OLMO2_13B,
    # fetchwiki/HuggingFaceTB-SmolLM3-3B: config.json (it has no tie_word_embeddings: SmolLM3Config's default, tied)
    "SmolLM3-3B": dict(architectures=["SmolLM3ForCausalLM"], attention_bias=False, bos_token_id=128000,
                       eos_token_id=128012, pad_token_id=128004, hidden_act="silu", hidden_size=2048,
                       intermediate_size=11008, layer_types=["full_attention"] * 36, max_position_embeddings=65536,
                       max_window_layers=28, mlp_bias=False, no_rope_layer_interval=4, no_rope_layers=[1, 1, 1, 0] * 9,
                       num_attention_heads=16, num_hidden_layers=36, num_key_value_heads=4, rms_norm_eps=1e-06,
                       rope_scaling=None, rope_theta=5000000.0, sliding_window=None, use_sliding_window=False,
                       vocab_size=128256),
    # mlc-ai/mlc-llm: python/mlc_llm/model/model_preset.py (its presets are the models' config.json; "qwen3_0.6b")
    "Qwen3-0.6B": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, max_window_layers=28, tie_word_embeddings=True),
    # mlc-ai/mlc-llm: python/mlc_llm/model/model_preset.py, "gemma2_2b" (eos [1, 107]: the -it config.json)
    "gemma-2-2b-it": dict(_GEMMA2, head_dim=256, hidden_size=2304, intermediate_size=9216, num_attention_heads=8,
                          num_hidden_layers=26, num_key_value_heads=4, query_pre_attn_scalar=256),
    # mlc-ai/mlc-llm: python/mlc_llm/model/model_preset.py, "gemma2_27b" (eos 1: the base config.json)
    "gemma-2-27b": dict(_GEMMA2, head_dim=128, hidden_size=4608, intermediate_size=36864, num_attention_heads=32,
                        num_hidden_layers=46, num_key_value_heads=16, query_pre_attn_scalar=144),
    # mlc-ai/mlc-llm: python/mlc_llm/model/model_preset.py at 8f49ea6b (before 95d50546 removed it), "phi-3"
    # (_name_or_path Phi-3-mini-4k-instruct)
    "Phi-3-mini-4k-instruct": dict(architectures=["Phi3ForCausalLM"], bos_token_id=1, eos_token_id=32000,
                                   hidden_act="silu", hidden_size=3072, intermediate_size=8192,
                                   max_position_embeddings=4096, num_attention_heads=32, num_hidden_layers=32,
                                   num_key_value_heads=32, original_max_position_embeddings=4096, pad_token_id=32000,
                                   rms_norm_eps=1e-05, rope_scaling=None, rope_theta=10000.0, sliding_window=2047,
                                   tie_word_embeddings=False, vocab_size=32064),
    # ThanatosShinji/onnx-tool: onnx_tool/model_configs.py, Phi_3_medium_4k_instruct (its config.json)
    "Phi-3-medium-4k-instruct": dict(architectures=["Phi3ForCausalLM"], bos_token_id=1, eos_token_id=32000,
                                     hidden_act="silu", hidden_size=5120, intermediate_size=17920,
                                     max_position_embeddings=4096, num_attention_heads=40, num_hidden_layers=40,
                                     num_key_value_heads=10, original_max_position_embeddings=4096,
                                     pad_token_id=32000, rms_norm_eps=1e-05, rope_scaling=None, rope_theta=10000.0,
                                     sliding_window=2047, tie_word_embeddings=False, vocab_size=32064),
    # mlc-ai/mlc-llm: python/mlc_llm/model/model_preset.py, "phi-3_5" (_name_or_path Phi-3.5-mini-instruct)
    "Phi-3.5-mini-instruct": dict(architectures=["Phi3ForCausalLM"], bos_token_id=1, eos_token_id=32000,
                                  hidden_act="silu", hidden_size=3072, intermediate_size=8192,
                                  max_position_embeddings=131072, num_attention_heads=32, num_hidden_layers=32,
                                  num_key_value_heads=32, original_max_position_embeddings=4096, pad_token_id=32000,
                                  rms_norm_eps=1e-05, rope_theta=10000.0, sliding_window=262144,
                                  rope_scaling=dict(type="longrope", short_factor=_PHI35_SHORT,
                                                    long_factor=_PHI35_LONG),
                                  tie_word_embeddings=False, vocab_size=32064),
    # mlc-ai/mlc-llm: python/mlc_llm/model/model_preset.py, "phi-4" (_name_or_path Phi-4-mini-instruct; its
    # full_attn_mod, interpolate_factor, lm_head_bias false and mlp_bias false are not Phi3Config fields)
    "Phi-4-mini-instruct": dict(architectures=["Phi3ForCausalLM"], bos_token_id=199999, eos_token_id=199999,
                                hidden_act="silu", hidden_size=3072, intermediate_size=8192,
                                max_position_embeddings=131072, num_attention_heads=24, num_hidden_layers=32,
                                num_key_value_heads=8, original_max_position_embeddings=4096, pad_token_id=199999,
                                partial_rotary_factor=0.75, rms_norm_eps=1e-05, rope_theta=10000.0,
                                rope_scaling=dict(type="longrope", short_factor=[1.0] * 48,
                                                  long_factor=_PHI4_MINI_LONG),
                                sliding_window=262144, tie_word_embeddings=True, vocab_size=200064),
    # NVIDIA-NeMo/Megatron-Bridge: tests/unit_tests/models/olmo2/test_olmo2_bridge.py, olmo2_1b_config_dict ("Mirror
    # of allenai/OLMo-2-0425-1B/config.json"); facebookresearch/fairseq2's OLMO2Config (its defaults: "the
    # allenai/OLMo-2-0425-1B model") has the same shape, base and vocabulary
    "OLMo-2-0425-1B": dict(architectures=["Olmo2ForCausalLM"], attention_bias=False, hidden_act="silu",
                           hidden_size=2048, intermediate_size=8192, max_position_embeddings=4096,
                           num_attention_heads=16, num_hidden_layers=16, num_key_value_heads=16, rms_norm_eps=1e-06,
                           rope_theta=500000.0, tie_word_embeddings=False, vocab_size=100352),
    # mlc-ai/mlc-llm: python/mlc_llm/model/model_preset.py, "olmo2_7b" (OLMo 2's one 7B: OLMo-2-1124-7B)
    "OLMo-2-1124-7B": dict(architectures=["Olmo2ForCausalLM"], hidden_act="silu", hidden_size=4096,
                           intermediate_size=11008, max_position_embeddings=4096, num_attention_heads=32,
                           num_hidden_layers=32, num_key_value_heads=32, rms_norm_eps=1e-06, rope_theta=500000.0,
                           tie_word_embeddings=False, vocab_size=100352),
    # mehmetcc/pal: phi-4/config.json (microsoft/phi-4: Phi3ForCausalLM, 14B)
    "phi-4": dict(architectures=["Phi3ForCausalLM"], bos_token_id=100257, eos_token_id=100257, hidden_act="silu",
                  hidden_size=5120, intermediate_size=17920, max_position_embeddings=16384, num_attention_heads=40,
                  num_hidden_layers=40, num_key_value_heads=10, original_max_position_embeddings=16384,
                  pad_token_id=100257, rms_norm_eps=1e-05, rope_scaling=None, rope_theta=250000,
                  sliding_window=16384, tie_word_embeddings=False, vocab_size=100352),
    # EchoCog/gpt-oss-20b: config.json (openai/gpt-oss-20b's; that copy's quantization_config says "gptq", the
    # published one "mxfp4" with these modules_to_not_convert, as quoted from both gpt-oss configs in a public guide)
    "gpt-oss-20b": dict(architectures=["GptOssForCausalLM"], attention_bias=True, attention_dropout=0.0,
                        eos_token_id=200002, experts_per_token=4, head_dim=64, hidden_act="silu", hidden_size=2880,
                        initial_context_length=4096, intermediate_size=2880,
                        layer_types=["sliding_attention", "full_attention"] * 12, max_position_embeddings=131072,
                        num_attention_heads=64, num_experts_per_tok=4, num_hidden_layers=24, num_key_value_heads=8,
                        num_local_experts=32, output_router_logits=False, pad_token_id=199999,
                        quantization_config={"modules_to_not_convert": ["model.layers.*.self_attn",
                                                                        "model.layers.*.mlp.router",
                                                                        "model.embed_tokens", "lm_head"],
                                             "quant_method": "mxfp4"},
                        rms_norm_eps=1e-05,
                        rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                      "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                      "truncate": False},
                        rope_theta=150000, router_aux_loss_coef=0.9, sliding_window=128, swiglu_limit=7.0,
                        tie_word_embeddings=False, vocab_size=201088),
    # kevinstephano/thunder_model_blocks: thunder_model_blocks/mistral/mistral_config.py
    "Mistral-Nemo-Base-2407": dict(architectures=["MistralForCausalLM"], head_dim=128, hidden_act="silu",
                                   hidden_size=5120, intermediate_size=14336, max_position_embeddings=128000,
                                   num_attention_heads=32, num_hidden_layers=40, num_key_value_heads=8,
                                   rms_norm_eps=1e-05, rope_theta=1000000.0, sliding_window=None,
                                   tie_word_embeddings=False, vocab_size=131072),
}
for _name, _hf in _HF_CONFIGS.items():
    _arch = _hf["architectures"][0]
    # (a named config is the model; how a folder stores it, e.g. gpt-oss's MXFP4 experts, is that folder's: random
    # checkpoints made from a name are dense)
    configs.append(dict(name=_name, hf_architecture=_arch, **{**SPECS[_arch].from_hf(_hf, _arch), "moe_mxfp4": False}))
NAME_TO_CONFIG = {c["name"]: c for c in configs}
NAMES = tuple(NAME_TO_CONFIG)
