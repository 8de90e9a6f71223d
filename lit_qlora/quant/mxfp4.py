"""MXFP4, the format gpt-oss's published checkpoints store their experts in: reading it, expert by expert.

The OCP Microscaling format, MXFP4 variant: a weight row is cut into blocks of 32 values; each value is a 4-bit
float (E2M1: a sign bit, 2 exponent bits, 1 mantissa bit, so one of 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives)
and each block has one shared scale, an 8-bit power of two (E8M0: 2^(s - 127)). gpt-oss's files hold, per stacked
projection, `*_blocks` [E, rows, in / 32, 16] uint8 (two values per byte, the low nibble first) and `*_scales`
[E, rows, in / 32] uint8. Our checkpoint keeps those bytes as they are (`{stack}.weight_blocks` / `.weight_scales`,
rows split per projection), so a converted gpt-oss is as small as the published one; the loader dequantizes one
expert at a time and quantizes it to --quantize (or keeps it dense): MXFP4 values are exact in bf16, so nothing is
rounded on the way. No full-precision copy of the model is ever in memory, only one expert's [out, in].
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from lit_qlora.utils import UserError

BLOCK = 32  # values per block: one scale each
BLOCKS_SUFFIX, SCALES_SUFFIX = ".weight_blocks", ".weight_scales"
# E2M1 codes 0..15: codes 0-7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6 (exponent bits 00 give 0 / 0.5, then 1.m * 2^(e - 1));
# bit 3 is the sign
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> the values [..., G * 32] in `dtype` (exact in bf16 and
    fp32: an E2M1 value has 2 significant bits)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or \
            blocks.size(-1) != BLOCK // 2:
        raise UserError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                        f"{scales.dtype} do not fit together; convert the checkpoint again")
    pairs = _byte_values(blocks.device)[blocks.int()].view(*blocks.shape[:-1], BLOCK)  # [..., G, 32]
    out = torch.empty(pairs.shape, dtype=dtype, device=blocks.device)
    torch.mul(pairs, torch.exp2(scales.float() - 127).unsqueeze(-1), out=out)  # exact: a power of two
    return out.flatten(-2)


_BYTE_VALUES: dict = {}


def _byte_values(device: torch.device) -> torch.Tensor:
    """[256, 2] fp32: the two values a byte holds, its low nibble's first (one lookup per byte instead of two)."""
    if device not in _BYTE_VALUES:
        _BYTE_VALUES[device] = torch.tensor([(E2M1[b & 0x0F], E2M1[b >> 4]) for b in range(256)],
                                            dtype=torch.float32, device=device)
    return _BYTE_VALUES[device]


class Mxfp4Tensor:
    """A stacked expert weight [E, out, in] stored as MXFP4, not dequantized yet: `blocks` [E, out, in / 32, 16] and
    `scales` [E, out, in / 32], each a tensor or a not-yet-read file tensor (anything with `read(start, count)`,
    lit_qlora.checkpoint.FileTensor). `expert(e)` dequantizes one expert, `load()` all of them into one tensor."""

    def __init__(self, blocks, scales) -> None:
        E, out, G, half = blocks.shape
        if tuple(scales.shape) != (E, out, G) or half != BLOCK // 2:
            raise UserError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit "
                            "together; convert the checkpoint again")
        self.blocks, self.scales = blocks, scales
        self.shape = torch.Size((E, out, G * BLOCK))
        self.dtype = torch.bfloat16  # what it dequantizes to, exactly

    def _part(self, t, e: int) -> torch.Tensor:
        if not hasattr(t, "read"):
            return t[e]
        n = t.shape[1:].numel()
        return t.read(e * n, n).view(t.shape[1:])

    def expert(self, e: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Expert e's [out, in], dequantized to `dtype`."""
        return dequantize(self._part(self.blocks, e), self._part(self.scales, e), dtype)

    def load(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Every expert, [E, out, in] in `dtype`, filled one expert at a time."""
        out = torch.empty(self.shape, dtype=dtype)
        for e in range(self.shape[0]):
            out[e] = self.expert(e, dtype)
        return out


def stored_shapes(stack: str, shape: torch.Size) -> dict[str, torch.Size]:
    """The MXFP4 tensors that store the dense stack `{stack}.weight` of `shape` [E, out, in] in our checkpoint."""
    E, out, in_f = shape
    return {stack + BLOCKS_SUFFIX: torch.Size((E, out, in_f // BLOCK, BLOCK // 2)),
            stack + SCALES_SUFFIX: torch.Size((E, out, in_f // BLOCK))}


def join_stacks(tensors: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
    """(name, tensor) pairs of a checkpoint with each MXFP4 pair `{stack}.weight_blocks` / `{stack}.weight_scales`
    yielded as one (`{stack}.weight`, Mxfp4Tensor) once both have come (our converter writes them one after the
    other); every other pair as it is."""
    pending: dict[str, dict[str, object]] = {}
    for name, t in tensors:
        suffix = next((s for s in (BLOCKS_SUFFIX, SCALES_SUFFIX) if name.endswith(s)), None)
        if suffix is None:
            yield name, t
            continue
        stack = name.removesuffix(suffix)
        parts = pending.setdefault(stack, {})
        parts[suffix] = t
        if len(parts) == 2:
            del pending[stack]
            yield stack + ".weight", Mxfp4Tensor(parts[BLOCKS_SUFFIX], parts[SCALES_SUFFIX])
    if pending:
        stack, parts = next(iter(pending.items()))
        lost = SCALES_SUFFIX if BLOCKS_SUFFIX in parts else BLOCKS_SUFFIX
        raise UserError(f"the checkpoint has no {stack}{lost} beside {stack}{next(iter(parts))}; the checkpoint is "
                        "incomplete: convert it again")
