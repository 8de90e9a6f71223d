"""Merge a LoRA adapter into the full-precision base weights on disk, one tensor at a time.

The base tensors come from `lit_model.safetensors` as stored (never from dequantized weights), the update
is added in fp32 and cast back to the stored dtype, and the result is a normal checkpoint folder
(`lit_model.safetensors` + `model_config.json` + the tokenizer files) that loads, quantizes and exports like
any other. Peak memory ≈ the largest tensor plus its update.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn as nn

from lit_qlora.config import Config
from lit_qlora.convert import _ST_DTYPES, LIT_CONFIG, LIT_WEIGHTS, convert_lit_checkpoint, ensure_converted, write_safetensors_stream
from lit_qlora.lora import LoRAConfig, LoRALinear, load_adapter, lora_targets
from lit_qlora.utils import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt")


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer (and generation) files that exist in `src` to `dst`. Returns their names."""
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, dst / name)
            copied.append(name)
    return copied


def safetensors_specs(path: Path) -> list[tuple[str, torch.Size, torch.dtype]]:
    """(name, shape, dtype) of every tensor in a safetensors file, in file order (the order `read_safetensors` yields)."""
    from lit_qlora.loader import safetensors_header

    header, _ = safetensors_header(path)
    items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    return [(k, torch.Size(e["shape"]), _ST_DTYPES[e["dtype"]]) for k, e in items]


def lora_delta(adapter: dict, module: str, config: Config, out_f: int, in_f: int) -> torch.Tensor:
    """The fp32 [out, in] update the adapter adds to our module `module` (exactly what LoRALinear computes)."""
    lora = LoRAConfig.from_dict(adapter["lora_config"])
    parts = lora_targets(config, lora)[module]
    with torch.device("meta"):
        base = nn.Linear(in_f, out_f, bias=False)
    m = LoRALinear(base, in_f, out_f, lora.r, lora.alpha, 0.0, parts)
    try:
        A, B = adapter["lora"][module + ".lora_A"], adapter["lora"][module + ".lora_B"]
    except KeyError as e:
        raise UserError(f"the adapter has no tensor {e.args[0]}; it is incomplete: use another checkpoint of it")
    if tuple(A.shape) != tuple(m.lora_A.shape) or tuple(B.shape) != tuple(m.lora_B.shape):
        raise UserError(f"adapter tensors of {module} have shapes {tuple(A.shape)}/{tuple(B.shape)}, the base model expects "
                        f"{tuple(m.lora_A.shape)}/{tuple(m.lora_B.shape)}; use the base model the adapter was trained on")
    m.lora_A = nn.Parameter(A.detach().float().cpu(), requires_grad=False)
    m.lora_B = nn.Parameter(B.detach().float().cpu(), requires_grad=False)
    return m.delta_weight()


def merged_tensors(checkpoint_dir: Path, adapter: Optional[dict], config: Config
                   ) -> tuple[list[tuple[str, torch.Size, torch.dtype]], Iterator[tuple[str, torch.Tensor]]]:
    """(specs, stream) of our checkpoint in `checkpoint_dir` with `adapter` added, read one tensor at a time.

    specs: (name, shape, stored dtype) of every tensor, in the order `stream` yields them. In the stream an adapted
    weight is base + update in fp32 (the caller picks the dtype to store), every other tensor is as stored. A LoRA on
    a tied head comes last, as its own `lm_head.weight` (the embedding plus the head's update).
    """
    weights = Path(checkpoint_dir) / LIT_WEIGHTS
    specs = safetensors_specs(weights)

    from lit_qlora.loader import read_safetensors

    if adapter is None:
        return specs, read_safetensors(weights)
    targets = lora_targets(config, LoRAConfig.from_dict(adapter["lora_config"]))
    untie = config.tie_embeddings and "lm_head" in targets
    if untie:  # the head gets its own, updated copy of the embedding
        wte = next(s for s in specs if s[0] == "transformer.wte.weight")
        specs.append(("lm_head.weight", wte[1], wte[2]))
    missing = [t for t in targets if t + ".weight" not in {s[0] for s in specs} and not (untie and t == "lm_head")]
    if missing:
        raise UserError(f"{weights} has no tensor {missing[0]}.weight; the checkpoint is incomplete: convert it again")

    def merged(t: torch.Tensor, module: str) -> torch.Tensor:
        out_f, in_f = t.shape
        return t.float() + lora_delta(adapter, module, config, out_f, in_f)

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in read_safetensors(weights):
            module = name.removesuffix(".weight")
            yield name, (merged(t, module) if name.endswith(".weight") and module in targets else t)
        if untie:
            for _, t in read_safetensors(weights, keys={"transformer.wte.weight"}):
                yield "lm_head.weight", merged(t, "lm_head")

    return specs, stream()


def merge_checkpoint(checkpoint_dir: Path, adapter: dict | Path, out_dir: Path) -> Path:
    """Base checkpoint + adapter -> a merged checkpoint folder `out_dir`. Returns `out_dir`."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    config = ensure_converted(checkpoint_dir)
    if out_dir.resolve() == checkpoint_dir.resolve():
        raise UserError(f"--out_dir {out_dir} is the base checkpoint folder; write the merged model to a new folder")
    if not isinstance(adapter, dict):
        adapter = load_adapter(Path(adapter), config)
    specs, stream = merged_tensors(checkpoint_dir, adapter, config)
    untie = config.tie_embeddings and any(name == "lm_head.weight" for name, _, _ in specs)
    out_dir.mkdir(parents=True, exist_ok=True)
    # each tensor goes back to the dtype it was stored in (the update was added in fp32)
    cast = ((name, t.to(dtype)) for (name, t), (_, _, dtype) in zip(stream, specs, strict=True))
    write_safetensors_stream(out_dir / LIT_WEIGHTS, specs, cast, metadata={"merged_from": str(checkpoint_dir)})
    out_config = replace(config, name=out_dir.name, tie_embeddings=False if untie else config.tie_embeddings)
    out_config.save(out_dir / LIT_CONFIG)
    copy_tokenizer_files(checkpoint_dir, out_dir)
    if (checkpoint_dir / "config.json").is_file():  # the tokenizer reads special token ids from it
        hf = json.loads((checkpoint_dir / "config.json").read_text())
        if untie:
            hf["tie_word_embeddings"] = False
        (out_dir / "config.json").write_text(json.dumps(hf, indent=2))
    return out_dir


def export_hf(checkpoint_dir: Path, out_dir: Path, adapter: Optional[dict | Path] = None) -> Path:
    """Our checkpoint (merged with `adapter` if given) -> a transformers folder with the tokenizer files."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    ensure_converted(checkpoint_dir)
    if out_dir.resolve() == checkpoint_dir.resolve():
        raise UserError(f"--out_dir {out_dir} is the base checkpoint folder; export to a new folder so the original files stay intact")
    out_dir.mkdir(parents=True, exist_ok=True)
    if adapter is None:
        convert_lit_checkpoint(checkpoint_dir, out_dir)
        copy_tokenizer_files(checkpoint_dir, out_dir)
        _keep_token_ids(checkpoint_dir, out_dir)
        return out_dir
    with tempfile.TemporaryDirectory(prefix=".merged-", dir=out_dir) as tmp:
        merge_checkpoint(checkpoint_dir, adapter, Path(tmp))
        convert_lit_checkpoint(Path(tmp), out_dir)
    copy_tokenizer_files(checkpoint_dir, out_dir)
    _keep_token_ids(checkpoint_dir, out_dir)
    return out_dir


def _keep_token_ids(src: Path, dst: Path) -> None:
    """Carry the special token ids of the original config.json into the exported one."""
    if not (src / "config.json").is_file() or not (dst / "config.json").is_file():
        return
    old, new = json.loads((src / "config.json").read_text()), json.loads((dst / "config.json").read_text())
    keep = {k: old[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if old.get(k) is not None}
    if keep:
        (dst / "config.json").write_text(json.dumps({**new, **keep}, indent=2))
