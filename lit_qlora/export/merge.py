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

from lit_qlora.adapter import Adapter
from lit_qlora.checkpoint import (
    LIT_CONFIG,
    LIT_WEIGHTS,
    TensorSpec,
    as_tensor,
    read_safetensors,
    safetensors_specs,
    write_safetensors_stream,
)
from lit_qlora.config import Config
from lit_qlora.convert import convert_lit_checkpoint, ensure_converted
from lit_qlora.lora import is_expert_target
from lit_qlora.quant.mxfp4 import BLOCK, BLOCKS_SUFFIX, SCALES_SUFFIX, join_stacks
from lit_qlora.readers import read_json
from lit_qlora.utils import UserError

# What a model folder needs besides its weights to tokenize, chat and stop like the original: transformers >= 4.43
# writes the chat template to chat_template.jinja, and generation_config.json names every end-of-turn id.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
                   "vocab.json", "merges.txt")


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer, chat-template and generation files that exist in `src` to `dst`. Returns their names."""
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, dst / name)
            copied.append(name)
    return copied


def merged_tensors(checkpoint_dir: Path, adapter: Optional[Adapter], config: Config
                   ) -> tuple[list[TensorSpec], Iterator[tuple[str, torch.Tensor]]]:
    """(specs, stream) of our checkpoint in `checkpoint_dir` with `adapter` added, read one tensor at a time.

    specs: (name, shape, stored dtype) of every tensor, in the order `stream` yields them. In the stream an adapted
    weight is base + update in fp32 (the caller picks the dtype to store: merge_checkpoint the stored one, the GGUF
    export its --dtype); every other tensor is as stored. A LoRA on a tied head comes last, as its own
    `lm_head.weight` (the embedding plus the head's update).
    """
    weights = Path(checkpoint_dir) / LIT_WEIGHTS
    specs = safetensors_specs(weights)
    if adapter is None:
        return specs, read_safetensors(weights)
    targets = adapter.targets()
    dense_experts = experts_made_dense(config, adapter)
    if dense_experts:  # each MXFP4 pair (blocks, scales) -> the stack's dense weight, where the blocks were, in the
        dtype = next(d for n, _, d in specs if n == "transformer.wte.weight")  # dtype of the dense weights
        specs = [(n.removesuffix(BLOCKS_SUFFIX) + ".weight", torch.Size((*s[:2], s[2] * BLOCK)), dtype)
                 if n.endswith(BLOCKS_SUFFIX) else (n, s, d) for n, s, d in specs if not n.endswith(SCALES_SUFFIX)]
    untie = config.tie_embeddings and "lm_head" in targets
    if untie:  # the head gets its own, updated copy of the embedding
        wte = next(s for s in specs if s[0] == "transformer.wte.weight")
        specs.append(("lm_head.weight", wte[1], wte[2]))
    missing = [t for t in targets if t + ".weight" not in {s[0] for s in specs} and not (untie and t == "lm_head")]
    if missing:
        raise UserError(f"{weights} has no tensor {missing[0]}.weight; the checkpoint is incomplete: convert it again")

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        tensors = read_safetensors(weights)
        for name, t in join_stacks(tensors) if dense_experts else tensors:
            yield name, adapter.merged(name, as_tensor(t), torch.float32)
        if untie:
            for _, t in read_safetensors(weights, keys={"transformer.wte.weight"}):
                yield "lm_head.weight", adapter.merged("lm_head.weight", t, torch.float32)

    return specs, stream()


def experts_made_dense(config: Config, adapter: Optional[Adapter]) -> bool:
    """Whether merging `adapter` turns the checkpoint's MXFP4 experts (gpt-oss as published) into dense bf16
    weights: when it adapts experts. W + s B A is not an MXFP4 grid, and re-quantizing it to MXFP4 would round the
    update away; every expert stack is then stored dense, in the dtype of the checkpoint's other weights (bf16 for
    the published model: the MXFP4 values exactly, the adapted ones rounded once), and the merged folder says so (no
    quantization_config)."""
    return bool(config.moe_mxfp4 and adapter is not None and any(map(is_expert_target, adapter.targets())))


def merge_checkpoint(checkpoint_dir: Path, adapter: Adapter | Path, out_dir: Path) -> Path:
    """Base checkpoint + adapter -> a merged checkpoint folder `out_dir`. Returns `out_dir`."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    config = ensure_converted(checkpoint_dir)
    if out_dir.resolve() == checkpoint_dir.resolve():
        raise UserError(f"--out_dir {out_dir} is the base checkpoint folder; write the merged model to a new folder")
    if not isinstance(adapter, Adapter):
        adapter = Adapter.load(Path(adapter), config)
    specs, stream = merged_tensors(checkpoint_dir, adapter, config)
    untie = config.tie_embeddings and any(name == "lm_head.weight" for name, _, _ in specs)
    out_dir.mkdir(parents=True, exist_ok=True)
    # each tensor goes back to the dtype it was stored in (the update was added in fp32)
    cast = ((name, t.to(dtype)) for (name, t), (_, _, dtype) in zip(stream, specs, strict=True))
    write_safetensors_stream(out_dir / LIT_WEIGHTS, specs, cast, metadata={"merged_from": str(checkpoint_dir)})
    dense = experts_made_dense(config, adapter)
    out_config = replace(config, name=out_dir.name, tie_embeddings=False if untie else config.tie_embeddings,
                         moe_mxfp4=config.moe_mxfp4 and not dense)
    out_config.save(out_dir / LIT_CONFIG)
    copy_tokenizer_files(checkpoint_dir, out_dir)
    if (checkpoint_dir / "config.json").is_file():  # the tokenizer reads special token ids from it
        hf = read_json(checkpoint_dir / "config.json", dict, "HF config")
        if untie:
            hf["tie_word_embeddings"] = False
        if dense:  # the experts are bf16 now
            hf.pop("quantization_config", None)
        (out_dir / "config.json").write_text(json.dumps(hf, indent=2))
    return out_dir


def export_hf(checkpoint_dir: Path, out_dir: Path, adapter: Optional[Adapter | Path] = None) -> Path:
    """Our checkpoint (merged with `adapter` if given) -> a transformers folder with the tokenizer files."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    ensure_converted(checkpoint_dir)
    if out_dir.resolve() == checkpoint_dir.resolve():
        raise UserError(f"--out_dir {out_dir} is the base checkpoint folder; export to a new folder so the original "
                        "files stay intact")
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
    old, new = read_json(src / "config.json", dict, "HF config"), read_json(dst / "config.json", dict, "HF config")
    keep = {k: old[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if old.get(k) is not None}
    if keep:
        (dst / "config.json").write_text(json.dumps({**new, **keep}, indent=2))
