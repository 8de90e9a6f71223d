"""16-bit matmuls by fp32 kernels on CPUs without native 16-bit support (lit_qlora/kernels/cpu_half.py).

What is shown here, on any CPU (the routing is forced or the CPU's kind faked):
1. linear, attention and the 4-bit layers compute what the documented rule says (fp32 products of the 16-bit values,
   rounded once): against a float64 computation, no further off than torch's own 16-bit kernels, and a 4-bit layer
   equal to bitsandbytes' fp32 layer on the same inputs, rounded; gradients likewise;
2. on a CPU without native bf16, a bf16-true LoRA training step (nf4 and dense bases, every adapted target, the
   output layer) runs no matmul and no attention in bf16; with native bf16 it keeps the bf16 kernels;
3. the step's loss and LoRA gradients agree with the bf16 kernels' within bf16 rounding.
"""
from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import lora_cfg, random_tokens, randomize_lora
from torch.utils._python_dispatch import TorchDispatchMode

from lit_qlora.kernels import cpu_half
from lit_qlora.loader import load_model
from lit_qlora.lora import lora_modules
from lit_qlora.quant.quantize import make_quantized_linear, quantize_into, quiet_bnb_import

quiet_bnb_import()
import bitsandbytes as bnb  # noqa: E402

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def real_cpu_afterwards():
    """`cpu_half.native` reads the CPU's flags once: forget what faked flags made it read."""
    yield
    cpu_half.native.cache_clear()


def randn(*shape: int, seed: int, dtype=BF16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def max_err(t: torch.Tensor, truth: torch.Tensor) -> float:
    return (t.double() - truth).abs().max().item()


# ---- 1. what each piece computes --------------------------------------------------------------------
@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_the_fp32_product_rounded_once(bias):
    x, w = randn(3, 40, 64, seed=0).requires_grad_(), randn(48, 64, seed=1).requires_grad_()
    b = randn(48, seed=2).requires_grad_() if bias else None
    g = randn(3, 40, 48, seed=3)
    inputs = [t for t in (x, w, b) if t is not None]

    def run(fn):
        y = fn(x, w, b)
        return [y.detach(), *torch.autograd.grad(y, inputs, g)]

    with cpu_half.forced(True):
        ours = run(cpu_half.linear)
    with cpu_half.forced(False):
        native = run(cpu_half.linear)  # torch's own bf16 kernels
    truth = run(lambda *a: F.linear(*[t.double() if t is not None else None for t in a]))
    # the documented rule, exactly: fp32 operands, one rounding to bf16 of the result and of each gradient
    x32, w32 = x.detach().float(), w.detach().float()
    assert torch.equal(ours[0], F.linear(x32, w32, b.detach().float() if bias else None).to(BF16))
    assert torch.equal(ours[1], (g.float() @ w32).to(BF16))
    for o, n, t in zip(ours, native, truth):
        assert o.dtype == BF16
        assert max_err(o, t.double()) <= max_err(n, t.double()) + 1e-6


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "mask"])
def test_attention_is_the_fp32_attention_rounded_once(masked):
    q = randn(2, 4, 24, 16, seed=0).requires_grad_()
    k, v = randn(2, 2, 24, 16, seed=1).requires_grad_(), randn(2, 2, 24, 16, seed=2).requires_grad_()
    mask = torch.rand(2, 1, 24, 24, generator=torch.Generator().manual_seed(3)) > 0.3 if masked else None
    if masked:
        mask |= torch.eye(24, dtype=torch.bool)  # no empty softmax row
    g = randn(2, 4, 24, 16, seed=4)

    def run(fn, dtype):
        y = fn(*(t.to(dtype) for t in (q, k, v)), mask, not masked, 0.25, True)
        return [y.detach(), *torch.autograd.grad(y, (q, k, v), g.to(dtype))]

    def sdpa(q, k, v, mask, is_causal, scale, gqa):  # torch's own kernels, in the inputs' dtype
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=gqa)

    ours = run(cpu_half.attention32, BF16)
    native = run(sdpa, BF16)
    fp32 = run(sdpa, torch.float32)
    truth = run(sdpa, torch.float64)
    assert torch.equal(ours[0], fp32[0].to(BF16))
    for o, n, t in zip(ours, native, truth):
        assert o.dtype == BF16
        assert max_err(o, t) <= max_err(n, t) + 1e-6


@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4"])
@pytest.mark.parametrize("in_features", [192, 96], ids=["whole-rows", "blocks-across-rows"])
def test_4bit_layer_is_bitsandbytes_weight_in_fp32_rounded_once(mode, in_features):
    """Our 4-bit layer in bf16 by the fp32 kernels: the weight bitsandbytes dequantizes (fp32, the flat blocks it
    quantized) times the same bf16 input, and the output gradient times it for the input's gradient, each rounded
    to bf16 once; and the output within one bf16 rounding of bitsandbytes' own layer at compute dtype fp32 where
    that layer is right."""
    w = 0.02 * torch.randn(80, in_features, generator=torch.Generator().manual_seed(1))
    ours = make_quantized_linear(nn.Linear(in_features, 80, bias=False, device="meta"), mode, BF16)
    quantize_into(ours, w.to(BF16), torch.device("cpu"))
    quant_type, dq = ("nf4" if "nf4" in mode else "fp4"), mode.endswith("-dq")
    ref = bnb.nn.Linear4bit(in_features, 80, bias=False, compute_dtype=torch.float32, quant_type=quant_type,
                            compress_statistics=dq)
    ref.weight = bnb.nn.Params4bit(w.to(BF16).clone(), requires_grad=False, quant_type=quant_type,
                                   compress_statistics=dq)
    ref = ref.to("cpu")
    assert torch.equal(ours.weight.data, ref.weight.data)
    state = copy.copy(ref.weight.quant_state)
    state.shape, state.dtype = torch.Size([80 * in_features]), torch.float32
    w32 = bnb.functional.dequantize_4bit(ref.weight.data.reshape(-1), state).reshape(80, in_features)

    x, g = randn(3, 20, in_features, seed=2), randn(3, 20, 80, seed=3)
    xo = x.clone().requires_grad_()
    with cpu_half.forced(True):
        yo = ours.train()(xo)
        (gx_o,) = torch.autograd.grad(yo, xo, g)
    assert yo.dtype == gx_o.dtype == BF16
    assert torch.equal(yo, (x.float() @ w32.T).to(BF16))
    assert torch.equal(gx_o, (g.float() @ w32).to(BF16))
    if in_features % 64 == 0:  # elsewhere bitsandbytes' CPU layer is wrong (quantize.needs_flat_dequantize)
        yr = ref.train()(x.float()).detach()
        assert ((yo.float() - yr).abs() <= 2**-7 * yr.abs() + 1e-3 * yr.abs().max()).all()


def test_small_matmuls_keep_the_16_bit_kernel(monkeypatch):
    """Decoding one token reads more bytes than it computes: the 16-bit kernel, which reads half, is kept there."""
    monkeypatch.setattr(cpu_half, "native", lambda dtype: False)
    w = randn(1536, 576, seed=0)
    assert not cpu_half.in_fp32(randn(1, 1, 576, seed=1), w.size(0))
    assert cpu_half.in_fp32(randn(4, 64, 576, seed=1), w.size(0))
    assert not cpu_half.in_fp32(randn(4, 64, 576, seed=1, dtype=torch.float32), w.size(0))  # fp32 is fp32
    q = randn(1, 9, 16, 64, seed=2)  # attention from MIN_ATTENTION_LENGTH queries on
    assert cpu_half.attention_in_fp32(q) and not cpu_half.attention_in_fp32(q[:, :, :1])
    monkeypatch.setattr(cpu_half, "native", lambda dtype: True)
    assert not cpu_half.in_fp32(randn(4, 64, 576, seed=1), w.size(0))
    assert not cpu_half.attention_in_fp32(q)


@pytest.mark.parametrize("native", [True, False])
def test_a_16bit_decoding_step_attends_in_fp32(monkeypatch, native):
    """One query per row against the KV cache, 16-bit, outside autograd: attention by the fp32 kernel on any CPU
    (torch's 16-bit one costs several times more there), the result the fp32 attention of the same inputs rounded
    once. With a gradient, more queries, or without the cache, the rule for the CPU kind applies as before."""
    from lit_qlora.config import Config
    from lit_qlora.model import CausalSelfAttention

    monkeypatch.setattr(cpu_half, "native", lambda dtype: native)
    attn = CausalSelfAttention(Config(n_embd=576, n_head=9, n_query_groups=3, vocab_size=64, n_layer=1,
                                      block_size=64))
    q, k, v = randn(2, 9, 1, 64, seed=0), randn(2, 3, 40, 64, seed=1), randn(2, 3, 40, 64, seed=2)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.125, enable_gqa=True).to(BF16)
    with torch.no_grad():
        assert cpu_half.attention_in_fp32(q, decoding=True)
        assert torch.equal(attn.attend(q, k, v, None, cached=True), want)
        assert not cpu_half.attention_in_fp32(randn(2, 9, 2, 64, seed=3), decoding=True)  # two queries
        assert not cpu_half.attention_in_fp32(q.float(), decoding=True)
        assert not cpu_half.attention_in_fp32(q)  # not a decoding step
    assert not cpu_half.attention_in_fp32(q, decoding=True)  # with gradients


def test_decoding_attention_reuses_its_fp32_buffers(monkeypatch):
    """Outside autograd the keys and values are converted into two buffers that grow by doubling, not into fresh
    tensors one position longer at every step (which fragmented the heap); the attention is the same."""
    monkeypatch.setattr(cpu_half, "_scratch", threading.local())
    q = randn(1, 4, 1, 16, seed=0)
    kv = randn(2, 1, 2, 100, 16, seed=1)
    buffers = set()
    with torch.no_grad():
        for L in range(1, 101):
            k, v = kv[0, :, :, :L], kv[1, :, :, :L]  # views of a cache, as decoding passes them
            got = cpu_half.attention32(q, k, v, None, False, 0.25, True)
            want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.25, enable_gqa=True)
            assert torch.equal(got, want.to(BF16)), L
            buffers.add(cpu_half._buffers()[0].data_ptr())
    assert len(buffers) <= 8  # 2 x 1 x 16 -> 3200 elements, doubling: 7 allocations


def test_threads_decoding_at_once_keep_their_own_buffers():
    """Two threads generating at the same time (torch lets go of the GIL inside ops) each convert into buffers of
    their own, and each gets its own attention while the other runs."""
    q = randn(1, 4, 1, 16, seed=0)
    kvs = [randn(2, 1, 2, 64, 16, seed=s) for s in (1, 2)]
    wants = [F.scaled_dot_product_attention(q.float(), kv[0].float(), kv[1].float(), scale=0.25,
                                            enable_gqa=True).to(BF16) for kv in kvs]
    seen, wrong, start = {}, [], threading.Barrier(2)

    def decode(i: int) -> None:
        start.wait()
        with torch.no_grad():
            for _ in range(300):
                got = cpu_half.attention32(q, kvs[i][0], kvs[i][1], None, False, 0.25, True)
                if not torch.equal(got, wants[i]):
                    wrong.append(i)
        seen[i] = {b.data_ptr() for b in cpu_half._buffers()}

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not seen[0] & seen[1] and not wrong


# ---- 2 and 3. a whole bf16-true training step ---------------------------------------------------------
ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
             "_scaled_dot_product_attention_math"}


def intensity(func, args) -> float:
    """Multiply-adds per element read of an aten matmul: m*n*k / (m*k + k*n + m*n); 0 for anything else."""
    name = func.overloadpacket.__name__
    if name in ("addmm", "baddbmm"):
        args = args[1:]
    if name not in ("mm", "bmm", "addmm", "baddbmm"):
        return 0.0
    (m, k), n = args[0].shape[-2:], args[1].shape[-1]
    return m * n * k / (m * k + k * n + m * n)


class Kernels16(TorchDispatchMode):
    """Records the 16-bit matmuls `cpu_half` should have sent to fp32 kernels (MIN_INTENSITY or more multiply-adds per
    element read) and the 16-bit attention kernels, forward and backward; counts the fp32 ones."""

    def __init__(self):
        super().__init__()
        self.half: list[str] = []
        self.fp32 = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ATTENTION or intensity(func, args) >= cpu_half.MIN_INTENSITY:
            dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
            if BF16 in dtypes:
                self.half.append(name)
            self.fp32 += dtypes == {torch.float32}
        return func(*args, **(kwargs or {}))


def training_step(folder, quantize, lora):
    model = load_model(folder, precision="bf16-true", quantize=quantize, lora=lora, seed=1)
    randomize_lora(model)
    model.train()
    torch.manual_seed(0)  # the same dropout masks
    idx = random_tokens(2, 32)
    with cpu_half.forced(None), Kernels16() as seen:
        cpu_half.native.cache_clear()
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
    grads = {n: m.lora_A.grad.float() for n, m in lora_modules(model).items()}
    return loss.item(), grads, seen


@pytest.mark.parametrize("quantize, targets, dropout",
                         [(None, dict(query=True, value=True), 0.1), ("bnb.nf4", {}, 0.0)],
                         ids=["dense-qv-dropout", "nf4-all-and-head"])
def test_bf16_training_runs_no_bf16_matmul_on_a_cpu_without_native_bf16(lora_tied, monkeypatch, quantize, targets,
                                                                         dropout):
    """Dense: LoRA on q and v only, so the projection, the MLP and the output layer are plain Linear layers."""
    lora = dataclasses.replace(lora_cfg(**targets), dropout=dropout)
    monkeypatch.setattr(cpu_half.precision, "cpu_flags", lambda: {"avx2"})
    loss, grads, seen = training_step(lora_tied.folder, quantize, lora)
    assert seen.half == [] and seen.fp32 > 30
    monkeypatch.setattr(cpu_half.precision, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    loss_native, grads_native, seen_native = training_step(lora_tied.folder, quantize, lora)
    assert len(seen_native.half) > 20  # the test can tell the two apart
    assert abs(loss - loss_native) <= 2e-2 * abs(loss_native)
    for name, g in grads.items():
        ref = grads_native[name]
        assert (g - ref).norm() <= 0.05 * ref.norm(), name


def test_large_weights_are_converted_a_chunk_at_a_time(monkeypatch):
    """A large output layer is never converted to fp32 whole (49152 x 576 would be a 113 MB temporary): the result
    is the same fp32 product, rounded once, gradients included."""
    x, w = randn(2, 24, 64, seed=0).requires_grad_(), randn(300, 64, seed=1).requires_grad_()
    g = randn(2, 24, 300, seed=2)
    with cpu_half.forced(True):
        y = cpu_half.linear(x, w)
        whole = [y.detach(), *torch.autograd.grad(y, (x, w), g)]
        monkeypatch.setattr(cpu_half, "FP32_CHUNK", 64 * 7)  # 7 rows at a time, a ragged last chunk
        y = cpu_half.linear(x, w)
        chunked = [y.detach(), *torch.autograd.grad(y, (x, w), g)]
    for a, b in zip(whole, chunked):
        assert a.dtype == b.dtype == BF16
        assert ((a.float() - b.float()).abs() <= 2**-7 * a.float().abs() + 1e-6).all()
    # rounded once: within half a bf16 step of the fp32 product (fp32 kernels may sum a 7-row block in another
    # order than the whole, so the last fp32 bit, and rarely the rounding, can differ from CPU to CPU)
    ref = F.linear(x.detach().float(), w.detach().float())
    assert ((chunked[0].float() - ref).abs() <= 2**-8 * ref.abs() + 1e-5).all()
    assert (chunked[0] == ref.to(BF16)).float().mean() > 0.99
