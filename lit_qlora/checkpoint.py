"""Our checkpoint folder on disk: safetensors reading and writing, tensor by tensor, and the up-front folder check.

A converted folder holds `lit_model.safetensors` (our tensor names) and `model_config.json` (our `Config`). Every
tensor is read with a plain file read rather than a memory map: pages of a mapped file stay in the process's
resident set once touched, which would make the whole checkpoint count against peak memory. Files are written
sequentially after a header computed from shapes alone, so no two full copies of a model ever exist in memory.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Optional

import torch

from lit_qlora.config import Config
from lit_qlora.lora import meta_model
from lit_qlora.quant.mxfp4 import Mxfp4Tensor, stored_shapes
from lit_qlora.readers import safetensors_header as check_safetensors_header
from lit_qlora.utils import UserError, atomic_write

LIT_WEIGHTS = "lit_model.safetensors"
LIT_CONFIG = "model_config.json"

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

TensorSpec = tuple[str, torch.Size, torch.dtype]


# ---- reading ------------------------------------------------------------------------------------
def safetensors_header(path: Path) -> tuple[dict, int]:
    """The tensor entries of a safetensors file's JSON header (without `__metadata__`) and the byte offset where the
    tensor data starts. A UserError ("damaged or truncated") when the header does not describe the file
    (`lit_qlora.readers.safetensors_header`)."""
    header, base = _raw_header(path)
    header.pop("__metadata__", None)
    return header, base


def safetensors_metadata(path: Path) -> dict:
    """The `__metadata__` strings of a safetensors file's header ({} without any); a UserError as
    `safetensors_header`."""
    return _raw_header(path)[0].get("__metadata__") or {}


def _raw_header(path: Path) -> tuple[dict, int]:
    """The whole JSON header (`__metadata__` included) and where the tensor data starts."""
    # every entry checked against the file (dtype, shape x dtype = span, inside the file, no overlaps): a UserError
    # saying "damaged or truncated" and naming the tensor otherwise
    header, meta, base = check_safetensors_header(path, dtypes=DTYPES)
    return {**header, "__metadata__": meta}, base


def safetensors_specs(path: Path) -> list[TensorSpec]:
    """(name, shape, dtype) of every tensor in a safetensors file, in file order (the order `read_safetensors`
    yields)."""
    header, _ = safetensors_header(path)
    items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    return [(k, torch.Size(e["shape"]), DTYPES[e["dtype"]]) for k, e in items]


class FileTensor:
    """A tensor of a safetensors file, not read yet: its shape and dtype, its elements read a range at a time
    (`read`) or all at once (`load`). The loader quantizes a large layer from it a chunk at a time, so no whole
    16-bit copy of it is ever in memory (49 MB for a 32000 x 768 bf16 output layer)."""

    def __init__(self, path: Path, offset: int, shape: torch.Size, dtype: torch.dtype) -> None:
        self.path, self.offset, self.shape, self.dtype = path, offset, torch.Size(shape), dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()

    def numel(self) -> int:
        return self.shape.numel()

    def read(self, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of the flattened tensor (fewer at its end), as a new 1-D tensor."""
        count = max(0, min(count, self.numel() - start))
        t = torch.empty(count * self.itemsize, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.offset + start * self.itemsize)
            f.readinto(memoryview(t.numpy()))
        return t.view(self.dtype)

    def load(self) -> torch.Tensor:
        return self.read(0, self.numel()).reshape(self.shape)

    def read_rows(self, f: BinaryIO, rows: list[int]) -> torch.Tensor:
        """Rows `rows` of this 2-D tensor, read from `f` (its file, opened binary), [len(rows), cols]: one positioned
        read per row, so nothing else of the file is read or mapped."""
        row_bytes = self.shape[1] * self.itemsize
        out = bytearray(len(rows) * row_bytes)
        for i, r in enumerate(rows):
            row = os.pread(f.fileno(), row_bytes, self.offset + r * row_bytes)
            if len(row) != row_bytes:
                raise UserError(f"{self.path} is shorter than its header says; convert the checkpoint again")
            out[i * row_bytes:(i + 1) * row_bytes] = row
        return torch.frombuffer(out, dtype=self.dtype).view(len(rows), self.shape[1])


def as_tensor(t: "torch.Tensor | FileTensor | Mxfp4Tensor") -> torch.Tensor:
    """`t` itself, or a FileTensor read whole, or an MXFP4 expert stack dequantized whole (bf16, exact)."""
    return t.load() if isinstance(t, (FileTensor, Mxfp4Tensor)) else t


def read_safetensors(path: Path, keys: Optional[set[str]] = None,
                     deferred: bool = False) -> Iterator[tuple[str, "torch.Tensor | FileTensor"]]:
    """Yield (name, tensor) from a safetensors file, one freshly read tensor at a time, in file order; with
    `deferred`, a FileTensor for each instead (nothing read until asked for)."""
    path = Path(path)
    size = path.stat().st_size
    try:
        header, base = safetensors_header(path)
    except ValueError:
        raise UserError(f"{path} is truncated or has a damaged header; convert the checkpoint again (delete it and "
                        "rerun)") from None
    with open(path, "rb") as f:
        for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if keys is not None and name not in keys:
                continue
            start, end = e["data_offsets"]
            if base + end > size:
                raise UserError(f"{path} is truncated at tensor {name}; convert the checkpoint again (delete it and "
                                "rerun)")
            if deferred:
                yield name, FileTensor(path, base + start, e["shape"], DTYPES[e["dtype"]])
                continue
            t = torch.empty(end - start, dtype=torch.uint8)
            f.seek(base + start)
            f.readinto(memoryview(t.numpy()))
            yield name, t.view(DTYPES[e["dtype"]]).reshape(e["shape"])


# ---- writing ------------------------------------------------------------------------------------
def write_safetensors_stream(path: Path, specs: list[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]],
                             metadata: Optional[dict] = None) -> None:
    """Write a safetensors file whose header is known up front; tensors arrive one at a time (atomic)."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, shape, dtype in specs:
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns tensor data to 8 bytes

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for (name, shape, dtype), (got_name, t) in zip(specs, tensors):
                if got_name != name or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                    raise RuntimeError(f"stream mismatch at {name}: got {got_name} {tuple(t.shape)} {t.dtype}")
                f.write(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())

    atomic_write(path, write)


# ---- our tensors and the folder check ---------------------------------------------------------------
def lit_param_shapes(config: Config) -> dict[str, torch.Size]:
    """Our state-dict keys and shapes as stored in a checkpoint (a tied head is stored once, as the embedding; with
    `moe_mxfp4` each expert stack's weight as its MXFP4 blocks and scales, lit_qlora/quant/mxfp4.py)."""
    sd = {k: v.shape for k, v in meta_model(config).state_dict().items()}
    if config.tie_embeddings:
        sd.pop("lm_head.weight", None)
    if config.moe_mxfp4:
        sd = {k2: s2 for k, s in sd.items()
              for k2, s2 in (stored_shapes(k.removesuffix(".weight"), s).items()
                             if ".mlp.experts." in k and k.endswith(".weight") else ((k, s),))}
    return sd


def check_checkpoint(checkpoint_dir: Path, config: Config) -> None:
    """Make sure the converted checkpoint is whole and agrees with its config, reading only the safetensors header
    (and the file size), so a broken or partial checkpoint is refused in one line before anything heavy loads."""
    checkpoint_dir = Path(checkpoint_dir)
    weights = checkpoint_dir / LIT_WEIGHTS
    redo = ("delete it and run again to convert the Hugging Face files again"
            if (checkpoint_dir / "config.json").is_file() else "convert the checkpoint again")
    size = weights.stat().st_size
    try:
        header, base = safetensors_header(weights)
        end = base + max((int(e["data_offsets"][1]) for e in header.values()), default=0)
        shapes = {k: tuple(e["shape"]) for k, e in header.items()}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise UserError(f"{weights} is damaged or truncated (unreadable header, {size} bytes); {redo}") from None
    if size < end:
        raise UserError(f"{weights} is truncated ({size} of {end} bytes); {redo}")
    expected = lit_param_shapes(config)
    for key, shape in expected.items():
        if key not in shapes:
            raise UserError(f"{weights} has no tensor {key}; the checkpoint is incomplete: {redo}")
        if shapes[key] != tuple(shape):
            raise UserError(f"{weights} holds {key} with shape {shapes[key]} but {LIT_CONFIG} implies "
                            f"{tuple(shape)}; the config and the weights disagree: convert the checkpoint again")
    extra = sorted(set(shapes) - set(expected))
    if extra:
        raise UserError(f"{weights} holds {extra[0]!r}, which the model in {LIT_CONFIG} has no place for; the config "
                        "and the weights disagree: convert the checkpoint again")
