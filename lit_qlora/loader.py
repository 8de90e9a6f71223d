"""Build a model from a checkpoint folder with low peak memory.

The model is created on the meta device, LoRA wrappers and empty quantized layers are put in place, and then
each tensor is read from disk on its own, cast or quantized, and placed. The full-precision model never
exists in memory: peak ≈ final model + the largest single tensor + the runtime.

Tensors are read with plain file reads rather than a memory map: pages of a mapped file stay in the
process's resident set once touched, which would make the whole checkpoint count against peak memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn

from lit_qlora.adapter import Adapter
from lit_qlora.checkpoint import LIT_WEIGHTS, FileTensor, as_tensor, read_safetensors
from lit_qlora.config import Config
from lit_qlora.convert import ensure_converted
from lit_qlora.lora import (
    RESIDUAL_INITS,
    LoRAConfig,
    LoRAExperts,
    LoRALinear,
    copy_into_param,
    init_lora_,
    lora_delta,
    lora_targets,
    meta_model,
    residual_init,
)
from lit_qlora.model import GPT, ExpertWeights
from lit_qlora.precision import parse_precision
from lit_qlora.quant.mxfp4 import Mxfp4Tensor, join_stacks
from lit_qlora.quant.prequantized import StoredQuantization, open_stored
from lit_qlora.quant.quant_mode import QuantMode
from lit_qlora.quant.quantize import (
    FileEmbedding,
    QuantizedExpertWeights,
    StoredEmbedding,
    TiedEmbedding4bit,
    check_quantize,
    dequantize_packed,
    dequantize_weight,
    is_quantized,
    load_bnb,
    prepare_4bit_for_sharding,
    quantize_4bit_tensor,
    quantize_experts,
    quantize_into,
    swap_linears,
)
from lit_qlora.utils import UserError


def _owner(model: nn.Module, key: str) -> tuple[nn.Module, str]:
    module_name, _, param = key.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(module, (LoRALinear, LoRAExperts)):  # base weights live inside the LoRA wrapper
        module = module.base
    return module, param


@dataclass
class LoadPlan:
    """What `load_model` decides before it reads a tensor. Weights are named as the checkpoint names them, without
    `.weight` (`transformer.h.0.attn.qkv`); a weight in none of the sets below is kept dense, cast to its dtype."""

    weights: Path  # the file read (named in error messages)
    quantized: set[str]  # land in a bitsandbytes layer (put in place by swap_linears): quantized as they are read...
    stored: Optional[StoredQuantization]  # ... or read from this stored quantization (see `from_stored`)
    merged: set[str]  # an adapter is added to them as they are read, in fp32, before any quantization
    residual: dict[str, Optional[list]]  # give up s*B0@A0 to a pissa / olora / loftq init (name -> row parts)
    embedding: str  # the input embedding: "dense", "head" (served by the tied 4-bit head: no dense copy) or "file"
    # (an untied quantized model's rows read from the file as looked up, or kept 16-bit as stored)

    def from_stored(self, name: str) -> bool:
        """Whether the quantized weight `name` is read from the stored quantization: it has one, and neither a merge
        nor a residual init changes the weight it was made from."""
        return self.stored is not None and name not in self.merged and name not in self.residual


def load_model(checkpoint_dir: Path, precision: str = "bf16-true", quantize: Optional[str] = None,
               lora: Optional[LoRAConfig] = None, device: torch.device | str = "cpu",
               quantize_lm_head: Optional[bool] = None,
               weights: Optional[Path] = None, config: Optional[Config] = None, seed: Optional[int] = None,
               merge_adapter: Optional[Adapter] = None,
               tensors: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
               embedding_from_head: bool = False, use_stored: bool = True,
               lora_init: Optional[dict[str, torch.Tensor]] = None) -> GPT:
    """The one loader: a GPT from `checkpoint_dir` (an HF folder is converted on first use), optionally with
    LoRA layers (fresh, or filled later with `load_lora_weights`) and quantized frozen Linear layers.

    `merge_adapter` is added to the full-precision weights as they are read, before any
    quantization, so a merged 4-bit model rounds once, like any quantized checkpoint.

    A LoRA with `lora.init` pissa / olora / loftq starts from the weights it adapts (lit_qlora.lora.residual_init):
    each such weight gives up s*B0@A0 as it is read, before it is quantized. `lora_init` (an adapter's tensors) gives
    the A0, B0 to take out instead of computing them (an adapter loaded to use it).

    `tensors` ((name, tensor) pairs in our naming, with `config`) fills the model instead of the checkpoint file:
    scripts/bench/bench_gpu.py makes random weights on the device that way, each quantized as soon as it exists.

    `embedding_from_head` (generation, never training): a tied model with a 4-bit output layer reads its input
    embedding from that layer (`TiedEmbedding4bit`), so the dense embedding is never kept; an untied quantized
    model on CPU reads its embedding rows from the checkpoint file as tokens are looked up (`FileEmbedding`), and
    elsewhere keeps a 16-bit embedding as stored while computing in fp32 (`StoredEmbedding`).

    On CPU, quantized layers are read from the checkpoint's stored quantization when it has a matching one
    (quant/prequantized.py; `use_stored=False`: quantize regardless); `model.stored_quantization` names the file
    read, or is None, and `model.layers_quantized_at_load` counts the quantized layers that were not read from it.

    The decisions come first (`LoadPlan`), then one loop places each tensor as it is read."""
    device = torch.device(device)
    prec = parse_precision(precision)
    quantize = check_quantize(quantize, precision, device)
    config = config or ensure_converted(checkpoint_dir)
    deferred = bool(quantize) and device.type == "cpu"  # a quantized weight is read as it is quantized
    tensors, weights = _tensor_source(checkpoint_dir, weights, tensors, config, deferred)
    model = meta_model(config, lora)
    if quantize:
        swap_linears(model, quantize, prec.dtype, bool(quantize_lm_head))
    plan = LoadPlan(weights, quantized=_quantized_now(model),
                    stored=_stored_quantization(weights, quantize, prec, device) if use_stored else None,
                    merged=set(merge_adapter.targets()) if merge_adapter is not None else set(),
                    residual=lora_targets(config, lora) if lora is not None and lora.init in RESIDUAL_INITS else {},
                    embedding=_embedding_kind(model, config, lora, quantize, embedding_from_head, merge_adapter))

    inits: dict[str, tuple[torch.Tensor, ...]] = {}  # module -> A, B, A0, B0 of a residual init
    for key, t in tensors:
        module, param = _owner_of(model, key, weights)
        name = key.removesuffix(".weight") if param == "weight" else None
        if name in plan.merged:  # rounded once, to the dtype or grid it is loaded into
            t = merge_adapter.merged(key, as_tensor(t), torch.float32)
        if name in plan.residual:  # the base keeps W - s*B0@A0
            quant_error = _quant_error(module, device, prec.dtype) if name in plan.quantized else None
            t, inits[name] = _take_residual(as_tensor(t), name, plan.residual[name], lora, lora_init, quant_error)
        if name in plan.quantized:
            _place_quantized(module, name, t, plan, prec, device)
        elif key == "transformer.wte.weight" and plan.embedding != "dense":
            _place_embedding(model, t, plan, prec, device)
        else:
            _place_dense(module, param, t, prec, device)
        del t

    head_adapter = merge_adapter if "lm_head" in plan.merged else None
    _tie_and_check(model, config, prec, device, weights, head_adapter, plan.stored)
    if lora is not None:
        _init_lora(model, prec.trainable_dtype, device, seed, inits)
    stored = plan.stored
    model.stored_quantization = stored.path if stored and stored.filled else None  # what the Loaded line names
    model.layers_quantized_at_load = sum(map(is_quantized, model.modules())) - (stored.filled if stored else 0)
    return model


def _tensor_source(checkpoint_dir: Path, weights: Optional[Path], tensors: Optional[Iterable], config: Config,
                   deferred: bool) -> tuple[Iterable[tuple[str, torch.Tensor]], Path]:
    """(name, tensor) pairs to load and the file they come from: the given `tensors`, else the checkpoint's weights
    read one tensor at a time (`deferred`: as FileTensors, read when quantized); MXFP4 expert stacks as one lazy
    tensor each, dequantized an expert at a time."""
    if tensors is not None:
        return tensors, Path("<the given tensors>")  # only named in error messages
    weights = Path(weights or Path(checkpoint_dir) / LIT_WEIGHTS)
    tensors = read_safetensors(weights, deferred=deferred)
    return (join_stacks(tensors) if config.moe_mxfp4 else tensors), weights


def _stored_quantization(weights: Path, quantize: Optional[QuantMode], prec, device: torch.device
                         ) -> Optional[StoredQuantization]:
    """The checkpoint's stored quantization in this mode (quantized once by scripts/quantize_checkpoint.py), on CPU;
    None when it has none."""
    if quantize and device.type == "cpu" and weights.is_file():
        return open_stored(weights, quantize, prec.dtype)
    return None


def _quantized_now(model: GPT) -> set[str]:
    """The weights that land in a bitsandbytes layer (a LoRA wrapper's base is named as the wrapper)."""
    return {name.removesuffix(".base") for name, m in model.named_modules()
            if is_quantized(m) or isinstance(m, QuantizedExpertWeights)}


def _embedding_kind(model: GPT, config: Config, lora: Optional[LoRAConfig], quantize: Optional[QuantMode],
                    wanted: bool, merge_adapter: Optional[Adapter]) -> str:
    """How the input embedding is kept (`LoadPlan.embedding`); "head" and "file" only for generation (`wanted`)."""
    if _embedding_from_head(model, config, lora, wanted, merge_adapter):
        return "head"
    if wanted and quantize and not config.tie_embeddings and type(model.transformer.wte) is nn.Embedding:
        return "file"
    return "dense"


def _owner_of(model: nn.Module, key: str, weights: Path) -> tuple[nn.Module, str]:
    """`_owner`, or one line saying the checkpoint does not fit the model."""
    try:
        return _owner(model, key)
    except AttributeError:
        raise UserError(f"{weights} holds {key!r}, which this model has no place for; the weights do not match "
                        f"model_config.json: convert the checkpoint again") from None


def _place_quantized(module: nn.Module, name: str, t, plan: LoadPlan, prec, device: torch.device) -> None:
    """A weight into its bitsandbytes layer: read as stored, or quantized now (a stacked projection of experts: a
    layer per expert, expert e stored as {name}.layers.{e}.weight)."""
    stored = plan.stored if plan.from_stored(name) else None
    if isinstance(module, QuantizedExpertWeights):
        fill = None if stored is None else (lambda e: stored.fill(module.layers[e], f"{name}.layers.{e}.weight"))
        quantize_experts(module, t, device, prec.dtype, fill)
    elif not (stored and stored.fill(module, name + ".weight")):
        quantize_into(module, t, device, prec.dtype)


def _place_embedding(model: GPT, t, plan: LoadPlan, prec, device: torch.device) -> None:
    """The input embedding of a generation model (`LoadPlan.embedding` "head" or "file")."""
    if plan.embedding == "head":  # the one copy: the tied head's 4 bits
        head = model.lm_head
        if not plan.from_stored("transformer.wte") or not plan.stored.fill(head, "lm_head.weight"):
            quantize_into(head, t, device, prec.dtype)
        model.transformer.wte = TiedEmbedding4bit(head, prec.frozen_other_dtype)
    elif isinstance(t, FileTensor):  # rows read from the file as tokens are looked up
        model.transformer.wte = FileEmbedding(t, prec.frozen_other_dtype)
    elif StoredEmbedding.fits(t := as_tensor(t), prec.frozen_other_dtype):  # 16-bit as stored, computing in fp32
        model.transformer.wte = StoredEmbedding(t.to(device), prec.frozen_other_dtype)
    else:
        _place_dense(model.transformer.wte, "weight", t, prec, device)


def _place_dense(module: nn.Module, param: str, t, prec, device: torch.device) -> None:
    """A tensor kept as it is read: frozen Linear weights in the compute dtype, embeddings and norms in theirs (fp32
    under *-mixed); dense MXFP4 experts dequantized into the compute dtype one expert at a time."""
    if isinstance(t, Mxfp4Tensor):
        t = t.load(prec.frozen_linear_dtype)
    t = as_tensor(t)
    linear_like = isinstance(module, (nn.Linear, ExpertWeights, QuantizedExpertWeights)) or is_quantized(module)
    dtype = prec.frozen_linear_dtype if linear_like else prec.frozen_other_dtype
    module._parameters[param] = nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)


def _embedding_from_head(model: GPT, config: Config, lora: Optional[LoRAConfig], wanted: bool,
                         merge_adapter: Optional[Adapter]) -> bool:
    """Whether the tied embedding is served from the 4-bit head: asked for, no LoRA layers (nothing trains), no
    adapter merged into the head, and a 4-bit head with whole blocks per row."""
    if not (wanted and config.tie_embeddings and lora is None):
        return False
    if merge_adapter is not None and "lm_head" in merge_adapter.targets():
        return False
    return TiedEmbedding4bit.fits(model.lm_head)


def _tie_and_check(model: GPT, config: Config, prec, device: torch.device, weights: Path,
                   head_adapter: Optional[Adapter] = None, stored: Optional[StoredQuantization] = None) -> None:
    if config.tie_embeddings and not isinstance(model.transformer.wte, TiedEmbedding4bit):
        head, param = _owner(model, "lm_head.weight")
        wte = model.transformer.wte.weight
        if head_adapter is not None:  # a LoRA on a tied head: the merged head is its own tensor
            w = head_adapter.merged("lm_head.weight", wte.detach().cpu(), prec.dtype)
            if is_quantized(head):
                quantize_into(head, w, device)
            else:
                head.weight = nn.Parameter(w.to(device=device, dtype=prec.frozen_linear_dtype), requires_grad=False)
        elif is_quantized(head):
            if not (stored and stored.fill(head, "lm_head.weight")):
                quantize_into(head, wte.detach().to(prec.dtype), device)
        else:
            head.weight = wte
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.is_meta and "lora_" not in name:
            raise UserError(f"{weights} has no tensor for {name}; the checkpoint is incomplete: convert it again")


def _take_residual(w: torch.Tensor, name: str, parts, lora: LoRAConfig, given: Optional[dict],
                   quant_error) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """W - s*B0@A0 and (A, B, A0, B0) of one adapted weight (each part of a fused qkv on its own), fp32."""
    out_f = w.shape[0]
    parts = parts or [(0, out_f)]
    if given is not None:
        A0, B0 = given[name + ".lora_A0"].float(), given[name + ".lora_B0"].float()
        A, B = given[name + ".lora_A"].float(), given[name + ".lora_B"].float()
    else:  # (a rank above a part's smaller side is refused by apply_lora)
        pieces = [residual_init(w[a:a + n], lora.init, lora.r, lora.scaling, lora.loftq_iters,
                                None if quant_error is None else _rows_error(quant_error, w, a, n)) for a, n in parts]
        A, B, A0, B0 = (torch.cat([p[i] for p in pieces]) for i in range(4))
    return w.float() - lora_delta(A0, B0, parts, lora.r, lora.scaling, out_f), (A, B, A0, B0)


def _rows_error(quant_error, w: torch.Tensor, start: int, n: int):
    """The quantization error of rows start:start+n of a residual, quantized with the rest of the weight (LoftQ on
    one part of a fused qkv: the other rows as they are)."""
    def err(rows: torch.Tensor) -> torch.Tensor:
        full = w.float().clone()
        full[start:start + n] = rows
        return quant_error(full)[start:start + n]
    return err


def _quant_error(module: nn.Module, device: torch.device, dtype: torch.dtype):
    """w -> w - dequantize(quantize(w)) as the 4-bit layer `module` would store w (None for int8: LoftQ is 4-bit)."""
    if not isinstance(module, load_bnb().nn.Linear4bit):
        return None

    def err(w: torch.Tensor) -> torch.Tensor:
        packed, state = quantize_4bit_tensor(module, w.to(dtype), device)
        return w.float() - dequantize_packed(packed, state, torch.float32).reshape(w.shape).cpu()
    return err


def _init_lora(model: nn.Module, dtype: torch.dtype, device: torch.device, seed: Optional[int],
               inits: Optional[dict] = None) -> None:
    gen_state = torch.random.get_rng_state()
    if seed is not None:
        torch.manual_seed(seed)
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            m.lora_A = nn.Parameter(torch.empty(m.lora_A.shape, device=device, dtype=dtype))
            m.lora_B = nn.Parameter(torch.empty(m.lora_B.shape, device=device, dtype=dtype))
            m.reset_lora_parameters()
            if inits and name in inits:  # pissa / olora / loftq: A and B from the weight, A0 and B0 kept
                A, B, A0, B0 = inits[name]
                with torch.no_grad():
                    m.lora_A.copy_(A)
                    m.lora_B.copy_(B)
                m.lora_A0, m.lora_B0 = A0.to(device), B0.to(device)
            if m.dora:  # the base's row norms, from a dequantized copy of its weight that is dropped at once
                m.lora_magnitude = nn.Parameter(torch.empty(m.lora_magnitude.shape, device=device, dtype=dtype))
                m.init_dora(dequantize_weight(m.base) if is_quantized(m.base) else m.base.weight)
        elif isinstance(m, LoRAExperts):
            m.lora_A = nn.Parameter(torch.empty(m.lora_A.shape, device=device, dtype=dtype))
            m.lora_B = nn.Parameter(torch.empty(m.lora_B.shape, device=device, dtype=dtype))
            m.reset_lora_parameters()
    if seed is not None:
        torch.random.set_rng_state(gen_state)


def load_model_with_adapter(checkpoint_dir: Path, adapter: Adapter, precision: str = "bf16-true",
                            quantize: Optional[str] = None, device: torch.device | str = "cpu", **kw) -> GPT:
    """Base model + separate LoRA layers filled from `adapter`, whatever quantization/precision it was trained with."""
    given = adapter.lora if adapter.config.init in RESIDUAL_INITS else None  # the A0, B0 its base gave up
    model = load_model(checkpoint_dir, precision=precision, quantize=quantize, lora=adapter.config, device=device,
                       lora_init=given, **kw)
    adapter.load_into(model)
    return model


def load_model_sharded(checkpoint_dir: Path, shard: Callable[[GPT], None], precision: str = "bf16-true",
                       quantize: Optional[str] = None, lora: Optional[LoRAConfig] = None,
                       device: torch.device | str = "cpu", quantize_lm_head: Optional[bool] = None,
                       config: Optional[Config] = None, seed: Optional[int] = None,
                       storage: torch.dtype = torch.uint8) -> GPT:
    """`load_model` for FSDP: this process keeps only its shard of every weight, the 4-bit ones included.

    The model is built on meta with the 4-bit layers' weights in their packed shape (`prepare_4bit_for_sharding`),
    `shard(model)` (torch's `fully_shard`, see lit_qlora/distributed.py) turns every parameter into a meta DTensor
    shard, and the shards get storage on `device`. Then each tensor is read from disk on its own, cast or quantized
    whole (the same bytes `load_model` stores) and only this rank's part of it is kept (`copy_into_param`: DTensor
    places it). Peak: the shards + the largest single tensor being quantized. The 4-bit layers' block scales are
    kept whole on every rank. LoRA weights are initialized whole from `seed`, like `load_model`, then sharded: the
    same values as an unsharded run. A pissa / olora / loftq init takes its residual from each whole weight as it is
    read (as `load_model` does); DoRA's row norms and starting magnitudes come from each whole weight as stored
    (dequantized for a moment), before only this rank's part of it is kept."""
    device = torch.device(device)
    prec = parse_precision(precision)
    quantize = check_quantize(quantize, precision, device)
    config = config or ensure_converted(checkpoint_dir)
    weights = Path(checkpoint_dir) / LIT_WEIGHTS
    model = meta_model(config, lora)
    if quantize:
        swap_linears(model, quantize, prec.dtype, bool(quantize_lm_head))
        prepare_4bit_for_sharding(model, storage)
    _set_meta_dtypes(model, prec)  # the shards get storage in these dtypes: the ones load_model gives each tensor
    shard(model)
    model.to_empty(device=device)
    filled: set[str] = set()
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    adapted = lora_targets(config, lora) if lora is not None else {}
    inits: dict[str, tuple[torch.Tensor, ...]] = {}  # module -> A, B, A0, B0 of a residual init
    dora: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # module -> DoRA's row norms^2 and magnitudes, whole

    def place(module: nn.Module, param: str, t: torch.Tensor, name: Optional[str] = None) -> None:
        target = module._parameters[param]
        if is_quantized(module) and param == "weight":
            packed, state = quantize_4bit_tensor(module, t.to(prec.dtype), device)
            module.quant_state = state  # whole on every rank, on `device` (where it was quantized)
            if name in dora:  # the weight the layer computes with
                weight = dequantize_packed(packed, state).reshape(state.shape)  # what the layer computes with
                dora[name] = _dora_start(weight, adapted[name], lora, inits.get(name))
            t = packed
        else:
            dtype = prec.frozen_linear_dtype if isinstance(module, nn.Linear) else prec.frozen_other_dtype
            t = t.to(dtype)
            if name in dora:
                dora[name] = _dora_start(t, adapted[name], lora, inits.get(name))
        with torch.no_grad():
            copy_into_param(target, t)
        filled.add(names[id(target)])

    tensors = read_safetensors(weights)
    for key, t in (join_stacks(tensors) if config.moe_mxfp4 else tensors):
        t = as_tensor(t)
        module, param = _owner_of(model, key, weights)
        name = key.removesuffix(".weight")
        if name in adapted and param == "weight":
            if lora.init in RESIDUAL_INITS:  # the base keeps W - s*B0@A0, as load_model
                quant_error = _quant_error(module, device, prec.dtype) if is_quantized(module) else None
                t, inits[name] = _take_residual(as_tensor(t), name, adapted[name], lora, None, quant_error)
            if lora.dora:
                dora[name] = None  # filled by place() from the weight as stored
        else:
            name = None
        place(module, param, t, name)
        if key == "transformer.wte.weight" and config.tie_embeddings:
            head, _ = _owner(model, "lm_head.weight")
            if is_quantized(head):  # the quantized head is its own tensor (an unquantized one is wte itself)
                place(head, "weight", t)
        del t
    if lora is not None:
        _init_lora_sharded(model, prec.trainable_dtype, device, seed, filled, names, inits, dora)
    missing = [n for n in names.values() if n not in filled]
    if missing:
        raise UserError(f"{weights} has no tensor for {missing[0]}; the checkpoint is incomplete: convert it again")
    return model


def _set_meta_dtypes(model: nn.Module, prec) -> None:
    """Give every (meta) parameter the dtype `load_model` stores it in: LoRA in the trainable dtype, frozen Linear
    weights and biases in the compute dtype, embeddings and norms in theirs; the packed 4-bit bytes stay as they are.
    A tied parameter keeps one dtype, its first owner's (the embedding), and stays one parameter."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m, name))
    for group in owners.values():
        m, name = group[0]
        p = m._parameters[name]
        if "lora_" in name:
            dtype = prec.trainable_dtype
        elif is_quantized(m) and name == "weight":
            continue
        else:
            dtype = prec.frozen_linear_dtype if isinstance(m, nn.Linear) else prec.frozen_other_dtype
        new = nn.Parameter(torch.empty(p.shape, dtype=dtype, device="meta"), requires_grad=p.requires_grad)
        for owner, owner_name in group:
            owner._parameters[owner_name] = new


def _init_lora_sharded(model: nn.Module, dtype: torch.dtype, device: torch.device, seed: Optional[int],
                       filled: set[str], names: dict[int, str], inits: dict, dora: dict) -> None:
    """`_init_lora` on whole tensors (the same random draws, in the same order), each then sharded; the residual
    inits' A and B and DoRA's magnitudes as `load_model_sharded` computed them from the whole weights (the initial
    A0, B0 and the row norms are buffers: whole on every rank)."""
    gen_state = torch.random.get_rng_state()
    if seed is not None:
        torch.manual_seed(seed)
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            A = torch.empty(m.lora_A.shape, device=device, dtype=dtype)
            B = torch.empty(m.lora_B.shape, device=device, dtype=dtype)
            init_lora_(A, B, len(m.parts), m.r, m.init)
            if name in inits:
                A, B, A0, B0 = (x.to(device) for x in inits[name])
                m.lora_A0, m.lora_B0 = A0, B0
            with torch.no_grad():
                copy_into_param(m.lora_A, A)
                copy_into_param(m.lora_B, B)
            filled.update((names[id(m.lora_A)], names[id(m.lora_B)]))
            if m.dora:
                wnorm2, magnitude = dora[name]
                m.lora_wnorm2 = wnorm2.to(device)
                with torch.no_grad():
                    copy_into_param(m.lora_magnitude, magnitude)
                filled.add(names[id(m.lora_magnitude)])
    if seed is not None:
        torch.random.set_rng_state(gen_state)


def _dora_start(weight: torch.Tensor, parts, lora: LoRAConfig, init: Optional[tuple] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """DoRA's row norms^2 and starting magnitudes of a layer whose whole weight (as it computes with it) is
    `weight`: `LoRALinear.init_dora` on a dense stand-in holding it, with the residual init's A and B (B = 0
    otherwise: the magnitudes are then the row norms, whatever A is)."""
    out_f, in_f = weight.shape
    stand_in = nn.Linear(in_f, out_f, bias=False, device="meta")
    stand_in.weight = nn.Parameter(weight, requires_grad=False)
    m = LoRALinear(stand_in, in_f, out_f, lora.r, lora.alpha, 0.0, parts, rslora=lora.rslora, dora=True)
    with torch.no_grad():
        m.lora_A = nn.Parameter(init[0].float() if init else torch.zeros(m.lora_A.shape))
        m.lora_B = nn.Parameter(init[1].float() if init else torch.zeros(m.lora_B.shape))
        m.init_dora(weight)
    return m.lora_wnorm2, m.lora_magnitude.detach()
