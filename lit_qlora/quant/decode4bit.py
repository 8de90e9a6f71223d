"""Fast batch-1 decoding with bitsandbytes 4-bit weights on any CPU: a small C kernel (`decode4bit.c`) that
multiplies straight from the packed nf4/fp4 bytes, compiled on first use and called through ctypes.

Why: decoding one token reads every weight once, so its speed is the speed of reading the weights. Without
AVX512-BF16, bitsandbytes dequantizes each whole 4-bit weight to a dense tensor for every token (reading 0.5
byte per weight, writing and reading back 2-4 more), which made 4-bit decoding 3-6x slower than dense. The kernel
reads the 0.5 byte (plus the block scales) and nothing else.

Only models loaded for generation use it (`lit_qlora.inference.load_for_inference` calls `enable_fast_decode`
through `fast_cpu_4bit_decoding`): their `Linear4bit` layers become `DecodeLinear4bit`, a subclass whose forward
runs the kernel for up to `MAX_KERNEL_ROWS` activation rows (decoding) and dequantize + dense matmul otherwise
(prefill: faster for many rows), with bitsandbytes' own dequantization, a few million weights at a time. Whenever
a gradient is needed it takes bitsandbytes' own forward, so a converted layer never silently stops gradients;
training code never converts layers anyway. An unmerged LoRA layer over such a layer becomes `DecodeLoRALinear`:
its decoding steps add the update inside the same kernel call (`q4_linear_lora`). A mixture's experts of one
projection become `DecodeExpertWeights`: a decoding step runs the active experts' gate and up projections in one
kernel call and their down projection in another (`q4_linear_many`), not a call per expert and projection.

The compiled library is cached per source hash, compiler, flags and CPU flags under
`$LIT_QLORA_CACHE` (default `$XDG_CACHE_HOME/lit_qlora` or `~/.cache/lit_qlora`). Without a working C compiler
(gcc, clang or `$CC`) generation falls back to today's path with one note on stderr. `LIT_QLORA_DECODE_KERNEL=0`
turns the kernel off (bitsandbytes' path everywhere, including its packed layout on AVX512-BF16 CPUs).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit_qlora.kernels import cpu_half
from lit_qlora.lora import LoRALinear
from lit_qlora.quant.quant_mode import QuantMode
from lit_qlora.quant.quantize import PartsQuantState, QuantizedExpertWeights, has_parts, quiet_bnb_import

bnb = quiet_bnb_import()

SOURCE = Path(__file__).with_name("decode4bit.c")
# Up to this many activation rows per call go through the kernel, more (prefill) through dequantize + one matmul.
# The kernel decodes each weight row once per 8 activation rows and runs at ~80% of the CPU's peak multiply rate
# from 8 rows on (AVX512-BF16 EPYC, one thread: 46 GMAC/s in bf16 against 59 for a loop of nothing but vdpbf16ps,
# 24 of 30 in fp32); at 32 rows it still beats dequantize + matmul in bf16 (690 against ~900 us for 576 x 1536) and
# is within 25% of it in fp32. A prompt's rows go to the kernel up to MAX_KERNEL_ROWS (as before the batched engine);
# the engine's decoding steps, one token per sequence, up to MAX_DECODE_ROWS sequences (each row computed as it
# would be alone: tutorials/batched_generation.md).
MAX_KERNEL_ROWS = 16
MAX_DECODE_ROWS = 32
# Layers with fewer weights than this run on one thread: waking a second one costs more than it saves (a few us
# on an idle machine, up to milliseconds when another process holds the other core).
PARALLEL_MIN_WEIGHTS = 1 << 17
# The dense path (prefill) dequantizes this many weights at a time: 16 MB of fp32 at most.
DENSE_CHUNK_WEIGHTS = 1 << 22
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # what the C kernel reads and writes natively
# Builds the tests compile besides the native one (the C file picks its code path from the compiler's macros).
VARIANTS = {"native": [], "avx512": ["-mno-avx512bf16"], "avx2": ["-mno-avx512f"], "portable": ["-DQ4_PORTABLE"]}


class _Layer(ctypes.Structure):
    """The C struct `q4_layer`, field for field."""

    _fields_ = [("w", ctypes.c_void_p), ("absmax", ctypes.c_void_p), ("absmax_q", ctypes.c_void_p),
                ("absmax2", ctypes.c_void_p), ("code2", ctypes.c_void_p), ("code", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("blocksize", ctypes.c_int64), ("blocksize2", ctypes.c_int64), ("offset", ctypes.c_float)]


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Where compiled kernels are kept: $LIT_QLORA_CACHE, else $XDG_CACHE_HOME/lit_qlora, else ~/.cache/lit_qlora."""
    root = os.environ.get("LIT_QLORA_CACHE")
    if root:
        return Path(root) / "decode4bit"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lit_qlora" / "decode4bit"


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), or a description of the machine elsewhere: -march=native binaries are only
    valid on a CPU with the same features, so they are part of the cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _compilers() -> list[str]:
    names = [os.environ["CC"]] if os.environ.get("CC") else []
    names += ["cc", "gcc", "clang"]
    found = []
    for name in names:
        path = shutil.which(name)
        if path and path not in found:
            found.append(path)
    return found


def _compiler_id(cc: str) -> str:
    try:
        r = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return r.stdout.splitlines()[0] if r.stdout else cc
    except (OSError, subprocess.SubprocessError):
        return cc


# Tried in order. OpenMP shares the rows of a layer between torch's threads; where the compiler has no OpenMP
# (Apple clang) the kernel runs on one thread; where -march=native is refused it runs without CPU-specific code.
_ATTEMPTS = (["-march=native", "-fopenmp"], ["-march=native"], [])
_BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-std=c11", "-ffp-contract=off"]


def _build(variant: str) -> tuple[Optional[Path], str]:
    """Compile (or find in the cache) the kernel library; (path or None, why not)."""
    source = SOURCE.read_bytes()
    compilers = _compilers()
    if not compilers:
        return None, "no C compiler found (looked for $CC, cc, gcc, clang)"
    errors = []
    for cc in compilers:
        cc_id = _compiler_id(cc)
        for extra in _ATTEMPTS:
            flags = _BASE_FLAGS + extra + VARIANTS[variant]
            key = hashlib.sha256("\0".join([source.hex(), cc, cc_id, " ".join(flags), _cpu_flags()]).encode())
            target = cache_dir() / f"decode4bit-{key.hexdigest()[:20]}.so"
            if target.is_file():
                return target, ""
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp_dir = target.parent
            except OSError:  # an unwritable cache: build into a temporary folder for this process only
                tmp_dir = Path(tempfile.mkdtemp(prefix="lit_qlora-decode4bit-"))
                target = tmp_dir / target.name
            tmp = tmp_dir / f".{target.name}.{os.getpid()}.tmp"
            try:
                r = subprocess.run([cc, *flags, "-o", str(tmp), str(SOURCE), "-lm"], capture_output=True,
                                   text=True, timeout=120)
            except (OSError, subprocess.SubprocessError) as e:
                errors.append(f"{cc}: {e}")
                continue
            if r.returncode == 0:
                os.replace(tmp, target)  # atomic: processes compiling at the same time never see half a file
                return target, ""
            errors.append(f"{cc} {' '.join(extra)}: {(r.stderr.strip().splitlines() or ['failed'])[-1]}")
            tmp.unlink(missing_ok=True)
    return None, "compiling the kernel failed (" + "; ".join(errors[:3]) + ")"


@functools.lru_cache(maxsize=None)
def kernel(variant: str = "native") -> Optional[ctypes.CDLL]:
    """The compiled kernel library, or None (with one note on stderr) when it cannot be built or is turned off."""
    if os.environ.get("LIT_QLORA_DECODE_KERNEL", "1") == "0":
        return None
    path, why = _build(variant)
    lib = None
    if path is not None:
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            why = f"loading {path} failed ({e})"
    if lib is None:
        _say(f"Note: {why}; 4-bit layers decode through bitsandbytes' dequantize-then-multiply path, which is "
             "several times slower on CPU. Install gcc or clang for the fast path.")
        return None
    lib.q4_linear.argtypes = [ctypes.POINTER(_Layer), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                              ctypes.c_int, ctypes.c_int]
    lib.q4_linear.restype = ctypes.c_int
    lib.q4_linear_lora.argtypes = lib.q4_linear.argtypes + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                            ctypes.c_void_p, ctypes.c_int64]
    lib.q4_linear_lora.restype = ctypes.c_int
    lib.q4_linear_segments.argtypes = lib.q4_linear.argtypes + [ctypes.c_int64] + [ctypes.c_void_p] * 5 + [
        ctypes.c_int64]
    lib.q4_linear_segments.restype = ctypes.c_int
    lib.q4_linear_many.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.q4_linear_many.restype = ctypes.c_int
    lib.q4_decode_attention.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 + [
        ctypes.c_float, ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.q4_decode_attention.restype = ctypes.c_int
    lib.q4_isa.restype = lib.q4_bf16dot.restype = ctypes.c_int
    return lib


def isa_name(lib: ctypes.CDLL) -> str:
    """Which code path a compiled library runs: 'avx512', 'avx2' or 'portable', with '+bf16' where bf16
    activations are multiplied by AVX512-BF16 dot products (`bf16_dot`)."""
    return {512: "avx512", 2: "avx2"}.get(lib.q4_isa(), "portable") + ("+bf16" if bf16_dot(lib) else "")


def bf16_dot(lib: ctypes.CDLL) -> bool:
    """Whether the library multiplies bf16 activations by bf16 weights with AVX512-BF16 (layers of whole 64-weight
    blocks per row): bitsandbytes' weights rounded to bf16 (as a dense bf16 model of them holds them), products
    summed in fp32. Otherwise, and always for fp32 activations, the weights are bitsandbytes' fp32 values."""
    return bool(lib.q4_bf16dot())


def parts(module: nn.Module) -> list[tuple[int, int, torch.Tensor, object]]:
    """(first row, rows, packed bytes, bitsandbytes QuantState) of each separately quantized part of a 4-bit layer:
    the whole layer, or each HF tensor of a layer quantized part by part (`quantize.PartsQuantState`: our fused qkv),
    whose packed bytes follow each other."""
    w = module.weight
    data, state = w.data.reshape(-1).view(torch.uint8), w.quant_state
    if not isinstance(state, PartsQuantState):
        return [(0, module.out_features, data, state)]
    out, r0, byte = [], 0, 0
    for rows, part in state.parts:
        n = (rows * module.in_features + 1) // 2
        out.append((r0, rows, data[byte:byte + n], part))
        r0, byte = r0 + rows, byte + n
    return out


def supports(module: nn.Module) -> bool:
    """Whether the kernel can run `module`: a bitsandbytes 4-bit layer on CPU whose rows start on a byte boundary
    (even in_features), in bitsandbytes' standard layout (not repacked for its AVX512-BF16 kernel)."""
    if not isinstance(module, bnb.nn.Linear4bit):
        return False
    w = module.weight
    if getattr(w, "quant_state", None) is None or w.device.type != "cpu" or module.in_features % 2:
        return False
    return all(not getattr(qs, "packing_format_for_cpu", False) and QuantMode.of_quant_state(qs) is not None
               and (not qs.nested or qs.state2.absmax.dtype == torch.float32) for _, _, _, qs in parts(module))


class _Part:
    """What the kernel reads for one separately quantized part of a layer (`parts`): the ctypes struct and the
    tensors its pointers point into (kept alive here)."""

    def __init__(self, r0: int, rows: int, packed: torch.Tensor, qs, k: int, bias: Optional[torch.Tensor]) -> None:
        self.r0, self.rows, self.w = r0, rows, packed
        self.code = qs.code.detach().float().contiguous()
        self.bias = bias[r0:r0 + rows] if bias is not None else None
        self.weights = rows * k
        layer = _Layer(w=packed.data_ptr(), code=self.code.data_ptr(), n=rows, k=k, blocksize=qs.blocksize,
                       bias=self.bias.data_ptr() if self.bias is not None else None)
        if qs.nested:  # decoded per block inside the kernel, exactly as bitsandbytes does (no fp32 copy kept)
            self.absmax_q = qs.absmax.contiguous()
            self.absmax2 = qs.state2.absmax.float().contiguous()
            self.code2 = qs.state2.code.float().contiguous()
            layer.absmax_q, layer.absmax2 = self.absmax_q.data_ptr(), self.absmax2.data_ptr()
            layer.code2, layer.blocksize2 = self.code2.data_ptr(), qs.state2.blocksize
            layer.offset = float(qs.offset)
        else:
            self.absmax = qs.absmax.float().contiguous()
            layer.absmax = self.absmax.data_ptr()
        self.layer = layer
        self.ref = ctypes.byref(layer)
        self.addr = ctypes.addressof(layer)


class _State:
    """What the kernel reads for one layer (a `_Part` per separately quantized part), and the parameters it was
    made from, so that it is rebuilt when they are replaced."""

    def __init__(self, module: "DecodeLinear4bit", lib: ctypes.CDLL) -> None:
        w = module.weight
        self.lib = lib
        self.param, self.qs, self.bias_param = w, w.quant_state, module._parameters.get("bias")
        bias = module.bias.detach().float().contiguous() if module.bias is not None else None
        self.parts = [_Part(r0, rows, packed, qs, module.in_features, bias) for r0, rows, packed, qs in parts(module)]

    def current(self, module: nn.Module) -> bool:
        """Whether `module` still holds the tensors this state points into. Identity checks, because anything that
        asks a bitsandbytes Params4bit for its storage goes through torch's subclass dispatch (~4 us per call, a
        millisecond per token). Loading (quantize_into) and bitsandbytes' repacking replace these objects."""
        params = module._parameters
        return (params["weight"] is self.param and self.param.quant_state is self.qs
                and params.get("bias") is self.bias_param)


def _run_part(lib: ctypes.CDLL, part: _Part, x: torch.Tensor, y: torch.Tensor, rows: int,
              lora: Optional[tuple[torch.Tensor, torch.Tensor]], rowscale: Optional[torch.Tensor] = None,
              segments: Optional["Segments"] = None) -> None:
    threads = 1 if part.weights * min(rows, 4) < PARALLEL_MIN_WEIGHTS else torch.get_num_threads()
    args = (part.ref, x.data_ptr(), y.data_ptr(), rows, _DTYPE_CODES[x.dtype], threads)
    if segments is not None:
        failed = lib.q4_linear_segments(*args, *segments.arrays(part.r0, part.rows))
    elif lora is None:
        failed = lib.q4_linear(*args)
    else:  # this part's columns of B^T, and its rows' factors
        A, Bt = lora
        failed = lib.q4_linear_lora(*args, A.data_ptr(), Bt.data_ptr() + part.r0 * 4, A.size(0),
                                    rowscale.data_ptr() + part.r0 * 4 if rowscale is not None else None, Bt.size(1))
    if failed:
        raise MemoryError("the 4-bit decode kernel could not allocate its activation buffer")


class Segments:
    """Rows of several LoRA adapters for one kernel call (`q4_linear_segments`): run i of the rows, up to ends[i],
    adds the update of loras[i] = (A [r, in], (scaling * B)^T [r, out], DoRA's factor g [out] or None: what
    `LoRALinear._decode_weights` gives), all fp32 and contiguous, or None for rows of the base alone."""

    def __init__(self, ends: list[int], loras: list[Optional[tuple]]) -> None:
        self.loras, n = loras, len(ends)
        self.ends = (ctypes.c_int64 * n)(*ends)
        self.r = (ctypes.c_int64 * n)(*(lora[0].size(0) if lora else 0 for lora in loras))
        self.A = (ctypes.c_void_p * n)(*(lora[0].data_ptr() if lora else None for lora in loras))
        self.ldb = next((lora[1].size(1) for lora in loras if lora), 0)
        self._B: dict[int, ctypes.Array] = {}

    def arrays(self, r0: int, rows: int) -> tuple:
        """What the kernel reads for the output rows r0 .. r0+rows-1 of the layer (a part quantized on its own): each
        adapter's columns of B^T and its factors from r0 on."""
        if r0 not in self._B:
            B = [lora[1].data_ptr() + r0 * 4 if lora else None for lora in self.loras]
            g = [lora[2].data_ptr() + r0 * 4 if lora and lora[2] is not None else None for lora in self.loras]
            self._B[r0] = ((ctypes.c_void_p * len(B))(*B), (ctypes.c_void_p * len(g))(*g))
        B, g = self._B[r0]
        return len(self.loras), self.ends, self.A, B, self.r, g, self.ldb


def run_kernel(lib: ctypes.CDLL, state: _State, x: torch.Tensor, out_features: int,
               lora: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
               rowscale: Optional[torch.Tensor] = None, segments: Optional[Segments] = None) -> torch.Tensor:
    """x [..., in] (fp32 or bf16, any number of rows) @ W^T (+ bias) through the kernel, in x's dtype. With `lora`
    (A [r, in] and B^T [r, out], fp32 and contiguous, the scaling in B) the update (x @ A^T) @ B^T is added before
    the one rounding to x's dtype; with `rowscale` too (DoRA's factor g [out], fp32 and contiguous) the output is
    g * (x @ W^T + update) (+ bias). A layer quantized part by part runs a kernel call per part (B^T's columns and
    g's rows of that part). `segments`: rows of several adapters instead (see `Segments`)."""
    x = x.contiguous()
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if len(state.parts) == 1 or not rows:
        y = x.new_empty((*x.shape[:-1], out_features))
        if rows:
            _run_part(lib, state.parts[0], x, y, rows, lora, rowscale, segments)
        return y
    outs = []
    for part in state.parts:
        y = x.new_empty((*x.shape[:-1], part.rows))
        _run_part(lib, part, x, y, rows, lora, rowscale, segments)
        outs.append(y)
    return torch.cat(outs, dim=-1)


def run_kernel_many(lib: ctypes.CDLL, projections: list[list[_State]], x: torch.Tensor,
                    sizes: list[int]) -> list[torch.Tensor]:
    """One kernel call (`q4_linear_many`) for several layers on groups of the rows of x [sum(sizes), in] (fp32 or
    bf16, contiguous): for each projection (a list of layer states, each quantized whole, with the same out_features)
    the output [sum(sizes), out] whose i-th group of sizes[i] rows is layer i of it on the i-th group of x. The same
    bits as `run_kernel` per layer: the kernel computes every output row with the same code."""
    count = len(projections) * len(sizes)
    Ls, xs, ys = (ctypes.c_void_p * count)(), (ctypes.c_void_p * count)(), (ctypes.c_void_p * count)()
    Ms = (ctypes.c_int64 * count)(*sizes * len(projections))
    outs, i, work = [], 0, 0
    x_ptr, x_row = x.data_ptr(), x.shape[-1] * x.element_size()
    for states in projections:
        part0 = states[0].parts[0]
        y = x.new_empty((x.shape[0], part0.rows))
        y_ptr, y_row, row = y.data_ptr(), part0.rows * y.element_size(), 0
        for state, m in zip(states, sizes):
            part = state.parts[0]
            Ls[i], xs[i], ys[i] = part.addr, x_ptr + row * x_row, y_ptr + row * y_row
            work += part.weights * min(m, 4)
            row, i = row + m, i + 1
        outs.append(y)
    threads = 1 if work < PARALLEL_MIN_WEIGHTS else torch.get_num_threads()
    if lib.q4_linear_many(Ls, xs, ys, Ms, count, _DTYPE_CODES[x.dtype], threads):
        raise MemoryError("the 4-bit decode kernel could not allocate its activation buffers")
    return outs


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                     starts: torch.Tensor, ends: torch.Tensor, scale: float, softcap: Optional[float] = None,
                     sinks: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """One decoding step's attention straight from the batched engine's paged keys and values (`q4_decode_attention`
    in the C file): q [B, H, 1, hs] (fp32 or bf16, the pools' dtype), pools [slots, G, hs], slots [B, L] (int64: the
    slot of each position of each row), row b attending to positions starts[b] .. ends[b]-1. Returns [B, H, 1, hs],
    or None where the kernel cannot take it (no compiler, another dtype or device)."""
    lib = kernel()
    if (lib is None or q.device.type != "cpu" or q.dtype not in _DTYPE_CODES or k_pool.dtype != q.dtype
            or v_pool.dtype != q.dtype):
        return None
    B, H, _, hs = q.shape
    q = q.contiguous()
    y = torch.empty_like(q)
    sinks = sinks.detach().float().contiguous() if sinks is not None else None
    threads = 1 if B * slots.size(1) * H * hs < PARALLEL_MIN_WEIGHTS else torch.get_num_threads()
    if lib.q4_decode_attention(q.data_ptr(), y.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), slots.data_ptr(),
                               starts.data_ptr(), ends.data_ptr(), B, slots.size(1), H, k_pool.size(1), hs, scale,
                               softcap or 0.0, sinks.data_ptr() if sinks is not None else None,
                               _DTYPE_CODES[q.dtype], threads):
        raise MemoryError("the decode attention kernel could not allocate its buffers")
    return y


def _scales(qs) -> torch.Tensor:
    """The fp32 scale of every block of one QuantState: its absmax, or bitsandbytes' decoding of the double-quantized
    one (dequantize_blockwise, then the offset), as bitsandbytes' own matmul computes it."""
    if not qs.nested:
        return qs.absmax.float()
    return bnb.functional.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset


def block_scales(module: nn.Module) -> torch.Tensor:
    """The fp32 scale of every block of a 4-bit layer quantized whole (see `_scales`)."""
    return _scales(module.weight.quant_state)


def dequantize_rows(packed: torch.Tensor, qs, k: int, r0: int, r1: int, dtype: torch.dtype,
                    scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows r0:r1 of a 4-bit weight of `k` columns quantized whole (`packed` bytes, QuantState `qs`: one of `parts`),
    dequantized by bitsandbytes' own op. r0 * k must fall on a block boundary. Where blocks straddle rows the rows
    are dequantized as one flat run, the quantizer's layout: bitsandbytes 0.50's CPU dequantize_4bit of a 2-D shape
    assumes blocks never cross a row, which is wrong when k % blocksize != 0 (e.g. 96 or 1376); with whole-block
    rows the 2-D shape lets it use its threads."""
    bs = qs.blocksize
    e0, e1 = r0 * k, r1 * k
    scales = _scales(qs) if scales is None else scales
    shape = (r1 - r0, k) if k % bs == 0 else (e1 - e0,)
    blocks = scales[e0 // bs:-(-e1 // bs)].contiguous()
    w = torch.ops.bitsandbytes.dequantize_4bit(packed[e0 // 2:(e1 + 1) // 2], blocks, bs, qs.quant_type, shape, dtype)
    return w.view(r1 - r0, k)


def dequantized_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x @ W^T (+ bias) by dequantizing W and one dense matmul, as bitsandbytes' Linear4bit does (compute dtype,
    then back to x's dtype), but DENSE_CHUNK_WEIGHTS weights at a time (within each part of a layer quantized part
    by part): a whole 49152 x 576 output layer would be a 113 MB fp32 temporary in every prefill (and was slower,
    tutorials/quantize.md)."""
    k, n = module.in_features, module.out_features
    dtype = module.compute_dtype or x.dtype
    xin = x.to(dtype)
    if cpu_half.in_fp32(xin, n):  # a 16-bit prefill on a CPU without native 16-bit matmuls
        dtype, xin = torch.float32, xin.float()
    bias = module.bias.to(dtype) if module.bias is not None else None
    layer_parts = parts(module)
    if len(layer_parts) == 1:
        _, _, packed, qs = layer_parts[0]
        bs = qs.blocksize
        align = bs // math.gcd(k, bs)  # chunks start on block boundaries
        if max(align, DENSE_CHUNK_WEIGHTS // max(k, 1) // align * align) >= n:
            return F.linear(xin, dequantize_rows(packed, qs, k, 0, n, dtype), bias).to(x.dtype)
    y = xin.new_empty((*x.shape[:-1], n))
    for p0, rows, packed, qs in layer_parts:
        bs = qs.blocksize
        align = bs // math.gcd(k, bs)
        step = max(align, DENSE_CHUNK_WEIGHTS // max(k, 1) // align * align)
        scales = _scales(qs)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            y[..., p0 + r0:p0 + r1] = F.linear(xin, dequantize_rows(packed, qs, k, r0, r1, dtype, scales),
                                               bias[p0 + r0:p0 + r1] if bias is not None else None)
    return y.to(x.dtype)


def kernel_rows(x: torch.Tensor) -> int:
    """How many rows of x [..., T, in] the kernel takes: MAX_DECODE_ROWS for a decoding step (one token per row),
    MAX_KERNEL_ROWS otherwise."""
    return MAX_DECODE_ROWS if x.dim() >= 3 and x.size(-2) == 1 else MAX_KERNEL_ROWS


class DecodeLinear4bit(bnb.nn.Linear4bit):
    """A `bitsandbytes.nn.Linear4bit` for generation on CPU: the same stored weights (so every tool that reads
    them still works), with decoding through the kernel. Made by `enable_fast_decode`, never constructed."""

    _q4: Optional[_State] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel_forward(x)
        return self._dense_forward(x) if y is None else y

    def kernel_forward(self, x: torch.Tensor, lora: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                       rowscale: Optional[torch.Tensor] = None,
                       segments: Optional[Segments] = None) -> Optional[torch.Tensor]:
        """The layer's output (plus a LoRA update, see `run_kernel`) through the kernel, or None where the kernel
        does not take x (more than MAX_KERNEL_ROWS rows, a gradient to compute, not on CPU, ...)."""
        lib = kernel()
        rows = x.numel() // self.in_features if self.in_features else 0
        if (lib is None or x.device.type != "cpu" or rows > kernel_rows(x)
                or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)
                or torch.is_grad_enabled() and (x.requires_grad or self.bias is not None and self.bias.requires_grad)):
            return None
        if self._q4 is None or not self._q4.current(self):
            if not supports(self):  # its weight was replaced by something the kernel cannot read
                return None
            self._q4 = _State(self, lib)
        if x.dtype == torch.float16:  # the kernel reads fp32 and bf16; fp16 on CPU is rare (16-true)
            return run_kernel(lib, self._q4, x.float(), self.out_features, lora, rowscale,
                              segments).to(torch.float16)
        return run_kernel(lib, self._q4, x, self.out_features, lora, rowscale, segments)

    def _dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Prefill and anything else the kernel does not take: dequantize, then a dense matmul. With a gradient to
        compute, bitsandbytes' own forward (its autograd function), except where its CPU dequantization is wrong
        (blocks straddling rows, see dequantize_rows); without, the same computation in bounded chunks."""
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.bias is not None and self.bias.requires_grad)
        whole_blocks = self.in_features % self.weight.quant_state.blocksize == 0 and not has_parts(self)
        if x.device.type != "cpu" or not supports(self) or needs_grad and whole_blocks:
            return super().forward(x)
        return dequantized_linear(self, x)


class DecodeLoRALinear(LoRALinear):
    """A `LoRALinear` over a `DecodeLinear4bit` base, for generation: a decoding step (eval, nothing to
    differentiate, no autocast, up to MAX_KERNEL_ROWS rows) runs the base layer and the LoRA update in one kernel
    call, in fp32 with one rounding (DoRA: the sum scaled by each row's factor inside the same call); everything
    else is LoRALinear's own forward. Made by `enable_fast_decode`, never constructed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (type(self.base) is DecodeLinear4bit and not self.training and not torch.is_grad_enabled()
                and not torch.is_autocast_enabled("cpu")):
            A, Bt, g = self._decode_weights()
            y = self.base.kernel_forward(x, (A, Bt), g)
            if y is not None:
                return y
        return super().forward(x)


class DecodeExpertWeights(QuantizedExpertWeights):
    """A `QuantizedExpertWeights` whose experts are `DecodeLinear4bit` layers, for generation: a decoding step (no
    gradient, at most MAX_KERNEL_ROWS rows per expert, fp32 or bf16 on CPU) runs the active experts of the projection,
    and of the up projection too when asked for the gate's (`many_with`), in one kernel call (`run_kernel_many`)
    instead of one call (and its Python) per expert; the same bits as per expert. Anything else goes per expert, as
    `QuantizedExpertWeights` does. Made by `enable_fast_decode`, never constructed."""

    def many(self, x: torch.Tensor, experts: list[int], sizes: list[int], bias: bool = True) -> torch.Tensor:
        states = self._states(x, experts, sizes)
        if states is None:
            return super().many(x, experts, sizes, bias)
        y, = run_kernel_many(kernel(), [states], x.contiguous(), sizes)
        return self._add_bias(y, experts, sizes) if bias else y

    def many_with(self, other: nn.Module, x: torch.Tensor, experts: list[int],
                  sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        mine = self._states(x, experts, sizes)
        theirs = other._states(x, experts, sizes) if mine is not None and type(other) is DecodeExpertWeights else None
        if theirs is None:
            return super().many_with(other, x, experts, sizes)
        a, b = run_kernel_many(kernel(), [mine, theirs], x.contiguous(), sizes)
        return self._add_bias(a, experts, sizes), other._add_bias(b, experts, sizes)

    def _states(self, x: torch.Tensor, experts: list[int], sizes: list[int]) -> Optional[list[_State]]:
        """The kernel states of `experts`' layers when the kernel takes x in one call, else None."""
        lib = kernel()
        if (lib is None or not sizes or x.device.type != "cpu" or x.dtype not in _DTYPE_CODES
                or max(sizes) > MAX_KERNEL_ROWS or torch.is_grad_enabled() and x.requires_grad):
            return None
        states, layers = [], list(self.layers._modules.values())  # (ModuleList's indexing costs ~1 us an expert)
        for e in experts:
            layer = layers[e]
            if type(layer) is not DecodeLinear4bit:
                return None
            if layer._q4 is None or not layer._q4.current(layer):
                if not supports(layer):
                    return None
                layer._q4 = _State(layer, lib)
            if len(layer._q4.parts) != 1:
                return None
            states.append(layer._q4)
        return states

    def _add_bias(self, y: torch.Tensor, experts: list[int], sizes: list[int]) -> torch.Tensor:
        """Each group's expert bias (gpt-oss), added as `QuantizedExpertWeights.forward` adds it."""
        if self.bias is None:
            return y
        rows = torch.tensor(experts).repeat_interleave(torch.tensor(sizes))
        return y + self.bias[rows].to(y.dtype)


def enable_fast_decode(model: nn.Module) -> int:
    """Switch every 4-bit layer of `model` that the kernel supports to it (for models that will not be trained);
    returns how many. 0 when the kernel is unavailable: the model then keeps bitsandbytes' path."""
    # plain Linear4bit, or our flat-dequantizing subclass of it (quantize.needs_flat_dequantize): the kernel reads
    # the flat blocks in either case
    layers = [m for m in model.modules()
              if isinstance(m, bnb.nn.Linear4bit) and not isinstance(m, DecodeLinear4bit) and supports(m)]
    if not layers or kernel() is None:
        return 0
    for m in layers:
        m._class_before_decode = type(m)
        m.__class__ = DecodeLinear4bit  # same storage and attributes: a subclass adds only the forward
        # bitsandbytes' AVX512-BF16 repacking would rewrite the weight into a layout the kernel cannot read
        m.support_avx512bf16_for_cpu = False
    for m in model.modules():  # unmerged adapters over those layers: base and update in one call
        if type(m) is LoRALinear and type(m.base) is DecodeLinear4bit:
            m.__class__ = DecodeLoRALinear
        # a mixture's experts of one projection, all on the kernel: the active ones in one call per decoding step
        if type(m) is QuantizedExpertWeights and all(type(e) is DecodeLinear4bit for e in m.layers):
            m.__class__ = DecodeExpertWeights
    return len(layers)


def disable_fast_decode(model: nn.Module) -> int:
    """Undo `enable_fast_decode`: back to the layers' classes before it. Returns how many were switched back."""
    n = 0
    for m in model.modules():
        if type(m) is DecodeLoRALinear:
            m.__class__ = LoRALinear
        if type(m) is DecodeExpertWeights:
            m.__class__ = QuantizedExpertWeights
        if type(m) is DecodeLinear4bit:
            m.__class__ = m.__dict__.pop("_class_before_decode", bnb.nn.Linear4bit)
            m.__dict__.pop("_q4", None)
            n += 1
    return n
