"""Our GPT against transformers for every supported family: logits, training gradients (fp32, bf16, compiled),
the CPU attention, the KV cache and greedy generation."""




import copy
import shutil

import pytest
import torch
from helpers import VOCAB, random_tokens, randomize_lora
from helpers_bounds import SEQUENCES, assert_as_close_as, assert_logits_as_close_as, exact_model

from lit_qlora.data.batching import collate, collate_packed, unpad
from lit_qlora.generation import generate
from lit_qlora.kernels import cpu_half
from lit_qlora.loader import load_model
from lit_qlora.lora import LoRAConfig
from lit_qlora.model import GPT
from lit_qlora.train.training import shift_labels


@torch.no_grad()
def test_logits_match_transformers(family_ckpt):
    """Our fp32 logits are at least as close to the exact ones (transformers' model in float64) as transformers' own
    fp32 logits (tests/helpers_bounds.py)."""
    idx = random_tokens(SEQUENCES, 24)  # longer than mistral's sliding window of 8
    got = family_ckpt.ours(idx)
    assert got.shape == (SEQUENCES, 24, VOCAB)
    assert_logits_as_close_as(got, family_ckpt.hf, idx)


def _first_block(model: torch.nn.Module) -> torch.nn.Module:
    """The first transformer block: ours, or transformers' first decoder layer (the first ModuleList of every
    CausalLM holds its layers)."""
    if isinstance(model, GPT):
        return model.transformer.h[0]
    return next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))[0]


def _block_input_grads(model: torch.nn.Module, idx: torch.Tensor, autocast: bool = False) -> torch.Tensor:
    """The gradient of sum(logsumexp(logits)) at the first block's input [B, T, C]: the embeddings, scaled where the
    family scales them, so that both models are measured at the same point. Under `autocast`: bf16 autocast, as the
    *-mixed precisions train. Nothing accumulates into the models' .grad."""
    seen = []

    def leaf(module, args):
        seen.append(args[0].detach().requires_grad_())
        return (seen[-1], *args[1:])

    handle = _first_block(model).register_forward_pre_hook(leaf)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(idx)
    finally:
        handle.remove()
    loss = getattr(out, "logits", out).float().logsumexp(-1).sum()
    return torch.autograd.grad(loss, seen[0])[0].float()


def _grad_setup(family_ckpt) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, the exact gradient: transformers' model in float64)."""
    idx = random_tokens(SEQUENCES, 24, seed=3)
    return idx, _block_input_grads(exact_model(family_ckpt.hf), idx)


def _count_cpu_attention(monkeypatch) -> list:
    from lit_qlora.kernels import cpu_attention
    calls = []
    fast = cpu_attention.causal_attention
    monkeypatch.setattr(cpu_attention, "causal_attention", lambda *a: calls.append(1) or fast(*a))
    return calls


def test_training_gradients_match_transformers(family_ckpt, monkeypatch):
    """Backward through our model in fp32 is at least as close to the exact gradient as transformers' own fp32
    backward (tests/helpers_bounds.py), and keeps PyTorch's flash backward."""
    calls = _count_cpu_attention(monkeypatch)
    idx, exact = _grad_setup(family_ckpt)
    assert_as_close_as(_block_input_grads(family_ckpt.ours, idx), _block_input_grads(family_ckpt.hf, idx), exact,
                       "fp32 gradient")
    assert not calls


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-true, fp32 kernels", "bf16-mixed"])
def test_bf16_gradients_as_close_as_transformers(family_ckpt, precision, monkeypatch):
    """Our bf16 backward, as the loader builds the model for `precision`, is at least as close to the exact gradient
    as transformers' own in that precision (tests/helpers_bounds.py): bf16-true by bf16 kernels (attention through
    cpu_attention's backward where it is plain causal), by fp32 kernels on bf16 data (a CPU without native bf16:
    lit_qlora/kernels/cpu_half.py), and bf16-mixed (fp32 embeddings and norms, bf16 Linear weights, autocast) against
    transformers' fp32 model under the same autocast."""
    calls = _count_cpu_attention(monkeypatch)
    idx, exact = _grad_setup(family_ckpt)
    mixed, fp32_kernels = precision == "bf16-mixed", precision.endswith("fp32 kernels")
    hf = family_ckpt.hf if mixed else copy.deepcopy(family_ckpt.hf).to(torch.bfloat16)
    reference = _block_input_grads(hf, idx, autocast=mixed)
    ours = load_model(family_ckpt.folder, precision=precision.split(",")[0])
    with cpu_half.forced(None if mixed else fp32_kernels):
        got = _block_input_grads(ours, idx, autocast=mixed)
    assert_as_close_as(got, reference, exact, f"{precision} gradient")
    c = ours.config
    full = [i for i in range(c.n_layer) if ours.layer_window(i) is None]
    # a window needs a mask (SDPA with attn_mask); soft-capped attention is computed by hand; sinks are one more key
    # under a float mask (model.sink_attention); autocast and the fp32 kernels take their own paths
    native = precision == "bf16-true"
    assert bool(calls) == (native and bool(full) and c.attn_softcap is None and not c.attn_sinks)


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("clang++")),
                    reason="torch.compile builds its CPU kernels with a C++ compiler (g++ or clang++): none found")
@pytest.mark.parametrize("family_ckpt", ["llama", "gpt_neox"], indirect=True)
def test_compiled_blocks_gradients_match_transformers(family_ckpt):
    """finetune --compile: the same checks through torch.compile'd blocks, fp32 and bf16-true (and no warning about
    how our code is written: torch.compile warned once per run about tracing through an lru_cache in cpu_half)."""
    import warnings

    idx, exact = _grad_setup(family_ckpt)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = {}
        for precision in ("32-true", "bf16-true"):
            model = load_model(family_ckpt.folder, precision=precision).train()  # compiled blocks serve training
            model.compile_blocks()
            got[precision] = _block_input_grads(model, idx)
    assert not [w for w in seen if "cpu_half" in str(w.message)], [str(w.message) for w in seen]
    hf = family_ckpt.hf
    assert_as_close_as(got["32-true"], _block_input_grads(hf, idx), exact, "compiled fp32 gradient")
    reference = _block_input_grads(copy.deepcopy(hf).to(torch.bfloat16), idx)
    assert_as_close_as(got["bf16-true"], reference, exact, "compiled bf16 gradient")


@pytest.mark.parametrize("T", [7, 100, 200])  # 200: at or above RECOMPUTE_BELOW, ATen's flash backward
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # the model takes this path in bf16 only
def test_cpu_attention_matches_sdpa(T, dtype):
    """cpu_attention's output and q, k, v gradients are at least as close to the exact ones (float64 SDPA) as
    PyTorch's own SDPA in the same dtype (ATen's flash kernels), each (batch, head) a sample (helpers_bounds.py).
    Queries 4x the usual size make scores large, where a score rounded to bf16 shows most in exp()."""
    from lit_qlora.kernels.cpu_attention import causal_attention, usable
    gen = torch.Generator().manual_seed(T)
    q, k, v, g = (torch.randn(4, 8, T, 16, generator=gen).to(dtype) for _ in range(4))
    q = (q.float() * 4).to(dtype)

    def run(attend, dt):
        qkv = [t.to(dt, copy=True).requires_grad_() for t in (q, k, v)]
        out = attend(*qkv)
        out.backward(g.to(dt))
        return [out.detach()] + [t.grad for t in qkv]

    sdpa = lambda *t: torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True, scale=0.25)  # noqa: E731
    assert usable(q.clone().requires_grad_(), k, v) == (dtype == torch.bfloat16)
    exact, reference = run(sdpa, torch.float64), run(sdpa, dtype)
    for name, got, ref, want in zip(("out", "dq", "dk", "dv"), run(lambda *t: causal_attention(*t, 0.25), dtype),
                                    reference, exact):
        assert_as_close_as(got, ref, want, f"{name}, T={T}, {dtype}", sample_dims=2)


@torch.no_grad()
def test_kv_cache_decoding_matches_full_forward(family_ckpt):
    """A prefill, then one token at a time with the KV cache: the logits are as close to the exact ones as
    transformers' own full forward (tests/helpers_bounds.py)."""
    model, idx = family_ckpt.ours, random_tokens(SEQUENCES, 24, seed=1)
    model.set_kv_cache(batch_size=SEQUENCES, max_seq_length=24)
    try:
        steps = [model(idx[:, :10], input_pos=torch.arange(10))]  # prefill
        steps += [model(idx[:, t:t + 1], input_pos=torch.tensor([t])) for t in range(10, 24)]
    finally:
        model.clear_kv_cache()
    assert_logits_as_close_as(torch.cat(steps, dim=1), family_ckpt.hf, idx, "KV-cache decoding")


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




@pytest.mark.parametrize("quantize", [None, "bnb.nf4"])
def test_activation_checkpointing_gives_the_same_gradients(lora_llama, quantize):
    """--activation_checkpointing recomputes each block in backward: the LoRA gradients equal those without it (LoRA
    dropout on: the recomputation must draw the same masks), while far fewer tensors are kept for backward."""
    lora = LoRAConfig(r=4, alpha=8, dropout=0.1, query=True, key=True, value=True, projection=True, mlp=True)
    model = load_model(lora_llama.folder, precision="32-true", quantize=quantize, lora=lora, seed=0).train()
    randomize_lora(model, seed=1)
    idx = random_tokens(2, 12, seed=5)

    def step(checkpointing: bool) -> tuple[dict, int]:
        model.activation_checkpointing = checkpointing
        saved = []
        torch.manual_seed(7)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            loss = model(idx).float().logsumexp(-1).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        return grads, sum(saved)

    plain, saved_plain = step(False)
    checkpointed, saved_ckpt = step(True)
    assert saved_ckpt < 0.5 * saved_plain, (saved_ckpt, saved_plain)
    for name, g in plain.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(checkpointed[name], g, atol=1e-6, rtol=1e-5)


# mistral: sliding window 8; phi3: and partial rotary with longrope; gpt_oss: attention sinks in each sample alone
@pytest.mark.parametrize("family_ckpt", ["llama", "gpt_neox", "mistral", "phi3", "gpt_oss"], indirect=True)
def test_packed_samples_train_exactly_as_alone(family_ckpt):
    """Three samples packed into one row (with a padded second row): every token's loss equals its loss when its
    sample runs alone, within 1e-5 in fp32, and so do the LoRA gradients of the summed loss."""
    mlp = not family_ckpt.ours.config.moe_n_expert  # (LoRA on experts: not here)
    lora = LoRAConfig(r=4, alpha=8, dropout=0.0, query=True, key=True, value=True, projection=True, mlp=mlp)
    model = load_model(family_ckpt.folder, precision="32-true", lora=lora, seed=0).train()
    randomize_lora(model, seed=2)
    lengths = [13, 20, 9, 11]  # longer than the window, so positions must restart for the window to be right
    samples = [{"input_ids": random_tokens(n, seed=20 + i), "labels": random_tokens(n, seed=20 + i)}
               for i, n in enumerate(lengths)]
    samples[2]["labels"][:4] = -100  # a masked prompt (sample 1, unmasked, checks the boundary: see collate_packed)
    batch = collate_packed([samples[:3], samples[3:]])
    assert batch["input_ids"].shape == (2, 42) and batch["segments"][1, 11:].eq(-1).all()

    def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        targets = shift_labels(labels[None])[0]
        return torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="none")

    alone, total = [], 0
    for s in samples:
        losses = token_losses(model(s["input_ids"][None])[0], s["labels"])
        alone.append(losses)
        total = total + losses.sum()
    total.backward()
    grads_alone = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)

    logits = model(batch["input_ids"], positions=batch["positions"], segments=batch["segments"])
    packed = [token_losses(logits[r], batch["labels"][r]) for r in range(2)]
    starts = [(0, 0), (0, 13), (0, 33), (1, 0)]
    for (r, at), n, expected in zip(starts, lengths, alone):
        got = packed[r][at:at + n]
        torch.testing.assert_close(got[:-1], expected[:-1], atol=1e-5, rtol=0)  # the last token predicts nothing
        assert got[-1] == 0 and expected[-1] == 0
    sum(p.sum() for p in packed).backward()
    for name, g in grads_alone.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, g, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family_ckpt", ["llama", "gpt_neox", "gpt_oss"], indirect=True)
@pytest.mark.parametrize("packed", [False, True])
def test_unpadded_batch_trains_as_the_padded_one(family_ckpt, packed):
    """`unpad` (what training runs): one row of the batch's real tokens gives the padded batch's summed loss and LoRA
    gradients within 1e-5 in fp32, for right-padded rows and for rows of packed samples."""
    mlp = not family_ckpt.ours.config.moe_n_expert  # (LoRA on experts: not here)
    lora = LoRAConfig(r=4, alpha=8, dropout=0.0, query=True, key=True, value=True, projection=True, mlp=mlp)
    model = load_model(family_ckpt.folder, precision="32-true", lora=lora, seed=0).train()
    randomize_lora(model, seed=3)
    lengths = [17, 6, 12, 9]
    samples = [{"input_ids": random_tokens(n, seed=40 + i), "labels": random_tokens(n, seed=40 + i)}
               for i, n in enumerate(lengths)]
    samples[0]["labels"][:5] = -100
    batch = collate_packed([samples[:1], samples[1:3], samples[3:]]) if packed else collate(samples)
    tgt = shift_labels(batch["labels"])

    def loss_and_grads(b, t):
        extra = {k: b[k] for k in ("positions", "segments") if k in b}
        loss = torch.nn.functional.cross_entropy(model(b["input_ids"], **extra).flatten(0, 1), t.flatten(),
                                                 ignore_index=-100, reduction="sum")
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    flat, flat_tgt = unpad(batch, tgt)
    assert flat["input_ids"].shape == (1, sum(lengths)) and int(flat["lengths"]) == sum(lengths)
    assert flat_tgt.ne(-100).sum() == tgt.ne(-100).sum()
    loss_padded, grads_padded = loss_and_grads(batch, tgt)
    loss_flat, grads_flat = loss_and_grads(flat, flat_tgt)
    torch.testing.assert_close(loss_flat, loss_padded, atol=1e-5, rtol=1e-6)
    for name, g in grads_padded.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(grads_flat[name], g, atol=1e-5, rtol=1e-4)
