"""What a `--precision` value means for our tensors: the dtypes of compute, frozen and trainable weights."""
from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch

from lit_qlora.utils import UserError

PRECISIONS = ("32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed")
PRECISION_CHOICES = ("auto", *PRECISIONS)  # what --precision accepts; "auto" is resolved by `resolve_precision`
ACCELERATORS = ("auto", "cpu", "cuda")  # what --accelerator accepts; "auto" is resolved by `resolve_accelerator`


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
        raise UserError(f"unknown --precision {precision!r}; choose one of {', '.join(PRECISION_CHOICES)}")
    dtype = {"32": torch.float32, "16": torch.float16, "bf16": torch.bfloat16}[precision.split("-")[0]]
    return Precision(precision, dtype, precision.endswith("-mixed"))


# ---- CPU matmul caches -----------------------------------------------------------------------------
CPU_MATMUL_CACHE = 64  # entries in each of the two caches below (torch's default: 1024 each)


def bound_cpu_matmul_caches(capacity: int = CPU_MATMUL_CACHE) -> None:
    """Cap the caches of prepared matmuls that a CPU's 16-bit matmuls fill (oneDNN's primitive cache and ideep's,
    above it), unless the user has set them.

    Each distinct shape of a bf16/fp16 matmul on oneDNN (CPUs with AVX512) gets its own prepared primitive, ~1-2 MB
    each, kept in a cache of 1024. Training changes shapes with every batch (the unpadded row's length), so those
    caches only grow: SmolLM2-135M nf4-dq bf16, 100 iterations, AVX512-BF16 CPU: peak 2.36 GB with torch's defaults,
    1.53 GB with 64, and no slower (0.95 vs 1.07 s per iteration); the demo's tiny model: 1.26 -> 0.47 GB, 15.5 ->
    19.5 s, its steps being short enough for re-preparing to show (tutorials/performance.md). Both caches read
    their capacity once, at their first use: call this before any 16-bit matmul. Child processes (DDP) inherit it."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(capacity))


# ---- --accelerator auto, --precision auto ---------------------------------------------------------
def resolve_accelerator(accelerator: str) -> str:
    """The device type an --accelerator value runs on, resolved once per run and passed down: cuda for auto when a GPU
    is visible, else cpu. An explicit cuda stays cuda without a GPU (an estimate plans for a GPU elsewhere); what
    loads refuses it there."""
    if accelerator not in ACCELERATORS:
        raise UserError(f"unknown --accelerator {accelerator!r}; choose one of {', '.join(ACCELERATORS)}")
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return accelerator


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (/proc/cpuinfo); empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls at (or above) fp32 speed. Without them, torch converts bf16 in software and a
    bf16 matmul runs several times slower than fp32 (tutorials/performance.md)."""
    return cpu_has_native(torch.bfloat16)


def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies the 16-bit `dtype` in hardware: AVX512-BF16/AMX-BF16 for bf16,
    AVX512-FP16/AMX-FP16 for fp16."""
    flags = cpu_flags()
    if dtype == torch.bfloat16:
        return bool({"avx512_bf16", "amx_bf16"} & flags)
    return bool({"avx512_fp16", "amx_fp16"} & flags)


def resolve_precision(precision: str, device_type: str) -> tuple[str, str]:
    """(precision, why) for `--precision auto`; other values come back as given, with why "".

    CUDA with bf16 support -> bf16-true; CUDA without -> 16-mixed (fp16 compute with loss scaling); a CPU with native
    bf16 (AVX512-BF16 or AMX) -> bf16-true; any other CPU -> 32-true. 4-bit storage is unchanged: only the compute
    dtype moves."""
    if precision != "auto":
        parse_precision(precision)
        return precision, ""
    if device_type == "cuda":
        if not torch.cuda.is_available():  # planning for a GPU elsewhere (scripts/estimate_memory.py --device cuda)
            return "bf16-true", "auto: assumed for a GPU with bf16 (none is visible here)"
        if torch.cuda.is_bf16_supported():
            return "bf16-true", "auto: this GPU computes in bf16"
        return "16-mixed", "auto: this GPU has no bf16, so fp16 with loss scaling"
    if cpu_has_native_bf16():
        return "bf16-true", "auto: this CPU has native bf16 (AVX512-BF16/AMX)"
    return "32-true", ("auto: this CPU has no native bf16 (no AVX512-BF16/AMX): fp32 is the fastest here, "
                       "bf16-true the smaller")


def slow_precision_warning(precision: str, device_type: str) -> Optional[str]:
    """A one-line warning for a 16-bit precision asked for on a CPU without native support for it, else None.

    *-true precisions run their matmuls by fp32 kernels there (kernels/cpu_half.py): slightly slower than 32-true.
    *-mixed ones go through autocast's 16-bit kernels: several times slower."""
    if device_type != "cpu" or precision == "32-true":
        return None
    half = torch.float16 if precision.startswith("16") else torch.bfloat16
    if cpu_has_native(half):
        return None
    name = "fp16" if half == torch.float16 else "bf16"
    if precision.endswith("-true"):
        cost = (f"its matmuls run by fp32 kernels on {name} data, so steps are about as fast as --precision 32-true "
                "(up to 1.2x slower) with less memory")
    else:
        cost = "autocast's emulated kernels make steps several times slower than --precision 32-true"
    return (f"warning: --precision {precision} on a CPU without native {name} support: {cost} "
            "(tutorials/performance.md); --precision auto picks for you")


def autocast_for(precision: str, device: torch.device):
    """*-mixed keeps embeddings and norms in fp32 and Linear weights low: compute under autocast, as in training."""
    prec = parse_precision(precision)
    return torch.autocast(device.type, dtype=prec.dtype) if prec.mixed else nullcontext()
