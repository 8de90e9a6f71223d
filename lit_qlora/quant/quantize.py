"""Quantized frozen base weights on top of bitsandbytes, on CPU and CUDA, plus the precision rules.

Lightning's `BitsandbytesPrecision` refuses CPU, so the Linear swap is ours: every frozen `nn.Linear` of the
base model becomes a `bitsandbytes.nn.Linear4bit` (nf4/fp4, with or without double quantization of the
block scales) or a `Linear8bitLt` (LLM.int8). The layers are created on the meta device and only get a
weight when `quantize_into` hands them the real tensor, so no quantized weight is ever randomly initialized.
"""
from __future__ import annotations

import copy
import functools
import logging
import sys
import warnings
from typing import Callable, Optional

import torch
import torch.nn as nn

from lit_qlora.checkpoint import FileTensor, as_tensor
from lit_qlora.kernels import cpu_half
from lit_qlora.lora import LoRALinear
from lit_qlora.model import ExpertWeights
from lit_qlora.precision import parse_precision
from lit_qlora.quant.mxfp4 import Mxfp4Tensor
from lit_qlora.quant.quant_mode import QuantMode
from lit_qlora.utils import UserError, release_freed_memory


def check_quantize(quantize: "str | QuantMode | None", precision: str,
                   device: torch.device | str = "cpu") -> Optional[QuantMode]:
    """The mode `quantize` names (None for none), after refusing up front, in one line, what cannot run. Everything
    else in the precision table runs."""
    parse_precision(precision)
    quantize = QuantMode.parse(quantize)
    if quantize is None:
        return None
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--quantize {quantize} runs on CPU and CUDA, not on {device.type}; use --accelerator cpu or "
                        "cuda")
    try:
        load_bnb()
    except Exception as e:  # pragma: no cover - depends on the install
        raise UserError(f"--quantize {quantize} needs bitsandbytes, which failed to import ({e}); pip install "
                        "'bitsandbytes>=0.50'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--quantize {quantize} on CUDA but no GPU is visible; run on a GPU machine or use "
                        "--accelerator cpu")
    return quantize


def _deferred_compile(fn=None, **options):
    """`torch.compile` that builds the compiled function at its first call instead of at decoration."""
    if fn is None:
        return lambda f: _deferred_compile(f, **options)
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = _real_compile(fn, **options)
        return compiled(*args, **kwargs)

    return call


_real_compile = torch.compile
_real_disable_dynamo = getattr(torch, "_disable_dynamo", None)


def _dynamo_off_when_loaded(fn=None, recursive: bool = True):
    """`torch._disable_dynamo` that imports TorchDynamo only once something else has.

    torch.library wraps every Python kernel (bitsandbytes' CPU kernels are Python) in `_disable_dynamo`,
    which imports TorchDynamo at the kernel's first call so that a compiled caller does not trace into it.
    While `torch._dynamo` has never been imported nothing is being compiled, so the kernel runs as it is.
    """
    if fn is None:
        return functools.partial(_dynamo_off_when_loaded, recursive=recursive)
    guarded = _real_disable_dynamo(fn, recursive=recursive)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if "torch._dynamo" in sys.modules:
            return guarded(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


def load_bnb():
    """bitsandbytes, imported on first use, its import-time warnings silenced (on CPU it tells users to
    install optional kernel packages: noise for ours).

    Its import decorates a few fallback kernels with `torch.compile`, and calling `torch.compile` imports
    TorchDynamo and Inductor with sympy and networkx: 0.12 GB resident in every process that imports
    bitsandbytes, most of a 4-bit generation's runtime, for functions our paths may never call. During that
    import `torch.compile` builds each compiled function at its first call instead (what it does anyway: it
    compiles on the first call), so the cost is paid only by a process that calls one. Likewise its kernels,
    registered through torch.library, import TorchDynamo at their first call (70 MB) only where it is loaded
    already (`_dynamo_off_when_loaded`).
    """
    if "bitsandbytes" not in sys.modules:
        torch.compile = _deferred_compile
        if _real_disable_dynamo is not None:
            torch._disable_dynamo = _dynamo_off_when_loaded
        log = logging.getLogger("bitsandbytes")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                import bitsandbytes  # noqa: F401
        finally:
            torch.compile = _real_compile
            if _real_disable_dynamo is not None:
                torch._disable_dynamo = _real_disable_dynamo
            log.setLevel(level)
    return sys.modules["bitsandbytes"]


def make_quantized_linear(linear: nn.Linear, mode: QuantMode, compute_dtype: torch.dtype,
                          parts: Optional[tuple[int, ...]] = None) -> nn.Module:
    """An empty (meta) bitsandbytes layer of the same shape as `linear`; `quantize_into` fills it. `parts`: the rows
    of each HF tensor its weight stacks (`quantized_parts`), each quantized on its own (4-bit only: int8 scales
    each row on its own anyway)."""
    bnb, mode = load_bnb(), QuantMode.parse(mode)
    out_f, in_f = linear.weight.shape
    has_bias = linear.bias is not None
    if mode.is_int8:
        q = bnb.nn.Linear8bitLt(in_f, out_f, bias=has_bias, has_fp16_weights=False, threshold=6.0, device="meta")
    else:
        q = _cpu_linear4bit()(in_f, out_f, bias=has_bias, compute_dtype=compute_dtype, quant_type=mode.quant_type,
                compress_statistics=mode.double_quant, device="meta")
        # Training must never run the CPU eval-time repacking (it silently stops gradients); generation
        # turns it back on where it is valid (`enable_cpu_inference_packing`).
        q.support_avx512bf16_for_cpu = False
        if parts is not None and len(parts) > 1:
            if sum(parts) != out_f:
                raise ValueError(f"parts {parts} do not add up to {out_f} rows")
            q.part_rows = tuple(parts)
    q.requires_grad_(False)
    return q


def quantized_parts(config, name: str) -> Optional[tuple[int, ...]]:
    """The rows of each HF tensor that the layer `name` of a `config` model stacks, where they are more than one:
    our fused attn.qkv of a checkpoint that stores q_proj, k_proj and v_proj apart. None: the layer is one HF tensor
    (Falcon's and Phi-3's fused query_key_value / qkv_proj, every other layer)."""
    from lit_qlora.convert import qkv_layout  # (same layer; only needed once a model is quantized)

    if name.endswith("attn.qkv") and qkv_layout(config) == "separate":
        return tuple(config.qkv_sizes)
    return None


class PartsQuantState:
    """The quantization state of a 4-bit layer whose rows stack several HF tensors (`quantized_parts`: our fused
    [q | k | v] where the checkpoint has q_proj, k_proj, v_proj): one bitsandbytes QuantState per part, each made by
    quantizing that tensor alone, exactly as bitsandbytes quantizes it in transformers. The packed bytes of the parts
    follow each other in the layer's weight.

    Why not one state for the stack: with double quantization bitsandbytes subtracts the mean block scale (`offset`)
    before quantizing the scales to 8 bits in runs of 256, and one state shares that mean and those runs between q,
    k and v. Where k and v have other scales than q (real checkpoints), their scales were rounded around q's mean:
    v's error was ~8% above bitsandbytes' own, and a 135M model's first loss 1% above transformers + bitsandbytes'.

    It answers what every 4-bit layer's state is asked (shape, dtype, blocksize, quant_type, nested, code, `to`,
    `as_dict`); the block scales are per part (`parts`)."""

    def __init__(self, parts: list[tuple[int, object]], shape: torch.Size, dtype: torch.dtype) -> None:
        self.parts = parts  # [(rows, bitsandbytes QuantState)] in row order
        self.shape, self.dtype = torch.Size(shape), dtype
        first = parts[0][1]
        self.blocksize, self.quant_type, self.nested, self.code = (first.blocksize, first.quant_type, first.nested,
                                                                     first.code)

    def to(self, device) -> None:
        for _, state in self.parts:
            state.to(device)

    def as_dict(self, packed: bool = False) -> dict[str, torch.Tensor]:
        """bitsandbytes' serialization of each part's state, its keys prefixed `part<i>.`."""
        return {f"part{i}.{k}": v for i, (_, state) in enumerate(self.parts) for k, v in state.as_dict(packed).items()}

    @classmethod
    def from_dict(cls, entries: dict[str, torch.Tensor], in_features: int, device: torch.device) -> "PartsQuantState":
        """Inverse of `as_dict(packed=True)` (KeyError or ValueError when `entries` is not such a dict)."""
        QuantState = load_bnb().functional.QuantState
        by_part: dict[int, dict[str, torch.Tensor]] = {}
        for k, v in entries.items():
            head, _, rest = k.partition(".")
            if not (head.startswith("part") and head[4:].isdigit() and rest):
                raise KeyError(k)
            by_part.setdefault(int(head[4:]), {})[rest] = v
        if sorted(by_part) != list(range(len(by_part))) or not by_part:
            raise KeyError("part0")
        states = [QuantState.from_dict(by_part[i], device=device) for i in range(len(by_part))]
        for st in states:
            if len(st.shape) != 2 or st.shape[1] != in_features:
                raise ValueError(f"a part of shape {tuple(st.shape)}")
        rows = [st.shape[0] for st in states]
        return cls(list(zip(rows, states)), torch.Size((sum(rows), in_features)), states[0].dtype)


def _state_of(module: nn.Module):
    """A 4-bit layer's QuantState (or PartsQuantState): on its weight, or kept on the module (FSDP's plain weight)."""
    return getattr(module.weight, "quant_state", None) or getattr(module, "quant_state", None)


def has_parts(module: nn.Module) -> bool:
    """Whether `module` is a 4-bit layer quantized part by part (`PartsQuantState`)."""
    return isinstance(_state_of(module), PartsQuantState) or bool(getattr(module, "part_rows", None))


def dequantize_packed(packed: torch.Tensor, state, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The flat dequantized values of `packed` (its bytes, any shape) under `state` (a QuantState or PartsQuantState),
    each part as the flat blocks it was quantized in, in `dtype` (default: the state's)."""
    F = load_bnb().functional
    data = packed.reshape(-1)
    if data.dtype != torch.uint8:
        data = data.view(torch.uint8)
    parts = state.parts if isinstance(state, PartsQuantState) else [(state.shape[0], state)]
    cols = state.shape[1] if len(state.shape) > 1 else 1
    out, byte = [], 0
    for rows, part in parts:
        n = rows * cols if isinstance(state, PartsQuantState) else state.shape.numel()
        part = copy.copy(part)
        part.shape = torch.Size([n])
        if dtype is not None:
            part.dtype = dtype
        out.append(F.dequantize_4bit(data[byte:byte + (n + 1) // 2], part).reshape(-1))
        byte += (n + 1) // 2
    return out[0] if len(out) == 1 else torch.cat(out)


def needs_flat_dequantize(in_features: int) -> bool:
    """Whether bitsandbytes' CPU 4-bit kernels get this layer wrong. The blocks of 64 values run over the flattened
    weight, but bitsandbytes 0.50's CPU dequantization of a 2-D weight (its forward and backward) takes them per row
    when in_features is a multiple of 16 but not of 64 (e.g. 96, 160, 1376): the results are off by several times
    the quantization error (tests/test_quantize.py). Such layers dequantize the flattened weight instead."""
    return in_features % 64 != 0 and in_features % 16 == 0


def dequantize_flat(module: nn.Module, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A 4-bit layer's weight [out, in] dequantized as the flat blocks it was quantized in (always right), in `dtype`
    (default: its compute dtype). fp32 comes straight from the 4-bit codes, not through a 16-bit rounding."""
    bnb = load_bnb()
    bnb.nn.modules.fix_4bit_weight_quant_state_from_module(module)  # FSDP's gathered weight comes without it
    # (stored as another dtype for FSDP, prepare_4bit_for_sharding: the same bytes)
    flat = dequantize_packed(module.weight.data, module.weight.quant_state, dtype)
    return flat.reshape(module.out_features, module.in_features)


class _DequantMatmul(torch.autograd.Function):
    """x @ W^T + b with W dequantized flat (`dequantize_flat`) into `dtype`, again in backward, as bitsandbytes' own
    4-bit matmul does: nothing of the dense weight, and nothing of x, is kept between forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        ctx.layer, ctx.dtype = layer, dtype
        bias = layer.bias.to(dtype) if layer.bias is not None else None
        return nn.functional.linear(x.to(dtype), dequantize_flat(layer, dtype), bias).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad.to(ctx.dtype) @ dequantize_flat(ctx.layer, ctx.dtype)).to(grad.dtype), None, None


def parts_matmul(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A part-by-part quantized layer's forward (`PartsQuantState`): its weight dequantized part by part into the
    compute dtype (fp32 for a 16-bit input where the CPU has no native 16-bit matmul), one matmul, as bitsandbytes'
    own 4-bit matmul computes a layer."""
    dtype = module.compute_dtype or x.dtype
    if x.device.type == "cpu" and cpu_half.in_fp32(x.to(dtype), module.out_features):
        dtype = torch.float32
    return _DequantMatmul.apply(x, module, dtype)


@functools.lru_cache(maxsize=None)
def _cpu_linear4bit() -> type:
    """`bitsandbytes.nn.Linear4bit` with our CPU forward (made on first use: bitsandbytes is imported lazily). On
    CUDA bitsandbytes' own forward is kept."""
    bnb = load_bnb()

    class CPULinear4bit(bnb.nn.Linear4bit):
        """On CPU, two cases take our matmul (`_DequantMatmul`) instead of bitsandbytes': a 16-bit input where the
        CPU has no native 16-bit matmul (computed by the fp32 kernel, kernels/cpu_half.py), and the widths whose
        rows bitsandbytes' CPU kernels get wrong (`needs_flat_dequantize`)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if has_parts(self):  # bitsandbytes' matmul knows one state: our matmul, on any device
                return parts_matmul(self, x)
            if x.device.type != "cpu":
                return super().forward(x)
            if cpu_half.in_fp32(x, self.out_features):
                return _DequantMatmul.apply(x, self, torch.float32)
            if needs_flat_dequantize(self.in_features):
                return _DequantMatmul.apply(x, self, x.dtype)
            return super().forward(x)

    return CPULinear4bit


def is_quantized(module: nn.Module) -> bool:
    bnb = load_bnb() if _bnb_loaded() else None
    return bnb is not None and isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))


def _bnb_loaded() -> bool:
    return "bitsandbytes" in sys.modules


def quantize_into(module: nn.Module, weight: torch.Tensor | FileTensor, device: torch.device,
                  dtype: Optional[torch.dtype] = None) -> None:
    """Quantize the full-precision `weight`, as converted to `dtype` (the compute dtype; default: its own), into the
    (meta) bitsandbytes `module` on `device`. On CPU the conversion happens a chunk at a time: a bf16 checkpoint
    loaded at 32-true never has a whole fp32 copy of a large layer (the same bits as converting first), and a
    FileTensor is read from the file a chunk at a time, so not even a whole 16-bit copy exists."""
    bnb = load_bnb()
    if device.type == "cpu":
        _quantize_into_cpu(bnb, module, weight, dtype or weight.dtype)
        return
    weight = as_tensor(weight).to(dtype or weight.dtype)
    if isinstance(module, bnb.nn.Linear8bitLt):
        # Int8Params quantizes row-wise (absmax per output row) when moved to a real device
        p = bnb.nn.Int8Params(weight.to(torch.float16 if device.type == "cuda" else weight.dtype), requires_grad=False,
                              has_fp16_weights=False)
        module.weight = p.to(device)
    elif has_parts(module):
        packed, state = quantize_4bit_tensor(module, weight, device)
        set_4bit_weight(module, packed, state)
    else:
        p = bnb.nn.Params4bit(weight, requires_grad=False, quant_type=module.weight.quant_type,
                              compress_statistics=module.weight.compress_statistics, blocksize=module.weight.blocksize,
                              quant_storage=module.weight.quant_storage, module=module)
        module.weight = p.to(device)


# bitsandbytes' CPU quantizers are plain torch code that makes fp32/int32 copies of the whole weight: about 16 bytes
# per parameter at once (24 for fp4), which for a large output layer alone broke the loader's memory budget.
# On CPU we therefore quantize CPU_QUANTIZE_CHUNK elements at a time into preallocated outputs. 4-bit blocks and
# int8 rows never straddle a chunk, and the double quantization of the block scales runs once over all of them, so the
# result is bit-identical. 128K elements per chunk: ~2.5 MB of temporaries (a 4-bit generation's peak RSS is its load's
# peak when they are larger: 1M elements added 17 MB to 0.32 GB), and as fast as 256K or 1M elements (8192 x 4096
# bf16 to nf4: 0.41-0.43 s each; 64K elements: 0.48 s).
CPU_QUANTIZE_CHUNK = 1 << 17
def _quantize_into_cpu(bnb, module: nn.Module, weight: torch.Tensor, dtype: torch.dtype) -> None:
    F = bnb.functional
    if isinstance(module, bnb.nn.Linear8bitLt):
        cols = weight.shape[1]
        rows, read = max(1, CPU_QUANTIZE_CHUNK // cols), _flat_reader(weight)
        cb = torch.empty(weight.shape, dtype=torch.int8)
        scb = torch.empty(weight.shape[0], dtype=torch.float32)
        for r in range(0, weight.shape[0], rows):  # what Int8Params does (on fp16), a few rows at a time
            rows_fp16 = read(r * cols, rows * cols).view(-1, cols).to(dtype).to(torch.float16)
            cb[r:r + rows], scb[r:r + rows], _ = F.int8_vectorwise_quant(rows_fp16)
        set_int8_weight(module, cb, scb)
        release_freed_memory()  # quantizing leaves freed buffers in heap holes
        return
    packed, state = _quantize_4bit_cpu(F, weight, four_bit_settings(module), dtype)
    set_4bit_weight(module, packed, state)
    release_freed_memory()  # quantizing leaves freed buffers in heap holes


def set_int8_weight(module: nn.Module, cb: torch.Tensor, scb: torch.Tensor) -> None:
    """Give the (meta) Linear8bitLt `module` its quantized weight: int8 rows `cb` and their fp32 scales `scb`."""
    module.weight = load_bnb().nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)


def set_4bit_weight(module: nn.Module, packed: torch.Tensor, state) -> None:
    """Give the (meta) Linear4bit `module` its quantized weight: the `packed` bytes and their QuantState, with the
    settings its meta Params4bit carries."""
    w = module.weight
    module.weight = load_bnb().nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=w.blocksize,
                                             compress_statistics=w.compress_statistics, quant_type=w.quant_type,
                                             quant_storage=w.quant_storage, module=module, bnb_quantized=True)
    module.quant_state = state


def _flat_reader(weight: torch.Tensor | FileTensor) -> Callable[[int, int], torch.Tensor]:
    """(start, count) -> that range of `weight`'s flattened elements: a slice of a tensor, or read from the file."""
    if isinstance(weight, FileTensor):
        return weight.read
    flat = weight.contiguous().reshape(-1)
    return lambda start, count: flat[start:start + count]


def _quantize_4bit_cpu(F, weight: torch.Tensor, settings: dict,
                       dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, object]:
    """(packed weight [n/2 bytes, 1] in settings' quant_storage, QuantState) of a full-precision CPU `weight`
    converted to `dtype` (default: its own), in chunks (see CPU_QUANTIZE_CHUNK). With settings' `parts` (rows of each
    stacked HF tensor) each part is quantized on its own: the packed bytes follow each other, the state is a
    PartsQuantState."""
    dtype = dtype or weight.dtype
    if settings.get("parts"):
        return _quantize_parts(weight, settings, lambda part, s: _quantize_4bit_cpu(F, part, s, dtype), dtype)
    read = _flat_reader(weight)
    n, bs, quant_type = weight.numel(), settings["blocksize"], settings["quant_type"]
    step = max(1, CPU_QUANTIZE_CHUNK // bs) * bs
    packed = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8)
    absmax = torch.empty(-(n // -bs), dtype=torch.float32)
    for start in range(0, n, step):
        q, state = F.quantize_4bit(read(start, step).to(dtype), blocksize=bs, compress_statistics=False,
                                   quant_type=quant_type, quant_storage=torch.uint8)
        packed[start // 2:start // 2 + q.shape[0]] = q
        absmax[start // bs:start // bs + state.absmax.numel()] = state.absmax
        del q
    if settings["quant_storage"] != torch.uint8:
        packed = packed.view(-1).view(settings["quant_storage"]).unsqueeze(1)
    kw = dict(shape=weight.shape, dtype=dtype, blocksize=bs, code=state.code, quant_type=quant_type)
    if settings["compress_statistics"]:  # as bitsandbytes.functional.quantize_4bit does it
        offset = absmax.mean()
        qabsmax, state2 = F.quantize_blockwise(absmax - offset, blocksize=256)
        return packed, F.QuantState(absmax=qabsmax, offset=offset, state2=state2, **kw)
    return packed, F.QuantState(absmax=absmax, **kw)


def _rows(weight: torch.Tensor | FileTensor, r0: int, n: int) -> torch.Tensor | FileTensor:
    """Rows r0:r0+n of a weight [out, in]: a view of a tensor, or that range of the file."""
    if isinstance(weight, FileTensor):
        cols = weight.shape[1]
        return FileTensor(weight.path, weight.offset + r0 * cols * weight.itemsize, (n, cols), weight.dtype)
    return weight[r0:r0 + n]


def _quantize_parts(weight: torch.Tensor | FileTensor, settings: dict, quantize_one: Callable,
                    dtype: torch.dtype) -> tuple[torch.Tensor, PartsQuantState]:
    """(packed bytes of every part in turn, PartsQuantState) of `weight`, each part of settings' `parts` rows
    quantized by `quantize_one(rows, settings without parts)`."""
    one = {**settings, "parts": None}
    packed, states, r0 = [], [], 0
    for n in settings["parts"]:
        p, state = quantize_one(_rows(weight, r0, n), one)
        packed.append(p.reshape(-1).view(torch.uint8))
        states.append((n, state))
        r0 += n
    if r0 != weight.shape[0]:
        raise ValueError(f"parts {settings['parts']} do not add up to {weight.shape[0]} rows")
    data = torch.cat(packed)
    if settings["quant_storage"] != torch.uint8:
        data = data.view(settings["quant_storage"])
    return data.unsqueeze(1), PartsQuantState(states, torch.Size(weight.shape), dtype)


def four_bit_settings(module: nn.Module) -> dict:
    """How a bitsandbytes 4-bit layer quantizes: read from its (meta) Params4bit, or kept on the module once the
    weight became a plain sharded parameter (`prepare_4bit_for_sharding`)."""
    kept = getattr(module, "four_bit_settings", None)
    if kept is not None:
        return kept
    w = module.weight
    return dict(blocksize=w.blocksize, quant_type=w.quant_type, compress_statistics=w.compress_statistics,
                quant_storage=w.quant_storage, parts=getattr(module, "part_rows", None))


def quantize_4bit_tensor(module: nn.Module, weight: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, object]:
    """(packed weight, QuantState) of the full-precision `weight` for the 4-bit layer `module`, on `device`, without
    touching the layer: what the sharded loader keeps a shard of. Bit-identical to what `quantize_into` stores."""
    F = load_bnb().functional
    settings = four_bit_settings(module)
    if device.type == "cpu":
        packed, state = _quantize_4bit_cpu(F, weight, settings)
        release_freed_memory()
        return packed, state
    def on_device(w: torch.Tensor, s: dict) -> tuple[torch.Tensor, object]:
        return F.quantize_4bit(as_tensor(w).to(device), blocksize=s["blocksize"],
                               compress_statistics=s["compress_statistics"], quant_type=s["quant_type"],
                               quant_storage=s["quant_storage"])
    if settings.get("parts"):
        return _quantize_parts(weight, settings, on_device, weight.dtype)
    return on_device(weight, settings)


def prepare_4bit_for_sharding(model: nn.Module, storage: torch.dtype = torch.uint8) -> int:
    """Before FSDP shards a model built on meta: every 4-bit layer's weight becomes a plain meta parameter of its
    packed shape ([n/2 bytes, 1] viewed as `storage`), the shape FSDP shards along dim 0, and the layer keeps its
    quantization settings (FSDP replaces the Params4bit by a plain parameter). The QuantState (block scales) stays
    whole on every rank as `module.quant_state`, from which bitsandbytes' forward rebuilds the Params4bit around the
    gathered bytes. Returns the number of layers prepared."""
    bnb = load_bnb()
    n = 0
    if any(isinstance(m, QuantizedExpertWeights) for m in model.modules()):
        raise UserError("sharding a quantized mixture of experts (FSDP) is not implemented; use one device, or "
                        "--strategy ddp")
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear8bitLt):
            raise UserError("--quantize bnb.int8 cannot be sharded (its row scales live on the weight object, which "
                            "FSDP replaces); use --quantize bnb.nf4-dq or --strategy ddp")
        if not isinstance(m, bnb.nn.Linear4bit):
            continue
        m.four_bit_settings = {**four_bit_settings(m), "quant_storage": storage}
        n_bytes = (m.in_features * m.out_features + 1) // 2
        size = torch.empty((), dtype=storage).element_size()
        if n_bytes % size:
            raise ValueError(f"{n_bytes} packed bytes do not fill whole {storage} elements")
        m.weight = nn.Parameter(torch.empty((n_bytes // size, 1), dtype=storage, device="meta"), requires_grad=False)
        m.quant_state = None
        n += 1
    return n


def swap_linears(model: nn.Module, mode: QuantMode, compute_dtype: torch.dtype,
                 quantize_lm_head: bool = False) -> list[str]:
    """Replace the frozen base Linear layers of `model` (on meta) by empty bitsandbytes layers. Returns their names.

    The output layer only with `quantize_lm_head` (`--quantize_lm_head true`). A tied head stays shared with the
    dense embedding (a 4-bit head would be a second copy of it, and raised the starting loss of a real tied
    49k-vocabulary model by 4.5%). An untied head stays dense too: every training step dequantizes a 4-bit head
    whole, in forward and again in backward, into a temporary as large as the dense head, so quantizing it saves
    nothing at the peak and costs time (16k x 1024 head: peak 2.04 against 2.02 GB, steps 10% slower;
    tutorials/performance.md). Generation may still ask for it: decoding reads the packed head without that
    temporary and is faster with it."""
    swapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is ExpertWeights:  # (a mixture's router stays dense: a plain Linear, skipped below)
                setattr(module, child_name, QuantizedExpertWeights(child, mode, compute_dtype))
                swapped.append(full)
                continue
            if child_name == "router" or full.endswith(".router.base"):  # (a LoRA on the router keeps it dense too)
                continue
            if type(child) is not nn.Linear or isinstance(module, LoRALinear) and child_name != "base":
                continue
            if not quantize_lm_head and full.split(".")[0] == "lm_head":
                continue
            layer = full.removesuffix(".base")  # (a LoRA layer wraps its base)
            parts = quantized_parts(model.config, layer) if hasattr(model, "config") else None
            setattr(module, child_name, make_quantized_linear(child, mode, compute_dtype, parts))
            swapped.append(full)
    return swapped


class QuantizedExpertWeights(nn.Module):
    """`ExpertWeights` under --quantize: one bitsandbytes layer per expert (`layers[e]`), each expert's [out, in]
    quantized exactly as bitsandbytes quantizes a Linear weight of that shape. An expert runs its own layer's
    forward (its 4-bit matmul dequantizes that expert alone), so the experts that receive no tokens in a step are
    never dequantized. `quantize_experts` fills it from the stacked [E, out, in] tensor, one expert at a time."""

    def __init__(self, dense: ExpertWeights, mode: QuantMode, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.n_expert, self.out_features, self.in_features = dense.n_expert, dense.out_features, dense.in_features
        shape = nn.Linear(dense.in_features, dense.out_features, bias=False, device="meta")
        self.layers = nn.ModuleList(make_quantized_linear(shape, mode, compute_dtype) for _ in range(dense.n_expert))
        self.bias = dense.bias  # [E, out] or None: stays dense, as a quantized Linear's bias does

    def forward(self, x: torch.Tensor, e: int, bias: bool = True) -> torch.Tensor:
        """Expert e's x @ W^T (+ its bias unless `bias` is False)."""
        layer = self.layers[e]
        bnb = load_bnb()
        if (not (torch.is_grad_enabled() and x.requires_grad) or x.device.type != "cpu" or x.dim() != 2
                or not isinstance(layer, bnb.nn.Linear4bit) or torch.is_autocast_enabled("cpu")
                or x.dtype != layer.compute_dtype):
            # no gradient (generation: the 4-bit decode kernel), int8, CUDA, autocast: the layer
            y = layer(x)
        else:
            dtype = torch.float32 if cpu_half.in_fp32(x, layer.out_features) else x.dtype
            y = _ExpertMatmul.apply(x, layer, dtype)
        return y if self.bias is None or not bias else y + self.bias[e].to(y.dtype)

    # each expert's layer in turn, as the dense form does (generation's DecodeExpertWeights: one kernel call)
    many, many_with = ExpertWeights.many, ExpertWeights.many_with


def dequantize_4bit_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A 4-bit layer's weight [out, in] in `dtype` by bitsandbytes' dequantization: of the 2-D weight where its rows are
    whole blocks (bitsandbytes' CPU kernel shares the rows between threads), of the flat blocks otherwise (see
    `needs_flat_dequantize`)."""
    if module.in_features % module.weight.quant_state.blocksize:
        return dequantize_flat(module, dtype)
    state = copy.copy(module.weight.quant_state)
    state.dtype = dtype
    return load_bnb().functional.dequantize_4bit(module.weight.data, state)


class _ExpertMatmul(torch.autograd.Function):
    """x @ W^T for one expert's 4-bit layer on CPU, W dequantized into `dtype` in forward and again in backward (what
    bitsandbytes' 4-bit matmul computes, and keeps: nothing). The product is allocated before W is dequantized, and W
    freed right after the product, so W is the newest block of the heap when it is freed and the next expert's W takes
    its place. (With bitsandbytes' matmul, which allocates its output after W, the outputs that stay alive between
    the freed weights of a layer's 64 experts left holes: peak RSS grew step after step, +25% after 4 steps on
    scripts/bench/bench_moe.py's shape.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        ctx.layer, ctx.dtype = layer, dtype
        out = torch.empty(x.size(0), layer.out_features, dtype=dtype)
        torch.mm(x.to(dtype), dequantize_4bit_weight(layer, dtype).t(), out=out)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty(grad.size(0), ctx.layer.in_features, dtype=ctx.dtype)
        torch.mm(grad.to(ctx.dtype), dequantize_4bit_weight(ctx.layer, ctx.dtype), out=out)
        return out.to(grad.dtype), None, None


def quantize_experts(module: QuantizedExpertWeights, weight: torch.Tensor | FileTensor, device: torch.device,
                     dtype: Optional[torch.dtype] = None, stored: Optional[Callable[[int], bool]] = None) -> None:
    """Quantize the stacked [E, out, in] `weight` into `module`'s per-expert layers (`quantize_into` each), reading a
    FileTensor one expert at a time. `stored(e)`: fills expert e from a stored quantization, False if it has none."""
    E, out_f, in_f = weight.shape
    for e, layer in enumerate(module.layers):
        if stored is not None and stored(e):
            continue
        if isinstance(weight, FileTensor):
            part = FileTensor(weight.path, weight.offset + e * out_f * in_f * weight.itemsize, (out_f, in_f),
                              weight.dtype)
        elif isinstance(weight, Mxfp4Tensor):  # gpt-oss's stored experts: this expert dequantized (exact in bf16)
            part = weight.expert(e)
        else:
            part = weight[e]
        quantize_into(layer, part, device, dtype)


class TiedEmbedding4bit(nn.Module):
    """A tied model's input embedding read from its 4-bit output layer, for generation: the rows of the tokens asked
    for are dequantized when asked for (bitsandbytes' own dequantization of those blocks), so no dense copy of the
    vocabulary x hidden matrix stays in memory (113 MB in fp32 for 49152 x 576). The values are the 4-bit head's,
    the same rounding the output layer already has. Needs whole blocks per row (`fits`); the head must keep
    bitsandbytes' plain layout (`enable_cpu_inference_packing` leaves it alone)."""

    def __init__(self, head: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self._head = [head]  # not a submodule: the head stays where it is, once
        self.num_embeddings, self.embedding_dim, self.dtype = head.out_features, head.in_features, dtype
        self.blocks_per_row = self.embedding_dim // head.weight.quant_state.blocksize
        head.feeds_embedding = True

    def row_scales(self, idx: torch.Tensor) -> torch.Tensor:
        """The fp32 block scales of the rows `idx`, [..., C/blocksize]. With double quantization the head keeps
        them 8-bit: only the asked-for rows' scales are undone (code2[q] * absmax2 + offset, bitsandbytes'
        arithmetic), so no fp32 copy of every row's scales is kept (1.7 MB for SmolLM2's 49152 x 576 head)."""
        state = self._head[0].weight.quant_state
        if not state.nested:
            return nn.functional.embedding(idx, state.absmax.view(self.num_embeddings, -1)).float()
        blocks = idx[..., None] * self.blocks_per_row + torch.arange(self.blocks_per_row, device=idx.device)
        inner = state.state2
        return inner.code[state.absmax[blocks].long()] * inner.absmax[blocks // inner.blocksize] + state.offset

    @staticmethod
    def fits(head: nn.Module) -> bool:
        bnb = load_bnb()
        return isinstance(head, bnb.nn.Linear4bit) and head.in_features % head.weight.blocksize == 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        bnb = load_bnb()
        head = self._head[0]
        state = head.weight.quant_state
        packed = head.weight.data.view(torch.uint8).view(self.num_embeddings, self.embedding_dim // 2)
        rows = nn.functional.embedding(idx, packed)  # [..., C/2] packed bytes of the asked-for rows
        scales = self.row_scales(idx)  # [..., C/blocksize]
        rows_state = bnb.functional.QuantState(absmax=scales.reshape(-1), shape=torch.Size((*idx.shape,
                                                                                             self.embedding_dim)),
                                               code=state.code, blocksize=state.blocksize,
                                               quant_type=state.quant_type, dtype=self.dtype)
        return bnb.functional.dequantize_4bit(rows.reshape(-1, 1), rows_state)


class StoredEmbedding(nn.Module):
    """An untied input embedding kept in its checkpoint's 16-bit dtype while the model computes in fp32, for
    generation with 4-bit layers: a lookup converts only the rows asked for. A bf16 or fp16 value is exact in fp32,
    so the rows equal an fp32 embedding's, at half its memory (49 against 98 MB for 32000 x 768)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.dtype = dtype

    @staticmethod
    def fits(weight: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether storing `weight` as it is loses nothing against converting it to `dtype`."""
        return weight.dtype in (torch.bfloat16, torch.float16) and dtype == torch.float32

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(idx, self.weight).to(self.dtype)


class FileEmbedding(nn.Module):
    """An untied input embedding read from the checkpoint file, a row per distinct token looked up, for generation
    with 4-bit layers on CPU: no copy of the table is held (49 MB for 32000 x 768 in bf16, 1 GB for Llama 3 8B's
    128256 x 4096), and a decoding step reads one row (1.5-8 KB, a few microseconds). The rows are converted to the
    compute dtype: the values of converting the whole table first. The file stays open, so a checkpoint converted
    again meanwhile (written as a new file) does not change a running model.

    A file read, not a memory map: a mapped page stays in the resident set once touched, and the kernel maps the
    page cache in large folios (measured: ~160 KB resident per random row of a 49 MB table)."""

    def __init__(self, source: FileTensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.source, self.dtype = source, dtype
        self.num_embeddings, self.embedding_dim = source.shape
        self.file_bytes = source.numel() * source.itemsize  # what memory_report shows
        self._file = open(source.path, "rb", buffering=0)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        ids, where = torch.unique(idx, return_inverse=True)
        if len(ids) and (ids[0] < 0 or ids[-1] >= self.num_embeddings):
            raise IndexError(f"token id out of range 0..{self.num_embeddings - 1} for the embedding")
        rows = self.source.read_rows(self._file, ids.tolist()).to(self.dtype)
        return nn.functional.embedding(where, rows)


def enable_cpu_inference_packing(model: nn.Module, enable: bool) -> int:
    """Let (or forbid) bitsandbytes repack 4-bit weights into its fast CPU inference layout.

    Packing makes batch-1 CPU decoding faster, but a packed layer has no backward: use it only for models
    that will not be trained again. It also needs in_features % 64 == 0. Returns the number of layers enabled.
    """
    bnb = load_bnb()
    from bitsandbytes.functional import has_avx512bf16

    n = 0
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            # (a head that also serves the embedding rows must keep the layout TiedEmbedding4bit reads)
            # (bitsandbytes' repacking knows one QuantState per layer: a layer quantized part by part keeps its own)
            ok = (enable and has_avx512bf16() and m.in_features % 64 == 0 and not getattr(m, "feeds_embedding", False)
                  and not has_parts(m))
            m.support_avx512bf16_for_cpu = ok
            n += ok
    return n


def validation_mode(model: nn.Module) -> None:
    """`model.eval()` for validation during training, except that bitsandbytes int8 layers on CPU keep their
    training matmul (dequantize, then a bf16/fp32 matmul) instead of LLM.int8 inference.

    Why: in eval mode an int8 layer quantizes its input and multiplies int8 by int8 into an int32 product that it
    rescales in two fp32 steps: for the head that is three fp32-sized copies of the logits at once, and it set the
    peak memory of int8 runs on CPU (bench_estimator.py). The training matmul also makes the validation loss the
    loss of the function being trained. Dropout and everything else are in eval mode as usual."""
    model.eval()
    if not _bnb_loaded():
        return
    bnb = load_bnb()
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear8bitLt) and m.weight.device.type == "cpu":
            m.training = True  # read by Linear8bitLt.forward only to pick the matmul (state.is_training)


def repacked_4bit_layers(model: nn.Module) -> list[str]:
    """The names of the 4-bit layers bitsandbytes repacked into its CPU inference layout."""
    bnb = load_bnb() if _bnb_loaded() else None
    if bnb is None:
        return []
    names = []
    for name, m in model.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            state = getattr(m.weight, "quant_state", None) or m.quant_state  # sharded: the plain weight has none
            if getattr(state, "packing_format_for_cpu", False):
                names.append(name)
    return names


def assert_trainable_4bit(model: nn.Module) -> None:
    """Fail loudly if any 4-bit layer was repacked for inference: gradients would silently stop there."""
    repacked = repacked_4bit_layers(model)
    if repacked:
        raise RuntimeError(f"{repacked[0]} was repacked for CPU inference and can no longer pass gradients; "
                           "keep support_avx512bf16_for_cpu=False on layers that train")


# ---- memory report ----------------------------------------------------------------------------
def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def memory_report(model: nn.Module) -> dict:
    """Bytes of quantized weights (with their quantization statistics), bits per quantized parameter,
    bytes of dense weights and trainable parameter count, measured from the tensors themselves. The figures are of the
    whole model, also when FSDP shards it; `rank_bytes` is what this process holds: its shards plus the block scales
    of the 4-bit layers, which every rank keeps whole."""
    q_bytes, q_params, dense_bytes, trainable, rank_bytes = 0, 0, 0, 0, 0
    file_bytes = sum(getattr(m, "file_bytes", 0) for m in model.modules())  # read from the checkpoint as used
    seen: set[int] = set()
    bnb = load_bnb() if _bnb_loaded() else None
    for m in model.modules():
        quantized = bnb is not None and isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))
        for pname, p in m._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            if p.requires_grad:
                trainable += p.numel()
            local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor: FSDP's shard of this rank
            rank_bytes += _tensor_bytes(local)
            if quantized and pname == "weight":
                stats = _quant_state_bytes(p, m)
                q_bytes += _tensor_bytes(p) + stats
                rank_bytes += stats
                q_params += m.in_features * m.out_features
            else:
                dense_bytes += _tensor_bytes(p)
        for b in m._buffers.values():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                dense_bytes += _tensor_bytes(b)
                rank_bytes += _tensor_bytes(b)
    return dict(quantized_bytes=q_bytes, quantized_params=q_params,
                bits_per_quantized_param=(8 * q_bytes / q_params) if q_params else 0.0,
                dense_bytes=dense_bytes, trainable_params=trainable, rank_bytes=rank_bytes, file_bytes=file_bytes)


def _quant_state_bytes(p: torch.Tensor, module: nn.Module) -> int:
    qs = getattr(p, "quant_state", None) or getattr(module, "quant_state", None)
    if isinstance(qs, PartsQuantState):
        return sum(_state_bytes(state) for _, state in qs.parts)
    return _state_bytes(qs) if qs is not None else _int8_scale_bytes(p, module)


def _state_bytes(qs) -> int:
    """4-bit: absmax per block (+ its own quantization state when nested) and the code table. bitsandbytes gives
    every layer (every part of a PartsQuantState) its own copy of the code tables (16 + 256 fp32): they count each."""
    n = _tensor_bytes(qs.absmax) + _tensor_bytes(qs.code)
    if qs.nested:
        n += _tensor_bytes(qs.state2.absmax) + _tensor_bytes(qs.state2.code) + _tensor_bytes(qs.offset)
    return n


def _int8_scale_bytes(p: torch.Tensor, module: nn.Module) -> int:
    # int8: one fp32 scale per row. The first forward moves it from the weight to `module.state.SCB`.
    scb = getattr(p, "SCB", None)
    if scb is None:
        scb = getattr(getattr(module, "state", None), "SCB", None)
    return _tensor_bytes(scb) if scb is not None else 0


def format_memory_report(r: dict) -> str:
    """The "Loaded" line's memory part; a model with nothing quantized says only what it holds."""
    quantized = (f"Quantized weights: {r['quantized_bytes'] / 2**20:.1f} MiB for {r['quantized_params'] / 1e6:.1f}M "
                 f"params ({r['bits_per_quantized_param']:.2f} bits/param) | " if r["quantized_params"] else "")
    return (f"{quantized}{'dense weights' if quantized else 'Weights'}: {r['dense_bytes'] / 2**20:.1f} MiB | "
            f"trainable params: {r['trainable_params']:,}"
            + (f" | embedding: {r['file_bytes'] / 2**20:.1f} MiB left in the checkpoint (rows read as used)"
               if r.get("file_bytes") else "")
            + (f" | this rank holds {r['rank_bytes'] / 2**20:.1f} MiB of them (sharded)"
               if r.get("rank_bytes", 0) < r["quantized_bytes"] + r["dense_bytes"] else ""))


def quiet_bnb_import():
    """bitsandbytes (`load_bnb`, whose import is quiet), its later warnings silenced too (noise for our users)."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    return load_bnb()


def dequantize_weight(module: nn.Module) -> torch.Tensor:
    """The full-precision weight a bitsandbytes layer computes with: [out, in]."""
    bnb = load_bnb()
    if isinstance(module, bnb.nn.Linear8bitLt):
        w = module.weight
        scb = w.SCB if getattr(w, "SCB", None) is not None else module.state.SCB
        cb = w.data if w.data.dtype == torch.int8 else module.state.CB
        return cb.float() * scb.float()[:, None] / 127.0
    if needs_flat_dequantize(module.in_features) or has_parts(module):
        return dequantize_flat(module)
    return bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
