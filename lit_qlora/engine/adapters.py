"""Several LoRA adapters over one base model, and rows of different adapters in one forward.

Each adapter is held as its own LoRA wrappers around the base model's very layers (`AdapterBank`); nothing is merged
and the base weights exist once. Two ways to use them:
- `route`: every layer some adapter targets becomes a `RowLoRALinear`, which runs its base layer once for all the
  rows of a forward (a 4-bit one through the decode kernel) and adds each run of rows of one adapter that adapter's
  update (its A and B as fp32 copies: `LoRALinear._frozen_forward`, one rounding, DoRA's factor too); base rows pay
  nothing. As Punica / S-LoRA / vLLM batch their LoRA rows: shrink by A, expand by B, per segment.
- `activate`: one adapter's wrappers in place for the whole model (an adapter on a mixture's experts, whose rows go
  to their experts in groups, runs this way, its rows alone in their forward).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn

from lit_qlora.adapter import Adapter
from lit_qlora.lora import LoRAExperts, LoRALinear, is_expert_target
from lit_qlora.model import linear
from lit_qlora.precision import parse_precision
from lit_qlora.quant.decode4bit import DecodeLinear4bit, DecodeLoRALinear, Segments
from lit_qlora.quant.quant_mode import QuantMode
from lit_qlora.quant.quantize import dequantize_weight, is_quantized
from lit_qlora.utils import UserError


class RowRoutes:
    """Which rows of the next forward carry which adapter: (adapter name, first row, end row) of each run of rows
    with an adapter, rows counted over the flattened [B * T] tokens (`segments`), and over the rows that reach the
    output layer (`head`: only those whose logits are wanted). Shared by every `RowLoRALinear` of a model."""

    def __init__(self) -> None:
        self.segments: list[tuple[str, int, int]] = []
        self.head: list[tuple[str, int, int]] = []
        self.version = 0  # changes whenever they do: what the layers' kernel arguments are cached by

    def set(self, segments: list[tuple[str, int, int]], head: list[tuple[str, int, int]]) -> None:
        if (segments, head) != (self.segments, self.head):
            self.segments, self.head, self.version = segments, head, self.version + 1


class RowLoRALinear(nn.Module):
    """A base layer and the LoRA wrappers of every adapter that targets it (`loras`, sharing this base): the base
    runs once on all the rows, then each segment of `routes` gets its adapter's update."""

    def __init__(self, base: nn.Module, routes: RowRoutes, head: bool = False) -> None:
        super().__init__()
        self.base, self.routes, self.head = base, routes, head
        self.in_features, self.out_features = base.in_features, base.out_features
        self.loras: dict[str, LoRALinear] = {}  # not submodules: the bank holds them (`add`)
        self._segments: tuple = (None, None)  # ((routes version, rows), the kernel's Segments for them)

    def add(self, name: str, lora: LoRALinear) -> None:
        self.loras[name] = lora
        self._segments = (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        segments = self.routes.head if self.head else self.routes.segments
        if (segments and type(self.base) is DecodeLinear4bit and not torch.is_grad_enabled()
                and not torch.is_autocast_enabled(x.device.type)):
            # the base and every row's update in one kernel call, summed in fp32 and rounded once (as
            # DecodeLoRALinear does for one adapter)
            y = self.base.kernel_forward(x, segments=self._kernel_segments(x))
            if y is not None:
                return y
        y = linear(self.base, x)
        if not segments:
            return y
        rows, out = x.reshape(-1, self.in_features), y.view(-1, self.out_features)
        for name, start, end in segments:
            lora = self.loras.get(name)
            if lora is not None:
                out[start:end] = lora._frozen_forward(rows[start:end], out[start:end])
        return y

    def _kernel_segments(self, x: torch.Tensor) -> Segments:
        """`routes` as the kernel takes them: every row in a run, a run of base rows with no LoRA; made again only
        when the routes change (a decoding batch keeps its rows for many steps; the adapters' fp32 copies they point
        into never change: nothing here trains)."""
        rows = x.numel() // self.in_features
        key, made = self._segments
        if key == (self.routes.version, rows):
            return made
        ends, loras, at = [], [], 0
        for name, start, end in (self.routes.head if self.head else self.routes.segments):
            if start > at:
                ends.append(start)
                loras.append(None)
            lora = self.loras.get(name)
            ends.append(end)
            loras.append(lora._decode_weights() if lora is not None else None)
            at = end
        if at < rows:
            ends.append(rows)
            loras.append(None)
        made = Segments(ends, loras)
        self._segments = ((self.routes.version, rows), made)
        return made


def runs(names: list[Optional[str]], rows_each: int) -> list[tuple[str, int, int]]:
    """(name, first row, end row) of each run of equal names but None, each name standing for `rows_each` rows."""
    out, start = [], 0
    for i in range(1, len(names) + 1):
        if i == len(names) or names[i] != names[start]:
            if names[start] is not None:
                out.append((names[start], start * rows_each, i * rows_each))
            start = i
    return out


class AdapterBank:
    """The base model's own layers, and for each adapter a LoRA wrapper (`LoRALinear`, or `DecodeLoRALinear` over a
    4-bit kernel layer) around each layer it targets, holding that adapter's tensors in the precision's trainable
    dtype: the same modules generate/lora.py --merge false builds, sharing the base layer objects. What one adapter
    holds is its A and B in that dtype (and a DoRA adapter its magnitudes) and nothing else (tests/test_serve.py
    counts the tensor storage): the file's tensors are copied out and dropped, and the fp32 decoding copies
    (`LoRALinear._decode_weights`, 2.4x the bf16 tensors with every target adapted) exist for the active adapter
    only. DoRA's row norms of a base layer (one fp32 vector) are shared by every DoRA adapter of that layer.

    An adapter started by PiSSA / OLoRA (trained over a base that gave up s*B0@A0) is served as the same update over
    the shared original base, a LoRA of rank 2r (`Adapter.as_plain_lora`); over a quantized base that is the base
    quantized whole rather than the residual it trained on, as a merged generation is. A LoftQ adapter's base is its
    own quantized residual: served only where that is the shared base (one LoftQ step: the base itself, quantized
    in the same mode)."""

    def __init__(self, model: nn.Module, precision: str, quantize: Optional[str] = None) -> None:
        self.model = model
        self.dtype = parse_precision(precision).trainable_dtype
        self.quantize = QuantMode.parse(quantize)
        self.base_layers: dict[str, nn.Module] = {}  # module name -> the model's own layer
        self.wrappers: dict[str, dict[str, LoRALinear | LoRAExperts]] = {}  # adapter -> module name -> wrapper
        self.adapters: dict[str, Adapter] = {}  # their settings and training record (tensors dropped)
        self.active: Optional[str] = None  # None: the bare base
        self._no_dropout = nn.Identity()  # one for every wrapper (a module each is ~2 KB of Python dicts)
        self._row_norms2: dict[str, torch.Tensor] = {}  # module name -> ||W||^2 of each row (DoRA), made once
        self.routes = RowRoutes()
        self.row_layers: dict[str, RowLoRALinear] = {}  # module name -> the layer every mixable adapter shares
        self._in_rows: set[str] = set()  # the adapters those layers hold

    def servable(self, name: str, adapter: Adapter) -> Adapter:
        """The adapter as an update over the shared base (see the class), or a one-line UserError."""
        cfg = adapter.config
        if cfg.init == "loftq":
            trained = QuantMode.parse(adapter.train.get("quantize"))
            if cfg.loftq_iters > 1 or trained != self.quantize:
                served = self.quantize or "not quantized"
                raise UserError(f"adapter {name} is a LoftQ adapter (--lora_init loftq, --loftq_iters "
                                f"{cfg.loftq_iters}, trained over {trained or 'no quantization'}): it belongs to its "
                                f"own quantized residual, not to the base served here ({served}); merge it "
                                "(scripts/merge_lora.py) and serve the merged folder")
            # one step: the residual is the whole weight (A0, B0 = 0), quantized as the server quantizes it
            tensors = {k: v for k, v in adapter.lora.items() if not k.endswith(("lora_A0", "lora_B0"))}
            return Adapter(tensors, replace(cfg, init="default"), adapter.model_config, adapter.train)
        return adapter.as_plain_lora()

    def add(self, name: str, adapter: Adapter) -> None:
        adapter = self.servable(name, adapter)
        cfg = adapter.config
        wrappers = {}
        for module_name, parts in adapter.targets().items():
            if module_name not in self.base_layers:
                self.base_layers[module_name] = self.model.get_submodule(module_name)
            base = self.base_layers[module_name]
            if is_expert_target(module_name):  # a stacked projection of experts: one pair per expert (never DoRA)
                w = LoRAExperts(base, cfg.r, cfg.alpha, cfg.dropout, rslora=cfg.rslora)
            else:
                w = LoRALinear(base, base.in_features, base.out_features, cfg.r, cfg.alpha, cfg.dropout, parts,
                               rslora=cfg.rslora, dora=cfg.dora)
            device = w.lora_A.device
            names = ("lora_A", "lora_B", "lora_magnitude") if cfg.dora else ("lora_A", "lora_B")
            try:
                tensors = [adapter.lora[f"{module_name}.{k}"] for k in names]
            except KeyError as e:
                raise UserError(f"adapter {name} has no tensor {e.args[0]}; it is incomplete: use another checkpoint "
                                "of it") from None
            wanted = [getattr(w, k).shape for k in names]
            if [t.shape for t in tensors] != wanted:
                raise UserError(f"adapter {name}'s tensors of {module_name} have shapes "
                                f"{'/'.join(str(tuple(t.shape)) for t in tensors)}, the base model expects "
                                f"{'/'.join(str(tuple(s)) for s in wanted)}; use the base model the adapter was "
                                "trained on")
            # copies, never the loaded tensors themselves (which may be views of the file's pages or of one storage)
            for k, t in zip(names, tensors):
                setattr(w, k, nn.Parameter(t.to(device=device, dtype=self.dtype, copy=True), requires_grad=False))
            if cfg.dora:
                w.lora_wnorm2 = self._row_norms(module_name, base)
            w.dropout = self._no_dropout  # never trained here: dropout is the identity whatever its p
            w.eval()
            if type(base) is DecodeLinear4bit:  # base and update in one kernel call, as enable_fast_decode does
                w.__class__ = DecodeLoRALinear
            wrappers[module_name] = w
        self.wrappers[name] = wrappers
        adapter.lora = {}  # the wrappers hold the tensors now (no second copy kept)
        self.adapters[name] = adapter

    def _row_norms(self, module_name: str, base: nn.Module) -> torch.Tensor:
        """||W||^2 of each row of a base layer, from its weight as served (a 4-bit one dequantized once, then freed),
        as the loader starts a DoRA layer (`LoRALinear.init_dora`)."""
        if module_name not in self._row_norms2:
            with torch.no_grad():
                w = dequantize_weight(base) if is_quantized(base) else base.weight
                self._row_norms2[module_name] = w.float().square().sum(1)
        return self._row_norms2[module_name]

    def activate(self, name: Optional[str]) -> None:
        """Put adapter `name`'s wrappers in place of the layers they target (None: the bare base everywhere, or the
        layers rows of several adapters share, which `route` tells what to add)."""
        if name is not None:  # no row of another adapter in this forward
            self.routes.set([], [])
        if name == self.active:
            return
        for w in self.wrappers.get(self.active, {}).values():  # its fp32 decoding copies: ~2.4x its own size
            w.drop_decode_weights()
        wrappers = self.wrappers.get(name, {}) if name is not None else {}
        for module_name, base in self.base_layers.items():
            parent_name, _, child = module_name.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            setattr(parent, child, wrappers.get(module_name, self.row_layers.get(module_name, base)))
        self.active = name

    def mixable(self, name: Optional[str]) -> bool:
        """Whether rows of adapter `name` can share a forward with rows of other adapters (`route`): any adapter but
        one on a mixture's experts, whose rows go through their experts in groups (those run alone, `activate`)."""
        return name is None or not any(is_expert_target(m) for m in self.wrappers[name])

    def route(self, names: list[Optional[str]], tokens_per_row: int, logits: Optional[list[bool]] = None) -> None:
        """The adapter of each row of the next forward ([len(names), tokens_per_row] tokens; None: the base), every
        one of them mixable; `logits`: whether each row's last token reaches the output layer (default all). Rows of
        one adapter should be next to each other: each run of them is one segment."""
        self.activate(None)
        self._install_rows()
        self.routes.set(runs(names, tokens_per_row), runs([n for n, w in zip(names, logits or [True] * len(names))
                                                             if w], 1))

    def _install_rows(self) -> None:
        """A `RowLoRALinear` in place of every layer a mixable adapter targets (once per adapter added)."""
        for name, wrappers in self.wrappers.items():
            if not self.mixable(name) or name in self._in_rows:
                continue
            self._in_rows.add(name)
            for module_name, w in wrappers.items():
                row = self.row_layers.get(module_name)
                if row is None:
                    row = RowLoRALinear(self.base_layers[module_name], self.routes, head=module_name == "lm_head")
                    self.row_layers[module_name] = row
                    parent_name, _, child = module_name.rpartition(".")
                    setattr(self.model.get_submodule(parent_name) if parent_name else self.model, child, row)
                row.add(name, w)

    def lora_bytes(self, name: str) -> int:
        return sum(p.numel() * p.element_size() for w in self.wrappers[name].values() for p in w.parameters(False))


