"""The 4-bit decode kernel (lit_qlora/quant/decode4bit.c + decode4bit.py) against bitsandbytes' own dequantization.

What is shown here:
1. the kernel reproduces bitsandbytes' fp32 dequantized weights bit for bit (one-hot activations), for nf4, nf4-dq,
   fp4, fp4-dq, in every build (AVX512, AVX2, portable C), including blocks that straddle rows and odd out_features;
2. layer outputs equal x @ W^T (W: bitsandbytes' dequantization, fp32) within a stated tolerance, batch 1 and
   batch > 1, fp32 and bf16 activations, with and without bias; prefill-sized inputs take the dense path;
3. anything that needs a gradient takes bitsandbytes' path (gradients flow as before), and training code never
   gets the kernel;
4. greedy tokens through the generation path equal those of a dense model built from bitsandbytes' dequantized
   weights, for nf4, nf4-dq and fp4 on every family the generation tests cover (32-true; at bf16-true the logits
   stay as close to that model as a dense bf16 model's do); int8 is left alone and stays within its tolerance;
5. generate/base.py samples (--num_samples) on the kernel, and greedy text is the same with it and without it;
6. without a C compiler generation falls back to bitsandbytes' path with one note; compiled kernels are cached;
7. an unmerged LoRA layer over a 4-bit base decodes in one kernel call (base product and update, one rounding):
   against float64 in every build, dispatched only where LoRALinear's own path would be a decoding step, and in a
   model the same greedy tokens as separate ops at fp32, logits at least as close to fp32 at bf16.

Reference: `bitsandbytes.functional.dequantize_4bit` of the flattened weight. bitsandbytes quantizes the flattened
[out, in] weight in blocks of 64; its CPU dequantization of the 2-D shape assumes blocks never cross a row, which
is wrong when in_features % 64 == 32 (0.50.2), so the reference dequantizes the 1-D tensor, the quantizer's layout
(test_flat_reference_is_the_right_one checks it against the original weights).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import bnb_dequantized, hf_model

from lit_qlora.quant.quantize import TiedEmbedding4bit, make_quantized_linear, quantize_into, quiet_bnb_import

quiet_bnb_import()
import bitsandbytes as bnb  # noqa: E402

from lit_qlora.quant import decode4bit as d  # noqa: E402

CPU = torch.device("cpu")
MODES_4BIT = ("bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq")
# (out, in): whole blocks; odd out_features; in % 64 == 32 (blocks straddle rows, bitsandbytes' 2-D CPU dequantize
# is wrong there); in % 64 == 36 (straddling, and segments that are not whole 16-byte vectors); a tiny odd one
SHAPES = [(96, 192), (33, 128), (64, 96), (7, 100), (5, 34)]
NO_COMPILER = "no C compiler ($CC, cc, gcc or clang) could build lit_qlora/quant/decode4bit.c"


def _cpu_has(*flags: str) -> bool:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return False
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return all(f in line.split() for f in flags)


def _variant_params():
    """Each kernel build that this machine can run, with the reason when it cannot."""
    reasons = {"native": None, "avx512": None if _cpu_has("avx512f") else "this CPU has no AVX512F",
               "avx2": None if _cpu_has("avx2", "fma") else "this CPU has no AVX2+FMA", "portable": None}
    return [pytest.param(v, marks=pytest.mark.skipif(r is not None, reason=r or "")) for v, r in reasons.items()]


HAVE_KERNEL = d.kernel() is not None
needs_kernel = pytest.mark.skipif(not HAVE_KERNEL, reason=NO_COMPILER)


@pytest.fixture(scope="module", autouse=True)
def few_threads():
    """2 threads: enough to run the kernel's OpenMP loop in parallel, without oversubscribing a shared CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(min(n, 2))
    yield
    torch.set_num_threads(n)


def lib_for(variant: str):
    lib = d.kernel(variant)
    if lib is None:
        pytest.skip(NO_COMPILER)
    return lib


def quantized_layer(mode: str, out_f: int, in_f: int, dtype: torch.dtype = torch.float32, bias: bool = False,
                    seed: int = 0) -> nn.Module:
    """Our 4-bit layer (the loader's way) of a random weight, plus a random bias if asked."""
    g = torch.Generator().manual_seed(seed)
    w = (0.02 * torch.randn(out_f, in_f, generator=g)).to(dtype)
    q = make_quantized_linear(nn.Linear(in_f, out_f, bias=bias, device="meta"), mode, dtype)
    quantize_into(q, w, CPU)
    if bias:
        q.bias = nn.Parameter((0.1 * torch.randn(out_f, generator=g)).to(dtype), requires_grad=False)
    return q.eval()


def bnb_weight(layer: nn.Module) -> torch.Tensor:
    """bitsandbytes' own fp32 dequantization of the layer's weight, over the flattened tensor (see the docstring),
    part by part where it was quantized part by part (a fused qkv)."""
    return bnb_dequantized(layer)


def reference(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x @ W^T (+ bias) in float64 from bitsandbytes' fp32 weights and the activations as given."""
    y = x.double() @ bnb_weight(layer).double().T
    return y + layer.bias.double() if layer.bias is not None else y


def bf16_weights(lib, layer: nn.Module, dtype: torch.dtype) -> bool:
    """Whether the kernel multiplies this layer's bf16 activations by bf16 weights (`decode4bit.bf16_dot`)."""
    qs = layer.weight.quant_state
    return dtype == torch.bfloat16 and d.bf16_dot(lib) and qs.blocksize == 64 and layer.in_features % 64 == 0


def assert_close_to_reference(y: torch.Tensor, layer: nn.Module, x: torch.Tensor, lib=None, lora=None,
                              rowscale=None) -> None:
    """Tolerance: fp32 accumulation error, 1e-5 x sum|x_k w_k| per output (an fp32 sum of up to 192 products stays
    well inside it), plus, for bf16 outputs, the bf16 rounding of the result (2^-8 relative), and where the kernel
    multiplies by bf16 weights (`bf16_weights`), their rounding (2^-8 relative each: 2^-8 x sum|x_k w_k|). With
    `lora` (A, B) the reference adds (x @ A^T) @ B^T and the fp32 error allowed grows by 1e-5 x its |.| sums; with
    `rowscale` g (DoRA) it is g * (x @ W^T + update) + bias, every error but the final rounding scaled by |g|."""
    ref = reference(layer, x)
    bias = layer.bias.double() if layer.bias is not None else torch.zeros(ref.shape[-1], dtype=torch.float64)
    scale = x.double().abs() @ bnb_weight(layer).double().abs().T
    tol = 1e-5 * scale + 1e-7
    if lora is not None:
        A, B = (t.double() for t in lora)
        ref = ref + (x.double() @ A.T) @ B.T
        tol = tol + 1e-5 * ((x.double().abs() @ A.abs().T) @ B.abs().T)
    if lib is not None and bf16_weights(lib, layer, y.dtype):
        tol = tol + scale * 2.0**-8
    if rowscale is not None:
        g = rowscale.double()
        ref, tol = (ref - bias) * g + bias, tol * g.abs() + 1e-7
    if y.dtype == torch.bfloat16:
        tol = tol + ref.abs() * 2.0**-8
    err = (y.double() - ref).abs()
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert (err <= tol).all(), f"max error {float(err.max()):.3g}, worst ratio {float((err / tol).max()):.3g}"


# ---- 1. the exact weights ------------------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("variant", _variant_params())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mode", MODES_4BIT)
def test_kernel_reproduces_bnb_weights_bit_for_bit(mode, shape, variant):
    """Row k of I @ W^T is column k of W: one product per output, so the kernel's fp32 weights show exactly; also
    one activation row at a time (the decoding loop, four weight rows at once on AVX512)."""
    lib = lib_for(variant)
    layer = quantized_layer(mode, *shape)
    state = d._State(layer, lib)
    got = d.run_kernel(lib, state, torch.eye(shape[1]), shape[0]).T
    want = bnb_weight(layer)
    assert torch.equal(got, want)
    for j in range(0, shape[1], 5):
        assert torch.equal(d.run_kernel(lib, state, torch.eye(shape[1])[j:j + 1], shape[0])[0], want[:, j]), j


def test_flat_reference_is_the_right_one():
    """The flattened dequantization is the quantizer's layout: it lies within nf4's rounding of the original weights
    (measured 0.09 relative L2 error, as in test_quantize), for blocks that straddle rows too."""
    g = torch.Generator().manual_seed(3)
    for out_f, in_f in [(64, 96), (33, 128)]:
        w = 0.02 * torch.randn(out_f, in_f, generator=g)
        layer = make_quantized_linear(nn.Linear(in_f, out_f, bias=False, device="meta"), "bnb.nf4", torch.float32)
        quantize_into(layer, w, CPU)
        assert float((bnb_weight(layer) - w).norm() / w.norm()) < 0.11


# ---- 2. layer outputs ------------------------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("variant", _variant_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mode", MODES_4BIT)
def test_kernel_output_matches_bnb_dequantized_matmul(mode, shape, rows, dtype, variant):
    lib = lib_for(variant)
    layer = quantized_layer(mode, *shape, dtype=dtype, bias=shape[0] % 2 == 1)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
    y = d.run_kernel(lib, d._State(layer, lib), x, shape[0])
    assert_close_to_reference(y, layer, x, lib)


@needs_kernel
@pytest.mark.parametrize("shape", [(96, 192), (33, 128), (8, 320)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mode", MODES_4BIT)
def test_bf16_dot_weights_are_bf16_codes_times_the_block_scale(mode, shape):
    """With AVX512-BF16 and bf16 activations the kernel's weight is bf16(code[nibble]) * absmax: the bf16 identity
    shows each, rounded to bf16, bit for bit (one product per output), for whole 128-weight chunks and a lone last
    block (192 = 128 + 64), through the many-row loop and the one-row (decoding) loop. Elsewhere it is bitsandbytes'
    fp32 weight, rounded to bf16 by the output."""
    lib = lib_for("native")
    layer = quantized_layer(mode, *shape, dtype=torch.bfloat16)
    got = d.run_kernel(lib, d._State(layer, lib), torch.eye(shape[1]).to(torch.bfloat16), shape[0]).T
    if not d.bf16_dot(lib):
        assert torch.equal(got, bnb_weight(layer).to(torch.bfloat16))
        pytest.skip("this CPU or compiler has no AVX512-BF16 path; checked the fp32 weights instead")
    qs = layer.weight.quant_state
    packed = layer.weight.data.reshape(-1).view(torch.uint8)
    nibbles = torch.stack([packed >> 4, packed & 15], dim=-1).reshape(-1).long()
    codes = qs.code.float().to(torch.bfloat16).float()[nibbles]
    scales = d.block_scales(layer).float().repeat_interleave(64)
    want = (codes * scales).view(shape).to(torch.bfloat16)
    assert torch.equal(got, want)
    state = d._State(layer, lib)  # one activation row at a time: the decoding loop (four weight rows at once)
    for j in range(0, shape[1], 5):
        one = torch.zeros(1, shape[1], dtype=torch.bfloat16)
        one[0, j] = 1
        assert torch.equal(d.run_kernel(lib, state, one, shape[0])[0], want[:, j]), j
    assert not torch.equal(got, bnb_weight(layer).to(torch.bfloat16))  # the test tells the two apart


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("mode", MODES_4BIT)
def test_converted_layer_dispatch(monkeypatch, mode, dtype):
    """Through the module: up to MAX_KERNEL_ROWS rows on the kernel, more on the dense path, both right; a decoding
    step of the batched engine (one token per row) up to MAX_DECODE_ROWS rows on the kernel; [B, T, in] inputs keep
    their leading dimensions."""
    calls = []
    monkeypatch.setattr(d, "run_kernel", lambda *a, _f=d.run_kernel: calls.append(a[2].shape) or _f(*a))
    for shape in [(96, 192), (64, 96)]:
        layer = quantized_layer(mode, *shape, dtype=dtype, bias=True)
        assert d.enable_fast_decode(layer) == 1 and type(layer) is d.DecodeLinear4bit
        for b, t in [(1, 1), (2, 3), (1, d.MAX_KERNEL_ROWS), (1, d.MAX_KERNEL_ROWS + 1), (2, 40),
                     (d.MAX_DECODE_ROWS, 1), (d.MAX_DECODE_ROWS + 1, 1)]:
            calls.clear()
            x = torch.randn(b, t, shape[1], generator=torch.Generator().manual_seed(t)).to(dtype)
            with torch.inference_mode():
                y = layer(x)
            assert y.shape == (b, t, shape[0]) and y.dtype == dtype
            on_kernel = b * t <= (d.MAX_DECODE_ROWS if t == 1 else d.MAX_KERNEL_ROWS)
            assert len(calls) == on_kernel, (b, t)
            if on_kernel and dtype != torch.float16:
                assert_close_to_reference(y.reshape(-1, shape[0]), layer, x.reshape(-1, shape[1]), d.kernel())
                continue
            ref = reference(layer, x.reshape(-1, shape[1])).view(b, t, -1)
            if on_kernel:  # fp16: computed in fp32 from the fp16 input, rounded to fp16 (2^-11) at the end
                tol = dict(atol=1e-4, rtol=2.0**-10)
            else:  # the dense path: weights rounded to the compute dtype first, as bitsandbytes does
                tol = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-3, rtol=2e-2),
                       torch.float16: dict(atol=3e-4, rtol=3e-3)}[dtype]
            torch.testing.assert_close(y.double(), ref, **tol)


@needs_kernel
@pytest.mark.parametrize("shape", [(96, 192), (64, 96), (7, 100)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.fp4-dq"])
def test_dense_path_in_chunks(monkeypatch, mode, shape):
    """Prefill dequantizes a few rows at a time (chunks start on block boundaries, straddling ones too): the same
    result as one whole dequantization, against bitsandbytes' weights."""
    layer = quantized_layer(mode, *shape, bias=True)
    d.enable_fast_decode(layer)
    x = torch.randn(2, 20, shape[1], generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        whole = layer(x)
        monkeypatch.setattr(d, "DENSE_CHUNK_WEIGHTS", 3 * shape[1])  # 3 rows (rounded up to a block boundary)
        chunked = layer(x)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)  # only the matmul shapes differ
    torch.testing.assert_close(whole.double(), reference(layer, x.reshape(-1, shape[1])).view(2, 20, -1),
                               atol=1e-5, rtol=1e-4)


@needs_kernel
def test_replaced_weight_rebuilds_the_kernel_state():
    layer = quantized_layer("bnb.nf4", 64, 128, seed=0)
    d.enable_fast_decode(layer)
    x = torch.randn(1, 128)
    with torch.no_grad():
        layer(x)
        quantize_into(layer, 0.02 * torch.randn(64, 128, generator=torch.Generator().manual_seed(9)), CPU)
        y = layer(x)
    assert_close_to_reference(y, layer, x)


# ---- 3. gradients and training ---------------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.fp4-dq"])
def test_inputs_needing_gradients_take_bnb_path(monkeypatch, mode):
    """A converted layer never swallows a gradient: it computes what bitsandbytes' Linear4bit computes, backward too."""
    monkeypatch.setattr(d, "run_kernel", lambda *a: pytest.fail("the kernel has no backward"))
    ours, ref = quantized_layer(mode, 96, 192), quantized_layer(mode, 96, 192)
    d.enable_fast_decode(ours)
    x = torch.randn(1, 192, generator=torch.Generator().manual_seed(0))
    grads = []
    for layer in (ours, ref):
        xi = x.clone().requires_grad_(True)
        layer(xi).square().sum().backward()
        grads.append(xi.grad)
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0


@needs_kernel
def test_only_supported_layers_convert_and_disable_restores():
    model = nn.Sequential(quantized_layer("bnb.nf4", 32, 64), quantized_layer("bnb.nf4-dq", 32, 96),
                          nn.Linear(8, 8))
    odd = make_quantized_linear(nn.Linear(33, 4, bias=False, device="meta"), "bnb.nf4", torch.float32)
    quantize_into(odd, 0.02 * torch.randn(4, 33), CPU)  # rows start mid-byte: bitsandbytes' path
    model.append(odd)
    assert d.enable_fast_decode(model) == 2
    assert [type(m).__name__ for m in model] == ["DecodeLinear4bit", "DecodeLinear4bit", "Linear", "CPULinear4bit"]
    assert not any(getattr(m, "support_avx512bf16_for_cpu", False) for m in model[:2])
    assert d.disable_fast_decode(model) == 2
    # back to what they were: the 96-wide layer to the flat-dequantizing subclass bitsandbytes' CPU kernels need
    assert [type(m).__name__ for m in model] == ["CPULinear4bit", "CPULinear4bit", "Linear", "CPULinear4bit"]


def test_training_code_never_imports_the_kernel():
    """Only generation uses the kernel (the generate scripts' inference module, and the engine: its rows of several
    adapters, its decoding attention, and `decoding`, which converts a model being trained for the time it samples):
    finetune, the loader and the LoRA code do not know about it."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    users = sorted(str(p.relative_to(root)) for p in [*root.glob("lit_qlora/**/*.py"), *root.glob("finetune/*.py"),
                                                        *root.glob("generate/*.py")]
                   if "decode4bit" in p.read_text() and p.name != "decode4bit.py")
    assert users == ["lit_qlora/engine/adapters.py", "lit_qlora/engine/engine.py", "lit_qlora/engine/kv.py",
                     "lit_qlora/inference.py"]


# ---- 7. unmerged LoRA layers ----------------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("variant", _variant_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("r", [8, 5, 24])
@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.fp4-dq"])
def test_kernel_adds_a_lora_update(mode, r, rows, dtype, variant):
    """q4_linear_lora: x @ W^T + bias + (x @ A^T) @ B^T in one call, against float64 from bitsandbytes' weights
    (an update about as large as the base product, so a lost or misplaced term shows); 514 x 256 is large enough
    for the rows to be shared out between threads."""
    lib = lib_for(variant)
    for shape in [(96, 192), (33, 128), (7, 100), (514, 256)]:
        layer = quantized_layer(mode, *shape, dtype=dtype, bias=True)
        g = torch.Generator().manual_seed(r + rows)
        A, B = 0.1 * torch.randn(r, shape[1], generator=g), 0.1 * torch.randn(shape[0], r, generator=g)
        x = torch.randn(rows, shape[1], generator=g).to(dtype)
        y = d.run_kernel(lib, d._State(layer, lib), x, shape[0], lora=(A, B.T.contiguous()))  # (B given as B^T)
        assert_close_to_reference(y, layer, x, lib, lora=(A, B))


@needs_kernel
@pytest.mark.parametrize("variant", _variant_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.fp4-dq"])
def test_kernel_scales_a_dora_sum_per_row(mode, rows, dtype, variant):
    """q4_linear_lora with a factor: g * (x @ W^T + (x @ A^T) @ B^T) + bias in one call (DoRA's output with its
    factor g per row, rows between 0.5 and 1.5, some exactly 1), against float64 from bitsandbytes' weights; red
    with the factor applied to the bias too, or not at all."""
    lib = lib_for(variant)
    for shape in [(96, 192), (33, 128), (7, 100), (514, 256)]:
        layer = quantized_layer(mode, *shape, dtype=dtype, bias=True)
        g = torch.Generator().manual_seed(rows)
        A, B = 0.1 * torch.randn(8, shape[1], generator=g), 0.1 * torch.randn(shape[0], 8, generator=g)
        scale = 0.5 + torch.rand(shape[0], generator=g)
        scale[::3] = 1.0
        x = torch.randn(rows, shape[1], generator=g).to(dtype)
        y = d.run_kernel(lib, d._State(layer, lib), x, shape[0], lora=(A, B.T.contiguous()), rowscale=scale)
        assert_close_to_reference(y, layer, x, lib, lora=(A, B), rowscale=scale)


@needs_kernel
@pytest.mark.parametrize("variant", _variant_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_many_layers_in_one_call_are_each_layer_alone_bit_for_bit(shape, dtype, variant, monkeypatch):
    """q4_linear_many (`run_kernel_many`, a mixture's active experts while decoding): two projections of three layers
    each (nf4, nf4-dq, fp4-dq; one with a bias), each layer on its own group of rows (1, 4, 2 rows; and one row each,
    the decoding loop), in one call: every output equals that layer's own call on its rows, bit for bit, whatever the
    threads (their row groups handed out across layers)."""
    lib = lib_for(variant)
    monkeypatch.setattr(d, "PARALLEL_MIN_WEIGHTS", 0)  # two threads even for these small layers
    modes = ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4-dq"]
    n, k = shape
    projections = [[quantized_layer(mode, out_f, k, dtype=dtype, bias=i == 1 and out_f == n, seed=10 * j + i)
                    for i, mode in enumerate(modes)] for j, out_f in enumerate([n, 7])]
    states = [[d._State(layer, lib) for layer in layers] for layers in projections]
    for sizes in [[1, 4, 2], [1, 1, 1]]:
        x = torch.randn(sum(sizes), k, generator=torch.Generator().manual_seed(len(sizes))).to(dtype)
        got = d.run_kernel_many(lib, states, x, sizes)
        for y, layers, layer_states in zip(got, projections, states):
            assert y.dtype == dtype and y.shape == (sum(sizes), layers[0].out_features)
            want = [d.run_kernel(lib, st, h, layer.out_features)
                    for st, h, layer in zip(layer_states, x.split(sizes), layers)]
            assert torch.equal(y, torch.cat(want)), sizes


def lora_over(layer: nn.Module, parts=None, seed: int = 0):
    """A LoRALinear (r 4, alpha 8) over `layer` with random A and B, in the layer's compute dtype."""
    from lit_qlora.lora import LoRALinear

    m = LoRALinear(layer, layer.in_features, layer.out_features, r=4, alpha=8, dropout=0.1, parts=parts)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.lora_A.copy_(0.1 * torch.randn(m.lora_A.shape, generator=g))
        m.lora_B.copy_(0.1 * torch.randn(m.lora_B.shape, generator=g))
    return m.to(layer.weight.quant_state.dtype).eval()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_layer_over_a_4bit_base_decodes_in_one_call(monkeypatch, dtype):
    """enable_fast_decode turns a LoRALinear over a 4-bit layer into DecodeLoRALinear: a decoding step (eval, no
    gradient, up to MAX_KERNEL_ROWS rows) is one kernel call with the update, within the kernel's tolerance of
    float64 (for a fused q/k/v layer with parts too); prefill-sized inputs, gradients, training mode and autocast
    take LoRALinear's own path; disable_fast_decode gives back LoRALinear."""
    from lit_qlora.lora import LoRALinear

    calls = []
    monkeypatch.setattr(d, "run_kernel", lambda *a, _f=d.run_kernel: calls.append(len(a) > 4 and a[4] is not None)
                        or _f(*a))
    for parts in [None, [(0, 32), (64, 32)]]:
        m = lora_over(quantized_layer("bnb.nf4", 96, 192, dtype=dtype, bias=True), parts)
        assert d.enable_fast_decode(m) == 1 and type(m) is d.DecodeLoRALinear and type(m.base) is d.DecodeLinear4bit
        for b, t in [(1, 1), (2, 3), (1, d.MAX_KERNEL_ROWS), (1, d.MAX_KERNEL_ROWS + 1)]:
            x = torch.randn(b, t, 192, generator=torch.Generator().manual_seed(t)).to(dtype)
            calls.clear()
            with torch.inference_mode():
                y = m(x)
            assert calls == ([True] if b * t <= d.MAX_KERNEL_ROWS else []), (b, t)
            if b * t <= d.MAX_KERNEL_ROWS:
                A, B = m.lora_A.float(), m.stacked_B().float() * m.scaling
                assert y.shape == (b, t, 96) and y.dtype == dtype
                assert_close_to_reference(y.reshape(-1, 96), m.base, x.reshape(-1, 192), d.kernel(), lora=(A, B))
        x = torch.randn(1, 1, 192).to(dtype)
        for how in ["grad", "train", "autocast"]:
            calls.clear()
            m.train(how == "train")
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "autocast"), \
                    torch.set_grad_enabled(how == "grad"):
                m(x.requires_grad_(how == "grad"))
            assert True not in calls, how  # the base alone may still take the kernel; the update never does
            x = x.detach()
        m.eval()
        assert d.disable_fast_decode(m) == 1 and type(m) is LoRALinear
    # fp32 A and B that are transposed views: the kernel reads contiguous copies
    m = lora_over(quantized_layer("bnb.nf4", 96, 192, dtype=torch.float32))
    m.lora_A = nn.Parameter(torch.randn(192, 4, generator=torch.Generator().manual_seed(1)).T)
    m.lora_B = nn.Parameter(torch.randn(4, 96, generator=torch.Generator().manual_seed(3)).T)
    x = torch.randn(1, 192, generator=torch.Generator().manual_seed(2))
    d.enable_fast_decode(m)
    with torch.inference_mode():
        y = m(x)
    assert_close_to_reference(y, m.base, x, d.kernel(), lora=(m.lora_A, m.stacked_B() * m.scaling))


@needs_kernel
@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.nf4-dq"])
def test_unmerged_adapter_decodes_as_with_separate_ops(family_ckpts, mode, monkeypatch):
    """A model with LoRA on every target over a 4-bit base, prepared for generation: every LoRA layer decodes in
    one kernel call; at fp32 the greedy tokens equal those of LoRALinear's separate ops and the logits agree to fp32
    summation order; at bf16 (one rounding instead of two) the logits are at least as close to the fp32 model's."""
    from lit_qlora.generation import generate
    from lit_qlora.inference import fast_cpu_4bit_decoding
    from lit_qlora.loader import load_model
    from lit_qlora.lora import LoRAConfig, LoRALinear

    folder = family_ckpts("llama3")
    cfg = LoRAConfig(r=4, alpha=8, dropout=0.0, query=True, key=True, value=True, projection=True, mlp=True)
    models = {}
    for precision in ("32-true", "bf16-true"):
        model = load_model(folder, precision=precision, quantize=mode, lora=cfg, seed=3).eval()
        with torch.no_grad():  # a sizable update (lora_B starts at zero)
            for i, m in enumerate(x for x in model.modules() if isinstance(x, LoRALinear)):
                m.lora_B.copy_(0.2 * torch.randn(m.lora_B.shape, generator=torch.Generator().manual_seed(i)))
        fast_cpu_4bit_decoding(model)
        models[precision] = model
    lora_layers = {p: [m for m in model.modules() if isinstance(m, LoRALinear)] for p, model in models.items()}
    assert all(type(m) is d.DecodeLoRALinear for ms in lora_layers.values() for m in ms)

    def separate(precision, on):
        for m in lora_layers[precision]:
            m.__class__ = LoRALinear if on else d.DecodeLoRALinear

    calls = []
    monkeypatch.setattr(d, "run_kernel",
                        lambda *a, _f=d.run_kernel: calls.append(len(a) > 4 and a[4] is not None) or _f(*a))
    prompt = torch.randint(0, models["32-true"].config.vocab_size, (PROMPT_LEN,),
                           generator=torch.Generator().manual_seed(5))
    fused = generate(models["32-true"], prompt, max_new_tokens=NEW_TOKENS)
    assert sum(calls) == (NEW_TOKENS - 1) * len(lora_layers["32-true"])  # every decoding step of every LoRA layer
    separate("32-true", True)
    assert torch.equal(generate(models["32-true"], prompt, max_new_tokens=NEW_TOKENS), fused)
    exact = teacher_forced_logits(models["32-true"], fused)
    separate("32-true", False)
    got = teacher_forced_logits(models["32-true"], fused)
    assert ((got - exact).abs().amax(-1) <= 1e-4 * exact.std(-1)).all()

    bf16 = teacher_forced_logits(models["bf16-true"], fused)
    separate("bf16-true", True)
    bf16_separate = teacher_forced_logits(models["bf16-true"], fused)
    err, err_separate = (bf16 - exact).abs().max().item(), (bf16_separate - exact).abs().max().item()
    assert err <= 1.05 * err_separate + 1e-3 * exact.abs().max().item(), (err, err_separate)


# ---- 4. greedy tokens on every family ----------------------------------------------------------------
def _family_params():
    try:
        import transformers  # noqa: F401
    except ImportError:
        return [pytest.param("llama", marks=pytest.mark.skip(reason="transformers is needed to build the tiny models"))]
    from helpers import TINY_HF_CONFIGS

    return [*TINY_HF_CONFIGS, "llama-straddling"]


@pytest.fixture(scope="module")
def family_ckpts(tmp_path_factory):
    """kind -> a converted tiny model of that family (built once per kind on first use)."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            from helpers import make_tiny_hf_model

            from lit_qlora.convert import convert_hf_checkpoint

            folder = tmp_path_factory.mktemp(kind)
            # weights 10x the default init: with tiny random weights greedy decoding just repeats one token;
            # "llama-straddling": intermediate 96, so mlp.proj's blocks straddle rows (in_features % 64 == 32)
            extra = dict(intermediate_size=96) if kind == "llama-straddling" else {}
            make_tiny_hf_model(kind.split("-")[0], folder, initializer_range=0.2, **extra)
            convert_hf_checkpoint(folder)
            cache[kind] = folder
        return cache[kind]

    return get


def dense_from_bnb(folder, quantized: nn.Module, precision: str) -> nn.Module:
    """The dense model whose every quantized Linear holds bitsandbytes' own dequantization of the same tensors."""
    from lit_qlora.loader import load_model
    from lit_qlora.quant.quantize import dequantize_weight, parse_precision

    dense = load_model(folder, precision=precision).eval()
    dtype = parse_precision(precision).dtype
    if isinstance(quantized.transformer.wte, TiedEmbedding4bit):  # the embedding is the 4-bit head's too
        w = nn.Parameter(bnb_weight(quantized.lm_head).to(dtype), requires_grad=False)
        dense.transformer.wte.weight = dense.lm_head.weight = w
    for name, m in quantized.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            w = bnb_weight(m)
        elif isinstance(m, bnb.nn.Linear8bitLt):
            w = dequantize_weight(m)  # int8 codes x row scale / 127, bitsandbytes' int8_vectorwise_dequant formula
        else:
            continue
        if ".experts." in name:  # one expert's layer (QuantizedExpertWeights) of a stacked [E, out, in] weight
            stack, _, e = name.rpartition(".layers.")
            dense.get_submodule(stack).weight.data[int(e)] = w.to(dtype)
            continue
        dense.get_submodule(name).weight = nn.Parameter(w.to(dtype), requires_grad=False)
    return dense


def quantized_for_generation(folder, mode: str, precision: str, monkeypatch) -> tuple[nn.Module, list]:
    """Our quantized model prepared as generate/*.py prepares it, and a list that grows by one per kernel call."""
    from lit_qlora.inference import fast_cpu_4bit_decoding
    from lit_qlora.loader import load_model

    model = load_model(folder, precision=precision, quantize=mode).eval()
    n = fast_cpu_4bit_decoding(model)
    n4 = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    assert n == n4 and (n4 > 0) == (mode != "bnb.int8")
    calls = []
    monkeypatch.setattr(d, "run_kernel", lambda *a, _f=d.run_kernel: calls.append(1) or _f(*a))
    return model, calls


PROMPT_LEN, NEW_TOKENS = 20, 12  # a prompt longer than MAX_KERNEL_ROWS: prefill on the dense path, decode on the kernel


def teacher_forced_logits(model: nn.Module, seq: torch.Tensor) -> torch.Tensor:
    """[NEW_TOKENS, V] fp32: the logits that chose each new token of `seq`, by prefill + one decode step at a time."""
    with torch.inference_mode():
        model.set_kv_cache(1, len(seq))
        steps = [model(seq[None, :PROMPT_LEN], input_pos=torch.arange(PROMPT_LEN))[0, -1:]]
        steps += [model(seq[None, t:t + 1], input_pos=torch.tensor([t]))[0] for t in range(PROMPT_LEN, len(seq) - 1)]
        model.clear_kv_cache()
    return torch.cat(steps).float()


def exact_reference(folder, quantized: nn.Module, seed: int = 5) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """(fp32 dense model of bitsandbytes' dequantized weights, its greedy sequence from a random prompt of `seed`, its
    teacher-forced logits)."""
    from lit_qlora.generation import generate

    exact = dense_from_bnb(folder, quantized, "32-true")
    prompt = torch.randint(0, quantized.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed))
    seq = generate(exact, prompt, max_new_tokens=NEW_TOKENS)
    assert len(set(seq[PROMPT_LEN:].tolist())) >= 2, "a real continuation, not one token repeated"
    return exact, seq, teacher_forced_logits(exact, seq)


@needs_kernel
@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4"])
@pytest.mark.parametrize("kind", _family_params())
def test_greedy_tokens_match_dense_model_of_bnb_weights(family_ckpts, kind, mode, monkeypatch):
    """32-true, through the generation path (inference.fast_cpu_4bit_decoding): the same greedy tokens as the dense
    model of bitsandbytes' fp32 dequantized weights, and the same logits up to fp32 summation order (measured
    <= 1e-5 x their std on every family)."""
    from lit_qlora.generation import generate

    folder = family_ckpts(kind)
    model, calls = quantized_for_generation(folder, mode, "32-true", monkeypatch)
    _, seq, want = exact_reference(folder, model)
    assert generate(model, seq[:PROMPT_LEN], max_new_tokens=NEW_TOKENS).tolist() == seq.tolist()
    assert calls, "the kernel was not used"
    got = teacher_forced_logits(model, seq)
    assert ((got - want).abs().amax(-1) <= 1e-4 * want.std(-1)).all()


class _CountDequantize(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts bitsandbytes' dequantizing ops (every path that makes a dense copy of 4-bit or int8 weights goes
    through one of them: dequantize_4bit, dequantize_blockwise of nested scales, int8's dequantizing matmul)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "bitsandbytes":
            self.calls.append(func.name())
        return func(*args, **(kwargs or {}))


@needs_kernel
@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.nf4-dq"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_moe_decoding_reads_only_the_active_experts_through_the_kernel(family_ckpts, kind, mode, monkeypatch):
    """Batch-1 decoding of a mixture of experts: at every step, in every MoE layer, the kernel runs the three
    projections of exactly the experts the router picks for the token (its top k), each once, and nothing is
    dequantized (no expert's weight, active or not, becomes a dense tensor): the only expert bytes read are the
    active experts' packed 4-bit weights and scales. (The tokens equal the dense model of bitsandbytes' weights:
    test_greedy_tokens_match_dense_model_of_bnb_weights over the same families.)"""
    from lit_qlora.model import MoE
    from lit_qlora.quant.quantize import QuantizedExpertWeights

    folder = family_ckpts(kind)
    model, _ = quantized_for_generation(folder, mode, "32-true", monkeypatch)
    owner = {}  # the packed weight of an expert's layer -> (MoE layer, expert)
    for name, m in model.named_modules():
        if isinstance(m, QuantizedExpertWeights):
            for e, layer in enumerate(m.layers):
                owner[id(layer.weight)] = (name.rsplit(".", 2)[0], e)
    ran: list[tuple[str, int]] = []
    real, real_many = d.run_kernel, d.run_kernel_many

    def run_kernel(lib, state, *args):
        if id(state.param) in owner:
            ran.append(owner[id(state.param)])
        return real(lib, state, *args)

    def run_kernel_many(lib, projections, *args):  # the active experts of a projection (or two) in one call
        ran.extend(owner[id(state.param)] for states in projections for state in states)
        return real_many(lib, projections, *args)

    monkeypatch.setattr(d, "run_kernel", run_kernel)
    monkeypatch.setattr(d, "run_kernel_many", run_kernel_many)
    picked: dict[str, list[int]] = {}  # MoE layer -> the experts its router picks for the token
    for name, m in model.named_modules():
        if isinstance(m, MoE):
            def pick(mod, args, _n=name):  # the router's top k for the token, from its weight
                scores = args[0].reshape(-1, mod.router.in_features).float() @ mod.router.weight.float().T
                if mod.router.bias is not None:  # gpt-oss's biased router
                    scores = scores + mod.router.bias.float()
                picked[_n] = scores.topk(mod.top_k, dim=-1).indices.flatten().tolist()

            m.register_forward_pre_hook(pick)
    c = model.config
    n_moe = sum(map(c.is_moe_layer, range(c.n_layer)))
    seq = torch.randint(0, c.vocab_size, (PROMPT_LEN + 6,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        model.set_kv_cache(1, len(seq))
        model(seq[None, :PROMPT_LEN], input_pos=torch.arange(PROMPT_LEN))  # prefill (dense path, > 16 rows)
        for t in range(PROMPT_LEN, len(seq)):
            ran.clear()
            picked.clear()
            with _CountDequantize() as counted:
                model(seq[None, t:t + 1], input_pos=torch.tensor([t]))
            assert counted.calls == [], counted.calls
            assert len(picked) == n_moe
            want = sorted((layer, e) for layer, experts in picked.items() for e in experts for _ in range(3))
            assert sorted(ran) == want and len(set(want)) == n_moe * c.moe_top_k
        model.clear_kv_cache()


@needs_kernel
@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.nf4-dq"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_moe_decoding_runs_each_projection_s_active_experts_in_one_kernel_call(family_ckpts, kind, mode, precision,
                                                                              monkeypatch):
    """A decoding step of a mixture (batch 1, and batch 3 through the KV cache) runs, in every MoE layer, the active
    experts' gate and up projections in one kernel call and their down projection in a second (DecodeExpertWeights),
    where a call per expert and projection ran before (3 x top_k per layer): the logits of every step are the same
    bits as those of the per-expert path (QuantizedExpertWeights' own, each expert's DecodeLinear4bit) on the same
    model, fp32 and bf16, gpt-oss's expert biases included (the kernel computes every row with the same code)."""
    from lit_qlora.quant.quantize import QuantizedExpertWeights

    model, _ = quantized_for_generation(family_ckpts(kind), mode, precision, monkeypatch)
    experts = [m for m in model.modules() if isinstance(m, QuantizedExpertWeights)]
    assert experts and all(type(m) is d.DecodeExpertWeights for m in experts)
    calls: list[int] = []  # per call: how many projections it ran
    monkeypatch.setattr(d, "run_kernel_many", lambda lib, projections, *a, _f=d.run_kernel_many:
                        calls.append(len(projections)) or _f(lib, projections, *a))
    c = model.config
    n_moe = sum(map(c.is_moe_layer, range(c.n_layer)))

    def decode(seq: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
        """The logits of each step after a prompt, teacher-forced, and the calls of each step."""
        steps, per_step = [], []
        with torch.inference_mode():
            model.set_kv_cache(seq.size(0), seq.size(1))
            model(seq[:, :PROMPT_LEN], input_pos=torch.arange(PROMPT_LEN))
            for t in range(PROMPT_LEN, seq.size(1)):
                calls.clear()
                steps.append(model(seq[:, t:t + 1], input_pos=torch.tensor([t])).float())
                per_step.append(list(calls))
            model.clear_kv_cache()
        return torch.cat(steps, 1), per_step

    for batch in (1, 3):
        seq = torch.randint(0, c.vocab_size, (batch, PROMPT_LEN + 6), generator=torch.Generator().manual_seed(batch))
        got, per_step = decode(seq)
        assert all(step == [2, 1] * n_moe for step in per_step), per_step
        for m in experts:  # the per-expert path on the same weights
            m.__class__ = QuantizedExpertWeights
        want, per_step = decode(seq)
        assert not any(per_step)
        for m in experts:
            m.__class__ = d.DecodeExpertWeights
        assert torch.equal(got, want), (got - want).abs().max()
    assert d.disable_fast_decode(model) and all(type(m) is QuantizedExpertWeights for m in experts)


@needs_kernel
def test_moe_decoding_with_lora_on_the_experts_keeps_a_call_per_expert(family_ckpts, monkeypatch):
    """An unmerged LoRA on the experts (a pair per expert, `LoRAExperts`) adds its update per expert: decoding runs
    each active expert's projections through their own kernel calls (3 x top_k per MoE layer and step), never the
    one-call path, and its logits are those of the model with the kernel turned off (bitsandbytes' path, the same
    LoRA) within 1e-4 x their std."""
    from helpers import lora_cfg, randomize_lora

    from lit_qlora.inference import fast_cpu_4bit_decoding
    from lit_qlora.loader import load_model
    from lit_qlora.lora import LoRAExperts

    model = load_model(family_ckpts("qwen3_moe"), precision="32-true", quantize="bnb.nf4",
                       lora=lora_cfg(query=True, experts=True), seed=0)
    randomize_lora(model, seed=5)
    model.eval()
    want = teacher_forced_logits(model, torch.randint(0, model.config.vocab_size, (PROMPT_LEN + 6,),
                                                      generator=torch.Generator().manual_seed(4)))
    assert fast_cpu_4bit_decoding(model) > 0
    wrapped = [m for m in model.modules() if isinstance(m, LoRAExperts)]
    assert wrapped and all(type(m.base) is d.DecodeExpertWeights for m in wrapped)
    calls = {"many": 0, "one": 0}
    monkeypatch.setattr(d, "run_kernel_many", lambda *a, _f=d.run_kernel_many: calls.update(many=1) or _f(*a))
    monkeypatch.setattr(d, "run_kernel", lambda *a, _f=d.run_kernel: calls.update(one=calls["one"] + 1) or _f(*a))
    c = model.config
    got = teacher_forced_logits(model, torch.randint(0, c.vocab_size, (PROMPT_LEN + 6,),
                                                     generator=torch.Generator().manual_seed(4)))
    n_moe = sum(map(c.is_moe_layer, range(c.n_layer)))
    assert calls["many"] == 0 and calls["one"] >= 5 * 3 * c.moe_top_k * n_moe
    assert ((got - want).abs().amax(-1) <= 1e-4 * want.std(-1)).all(), (got - want).abs().amax(-1) / want.std(-1)


@needs_kernel
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_moe_kernel_decoding_logits_equal_transformers(family_ckpts, kind, monkeypatch, tmp_path):
    """Batch-1 decoding of a 4-bit (nf4-dq) mixture of experts through the kernel, one token per step after a prompt,
    gives the logits transformers' model computes over the whole sequence when it holds the same weights
    (bitsandbytes' dequantization of every quantized layer, experts included, written as an HF checkpoint by our
    converter): within 1e-4 x their std at every step, fp32."""
    from safetensors.torch import save_file

    from lit_qlora.checkpoint import LIT_CONFIG, LIT_WEIGHTS
    from lit_qlora.convert import convert_lit_checkpoint
    from lit_qlora.readers import safetensors_header

    folder = family_ckpts(kind)
    model, calls = quantized_for_generation(folder, "bnb.nf4-dq", "32-true", monkeypatch)
    dense = dense_from_bnb(folder, model, "32-true")
    keys = safetensors_header(folder / LIT_WEIGHTS)[0].keys()
    lit = tmp_path / "lit"
    lit.mkdir()
    (lit / LIT_CONFIG).write_bytes((folder / LIT_CONFIG).read_bytes())
    save_file({k: v.detach().contiguous() for k, v in dense.state_dict().items() if k in keys}, lit / LIT_WEIGHTS)
    hf = hf_model(convert_lit_checkpoint(lit, tmp_path / "hf"))

    seq = torch.randint(0, model.config.vocab_size, (PROMPT_LEN + 8,), generator=torch.Generator().manual_seed(3))
    got = teacher_forced_logits(model, seq)  # prefill on the dense path, then 7 one-token steps on the kernel
    assert calls, "the kernel was not used"
    with torch.inference_mode():
        want = hf(seq[None]).logits[0, PROMPT_LEN - 1:-1].float()
    assert ((got - want).abs().amax(-1) <= 1e-4 * want.std(-1)).all(), (got - want).abs().amax(-1) / want.std(-1)


@needs_kernel
@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq"])
@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_tied_embedding_is_read_from_the_4bit_head(family_ckpts, kind, mode, monkeypatch):
    """A tied model with a 4-bit output layer, loaded as generate/*.py loads it: no dense vocabulary x hidden matrix
    anywhere, embedding rows equal to bitsandbytes' dequantization of the head's rows, and greedy generation equal
    to the dense model whose embedding and head both hold those dequantized weights."""
    from itertools import chain

    from lit_qlora.generation import generate
    from lit_qlora.inference import fast_cpu_4bit_decoding
    from lit_qlora.loader import load_model

    folder = family_ckpts(kind)
    model = load_model(folder, precision="32-true", quantize=mode, quantize_lm_head=True,
                       embedding_from_head=True).eval()
    c = model.config
    assert c.tie_embeddings and isinstance(model.transformer.wte, TiedEmbedding4bit)
    assert not any(t.shape == (c.vocab_size, c.n_embd) for t in chain(model.parameters(), model.buffers()))
    # nor an fp32 copy of the head's block scales: with double quantization they stay 8-bit, undone per row read
    assert not list(model.transformer.wte.buffers()) and not list(model.transformer.wte.parameters())
    idx = torch.randint(0, c.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model.transformer.wte(idx), nn.functional.embedding(idx, bnb_weight(model.lm_head)))

    assert fast_cpu_4bit_decoding(model) > 0
    _, seq, want = exact_reference(folder, model)
    assert generate(model, seq[:PROMPT_LEN], max_new_tokens=NEW_TOKENS).tolist() == seq.tolist()
    got = teacher_forced_logits(model, seq)
    assert ((got - want).abs().amax(-1) <= 1e-4 * want.std(-1)).all()
    # without the head quantized, or while training (LoRA layers), the embedding stays dense and tied
    dense_head = load_model(folder, precision="32-true", quantize=mode, embedding_from_head=True)
    assert dense_head.lm_head.weight is dense_head.transformer.wte.weight


@needs_kernel
@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4"])
@pytest.mark.parametrize("kind", _family_params())
def test_bf16_decoding_is_as_close_as_dense_bf16(family_ckpts, kind, mode, monkeypatch):
    """bf16-true. A bf16 model of the same dequantized weights is itself far from the exact model (these tiny models
    have weights 10x the usual init: measured 0.22-1.26 x the logits' std after 12 steps) and greedy tokens flip at
    near-ties, so exact tokens are not the test. Instead, teacher-forced on the exact model's greedy tokens, the
    kernel's bf16 decoding stays as close to the exact logits as the dense bf16 model does: its largest logit error,
    averaged over the 12 steps, within 1.25x the dense bf16 model's (measured ratios 0.84-1.07; one step alone
    varies more, up to 1.3x, with the thread count). A mixture of experts over three prompts: its ratio varies more
    from prompt to prompt (measured over 8 prompts, nf4: Mixtral 0.39-1.58, gpt-oss 0.76-1.30, Qwen3-MoE 0.47-1.00;
    gpt-oss's 1.30 chose the exact model's experts at every step)."""
    folder = family_ckpts(kind)
    model, calls = quantized_for_generation(folder, mode, "bf16-true", monkeypatch)
    dense = dense_from_bnb(folder, model, "bf16-true")
    ours_err, dense_err = [], []
    for seed in (5, 6, 7) if model.config.moe_n_expert else (5,):
        _, seq, want = exact_reference(folder, model, seed)
        got = teacher_forced_logits(model, seq)
        assert calls, "the kernel was not used"
        ours_err.append((got - want).abs().amax(-1))
        dense_err.append((teacher_forced_logits(dense, seq) - want).abs().amax(-1))
    ours_err, dense_err = torch.cat(ours_err), torch.cat(dense_err)
    assert ours_err.mean() <= 1.25 * dense_err.mean(), (ours_err, dense_err)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
@pytest.mark.parametrize("kind", _family_params())
def test_int8_generation_is_unchanged_and_close_to_its_dequantized_weights(family_ckpts, kind, precision,
                                                                          monkeypatch):
    """int8 has no kernel: the generation path leaves its layers alone (same logits, bit for bit, as before the hook).
    LLM.int8 also rounds the activations to int8, so its tokens may differ from the dense model of its dequantized
    weights (4 of 11 families at 32-true): teacher-forced, its logits stay within 0.3 x their std of that model's
    at 32-true and 0.5 x at bf16-true (measured up to 0.23 and, bf16, 0.32 through fp32 kernels on an AVX2 CPU and
    0.43 with native bf16 kernels on AVX512-BF16: llama_longrope)."""
    from lit_qlora.loader import load_model

    folder = family_ckpts(kind)
    model, calls = quantized_for_generation(folder, "bnb.int8", precision, monkeypatch)
    _, seq, want = exact_reference(folder, model)
    got = teacher_forced_logits(model, seq)
    assert not calls
    untouched = load_model(folder, precision=precision, quantize="bnb.int8").eval()
    assert torch.equal(teacher_forced_logits(untouched, seq), got)
    bound = 0.3 if precision == "32-true" else 0.5
    if model.config.moe_n_expert and precision != "32-true":
        # bf16 rounding moves some tokens to other experts: the dense bf16 model of the same weights is as far off
        # (tiny Mixtral: 0.82 x std; its int8 model 0.89 x)
        dense16 = teacher_forced_logits(dense_from_bnb(folder, model, precision), seq)
        bound = max(bound, 1.25 * ((dense16 - want).abs().amax(-1) / want.std(-1)).max().item())
    assert ((got - want).abs().amax(-1) <= bound * want.std(-1)).all()


# ---- 5. the generate script --------------------------------------------------------------------------
@needs_kernel
def test_generate_script_samples_on_the_kernel(tmp_path_factory, tmp_path, monkeypatch):
    """generate/base.py with --quantize: --num_samples 3 with sampling gives three answers and the usual figures;
    greedy output at 32-true is the same text with the kernel and without it (LIT_QLORA_DECODE_KERNEL=0)."""
    import json

    import helpers_train as h

    setup = h.tiny_setup(tmp_path_factory)
    common = ["--checkpoint_dir", setup["ckpt"], "--prompt", "kind\nowl\n", "--max_new_tokens", 6, "--quantize",
              "bnb.nf4-dq", "--precision", "32-true"]
    r = h.run_script(h.GENERATE_BASE, common + ["--num_samples", 3, "--temperature", 0.9, "--top_k", 50,
                                                "--metrics_file", tmp_path / "m.json"])
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "Note:" not in r.stderr  # the kernel was built, no fallback note
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert len(metrics["outputs"]) == 3 and r.stdout.count("\n") == 3 and metrics["tokens_per_sec"] > 0
    greedy = [h.run_script(h.GENERATE_BASE, common + ["--num_samples", 2])]
    monkeypatch.setenv("LIT_QLORA_DECODE_KERNEL", "0")
    greedy.append(h.run_script(h.GENERATE_BASE, common + ["--num_samples", 2]))
    assert all(g.returncode == 0 for g in greedy), [g.stderr for g in greedy]
    assert greedy[0].stdout == greedy[1].stdout and greedy[0].stdout.count("\n") == 2


# ---- 6. no compiler, and the cache ----------------------------------------------------------------------
def test_without_a_compiler_generation_falls_back_with_one_note(monkeypatch, tmp_path, capfd):
    monkeypatch.setenv("LIT_QLORA_CACHE", str(tmp_path))
    monkeypatch.setattr(d, "_compilers", lambda: [])
    d.kernel.cache_clear()
    try:
        layer = quantized_layer("bnb.nf4", 64, 128, bias=True)
        x = torch.randn(1, 128)
        with torch.no_grad():
            expected = layer(x)
            assert d.enable_fast_decode(layer) == 0 and type(layer).__name__ == "CPULinear4bit"
            d.kernel()  # asking again prints nothing more
            assert torch.equal(layer(x), expected)
        err = capfd.readouterr().err
        assert err.count("Note: no C compiler found") == 1, err
        assert "bitsandbytes' dequantize-then-multiply path" in err
    finally:
        d.kernel.cache_clear()


def test_failing_compiler_falls_back(monkeypatch, tmp_path, capfd):
    """A compiler that exists but fails (here `false`) is a fallback too, never a crash."""
    import shutil

    if shutil.which("false") is None:
        pytest.skip("no `false` program to stand in for a broken compiler")
    monkeypatch.setenv("LIT_QLORA_CACHE", str(tmp_path))
    monkeypatch.setattr(d, "_compilers", lambda: [shutil.which("false")])
    d.kernel.cache_clear()
    try:
        assert d.kernel() is None
        assert "compiling the kernel failed" in capfd.readouterr().err
    finally:
        d.kernel.cache_clear()


@needs_kernel
def test_compiled_kernel_is_cached(monkeypatch, tmp_path):
    import subprocess

    monkeypatch.setenv("LIT_QLORA_CACHE", str(tmp_path))
    d.kernel.cache_clear()
    try:
        assert d.kernel("portable") is not None
        built = list((tmp_path / "decode4bit").glob("*.so"))
        assert len(built) == 1
        d.kernel.cache_clear()
        real_run = subprocess.run
        monkeypatch.setattr(subprocess, "run", lambda cmd, *a, **k: real_run(cmd, *a, **k) if "--version" in cmd
                            else pytest.fail("compiled again"))
        assert d.kernel("portable") is not None  # from the cache
    finally:
        d.kernel.cache_clear()


@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.nf4-dq"])
def test_bf16_prefill_uses_fp32_kernels_without_native_bf16(mode):
    """A prefill through the dense path (`dequantized_linear`) on a CPU without native bf16 (forced here): the weight
    dequantized to fp32 times the bf16 input, rounded once; with bf16 kernels, the bf16 weight instead."""
    from lit_qlora.kernels import cpu_half

    layer = quantized_layer(mode, 96, 128, dtype=torch.bfloat16)
    x = torch.randn(1, 24, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad(), cpu_half.forced(True):
        y = d.dequantized_linear(layer, x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, (x.float() @ bnb_weight(layer).T).to(torch.bfloat16))
    with torch.no_grad(), cpu_half.forced(False):
        y16 = d.dequantized_linear(layer, x)
    assert not torch.equal(y16, y)  # the test can tell the kernels apart


def test_profile_decode_times_every_part_of_a_step(train_setup):
    """scripts/bench/profile_decode.py (a benchmark, figures only) still reaches every part it names: each row is there,
    timed (> 0), no part longer than the step, and the 4-bit layers ran on the kernel."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "scripts" / "bench" / "profile_decode.py"), "--checkpoint_dir",
                        str(train_setup["ckpt"]), "--quantize", "bnb.nf4", "--precision", "32-true", "--steps", "3"],
                       capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr
    on_kernel = int(re.search(r"(\d+) layers on the 4-bit decode kernel", r.stdout).group(1))
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| ([^|]+?) \| ([\d.]+) \|", r.stdout, re.M)}
    parts = ["block", "attn", "mlp", "norms", "attn: qkv", "attn: proj", "attn: rope", "attn: attention",
             "attn: kv cache update", "mlp: projections", "output layer", "embedding", "final norm"]
    assert on_kernel > 0 and all(rows.get(p, 0) > 0 for p in parts), (on_kernel, rows)
    assert all(v <= rows["step (wall)"] for v in rows.values()), rows
    assert "other projections" not in rows, rows  # every projection labelled


@needs_kernel
@pytest.mark.parametrize("variant", _variant_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES + [(514, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_each_row_of_a_many_row_call_is_that_row_alone_bit_for_bit(shape, dtype, variant, monkeypatch):
    """The batched engine's rows share one kernel call per layer: every row of an M-row call (M up to 33: tiles of 8,
    their remainders, the 4-row decoding loop of M = 1) equals the same row computed alone, bit for bit, so a
    sequence's logits never depend on what shares its batch. Red with a tile that sums its rows in another order."""
    lib = lib_for(variant)
    monkeypatch.setattr(d, "PARALLEL_MIN_WEIGHTS", 0)  # threads too
    layer = quantized_layer("bnb.nf4-dq", *shape, dtype=dtype, bias=True)
    state = d._State(layer, lib)
    x = torch.randn(33, shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    alone = torch.cat([d.run_kernel(lib, state, x[i:i + 1], shape[0]) for i in range(33)])
    for m in (2, 3, 5, 8, 9, 16, 33):
        assert torch.equal(d.run_kernel(lib, state, x[:m], shape[0]), alone[:m]), m


@needs_kernel
@pytest.mark.parametrize("variant", _variant_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_of_several_adapters_in_one_call(dtype, variant):
    """q4_linear_segments (`Segments`): runs of rows with a LoRA each (one a DoRA factor, one none), one call,
    every row equal bit for bit to that row through q4_linear_lora with its own adapter alone (or q4_linear), for a
    layer quantized whole and a fused one quantized part by part (B and g cut per part). Red with a run's rows given
    its neighbour's adapter."""
    lib = lib_for(variant)
    g = torch.Generator().manual_seed(0)
    fused = make_quantized_linear(nn.Linear(192, 96, bias=True, device="meta"), "bnb.nf4-dq", dtype, parts=(64, 16, 16))
    quantize_into(fused, 0.02 * torch.randn(96, 192, generator=g).to(dtype), CPU)
    fused.bias = nn.Parameter(0.1 * torch.randn(96, generator=g).to(dtype), requires_grad=False)
    for layer in (quantized_layer("bnb.nf4", 96, 192, dtype=dtype, bias=True), fused.eval()):
        assert len(d._State(layer, lib).parts) == (1 if layer is not fused else 3)
        adapters = [(0.1 * torch.randn(r, 192, generator=g), 0.1 * torch.randn(r, 96, generator=g), scale)
                    for r, scale in [(4, None), (8, 0.5 + torch.rand(96, generator=g)), (2, None)]]
        loras = [adapters[0], None, adapters[1], adapters[2], adapters[0]]
        ends = [2, 3, 6, 7, 9]
        x = torch.randn(9, 192, generator=g).to(dtype)
        state = d._State(layer, lib)
        y = d.run_kernel(lib, state, x, 96, segments=d.Segments(ends, loras))
        start = 0
        for end, lora in zip(ends, loras):
            want = d.run_kernel(lib, state, x[start:end], 96, lora=lora and lora[:2], rowscale=lora and lora[2])
            assert torch.equal(y[start:end], want), (start, end)
            start = end
