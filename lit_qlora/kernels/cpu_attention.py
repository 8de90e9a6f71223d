"""Causal attention for bf16 CPU training: PyTorch's flash forward, and a faster backward for short sequences.

Why: on CPU, ATen's bf16 flash-attention backward is slow for the short sequences fine-tuning data is made of;
recomputing the softmax with plain bf16 matmuls is about 3x faster below 192 tokens, while in fp32 the flash backward
is the faster one, so fp32 keeps it (measurements: tutorials/performance.md). Recomputing keeps the memory of flash
attention: only q, k, v, the output and the log-sum-exp [B, H, T] are saved for backward; the [B, H, T, T]
probabilities exist only inside backward, one layer at a time. From T = 192 on the flash backward was as fast or
faster, so it is used there.

Accuracy: as close to the fp32 gradients as ATen's flash backward (transformers' bf16 SDPA), which sums the scores
and dp = dout v^T in fp32. An earlier version rounded them to bf16 (plain bf16 matmuls): its dq, dk, dv were 2x
(scores of unit size) to 7x (4x larger scores) further from the fp32 gradients than ATen's, relative error 0.0052
against 0.0028 (dq) and 0.0220 against 0.0030 (dv; T = 24 and 100, 16-wide heads, this module's test on an AVX512-BF16
EPYC). With the sums in fp32 the backward takes 0.47 / 1.03 / 3.9 / 4.9 ms against 0.49 / 0.90 / 4.6 / 11.2 ms
before at T = 32 / 64 / 128 / 176 (B=4, H=9, hs=64, 2 threads, that EPYC).
"""
from __future__ import annotations

import torch

RECOMPUTE_BELOW = 192  # sequence length from which ATen's own flash backward is used


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        # q, k, v [B, H, T, hs] -> out [B, H, T, hs]; lse [B, H, T] is the softmax normalizer of each query row
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        if q.size(-2) >= RECOMPUTE_BELOW or q.dtype == torch.float32:  # fp32: the flash backward is the faster one
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, True, scale=ctx.scale)
            return dq, dk, dv, None
        # p = softmax(q k^T * scale) rebuilt from the saved normalizer; tril_ applies the causal mask. The scores and
        # dp = dout v^T are sums of exact products of bf16 values in fp32 (fp32 kernels on the bf16 values), as in
        # ATen's flash backward: bf16 matmuls would round them to bf16, and exp() turns a score's rounding error
        # (up to |s| * 2^-9) into a relative error of p, twice to seven times ATen's error on dq, dk, dv (module doc)
        p = torch.matmul(q.float(), k.float().transpose(-2, -1)).mul_(ctx.scale)
        p = p.sub_(lse.unsqueeze(-1)).exp_().tril_()  # [B, H, T, T]
        dv = p.to(v.dtype).transpose(-2, -1) @ dout  # [B, H, T, hs]
        # softmax backward: ds = p * (dp - rowsum(dout * out)), times the scale before it is rounded to bf16 once
        d = (dout.float() * out.float()).sum(-1, keepdim=True)  # [B, H, T, 1]
        ds = torch.matmul(dout.float(), v.float().transpose(-2, -1)).sub_(d).mul_(p).mul_(ctx.scale).to(q.dtype)
        del p
        dq = ds @ k
        dk = ds.transpose(-2, -1) @ q
        return dq, dk, dv, None


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Plain causal self-attention being trained on CPU in bf16, without autocast (which casts on its own)."""
    return (q.device.type == "cpu" and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad) and q.size(-2) == k.size(-2)
            and q.dtype == k.dtype == v.dtype == torch.bfloat16
            and not torch.is_autocast_enabled("cpu"))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v for q, k, v [B, H, T, hs] of the same length."""
    return _CausalAttention.apply(q, k, v, scale)


def keep_out_of_compiled_graphs() -> None:
    """Make `causal_attention` a graph break for torch.compile (GPT.compile_blocks calls this): traced, the
    backward's length test would make a second compilation. Applied only when compiling, because
    `torch.compiler.disable` imports torch._dynamo, 2.5 s of every script's start otherwise."""
    global causal_attention
    if not getattr(causal_attention, "_kept_out", False):
        causal_attention = torch.compiler.disable(causal_attention)
        causal_attention._kept_out = True
