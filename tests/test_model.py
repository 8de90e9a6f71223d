"""Our GPT against transformers for every supported family: logits, training gradients (fp32, bf16, compiled),
the CPU attention, the KV cache and greedy generation."""




import copy
import shutil

import pytest
import torch
from helpers import VOCAB, random_tokens

from lit_qlora.generation import generate
from lit_qlora.model import GPT


@torch.no_grad()
def test_logits_match_transformers(family_ckpt):
    idx = random_tokens(2, 24)  # longer than mistral's sliding window of 8
    expected = family_ckpt.hf(idx).logits
    got = family_ckpt.ours(idx)
    assert got.shape == (2, 24, VOCAB)
    assert (got - expected).abs().max().item() <= 1e-4


def test_training_gradients_match_transformers(family_ckpt, monkeypatch):
    """Backward through our model equals transformers' in fp32, and in bf16 (where it goes through cpu_attention's
    backward) it is as close to the fp32 gradient as transformers' own bf16 backward is."""
    from lit_qlora import cpu_attention
    calls = []
    fast = cpu_attention.causal_attention
    monkeypatch.setattr(cpu_attention, "causal_attention", lambda *a: calls.append(1) or fast(*a))
    idx = random_tokens(2, 24, seed=3)
    pad = family_ckpt.hf.config.pad_token_id
    if pad is not None:  # HF's embedding gives its padding row no gradient; ours (always frozen in LoRA) does
        idx[idx == pad] = (pad + 1) % VOCAB

    def embedding_grad(model: torch.nn.Module, dtype: torch.dtype, compiled: bool = False) -> torch.Tensor:
        model = copy.deepcopy(model).to(dtype)
        if compiled:
            model.train()  # compiled blocks serve training steps only
            model.compile_blocks()
        logits = model(idx)
        getattr(logits, "logits", logits).float().logsumexp(-1).sum().backward()
        wte = model.transformer.wte if isinstance(model, GPT) else model.get_input_embeddings()
        return wte.weight.grad.float()

    expected = embedding_grad(family_ckpt.hf, torch.float32)
    torch.testing.assert_close(embedding_grad(family_ckpt.ours, torch.float32), expected, atol=1e-4, rtol=1e-4)
    assert not calls  # fp32 keeps PyTorch's flash backward
    err_ours = (embedding_grad(family_ckpt.ours, torch.bfloat16) - expected).abs().max()
    err_hf = (embedding_grad(family_ckpt.hf, torch.bfloat16) - expected).abs().max()
    assert err_ours <= 1.5 * err_hf + 1e-3 * expected.abs().max()
    sliding = family_ckpt.ours.config.sliding_window_size is not None  # a window needs a mask: SDPA with attn_mask
    assert bool(calls) == (not sliding)
    has_cxx = shutil.which("g++") or shutil.which("clang++")  # torch.compile's CPU kernels are built with one
    # finetune --compile: the same check through compiled blocks
    if family_ckpt.kind in ("llama", "gpt_neox") and has_cxx:
        torch.testing.assert_close(embedding_grad(family_ckpt.ours, torch.float32, compiled=True), expected, atol=1e-4,
                                   rtol=1e-4)
        err_compiled = (embedding_grad(family_ckpt.ours, torch.bfloat16, compiled=True) - expected).abs().max()
        assert err_compiled <= 1.5 * err_hf + 1e-3 * expected.abs().max()


@pytest.mark.parametrize("T", [7, 100, 200])  # 200: at or above RECOMPUTE_BELOW, ATen's flash backward
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # the model takes this path in bf16 only
def test_cpu_attention_matches_sdpa(T, dtype):
    from lit_qlora.cpu_attention import causal_attention, usable
    gen = torch.Generator().manual_seed(T)
    q, k, v, g = (torch.randn(2, 4, T, 16, generator=gen) for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]  # fp32 reference: PyTorch's own SDPA
    torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True, scale=0.25).backward(g)
    ours = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    assert usable(*ours) == (dtype == torch.bfloat16)
    out = causal_attention(*ours, 0.25)
    out.backward(g.to(dtype))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    torch.testing.assert_close(out.float(), expected, **tol)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad.float(), b.grad, **tol)


@torch.no_grad()
def test_kv_cache_decoding_matches_full_forward(family_ckpt):
    model, idx = family_ckpt.ours, random_tokens(2, 24, seed=1)
    full = model(idx)
    model.set_kv_cache(batch_size=2, max_seq_length=24)
    try:
        steps = [model(idx[:, :10], input_pos=torch.arange(10))]  # prefill
        steps += [model(idx[:, t:t + 1], input_pos=torch.tensor([t])) for t in range(10, 24)]
    finally:
        model.clear_kv_cache()
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers(family_ckpt):
    prompt = random_tokens(8, seed=2)
    hf = family_ckpt.hf
    hf.generation_config.eos_token_id = None  # the tiny models' default eos (e.g. 2) may be produced: never stop early
    with torch.no_grad():
        expected = hf.generate(prompt[None], attention_mask=torch.ones(1, 8, dtype=torch.long), do_sample=False,
                               max_new_tokens=12, eos_token_id=None, pad_token_id=0)[0]
    # a real continuation, not one token repeated
    assert expected.shape == (20,) and len(set(expected[8:].tolist())) >= 3
    streamed = []
    got = generate(family_ckpt.ours, prompt, max_new_tokens=12, temperature=0.0, on_token=streamed.append)
    assert got.tolist() == expected.tolist()
    assert streamed == got[8:].tolist()
    assert family_ckpt.ours.kv_caches is None


