"""Tiny Hugging Face models of every supported family, built locally with random weights (no downloads), and the
small helpers the model, LoRA, PEFT and merge tests share, and bitsandbytes' own layers as the quantization
reference."""
from __future__ import annotations

import contextlib
import copy
import functools
import io
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

import torch
from safetensors.torch import load_file

from lit_qlora.adapter import Adapter
from lit_qlora.checkpoint import LIT_CONFIG, LIT_WEIGHTS
from lit_qlora.config import Config
from lit_qlora.convert import convert_hf_checkpoint
from lit_qlora.loader import load_model
from lit_qlora.lora import LoRAConfig, lora_modules
from lit_qlora.model import GPT
from lit_qlora.quant.quantize import load_bnb

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 320  # every tiny config
ALL = dict(query=True, key=True, value=True, projection=True, mlp=True, head=True)


# Small but not degenerate: GQA where the family has it, partial rotary, biases, an intermediate size % 64 == 0
TINY_HF_CONFIGS: dict[str, dict] = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=320, hidden_size=64,
                  intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False),
    "llama3": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=320, hidden_size=64,
                   intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                   rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=16)),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=320, hidden_size=64,
                    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=128, sliding_window=8, tie_word_embeddings=False),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=320, hidden_size=64,
                  intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False),
    "gemma": dict(architectures=["GemmaForCausalLM"], model_type="gemma", vocab_size=320, hidden_size=64,
                  intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                  max_position_embeddings=128,
                  rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh"),
    "gpt_neox": dict(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox", vocab_size=320, hidden_size=64,
                     intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                     rotary_pct=0.25, partial_rotary_factor=0.25, use_parallel_residual=True, hidden_act="gelu",
                     tie_word_embeddings=False),
    "falcon7b": dict(architectures=["FalconForCausalLM"], model_type="falcon", vocab_size=320, hidden_size=64,
                     num_hidden_layers=2, num_attention_heads=4, multi_query=True, new_decoder_architecture=False,
                     parallel_attn=True, bias=False, alibi=False, max_position_embeddings=128),
    "falcon40b": dict(architectures=["FalconForCausalLM"], model_type="falcon", vocab_size=320, hidden_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                      parallel_attn=True, bias=False, alibi=False, max_position_embeddings=128),
    "phi": dict(architectures=["PhiForCausalLM"], model_type="phi", vocab_size=320, hidden_size=64,
                intermediate_size=256,
                num_hidden_layers=2, num_attention_heads=4, partial_rotary_factor=0.5, max_position_embeddings=128,
                hidden_act="gelu_new", tie_word_embeddings=False),
    "stablelm": dict(architectures=["StableLmForCausalLM"], model_type="stablelm", vocab_size=320, hidden_size=64,
                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                     partial_rotary_factor=0.25, use_qkv_bias=True, max_position_embeddings=128,
                     tie_word_embeddings=False),
    # ---- the families of issue 33: each with the feature that sets it apart switched on where a test can see it
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=320, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=24, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  tie_word_embeddings=True, use_sliding_window=False),
    "mistral_nemo": dict(architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=320, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=128, sliding_window=None, tie_word_embeddings=False),
    # soft-caps small enough to clip; a sliding window (layer 0) shorter than the test sequences
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=320, hidden_size=64,
                   intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=1.5,
                   final_logit_softcapping=3.0, max_position_embeddings=128, hidden_activation="gelu_pytorch_tanh",
                   tie_word_embeddings=False),
    # 2 sliding layers and a full one with its own RoPE base and linear scaling; head_dim * heads != hidden
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=320, hidden_size=64,
                   intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                   head_dim=32, query_pre_attn_scalar=32, sliding_window=8, max_position_embeddings=128,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
                   tie_word_embeddings=False),  # tied, greedy decoding of this tiny model repeats one token
    "olmo2": dict(architectures=["Olmo2ForCausalLM"], model_type="olmo2", vocab_size=320, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # layer 1 without RoPE; yarn that changes the frequencies at any length
    "smollm3": dict(architectures=["SmolLM3ForCausalLM"], model_type="smollm3", vocab_size=320, hidden_size=64,
                    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=64, no_rope_layers=[1, 0], tie_word_embeddings=True, pad_token_id=None,
                    bos_token_id=None, eos_token_id=None,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                     "rope_theta": 10000.0}),
    # Phi-3: fused qkv_proj and gate_up_proj; longrope (short factors here, long ones in test_families) on half of
    # each head (partial rotary); a sliding window shorter than the test sequences
    "phi3": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=320, hidden_size=64,
                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=128, original_max_position_embeddings=32, partial_rotary_factor=0.5,
                 sliding_window=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0]}),
    # Phi-4-mini's shape of it: a tied head, 3/4 of each head rotated, no sliding window
    "phi4_mini": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=320, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                      max_position_embeddings=128, original_max_position_embeddings=32, partial_rotary_factor=0.75,
                      sliding_window=None, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                       "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
                                       "long_factor": [1.0, 2.0, 3.0, 5.0, 8.0, 13.0]}),
    # ---- mixtures of experts (issue 34): few experts, top-2 routing, so several experts get tokens and some none
    # Qwen3-MoE: Qwen3's QK-norm; layer 1 a dense MLP (mlp_only_layers), the top-2 weights renormalized
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=320, hidden_size=64,
                      intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=128,
                      rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, use_sliding_window=False),
    # Mixtral: every layer 4 experts of intermediate_size, top 2, softmax then the top 2 renormalized
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=320, hidden_size=64,
                    intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                    rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False),
    # gpt-oss: attention sinks and biases, a sliding layer (window 8, shorter than the test sequences) then a full
    # one, its published YaRN; 4 biased experts of 32 behind a biased router, top 2 (softmax over the top-2 logits);
    # a SwiGLU clamp low enough (2) that the tiny model's gates and ups reach it, and a gain other than the default
    "gpt_oss": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=320, hidden_size=64,
                    intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=131072,
                    swiglu_limit=2.0, swiglu_alpha=1.5, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 4096,
                                     "rope_theta": 150000.0}),
    # longrope: the short factors (every test sequence is within original_max_position_embeddings; the long ones are
    # tested in test_model)
    "llama_longrope": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=320, hidden_size=64,
                           intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=128, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                            "original_max_position_embeddings": 32,
                                            "short_factor": [1.0, 1.5, 2.0, 1.0, 3.0, 1.2, 1.0, 4.0],
                                            "long_factor": [2.0, 3.0, 5.0, 8.0, 1.0, 9.0, 2.0, 6.0]}),
}


def make_tiny_hf_model(kind: str, folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """Build a random tiny transformers model of `kind`, save it (config.json + safetensors) and return it."""
    import transformers

    cfg_dict = {**TINY_HF_CONFIGS[kind], **overrides}
    cfg_cls = transformers.AutoConfig.for_model(cfg_dict["model_type"]).__class__
    cfg = cfg_cls(**{k: v for k, v in cfg_dict.items() if k != "model_type"})
    torch.manual_seed(seed)
    model = getattr(transformers, cfg_dict["architectures"][0])(cfg)
    with torch.no_grad():  # default inits leave norms at 1 and biases at 0: randomize so bugs show up
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model = model.to(dtype).eval()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return model


def lora_cfg(**targets) -> LoRAConfig:
    flags = {k: False for k in ALL}
    flags.update(targets or ALL)
    return LoRAConfig(r=4, alpha=8, dropout=0.0, **flags)


def random_tokens(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def randomize_lora(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) * 0.1)
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.1)


def lora_grads(model) -> dict[str, torch.Tensor]:
    """Every LoRA module's A and B gradients (cloned), then cleared for the next backward."""
    out = {}
    for name, m in lora_modules(model).items():
        out[f"{name}.A"], out[f"{name}.B"] = m.lora_A.grad.clone(), m.lora_B.grad.clone()
        m.lora_A.grad = m.lora_B.grad = None
    return out


def random_adapter(folder: Path, seed: int = 0, **targets) -> Adapter:
    """An adapter of the checkpoint in `folder` on `targets` (LoRAConfig's flags) with random A and B (B not zero: the
    update is real)."""
    lora = LoRAConfig(r=4, alpha=8, dropout=0.0, **targets)
    model = load_model(folder, precision="32-true", lora=lora, seed=seed)
    randomize_lora(model, seed)
    return Adapter.of_model(model, lora)


def adapter_of(model, lora: LoRAConfig) -> Adapter:
    return Adapter.of_model(model, lora)


def hf_model(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_4bit(folder: Path, mode: str = "bnb.nf4"):
    """transformers + bitsandbytes' own 4-bit model of `folder` (what a QLoRA user of HF PEFT starts from), fp32
    compute, in eval mode, computing as on every CPU: dequantized weight, fp32 matmul. On a CPU with AVX512-BF16,
    bitsandbytes would repack each 4-bit layer at its first eval-mode forward and compute it in bf16 from then on
    (logits ~1e-3 away from the fp32 product, and an assertion on a layer whose out_features is not a multiple of
    32), which is another function than the one being compared. And there bitsandbytes 0.50's CPU kernel
    dequantizes a layer whose in_features is not a multiple of 64 with its blocks taken per row, not as the flat
    tensor was quantized (tests/test_quantize.py shows it), so such a layer computes with bitsandbytes' own
    dequantization of its bytes taken flat, the layout they were quantized in."""
    import warnings

    import transformers

    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4" if "nf4" in mode else "fp4",
                                             bnb_4bit_use_double_quant=mode.endswith("-dq"),
                                             bnb_4bit_compute_dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map={"": "cpu"},
                                                                  quantization_config=config).eval()
    F = load_bnb().functional
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
            if m.in_features % 64:
                state = copy.copy(m.weight.quant_state)
                state.shape = torch.Size([m.weight.quant_state.shape.numel()])
                w = F.dequantize_4bit(m.weight.data.reshape(-1), state).reshape(m.weight.quant_state.shape)
                m.forward = functools.partial(torch.nn.functional.linear, weight=w, bias=m.bias)
    return model


def run_in_process(script: "Path | str", *args) -> SimpleNamespace:
    """A script's CLI (argument parsing included) in this process, as `python script args` would run it but without
    a fresh interpreter's seconds: (returncode, stderr). `script`: a path, or a name under scripts/. For the exit path
    of a real process (signals, imports at start-up) use helpers_train.run_script."""
    path = Path(script) if Path(script).is_absolute() else ROOT / "scripts" / script
    argv, err, code = sys.argv, io.StringIO(), 0
    sys.argv = [str(path), *map(str, args)]
    try:
        with contextlib.redirect_stderr(err):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
    sys.stderr.write(err.getvalue())  # still visible to capsys / on failure
    return SimpleNamespace(returncode=code, stderr=err.getvalue())


def run_script_here(name: str, *args) -> int:
    """`run_in_process`'s exit code."""
    return run_in_process(name, *args).returncode


def converted_tiny(tmp_path_factory, kind: str, name: str, **overrides) -> SimpleNamespace:
    """A tiny HF model of `kind`, saved under `name` and converted: (kind, folder, config)."""
    folder = tmp_path_factory.mktemp("ckpt") / name
    make_tiny_hf_model(kind, folder, **overrides)
    convert_hf_checkpoint(folder)
    return SimpleNamespace(kind=kind, folder=folder, config=load_model(folder, precision="32-true").config)


def load_ours(folder: Path) -> GPT:
    """Our GPT with the converted weights of `folder`, in fp32, loaded without the loader (plain load_state_dict)."""
    config = Config.from_file(folder / LIT_CONFIG)
    model = GPT(config)
    missing, unexpected = model.load_state_dict(load_file(folder / LIT_WEIGHTS), strict=False)
    assert not unexpected
    assert set(missing) == ({"lm_head.weight"} if config.tie_embeddings else set())  # tied: stored once, as wte
    return model.eval()


# ---- bitsandbytes references (tests/test_quantize.py, tests/test_prequantized.py) -------------------------------
def reference_layer(mode: str, w: torch.Tensor, compute_dtype: torch.dtype,
                    parts: Optional[Sequence[int]] = None) -> "torch.nn.Module | list[torch.nn.Module]":
    """A bitsandbytes layer built the way its documentation does it, from the full-precision weight `w` [out, in].
    With `parts` (the rows of each HF tensor a fused layer stacks, `quantize.quantized_parts`) and a 4-bit mode: a
    list, one such layer per part, as transformers + bitsandbytes quantize q_proj, k_proj and v_proj apart (int8
    scales each row on its own: one layer)."""
    import bitsandbytes as bnb

    if parts and mode != "bnb.int8":
        return [reference_layer(mode, p, compute_dtype) for p in w.split(list(parts))]
    out_f, in_f = w.shape
    if mode == "bnb.int8":
        ref = bnb.nn.Linear8bitLt(in_f, out_f, bias=False, has_fp16_weights=False, threshold=6.0)
        ref.weight = bnb.nn.Int8Params(w.clone(), requires_grad=False, has_fp16_weights=False)
    else:
        quant_type = "nf4" if "nf4" in mode else "fp4"
        dq = mode.endswith("-dq")
        ref = bnb.nn.Linear4bit(in_f, out_f, bias=False, compute_dtype=compute_dtype, quant_type=quant_type,
                                compress_statistics=dq)
        ref.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type=quant_type, compress_statistics=dq)
    return ref.to("cpu")


def _packed_parts(layer: torch.nn.Module) -> list[tuple[torch.Tensor, object]]:
    """(packed bytes, QuantState) of each separately quantized part of a loaded 4-bit layer, in row order."""
    from lit_qlora.quant.quantize import PartsQuantState

    state, data = layer.weight.quant_state, layer.weight.data.reshape(-1).view(torch.uint8)
    if not isinstance(state, PartsQuantState):
        return [(data, state)]
    out, byte = [], 0
    for rows, part in state.parts:
        n = (rows * layer.in_features + 1) // 2
        out.append((data[byte:byte + n], part))
        byte += n
    assert byte == data.numel()
    return out


def bnb_dequantized(layer: torch.nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """bitsandbytes' own dequantization (`functional.dequantize_4bit`, of the flat blocks the weight was quantized
    in) of a loaded 4-bit layer's weight [out, in], part by part where it was quantized part by part."""
    import copy

    import bitsandbytes as bnb

    flat = []
    for data, state in _packed_parts(layer):
        state = copy.copy(state)
        state.shape, state.dtype = torch.Size([data.numel() * 2]), dtype
        flat.append(bnb.functional.dequantize_4bit(data, state).reshape(-1))
    return torch.cat(flat)[:layer.out_features * layer.in_features].view(layer.out_features, layer.in_features)


def assert_same_stored(ours: torch.nn.Module, ref: "torch.nn.Module | list[torch.nn.Module]") -> None:
    """`ours` stores what the bitsandbytes layer `ref` stores, or with a list (`reference_layer` with parts) what
    each part's layer stores, part after part."""
    from lit_qlora.quant.quantize import PartsQuantState

    if isinstance(ref, list):
        parts = _packed_parts(ours)
        assert isinstance(ours.weight.quant_state, PartsQuantState) and len(parts) == len(ref)
        for (data, state), r in zip(parts, ref):
            view = SimpleNamespace(weight=SimpleNamespace(data=data.view(r.weight.data.dtype).view(r.weight.data.shape),
                                                          quant_state=state))
            assert_same_stored(view, r)
        return
    if isinstance(getattr(ref.weight, "quant_state", None), PartsQuantState):  # another layer of ours
        theirs = _packed_parts(ref)
        return assert_same_stored(ours, [SimpleNamespace(weight=SimpleNamespace(data=d.unsqueeze(1), quant_state=st))
                                         for d, st in theirs])
    assert not isinstance(getattr(ours.weight, "quant_state", None), PartsQuantState), "quantized part by part"
    assert torch.equal(ours.weight.data, ref.weight.data)
    qs, rs = getattr(ours.weight, "quant_state", None), getattr(ref.weight, "quant_state", None)
    if qs is None:  # int8: the per-row scales
        assert torch.equal(ours.weight.SCB, ref.weight.SCB)
        return
    assert torch.equal(qs.absmax, rs.absmax) and torch.equal(qs.code, rs.code)
    assert qs.nested == rs.nested and qs.quant_type == rs.quant_type and qs.blocksize == rs.blocksize
    if qs.nested:
        assert torch.equal(qs.state2.absmax, rs.state2.absmax) and torch.equal(qs.offset, rs.offset)
