"""LoRA on any subset of {query, key, value, projection, mlp, head}, over a dense or a quantized base.

The base layer is kept untouched inside `LoRALinear.base`; only `lora_A` / `lora_B` train. For the fused qkv
projection one `lora_A` stacks the A matrices of the enabled parts, so x·A is computed once for q, k and v.
Adapter files hold only LoRA tensors plus everything needed to use them (hyperparameters, base model config,
how they were trained), so loading never depends on the flags of the run that made them.
"""
from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from lit_qlora.config import Config
from lit_qlora.utils import UserError, atomic_torch_save

ADAPTER_FORMAT = "lit-qlora-adapter-v1"


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

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def targets(self) -> list[str]:
        return [f.name for f in fields(self) if f.type in (bool, "bool") and getattr(self, f.name)]

    @classmethod
    def from_dict(cls, d: dict) -> "LoRAConfig":
        return cls(**{k: v for k, v in d.items() if k in {f.name for f in fields(cls)}})


class LoRALinear(nn.Module):
    """y = base(x) + scaling * B(A(dropout(x))), with the update limited to row ranges `parts` of the output."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, r: int, alpha: float, dropout: float,
                 parts: Optional[list[tuple[int, int]]] = None) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = in_features, out_features
        self.parts = parts or [(0, out_features)]  # (first row, number of rows) of each adapted slice
        self.r, self.scaling = r, alpha / r
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(len(self.parts) * r, in_features, device=device))  # [n*r, in]
        self.lora_B = nn.Parameter(torch.empty(sum(n for _, n in self.parts), r, device=device))  # [rows, r]
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False

    def reset_lora_parameters(self) -> None:
        # As in the LoRA paper and PEFT: A random, B zero, so training starts from the base model exactly
        for i in range(len(self.parts)):
            nn.init.kaiming_uniform_(self.lora_A.data[i * self.r:(i + 1) * self.r], a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.merged:
            return y
        ax = self.dropout(x).to(self.lora_A.dtype) @ self.lora_A.T  # [B, T, n*r], one matmul for all parts
        if len(self.parts) == 1 and self.parts[0] == (0, self.out_features):
            return y + (ax @ self.lora_B.T * self.scaling).to(y.dtype)
        pieces, row, b_row = [], 0, 0
        for i, (start, n) in enumerate(self.parts):
            if start > row:  # rows without LoRA (e.g. k when only q and v are adapted)
                pieces.append(ax.new_zeros(*ax.shape[:-1], start - row))
            pieces.append(ax[..., i * self.r:(i + 1) * self.r] @ self.lora_B[b_row:b_row + n].T)
            row, b_row = start + n, b_row + n
        if row < self.out_features:
            pieces.append(ax.new_zeros(*ax.shape[:-1], self.out_features - row))
        return y + (torch.cat(pieces, dim=-1) * self.scaling).to(y.dtype)

    def delta_weight(self) -> torch.Tensor:
        """The dense update this adapter adds to the base weight: [out, in] in fp32."""
        A, B = self.lora_A.float(), self.lora_B.float()
        delta = torch.zeros(self.out_features, self.in_features, device=A.device)
        b_row = 0
        for i, (start, n) in enumerate(self.parts):
            delta[start:start + n] = B[b_row:b_row + n] @ A[i * self.r:(i + 1) * self.r]
            b_row += n
        return delta * self.scaling


def lora_targets(config: Config, lora: LoRAConfig) -> dict[str, list[tuple[int, int]] | None]:
    """Module name -> adapted row ranges (None = all rows) for the given model and LoRA settings."""
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
    if lora.head:
        targets["lm_head"] = None
    return targets


def apply_lora(model: nn.Module, lora: LoRAConfig) -> None:
    """Wrap the targeted Linear layers of `model` in LoRALinear (works on the meta device)."""
    if lora.r <= 0:
        raise UserError(f"--lora_r must be positive, got {lora.r}; use e.g. --lora_r 8")
    for name, parts in lora_targets(model.config, lora).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child)
        out_f, in_f = base.weight.shape
        setattr(parent, child, LoRALinear(base, in_f, out_f, lora.r, lora.alpha, lora.dropout, parts))
    mark_only_lora_trainable(model)


def mark_only_lora_trainable(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items() if "lora_" in k}


# ---- adapter files ----------------------------------------------------------------------------
def save_adapter(path: Path, model: nn.Module, lora: LoRAConfig, train_info: Optional[dict] = None) -> None:
    """LoRA tensors (fp32 on CPU) + hyperparameters + the base config, written atomically."""
    payload = {
        "format": ADAPTER_FORMAT,
        "lora": {k: v.float().cpu().clone() for k, v in lora_state_dict(model).items()},
        "lora_config": asdict(lora),
        "model_config": model.config.to_dict(),
        "train": train_info or {},
    }
    atomic_torch_save(payload, Path(path))


def load_adapter(path: Path, base_config: Optional[Config] = None) -> dict:
    """Read an adapter file (or a PEFT folder) and check it belongs to `base_config`."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"adapter {path} not found; pass --lora_path with a lit_model_lora_finetuned.pth file or a PEFT folder")
    if path.is_dir():
        from lit_qlora.peft_interop import import_peft

        if base_config is None:
            raise UserError(f"a PEFT folder ({path}) needs the base model; pass --checkpoint_dir")
        adapter = import_peft(path, base_config)
    else:
        try:
            adapter = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise UserError(f"{path} is not a readable adapter file ({type(e).__name__}); it may be damaged: use an earlier checkpoint")
        if not isinstance(adapter, dict) or adapter.get("format") != ADAPTER_FORMAT:
            raise UserError(f"{path} is not a lit-qlora adapter file; pass an adapter written by finetune/lora.py or a PEFT folder")
    if base_config is not None:
        check_same_base(adapter["model_config"], base_config, path)
    return adapter


_ARCH_FIELDS = ("vocab_size", "n_layer", "n_head", "n_embd", "n_query_groups", "head_size", "intermediate_size",
                "mlp_class", "tie_embeddings")


def check_same_base(adapter_cfg: dict, base: Config, path: Path) -> None:
    diff = [f for f in _ARCH_FIELDS if adapter_cfg.get(f) != getattr(base, f)]
    if diff:
        f = diff[0]
        raise UserError(f"adapter {path} was trained on {adapter_cfg.get('name') or '?'} ({f}={adapter_cfg.get(f)}) but the base model "
                        f"is {base.name or '?'} ({f}={getattr(base, f)}); use the --checkpoint_dir the adapter was trained on")


def load_lora_weights(model: nn.Module, lora_sd: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors into the model's LoRA parameters, whatever their dtype or device."""
    params = dict(model.named_parameters())
    for k, v in lora_sd.items():
        if k not in params:
            raise UserError(f"adapter tensor {k} has no place in this model; the adapter targets other layers than the model was built with")
        if params[k].shape != v.shape:
            raise UserError(f"adapter tensor {k} has shape {tuple(v.shape)}, the model expects {tuple(params[k].shape)}; "
                            "use the base model the adapter was trained on")
        with torch.no_grad():
            params[k].copy_(v.to(params[k].dtype))


# ---- merging ----------------------------------------------------------------------------------
def merge_lora(model: nn.Module, verbose: bool = True) -> None:
    """Fold every adapter into its base layer, in memory. A quantized base is dequantized, updated in fp32
    and re-quantized (that rounds; `scripts/merge_lora.py` merges into the original weights instead)."""
    from lit_qlora.quantize import dequantize_weight, is_quantized, quantize_into

    told = False
    for name, m in lora_modules(model).items():
        if m.merged:
            continue
        delta = m.delta_weight()
        wte = model.transformer["wte"] if hasattr(model, "transformer") and "wte" in model.transformer else None
        if wte is not None and getattr(m.base, "weight", None) is wte.weight:
            m.base.weight = nn.Parameter(wte.weight.detach().clone(), requires_grad=False)  # untie before changing the head
            model.config = replace(model.config, tie_embeddings=False)
        if is_quantized(m.base):
            if verbose and not told:
                print("Merging LoRA into a quantized base: dequantize, add, re-quantize (rounds to the quantization grid).",
                      file=sys.stderr)
                told = True
            w = dequantize_weight(m.base).float()
            quantize_into(m.base, (w + delta.to(w.device)).to(_dense_dtype(m.base)), w.device)
        else:
            with torch.no_grad():
                m.base.weight.data = (m.base.weight.data.float() + delta.to(m.base.weight.device)).to(m.base.weight.dtype)
        m.merged = True


def _dense_dtype(q: nn.Module) -> torch.dtype:
    return getattr(q, "compute_dtype", None) or torch.bfloat16
