"""The training loss at the output layer: cross entropy summed over the target positions (or, for preference
losses, each position's -log p(target)), in fp32, without keeping what a large vocabulary makes large.

`head_cross_entropy` is what a training step uses when the output layer is a frozen dense weight (the default: the
head is not quantized and has no LoRA): it never holds more than one chunk of logits. `chunked_cross_entropy` takes
logits that were already computed (a quantized head, a LoRA on the head, callers that want the logits)."""
from __future__ import annotations

from typing import Optional

import torch

from lit_qlora.kernels import cpu_half

HEAD_CHUNK_ELEMENTS = 2**24  # logits per chunk of head_cross_entropy: 64 MiB in fp32 whatever the vocabulary


def chunked_cross_entropy(logits: torch.Tensor | list[torch.Tensor], targets: torch.Tensor,
                          ignore_index: int = -100, reduction: str = "sum", temperature: float = 1.0) -> torch.Tensor:
    """Sum (not mean) of token losses, or with reduction "none" each target position's loss, -log p(target) [N] in
    fp32 (0 at ignored positions); with a `temperature`, of the distribution softmax(logits / temperature) (what
    sampling at that temperature draws from: GRPO's log-probabilities). `logits` may come in sequence chunks from
    `GPT(lm_head_chunk=...)`: the fp32 upcast is then made chunk by chunk, as a temporary (backward keeps only the
    logits and a log-sum-exp per row).
    Logits [B, T, V] go with targets [B, T]; logits of selected positions [N, V] (`GPT(output_mask=...)`) with the
    targets of those positions [N]."""
    _check_reduction(reduction)
    if isinstance(logits, torch.Tensor):
        logits = [logits]
    losses, start = [], 0
    for chunk in logits:
        T = chunk.size(1) if chunk.dim() == 3 else chunk.size(0)
        t = targets[:, start:start + T] if chunk.dim() == 3 else targets[start:start + T]
        start += T
        losses.append(_CrossEntropy.apply(chunk.reshape(-1, chunk.size(-1)), t.reshape(-1), ignore_index,
                                          reduction == "sum", temperature))
    if reduction == "none":
        return torch.cat(losses)
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total


def _check_reduction(reduction: str) -> None:
    if reduction not in ("sum", "none"):
        raise ValueError(f"reduction {reduction!r}: 'sum' or 'none'")


class _CrossEntropy(torch.autograd.Function):
    """F.cross_entropy(logits.float(), targets, reduction="sum" or "none") for logits [N, V], saving the logits (which
    the caller holds anyway) and one fp32 log-sum-exp per row. Why: autograd's cross entropy saves its fp32
    log-probabilities (a second [N, V] tensor, twice the logits' size in bf16) and its backward fills a zero [N, V]
    gradient, scatters into it and runs softmax's backward; here backward builds softmax - one_hot in one tensor."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, summed: bool,
                temperature: float = 1.0) -> torch.Tensor:
        x = logits.float()
        if temperature != 1.0:
            x = x / temperature
        lse = torch.logsumexp(x, dim=-1)  # [N]
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0)
        picked = x.gather(-1, safe[:, None])[:, 0]
        ctx.save_for_backward(logits, targets, lse)
        ctx.ignore_index, ctx.temperature = ignore_index, temperature
        nll = torch.where(valid, lse - picked, 0)
        return nll.sum() if summed else nll

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        valid = targets != ctx.ignore_index
        T = ctx.temperature
        x = logits if T == 1.0 else logits.float() / T
        g = torch.sub(x, lse[:, None]).exp_()  # softmax, one new fp32 [N, V] (bf16 - fp32 gives fp32)
        rows = valid.nonzero()[:, 0]
        g[rows, targets[rows]] -= 1.0
        scale = torch.where(valid, grad, 0)[:, None]  # a scalar (sum) or one per row (none); ignored rows: none
        g.mul_(scale if T == 1.0 else scale / T)  # d(z / T) / dz = 1 / T
        return g.to(logits.dtype), None, None, None, None


def head_chunk_rows(vocab_size: int) -> int:
    """Positions per chunk of `head_cross_entropy`: HEAD_CHUNK_ELEMENTS logits (at least 16 rows)."""
    return max(16, HEAD_CHUNK_ELEMENTS // max(vocab_size, 1))


def head_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                       softcap: Optional[float] = None, ignore_index: int = -100,
                       chunk: Optional[int] = None, reduction: str = "sum", temperature: float = 1.0) -> torch.Tensor:
    """The token losses of the output layer `weight` [V, C] (frozen, no bias) at the hidden states x [N, C] with
    targets [N], summed, or each position's (reduction "none": -log p(target) [N] in fp32, what preference losses are
    made of): `chunked_cross_entropy(softcap(x @ weight.T), targets, reduction=...)` with the same value and gradient
    for x, but holding one chunk of logits at a time (`head_chunk_rows`) instead of all of them until backward.

    Why: with a 262k-entry vocabulary (Gemma 3) the logits of 4 x 256 positions are 1 GiB in fp32, the largest
    tensor of a step. Each position's loss depends on its own hidden state only, so the gradient of loss i for x_i
    (one row [C]) is known in forward: (softmax_i - one_hot_i) @ weight. Each chunk's logits, its fp32 softmax and
    these rows are made and dropped in forward; backward only scales row i by the upstream gradient of loss i (one
    scalar for the sum). `temperature`: of softmax(logits / temperature), as `chunked_cross_entropy`."""
    _check_reduction(reduction)
    chunk = chunk or head_chunk_rows(weight.size(0))
    return _HeadCrossEntropy.apply(x.reshape(-1, x.size(-1)), weight, targets.reshape(-1), softcap, ignore_index,
                                   chunk, reduction == "sum", temperature)


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, cap: Optional[float],
                ignore_index: int, chunk: int, summed: bool, temperature: float = 1.0) -> torch.Tensor:
        want_grad = ctx.needs_input_grad[0]
        grad_x = torch.empty_like(x) if want_grad else None
        nll = torch.empty(x.size(0), dtype=torch.float32, device=x.device)
        for s in range(0, x.size(0), chunk):
            xc, tc = x[s:s + chunk], targets[s:s + chunk]
            z = cpu_half.linear(xc, w)  # the logits in x's dtype, as the output layer computes them
            t = torch.tanh(z / cap) if cap is not None else None
            logits = (t * cap if cap is not None else z).float()
            if temperature != 1.0:
                logits = logits.div_(temperature)
            del z
            valid = tc != ignore_index
            safe = torch.where(valid, tc, 0)
            picked = logits.gather(-1, safe[:, None])[:, 0]
            # log-sum-exp and softmax in place of the logits: torch.logsumexp would allocate a second [rows, V]
            # buffer for (logits - max), the largest temporary of a small model's step (+64 MiB of peak RSS)
            top = logits.amax(dim=-1)
            e = logits.sub_(top[:, None]).exp_()  # exp(z - max), in place
            total = e.sum(dim=-1)
            nll[s:s + chunk] = torch.where(valid, top + total.log() - picked, 0)
            if want_grad:
                g = e.div_(total[:, None])  # softmax, in place
                rows = valid.nonzero()[:, 0]
                g[rows, tc[rows]] -= 1.0
                g[~valid] = 0.0
                if temperature != 1.0:
                    g.div_(temperature)  # d(z / T) / dz
                g = g.to(x.dtype)  # the precision autograd hands the output layer's backward
                if cap is not None:
                    g = g * (1 - t * t)  # d(cap * tanh(z / cap)) / dz, in x's dtype as autograd's tanh backward
                grad_x[s:s + chunk] = cpu_half.mm(g, w)  # row i: d loss_i / d x_i
            del logits
        ctx.save_for_backward(grad_x)
        return nll.sum() if summed else nll

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (grad_x,) = ctx.saved_tensors
        scale = grad.to(grad_x.dtype)
        return grad_x * (scale if scale.dim() == 0 else scale[:, None]), None, None, None, None, None, None, None
