"""What a `--precision` value means for our tensors: the dtypes of compute, frozen and trainable weights."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lit_qlora.utils import UserError

PRECISIONS = ("32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed")


@dataclass(frozen=True)
class Precision:
    """What a `--precision` value means for our tensors.

    *-true: every floating weight and the compute in `dtype` (16-true keeps the LoRA weights in fp32, see below).
    *-mixed: trainable (LoRA) weights in fp32, compute under autocast in `dtype`; frozen Linear weights are
    stored in `dtype` (autocast would cast them to it for every matmul anyway), embeddings and norms in fp32.
    """

    name: str
    dtype: torch.dtype  # compute dtype
    mixed: bool

    @property
    def trainable_dtype(self) -> torch.dtype:
        # fp16 LoRA weights cannot train with AdamW: its eps (1e-8) rounds to 0 in fp16, and lora_A's first gradient
        # is exactly 0 (B starts at 0), so the first update is 0/0. The few LoRA weights stay fp32 under 16-true too.
        return torch.float32 if self.mixed or self.dtype == torch.float16 else self.dtype

    @property
    def frozen_linear_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def frozen_other_dtype(self) -> torch.dtype:
        return torch.float32 if self.mixed else self.dtype


def parse_precision(precision: str) -> Precision:
    if precision not in PRECISIONS:
        raise UserError(f"unknown --precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    dtype = {"32": torch.float32, "16": torch.float16, "bf16": torch.bfloat16}[precision.split("-")[0]]
    return Precision(precision, dtype, precision.endswith("-mixed"))
