"""Everything the project knows about each Hugging Face architecture, one `FamilySpec` each.

A spec says how the architecture's `config.json` maps onto our `Config` fields (`from_hf`), how a `Config` is
written back for transformers (`to_hf`), how its weights are named (`weights`: the layer prefix, our module ->
HF module, the q/k/v layout) and llama.cpp's architecture name where the GGUF export can write it. The model,
the converters, the exporters and PEFT interop read the spec instead of testing architecture names.

To add a family: write its `from_hf` / `to_hf` and add one `FamilySpec` to `SPECS` (and one row to the tiny
configs of tests/helpers.py, which runs it through every parity test). This module imports nothing of ours but
`utils`: `Config` is passed in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from lit_qlora.utils import UserError

# ---- weight names -------------------------------------------------------------------------------
# Per family: (prefix of HF layer i, {our per-layer module: HF per-layer module}, {our global module: HF's}).
# Our names: norm_1 / norm_2 (before attention / MLP), post_attention_norm / post_mlp_norm (on their outputs),
# attn.qkv (fused q|k|v), attn.q_norm / attn.k_norm, attn.proj, mlp.fc_1 / fc_2 / proj (gated) or mlp.fc / proj.
_LLAMA_LAYER = {"norm_1": "input_layernorm", "norm_2": "post_attention_layernorm", "attn.proj": "self_attn.o_proj",
                "mlp.fc_1": "mlp.gate_proj", "mlp.fc_2": "mlp.up_proj", "mlp.proj": "mlp.down_proj"}
_LLAMA_GLOBAL = {"transformer.wte": "model.embed_tokens", "transformer.ln_f": "model.norm", "lm_head": "lm_head"}
_QK_NORM = {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}
_SEPARATE_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def _names(layer: str, map: dict, globals: dict, qkv: str, q_names: tuple, gate_up: Optional[str] = None,
           experts: Optional[dict] = None, fused_experts: Optional[dict] = None,
           moe_params: Optional[dict] = None) -> dict:
    # gate_up: the HF module holding mlp.fc_1's rows then mlp.fc_2's in one tensor (Phi-3), else None
    # experts: our stacked expert weight [E, out, in] -> the HF module of expert {e} (one tensor per expert, as HF
    # checkpoints store them; transformers 5 stacks them itself when it loads and splits them when it saves)
    # fused_experts (gpt-oss): the layer's experts are two HF tensors, "gate_up" (fc_1 and fc_2) and "down" (proj),
    # each stacked over experts and transposed, [E, in, out], the gate's and up's columns interleaved (gate first),
    # with `{name}_bias` [E, out] beside them; published checkpoints store the weights as MXFP4 (`{name}_blocks`,
    # `{name}_scales`, rows = out). lit_qlora/convert.py's `fused_experts_*` read and write that layout.
    # moe_params: the parameters of transformers' in-memory MoE layer that PEFT's target_parameters name (under the
    # layer prefix): gate_up [E, 2 * inner, C] (fc_1's rows then fc_2's), down [E, C, inner] and the router's
    # [E, C]; gate_up is defined before down in the experts module (PEFT nests the first one innermost);
    # "interleaved": gate_up's rows alternate gate and up (gpt-oss; stored transposed, which PEFT handles). None: a
    # layout our PEFT interop does not map
    return dict(layer=layer, map=map, globals=globals, qkv=qkv, q_names=q_names, gate_up=gate_up,
                experts=experts or {}, fused_experts=fused_experts or {}, moe_params=moe_params)


_MOE_PARAMS = {"gate_up": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj", "router": "mlp.gate.weight"}


_LLAMA_NAMES = _names("model.layers.{i}.", _LLAMA_LAYER, _LLAMA_GLOBAL, "separate", _SEPARATE_QKV)
_QWEN3_NAMES = _names("model.layers.{i}.", {**_LLAMA_LAYER, **_QK_NORM}, _LLAMA_GLOBAL, "separate", _SEPARATE_QKV)
_GEMMA2_LAYER = {**_LLAMA_LAYER, "post_attention_norm": "post_attention_layernorm",
                 "norm_2": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}
_GEMMA2_NAMES = _names("model.layers.{i}.", _GEMMA2_LAYER, _LLAMA_GLOBAL, "separate", _SEPARATE_QKV)
_GEMMA3_NAMES = _names("model.layers.{i}.", {**_GEMMA2_LAYER, **_QK_NORM}, _LLAMA_GLOBAL, "separate", _SEPARATE_QKV)
_OLMO2_LAYER = {"post_attention_norm": "post_attention_layernorm", "post_mlp_norm": "post_feedforward_layernorm",
                **{k: v for k, v in _LLAMA_LAYER.items() if not k.startswith("norm_")}, **_QK_NORM}
_OLMO2_NAMES = _names("model.layers.{i}.", _OLMO2_LAYER, _LLAMA_GLOBAL, "separate", _SEPARATE_QKV)
# Phi-3 / Phi-4: one fused [q | k | v] and one fused [gate | up] Linear per layer
_PHI3_NAMES = _names("model.layers.{i}.", {k: v for k, v in _LLAMA_LAYER.items() if k not in ("mlp.fc_1", "mlp.fc_2")},
                     _LLAMA_GLOBAL, "fused", ("self_attn.qkv_proj",), gate_up="mlp.gate_up_proj")
_QWEN3_MOE_NAMES = _names("model.layers.{i}.", {**_LLAMA_LAYER, **_QK_NORM, "mlp.router": "mlp.gate"}, _LLAMA_GLOBAL,
                          "separate", _SEPARATE_QKV,
                          experts={"mlp.experts.fc_1": "mlp.experts.{e}.gate_proj",
                                   "mlp.experts.fc_2": "mlp.experts.{e}.up_proj",
                                   "mlp.experts.proj": "mlp.experts.{e}.down_proj"}, moe_params=_MOE_PARAMS)
# (its map keeps Llama's dense MLP names, which no Mixtral layer has: PEFT interop lists them for every layer)
_MIXTRAL_NAMES = _names("model.layers.{i}.", {**_LLAMA_LAYER, "mlp.router": "block_sparse_moe.gate"}, _LLAMA_GLOBAL,
                        "separate", _SEPARATE_QKV,
                        experts={"mlp.experts.fc_1": "block_sparse_moe.experts.{e}.w1",
                                 "mlp.experts.fc_2": "block_sparse_moe.experts.{e}.w3",
                                 "mlp.experts.proj": "block_sparse_moe.experts.{e}.w2"},
                        moe_params=_MOE_PARAMS)  # (transformers 5 names block_sparse_moe mlp in memory)
# gpt-oss: Llama's attention names with biases and sinks (our attn.sinks parameter is HF's self_attn.sinks)
_GPT_OSS_NAMES = _names("model.layers.{i}.",
                        {"norm_1": "input_layernorm", "norm_2": "post_attention_layernorm",
                         "attn.proj": "self_attn.o_proj", "attn": "self_attn", "mlp.router": "mlp.router"},
                        _LLAMA_GLOBAL, "separate", _SEPARATE_QKV,
                        fused_experts={"gate_up": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj"},
                        moe_params={"gate_up": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj",
                                    "router": "mlp.router.weight", "interleaved": True})
_NEOX_NAMES = _names("gpt_neox.layers.{i}.",
                     {"norm_1": "input_layernorm", "norm_2": "post_attention_layernorm", "attn.proj": "attention.dense",
                      "mlp.fc": "mlp.dense_h_to_4h", "mlp.proj": "mlp.dense_4h_to_h"},
                     {"transformer.wte": "gpt_neox.embed_in", "transformer.ln_f": "gpt_neox.final_layer_norm",
                      "lm_head": "embed_out"},
                     "interleaved", ("attention.query_key_value",))
_PHI_NAMES = _names("model.layers.{i}.",
                    {"norm_1": "input_layernorm", "attn.proj": "self_attn.dense", "mlp.fc": "mlp.fc1",
                     "mlp.proj": "mlp.fc2"},
                    {"transformer.wte": "model.embed_tokens", "transformer.ln_f": "model.final_layernorm",
                     "lm_head": "lm_head"},
                    "separate", _SEPARATE_QKV)


def _falcon_names(config: Any) -> dict:
    # separate fused: [q | k | v] already (7B multi-query) | interleaved: per head [q, k, v] (MHA) |
    # grouped: per kv head [q .. q, k, v] (40B)
    new = bool(config.hf_extra.get("new_decoder_architecture"))
    layout = "grouped" if new else "fused" if config.hf_extra.get("multi_query", True) else "interleaved"
    norms = {"norm_1": "ln_attn", "norm_2": "ln_mlp"} if new and not config.shared_attention_norm else {
        "norm_1": "input_layernorm"}
    return _names("transformer.h.{i}.",
                  {**norms, "attn.proj": "self_attention.dense", "mlp.fc": "mlp.dense_h_to_4h",
                   "mlp.proj": "mlp.dense_4h_to_h"},
                  {"transformer.wte": "transformer.word_embeddings", "transformer.ln_f": "transformer.ln_f",
                   "lm_head": "lm_head"},
                  layout, ("self_attention.query_key_value",))


# ---- reading HF configs ---------------------------------------------------------------------------
def _act(name: str) -> str:
    table = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
             "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}
    if name not in table:
        raise UserError(f"activation {name!r} is not supported; supported: {', '.join(table)}")
    return table[name]


def _hf_act(kind: str) -> str:
    return {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[kind]


ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope")


def rope_from_hf(params: Optional[dict], hf: dict, arch: str) -> tuple[float, Optional[dict]]:
    """(base, our rope_scaling or None) from one set of HF rope parameters (4.x: `rope_scaling` beside
    `rope_theta`; 5.x: `rope_parameters`). Any scaling we do not implement is refused, naming it."""
    params = dict(params or {})
    base = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UserError(f"{arch}: rope scaling {kind!r} is not implemented (rope_type in config.json); supported: "
                        f"{', '.join(ROPE_TYPES)}")
    if kind == "default":
        return base, None
    original = params.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    need = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "linear": ("factor",), "yarn": ("original_max_position_embeddings",),
            "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}[kind]
    got = {**params, "original_max_position_embeddings": original}
    missing = [k for k in need if got.get(k) is None]
    if missing:
        raise UserError(f"{arch}: {kind} rope scaling in config.json lacks {missing[0]!r}; fix the model config")
    if kind == "llama3":  # stored without rope_type: configs written before the other kinds existed read the same
        return base, {k: got[k] for k in need}
    if kind == "linear":
        return base, {"rope_type": "linear", "factor": float(got["factor"])}
    max_pos = hf.get("max_position_embeddings", original)
    factor = got.get("factor") or max_pos / original
    if kind == "yarn":
        return base, {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original,
                      "beta_fast": float(got.get("beta_fast") or 32), "beta_slow": float(got.get("beta_slow") or 1),
                      "attention_factor": got.get("attention_factor"), "mscale": got.get("mscale"),
                      "mscale_all_dim": got.get("mscale_all_dim"), "truncate": got.get("truncate", True)}
    return base, {"rope_type": "longrope", "short_factor": [float(x) for x in got["short_factor"]],
                  "long_factor": [float(x) for x in got["long_factor"]], "factor": float(factor),
                  "original_max_position_embeddings": original, "attention_factor": got.get("attention_factor")}


def rope_to_hf(base: float, scaling: Optional[dict]) -> dict:
    """One set of HF rope parameters (5.x `rope_parameters` form) for our base and scaling."""
    if not scaling:
        return {"rope_type": "default", "rope_theta": base}
    s = dict(scaling)
    kind = s.pop("rope_type", "llama3")
    return {"rope_type": kind, "rope_theta": base, **{k: v for k, v in s.items() if v is not None}}


def _rope_params(hf: dict) -> dict:
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def _layer_types(hf: dict, n_layer: int, arch: str, default: Optional[Callable[[int], str]] = None) -> Optional[list]:
    """Per-layer attention kinds ("sliding_attention" / "full_attention"), or None when every layer is alike."""
    types = hf.get("layer_types")
    if types is None and default is not None:
        types = [default(i) for i in range(n_layer)]
    if types is None:
        return None
    known = ("sliding_attention", "full_attention")
    bad = [t for t in types if t not in known]
    if bad:
        raise UserError(f"{arch}: layer type {bad[0]!r} in config.json's layer_types is not implemented; supported: "
                        f"{', '.join(known)}")
    if len(types) != n_layer:
        raise UserError(f"{arch}: layer_types lists {len(types)} layers but num_hidden_layers is {n_layer}; fix the "
                        "model config")
    return list(types)


def _refuse(hf: dict, arch: str, fields: dict[str, Any]) -> None:
    """Refuse config fields that change the math and that we do not implement (field -> the value we implement)."""
    for key, ok in fields.items():
        value = hf.get(key)
        if value is not None and value != ok and not (callable(ok) and ok(value)):
            raise UserError(f"{arch}: {key}={value!r} in config.json is not implemented; use a model without it")


def _llama_like(hf: dict, arch: str) -> dict:
    base, scaling = rope_from_hf(_rope_params(hf), hf, arch)
    n_head = hf["num_attention_heads"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    return dict(
        block_size=hf.get("max_position_embeddings", 4096), vocab_size=hf["vocab_size"],
        n_layer=hf["num_hidden_layers"], n_head=n_head, n_embd=hf["hidden_size"],
        n_query_groups=hf.get("num_key_value_heads") or n_head,
        head_size=hf.get("head_dim") or hf["hidden_size"] // n_head,
        rope_base=base, rope_scaling=scaling, norm_class="RMSNorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
        mlp_class="LLaMAMLP", activation=_act(hf.get("hidden_act", "silu")),
        intermediate_size=hf["intermediate_size"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window_size=window,
    )


def _map_llama(hf: dict, arch: str) -> dict:
    if hf.get("mlp_bias") or hf.get("attention_bias"):
        raise UserError(f"{arch} configs with attention_bias or mlp_bias are not supported; use a model without "
                        "those biases")
    return _llama_like(hf, arch)


def _map_qwen2(hf: dict, arch: str) -> dict:
    kw = _llama_like(hf, arch)
    if kw["sliding_window_size"] is not None:
        first = hf.get("max_window_layers", hf["num_hidden_layers"])
        kw["layer_types"] = _layer_types(hf, kw["n_layer"], arch,
                                         lambda i: "sliding_attention" if i >= first else "full_attention")
    kw.update(attn_bias=True, bias=False)
    return kw


def _map_qwen3(hf: dict, arch: str) -> dict:
    _refuse(hf, arch, {"attention_bias": False})
    kw = _map_qwen2(hf, arch)
    kw.update(attn_bias=False, qk_norm="head")
    return kw


def _map_qwen3_moe(hf: dict, arch: str) -> dict:
    """Qwen3's attention; the MLP of layer i is a mixture of experts unless i is in mlp_only_layers or (i + 1) is
    not a multiple of decoder_sparse_step (then a dense MLP of intermediate_size)."""
    _refuse(hf, arch, {"attention_bias": False})
    kw = _llama_like(hf, arch)
    kw["sliding_window_size"] = hf.get("sliding_window") if hf.get("use_sliding_window") else None  # every layer
    n_expert = hf.get("num_experts", hf.get("num_local_experts", 128))
    step, only = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    dense = [i for i in range(kw["n_layer"]) if i in only or (i + 1) % step]
    if n_expert:
        kw.update(moe_n_expert=n_expert, moe_top_k=hf.get("num_experts_per_tok", 8),
                  moe_intermediate_size=hf.get("moe_intermediate_size", 768),
                  moe_norm_topk=bool(hf.get("norm_topk_prob", False)), moe_dense_layers=dense or None)
    kw.update(qk_norm="head", hf_extra=_router_extra(hf))
    return kw


def _map_mixtral(hf: dict, arch: str) -> dict:
    """Mistral's attention; every MLP a mixture of experts of intermediate_size, the top-k scores renormalized."""
    _refuse(hf, arch, {"router_jitter_noise": 0.0})
    kw = _llama_like(hf, arch)
    kw.update(moe_n_expert=hf.get("num_local_experts", hf.get("num_experts", 8)),
              moe_top_k=hf.get("num_experts_per_tok", 2), moe_norm_topk=True,
              hf_extra=_router_extra(hf))
    return kw


def _router_extra(hf: dict) -> dict:
    """The training-only router fields of a Qwen3-MoE / Mixtral config, kept for the export: the load-balancing loss'
    weight (finetune's --router_aux_loss_coef defaults to it; transformers' default 0.001) and whether transformers
    adds that loss (gpt-oss keeps both as given)."""
    return {"router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001),
            "output_router_logits": bool(hf.get("output_router_logits", False))}


# What the published gpt-oss checkpoints leave unquantized (quantization_config modules_to_not_convert): all but the
# experts
_GPT_OSS_MXFP4_UNCONVERTED = ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")


def _map_gpt_oss(hf: dict, arch: str) -> dict:
    """gpt-oss: attention with biases and learned sinks, sliding-window layers alternating with full ones (by
    layer_types, default sliding first), YaRN RoPE over head_dim; every MLP a mixture of biased experts behind a
    biased router, the softmax taken over the top-k logits (the renormalized top-k probabilities), the experts' clamped
    SwiGLU; RMSNorm scaling in fp32. Published checkpoints store the experts in MXFP4 (quantization_config
    quant_method "mxfp4"); a dequantized copy as transformers saves it has them in bf16."""
    # (hidden_act is not read by transformers' gpt-oss: its experts always use the clamped SwiGLU)
    _refuse(hf, arch, {"attention_dropout": 0.0})
    quant = hf.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        if method != "mxfp4":
            raise UserError(f"{arch}: quantization_config quant_method={method!r} in config.json is not implemented "
                            "(gpt-oss checkpoints are read as published, MXFP4, or dequantized); use one of those")
        left = [m for m in _GPT_OSS_MXFP4_UNCONVERTED if m not in (quant.get("modules_to_not_convert") or [])]
        if left:
            raise UserError(f"{arch}: quantization_config in config.json quantizes {left[0]!r} (it is not in "
                            "modules_to_not_convert); only MXFP4 experts are implemented: use the published checkpoint "
                            "or a dequantized one")
    rope = dict(_rope_params(hf) or _GPT_OSS_ROPE)
    rope.setdefault("rope_theta", hf.get("rope_theta", 150000.0))  # GptOssConfig's default_theta
    hf = {**hf, "rope_parameters": rope}
    kw = _llama_like(hf, arch)
    n = kw["n_layer"]
    kw["layer_types"] = _layer_types(hf, n, arch, lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention")
    kw["sliding_window_size"] = hf.get("sliding_window", 128)
    if "sliding_attention" in kw["layer_types"] and kw["sliding_window_size"] is None:
        raise UserError(f"{arch}: layer_types has sliding layers but sliding_window is null; fix the model config")
    kw.update(bias=bool(hf.get("attention_bias", True)), norm_fp32_scale=True, attn_sinks=True, moe_bias=True,
              moe_norm_topk=True, moe_n_expert=hf.get("num_local_experts", hf.get("num_experts", 128)),
              moe_top_k=hf.get("num_experts_per_tok", hf.get("experts_per_token", 4)),
              moe_swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
              moe_swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), moe_mxfp4=quant is not None,
              hf_extra={k: hf[k] for k in ("router_aux_loss_coef", "output_router_logits", "pad_token_id",
                                           "bos_token_id", "eos_token_id", "quantization_config")
                        if hf.get(k) is not None})
    if quant is not None:
        odd = [(k, v) for k, v in (("hidden_size", kw["n_embd"]), ("intermediate_size", kw["intermediate_size"]))
               if v % 32]
        if odd:
            raise UserError(f"{arch}: {odd[0][0]}={odd[0][1]} is not a multiple of 32, MXFP4's block; the checkpoint "
                            "cannot be MXFP4: fix the model config")
    return kw


# GptOssConfig's RoPE where config.json has none
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def _map_smollm3(hf: dict, arch: str) -> dict:
    _refuse(hf, arch, {"attention_bias": False, "mlp_bias": False})
    kw = _llama_like(hf, arch)
    kw["tie_embeddings"] = bool(hf.get("tie_word_embeddings", True))  # SmolLM3Config's default is tied
    n = kw["n_layer"]
    interval = hf.get("no_rope_layer_interval", 4)
    uses_rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    if len(uses_rope) != n:
        raise UserError(f"{arch}: no_rope_layers lists {len(uses_rope)} layers but num_hidden_layers is {n}; fix the "
                        "model config")
    kw["nope_layers"] = [i for i, r in enumerate(uses_rope) if not r] or None
    # its config class defaults these to the 128k vocabulary's ids: keep the checkpoint's for an exact export
    kw["hf_extra"] = {k: hf.get(k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
    if not hf.get("use_sliding_window"):
        kw["sliding_window_size"] = None
    else:
        kw["layer_types"] = _layer_types(hf, n, arch, lambda i: "sliding_attention" if not uses_rope[i]
                                         else "full_attention")
    return kw


def _map_gemma(hf: dict, arch: str) -> dict:
    kw = _llama_like(hf, arch)
    kw.update(norm_unit_offset=True, scale_embeddings=True, tie_embeddings=hf.get("tie_word_embeddings", True),
              activation=_act(hf.get("hidden_activation") or hf.get("hidden_act", "gelu_pytorch_tanh")))
    return kw


def _gemma_next(hf: dict, arch: str, default_types: Callable[[int], str]) -> dict:
    """What Gemma 2 and Gemma 3 add to Gemma: norms around both branches, a query scale of their own, sliding
    attention on some layers, soft-capping (Gemma 2)."""
    _refuse(hf, arch, {"attention_bias": False, "use_bidirectional_attention": False})
    kw = _map_gemma(hf, arch)
    scalar = hf.get("query_pre_attn_scalar", kw["head_size"])
    kw.update(post_norms=True, attention_scale=float(scalar) ** -0.5, hf_extra={"query_pre_attn_scalar": scalar},
              attn_softcap=hf.get("attn_logit_softcapping"), final_softcap=hf.get("final_logit_softcapping"),
              sliding_window_size=hf.get("sliding_window"))
    if kw["sliding_window_size"] is not None:
        kw["layer_types"] = _layer_types(hf, kw["n_layer"], arch, default_types)
    return kw


def _map_gemma2(hf: dict, arch: str) -> dict:
    return _gemma_next(hf, arch, lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention")


def _map_gemma3(hf: dict, arch: str) -> dict:
    pattern = hf.get("sliding_window_pattern", 6)
    rp = hf.get("rope_parameters") or {}
    if "full_attention" in rp or "sliding_attention" in rp:  # transformers 5: one set per layer type
        full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
    else:
        full = dict(rp or hf.get("rope_scaling") or {})
        full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    full.setdefault("rope_theta", 1_000_000.0)
    local.setdefault("rope_theta", 10_000.0)
    kw = _gemma_next({**hf, "rope_parameters": full}, arch,
                     lambda i: "sliding_attention" if (i + 1) % pattern else "full_attention")
    local_base, local_scaling = rope_from_hf(local, hf, arch)
    if local_scaling:
        raise UserError(f"{arch}: rope scaling on the sliding layers is not implemented; use a model without it")
    kw.update(qk_norm="head", rope_local_base=local_base)
    return kw


def _map_olmo2(hf: dict, arch: str) -> dict:
    _refuse(hf, arch, {"attention_bias": False, "clip_qkv": None})
    kw = _llama_like(hf, arch)
    kw.update(pre_norms=False, post_norms=True, qk_norm="full", norm_fp32_scale=True, sliding_window_size=None)
    return kw


def _map_phi3(hf: dict, arch: str) -> dict:
    rp = dict(_rope_params(hf))
    if rp.get("rope_type", rp.get("type")) in ("su", "yarn"):  # Phi3Config reads both as longrope
        rp["rope_type"] = "longrope"
    # Phi3Config's defaults where config.json has no value
    hf = {"original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5, **hf, "rope_parameters": rp}
    kw = _llama_like(hf, arch)
    kw.update(rotary_percentage=_partial_rotary(hf), norm_eps=hf["rms_norm_eps"],
              hf_extra={k: hf.get(k, d) for k, d in (("pad_token_id", 32000), ("bos_token_id", 1),
                                                     ("eos_token_id", 32000))})
    return kw


def _map_gpt_neox(hf: dict, arch: str) -> dict:
    base, _ = rope_from_hf(_rope_params(hf), hf, arch)
    return dict(
        block_size=hf.get("max_position_embeddings", 2048), vocab_size=hf["vocab_size"],
        n_layer=hf["num_hidden_layers"], n_head=hf["num_attention_heads"], n_embd=hf["hidden_size"],
        rotary_percentage=_partial_rotary(hf, hf.get("rotary_pct", 0.25)), rope_base=base,
        parallel_residual=hf.get("use_parallel_residual", True), norm_class="LayerNorm",
        norm_eps=hf.get("layer_norm_eps", 1e-5), bias=True, mlp_class="GptNeoxMLP",
        activation=_act(hf.get("hidden_act", "gelu")), intermediate_size=hf["intermediate_size"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        hf_extra={"attention_bias": hf.get("attention_bias", True)},
    )


def _partial_rotary(hf: dict, default: float = 1.0) -> float:
    rp = hf.get("rope_parameters") or {}
    return float(rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", default)))


def _map_falcon(hf: dict, arch: str) -> dict:
    if hf.get("alibi"):
        raise UserError("Falcon models with alibi are not supported; use a rotary Falcon (7B, 40B)")
    n_head = hf["num_attention_heads"]
    new_arch = bool(hf.get("new_decoder_architecture", False))
    if new_arch:
        groups = hf.get("num_kv_heads") or n_head
    else:
        groups = 1 if hf.get("multi_query", True) else n_head
    if not hf.get("parallel_attn", True):
        raise UserError("Falcon with parallel_attn=false is not supported; use Falcon 7B/40B")
    base, _ = rope_from_hf(_rope_params(hf), hf, arch)
    return dict(
        block_size=hf.get("max_position_embeddings", 2048), vocab_size=hf["vocab_size"],
        n_layer=hf["num_hidden_layers"], n_head=n_head, n_embd=hf["hidden_size"], n_query_groups=groups,
        rope_base=base, parallel_residual=True,
        shared_attention_norm=not new_arch or hf.get("num_ln_in_parallel_attn") == 1,
        norm_class="LayerNorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5), bias=bool(hf.get("bias", False)),
        mlp_class="GptNeoxMLP", activation=_act(hf.get("activation", "gelu")),
        intermediate_size=hf.get("ffn_hidden_size") or 4 * hf["hidden_size"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        hf_extra={"new_decoder_architecture": new_arch, "multi_query": hf.get("multi_query", True)},
    )


def _map_phi(hf: dict, arch: str) -> dict:
    if hf.get("qk_layernorm"):
        raise UserError("Phi with qk_layernorm=true is not supported; use Phi-1.5 or Phi-2")
    base, _ = rope_from_hf(_rope_params(hf), hf, arch)
    n_head = hf["num_attention_heads"]
    return dict(
        block_size=hf.get("max_position_embeddings", 2048), vocab_size=hf["vocab_size"],
        n_layer=hf["num_hidden_layers"], n_head=n_head, n_embd=hf["hidden_size"],
        n_query_groups=hf.get("num_key_value_heads") or n_head, rotary_percentage=_partial_rotary(hf, 0.5),
        rope_base=base, parallel_residual=True, shared_attention_norm=True, norm_class="LayerNorm",
        norm_eps=hf.get("layer_norm_eps", 1e-5), bias=True, lm_head_bias=True, mlp_class="GptNeoxMLP",
        activation=_act(hf.get("hidden_act", "gelu_new")), intermediate_size=hf["intermediate_size"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def _map_stablelm(hf: dict, arch: str) -> dict:
    if hf.get("qk_layernorm") or hf.get("use_parallel_residual"):
        raise UserError("StableLM with qk_layernorm or parallel residual is not supported; use StableLM 2 1.6B")
    base, _ = rope_from_hf(_rope_params(hf), hf, arch)
    n_head = hf["num_attention_heads"]
    return dict(
        block_size=hf.get("max_position_embeddings", 4096), vocab_size=hf["vocab_size"],
        n_layer=hf["num_hidden_layers"], n_head=n_head, n_embd=hf["hidden_size"],
        n_query_groups=hf.get("num_key_value_heads") or n_head, rotary_percentage=_partial_rotary(hf, 0.25),
        rope_base=base, norm_class="LayerNorm", norm_eps=hf.get("layer_norm_eps", 1e-5),
        attn_bias=bool(hf.get("use_qkv_bias", False)), mlp_class="LLaMAMLP",
        activation=_act(hf.get("hidden_act", "silu")),
        intermediate_size=hf["intermediate_size"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


# ---- writing HF configs ---------------------------------------------------------------------------
def _common(c: Any) -> dict:
    return dict(architectures=[c.hf_architecture], vocab_size=c.vocab_size, hidden_size=c.n_embd,
                num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, max_position_embeddings=c.block_size,
                tie_word_embeddings=c.tie_embeddings, rope_theta=c.rope_base, torch_dtype="bfloat16")


def _llama_to_hf(c: Any, model_type: str) -> dict:
    d = dict(_common(c), model_type=model_type, num_key_value_heads=c.n_query_groups, head_dim=c.head_size,
             intermediate_size=c.intermediate_size, rms_norm_eps=c.norm_eps, hidden_act=_hf_act(c.activation),
             attention_bias=False)
    if c.rope_scaling:
        d["rope_scaling"] = rope_to_hf(c.rope_base, c.rope_scaling)
    return d


def _to_llama(c: Any) -> dict:
    return _llama_to_hf(c, "llama")


def _to_mistral(c: Any) -> dict:
    return dict(_llama_to_hf(c, "mistral"), sliding_window=c.sliding_window_size)


def _qwen_window(c: Any, d: dict) -> dict:
    d.update(use_sliding_window=c.sliding_window_size is not None, sliding_window=c.sliding_window_size)
    if c.layer_types is not None:
        d.update(layer_types=list(c.layer_types),
                 max_window_layers=next((i for i, t in enumerate(c.layer_types) if t == "sliding_attention"),
                                        c.n_layer))
    return d


def _to_qwen2(c: Any) -> dict:
    return _qwen_window(c, _llama_to_hf(c, "qwen2"))


def _to_qwen3(c: Any) -> dict:
    return _qwen_window(c, _llama_to_hf(c, "qwen3"))


def _to_qwen3_moe(c: Any) -> dict:
    d = _llama_to_hf(c, "qwen3_moe")
    d.update(c.hf_extra, num_experts=c.moe_n_expert, num_experts_per_tok=c.moe_top_k,
             moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.moe_norm_topk, decoder_sparse_step=1,
             mlp_only_layers=list(c.moe_dense_layers or []), use_sliding_window=c.sliding_window_size is not None,
             sliding_window=c.sliding_window_size)
    return d


def _to_mixtral(c: Any) -> dict:
    d = _llama_to_hf(c, "mixtral")
    d.pop("attention_bias")  # Mixtral has no such field
    d.update(c.hf_extra, intermediate_size=c.moe_intermediate_size, num_local_experts=c.moe_n_expert,
             num_experts_per_tok=c.moe_top_k, sliding_window=c.sliding_window_size)
    return d


def _to_gpt_oss(c: Any) -> dict:
    d = _llama_to_hf(c, "gpt_oss")
    d.pop("rope_scaling", None)
    d.pop("rope_theta")
    extra = dict(c.hf_extra)
    quant = extra.pop("quantization_config", None)
    d.update(extra, rope_parameters=rope_to_hf(c.rope_base, c.rope_scaling), attention_bias=c.bias,
             layer_types=list(c.layer_types), sliding_window=c.sliding_window_size,
             intermediate_size=c.moe_intermediate_size, num_local_experts=c.moe_n_expert,
             num_experts_per_tok=c.moe_top_k, swiglu_limit=c.moe_swiglu_limit, swiglu_alpha=c.moe_swiglu_alpha)
    if c.moe_mxfp4:  # the experts are written as stored: MXFP4, which transformers reads by this entry
        d["quantization_config"] = quant or {"quant_method": "mxfp4",
                                             "modules_to_not_convert": list(_GPT_OSS_MXFP4_UNCONVERTED)}
    return d


def _to_smollm3(c: Any) -> dict:
    d = _llama_to_hf(c, "smollm3")
    nope = set(c.nope_layers or ())
    d.update(c.hf_extra)
    d.update(no_rope_layers=[int(i not in nope) for i in range(c.n_layer)], mlp_bias=False,
             use_sliding_window=c.sliding_window_size is not None, sliding_window=c.sliding_window_size)
    if c.layer_types is not None:
        d["layer_types"] = list(c.layer_types)
    return d


def _to_gemma(c: Any) -> dict:
    return dict(_llama_to_hf(c, "gemma"), hidden_activation=_hf_act(c.activation))


def _gemma_next_to_hf(c: Any, model_type: str) -> dict:
    scalar = c.hf_extra.get("query_pre_attn_scalar", round(c.attention_scale ** -2))
    d = dict(_to_gemma(c), model_type=model_type, query_pre_attn_scalar=scalar,
             attn_logit_softcapping=c.attn_softcap, final_logit_softcapping=c.final_softcap,
             sliding_window=c.sliding_window_size)
    if c.layer_types is not None:
        d["layer_types"] = list(c.layer_types)
    return d


def _to_gemma2(c: Any) -> dict:
    return _gemma_next_to_hf(c, "gemma2")


def _to_gemma3(c: Any) -> dict:
    d = _gemma_next_to_hf(c, "gemma3_text")
    d.pop("rope_theta")
    d.pop("rope_scaling", None)
    d["rope_parameters"] = {"full_attention": rope_to_hf(c.rope_base, c.rope_scaling),
                            "sliding_attention": rope_to_hf(c.rope_local_base, None)}
    return d


def _to_olmo2(c: Any) -> dict:
    d = _llama_to_hf(c, "olmo2")
    d.pop("head_dim")  # OLMo 2 has none of its own: hidden / heads
    return d


def _to_phi3(c: Any) -> dict:
    d = _llama_to_hf(c, "phi3")
    d.pop("attention_bias")  # Phi-3 has no such field (and no biases)
    d.update(c.hf_extra, partial_rotary_factor=c.rotary_percentage, sliding_window=c.sliding_window_size,
             original_max_position_embeddings=(c.rope_scaling or {}).get("original_max_position_embeddings",
                                                                         c.block_size))
    return d


def _to_stablelm(c: Any) -> dict:
    return dict(_common(c), model_type="stablelm", num_key_value_heads=c.n_query_groups,
                intermediate_size=c.intermediate_size,
                layer_norm_eps=c.norm_eps, hidden_act=_hf_act(c.activation), use_qkv_bias=c.attn_bias,
                partial_rotary_factor=c.rotary_percentage, use_parallel_residual=False, qk_layernorm=False)


def _to_gpt_neox(c: Any) -> dict:
    return dict(_common(c), model_type="gpt_neox", intermediate_size=c.intermediate_size, layer_norm_eps=c.norm_eps,
                hidden_act=_hf_act(c.activation), rotary_pct=c.rotary_percentage,
                partial_rotary_factor=c.rotary_percentage,
                rotary_emb_base=c.rope_base, use_parallel_residual=c.parallel_residual,
                attention_bias=c.hf_extra.get("attention_bias", True))


def _to_phi(c: Any) -> dict:
    return dict(_common(c), model_type="phi", num_key_value_heads=c.n_query_groups,
                intermediate_size=c.intermediate_size,
                layer_norm_eps=c.norm_eps, hidden_act=_hf_act(c.activation),
                partial_rotary_factor=c.rotary_percentage, qk_layernorm=False)


def _to_falcon(c: Any) -> dict:
    new = bool(c.hf_extra.get("new_decoder_architecture"))
    return dict(_common(c), model_type="falcon", num_kv_heads=c.n_query_groups, layer_norm_epsilon=c.norm_eps,
                bias=c.bias, parallel_attn=True, alibi=False, new_decoder_architecture=new,
                multi_query=c.hf_extra.get("multi_query", True),
                ffn_hidden_size=c.intermediate_size, activation=_hf_act(c.activation),
                num_ln_in_parallel_attn=(1 if c.shared_attention_norm else 2) if new else None)


# ---- the specs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FamilySpec:
    architecture: str  # transformers' class name, the first entry of config.json's `architectures`
    model_type: str  # config.json's `model_type`
    from_hf: Callable[[dict, str], dict]  # HF config dict (and the architecture, for messages) -> Config fields
    to_hf: Callable[[Any], dict]  # Config -> HF config dict
    weights: Callable[[Any], dict]  # Config -> weight names: layer, map, globals, qkv (layout), q_names
    gguf: Optional[str] = None  # llama.cpp's architecture name, where our GGUF export writes this family


def _fixed(names: dict) -> Callable[[Any], dict]:
    return lambda config: names


SPECS: dict[str, FamilySpec] = {s.architecture: s for s in (
    FamilySpec("LlamaForCausalLM", "llama", _map_llama, _to_llama, _fixed(_LLAMA_NAMES), "llama"),
    FamilySpec("MistralForCausalLM", "mistral", _map_llama, _to_mistral, _fixed(_LLAMA_NAMES), "llama"),
    FamilySpec("Qwen2ForCausalLM", "qwen2", _map_qwen2, _to_qwen2, _fixed(_LLAMA_NAMES), "qwen2"),
    FamilySpec("Qwen3ForCausalLM", "qwen3", _map_qwen3, _to_qwen3, _fixed(_QWEN3_NAMES), "qwen3"),
    FamilySpec("Qwen3MoeForCausalLM", "qwen3_moe", _map_qwen3_moe, _to_qwen3_moe, _fixed(_QWEN3_MOE_NAMES),
               "qwen3moe"),
    # llama.cpp's converter writes Mixtral as "llama" with experts (ffn_*_exps)
    FamilySpec("MixtralForCausalLM", "mixtral", _map_mixtral, _to_mixtral, _fixed(_MIXTRAL_NAMES), "llama"),
    FamilySpec("GptOssForCausalLM", "gpt_oss", _map_gpt_oss, _to_gpt_oss, _fixed(_GPT_OSS_NAMES), "gpt-oss"),
    FamilySpec("SmolLM3ForCausalLM", "smollm3", _map_smollm3, _to_smollm3, _fixed(_LLAMA_NAMES)),
    FamilySpec("GemmaForCausalLM", "gemma", _map_gemma, _to_gemma, _fixed(_LLAMA_NAMES)),
    FamilySpec("Gemma2ForCausalLM", "gemma2", _map_gemma2, _to_gemma2, _fixed(_GEMMA2_NAMES), "gemma2"),
    FamilySpec("Gemma3ForCausalLM", "gemma3_text", _map_gemma3, _to_gemma3, _fixed(_GEMMA3_NAMES), "gemma3"),
    FamilySpec("Olmo2ForCausalLM", "olmo2", _map_olmo2, _to_olmo2, _fixed(_OLMO2_NAMES)),
    FamilySpec("Phi3ForCausalLM", "phi3", _map_phi3, _to_phi3, _fixed(_PHI3_NAMES), "phi3"),
    FamilySpec("StableLmForCausalLM", "stablelm", _map_stablelm, _to_stablelm, _fixed(_LLAMA_NAMES)),
    FamilySpec("GPTNeoXForCausalLM", "gpt_neox", _map_gpt_neox, _to_gpt_neox, _fixed(_NEOX_NAMES)),
    FamilySpec("FalconForCausalLM", "falcon", _map_falcon, _to_falcon, _falcon_names),
    FamilySpec("PhiForCausalLM", "phi", _map_phi, _to_phi, _fixed(_PHI_NAMES)),
)}
MODEL_TYPE_TO_ARCH = {s.model_type: s.architecture for s in SPECS.values()}
# Architectures that are known and deliberately refused, with why (more helpful than "unsupported")
REFUSED = {
    "Gemma3nForCausalLM": "per-layer input embeddings (Gemma 3n) are not implemented",
    "Gemma4ForCausalLM": "per-layer input embeddings (Gemma 4) are not implemented",
    "Qwen3NextForCausalLM": "linear-attention hybrid layers (Qwen3-Next) are not implemented",
    "Qwen3_5ForCausalLM": "linear-attention hybrid layers (Qwen3.5) are not implemented",
    "Qwen2MoeForCausalLM": "mixtures of experts are not implemented yet",
    "OlmoeForCausalLM": "mixtures of experts are not implemented yet",
}




@dataclass(frozen=True)
class TextPart:
    """A multimodal architecture whose language model is one of the families above: its config.json holds that model
    under `text_config`, naming only what differs from the text config class's `defaults`, and its weight files name
    the text model's tensors with a prefix of their own (`renames`: (prefix there, prefix in the text model), first
    match wins; tensors matching none, the vision tower and projector, are not read)."""
    architecture: str
    model_type: str
    defaults: dict
    renames: tuple[tuple[str, str], ...]


# Only the text model is fine-tuned: the vision tower and projector are left out (images are not an input here)
TEXT_PARTS = {
    # Gemma3TextConfig's defaults (transformers 5.24) for the fields the mapping reads; the published 4B / 12B / 27B
    # files name their tensors language_model.model.* / language_model.lm_head.*, transformers 5 saves
    # model.language_model.* (the head tied)
    "Gemma3ForConditionalGeneration": TextPart(
        "Gemma3ForCausalLM", "gemma3_text",
        dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
             num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
             max_position_embeddings=131_072, rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256,
             sliding_window=4096, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0),
        (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
         ("model.language_model.", "model."))),
}


def text_part(hf: dict) -> dict:
    """The config.json of the model this tool trains: `hf` itself, or a multimodal one's text model (TEXT_PARTS)."""
    part = TEXT_PARTS.get(architecture_of(hf))
    if part is None:
        return hf
    text = hf.get("text_config") or {}
    if not isinstance(text, dict):
        raise UserError(f"config.json: text_config of {architecture_of(hf)} is not an object; download it again")
    # the multimodal model ties its head by its own field, whatever text_config says (as transformers does)
    tie = hf.get("tie_word_embeddings", part.defaults["tie_word_embeddings"])
    return {**part.defaults, **text, "tie_word_embeddings": tie, "architectures": [part.architecture],
            "model_type": part.model_type}


def spec(architecture: str) -> FamilySpec:
    if architecture not in SPECS:
        why = REFUSED.get(architecture)
        raise UserError(f"unsupported architecture {architecture!r}" + (f" ({why})" if why else "") +
                        f"; supported: {', '.join(sorted(SPECS))}")
    return SPECS[architecture]


def architecture_of(hf: dict) -> str:
    archs = hf.get("architectures") or []
    return archs[0] if archs else MODEL_TYPE_TO_ARCH.get(hf.get("model_type", ""), hf.get("model_type") or "")
