"""Quantize a checkpoint once, load it quantized: the bitsandbytes layers' bytes, stored next to the checkpoint.

bitsandbytes' CPU quantizer is slow (SmolLM2-135M to nf4: 4.0 s against 0.2 s for a dense load; a 7B model takes
minutes), and every CPU load with --quantize paid it again. `python scripts/quantize_checkpoint.py --checkpoint_dir
<folder> --quantize bnb.nf4 --precision bf16-true` stores what the loader would compute, and any later CPU load of
that folder with the same --quantize and compute dtype (generation, chat, fine-tuning) reads it instead.

The file is `<checkpoint>/lit_model.<quantize>.<dtype>.safetensors` (e.g. `lit_model.bnb.nf4.bfloat16.safetensors`:
the weights are quantized from the compute dtype, so that is part of what they are). Per quantized weight `name`:
`name` holds the packed bytes (int8 rows for bnb.int8) and `name.<entry>` bitsandbytes' own serialization of its
QuantState (`QuantState.as_dict(packed=True)`: absmax, quant_map, the nested entries, and the packed
`quant_state.bitsandbytes__<type>` settings); int8 keeps its row scales as `name.SCB`. Only quantized weights are in
it: norms, biases and embeddings are still read from the checkpoint.

A stored file is used only while it matches: its header records the checkpoint's size, modification time and a hash
of its header and of samples of its data, the mode, the dtype and the bitsandbytes version. If any differs (the
checkpoint was converted or merged again, copied without its times, another bitsandbytes), the loader says so in
one line and quantizes as before. Not used: on a GPU (quantizing there is fast), with an adapter merged into the
weights while they load (generate/lora.py's default with --lora_path: merge it into a folder with
scripts/merge_lora.py first), or for an FSDP-sharded load.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from lit_qlora.checkpoint import DTYPES, FileTensor, safetensors_header, safetensors_metadata, write_safetensors_stream
from lit_qlora.quant.quantize import (
    PartsQuantState,
    four_bit_settings,
    is_quantized,
    load_bnb,
    repacked_4bit_layers,
    set_4bit_weight,
    set_int8_weight,
)
from lit_qlora.utils import UserError

FORMAT = "lit-qlora quantized weights 2"
_SAMPLES, _SAMPLE_BYTES = 32, 4096


def stored_path(weights: Path, quantize: str, dtype: torch.dtype) -> Path:
    """Where the quantized weights of the checkpoint file `weights` for `quantize` from `dtype` are stored."""
    weights = Path(weights)
    return weights.with_name(f"{weights.stem}.{quantize}.{str(dtype).removeprefix('torch.')}.safetensors")


def fingerprint(weights: Path) -> str:
    """What identifies the checkpoint file `weights` for a stored quantization: its size and modification time, and a
    hash of its header and of 32 4 KiB samples spread over its data (a few ms on any size of file)."""
    st = Path(weights).stat()
    h = hashlib.sha256()
    with open(weights, "rb") as f:
        n = min(int.from_bytes(f.read(8), "little"), st.st_size - 8)  # a damaged header is the loader's to report
        h.update(f.read(n))
        for i in range(_SAMPLES):
            f.seek(8 + n + (st.st_size - 8 - n) * i // _SAMPLES)
            h.update(f.read(_SAMPLE_BYTES))
    return f"{st.st_size}:{st.st_mtime_ns}:{h.hexdigest()}"


def _expected(weights: Path, quantize: str, dtype: torch.dtype) -> dict:
    return {"lit_qlora": FORMAT, "source": fingerprint(weights), "quantize": quantize,
            "dtype": str(dtype).removeprefix("torch."), "bitsandbytes": load_bnb().__version__}


def _entries(module: nn.Module) -> dict[str, torch.Tensor]:
    """A quantized layer's stored tensors, by their suffix after the weight's name ("" for the weight itself)."""
    w = module.weight
    if isinstance(module, load_bnb().nn.Linear8bitLt):
        return {"": w.data, ".SCB": w.SCB}
    out = {"": w.data.view(-1).view(torch.uint8).unsqueeze(1)}  # any quant_storage, stored as bytes
    out.update({f".{k}": v.contiguous() for k, v in w.quant_state.as_dict(packed=True).items()})
    return out


def write_stored(model: nn.Module, weights: Path, quantize: str, dtype: torch.dtype) -> tuple[Path, int]:
    """Store every quantized layer of `model` (loaded from `weights` with `quantize` from `dtype`, before any CPU
    inference packing) next to `weights`, atomically. Returns (the file, the number of layers)."""
    repacked = repacked_4bit_layers(model)
    if repacked:  # bitsandbytes' CPU inference layout is not what a load reads back
        raise RuntimeError(f"{repacked[0]} was repacked for CPU inference; store a model as it was loaded")
    tensors: list[tuple[str, torch.Tensor]] = []
    for name, module in model.named_modules():
        if is_quantized(module):
            key = name.removesuffix(".base") + ".weight"  # the checkpoint's name (a LoRA layer wraps its base)
            tensors += [(key + suffix, t) for suffix, t in _entries(module).items()]
    path = stored_path(weights, quantize, dtype)
    specs = [(k, t.shape, t.dtype) for k, t in tensors]
    write_safetensors_stream(path, specs, iter(tensors), metadata=_expected(weights, quantize, dtype))
    return path, sum(1 for k, _ in tensors if k.endswith(".weight"))


class StoredQuantization:
    """An open stored file: `fill(module, key)` gives a quantized layer its stored weight; `filled` counts them."""

    def __init__(self, path: Path) -> None:
        self.path, self.filled = path, 0
        header, base = safetensors_header(path)
        self.layers: dict[str, dict[str, FileTensor]] = {}  # weight name -> {"": the weight, ".absmax": ..., ...}
        for k, e in header.items():
            layer, _, entry = k.rpartition(".weight")  # "<layer>.weight" + "" / ".absmax" / ".SCB" / ...
            self.layers.setdefault(layer + ".weight", {})[entry] = FileTensor(path, base + e["data_offsets"][0],
                                                                               e["shape"], DTYPES[e["dtype"]])

    def fill(self, module: nn.Module, key: str) -> bool:
        """Give the (meta) quantized layer `module` the stored weight `key` (a checkpoint name); False (nothing
        done) when the file has none for it, or one of another shape or kind."""
        bnb = load_bnb()
        entries = dict(self.layers.get(key, {}))
        stored = entries.pop("", None)
        if stored is None:
            return False
        if isinstance(module, bnb.nn.Linear8bitLt):
            scb = entries.get(".SCB")
            if stored.dtype != torch.int8 or scb is None or tuple(stored.shape) != (module.out_features,
                                                                                   module.in_features):
                return False
            set_int8_weight(module, stored.load(), scb.load())
            self.filled += 1
            return True
        qs = {entry[1:]: t.load() for entry, t in entries.items()}  # bitsandbytes' QuantState entries
        if stored.dtype != torch.uint8 or not qs:
            return False
        settings = four_bit_settings(module)
        if any(k.startswith("part") for k in qs):  # quantized part by part (PartsQuantState)
            state = PartsQuantState.from_dict(qs, module.in_features, torch.device("cpu"))
            if [n for n, _ in state.parts] != list(settings["parts"] or ()):
                return False
            first = state.parts[0][1]
            if any(p.quant_type != first.quant_type or p.nested != first.nested or p.blocksize != first.blocksize
                   for _, p in state.parts):
                return False
        elif settings["parts"]:  # stored whole, but this layer quantizes part by part: quantize it again
            return False
        else:
            state = bnb.functional.QuantState.from_dict(qs, device=torch.device("cpu"))
        if (tuple(state.shape) != (module.out_features, module.in_features)
                or state.quant_type != settings["quant_type"] or state.blocksize != settings["blocksize"]
                or state.nested != bool(settings["compress_statistics"])):
            return False
        packed = stored.load()
        if settings["quant_storage"] != torch.uint8:
            packed = packed.view(-1).view(settings["quant_storage"]).unsqueeze(1)
        set_4bit_weight(module, packed, state)
        self.filled += 1
        return True


def stored_mismatch(weights: Path, quantize: str, dtype: torch.dtype) -> Optional[str]:
    """None when the stored quantization of `weights` for `quantize` from `dtype` is there and matches them; else why
    it cannot be used ("" when there is no such file)."""
    path = stored_path(weights, quantize, dtype)
    if not path.is_file():
        return ""
    try:
        meta = safetensors_metadata(path)
    except (OSError, ValueError, UserError):  # a cache: a damaged one is ignored, said so, and made again
        return "it is damaged (an unreadable header)"
    differs = [k for k, v in _expected(weights, quantize, dtype).items() if meta.get(k) != v]
    if not differs:
        return None
    return {"source": f"{Path(weights).name} is not the file it was made from: its size, time or data differ",
            "bitsandbytes": f"it was written by bitsandbytes {meta.get('bitsandbytes')}"}.get(
                differs[0], f"its {', '.join(differs)} differ")


def open_stored(weights: Path, quantize: str, dtype: torch.dtype) -> Optional[StoredQuantization]:
    """The stored quantization of `weights` for `quantize` from `dtype`, when there is one that matches; None
    otherwise, with a one-line note on stderr when a file is there but cannot be used (and why)."""
    why = stored_mismatch(weights, quantize, dtype)
    path = stored_path(weights, quantize, dtype)
    if why:
        _note(f"{path.name} cannot be used ({why}); quantizing instead. Rerun scripts/quantize_checkpoint.py to "
              "store it again")
    return StoredQuantization(path) if why is None else None


def _note(msg: str) -> None:
    print(f"note: {msg}", file=sys.stderr, flush=True)


def load_note(model: nn.Module, quantize: Optional[str], device: torch.device, seconds: float) -> str:
    """What a "Loaded" line adds about quantizing: the stored file read (and how many layers were quantized anyway,
    those a merged adapter changes), or, after a CPU load that quantized for more than 10 s, how to skip that next
    time; "" otherwise."""
    used, now = getattr(model, "stored_quantization", None), getattr(model, "layers_quantized_at_load", 0)
    if used is not None:
        also = f"; {now} layers the merged adapter changes quantized now" if now else ""
        return f" | quantized weights read from {Path(used).name}{also}"
    if quantize and device.type == "cpu" and seconds > 10:
        return (" | most of that was quantizing: scripts/quantize_checkpoint.py stores the result for later loads (an "
                "adapter merged while loading: merge it into a folder once with scripts/merge_lora.py, and quantize "
                "that)")
    return ""
