"""LoRA on any subset of {query, key, value, projection, mlp, head} and, on a mixture of experts, {experts, router},
over a dense or a quantized base.

The base layer is kept untouched inside `LoRALinear.base`; only `lora_A` / `lora_B` train. For the fused qkv
projection one `lora_A` stacks the A matrices of the enabled parts, so x·A is computed once for q, k and v.
A stacked projection of a layer's experts is wrapped in `LoRAExperts`: one low-rank pair per expert, computed on the
tokens routed to that expert. The router is a plain Linear, wrapped in `LoRALinear` like any other.
The adapter file (LoRA tensors plus everything needed to use them) is `lit_qlora.adapter.Adapter`.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from lit_qlora.config import Config
from lit_qlora.kernels import cpu_half
from lit_qlora.model import GPT, ExpertWeights, linear
from lit_qlora.utils import UserError

# Up to this many rows of 16-bit activations (a decoding step: one per sequence) the LoRA products run in fp32 on CPU;
# up to DECODE_BATCH for the batched engine's decoding steps (one token per row)
DECODE_ROWS = 16
DECODE_BATCH = 32


# --lora_init: how A and B start. default: A kaiming-uniform, B = 0 (PEFT's True); gaussian: A ~ N(0, 1/r^2), B = 0;
# pissa / olora / loftq start from the base weight, which keeps the residual (RESIDUAL_INITS)
LORA_INITS = ("default", "gaussian", "pissa", "olora", "loftq")
RESIDUAL_INITS = ("pissa", "olora", "loftq")

# LoRAConfig's bool fields that choose a variant of LoRA rather than a layer to adapt
_VARIANT_FLAGS = ("rslora", "dora")


def lora_scaling(alpha: float, r: int, rslora: bool = False) -> float:
    """The factor of B @ A: alpha / r, or alpha / sqrt(r) for rsLoRA (as PEFT's `use_rslora`)."""
    return alpha / math.sqrt(r) if rslora else alpha / r


@dataclass
class LoRAConfig:
    r: int = 8
    alpha: float = 16
    dropout: float = 0.05
    query: bool = True
    key: bool = False
    value: bool = True
    projection: bool = False
    mlp: bool = False
    head: bool = False
    experts: bool = False  # a mixture's experts: one pair per expert on each of fc_1, fc_2, proj (`LoRAExperts`)
    router: bool = False  # a mixture's router (the Linear that scores the experts)
    rslora: bool = False  # rank-stabilized scaling alpha / sqrt(r) (PEFT's use_rslora)
    loraplus_lr_ratio: Optional[float] = None  # LoRA+: B's learning rate is this times A's (training only)
    dora: bool = False  # DoRA: a trained magnitude per adapted output row (PEFT's use_dora)
    init: str = "default"  # default (kaiming A, B = 0), gaussian, pissa, olora, loftq (LORA_INITS)
    loftq_iters: int = 1  # LoftQ's alternating quantize / low-rank steps

    @property
    def scaling(self) -> float:
        return lora_scaling(self.alpha, self.r, self.rslora)

    def targets(self) -> list[str]:
        return [f.name for f in fields(self) if f.type in (bool, "bool") and getattr(self, f.name)
                and f.name not in _VARIANT_FLAGS]

    @classmethod
    def from_dict(cls, d: dict) -> "LoRAConfig":
        return cls(**{k: v for k, v in d.items() if k in {f.name for f in fields(cls)}})


class LoRALinear(nn.Module):
    """y = base(x) + scaling * B(A(dropout(x))), with the update limited to row ranges `parts` of the output."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, r: int, alpha: float, dropout: float,
                 parts: Optional[list[tuple[int, int]]] = None, rslora: bool = False, dora: bool = False,
                 init: str = "default") -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = in_features, out_features
        self.parts = parts or [(0, out_features)]  # (first row, number of rows) of each adapted slice
        self.r, self.scaling = r, lora_scaling(alpha, r, rslora)
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(len(self.parts) * r, in_features, device=device))  # [n*r, in]
        self.lora_B = nn.Parameter(torch.empty(sum(n for _, n in self.parts), r, device=device))  # [rows, r]
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.dora = dora
        if init in RESIDUAL_INITS:  # the initial A and B, which the base weight had taken out (export, merge, load)
            self.register_buffer("lora_A0", torch.zeros_like(self.lora_A, requires_grad=False))
            self.register_buffer("lora_B0", torch.zeros_like(self.lora_B, requires_grad=False))
        self.init = init
        if dora:  # DoRA (Liu et al. 2024, as PEFT's DoraLinearLayer): y = m / ||W + s*B@A||_row * (W + s*B@A) x + bias
            rows = sum(n for _, n in self.parts)
            self.lora_magnitude = nn.Parameter(torch.empty(rows, device=device))  # m, one per adapted row
            # ||W||^2 of every row of the base (constant): with it the row norms of W + s*B@A need no copy of W
            self.register_buffer("lora_wnorm2", torch.empty(out_features, device=device), persistent=False)

    def reset_lora_parameters(self) -> None:
        init_lora_(self.lora_A.data, self.lora_B.data, len(self.parts), self.r, self.init)

    def init_dora(self, weight: torch.Tensor) -> None:
        """Record the base's row norms from its full-precision (dequantized) weight [out, in], which the caller frees
        after, and start the magnitudes at ||W + s*B@A|| (||W|| for B = 0), as PEFT does."""
        with torch.no_grad():
            self.lora_wnorm2 = weight.float().square().sum(1).to(self.lora_A.device)
            self.lora_magnitude.copy_(self.dora_weight_norm())

    def dora_weight_norm(self, wa: Optional[torch.Tensor] = None) -> torch.Tensor:
        """||W + s*B@A|| of each adapted row, fp32, detached (DoRA's section 4.3, as PEFT): from ||W||^2 (kept),
        2s <W, B@A> (= 2s sum_k B_ik (W A^T)_ik, W A^T by the base layer itself on A's r rows: `wa`, [n*r, out] with
        the bias, when the caller has it) and s^2 ||B@A||^2 (= B (A A^T) B^T): no dequantized W, on a 4-bit base, and
        r instead of `in` products per row."""
        with torch.no_grad():
            A, B = self.lora_A.float(), self.stacked_B().float()
            if wa is None:
                wa = linear(self.base, A.to(self._norm_dtype()))
            wa = wa.float()
            bias = getattr(self.base, "bias", None)
            if bias is not None:
                wa = wa - bias.float()
            cross = (B * wa.T).sum(1)
            ba2 = ((B @ (A @ A.T)) * B).sum(1)
            s = self.scaling
            norm2 = (self.lora_wnorm2.float() + 2 * s * cross + s * s * ba2).clamp_min(0).sqrt()
            return norm2[self.dora_rows()]

    def _norm_dtype(self) -> torch.dtype:
        """The dtype A's rows go through the base layer in for the norms: the weight's (fp32 for a 4-bit layer, whose
        bytes are no float dtype: it computes in its own compute dtype)."""
        dtype = getattr(getattr(self.base, "weight", None), "dtype", torch.float32)
        return dtype if dtype.is_floating_point else torch.float32

    def dora_rows(self) -> torch.Tensor:
        """The output rows the magnitudes belong to, in lora_B's order."""
        return torch.cat([torch.arange(a, a + n, device=self.lora_A.device) for a, n in self.parts])

    def dora_scale(self, wa: Optional[torch.Tensor] = None) -> torch.Tensor:
        """m / ||W + s*B@A|| for every output row (1 for rows without LoRA), differentiable in m only."""
        g = self.lora_magnitude / self.dora_weight_norm(wa).to(self.lora_magnitude.dtype)
        if len(self.parts) == 1 and self.parts[0] == (0, self.out_features):
            return g
        return g.new_ones(self.out_features).index_put((self.dora_rows(),), g)

    def _dora_rescale(self, z: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """g * (z - bias) + bias for z = W x + bias + s*B A x [rows, out] (fp32): DoRA's output from LoRA's, with the
        factor g of a model that is not training (`_decode_weights`)."""
        bias = getattr(self.base, "bias", None)
        if bias is None:
            return z.mul_(g)
        b = bias.float()
        return z.sub_(b).mul_(g).add_(b)

    def _dora_forward(self, x: torch.Tensor) -> torch.Tensor:
        """PEFT's DoRA output y + (g - 1) * W x' + g * s * B A x' (g = `dora_scale`, x' = dropout(x), W x' without the
        bias) as g * (W x' + s * B A x') + (y - W x'): with the products g multiplies summed first, autograd keeps one
        activation-sized tensor for g's gradient instead of two. The base layer runs once, on x, x' (dropout on) and
        A's rows (the row norms) stacked: a 4-bit weight is dequantized once per step and direction, as without DoRA
        (three times forward and twice backward before, with dropout on). Not training and nothing to differentiate:
        `_frozen_forward`."""
        dropping = isinstance(self.dropout, nn.Dropout) and self.training and self.dropout.p > 0
        rows = x.reshape(-1, self.in_features)
        if dropping:  # nn.Dropout's distribution, drawn as _DropoutMatmul draws it (0.6x the cost, a 1-byte mask kept)
            p = self.dropout.p
            xd = torch.where(dropout_keep(rows, p), rows, 0) * (1.0 / (1.0 - p))
        else:
            xd = rows
        n, r = rows.shape[0], self.lora_A.shape[0]
        stacked = [rows, xd] if dropping else [rows]
        out = linear(self.base, torch.cat([*stacked, self.lora_A.detach().to(self._norm_dtype()).to(rows.dtype)]))
        y, wx, wa = out[:n], out[n:-r] if dropping else out[:n], out[-r:]
        ax = cpu_half.linear(xd.to(self.lora_A.dtype), self.lora_A)
        lora = cpu_half.linear(ax, self.stacked_B() * self.scaling)
        g = self.dora_scale(wa)
        bias = getattr(self.base, "bias", None)
        if bias is not None:
            wx = wx - bias.to(wx.dtype)
        z = g * (wx.to(g.dtype) + lora.to(g.dtype))
        rest = (y - wx) if dropping else bias  # y - W x' = bias + W (x - x')
        out = z if rest is None else z + rest.to(g.dtype)
        return out.to(y.dtype).view(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frozen = self.dora and not self.training and not torch.is_grad_enabled()
        if self.dora and not frozen:
            return self._dora_forward(x)
        y = linear(self.base, x)
        if frozen or self._decoding(x):
            return self._frozen_forward(x, y)
        p = self.dropout.p if isinstance(self.dropout, nn.Dropout) and self.training else 0.0
        if p > 0 and torch.is_grad_enabled() and not torch.is_autocast_enabled(x.device.type):
            ax = _DropoutMatmul.apply(x, self.lora_A, p)  # [B, T, n*r], one matmul for all parts
        else:  # (autocast casts the matmul's inputs itself: the plain ops there)
            ax = cpu_half.linear(self.dropout(x).to(self.lora_A.dtype), self.lora_A)
        # Why one matmul with the scaling folded into B: per part, the outputs would be multiplied by the scaling,
        # concatenated and added, three passes over an activation-sized tensor (5% of a CPU step); here the
        # scaling multiplies the small [out, n*r] matrix and addmm adds the product to y as it is written.
        B = self.stacked_B() * self.scaling
        if y.dtype == ax.dtype and not cpu_half.emulated(ax):
            rows, ax = y.reshape(-1, self.out_features), ax.reshape(-1, ax.size(-1))
            if _own_tensor(y) and not torch.is_autocast_enabled(y.device.type):  # (autocast casts no in-place op)
                # In place: with a new output, y's freed block of exactly its size became a hole that glibc (before
                # 2.38) does not give to a later request of that size, which torch makes 64-byte aligned (peak RSS of
                # GRPO's benchmark step without recomputation: 1.87 -> 1.77 GB).
                return rows.addmm_(ax, B.T).view(y.shape)
            return torch.addmm(rows, ax, B.T).view(y.shape)
        return y + cpu_half.linear(ax, B).to(y.dtype)

    def _frozen_forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The update added to y = base(x) in fp32 from `_decode_weights`' copies, rounded once to y's dtype, as addmm
        does; DoRA's rows then scaled by their fixed factor. Taken by decoding steps, and by DoRA whenever nothing
        trains (its factor then costs no product with the base per call).
        Why fp32 when decoding: a decoding step's products are tiny ([rows, in] @ [in, r] @ [r, out]), and 16-bit CPU
        matmuls of that size cost several times their fp32 ones (oneDNN's per-call overhead: 18 against 2.5 us for
        1 x 576 @ 576 x 24 in bf16 on an AVX512-BF16 CPU). With every layer adapted that made unmerged decoding 2.2x
        slower than merged."""
        A, Bt, g = self._decode_weights()
        ax = nn.functional.linear(x.reshape(-1, self.in_features).float(), A)
        z = torch.addmm(y.reshape(-1, self.out_features).float(), ax, Bt)
        return (z if g is None else self._dora_rescale(z, g)).to(y.dtype).view(y.shape)

    def _decoding(self, x: torch.Tensor) -> bool:
        """A generation step on CPU: a few rows of 16-bit activations, nothing to differentiate, no dropout, no
        autocast (which would cast the products back to 16 bits)."""
        return (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and not self.training
                and not torch.is_grad_enabled()
                and x.numel() <= (DECODE_BATCH if x.dim() >= 3 and x.size(-2) == 1 else DECODE_ROWS) * x.size(-1)
                and not torch.is_autocast_enabled("cpu"))

    def _decode_weights(self) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """fp32 A, (scaling * stacked B)^T [r, out] and, for DoRA, the factor g = `dora_scale` of every output row, for
        a model that is not training: made once instead of at every step (four to eight small ops per layer and step:
        decoding with every layer adapted went from 41 to 46 tokens/s; DoRA's g takes a product with the base).
        Made again whenever A, B or the magnitudes change: their version counters count every in-place update (an
        optimizer step, a load_state_dict). `train()` drops them (a few MB of fp32 copies that training would make
        stale)."""
        params = (self.lora_A, self.lora_B, self.lora_magnitude) if self.dora else (self.lora_A, self.lora_B)
        if any(p.is_inference() for p in params):  # no version counter to tell an update by: made every time
            return self._make_decode_weights()
        # the parameters themselves are held with the copies: a new tensor can never reuse their address or id
        stamp = tuple((p._version, p.data_ptr()) for p in params) + (self.scaling,)
        c = self.__dict__.get("_decode_cache")
        if c is None or any(a is not b for a, b in zip(c[0], params)) or c[1] != stamp:
            c = params, stamp, self._make_decode_weights()
            self.__dict__["_decode_cache"] = c
        return c[2]

    def _make_decode_weights(self) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        with torch.no_grad():
            A, Bt = self.lora_A.float().contiguous(), (self.stacked_B().float() * self.scaling).T.contiguous()
            return A, Bt, self.dora_scale().float().contiguous() if self.dora else None

    def drop_decode_weights(self) -> None:
        """Free the fp32 copies `_decode_weights` keeps (made again at the next decoding step)."""
        self.__dict__.pop("_decode_cache", None)

    def train(self, mode: bool = True) -> "LoRALinear":
        if mode:
            self.drop_decode_weights()
        return super().train(mode)

    def stacked_B(self) -> torch.Tensor:
        """B as one [out_features, n*r] matrix: part i's rows at its row range and in columns i*r to (i+1)*r, zeros
        elsewhere (rows without LoRA, e.g. k when only q and v are adapted), so ax @ stacked_B^T is every part's
        update at once."""
        if len(self.parts) == 1 and self.parts[0] == (0, self.out_features):
            return self.lora_B
        full = self.lora_B.new_zeros(self.out_features, len(self.parts) * self.r)
        b_row = 0
        for i, (start, n) in enumerate(self.parts):
            full[start:start + n, i * self.r:(i + 1) * self.r] = self.lora_B[b_row:b_row + n]
            b_row += n
        return full

    def delta_weight(self) -> torch.Tensor:
        """The dense update this adapter adds to the base weight: [out, in] in fp32."""
        return lora_delta(self.lora_A, self.lora_B, self.parts, self.r, self.scaling, self.out_features)


def _own_tensor(y: torch.Tensor) -> bool:
    """Whether the base layer's output y may be written in place: not a view (of an input, or made inside a custom
    autograd Function, whose backward autograd would then have to replace) and not a leaf that requires grad. No base
    layer keeps its output for backward."""
    return y._base is None and not (y.is_leaf and y.requires_grad)


class _DropoutMatmul(torch.autograd.Function):
    """dropout(x) @ A^T keeping x and a one-byte mask for backward, where plain autograd keeps the mask in x's dtype
    and the dropped-out copy of x: 5 instead of 8 bytes per element of every adapted layer's fp32 input. The mask is
    drawn from torch's generator (reproducible, restored on resume) as 31-bit integers, each kept when at or above
    p * 2^31: nn.Dropout's distribution (torch.rand has 24 bits) at 0.6x the cost of drawing floats on CPU, and
    torch.where instead of a multiplication by the bool mask (which converts it first, 4x slower). Together about a
    tenth of a CPU step with dropout on (tutorials/performance.md)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, A: torch.Tensor, p: float) -> torch.Tensor:
        keep = dropout_keep(x, p)
        ctx.save_for_backward(x, keep, A)
        ctx.scale = 1.0 / (1.0 - p)
        return cpu_half.mm(torch.where(keep, x, 0).mul_(ctx.scale).to(A.dtype), A.T)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, keep, A = ctx.saved_tensors
        grad_x = grad_a = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.where(keep, cpu_half.mm(grad, A), 0).mul_(ctx.scale).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dropped = torch.where(keep, x, 0).mul_(ctx.scale).to(A.dtype)
            grad_a = cpu_half.mm(grad.reshape(-1, grad.size(-1)).T, dropped.reshape(-1, dropped.size(-1)))
        return grad_x, grad_a, None


def dropout_keep(x: torch.Tensor, p: float) -> torch.Tensor:
    """Which elements of x dropout (probability p) keeps: 31-bit integers from torch's generator, each kept when at
    or above p * 2^31 (see _DropoutMatmul)."""
    return torch.empty(x.shape, dtype=torch.int32, device=x.device).random_() >= round(p * 2**31)


class LoRAExperts(nn.Module):
    """LoRA on one stacked projection of a layer's experts (`model.ExpertWeights` or its quantized form): expert e
    computes base(x, e) + scaling * B_e A_e dropout(x) on the rows routed to it, each expert with its own pair,
    `lora_A` [E, r, in] and `lora_B` [E, out, r]. Experts without tokens in a step get no update (zero gradient), as
    their base is not run. Why a pair per expert rather than one shared by all: tutorials/finetune_lora.md (measured);
    it is also the layout PEFT's target_parameters gives stacked experts (lit_qlora/export/peft_interop.py)."""

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float, rslora: bool = False,
                 init: str = "default") -> None:
        super().__init__()
        self.base = base
        self.n_expert, self.in_features, self.out_features = base.n_expert, base.in_features, base.out_features
        self.r, self.scaling = r, lora_scaling(alpha, r, rslora)
        device = next(base.parameters()).device
        self.lora_A = nn.Parameter(torch.empty(self.n_expert, r, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.empty(self.n_expert, self.out_features, r, device=device))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.init = init

    def reset_lora_parameters(self) -> None:
        """Each expert's A as a dense layer's (fan-in `in`), every B zero."""
        init_lora_(self.lora_A.data.view(-1, self.in_features), self.lora_B.data, self.n_expert, self.r, self.init)

    def per_expert(self) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """(x [n, in] of expert e's rows, e) -> [n, out], for the experts of one forward. The per-expert views of A and
        of scaling * B are taken here, once (unbind): backward then stacks their gradients in one op, where indexing
        the stacked parameters per expert would make a whole [E, r, in] gradient for every expert that ran."""
        A, B = self.lora_A.unbind(0), (self.lora_B * self.scaling).unbind(0)
        p = self.dropout.p if isinstance(self.dropout, nn.Dropout) and self.training else 0.0
        lean_dropout = p > 0 and torch.is_grad_enabled() and not torch.is_autocast_enabled(A[0].device.type)

        def run(x: torch.Tensor, e: int, bias: bool = True) -> torch.Tensor:
            y = self.base(x, e, bias=bias)
            if lean_dropout:  # (as LoRALinear: a one-byte mask kept for backward)
                ax = _DropoutMatmul.apply(x, A[e], p)
            else:
                ax = cpu_half.linear(self.dropout(x).to(A[e].dtype), A[e])
            if y.dtype == ax.dtype and not cpu_half.emulated(ax):
                return torch.addmm(y, ax, B[e].T)
            return y + cpu_half.linear(ax, B[e]).to(y.dtype)
        return run

    def forward(self, x: torch.Tensor, e: int, bias: bool = True) -> torch.Tensor:
        return self.per_expert()(x, e, bias)

    # each expert in turn with its update, the per-expert views taken once (per_expert), the rows split once
    many, many_with = ExpertWeights.many, ExpertWeights.many_with

    def delta_weight(self) -> torch.Tensor:
        """The dense update of every expert's weight: [E, out, in] in fp32."""
        return expert_lora_delta(self.lora_A, self.lora_B, self.scaling)

    def drop_decode_weights(self) -> None:
        """(Nothing kept for decoding: the server calls this on every wrapper it switches out.)"""


def expert_lora_delta(A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
    """scaling * B_e @ A_e for every expert: A [E, r, in], B [E, out, r] -> [E, out, in] in fp32 (the merge rule of
    expert LoRAs, as `lora_delta` is of the others)."""
    return torch.bmm(B.float(), A.float()) * scaling


def init_lora_(A: torch.Tensor, B: torch.Tensor, n_parts: int, r: int, init: str = "default") -> None:
    """As in the LoRA paper and PEFT: A random (each part's r rows on their own; kaiming-uniform, or N(0, 1/r^2) for
    `gaussian` as PEFT's), B zero, so training starts from the base model exactly. On whole tensors: the sharded
    loader initializes them like this, then keeps its shard. (pissa / olora / loftq: `residual_init`, at load.)"""
    for i in range(n_parts):
        if init == "gaussian":
            nn.init.normal_(A[i * r:(i + 1) * r], std=1 / r)
        else:
            nn.init.kaiming_uniform_(A[i * r:(i + 1) * r], a=math.sqrt(5))
    nn.init.zeros_(B)


def residual_init(weight: torch.Tensor, init: str, r: int, scaling: float, iters: int = 1,
                  quant_error: Optional[Any] = None) -> tuple[torch.Tensor, ...]:
    """(A [r, in], B [out, r], A0, B0) of one adapted weight W [out, in], fp32, as PEFT starts them (peft 0.21's
    tuners/lora/layer.py and utils/loftq_utils.py); the base keeps W - s*B0@A0 (quantized under --quantize).

    pissa: W = U S V^T, A = sqrt(S_r / s) V_r^T, B = U_r sqrt(S_r / s): s*B@A is W's best rank-r part, which the
      base gives up (A0, B0 = A, B; quantized: QPiSSA).
    olora: W = Q R, A = R[:r], B = Q[:, :r], A0, B0 = A, B.
    loftq: `iters` times: quantize the residual, A and B from the SVD of W - dequantize(quantized) (split as PiSSA's,
      over s so that s*B@A is that rank-r part at any alpha: PEFT's are for s = 1); the base keeps the residual of
      the step before (A0, B0: that step's factors, zero for one step), which is what gets quantized.
      `quant_error(w)` = w - dequantize(quantize(w)) in the layer's --quantize mode.
    """
    W = weight.float()
    if init == "olora":
        Q, R = torch.linalg.qr(W)
        A, B = R[:r].contiguous(), Q[:, :r].contiguous()
        return A, B, A, B
    if init == "pissa":
        A, B = _principal(W, r, scaling)
        return A, B, A, B
    if init == "loftq":
        if quant_error is None:
            raise UserError("--lora_init loftq adapts only layers stored in 4 bits (it starts from their "
                            "quantization error): pass a 4-bit --quantize such as bnb.nf4 (and --quantize_lm_head true "
                            "with --lora_head), or use --lora_init pissa")
        A0, B0 = W.new_zeros(r, W.shape[1]), W.new_zeros(W.shape[0], r)
        for i in range(iters):
            kept = W - scaling * (B0 @ A0)
            A, B = _principal(W - (kept - quant_error(kept)), r, scaling)
            if i + 1 < iters:
                A0, B0 = A, B
        return A, B, A0, B0
    raise ValueError(f"no residual init {init!r}")


def _principal(W: torch.Tensor, r: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A, B with s*B@A the best rank-r approximation of W, the singular values split evenly (PiSSA's, LoftQ's)."""
    U, S, Vh = torch.linalg.svd(W, full_matrices=False)
    root = (S[:r] / scaling).sqrt()
    return (root[:, None] * Vh[:r]).contiguous(), (U[:, :r] * root).contiguous()


def lora_delta(A: torch.Tensor, B: torch.Tensor, parts: list[tuple[int, int]], r: int, scaling: float,
               out_features: int) -> torch.Tensor:
    """scaling * B @ A placed in the adapted row ranges `parts` of an [out_features, in] weight, in fp32: exactly the
    update `LoRALinear.forward` adds (the one merge rule used by the loader, the on-disk merge and the exports)."""
    A, B = A.float(), B.float()
    delta = torch.zeros(out_features, A.shape[1], device=A.device)
    b_row = 0
    for i, (start, n) in enumerate(parts):
        delta[start:start + n] = B[b_row:b_row + n] @ A[i * r:(i + 1) * r]
        b_row += n
    return delta * scaling


def lora_targets(config: Config, lora: LoRAConfig) -> dict[str, list[tuple[int, int]] | None]:
    """Module name -> adapted row ranges (None = all rows) for the given model and LoRA settings."""
    check_moe_targets(config, lora)
    q, k, v = config.qkv_sizes
    targets: dict[str, Any] = {}
    qkv_parts = [(start, n) for on, start, n in ((lora.query, 0, q), (lora.key, q, k), (lora.value, q + k, v)) if on]
    mlp_names = ("fc",) if config.mlp_class == "GptNeoxMLP" else ("fc_1", "fc_2")
    for i in range(config.n_layer):
        p = f"transformer.h.{i}."
        if qkv_parts:
            targets[p + "attn.qkv"] = qkv_parts
        if lora.projection:
            targets[p + "attn.proj"] = None
        if lora.mlp:
            for n in mlp_names + ("proj",):
                targets[p + f"mlp.{n}"] = None
        if config.is_moe_layer(i):
            if lora.router:
                targets[p + "mlp.router"] = None
            if lora.experts:
                for n in EXPERT_PROJECTIONS:
                    targets[p + f"mlp.experts.{n}"] = None
    if lora.head:
        targets["lm_head"] = None
    return targets


EXPERT_PROJECTIONS = ("fc_1", "fc_2", "proj")  # the stacked projections of a layer's experts (model.Experts)


def is_expert_target(name: str) -> bool:
    """Whether our module `name` is a stacked projection of experts (a `LoRAExperts` target)."""
    return ".mlp.experts." in name


def check_moe_targets(config: Config, lora: LoRAConfig) -> None:
    """Refuse, in one line, LoRA settings on a mixture of experts (or asking for one) that are not implemented."""
    if (lora.experts or lora.router) and not config.moe_n_expert:
        flag = "--lora_experts" if lora.experts else "--lora_router"
        raise UserError(f"{flag} adapts a mixture of experts, which {config.name or config.hf_architecture} is not "
                        f"(it has dense MLPs); leave {flag} off (--lora_mlp adapts its MLPs)")
    if lora.mlp and config.moe_n_expert:
        raise UserError("--lora_mlp on a mixture of experts: its MLPs are experts; use --lora_experts true (and "
                        "--lora_router true) instead (the dense MLPs of mlp_only_layers are not adapted)")
    if not (lora.experts or lora.router):
        return
    what = "experts" if lora.experts else "router"
    if lora.dora:
        raise UserError(f"--lora_dora on the {what} (--lora_{what}) is not implemented (PEFT has no DoRA on them "
                        "either); leave --lora_dora off, or adapt attention only")
    if lora.init in RESIDUAL_INITS:
        raise UserError(f"--lora_init {lora.init} on the {what} (--lora_{what}) is not implemented; use --lora_init "
                        "default or gaussian")


def apply_lora(model: nn.Module, lora: LoRAConfig) -> None:
    """Wrap the targeted Linear layers of `model` in LoRALinear (works on the meta device)."""
    if lora.r <= 0:
        raise UserError(f"--lora_r must be positive, got {lora.r}; use e.g. --lora_r 8")
    if lora.init in RESIDUAL_INITS and lora.head and model.config.tie_embeddings:
        raise UserError(f"--lora_init {lora.init} cannot start a LoRA on a head tied to the embedding (the head "
                        "would keep a residual the embedding must not); leave --lora_head off or use --lora_init "
                        "default")
    for name, parts in lora_targets(model.config, lora).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child)
        if is_expert_target(name):  # (DoRA and the residual inits are refused there: check_moe_targets)
            wrapper: nn.Module = LoRAExperts(base, lora.r, lora.alpha, lora.dropout, rslora=lora.rslora,
                                             init=lora.init)
        else:
            out_f, in_f = base.weight.shape
            smallest = min([in_f, *(n for _, n in parts or [(0, out_f)])])
            if lora.init in RESIDUAL_INITS and lora.r > smallest:  # r singular vectors (QR columns) of each part
                raise UserError(f"--lora_init {lora.init} needs --lora_r at most the smaller side of each adapted "
                                f"weight (part); {name} has one of {smallest}: use --lora_r {smallest} or less, or "
                                "--lora_init default")
            wrapper = LoRALinear(base, in_f, out_f, lora.r, lora.alpha, lora.dropout, parts, rslora=lora.rslora,
                                 dora=lora.dora, init=lora.init)
        setattr(parent, child, wrapper)
    mark_only_lora_trainable(model)


def mark_only_lora_trainable(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name


def lora_modules(model: nn.Module) -> dict[str, "LoRALinear | LoRAExperts"]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAExperts))}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items() if "lora_" in k}


def load_lora_weights(model: nn.Module, lora_sd: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors into the model's LoRA parameters (and the initial A0, B0 of a residual init), whatever
    their dtype or device."""
    params = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    for k, v in lora_sd.items():
        if k not in params:
            raise UserError(f"adapter tensor {k} has no place in this model; the adapter targets other layers than the "
                            "model was built with")
        if params[k].shape != v.shape:
            raise UserError(f"adapter tensor {k} has shape {tuple(v.shape)}, the model expects "
                            f"{tuple(params[k].shape)}; "
                            "use the base model the adapter was trained on")
        with torch.no_grad():
            copy_into_param(params[k], v)


def copy_into_param(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole tensor `full` into `param` (any dtype or device); a DTensor parameter (FSDP) takes its own shard
    of it, placed by DTensor itself."""
    if hasattr(param, "device_mesh"):  # DTensor
        from torch.distributed.tensor import distribute_tensor

        full = full.to(device=param.device, dtype=param.dtype)
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full.to(param.dtype))


@contextlib.contextmanager
def _skip_normal_init():
    real = torch.nn.init.normal_
    torch.nn.init.normal_ = lambda tensor, *args, **kwargs: tensor
    try:
        yield
    finally:
        torch.nn.init.normal_ = real


def meta_model(config: Config, lora: Optional[LoRAConfig] = None) -> GPT:
    """The model on the meta device (allocates nothing), with LoRA layers if `lora` is given: every shape and tie
    without a byte of weights, for the loader, the checkpoint check, the memory planner and parameter counts."""
    # An init on meta computes nothing, but `normal_` (nn.Embedding's init) has no meta kernel and runs through
    # torch's Python reference, which imports TorchDynamo: 70 MB resident in a generation process for nothing.
    with torch.device("meta"), _skip_normal_init():
        model = GPT(config)
    if lora is not None:
        apply_lora(model, lora)
    return model
