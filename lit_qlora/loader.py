"""Build a model from a checkpoint folder with low peak memory.

The model is created on the meta device, LoRA wrappers and empty quantized layers are put in place, and then
each tensor is read from disk on its own, cast or quantized, and placed. The full-precision model never
exists in memory: peak ≈ final model + the largest single tensor + the runtime.

Tensors are read with plain file reads rather than a memory map: pages of a mapped file stay in the
process's resident set once touched, which would make the whole checkpoint count against peak memory.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch
import torch.nn as nn

from lit_qlora.config import Config
from lit_qlora.convert import LIT_WEIGHTS, _ST_DTYPES, ensure_converted
from lit_qlora.lora import LoRAConfig, LoRALinear, apply_lora, load_lora_weights
from lit_qlora.model import GPT
from lit_qlora.quantize import check_quantize, is_quantized, parse_precision, quantize_into, swap_linears
from lit_qlora.utils import UserError


def safetensors_header(path: Path) -> tuple[dict, int]:
    """The tensor entries of a safetensors file's JSON header (without `__metadata__`) and the byte offset where the
    tensor data starts. ValueError when the file is too short for its header or the header is not readable JSON."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n <= 0 or 8 + n > size:
            raise ValueError(f"a header of {n} bytes in a file of {size}")
        header = json.loads(f.read(n))  # UnicodeDecodeError and JSONDecodeError are ValueErrors
    if not isinstance(header, dict):
        raise ValueError("a header that is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + n


def read_safetensors(path: Path, keys: Optional[set[str]] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from a safetensors file, one freshly read tensor at a time, in file order."""
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
                raise UserError(f"{path} is truncated at tensor {name}; convert the checkpoint again (delete it and rerun)")
            t = torch.empty(end - start, dtype=torch.uint8)
            f.seek(base + start)
            f.readinto(memoryview(t.numpy()))
            yield name, t.view(_ST_DTYPES[e["dtype"]]).reshape(e["shape"])


def _owner(model: nn.Module, key: str) -> tuple[nn.Module, str]:
    module_name, _, param = key.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(module, LoRALinear):  # base weights live inside the LoRA wrapper
        module = module.base
    return module, param


def load_model(checkpoint_dir: Path, precision: str = "bf16-true", quantize: Optional[str] = None,
               lora: Optional[LoRAConfig] = None, device: torch.device | str = "cpu", quantize_lm_head: bool = True,
               weights: Optional[Path] = None, config: Optional[Config] = None, seed: Optional[int] = None,
               merge_adapter: Optional[dict] = None,
               tensors: Optional[Iterable[tuple[str, torch.Tensor]]] = None) -> GPT:
    """The one loader: a GPT from `checkpoint_dir` (an HF folder is converted on first use), optionally with
    LoRA layers (fresh, or filled later with `load_lora_weights`) and quantized frozen Linear layers.

    `merge_adapter` (an adapter dict) is added to the full-precision weights as they are read, before any
    quantization, so a merged 4-bit model rounds once, like any quantized checkpoint.

    `tensors` ((name, tensor) pairs in our naming, with `config`) fills the model instead of the checkpoint file:
    scripts/bench_gpu.py makes random weights on the device that way, each quantized as soon as it exists."""
    device = torch.device(device)
    prec = parse_precision(precision)
    check_quantize(quantize, precision, device)
    config = config or ensure_converted(checkpoint_dir)
    if tensors is None:
        weights = Path(weights or Path(checkpoint_dir) / LIT_WEIGHTS)
        tensors = read_safetensors(weights)
    else:
        weights = Path("<the given tensors>")  # only named in error messages
    with torch.device("meta"):
        model = GPT(config)
    if lora is not None:
        apply_lora(model, lora)
    if quantize:
        swap_linears(model, quantize, prec.dtype, quantize_lm_head)

    merge_targets = _merge_targets(config, merge_adapter)
    for key, t in tensors:
        name = key.rpartition(".")[0]
        if name in merge_targets and key.endswith(".weight"):
            t = t.float() + _delta(merge_adapter, name, config, t.shape)
        try:
            module, param = _owner(model, key)
        except AttributeError:
            raise UserError(f"{weights} holds {key!r}, which this model has no place for; the weights do not match "
                            f"model_config.json: convert the checkpoint again")
        if is_quantized(module) and param == "weight":
            quantize_into(module, t.to(prec.dtype), device)
            continue
        # Frozen Linear weights go to the compute dtype; embeddings and norms stay fp32 under *-mixed
        dtype = prec.frozen_linear_dtype if isinstance(module, nn.Linear) or is_quantized(module) else prec.frozen_other_dtype
        module._parameters[param] = nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)
        del t

    _tie_and_check(model, config, prec, device, weights, merge_adapter if "lm_head" in merge_targets else None)
    if lora is not None:
        _init_lora(model, prec.trainable_dtype, device, seed)
    return model


def _merge_targets(config: Config, adapter: Optional[dict]) -> set[str]:
    if adapter is None:
        return set()
    from lit_qlora.lora import lora_targets

    return set(lora_targets(config, LoRAConfig.from_dict(adapter["lora_config"])))


def _delta(adapter: dict, name: str, config: Config, shape: torch.Size) -> torch.Tensor:
    from lit_qlora.merge import lora_delta

    return lora_delta(adapter, name, config, shape[0], shape[1])


def _tie_and_check(model: GPT, config: Config, prec, device: torch.device, weights: Path,
                   head_adapter: Optional[dict] = None) -> None:
    if config.tie_embeddings:
        head, param = _owner(model, "lm_head.weight")
        wte = model.transformer.wte.weight
        if head_adapter is not None:  # a LoRA on a tied head: the merged head is its own tensor
            w = (wte.detach().float().cpu() + _delta(head_adapter, "lm_head", config, wte.shape)).to(prec.dtype)
            if is_quantized(head):
                quantize_into(head, w, device)
            else:
                head.weight = nn.Parameter(w.to(device=device, dtype=prec.frozen_linear_dtype), requires_grad=False)
        elif is_quantized(head):
            quantize_into(head, wte.detach().to(prec.dtype), device)
        else:
            head.weight = wte
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.is_meta and "lora_" not in name:
            raise UserError(f"{weights} has no tensor for {name}; the checkpoint is incomplete: convert it again")


def _init_lora(model: nn.Module, dtype: torch.dtype, device: torch.device, seed: Optional[int]) -> None:
    gen_state = torch.random.get_rng_state()
    if seed is not None:
        torch.manual_seed(seed)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.lora_A = nn.Parameter(torch.empty(m.lora_A.shape, device=device, dtype=dtype))
            m.lora_B = nn.Parameter(torch.empty(m.lora_B.shape, device=device, dtype=dtype))
            m.reset_lora_parameters()
    if seed is not None:
        torch.random.set_rng_state(gen_state)


def load_model_with_adapter(checkpoint_dir: Path, adapter: dict, precision: str = "bf16-true",
                            quantize: Optional[str] = None, device: torch.device | str = "cpu", **kw) -> GPT:
    """Base model + an adapter dict from `lora.load_adapter`, whatever quantization/precision it was trained with."""
    model = load_model(checkpoint_dir, precision=precision, quantize=quantize,
                       lora=LoRAConfig.from_dict(adapter["lora_config"]), device=device, **kw)
    load_lora_weights(model, adapter["lora"])
    return model


def say(msg: str) -> None:
    print(msg, file=sys.stderr)
