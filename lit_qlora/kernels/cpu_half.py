"""bf16/fp16 matmuls computed by fp32 kernels on CPUs without native support for the 16-bit type.

Why: on a CPU without AVX512-BF16/AMX, torch converts every bf16 operand in software inside its matmul kernel, and a
bf16 matmul of a fine-tuning shape runs 3-4x slower than the fp32 one (1024x576 @ 576x1536: 30 vs 10 ms on a 2-core
AVX2/AVX512F Xeon; scripts/bench/bench_precision.py). Converting the operands to fp32 first and calling the fp32 kernel
takes about as long as the fp32 matmul alone. The result is what a native 16-bit kernel computes: products of the
same 16-bit values, summed in fp32, rounded to the 16-bit type once. Only the kernel moves: weights, activations and
what is saved for backward keep their dtype, so memory is what `--precision bf16-true` promises.

Matmuls that read more bytes than they compute (decoding one token: x [1, K] @ W [K, N]) are faster with the 16-bit
kernel, which reads half the bytes: below MIN_INTENSITY multiply-adds per element read (measured crossover: about 5)
they keep it. Under autocast (*-mixed precisions) autocast decides.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from lit_qlora import precision

MIN_INTENSITY = 6.0  # m*n*k / (m*k + k*n + m*n) from which the fp32 kernel is used
MIN_ATTENTION_LENGTH = 16  # queries per row from which attention is computed by fp32 kernels
FP32_CHUNK = 1 << 22  # weight elements converted to fp32 at once (16 MB; a 49152 x 576 output layer would be 113 MB)
_forced: Optional[bool] = None  # set by `forced` (tests): apply (True) or not (False) whatever the CPU and size


def native(dtype: torch.dtype) -> bool:
    """precision.cpu_has_native, read once (it is asked for every matmul). A plain dict, filled at import, rather than
    functools.lru_cache: torch.compile traces through an lru_cache wrapper, warning about it on every compiled run."""
    found = _native.get(dtype)
    if found is None:
        found = _native[dtype] = precision.cpu_has_native(dtype)
    return found


_native: dict[torch.dtype, bool] = {}
native.cache_clear = _native.clear  # tests that fake the CPU's flags make it read them again
native(torch.bfloat16)  # filled now, before a compiled graph could meet it empty
native(torch.float16)


def emulated_dtype(dtype: torch.dtype) -> bool:
    """Whether CPU matmuls of the 16-bit `dtype` go to fp32 kernels here (given enough work, see `in_fp32`)."""
    return _forced if _forced is not None else not native(dtype)


def emulated(x: torch.Tensor) -> bool:
    """Whether `x` is a 16-bit CPU tensor this CPU has no native matmul for (and autocast is off)."""
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16) or torch.is_autocast_enabled("cpu"):
        return False
    return emulated_dtype(x.dtype)


def in_fp32(x: torch.Tensor, n: int) -> bool:
    """Whether x [..., k] @ [k, n] runs through the fp32 kernel."""
    if not emulated(x):
        return False
    k = x.size(-1)
    m = x.numel() // k if k else 0
    return _forced is not None or m * n * k >= MIN_INTENSITY * (m * k + k * n + m * n)


@contextlib.contextmanager
def forced(enabled: Optional[bool]) -> Iterator[None]:
    """Use (True) or never use (False) the fp32 kernels for 16-bit CPU tensors, whatever the CPU: for tests."""
    global _forced
    before, _forced = _forced, enabled
    try:
        yield
    finally:
        _forced = before


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for use inside autograd Functions (no graph is recorded there), in a's dtype."""
    if in_fp32(a, b.size(-1)):
        return (a.float() @ b.float()).to(a.dtype)
    return a @ b


def _linear32(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """F.linear by the fp32 kernel, the result in x's dtype; w is converted FP32_CHUNK elements at a time."""
    x32 = x.float()
    n, k = w.shape
    step = max(1, FP32_CHUNK // max(k, 1))
    if step >= n:
        return F.linear(x32, w.float(), bias.float() if bias is not None else None).to(x.dtype)
    y = x.new_empty((*x.shape[:-1], n))
    for r0 in range(0, n, step):
        b = bias[r0:r0 + step].float() if bias is not None else None
        y[..., r0:r0 + step] = F.linear(x32, w[r0:r0 + step].float(), b)  # rounded to x's dtype as it is stored
    return y


def _grad_input32(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """g @ w in fp32 (g [..., n] fp32, w [n, k]), w converted FP32_CHUNK elements at a time."""
    n, k = w.shape
    step = max(1, FP32_CHUNK // max(k, 1))
    if step >= n:
        return g @ w.float()
    out = g[..., :step] @ w[:step].float()
    for r0 in range(step, n, step):
        out += g[..., r0:r0 + step] @ w[r0:r0 + step].float()
    return out


class _Linear(torch.autograd.Function):
    """x @ w^T + bias by fp32 kernels, saving x and w in their own dtype (autograd would save fp32 copies)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        # as autograd does: x only for w's gradient, w only for x's (a frozen weight keeps no input alive)
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w if ctx.needs_input_grad[0] else None)
        ctx.has_bias, ctx.dtype = bias is not None, x.dtype
        return _linear32(x, w, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        g = grad.float()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _grad_input32(g, w).to(ctx.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (g.reshape(-1, g.size(-1)).T @ x.reshape(-1, x.size(-1)).float()).to(ctx.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.reshape(-1, g.size(-1)).sum(0).to(grad.dtype)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear, by the fp32 kernel where `in_fp32(x)`."""
    if w.dtype == x.dtype and in_fp32(x, w.size(0)):
        return _Linear.apply(x, w, bias)
    return F.linear(x, w, bias)


class _Attention(torch.autograd.Function):
    """scaled_dot_product_attention by fp32 kernels. Saves q, k, v in their dtype; backward runs the fp32 forward
    again and differentiates it (an attention forward costs about a third of its backward)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal: bool, scale: float, enable_gqa: bool) -> torch.Tensor:
        ctx.save_for_backward(q, k, v)
        ctx.args = (mask, is_causal, scale, enable_gqa)
        return _sdpa32(q.float(), k.float(), v.float(), *ctx.args).to(q.dtype)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v = ctx.saved_tensors
        q32, k32, v32 = (t.detach().float().requires_grad_(n) for t, n in zip((q, k, v), ctx.needs_input_grad))
        with torch.enable_grad():
            out = _sdpa32(q32, k32, v32, *ctx.args)
        wanted = [t for t in (q32, k32, v32) if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, dout.float()))
        dq, dk, dv = (next(grads).to(t.dtype) if t32.requires_grad else None
                      for t, t32 in zip((q, k, v), (q32, k32, v32)))
        return dq, dk, dv, None, None, None, None


def _sdpa32(q, k, v, mask, is_causal, scale, enable_gqa):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=enable_gqa)


def attention_in_fp32(q: torch.Tensor, decoding: bool = False) -> bool:
    """Whether attention for queries q [B, H, T, hs] runs by fp32 kernels (`attention32`): `emulated` 16-bit
    queries of MIN_ATTENTION_LENGTH or more positions; and, on any CPU, a `decoding` step (one query per row against
    the KV cache) of 16-bit tensors outside autograd and autocast. There torch's 16-bit CPU attention costs several
    times the conversions plus the fp32 kernel, with native bf16 too (AVX512-BF16, 9 heads of 64 over 300 cached
    keys: 294 against 58 us; over 2000 keys 1.9 against 1.4 ms)."""
    if (decoding and q.size(-2) == 1 and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)
            and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")):
        return True
    return emulated(q) and (_forced is not None or q.size(-2) >= MIN_ATTENTION_LENGTH)


def attention32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], is_causal: bool,
                scale: float, enable_gqa: bool) -> torch.Tensor:
    """F.scaled_dot_product_attention of 16-bit q, k, v by fp32 kernels, the result in q's dtype."""
    if not torch.is_grad_enabled():  # the same forward without the autograd Function's ~15 us (a decoding step)
        return _sdpa32(q.float(), _fp32_copy(k, 0), _fp32_copy(v, 1), mask, is_causal, scale, enable_gqa).to(q.dtype)
    return _Attention.apply(q, k, v, mask, is_causal, scale, enable_gqa)


_scratch = threading.local()  # per thread: fp32 buffers for the keys and values outside autograd


def _buffers() -> list[Optional[torch.Tensor]]:
    """This thread's two buffers: torch releases the GIL inside ops, so two threads generating at once (a server)
    would otherwise write each other's keys into a buffer the other is about to read."""
    if not hasattr(_scratch, "bufs"):
        _scratch.bufs = [None, None]
    return _scratch.bufs


def _fp32_copy(t: torch.Tensor, slot: int) -> torch.Tensor:
    """`t` in fp32, written into a buffer kept for the next call, which grows by doubling. Decoding converts the
    cached keys and values of every layer at every step, one position longer each time: fresh tensors of ever
    larger sizes fragmented the heap (SmolLM2-135M, 400 new tokens: +51 MiB resident against +13 without)."""
    n = t.numel()
    bufs = _buffers()
    buf = bufs[slot]
    if buf is None or buf.numel() < n:
        buf = bufs[slot] = torch.empty(max(n, 2 * (buf.numel() if buf is not None else 0)))
    return buf[:n].view(t.shape).copy_(t)
