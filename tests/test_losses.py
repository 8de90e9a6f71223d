"""lit_qlora/losses.py: the training loss at the output layer, against torch's cross entropy and against the logits
path it replaces (same loss and gradients, without keeping the logits)."""
from __future__ import annotations

import pytest
import torch
from helpers import lora_cfg

from lit_qlora.config import Config
from lit_qlora.lora import apply_lora, lora_modules
from lit_qlora.losses import chunked_cross_entropy, head_cross_entropy
from lit_qlora.model import GPT


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunked", [False, True])
def test_chunked_cross_entropy_equals_torch(dtype, chunked):
    """The training loss (its own autograd function) against F.cross_entropy on the fp32 upcast, reduction "sum",
    with ignored targets: the loss and the logits' gradient (in the logits' dtype), for [N, V] and chunked [B, T, V]
    logits; an ignored row gets no gradient."""
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 10, 97
    logits = (torch.randn(B, T, V, generator=g) * 4).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, :4] = -100
    targets[2, -1] = -100
    upstream = 0.37
    ref_in = logits.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_in.float().reshape(-1, V), targets.reshape(-1), ignore_index=-100,
                                            reduction="sum")
    (ref * upstream).backward()
    ours_in = logits.clone().requires_grad_()
    if chunked:
        loss = chunked_cross_entropy(list(ours_in.split(4, dim=1)), targets)
    else:
        loss = chunked_cross_entropy(ours_in.reshape(-1, V), targets.reshape(-1))
    (loss * upstream).backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5)
    assert ours_in.grad.dtype == dtype
    torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-5, atol=1e-6)
    assert ours_in.grad[0, :4].abs().max() == 0 and ours_in.grad[1].abs().max() > 0




def _saved_bytes(fn) -> tuple[torch.Tensor, int]:
    """fn()'s result and the bytes autograd saved for its backward."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(saved)


def _head_case(dtype: torch.dtype, seed: int):
    """(generator, hidden states x [37, 16], head W [301, 16] with large logits, targets with 5 ignored rows)."""
    g = torch.Generator().manual_seed(seed)
    N, C, V = 37, 16, 301
    x = torch.randn(N, C, generator=g).to(dtype)
    w = (torch.randn(V, C, generator=g) * 2).to(dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[:5] = -100
    return g, x, w, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cap", [None, 3.0])
def test_head_cross_entropy_equals_the_logits_path(dtype, cap):
    """Loss and gradient of the hidden states equal chunked_cross_entropy over softcap(x @ W.T) (Gemma 2's final
    soft-cap included, with logits large enough for it to clip), with ignored targets and chunks that do not divide
    the rows; the logits are never saved: what backward keeps is one [N, C] gradient."""
    g, x, w, targets = _head_case(dtype, seed=0)
    (N, C), V = x.shape, w.shape[0]
    upstream = 0.29

    def logits_path(xi):
        z = xi @ w.T
        return chunked_cross_entropy(torch.tanh(z / cap) * cap if cap else z, targets)

    ref_in = x.clone().requires_grad_()
    ref, ref_saved = _saved_bytes(lambda: logits_path(ref_in))
    (ref * upstream).backward()
    ours_in = x.clone().requires_grad_()
    loss, saved = _saved_bytes(lambda: head_cross_entropy(ours_in, w, targets, cap, chunk=8))
    (loss * upstream).backward()
    fp32 = dtype == torch.float32
    torch.testing.assert_close(loss, ref, **(dict(rtol=1e-6, atol=1e-5) if fp32 else dict(rtol=2e-2, atol=2e-2)))
    assert ours_in.grad.dtype == dtype and ours_in.grad[:5].abs().max() == 0
    torch.testing.assert_close(ours_in.grad, ref_in.grad,
                               **(dict(rtol=1e-5, atol=1e-6) if fp32 else dict(rtol=5e-2, atol=2e-2)))
    assert saved == N * C * x.element_size() and ref_saved >= N * V * x.element_size()
    if cap:  # the cap clips: without it the loss differs
        assert abs(float(head_cross_entropy(x, w, targets)) - float(loss)) > 1.0
    with torch.no_grad():  # validation: the same value, nothing kept
        torch.testing.assert_close(head_cross_entropy(x, w, targets, cap, chunk=8), loss.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_position_cross_entropy_equals_torch(dtype):
    """reduction "none" (what preference losses sum per sequence): each position's loss equals F.cross_entropy's on
    the fp32 upcast, and the logits' gradient under an upstream gradient that differs per position (as a preference
    loss gives: a chosen row's positions one sign, a rejected row's the other) equals autograd's; chunks too."""
    g = torch.Generator().manual_seed(1)
    N, V = 29, 97
    logits = (torch.randn(N, V, generator=g) * 4).to(dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[3] = -100
    upstream = torch.randn(N, generator=g)
    ref_in = logits.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_in.float(), targets, ignore_index=-100, reduction="none")
    (ref * upstream).sum().backward()
    ours_in = logits.clone().requires_grad_()
    per = chunked_cross_entropy(list(ours_in.split(8)), targets, reduction="none")
    (per * upstream).sum().backward()
    assert per.shape == (N,) and per.dtype == torch.float32 and per[3] == 0
    torch.testing.assert_close(per, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-5, atol=1e-6)


def _float64_head_grad(x, w, targets, cap, upstream) -> torch.Tensor:
    """d sum_i upstream_i * -log softmax(softcap(x @ W.T))_i[target_i] / dx, computed in float64 (the reference both
    fp32 paths are measured against)."""
    xi = x.double().requires_grad_()
    z = xi @ w.double().T
    z = torch.tanh(z / cap) * cap if cap else z
    nll = torch.nn.functional.cross_entropy(z, targets, ignore_index=-100, reduction="none")
    (nll * upstream.double()).sum().backward()
    return xi.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cap", [None, 3.0])
def test_head_cross_entropy_per_position_equals_the_logits_path(dtype, cap):
    """head_cross_entropy(reduction="none"), the preference path: each position's -log p(target) and the hidden
    states' gradient under a per-position upstream gradient equal chunked_cross_entropy(reduction="none") over
    softcap(x @ W.T) (soft-cap clipping, ignored rows, uneven chunks); autograd saves one [N, C] tensor, no logits."""
    g, x, w, targets = _head_case(dtype, seed=2)
    (N, C), V = x.shape, w.shape[0]
    upstream = torch.randn(N, generator=g) * 3  # one weight per position, signs mixed

    def logits_path(xi):
        z = xi @ w.T
        return chunked_cross_entropy(torch.tanh(z / cap) * cap if cap else z, targets, reduction="none")

    ref_in = x.clone().requires_grad_()
    ref, ref_saved = _saved_bytes(lambda: logits_path(ref_in))
    (ref * upstream).sum().backward()
    ours_in = x.clone().requires_grad_()
    per, saved = _saved_bytes(lambda: head_cross_entropy(ours_in, w, targets, cap, chunk=8, reduction="none"))
    (per * upstream).sum().backward()
    fp32 = dtype == torch.float32
    assert per.shape == (N,) and per.dtype == torch.float32 and per[:5].abs().max() == 0
    torch.testing.assert_close(per, ref, **(dict(rtol=1e-6, atol=1e-5) if fp32 else dict(rtol=2e-2, atol=2e-2)))
    assert ours_in.grad.dtype == dtype and ours_in.grad[:5].abs().max() == 0
    if fp32:  # both rounded differently (softmax as exp(z - max) / sum against exp(z - lse)): each against float64
        exact = _float64_head_grad(x, w, targets, cap, upstream)
        ours_err, ref_err = ((g_ - exact).abs().max().item() for g_ in (ours_in.grad.double(), ref_in.grad.double()))
        assert ours_err <= 2 * ref_err + 4 * torch.finfo(dtype).eps, (ours_err, ref_err)
    else:
        torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=5e-2, atol=5e-2)
    assert saved == N * C * x.element_size() and ref_saved >= N * V * x.element_size()
    # the sum of the positions is the summed loss, value and gradient
    summed_in = x.clone().requires_grad_()
    head_cross_entropy(summed_in, w, targets, cap, chunk=8).backward()
    per_in = x.clone().requires_grad_()
    head_cross_entropy(per_in, w, targets, cap, chunk=8, reduction="none").sum().backward()
    torch.testing.assert_close(per_in.grad, summed_in.grad, rtol=0, atol=0)


def _soft_capped_lora_gpt(head_lora: bool):
    """A tiny soft-capped GPT with random LoRA (on the head only, or on q, v and the MLP), only LoRA trainable, and a
    batch of inputs and targets."""
    config = Config(name="t", block_size=32, vocab_size=211, n_layer=2, n_head=4, n_embd=32,
                    n_query_groups=2, intermediate_size=48, mlp_class="LLaMAMLP", norm_class="RMSNorm",
                    bias=False, rotary_percentage=1.0, parallel_residual=False, final_softcap=5.0)
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    apply_lora(model, lora_cfg() if head_lora else lora_cfg(query=True, value=True, mlp=True))
    for m in lora_modules(model).values():
        torch.nn.init.normal_(m.lora_A, std=0.3)
        torch.nn.init.normal_(m.lora_B, std=0.1)
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    idx = torch.randint(0, 211, (2, 12))
    tgt = torch.randint(0, 211, (2, 12))
    return model, idx, tgt


@pytest.mark.parametrize("head_lora", [False, True])
def test_gpt_targets_give_the_loss_of_its_logits(head_lora):
    """GPT(..., targets=...) returns the summed loss of its own logits (the frozen head through head_cross_entropy;
    a head with a LoRA through its kept logits), with the same gradients on every LoRA weight."""
    model, idx, tgt = _soft_capped_lora_gpt(head_lora)
    mask = torch.ones_like(tgt, dtype=torch.bool)
    mask[0, :5] = False

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    ref = chunked_cross_entropy(model(idx, output_mask=mask), tgt[mask])
    ref_grads = grads(ref)
    loss = model(idx, output_mask=mask, targets=tgt[mask], lm_head_chunk=3)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5)
    for n, g in grads(loss).items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("head_lora", [False, True])
def test_gpt_per_position_targets_give_the_log_probs_of_its_logits(head_lora):
    """GPT(..., targets=..., reduction="none") (preference.batch_logps): -log p(target) of each selected position,
    equal to the log-softmax of its own logits, and the same LoRA gradients under a per-position upstream gradient,
    with the frozen head (no logits kept) and with a head LoRA (the logits path)."""
    model, idx, tgt = _soft_capped_lora_gpt(head_lora)
    mask = torch.ones_like(tgt, dtype=torch.bool)
    mask[1, :4] = False
    upstream = torch.randn(int(mask.sum()))

    def grads(out):
        model.zero_grad()
        (out * upstream).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    logp = torch.log_softmax(model(idx, output_mask=mask).float(), -1).gather(-1, tgt[mask][:, None])[:, 0]
    ref_grads = grads(-logp)
    nll = model(idx, output_mask=mask, targets=tgt[mask], lm_head_chunk=3, reduction="none")
    torch.testing.assert_close(-nll, logp, rtol=1e-6, atol=1e-5)
    for n, g in grads(nll).items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)
