"""The `--quantize` modes, as one type: everything the rest of the package asks of a mode is an attribute here.

A mode is parsed once where it enters (a flag, an adapter's record, a stored quantization's metadata) with
`QuantMode.parse`, which also turns "none" into None. It is still a `str` (its flag value), so it prints, compares
and serialises as the flag the user typed; nothing outside this type compares a mode, or a bitsandbytes quant_type,
with a string. Adding a mode: one member below (name, bits, bitsandbytes' quant_type, double quantization) plus, if
its bytes differ from the two layouts in `layer_bytes`, its branch there; then the layer that stores it in
`quantize.make_quantized_linear`.
"""
from __future__ import annotations

from enum import Enum
from typing import Optional

from lit_qlora.utils import UserError

BNB_4BIT_BLOCKSIZE = 64  # values per absmax block of bitsandbytes' 4-bit layers
BNB_DQ_BLOCKSIZE = 256  # absmax values per block of the double quantization


class QuantMode(str, Enum):
    """One bitsandbytes storage of a base weight."""

    NF4 = ("bnb.nf4", 4, "nf4", False)
    NF4_DQ = ("bnb.nf4-dq", 4, "nf4", True)
    FP4 = ("bnb.fp4", 4, "fp4", False)
    FP4_DQ = ("bnb.fp4-dq", 4, "fp4", True)
    INT8 = ("bnb.int8", 8, None, False)

    def __new__(cls, flag: str, bits: int, quant_type: Optional[str], double_quant: bool) -> "QuantMode":
        obj = str.__new__(cls, flag)
        obj._value_ = flag
        obj.bits = bits  # bits per stored weight value (statistics not included)
        obj.quant_type = quant_type  # bitsandbytes' quant_type of a 4-bit layer ("nf4" / "fp4"); None: LLM.int8
        obj.double_quant = double_quant  # the 4-bit absmax scales themselves quantized to 8 bits
        return obj

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def is_4bit(self) -> bool:
        return self.bits == 4

    @property
    def is_int8(self) -> bool:
        return self.bits == 8

    @property
    def shardable(self) -> bool:
        """Whether FSDP can shard its layers: int8 keeps its row scales on the weight object, which FSDP replaces."""
        return not self.is_int8

    @classmethod
    def of_quant_state(cls, state) -> Optional["QuantMode"]:
        """The 4-bit mode a bitsandbytes QuantState stores (its quant_type, its absmax double-quantized or not);
        None for a storage no mode here makes."""
        return next((m for m in cls if m.is_4bit and m.quant_type == getattr(state, "quant_type", None)
                     and m.double_quant == bool(getattr(state, "nested", False))), None)

    def layer_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes bitsandbytes stores for one quantized [out, in] weight, statistics included."""
        n = out_features * in_features
        if self.is_int8:
            return n + 4 * out_features  # int8 values + one fp32 absmax per row (SCB)
        blocks = -(-n // BNB_4BIT_BLOCKSIZE)
        size = -(-n // 2) + 16 * 4  # two 4-bit values per byte + the layer's 16-entry fp32 code table
        if self.double_quant:
            # absmax itself quantized to uint8 (blocks of 256), plus its fp32 scales, 256-entry code and offset
            return size + blocks + 4 * -(-blocks // BNB_DQ_BLOCKSIZE) + 256 * 4 + 4
        return size + 4 * blocks

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)

    @classmethod
    def parse(cls, value: "str | QuantMode | None") -> Optional["QuantMode"]:
        """The mode a flag value names; None for no quantization (None, "none"). Unknown names: one-line error."""
        if value is None or isinstance(value, cls):
            return value
        if str(value).lower() == "none":
            return None
        try:
            return cls(value)
        except ValueError:
            raise UserError(f"unknown --quantize {value!r}; choose one of {', '.join(cls.names())} or leave it "
                            "out") from None
