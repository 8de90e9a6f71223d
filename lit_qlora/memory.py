"""Predict the peak memory of a LoRA / QLoRA training run from the model config and the settings alone.

    peak = runtime + frozen weights (quantized + dense) + LoRA weights, gradients and optimizer state
           + activations of one micro-batch at their peak (saved for backward + logits + the largest temporary)

What is predicted is what finetune/lora.py reports as "Memory used": peak resident set size on CPU,
`torch.cuda.max_memory_allocated` on CUDA. Nothing is loaded: the shapes come from `Config`, and every term
mirrors what actually exists during training:

- quantized weights: the bytes bitsandbytes keeps per layer (4-bit: packed nibbles + one fp32 absmax per
  64-value block, or with double quantization one uint8 absmax per block + fp32 scales per 256 blocks; int8:
  one byte per value + one fp32 scale per output row), see `QuantMode.layer_bytes`; a mixture of experts stores
  every expert (one such layer per expert and projection) and keeps its router dense;
- dense weights in the dtypes of `lit_qlora.quant.quantize.Precision` (under *-mixed frozen Linear weights are in
  the low dtype, embeddings and norms in fp32);
- LoRA weights and gradients in the trainable dtype, optimizer state as each optimizer allocates it;
- activations: the tensors autograd saves in `lit_qlora.model.GPT`'s forward (walked layer by layer in
  `_block_saved` as the config shapes each block: pre- and post-norms, q / k norms, each layer's RoPE or none, its
  sliding window's mask, the attention kernel or Gemma 2's eager soft-capped attention in `_attention_saved`; a
  mixture of experts' layer: the router's probabilities and choices, and the top-k experts' activations of every
  token, with a LoRA on the experts each pair's, `_moe_saved`), what the loss keeps (with a frozen dense head, the
  default: the gradient of the final hidden states, one chunk of logits existing at a time in forward; with a
  quantized head or a LoRA on it: the logits and a log-sum-exp per position), and the largest temporary alive at
  the peak (one chunk of logits with its fp32 softmax, a dequantized 4-bit/int8 weight (one expert's at a time), the
  gradients inside one block's backward).

The activation terms match the bytes autograd really saves (tests/test_memory.py compares them through
saved-tensor hooks) and, with the temporaries, the peak of live tensors measured with torch's profiler. On CPU
two measured terms come on top (scripts/bench/bench_estimator.py): the runtime (interpreter, torch, Lightning,
bitsandbytes, thread pools) and glibc's heap slack (`_allocator_slack`). Not modelled: oneDNN's per-shape
caches, which grow the CPU resident size over the first iterations when batches come in many different
lengths (up to a few hundred MB), so variable-length data on CPU can peak above the estimate.

Sharded (`--strategy fsdp`, `shard_world` ranks): the figures are per rank. Every parameter is split along its first
dimension into `shard_world` equal pieces (the last one padded, as FSDP2 allocates them), the 4-bit layers' packed
bytes included; their block scales stay whole on every rank (lit_qlora/distributed.py). LoRA gradients and optimizer
state are sharded alike. On top comes what FSDP gathers for compute ("gathered weights (fsdp)"): the root unit
(embeddings, final norm, head), which stays gathered through the step, plus two transformer blocks at once (the one
computing and the next one being gathered; also the gather buffer of one block).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil
import torch
import torch.nn as nn

from lit_qlora.checkpoint import LIT_CONFIG
from lit_qlora.config import Config
from lit_qlora.kernels import cpu_half
from lit_qlora.kernels.cpu_attention import RECOMPUTE_BELOW
from lit_qlora.lora import LoRAConfig, LoRAExperts, LoRALinear, lora_targets, meta_model
from lit_qlora.losses import head_chunk_rows
from lit_qlora.model import ExpertWeights
from lit_qlora.precision import Precision, parse_precision
from lit_qlora.quant.quant_mode import QuantMode
from lit_qlora.quant.quantize import CPU_QUANTIZE_CHUNK, quantized_parts
from lit_qlora.utils import UserError

GiB = 2**30
MiB = 2**20

# Measured on CPU (scripts/bench/bench_estimator.py --calibrate_runtime): peak RSS of a training run of a ~0-size
# model: Python, torch, Lightning, jsonargparse, tokenizers, oneDNN/OpenMP buffers after the first steps.
CPU_RUNTIME_BYTES = int(0.376 * GiB)
CPU_RUNTIME_BNB_BYTES = int(0.047 * GiB)  # extra when bitsandbytes is imported (quantization or its optimizers)
CPU_HEAP_FIXED = int(0.03 * GiB)  # glibc heap slack (see `_allocator_slack`), fitted on measured runs
CPU_HEAP_SLACK = 0.6  # ... per byte of sub-threshold tensors alive at the peak
CPU_DEQUANT_CHURN = 2.5  # ... per byte of the largest sub-threshold dequantized weight (quantized layers)
# Allocations from this size up are mmapped and unmapped when freed, so they leave no heap slack: finetune/lora.py
# fixes glibc's threshold at 32 MiB on CPU (lit_qlora.utils.tune_cpu_allocator), the most its adaptive one reaches.
GLIBC_MMAP_THRESHOLD_MAX = 32 * MiB
CUDA_RUNTIME_BYTES = 64 * MiB  # cuBLAS workspaces and small buffers that go through the caching allocator
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes' 8-bit optimizers keep fp32 state for smaller tensors
BNB_OPTIM_BLOCKSIZE = 256


# ---- weights -----------------------------------------------------------------------------------
def _int8(quantize: Optional[QuantMode]) -> bool:
    return quantize is not None and quantize.is_int8


def _shard_rows(rows: int, world: int) -> int:
    """Rows of one rank's shard of a tensor split along dim 0 over `world` ranks (FSDP2 pads every rank to this)."""
    return -(-rows // world)


def _dtype_bytes(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def weight_bytes(config: Config, lora: LoRAConfig, precision: str, quantize: "str | QuantMode | None",
                 quantize_lm_head: Optional[bool] = None, shard_world: int = 1) -> dict:
    """Quantized and dense bytes of the frozen model, the LoRA parameter count and the quantized layer shapes; with
    `shard_world` > 1 also what one rank holds of them under FSDP ("*_rank": rank 0's shard, the largest)."""
    prec, quantize = parse_precision(precision), QuantMode.parse(quantize)
    model = meta_model(config, lora)
    quantize_lm_head = bool(quantize_lm_head)
    linear_b, other_b = _dtype_bytes(prec.frozen_linear_dtype), _dtype_bytes(prec.frozen_other_dtype)
    quant, quant_params, dense, lora_numels = 0, 0, 0, []
    quant_rank, dense_rank, lora_rank_numels = 0, 0, []
    unit_bytes: dict[str, int] = {}  # FSDP unit ("root" or block index) -> bytes of its gathered parameters
    quantized_shapes: list[tuple[str, int, int]] = []
    seen: set[int] = set()
    for name, m in model.named_modules():
        parent_is_lora = isinstance(m, (LoRALinear, LoRAExperts))  # (experts: a pair per expert, [E, ...])
        unit = name.split(".")[2] if name.startswith("transformer.h.") else "root"
        if parent_is_lora:
            lora_numels += [m.lora_A.numel(), m.lora_B.numel()]
            lora_rank_numels += [_shard_rows(p.shape[0], shard_world) * (p.numel() // p.shape[0])
                                 for p in (m.lora_A, m.lora_B)]
            unit_bytes[unit] = unit_bytes.get(unit, 0) + (m.lora_A.numel() + m.lora_B.numel()) * _dtype_bytes(
                prec.trainable_dtype)
            continue
        base_name = name[:-len(".base")] if name.endswith(".base") else name
        for pname, p in m._parameters.items():
            if p is None:
                continue
            # a mixture's stacked experts [E, out, in] are Linear weights (one bitsandbytes layer per expert under
            # --quantize); its router stays a dense Linear (quantize.swap_linears)
            is_experts = type(m) is ExpertWeights
            is_linear = type(m) is nn.Linear or is_experts
            quantized = (quantize is not None and is_linear and pname == "weight" and not name.endswith(".router")
                         and (quantize_lm_head or base_name.split(".")[0] != "lm_head"))
            if id(p) in seen and not quantized:  # a tied head that is quantized is its own tensor (the loader's)
                continue
            seen.add(id(p))
            if quantized:
                n_layers, (out_f, in_f) = (p.shape[0], tuple(p.shape[1:])) if is_experts else (1, tuple(p.shape))
                parts = quantized_parts(config, base_name) if quantize.is_4bit else None  # (each its own state)
                layer = sum(quantize.layer_bytes(n, in_f) for n in (parts or [out_f])) * n_layers
                packed = -(-out_f * in_f // 2) * n_layers if quantize.is_4bit else p.numel()  # the sharded part
                quant += layer
                quant_rank += layer - packed + _shard_rows(packed, shard_world)
                quant_params += p.numel()
                quantized_shapes.append((base_name, out_f, in_f))  # (experts: each one's, dequantized one at a time)
                unit_bytes[unit] = unit_bytes.get(unit, 0) + packed
            else:
                size = linear_b if is_linear else other_b
                dense += p.numel() * size
                dense_rank += _shard_rows(p.shape[0], shard_world) * (p.numel() // p.shape[0]) * size
                unit_bytes[unit] = unit_bytes.get(unit, 0) + p.numel() * size
    blocks = [v for k, v in unit_bytes.items() if k != "root"]
    return dict(quantized=quant, quantized_params=quant_params, dense=dense, lora_numels=lora_numels,
                quantized_shapes=quantized_shapes, quantized_rank=quant_rank, dense_rank=dense_rank,
                lora_rank_numels=lora_rank_numels, root_unit=unit_bytes.get("root", 0),
                block_unit=max(blocks, default=0))


def optimizer_state_bytes(optimizer: str, numels: list[int], param_bytes: int, device_type: str = "cpu") -> int:
    """Bytes of optimizer state for trainable tensors of the given sizes."""
    total = 0
    for n in numels:
        if optimizer == "AdamW":  # torch keeps exp_avg and exp_avg_sq in the parameter's dtype
            total += 2 * n * param_bytes + 4
        elif optimizer in ("AdamW8bit", "PagedAdamW8bit") and n >= BNB_MIN_8BIT_SIZE:
            paged = optimizer.startswith("Paged") and device_type == "cuda" and n >= 1e5
            total += (0 if paged else 2 * n) + 2 * 4 * -(-n // BNB_OPTIM_BLOCKSIZE)
        else:  # bitsandbytes' 32-bit state (and the 8-bit optimizers below min_8bit_size): two fp32 buffers
            paged = optimizer.startswith("Paged") and device_type == "cuda" and n >= 1e5
            total += 0 if paged else 2 * 4 * n  # paged buffers live in CUDA unified memory, outside "allocated"
    return total


# ---- activations ---------------------------------------------------------------------------------
# Activations are collected as lists of tensor sizes (bytes): the CPU allocator treats small and large tensors
# differently (see `_allocator_slack`).
@dataclass
class _Dims:
    """Shapes and byte sizes of one micro-batch's tensors."""
    B: int
    T: int
    a: int  # bytes of a matmul output (the compute dtype)
    r: int  # bytes of the residual stream and norm outputs (fp32 under *-mixed: embeddings stay fp32)
    mask: int  # bytes per element of nn.Dropout's mask: 1 on CUDA (bool), 0 on CPU (the input's dtype)
    cpu_attention: bool  # lit_qlora.kernels.cpu_attention's path (CPU, bf16-true training)
    cpu_half: bool  # kernels.cpu_half's fp32 kernels (CPU without native 16-bit matmuls, *-true): wins over the above
    mixed: bool
    lora_dropout: bool
    t: int = 4  # bytes of a trainable (LoRA) weight: DoRA's factor and the sum it multiplies are in that dtype
    w_norm: int = 4  # bytes of a norm's weight (the frozen dense dtype)

    @property
    def N(self) -> int:
        return self.B * self.T


def _norm_saved(c: Config, d: _Dims, input_shared: bool = False, size: Optional[int] = None,
                rows: Optional[int] = None, in_bytes: Optional[int] = None) -> list[int]:
    """What a norm (model.make_norm) of `size` features saves over `rows` rows (default: the residual stream's,
    [N, n_embd] in d.r bytes); `input_shared`: its input is already saved by something else reading it (the other
    norm of a parallel block, the qkv output that attention keeps)."""
    rows, size, in_bytes = rows or d.N, size or c.n_embd, in_bytes or d.r
    if c.norm_class == "RMSNorm":
        # x.float() is x itself in fp32 (the input is what is saved), else an fp32 copy; then 1/rms per row
        s = ([] if input_shared and in_bytes == 4 else [rows * size * 4]) + [rows * 4]
        if c.norm_unit_offset or (c.norm_fp32_scale and d.w_norm != 4):
            s.append(size * 4)  # Gemma's (1 + w) in fp32, OLMo 2's fp32 copy of a 16-bit w: what multiplies x
        return s
    return ([] if input_shared else [rows * size * in_bytes]) + [rows * in_bytes] * 2  # LayerNorm: input, mean, rstd


def _attention_saved(c: Config, d: _Dims, i: int, seen: set, masks: set) -> list[int]:
    """What layer i's attention saves for backward between its qkv and output projections (q / k norms, RoPE, the
    attention kernel of `CausalSelfAttention.attend`), its qkv output needing grad. Each saved storage is counted
    once (`store`): q, k and v are views of the qkv output until a norm or RoPE makes them new tensors. Adds "y" to
    `seen` where the output projection's input is a view of the attention output saved here; `masks`: the sliding
    windows whose boolean mask an earlier layer saved already (one per window per forward)."""
    q_b = d.N * c.n_head * c.head_size * d.a
    sizes = {"qkv": d.N * sum(c.qkv_sizes) * d.a, "q": q_b, "k": d.N * c.n_query_groups * c.head_size * d.a}
    store, small, (q_at, k_at), contiguous = _qk_saved(c, d, i, sizes)
    window = c.layer_window(i)
    masked = window is not None and d.T > window  # GPT._mask: a mask only where the window is shorter than the row
    if c.attn_softcap is not None:
        return _softcapped_saved(c, d, store, sizes, small) + _new_mask(masked, window, masks, d.T * d.T)
    if c.attn_sinks:
        return small + _sinks_saved(c, d, seen)
    if d.cpu_half:
        # cpu_half's attention keeps only q, k (G heads) and v (a copy: CausalSelfAttention.forward) and recomputes
        # in backward (its mask an attribute)
        store.update({q_at: sizes[q_at], k_at: sizes[k_at], "v": sizes["k"]})
        return list(store.values()) + small
    return _sdpa_saved(c, d, store, sizes, small, (q_at, k_at), masked, contiguous, seen)


def _qk_saved(c: Config, d: _Dims, i: int, sizes: dict) -> tuple[dict, list[int], tuple[str, str], bool]:
    """What the q / k norms save, and where q and k live after them and RoPE: (storages, small tensors, the storages
    q and k are views of, whether q is laid out [B, H, T, hs] rather than as a view of a [B, T, ...] tensor)."""
    store: dict[str, int] = {}
    small: list[int] = []
    q_at = k_at = "qkv"
    contiguous = False
    if c.qk_norm:
        # Qwen3 / Gemma 3 normalize each head of q and k, OLMo 2 the whole projections; fp32: the input saved is a
        # view of the qkv output
        per_head = c.qk_norm == "head"
        for n in (c.n_head, c.n_query_groups):
            small += _norm_saved(c, d, input_shared=True, size=c.head_size if per_head else n * c.head_size,
                                 rows=d.N * n if per_head else d.N, in_bytes=d.a)
        if d.a == 4:
            store["qkv"] = sizes["qkv"]
        q_at, k_at, contiguous = "q", "k", per_head
    if c.rope_n_elem and c.layer_rope(i) is not None:
        q_at, k_at = "q", "k"  # rotated: new tensors, in the layout of their input
    return store, small, (q_at, k_at), contiguous


def _new_mask(masked: bool, window: Optional[int], masks: set, mask_bytes: int) -> list[int]:
    """The boolean mask softcapped attention keeps: a new causal one per layer, a sliding window's once per forward
    (recorded in `masks`)."""
    if masked and window in masks:
        return []
    if masked:
        masks.add(window)
    return [mask_bytes]


def _softcapped_saved(c: Config, d: _Dims, store: dict, sizes: dict, small: list[int]) -> list[int]:
    """model.softcapped_attention, eager: the matmuls keep q and k^T (k, v repeated to every head first), the
    soft-cap its tanh, the fp32 softmax its output, the last matmul the probabilities (a copy in q's dtype) and v
    (the boolean mask: `_new_mask`)."""
    rep = c.n_head // c.n_query_groups
    q_b, kv_b = sizes["q"], sizes["k"]
    store["q_mm"] = q_b
    store["k_mm"] = q_b if rep > 1 else kv_b
    if rep > 1:
        store["v_mm"] = q_b
    else:  # v, copied out of the qkv output in training (CausalSelfAttention.forward)
        store["v_mm"] = kv_b
    scores = d.B * c.n_head * d.T * d.T
    return list(store.values()) + small + [scores * d.a, scores * 4 + (scores * d.a if d.a != 4 else 0)]


def _sinks_saved(c: Config, d: _Dims, seen: set) -> list[int]:
    """model.sink_attention (gpt-oss): k and v with a zero row appended (new tensors) and the float mask that carries
    the sink logits, [1, H, T, T + 1], built by each layer, all kept by SDPA with q, its output and the log-sum-exp;
    cpu_half's path runs it on fp32 copies of q, k and v."""
    B, T, H, G, hs = d.B, d.T, c.n_head, c.n_query_groups, c.head_size
    ab = 4 if d.cpu_half else d.a
    if not d.cpu_half:
        seen.add("y")  # (as in `_sdpa_saved`: the output is in q's layout)
    return [d.N * H * hs * ab, 2 * B * G * (T + 1) * hs * ab, d.N * H * hs * ab, B * H * T * 4, H * T * (T + 1) * ab]


def _sdpa_saved(c: Config, d: _Dims, store: dict, sizes: dict, small: list[int], at: tuple[str, str], masked: bool,
                contiguous: bool, seen: set) -> list[int]:
    """Attention keeps q and k (rotated), v, its output and the fp32 log-sum-exp. SDPA takes the keys and values at
    G heads (enable_gqa); v is copied out of the qkv output (which would else stay alive whole). cpu_attention's bf16
    path (no mask) repeats k and v to every head first, so with GQA k and v are their own tensors there."""
    q_b = sizes["q"]
    store[at[0]] = sizes[at[0]]
    if c.n_query_groups != c.n_head and d.cpu_attention and not masked:
        store["k_rep"], store["v_rep"] = q_b, q_b
    else:
        store[at[1]] = sizes[at[1]]
        store["v"] = sizes["k"]
    store["out"] = q_b
    small.append(d.B * c.n_head * d.T * 4)
    if masked:
        small.append(d.T * d.T * d.a)  # SDPA keeps the boolean mask converted to q's dtype, each layer its own copy
    if not contiguous:
        # the projection's input is a view of the attention output saved here (SDPA writes it in q's layout,
        # [B, T, H, hs] when q is a view of a [B, T, ...] tensor; normalized per head, q is contiguous
        # [B, H, T, hs] and the projection's input a copy)
        seen.add("y")
    return list(store.values()) + small


def _linear_saved(name: str, in_f: int, out_f: int, grad_in: bool, d: _Dims, targets: dict, lora: LoRAConfig,
                  quantize: Optional[QuantMode], in_bytes: int, saved_inputs: set, input_name: str,
                  int8_inputs: Optional[dict] = None) -> tuple[list[int], bool]:
    """What a (LoRA-wrapped, maybe quantized) Linear saves for backward, and whether its output needs grad.

    `int8_inputs` collects the inputs bitsandbytes' int8 layers keep as `ctx.A`: a plain attribute, not a saved
    tensor, so activation checkpointing does not free them."""
    s: list[int] = []
    N = d.N
    if _int8(quantize) and grad_in and int8_inputs is not None:
        int8_inputs[input_name] = N * in_f * in_bytes
    if _int8(quantize) and grad_in and input_name not in saved_inputs:
        s.append(N * in_f * in_bytes)  # bitsandbytes' int8 matmul keeps its input (ctx.A) for a weight gradient
        saved_inputs.add(input_name)
    if name not in targets:
        return s, grad_in
    parts = targets[name]
    n_parts = len(parts) if parts else 1
    if lora.dora:
        return s + _dora_saved(in_f, out_f, parts, grad_in, d, lora, in_bytes, saved_inputs, input_name), True
    if d.lora_dropout and not d.mixed:
        # lora._DropoutMatmul: the input itself (unless kept already) and a one-byte mask
        s.append(N * in_f)
        if input_name not in saved_inputs:
            s.append(N * in_f * in_bytes)
            saved_inputs.add(input_name)
    elif d.lora_dropout:  # under autocast the plain ops: nn.Dropout's mask and autocast's low-precision dropped input
        if grad_in:
            s.append(N * in_f * (d.mask or in_bytes))  # the dropout mask (CPU: in the input's dtype; CUDA: bool)
        s.append(N * in_f * d.a)
    elif in_bytes != d.a:
        s.append(N * in_f * d.a)  # autocast's low-precision copy of the (fp32) input
    elif input_name not in saved_inputs:
        s.append(N * in_f * d.a)  # the input itself (shared with other layers reading it)
        saved_inputs.add(input_name)
    s.append(N * n_parts * lora.r * d.a)  # x @ A, kept for B's gradient
    if not d.mixed:  # (under autocast: its low-precision copy, as the LoRA weights' copies in the tail)
        s.append(out_f * n_parts * lora.r * d.a)  # B stacked and scaled (LoRALinear.forward), kept for x @ A's grad
    return s, True


def _dora_saved(in_f: int, out_f: int, parts, grad_in: bool, d: _Dims, lora: LoRAConfig, in_bytes: int,
                saved_inputs: set, input_name: str) -> list[int]:
    """What a DoRA layer (LoRALinear._dora_forward) saves: the input of x' @ A (the input itself, shared, or with
    dropout its dropped-out copy, and the one-byte mask when the input needs a gradient; under autocast its
    low-precision copy), x' @ A and the stacked B for the LoRA products, the sum its factor multiplies ([N, out],
    trainable dtype), and the factor's small vectors (the row norms, the factor, and the adapted rows' indices where
    the rows come in several parts)."""
    N, rows = d.N, sum(n for _, n in parts) if parts else out_f
    s: list[int] = []
    if d.lora_dropout:
        if grad_in:
            s.append(N * in_f)  # lora.dropout_keep's mask, for the input's gradient
        s.append(N * in_f * (d.a if d.mixed else in_bytes))  # x' (under autocast: its low-precision copy)
    elif in_bytes != d.a:
        s.append(N * in_f * d.a)  # autocast's low-precision copy of the (fp32) input
    elif input_name not in saved_inputs:
        s.append(N * in_f * d.a)  # the input itself (shared with other layers reading it)
        saved_inputs.add(input_name)
    n_r = (len(parts) if parts else 1) * lora.r
    s.append(N * n_r * d.a)  # x' @ A
    if not d.mixed:  # (under autocast: its low-precision copy, as the LoRA weights' copies in the tail)
        s.append(out_f * n_r * d.a)  # B stacked and scaled
    s += [N * out_f * d.t, rows * d.t, out_f * d.t]  # g's multiplicand, the norms, g
    if parts and parts != [(0, out_f)]:
        s.append(rows * 8)  # the adapted rows' indices (g spread over every row: LoRALinear.dora_scale)
    return s


def _block_saved(c: Config, lora: LoRAConfig, quantize: Optional[QuantMode], d: _Dims, i: int,
                 grad_in: bool, int8_inputs: Optional[dict] = None, masks: Optional[set] = None,
                 proj_input_remade: bool = False) -> tuple[list[int], bool]:
    """What block i of `GPT.forward` saves for backward, and whether its output needs grad. `proj_input_remade`: the
    gated MLP's down projection does not keep its input (LLaMAMLP.forward, when the block is not recomputed whole)."""
    targets = lora_targets(c, lora)
    p = f"transformer.h.{i}."
    N, C, H, hs, F = d.N, c.n_embd, c.n_head, c.head_size, c.intermediate_size
    seen: set = set()  # tensors saved already (several layers reading the same input)
    s = _norm_saved(c, d) if grad_in and c.pre_norms else []  # norm_1 (OLMo 2 has none: attention reads x)
    s_qkv, g_qkv = _linear_saved(p + "attn.qkv", C, sum(c.qkv_sizes), grad_in, d, targets, lora, quantize, d.r, seen,
                                 "h1", int8_inputs)
    s += s_qkv
    if g_qkv:
        s += _attention_saved(c, d, i, seen, masks if masks is not None else set())
    s_proj, g_attn = _linear_saved(p + "attn.proj", H * hs, C, g_qkv, d, targets, lora, quantize, d.a, seen, "y",
                                   int8_inputs)
    s += s_proj
    if c.post_norms and g_attn:  # Gemma 2/3, OLMo 2: the attention output normalized before the residual add
        s += _norm_saved(c, d, in_bytes=d.a)
    if c.parallel_residual:
        g_mlp_in = grad_in
        if not c.shared_attention_norm and grad_in:
            s += _norm_saved(c, d, input_shared=True)  # norm_2 reads the same block input
    else:
        g_mlp_in = grad_in or g_attn
        if g_mlp_in and c.pre_norms:
            s += _norm_saved(c, d)  # norm_2
    if c.is_moe_layer(i):  # frozen router and experts: their output needs grad where their input does
        s_r, _ = _linear_saved(p + "mlp.router", C, c.moe_n_expert, g_mlp_in, d, targets, lora, quantize, d.r, seen,
                               "h2", int8_inputs)
        s += s_r + (_moe_saved(c, d, lora) if g_mlp_in else [])
        if c.post_norms and g_mlp_in:
            s += _norm_saved(c, d)  # (the experts' sum is cast back to the residual's dtype)
        return s, grad_in or g_attn or g_mlp_in
    if c.mlp_class == "LLaMAMLP":
        s1, g1 = _linear_saved(p + "mlp.fc_1", C, F, g_mlp_in, d, targets, lora, quantize, d.r, seen, "h2", int8_inputs)
        s2, g2 = _linear_saved(p + "mlp.fc_2", C, F, g_mlp_in, d, targets, lora, quantize, d.r, seen, "h2", int8_inputs)
        s += s1 + s2
        if g1 or g2:  # model._GatedActivation: fc_1's and fc_2's outputs (act(fc_1) is recomputed in backward)
            s += [N * F * d.a, N * F * d.a]
            if proj_input_remade and not _int8(quantize):  # (an int8 layer keeps its input as an attribute)
                seen.add("m")
        g_hidden = g1 or g2
    else:
        s1, g_hidden = _linear_saved(p + "mlp.fc", C, F, g_mlp_in, d, targets, lora, quantize, d.r, seen, "h2",
                                     int8_inputs)
        s += s1 + ([N * F * d.a] if g_hidden else [])  # the activation's input
    s_p, g_mlp = _linear_saved(p + "mlp.proj", F, C, g_hidden, d, targets, lora, quantize, d.a, seen, "m", int8_inputs)
    s += s_p
    if c.post_norms and g_mlp:
        s += _norm_saved(c, d, in_bytes=d.a)  # post_mlp_norm
    return s, grad_in or g_attn or g_mlp


def _moe_saved(c: Config, d: _Dims, lora: Optional[LoRAConfig] = None) -> list[int]:
    """What model.MoE saves for backward when its input needs grad (router and experts frozen). The router's matmul
    keeps only its weight; its fp32 softmax keeps the probabilities, top-k the chosen indices, the renormalization its
    two operands; the experts keep the sort order and the token of every routed row (int64), the routing weights in
    sorted order, the gated activation its two inputs (every routed row's gate and up projections, [N*k,
    moe_intermediate_size] each), and the gather back to token order its indices."""
    N, E, k, F = d.N, c.moe_n_expert, c.moe_top_k, c.moe_intermediate_size
    s = [N * E * 4, N * k * 8] + ([N * k * 4, N * 4] if c.moe_norm_topk else [])
    s += [N * k * 8, N * k * 8, N * k * d.r, N * k * 8]
    if c.moe_swiglu_limit is not None:
        # gpt-oss's clamped SwiGLU in plain autograd ops: both clamps' inputs, the clamped gate, its sigmoid, up + 1,
        # the gate times its sigmoid and the product the routing weight scales
        s += [N * k * F * d.a] * 7
    else:
        s += [N * k * F * d.a] * 2
    if c.moe_bias:
        s.append(N * k * c.n_embd * d.a)  # the down projection's bias gathered per routed row, which the weight scales
    if lora is not None and lora.experts:
        # lora.LoRAExperts on fc_1, fc_2 and proj: each keeps its input (the routed rows, shared by fc_1 and fc_2;
        # the gated activation's output for proj), every expert's x @ A_e, scaling * B (all experts at once), and
        # with dropout a one-byte mask of its input
        C = c.n_embd
        s += [N * k * C * d.a, N * k * F * d.a]
        for in_f, out_f in ((C, F), (C, F), (F, C)):
            s += [N * k * lora.r * d.a, E * out_f * lora.r * d.a] + ([N * k * in_f] if lora.dropout > 0 else [])
    return s


def _moe_temp(c: Config, d: _Dims) -> list[int]:
    """Alive inside a MoE layer's backward, at its largest: the gradient of all N*k routed rows twice (the experts'
    input gradients collected, then concatenated), the gate and up projections' gradients, and the hidden states'
    gradients."""
    N, C, k, F = d.N, c.n_embd, c.moe_top_k, c.moe_intermediate_size
    return [N * k * C * d.a] * 2 + [N * k * F * d.a] * 2 + [N * C * 4] * 2


def _moe_stranded(c: Config, d: _Dims, dequant: int) -> int:
    """CPU heap left resident by one MoE layer's forward (`_allocator_slack`) with quantized experts: each active
    expert's projection dequantizes its weight (`dequant` bytes), computes its rows' output, a small tensor alive
    until all experts' outputs are concatenated, and frees the weight: the outputs, carved from the freed weights'
    space, leave holes too small for the next expert's weight, so the heap grows by about one dequantized weight
    per active expert and keeps it. Measured (scripts/bench/bench_estimator.py --model moe --n_layer 4, nf4-dq): ~0.24
    GiB of peak RSS above the tensors and the dense-fitted slack at micro batch 4 and at 1 alike, i.e. it does not
    grow with the tokens. Active experts: those at least one of the N*k routed rows picks, under even routing."""
    E, rows = c.moe_n_expert, d.N * c.moe_top_k
    active = E * (1 - (1 - 1 / E) ** rows)
    return int(active * dequant)


def _layer_backward_temp(c: Config, d: _Dims, dequant: int) -> list[int]:
    """Gradients alive inside one block's backward (the MLP's are the largest; a mixture of experts' layer: see
    `_moe_temp`) plus one dequantized weight (an expert's one at a time)."""
    N, C, F = d.N, c.n_embd, c.intermediate_size
    dense = [N * F * d.a] * 3 + [N * C * 4] * 2
    moe = _moe_temp(c, d) if c.moe_n_expert else []
    if c.moe_n_expert and not c.moe_dense_layers:
        dense = []
    return max(dense, moe, key=sum) + ([dequant] if dequant else [])


def _allocator_slack(device_type: str, small_bytes: int, churn_bytes: int, stranded_bytes: int = 0) -> int:
    """CPU: glibc serves allocations below its self-raising mmap threshold (at most 32 MiB) from heaps it rarely
    gives back: holes and an untrimmed top keep the resident size above the live tensors, by a share of the
    small tensors alive at the peak, more when quantized layers allocate and free a dequantized weight of that
    size for every matmul, plus what each mixture-of-experts layer strands below its saved tensors
    (`_moe_stranded`). Fitted with scripts/bench/bench_estimator.py (glibc defaults; the spread between runs of one
    cell is about +-5%). CUDA: 0, max_memory_allocated counts live blocks only."""
    if device_type != "cpu":
        return 0
    return int(CPU_HEAP_FIXED + CPU_HEAP_SLACK * small_bytes + CPU_DEQUANT_CHURN * churn_bytes + stranded_bytes)


@dataclass
class Estimate:
    """A predicted peak with its breakdown (bytes)."""
    parts: dict[str, int]
    notes: dict[str, str]
    settings: dict
    device_type: str
    peak_phase: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def total_gb(self) -> float:
        return self.total / GiB

    def table(self) -> str:
        kind = "peak RSS" if self.device_type == "cpu" else "CUDA max allocated"
        s = self.settings
        head = (f"Estimated peak training memory ({kind}) of {s['model']} | {s['precision']}, quantize "
                f"{s['quantize'] or 'none'}, "
                f"{s['optimizer']}, micro batch {s['micro_batch_size']} x {s['seq_length']} tokens"
                f"{', activation checkpointing' if s['activation_checkpointing'] else ''}, LoRA r={s['lora_r']} on "
                f"{','.join(s['lora_targets'])}"
                + (f"; per rank, sharded over {s['shard_world']} ranks (fsdp)" if s.get("shard_world", 1) > 1 else ""))
        rows = [(k, f"{v / GiB:.3f}", self.notes.get(k, "")) for k, v in self.parts.items()]
        rows.append(("Total", f"{self.total_gb:.3f}", f"peak at: {self.peak_phase}"))
        w0, w1 = max(len(r[0]) for r in rows + [("Component", "")]), max(len(r[1]) for r in rows + [("", "GiB")])
        lines = [head, f"| {'Component':<{w0}} | {'GiB':>{w1}} | Detail", f"|{'-' * (w0 + 2)}|{'-' * (w1 + 2)}|-------"]
        lines += [f"| {name:<{w0}} | {gb:>{w1}} | {note}" for name, gb, note in rows]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return dict(total_gb=self.total_gb, parts_gb={k: v / GiB for k, v in self.parts.items()},
                    peak_phase=self.peak_phase, settings=self.settings, device_type=self.device_type)


def estimate_training_memory(
    config: Config,
    lora: Optional[LoRAConfig] = None,
    precision: str = "bf16-true",
    quantize: "str | QuantMode | None" = None,
    optimizer: str = "AdamW",
    micro_batch_size: int = 1,
    seq_length: Optional[int] = None,
    activation_checkpointing: bool = False,
    quantize_lm_head: Optional[bool] = None,
    device_type: str = "cpu",
    validation: bool = True,
    shard_world: int = 1,
) -> Estimate:
    """Peak memory of one training process of finetune/lora.py with these settings (see the module docstring).

    `seq_length`: tokens per sample (the longest sample of a batch sets its length); default: the model's context.
    `validation`: whether validation forwards run (finetune's --eval_iters > 0); they can set the peak under int8.
    `shard_world`: ranks the weights are sharded over (--strategy fsdp); the estimate is then one rank's."""
    lora = lora or LoRAConfig()
    quantize = QuantMode.parse(quantize)
    prec = parse_precision(precision)
    c = config
    B = int(micro_batch_size)
    T = min(int(seq_length or c.block_size), c.block_size)
    if B < 1 or T < 1:
        raise UserError(f"the micro batch size and the sequence length must be positive, got {B} and {T}")
    d = _step_dims(prec, lora, B, T, device_type)
    quantize_lm_head = bool(quantize_lm_head)
    shard_world = max(1, int(shard_world))
    w = weight_bytes(c, lora, precision, quantize, quantize_lm_head, shard_world)
    static = _static_terms(w, prec, quantize, optimizer, device_type, shard_world)
    act = _saved_activations(c, lora, quantize if quantize_lm_head else None, quantize, d, prec,
                             sum(w["lora_numels"]), activation_checkpointing)
    phases = _step_phases(c, d, prec, quantize, w, act, activation_checkpointing, validation, device_type)

    peak = max(phases, key=lambda ph: ph.total)
    parts = {**static, "activations saved": sum(peak.saved), "logits (+ loss gradient)": sum(peak.held),
             "temporaries": sum(peak.temps)}
    small_max = max(_small(ph.saved + ph.held + ph.temps) for ph in phases)
    if device_type == "cpu":
        parts["allocator slack"] = _cpu_slack(c, d, w, small_max)
    phase, temp_note = _loading_peak(parts, static, c, quantize, device_type) or (peak.name, peak.note)
    notes = _notes(c, lora, precision, quantize, optimizer, w, prec, d, phase, temp_note, activation_checkpointing,
                   device_type)
    if not act.logits:  # losses.head_cross_entropy
        notes["logits (+ loss gradient)"] = "none kept: made a chunk at a time in forward; the hidden states' gradient"
    if shard_world > 1:
        _per_rank_notes(notes, shard_world, bool(w["quantized_params"]))
    settings = dict(model=c.name or "model", precision=precision, quantize=quantize, optimizer=optimizer,
                    micro_batch_size=B, seq_length=T, activation_checkpointing=activation_checkpointing, lora_r=lora.r,
                    lora_targets=lora.targets(), shard_world=shard_world)
    extra = dict(saved_for_backward=sum(act.saved_all) + sum(act.logits) + sum(act.loss_saved), logits=sum(act.logits),
                 chunk_tokens=act.chunk_tokens,
                 optimizer_state=static["optimizer state"],
                 live_dynamic=sum(peak.saved) + sum(peak.held) + sum(peak.temps), small_max=small_max,
                 rank_weight_bytes=static["quantized weights"] + static["dense weights"]
                 + sum(w["lora_rank_numels"]) * _dtype_bytes(prec.trainable_dtype))
    return Estimate(parts, notes, settings, device_type, peak_phase=phase, extra=extra)


def _step_dims(prec: Precision, lora: LoRAConfig, B: int, T: int, device_type: str) -> _Dims:
    """The sizes and paths of one training step (`_Dims`) under this precision on this device."""
    a = _dtype_bytes(prec.dtype)
    return _Dims(B=B, T=T, a=a, r=4 if prec.mixed else a, mask=1 if device_type == "cuda" else 0, mixed=prec.mixed,
                 cpu_attention=device_type == "cpu" and prec.dtype is torch.bfloat16 and not prec.mixed,
                 cpu_half=(device_type == "cpu" and prec.dtype in (torch.bfloat16, torch.float16) and not prec.mixed
                           and cpu_half.emulated_dtype(prec.dtype) and T >= cpu_half.MIN_ATTENTION_LENGTH),
                 lora_dropout=lora.dropout > 0, t=_dtype_bytes(prec.trainable_dtype),
                 w_norm=_dtype_bytes(prec.frozen_other_dtype))


def _cpu_slack(c: Config, d: _Dims, w: dict, small_max: int) -> int:
    """CPU: the heap grows to the most small-tensor bytes of any phase (`small_max`) and stays resident through the
    others; dequantized weights churn it, and every MoE layer's forward with quantized experts strands some
    (`_moe_stranded`)."""
    churn = max((out_f * in_f * d.a for _, out_f, in_f in w["quantized_shapes"]
                 if out_f * in_f * d.a < GLIBC_MMAP_THRESHOLD_MAX), default=0)
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.n_layer))
    expert_dq = max((out_f * in_f * d.a for name, out_f, in_f in w["quantized_shapes"] if ".experts." in name),
                    default=0)
    stranded = _moe_stranded(c, d, expert_dq) * moe_layers if moe_layers else 0
    return _allocator_slack("cpu", small_max, churn, stranded)


def _loading_peak(parts: dict, static: dict, c: Config, quantize: Optional[QuantMode],
                  device_type: str) -> Optional[tuple[str, str]]:
    """Loading can peak higher than a step for tiny batches: the weights placed so far plus what is being read and
    converted. Where it does, its excess goes into `parts`' temporaries and (phase, note) names it; else None."""
    load_peak = (static["runtime"] + static["quantized weights"] + static["dense weights"]
                 + _load_temp(c, quantize, device_type))
    if load_peak <= sum(parts.values()):
        return None
    parts["temporaries"] += load_peak - sum(parts.values())
    return "loading", ("quantizing the largest tensor on the device" if device_type == "cuda"
                       else "reading + quantizing a chunk of a tensor")


def _per_rank_notes(notes: dict, shard_world: int, quantized: bool) -> None:
    """The notes of the terms FSDP shards, saying they are one rank's part."""
    for k in ("quantized weights", "dense weights", "LoRA weights + grads", "optimizer state"):
        notes[k] = f"this rank's 1/{shard_world}" + (f" of {notes[k]}" if notes[k] else "") + (
            " (block scales whole)" if k == "quantized weights" and quantized else "")

def _static_terms(w: dict, prec: Precision, quantize: Optional[QuantMode], optimizer: str, device_type: str,
                  shard_world: int = 1) -> dict:
    """What exists for the whole run: the runtime, frozen weights, LoRA weights with their gradients, optimizer
    state; sharded over `shard_world` ranks, one rank's part of each plus what FSDP gathers for compute."""
    t_bytes = _dtype_bytes(prec.trainable_dtype)
    runtime = CPU_RUNTIME_BYTES if device_type == "cpu" else CUDA_RUNTIME_BYTES
    if device_type == "cpu" and (quantize or optimizer != "AdamW"):
        runtime += CPU_RUNTIME_BNB_BYTES
    if shard_world == 1:
        n_lora = sum(w["lora_numels"])
        return {"runtime": runtime, "quantized weights": w["quantized"], "dense weights": w["dense"],
                "LoRA weights + grads": 2 * n_lora * t_bytes,
                "optimizer state": optimizer_state_bytes(optimizer, w["lora_numels"], t_bytes, device_type)}
    n_lora = sum(w["lora_rank_numels"])
    return {"runtime": runtime, "quantized weights": w["quantized_rank"], "dense weights": w["dense_rank"],
            "LoRA weights + grads": 2 * n_lora * t_bytes,
            "optimizer state": optimizer_state_bytes(optimizer, w["lora_rank_numels"], t_bytes, device_type),
            "gathered weights (fsdp)": w["root_unit"] + 2 * w["block_unit"]}


@dataclass
class _Activations:
    saved_all: list[int]  # what autograd keeps through the step (with checkpointing: what it cannot drop)
    block_max: list[int]  # the largest block's saved tensors (recomputed one at a time under checkpointing)
    tail: list[int]  # ln_f, the head, rope tables, autocast's LoRA copies
    logits: list[int]  # the logits chunks the training loop holds
    loss_saved: list[int]  # what the loss saves besides the logits: fp32 log-sum-exp and int64 targets per position
    chunk_tokens: int  # positions of one logits chunk, times the batch


def _saved_activations(c: Config, lora: LoRAConfig, head_quantize: Optional[QuantMode],
                       quantize: Optional[QuantMode], d: _Dims, prec: Precision, n_lora: int,
                       activation_checkpointing: bool) -> _Activations:
    """Saved for backward, block by block (the first block's input never needs grad), then the tail and logits."""
    grad, blocks, block_max, int8_kept, masks = False, [], [], [], set()
    for i in range(c.n_layer):
        int8_inputs: dict = {}
        s, grad = _block_saved(c, lora, quantize, d, i, grad, int8_inputs, masks,
                               proj_input_remade=not activation_checkpointing)
        blocks += s
        block_max = max(block_max, s, key=sum)
        int8_kept += int8_inputs.values()
    targets = lora_targets(c, lora)
    tail = _norm_saved(c, d) if grad else []  # ln_f
    head_saved, _ = _linear_saved("lm_head", c.n_embd, c.vocab_size, grad, d, targets, lora, head_quantize, d.r,
                                  set(), "hf")
    # + the rope cos/sin of each RoPE the layers use (Gemma 3's sliding layers have their own; NoPE layers none)
    ropes = {c.layer_rope(i) for i in range(c.n_layer)} - {None} if c.rope_n_elem else set()
    tail += head_saved + [2 * d.T * c.rope_n_elem * d.r] * len(ropes)
    if prec.mixed:
        tail.append(n_lora * d.a)  # autocast's low-precision copies of the LoRA weights
    # Logits: the training loop holds them (in chunks of 256 positions for large vocabularies, see
    # training.head_chunk) through backward; the loss saves them (not a copy) and one fp32 log-sum-exp per position.
    # Counted for every position: an upper bound, as training runs the output layer only where a target exists
    # (GPT(output_mask=...)), which prompt masking and packing make a fraction of the positions.
    V = c.vocab_size
    # checkpointing: the block inputs (the sliding windows' boolean masks among them), and what it cannot drop (int8
    # layers' inputs, see _linear_saved)
    windows = {c.layer_window(i) for i in range(c.n_layer)} - {None}
    block_inputs = [d.N * c.n_embd * d.r] * c.n_layer + [d.T * d.T for w in windows if d.T > w]
    saved_all = (block_inputs + int8_kept if activation_checkpointing else blocks) + tail
    if "lm_head" not in targets and head_quantize is None:
        # a frozen dense head: losses.head_cross_entropy holds one chunk of logits at a time, in forward, and keeps
        # only the gradient of the hidden states for backward
        return _Activations(saved_all, block_max, tail, [], [d.N * c.n_embd * d.a], min(head_chunk_rows(V), d.N))
    chunk_T = min(256 if V >= 32000 else d.T, d.T)
    n_chunks = -(-d.T // chunk_T)
    N_c = d.B * chunk_T
    loss_saved = [d.N * 4, d.N * 8]
    if c.final_softcap is not None:  # Gemma 2's soft-capped logits (GPT.output): tanh keeps its result, per chunk
        loss_saved += [N_c * V * d.a] * n_chunks
    return _Activations(saved_all, block_max, tail, [N_c * V * d.a] * n_chunks, loss_saved, N_c)


@dataclass
class _Phase:
    name: str
    saved: list[int]
    held: list[int]
    temps: list[int]
    note: str

    @property
    def total(self) -> int:
        return sum(self.saved) + sum(self.held) + sum(self.temps)


def _step_phases(c: Config, d: _Dims, prec: Precision, quantize: Optional[QuantMode], w: dict, act: _Activations,
                 activation_checkpointing: bool, validation: bool, device_type: str) -> list[_Phase]:
    """The candidate peaks of one step, in backward order. Backward first runs the loss of every chunk (the fp32
    gradients of one chunk at a time), then the head (the gradients of all logits), then
    the blocks from the last one; validation runs the same micro batch without grad."""
    N, C, V, a, N_c = d.N, c.n_embd, c.vocab_size, d.a, act.chunk_tokens
    # A quantized layer computes with a dequantized copy of its weight. int8: bitsandbytes scales the int8 copy in
    # place by fp32 row scales, which on CPU goes through two fp32 temporaries of the weight's size.
    per_value = a + (8 if a != 4 and device_type == "cpu" else 0) if _int8(quantize) else a
    if d.cpu_half and not _int8(quantize):
        per_value = 4  # dequantized straight to fp32 for the fp32 kernel
    dq = {name: out_f * in_f * per_value for name, out_f, in_f in w["quantized_shapes"]}
    layer_dq = max((v for k, v in dq.items() if k != "lm_head"), default=0)
    head_dq = [dq["lm_head"]] if "lm_head" in dq else []
    block_temps = _layer_backward_temp(c, d, layer_dq)
    if d.cpu_half:
        # attention's backward in fp32: q, k, v, their gradients and the recomputed output
        H, G, hs = c.n_head, c.n_query_groups, c.head_size
        block_temps.append(N * hs * 4 * (2 * (H + 2 * G) + H))
    elif device_type == "cpu" and prec.dtype is torch.bfloat16 and d.T < RECOMPUTE_BELOW:
        # cpu_attention's backward rebuilds one layer's probabilities: fp32 p + bf16 copy, fp32 dp - d + bf16 ds,
        # from fp32 copies of two of q, k, v, dout at a time
        block_temps.append(d.B * c.n_head * d.T * (d.T * (4 + 2 + 4 + 2) + 2 * c.head_size * 4))
    head_note = "head backward" + (" with its dequantized weight" if head_dq else "")
    block_note = "gradients inside one block" + (" + a dequantized weight" if layer_dq else "")
    saved = act.saved_all
    if not act.logits:  # the loss of a frozen dense head, made chunk by chunk in forward (head_cross_entropy)
        chunk_temps = [N_c * V * a, N_c * V * 4] + ([N_c * V * a] if a != 4 else [])
        phases = [_Phase("output loss (forward)", saved, act.loss_saved, chunk_temps,
                         "one chunk of logits, its fp32 softmax and its gradient")]
        phases.append(_Phase("block recomputation", saved[:-len(act.tail) or None] + act.block_max,
                             act.loss_saved[:1], block_temps, "a recomputed block + " + block_note)
                      if activation_checkpointing else
                      _Phase("block backward", saved, act.loss_saved[:1], block_temps, block_note))
        if validation:
            phases.append(_Phase("validation forward", [], [], [N_c * V * a, N_c * V * 4],
                                 "one chunk of logits and its fp32 softmax (no grad)"))
        return phases
    phases = [
        _Phase("loss backward", saved, act.logits + act.loss_saved, [N_c * V * 4] + ([N_c * V * a] if a != 4 else []),
               "loss gradients of one logits chunk (fp32, and in the logits' dtype)"),
        _Phase("head backward", saved, act.logits + [N * V * a], [N_c * C * a] + head_dq,
               head_note + " + the logits' gradients"),
    ]
    if activation_checkpointing:  # one block at a time is recomputed in backward: its saved tensors and gradients
        phases.append(_Phase("block recomputation", saved[:-len(act.tail) or None] + act.block_max, act.logits,
                             block_temps, "a recomputed block + " + block_note))
    else:
        phases.append(_Phase("block backward", saved, act.logits, block_temps, block_note))
    if validation:  # nothing saved (int8 layers keep their training matmul, see quantize.validation_mode: LLM.int8
        # inference would hold an int32 and two fp32 copies of a logits chunk)
        phases.append(_Phase("validation forward", [], act.logits[:-1], [N_c * V * a, N_c * C * a] + head_dq,
                             "the head's output for one logits chunk (no grad)"))
    return phases


def _small(sizes: list[int]) -> int:
    """Bytes of the tensors below glibc's mmap threshold: those leave heap slack behind on CPU."""
    return sum(t for t in sizes if t < GLIBC_MMAP_THRESHOLD_MAX)


def _notes(c: Config, lora: LoRAConfig, precision: str, quantize: Optional[QuantMode], optimizer: str, w: dict,
           prec: Precision, d: _Dims, phase: str, temp_note: str, activation_checkpointing: bool,
           device_type: str) -> dict[str, str]:
    """The 'Detail' column of the estimate's table."""
    n_lora, t_bytes = sum(w["lora_numels"]), _dtype_bytes(prec.trainable_dtype)
    bits = 8 * w["quantized"] / w["quantized_params"] if w["quantized_params"] else 0.0
    if phase == "validation forward":
        saved_note = "none: no grad"
    elif activation_checkpointing:
        saved_note = "each block's input (checkpointing)" + (" + one recomputed block" if "recomputation" in phase
                                                             else "")
    else:
        saved_note = f"{c.n_layer} blocks, for backward"
    held_extra = {"loss backward": " + log-sum-exp", "head backward": " + their gradients"}.get(phase, "")
    return {
        "runtime": "Python, torch, Lightning, bitsandbytes: measured" if device_type == "cpu" else "CUDA workspaces",
        "quantized weights": (f"{w['quantized_params'] / 1e6:.1f}M params at {bits:.3f} bits"
                              if w["quantized_params"] else ""),
        "dense weights": ("embeddings, norms" + (", unquantized layers" if quantize else ", Linear layers")
                          + f" ({precision})"),
        "LoRA weights + grads": f"{n_lora / 1e6:.2f}M params, {t_bytes} bytes each, twice",
        "optimizer state": optimizer,
        "activations saved": saved_note,
        "logits (+ loss gradient)": f"[{d.B}, {d.T}, {c.vocab_size}] held by the loop" + held_extra,
        "temporaries": temp_note,
        "allocator slack": "glibc heap growth, ~ the small tensors of the peak",
        "gathered weights (fsdp)": "root unit (embeddings, norm, head) + two blocks, gathered for compute",
    }


def _load_temp(c: Config, quantize: Optional[QuantMode], device_type: str) -> int:
    """What loading holds beyond the weights it has placed. On a GPU the largest tensor, read on the CPU, is
    quantized from its copy on the device. On CPU quantized layers are quantized from the file a chunk at a time
    (`CPU_QUANTIZE_CHUNK` elements; bitsandbytes' quantizers make ~16 bytes of fp32/int32 copies per element) and
    dense tensors are cast as they are read: a few MiB whatever the model (SmolLM2-135M's shape, every mode
    measured: 3-5 MiB above the loaded weights)."""
    if device_type == "cuda":
        big = max(c.vocab_size * c.n_embd, c.intermediate_size * c.n_embd, sum(c.qkv_sizes) * c.n_embd)
        return big * (2 + 1) if _int8(quantize) else big * 2 if quantize else 0
    return CPU_QUANTIZE_CHUNK * 16 if quantize else 0


def pick_micro_batch_size(budget_bytes: float, max_micro_batch_size: int = 1024, **kw) -> tuple[int, Estimate]:
    """The largest micro batch size whose estimated peak fits in `budget_bytes` (powers of two, then refined).

    Returns (0, estimate at 1) when not even a micro batch of 1 fits."""
    est1 = estimate_training_memory(micro_batch_size=1, **kw)
    if est1.total > budget_bytes:
        return 0, est1
    lo, best = 1, est1  # the estimate grows with the micro batch size: binary search
    hi = 2
    while hi <= max_micro_batch_size:
        e = estimate_training_memory(micro_batch_size=hi, **kw)
        if e.total > budget_bytes:
            break
        lo, best, hi = hi, e, hi * 2
    hi = min(hi, max_micro_batch_size + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        e = estimate_training_memory(micro_batch_size=mid, **kw)
        if e.total <= budget_bytes:
            lo, best = mid, e
        else:
            hi = mid
    return lo, best


# ---- configs without loading --------------------------------------------------------------------
def read_config(checkpoint_dir: Path) -> Config:
    """The model config of a checkpoint folder, without converting or loading weights."""
    checkpoint_dir = Path(checkpoint_dir)
    if (checkpoint_dir / LIT_CONFIG).is_file():
        return Config.from_file(checkpoint_dir / LIT_CONFIG)
    if (checkpoint_dir / "config.json").is_file():
        return Config.from_hf_config(checkpoint_dir / "config.json")
    if not checkpoint_dir.is_dir():
        raise UserError(f"checkpoint folder {checkpoint_dir} does not exist; pass --checkpoint_dir with a downloaded "
                        "model folder")
    raise UserError(f"{checkpoint_dir} holds no model_config.json or config.json; pass a model folder")


def available_memory_bytes(device_type: str) -> int:
    """Free memory of the device: CUDA free memory, or the system's available RAM."""
    if device_type == "cuda":
        return torch.cuda.mem_get_info()[0]
    return psutil.virtual_memory().available


def plan_micro_batch_size(checkpoint_dir: Path, micro_batch_size: int | str, memory_budget: Optional[float],
                          estimate_only: bool, device_type: str, devices: int, lora: LoRAConfig, **settings) -> int:
    """What finetune/lora.py calls before loading anything: resolves `--micro_batch_size auto` to the largest
    micro batch whose estimate fits `--memory_budget` (GB, default: the memory free now) and prints the estimate
    (to stdout with --estimate_only, else to stderr). `devices`: processes of the run (all machines); `settings`
    may hold `shard_world` (--strategy fsdp): the estimate is then per rank. `device_type`: the run's resolved
    accelerator (cpu or cuda)."""
    out = sys.stdout if estimate_only else sys.stderr
    kw = dict(config=read_config(checkpoint_dir), lora=lora, device_type=device_type, **settings)
    if micro_batch_size == "auto":
        if memory_budget is None and devices > 1:  # every DDP process would measure a different free memory
            raise UserError("--micro_batch_size auto with --devices > 1 needs --memory_budget (GB per device); pass "
                            "e.g. "
                            "--memory_budget 20")
        if memory_budget is not None and memory_budget <= 0:
            raise UserError(f"--memory_budget must be positive (GB), got {memory_budget}")
        budget = memory_budget * GiB if memory_budget else available_memory_bytes(device_type)
        where = f"--memory_budget {memory_budget} GB" if memory_budget else f"the free {device_type} memory"
        mbs, est = pick_micro_batch_size(budget, **kw)
        if mbs == 0:
            raise UserError(f"even --micro_batch_size 1 needs about {est.total_gb:.2f} GB, more than {where} "
                            f"({budget / GiB:.2f} "
                            "GB); use --quantize bnb.nf4-dq, --activation_checkpointing true, a smaller "
                            "--max_seq_length, or "
                            "a larger --memory_budget")
        print(f"--micro_batch_size auto: {mbs}, the largest whose estimated peak fits {where} ({budget / GiB:.2f} GB)",
              file=out)
    else:
        try:
            mbs = int(micro_batch_size)
        except ValueError:
            raise UserError(f"--micro_batch_size must be a positive number or auto, got {micro_batch_size!r}") from None
        if mbs < 1:
            raise UserError(f"--micro_batch_size must be at least 1, got {mbs}; pass a positive number or auto")
        est = estimate_training_memory(micro_batch_size=mbs, **kw)
    print(est.table(), file=out)
    if estimate_only and memory_budget and est.total > memory_budget * GiB:
        print(f"This exceeds --memory_budget {memory_budget} GB.", file=out)
    return mbs


def estimate_to_json(est: Estimate) -> str:
    return json.dumps(est.as_dict(), indent=2)
