"""The adapter: LoRA tensors plus everything needed to use them, one type for finetune, the loader, merge and PEFT.

An adapter file never depends on the flags of the run that made it: it names its LoRA settings, the base model's
config and how it was trained, so it loads under any `--quantize` / `--precision`.

File format `lit-qlora-adapter-v1` (a torch pickle of plain dicts and tensors, readable with weights_only=True):

    {"format": "lit-qlora-adapter-v1",
     "lora": {our LoRA parameter name: fp32 tensor},        # e.g. transformer.h.0.attn.qkv.lora_A
     "lora_config": asdict(LoRAConfig),
     "model_config": Config.to_dict() of the base model,
     "train": {precision, quantize, quantize_lm_head, template, max_seq_length, mask_inputs, iter, ...}}

A resumable checkpoint (`checkpoints/iter-*.pth`) is the same dict plus "resume" (optimizer, data position, RNG, ...),
so every checkpoint is also an adapter.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Iterable, Optional

import torch
import torch.nn as nn

from lit_qlora.config import Config
from lit_qlora.export.peft_interop import export_peft, import_peft
from lit_qlora.lora import (
    LORA_INITS,
    RESIDUAL_INITS,
    LoRAConfig,
    expert_lora_delta,
    is_expert_target,
    load_lora_weights,
    lora_delta,
    lora_state_dict,
    lora_targets,
    meta_model,
)
from lit_qlora.readers import check_config_dict, check_fields, load_torch
from lit_qlora.utils import UserError, atomic_torch_save

ADAPTER_FORMAT = "lit-qlora-adapter-v1"

# what must agree between the model an adapter was trained on and the one it is applied to
_ARCH_FIELDS = ("vocab_size", "n_layer", "n_head", "n_embd", "n_query_groups", "head_size", "intermediate_size",
                "mlp_class", "tie_embeddings")


@dataclass
class Adapter:
    lora: dict[str, torch.Tensor]  # our LoRA parameter names -> tensors (fp32, CPU)
    config: LoRAConfig
    model_config: dict  # Config.to_dict() of the base model
    train: dict = field(default_factory=dict)  # how it was trained (precision, quantize, template, ...)

    # ---- making, saving, loading ---------------------------------------------------------------------
    @classmethod
    def of_model(cls, model: nn.Module, lora: LoRAConfig, train: Optional[dict] = None,
                 tensors: Optional[dict[str, torch.Tensor]] = None) -> "Adapter":
        """The LoRA weights of `model` (copied to fp32 on CPU) with their settings. `tensors`: the LoRA weights when the
        model holds only shards of them (FSDP), gathered whole (lit_qlora.distributed.full_lora_state_dict)."""
        tensors = {k: v.float().cpu().clone() for k, v in (tensors or lora_state_dict(model)).items()}
        return cls(tensors, lora, model.config.to_dict(), dict(train or {}))

    def payload(self) -> dict:
        """The dict written to disk (see the module docstring)."""
        return {"format": ADAPTER_FORMAT, "lora": self.lora, "lora_config": asdict(self.config),
                "model_config": self.model_config, "train": self.train}

    def save(self, path: Path, resume: Optional[dict] = None) -> None:
        """Write atomically; `resume` (finetune's state) makes it a resumable checkpoint."""
        payload = self.payload()
        if resume is not None:
            payload["resume"] = resume
        atomic_torch_save(payload, Path(path))

    @classmethod
    def from_payload(cls, payload: dict, where: object = "the adapter") -> "Adapter":
        """The adapter of a loaded file, every part checked first (`check_payload`)."""
        if not isinstance(payload, dict) or payload.get("format") != ADAPTER_FORMAT:
            raise UserError(f"{where} is not a lit-qlora adapter file; pass an adapter written by finetune/lora.py "
                            "or a PEFT folder")
        check_payload(payload, where)
        return cls(dict(payload["lora"]), LoRAConfig.from_dict(payload["lora_config"]), dict(payload["model_config"]),
                   dict(payload.get("train") or {}))

    @classmethod
    def load(cls, path: Path, base_config: Optional[Config] = None, mmap: bool = False) -> "Adapter":
        """Read our adapter file (or any checkpoint of a run) or a PEFT LoRA folder, and check it belongs to
        `base_config` when given (a PEFT folder needs it: its tensors are mapped onto that model). `mmap`: our
        file's tensors stay in the file's pages (for a caller that copies them out and drops them: no heap left
        fragmented by freed temporaries)."""
        path = Path(path)
        if not path.exists():
            raise UserError(f"adapter {path} not found; pass --lora_path with a lit_model_lora_finetuned.pth file "
                            "or a PEFT folder")
        if path.is_dir():
            if base_config is None:
                raise UserError(f"a PEFT folder ({path}) needs the base model; pass --checkpoint_dir")
            tensors, lora, train = import_peft(path, base_config)
            adapter = cls(tensors, lora, base_config.to_dict(), train)
        else:
            payload = load_torch(path, "adapter", "use an earlier checkpoint", mmap=mmap)  # weights_only
            adapter = cls.from_payload(payload, path)
        if base_config is not None:
            adapter.check_base(base_config, path)
        return adapter

    def export_peft(self, base_config: Config, out_dir: Path, base_model_name_or_path: str = "") -> Path:
        """Write a PEFT LoRA folder (adapter_model.safetensors + adapter_config.json) for the transformers model of
        `base_config`, after checking the adapter belongs to it."""
        self.check_base(base_config, "to export")
        plain = self.as_plain_lora()
        return export_peft(plain.lora, plain.config, base_config, out_dir, base_model_name_or_path)

    def as_plain_lora(self) -> "Adapter":
        """A pissa / olora / loftq adapter (trained over a base that gave up s*B0@A0) as the same update over the
        original base, a plain LoRA of rank 2r, as PEFT's `path_initial_model_for_weight_conversion` converts one: per
        part A' = [A; A0], B' = [B, -B0], alpha doubled (times sqrt(2) for rsLoRA) to keep the scaling. W + s*B'@A' is
        W - s*B0@A0 + s*B@A, so a DoRA adapter keeps its magnitudes: the row norms it divides by are the same.

        LoftQ (PEFT converts it the same way, with a warning): the trained model computed Q(W - s*B0@A0) + s*B@A, Q
        the 4-bit quantization it trained over; the converted adapter over the original W computes W - s*B0@A0 +
        s*B@A, which differs from it by exactly the quantization error of the residual, the error LoftQ's start
        minimizes (`export_gap` measures it). One LoftQ step leaves A0 = B0 = 0 (the residual is W itself): its
        adapter is already a plain LoRA of rank r and is returned with A0, B0 dropped. Other adapters are returned as
        they are."""
        c = self.config
        if c.init not in RESIDUAL_INITS:
            return self
        converted = {**self.train, "converted_from": c.init}
        if c.init == "loftq" and not any(v.any() for k, v in self.lora.items() if k.endswith(".lora_B0")):
            tensors = {k: v for k, v in self.lora.items() if not k.endswith((".lora_A0", ".lora_B0"))}
            return Adapter(tensors, replace(c, init="default"), self.model_config, converted)
        tensors = {k: v for k, v in self.lora.items() if k.endswith(".lora_magnitude")}
        for module, parts in self.targets().items():
            n = len(parts or [None])
            A, A0 = (self.lora[f"{module}.{k}"].float() for k in ("lora_A", "lora_A0"))
            B, B0 = (self.lora[f"{module}.{k}"].float() for k in ("lora_B", "lora_B0"))
            stacked = torch.cat([A.view(n, c.r, -1), A0.view(n, c.r, -1)], 1)  # [part, 2r, in]
            tensors[module + ".lora_A"] = stacked.reshape(2 * n * c.r, -1)
            tensors[module + ".lora_B"] = torch.cat([B, -B0], 1)
        alpha = c.alpha * (math.sqrt(2) if c.rslora else 2)
        config = replace(c, r=2 * c.r, alpha=alpha, init="default")
        return Adapter(tensors, config, self.model_config, converted)

    def export_gap(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """How far `as_plain_lora()` over the original weights is from the model this adapter trained: per adapted
        module, ||merged as trained - merged converted|| / ||merged as trained|| (Frobenius, fp32, after DoRA's row
        scaling), from the base checkpoint's (name, tensor) pairs `tensors`. Zero for every adapter but LoftQ's, whose
        trained base was the 4-bit residual (`merged`); there it is the residual's quantization error, relative. A
        LoftQ adapter that does not record its --quantize cannot be measured (UserError, as its merge)."""
        if self.config.init != "loftq":
            return {}
        plain = self.as_plain_lora()
        gaps = {}
        for key, tensor in tensors:
            if self.changes(key):
                trained = self.merged(key, tensor, torch.float32)
                gaps[key.removesuffix(".weight")] = float((trained - plain.merged(key, tensor, torch.float32)).norm()
                                                          / trained.norm())
        return gaps

    # ---- using -------------------------------------------------------------------------------------
    @cached_property
    def base_config(self) -> Config:
        return Config.from_dict(self.model_config)

    def check_base(self, base: Config, where: object) -> None:
        """Refuse, in one line, a base model of another shape than the one the adapter was trained on."""
        diff = [f for f in _ARCH_FIELDS if self.model_config.get(f) != getattr(base, f)]
        if diff:
            f = diff[0]
            raise UserError(f"adapter {where} was trained on {self.model_config.get('name') or '?'} "
                            f"({f}={self.model_config.get(f)}) but the base model is {base.name or '?'} "
                            f"({f}={getattr(base, f)}); use the --checkpoint_dir the adapter was trained on")

    @cached_property
    def _targets(self) -> dict[str, Optional[list[tuple[int, int]]]]:
        return lora_targets(self.base_config, self.config)

    def targets(self) -> dict[str, Optional[list[tuple[int, int]]]]:
        """Our module name -> adapted row ranges (None: all rows)."""
        return self._targets

    def load_into(self, model: nn.Module) -> None:
        """Copy the LoRA tensors into a model built with the same LoRA settings (any dtype or device)."""
        load_lora_weights(model, self.lora)

    def delta(self, module: str, weight_shape: tuple[int, ...], initial_only: bool = False) -> torch.Tensor:
        """The fp32 update s*B@A this adapter adds to the [out, in] weight of our module `module` (DoRA then scales the
        rows of the sum: `merged`); for a stacked projection of experts, [E, out, in]: each expert's own s*B_e@A_e."""
        if is_expert_target(module):
            return self._expert_delta(module, weight_shape)
        parts = self.targets()[module]
        out_f, in_f = weight_shape
        parts = parts or [(0, out_f)]
        r = self.config.r
        try:
            A, B = self.lora[module + ".lora_A"], self.lora[module + ".lora_B"]
        except KeyError as e:
            raise UserError(f"the adapter has no tensor {e.args[0]}; it is incomplete: use another checkpoint of it")
        want_a, want_b = (len(parts) * r, in_f), (sum(n for _, n in parts), r)
        if tuple(A.shape) != want_a or tuple(B.shape) != want_b:
            raise UserError(f"adapter tensors of {module} have shapes {tuple(A.shape)}/{tuple(B.shape)}, the base "
                            "model "
                            f"expects {want_a}/{want_b}; use the base model the adapter was trained on")
        delta = lora_delta(A.detach().cpu(), B.detach().cpu(), parts, r, self.config.scaling, out_f)
        if self.config.init in RESIDUAL_INITS:  # the base it was trained on had s*B0@A0 taken out of this weight
            A0, B0 = self.lora[module + ".lora_A0"], self.lora[module + ".lora_B0"]
            delta0 = lora_delta(A0.detach().cpu(), B0.detach().cpu(), parts, r, self.config.scaling, out_f)
            return delta0 * -1 if initial_only else delta - delta0
        return delta

    def _expert_delta(self, module: str, weight_shape: tuple[int, ...]) -> torch.Tensor:
        r = self.config.r
        try:
            A, B = self.lora[module + ".lora_A"], self.lora[module + ".lora_B"]
        except KeyError as e:
            raise UserError(f"the adapter has no tensor {e.args[0]}; it is incomplete: use another checkpoint of it")
        E, out_f, in_f = weight_shape
        if tuple(A.shape) != (E, r, in_f) or tuple(B.shape) != (E, out_f, r):
            raise UserError(f"adapter tensors of {module} have shapes {tuple(A.shape)}/{tuple(B.shape)}, the base "
                            f"model expects {(E, r, in_f)}/{(E, out_f, r)}; use the base model the adapter was trained "
                            "on")
        return expert_lora_delta(A.detach().cpu(), B.detach().cpu(), self.config.scaling)

    def _quantized_as_trained(self, w: torch.Tensor, module: str) -> torch.Tensor:
        """`w` [out, in] (the base's layer `module`) quantized and dequantized as the training run's loader stored
        its base (its --quantize and --precision, recorded in `train`; a fused qkv part by part): a LoftQ adapter's
        base."""
        from lit_qlora.precision import parse_precision
        from lit_qlora.quant.quantize import dequantize_weight, make_quantized_linear, quantize_into, quantized_parts

        mode, precision = self.train.get("quantize"), self.train.get("precision") or "32-true"
        if not mode:
            raise UserError("this LoftQ adapter does not record the --quantize it was trained with; it cannot be "
                            "merged: generate with it unmerged (--merge false)")
        dtype = parse_precision(precision).dtype
        layer = make_quantized_linear(nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta"), mode, dtype,
                                      quantized_parts(self.base_config, module))
        quantize_into(layer, w, torch.device("cpu"), dtype)
        return dequantize_weight(layer).float()

    def merged(self, key: str, tensor: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """`tensor` (the base checkpoint's tensor `key`) with the update added in fp32, cast to `dtype` (default: the
        tensor's own), if the adapter targets it; otherwise `tensor` itself. The one merge rule of the loader (which
        keeps fp32 until it quantizes or casts) and of scripts/merge_lora.py (which writes the stored dtype)."""
        if not self.changes(key):
            return tensor
        module = key.removesuffix(".weight")
        merged = tensor.float() + self.delta(module, tuple(tensor.shape))
        if self.config.init == "loftq":  # its base was the 4-bit residual: dequantize(quantize(W - s*B0@A0)) + s*B@A
            kept = tensor.float() + self.delta(module, tuple(tensor.shape), initial_only=True)  # W - s*B0@A0
            merged = self._quantized_as_trained(kept, module) + (merged - kept)  # (merged - kept = s*B@A)
        if self.config.dora:  # DoRA, as PEFT merges it: each adapted row of W + s*B@A scaled to its magnitude
            parts = self.targets()[module] or [(0, tensor.shape[0])]
            rows = torch.cat([torch.arange(a, a + n) for a, n in parts])
            m = self.lora[module + ".lora_magnitude"].float()
            merged[rows] *= (m / torch.linalg.norm(merged[rows], dim=1))[:, None]
        return merged.to(dtype or tensor.dtype)

    def changes(self, key: str) -> bool:
        """Whether merging this adapter changes the base checkpoint's tensor `key`."""
        return key.endswith(".weight") and key.removesuffix(".weight") in self.targets()


_LORA_FIELDS = {"r": "size", "alpha": "number", "dropout": "fraction", "query": "bool", "key": "bool", "value": "bool",
                "projection": "bool", "mlp": "bool", "head": "bool", "experts": "bool", "router": "bool",
                "rslora": "bool", "loraplus_lr_ratio": "positive", "dora": "bool",
                "init": "str", "loftq_iters": "size"}


def check_payload(payload: dict, where: object) -> None:
    """Refuse, in one line naming the part, an adapter payload that does not describe a usable adapter: its LoRA
    settings (a rank from 1 to the model's width, a dropout below 1), its base model's config (every field that
    shapes the model present, with values a model can have), and its tensors (each one the model has a place for, of
    the shape the two configs imply, finite, none missing)."""
    fix = "it is damaged or not of this version: use another checkpoint of the run"
    for part in ("lora", "lora_config", "model_config"):
        if not isinstance(payload.get(part), dict):
            raise UserError(f"{where}: {part} is {type(payload.get(part)).__name__}, expected an object; {fix}")
    if not isinstance(payload.get("train") or {}, dict):
        raise UserError(f"{where}: train is {type(payload['train']).__name__}, expected an object; {fix}")
    check_fields(payload["lora_config"], f"{where} lora_config", _LORA_FIELDS, ("r", "alpha"), fix)
    check_config_dict(payload["model_config"], f"{where} model_config", fix)
    try:
        base = Config.from_dict(payload["model_config"])
    except UserError as e:
        raise UserError(f"{where} model_config: {e}") from None
    lora = LoRAConfig.from_dict(payload["lora_config"])
    if lora.init not in LORA_INITS:
        raise UserError(f"{where} lora_config: init is {lora.init!r}, expected one of {', '.join(LORA_INITS)}; {fix}")
    if lora.dropout >= 1:
        raise UserError(f"{where} lora_config: dropout is {lora.dropout}, expected a number from 0 to below 1; {fix}")
    if lora.r > base.n_embd:
        raise UserError(f"{where} lora_config: r is {lora.r}, larger than the layers it adapts (n_embd="
                        f"{base.n_embd}); {fix}")
    expected = {k: tuple(v.shape) for k, v in lora_state_dict(meta_model(base, lora)).items()}
    tensors = payload["lora"]
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise UserError(f"{where}: LoRA tensor {name!r} is {type(t).__name__}"
                            f"{' of ' + str(t.dtype) if isinstance(t, torch.Tensor) else ''}, expected a floating "
                            f"tensor; {fix}")
        if name not in expected:
            raise UserError(f"{where} holds LoRA tensor {name!r}, which its lora_config and model_config have no "
                            f"place for; {fix}")
        if tuple(t.shape) != expected[name]:
            raise UserError(f"{where}: LoRA tensor {name} has shape {tuple(t.shape)}, its configs imply "
                            f"{expected[name]}; {fix}")
        if not torch.isfinite(t).all():  # training never saves one: it stops at a non-finite loss before
            raise UserError(f"{where}: LoRA tensor {name} holds non-finite values ({int((~torch.isfinite(t)).sum())} "
                            f"NaN or inf); {fix}")
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise UserError(f"{where} has no LoRA tensor {missing[0]} ({len(missing)} missing); {fix}")
