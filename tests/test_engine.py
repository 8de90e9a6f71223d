"""The batched engine (lit_qlora/engine) against the batch-1 loop, `generation.generate`, as the reference: every
sequence of a batch (different prompt lengths, chunked prefills, a KV budget that makes some wait, a prefix cache,
rows of different adapters over a 4-bit base) gets the tokens it gets alone; and the 4-bit kernel computes each row
of a many-row call exactly as it computes that row alone (the property that makes a row's result independent of its
neighbours).

Tolerance: none. In fp32 the engine's tokens are compared with `generate`'s exactly (greedy, and sampled with the same
seed): each row's logits come from the same ops on the same values as alone, up to fp32 summation order of the
attention over a padded batch; a test that ever met a near-tie would show it as a different token, not hide it.
"""
from __future__ import annotations

import pytest
import torch
from helpers import ALL, load_ours, make_tiny_hf_model, random_adapter, random_tokens

from lit_qlora.adapter import Adapter
from lit_qlora.convert import convert_hf_checkpoint
from lit_qlora.engine import Engine, Sampling, generate_batch
from lit_qlora.engine.adapters import AdapterBank
from lit_qlora.generation import generate
from lit_qlora.utils import UserError

LENGTHS = (3, 17, 9, 40, 1, 33)  # prompts shorter than a block, longer than two, of one token


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny random models of the families whose attention differs: plain GQA, soft-capped (Gemma 2), sliding window
    with its own RoPE (Gemma 3), sinks and experts (gpt-oss), experts with QK-norm (Qwen3-MoE), longrope with partial
    rotary and a window (Phi-3)."""
    out = {}
    for kind in ("llama", "gemma2", "gemma3", "gpt_oss", "qwen3_moe", "phi3"):
        folder = tmp_path_factory.mktemp(kind)
        make_tiny_hf_model(kind, folder, initializer_range=0.2)
        convert_hf_checkpoint(folder)
        out[kind] = (folder, load_ours(folder))
    return out


def prompts() -> list[list[int]]:
    return [random_tokens(n, seed=n).tolist() for n in LENGTHS]


def alone(model, prompt: list[int], n: int, **kw) -> list[int]:
    return generate(model, torch.tensor(prompt), n, **kw)[len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["llama", "gemma2", "gemma3", "gpt_oss", "qwen3_moe", "phi3"])
def test_greedy_batch_equals_each_prompt_alone(models, kind):
    """Six prompts of different lengths in one batch, and again with a KV budget of 4 blocks (sequences wait for
    room) and 16-token prefill chunks: each sequence's greedy tokens are `generate`'s for it alone; longrope (Phi-3)
    picks its factors per row, by what that sequence alone would reach. Red with the rows' positions, keys or
    windows mixed up."""
    _, model = models[kind]
    want = [alone(model, p, 12) for p in prompts()]
    assert [c.ids for c in generate_batch(model, prompts(), Sampling(max_new_tokens=12))] == want
    engine = Engine(model, kv_cache_tokens=64, max_batch=4, block_size=16, prefill_tokens=16)
    seqs = [engine.submit(p, Sampling(max_new_tokens=12)) for p in prompts()]
    in_use = []
    while engine.busy:
        engine.step()
        in_use.append(engine.pool.blocks - engine.pool.available())
    assert [s.new_ids for s in seqs] == want
    assert max(in_use) <= 4 and all(s.finish_reason == "length" for s in seqs)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "gpt_oss", "phi3"])
def test_decoding_attention_from_the_pool_and_without_the_kernel(models, kind, monkeypatch):
    """A decoding step's attention runs in the decode kernel straight from the paged pool (soft-caps, sinks, windows
    and GQA inside it), a step per layer; with the kernel unavailable it is torch's attention over gathered keys, and
    both give `generate`'s tokens."""
    from lit_qlora.engine import kv

    _, model = models[kind]
    want = [alone(model, p, 8) for p in prompts()]
    calls = []
    monkeypatch.setattr(kv, "decode_attention", lambda *a, _f=kv.decode_attention: calls.append(1) or _f(*a))
    assert [c.ids for c in generate_batch(model, prompts(), Sampling(max_new_tokens=8))] == want
    assert len(calls) == 7 * model.config.n_layer  # the decoding steps (the first token comes from the prefill)
    monkeypatch.setattr(kv, "kernel", lambda: None)
    calls.clear()
    assert [c.ids for c in generate_batch(model, prompts(), Sampling(max_new_tokens=8))] == want and not calls


def test_a_sampled_sequence_is_itself_whatever_shares_the_batch(models):
    """Each sequence with its own seed, temperature and filters draws what it draws alone (in a batch of one) and what
    `generate` draws with a generator of that seed: a row's draws never use another row's generator or logits."""
    _, model = models["llama"]
    settings = [Sampling(max_new_tokens=10, temperature=t, top_k=k, top_p=p, seed=i)
                for i, (t, k, p) in enumerate([(1.0, None, None), (0.7, 20, None), (1.3, None, 0.9), (0.0, None, None),
                                               (1.0, 5, 0.8), (2.0, None, None)])]
    together = [c.ids for c in generate_batch(model, prompts(), settings)]
    assert together == [generate_batch(model, [p], s)[0].ids for p, s in zip(prompts(), settings)]
    assert together == [alone(model, p, 10, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                              generator=torch.Generator().manual_seed(s.seed)) for p, s in zip(prompts(), settings)]
    assert len({tuple(t) for t in together}) == len(together)


def test_stops_leave_the_batch_at_once(models):
    """A stop id ends its sequence (kept as its last token, as `generate` keeps eos) and the others go on; a finished
    sequence's blocks are free at once."""
    _, model = models["llama"]
    full = [alone(model, p, 12) for p in prompts()]
    stops = [(full[0][2],), (), (full[2][5], 10**6), (), (), ()]
    settings = [Sampling(max_new_tokens=12, stop_ids=s) for s in stops]
    got = generate_batch(model, prompts(), settings)
    assert got[0].ids == full[0][:full[0].index(full[0][2]) + 1] and got[0].finish_reason == "stop"
    assert got[2].ids == full[2][:full[2].index(full[2][5]) + 1] and got[2].finish_reason == "stop"
    assert [c.ids for c in got[3:]] == full[3:] and got[1].ids == full[1]


def test_the_prompt_of_several_choices_is_computed_once(models):
    """Four choices of one prompt (`n`): the prompt goes through the model once, the others start from its keys and
    values (full blocks shared, the last one copied); each draws as it would alone."""
    _, model = models["llama"]
    prompt = prompts()[3]  # 40 tokens: two full blocks and a partial one
    settings = [Sampling(max_new_tokens=8, temperature=1.0, seed=i) for i in range(4)]
    engine = Engine(model, kv_cache_tokens=1024)
    seqs = [engine.submit(prompt, s) for s in settings]
    engine.run()
    assert engine.stats["prefill_tokens"] == len(prompt)
    assert [s.new_ids for s in seqs] == [generate_batch(model, [prompt], s)[0].ids for s in settings]


def test_next_turn_reuses_the_cached_prefix(models):
    """A prompt that starts with an earlier sequence's ids (a chat's next turn) takes their full blocks from the cache
    and computes the rest only; its tokens are those of a fresh engine. Another adapter never hits (its keys differ)."""
    _, model = models["gemma3"]
    engine = Engine(model, kv_cache_tokens=512)
    first = engine.submit(prompts()[3], Sampling(max_new_tokens=10))
    engine.run()
    turn = first.ids + random_tokens(7, seed=99).tolist()
    second = engine.submit(turn, Sampling(max_new_tokens=10))
    engine.run()
    assert second.cached == 48 and engine.stats["prefill_tokens"] == 40 + len(turn) - 48
    assert second.new_ids == alone(model, turn, 10)


def test_budget_checks_are_one_line(models):
    _, model = models["llama"]
    engine = Engine(model, kv_cache_tokens=32, block_size=16)
    with pytest.raises(UserError, match="need 48 tokens of KV cache, the budget holds 32; raise --kv_cache_gb"):
        engine.submit(prompts()[1], Sampling(max_new_tokens=20))
    with pytest.raises(UserError, match="exceed the model's context"):
        engine.submit([1] * 10, Sampling(max_new_tokens=model.config.block_size))
    with pytest.raises(UserError, match="unknown adapter 'x'"):
        engine.submit([1, 2], Sampling(max_new_tokens=2), adapter="x")
    with pytest.raises(UserError, match="holds no block"):
        Engine(model, kv_cache_tokens=8, block_size=16)


def test_cancel_and_deadline(models):
    _, model = models["llama"]
    engine = Engine(model, kv_cache_tokens=512)
    a = engine.submit(prompts()[0], Sampling(max_new_tokens=50))
    b = engine.submit(prompts()[1], Sampling(max_new_tokens=5), deadline=0.0)
    c = engine.submit(prompts()[2], Sampling(max_new_tokens=5))
    engine.step()
    engine.cancel(a)
    engine.run()
    assert (a.finish_reason, b.finish_reason, c.finish_reason) == ("cancelled", "timeout", "length")
    assert engine.pool.available() == engine.pool.blocks


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """A tiny Llama with three adapters: on q, v and the MLP; on every target; DoRA on q, v."""
    folder = tmp_path_factory.mktemp("adapted")
    make_tiny_hf_model("llama", folder, initializer_range=0.2)
    convert_hf_checkpoint(folder)
    paths = {}
    for i, targets in enumerate([dict(query=True, value=True, mlp=True), ALL, dict(query=True, value=True)]):
        adapter = random_adapter(folder, seed=i + 1, **targets)
        if i == 2:
            adapter = random_adapter_dora(folder)
        paths[f"a{i}"] = folder / f"a{i}.pth"
        adapter.save(paths[f"a{i}"])
    return folder, paths


def random_adapter_dora(folder) -> Adapter:
    from helpers import randomize_lora

    from lit_qlora.loader import load_model
    from lit_qlora.lora import LoRAConfig, lora_modules

    lora = LoRAConfig(r=4, alpha=8, dropout=0.0, query=True, value=True, dora=True)
    model = load_model(folder, precision="32-true", lora=lora, seed=3)
    randomize_lora(model, 3)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_magnitude.mul_(1.2)
    return Adapter.of_model(model, lora)


def load_served(folder, quantize, path=None):
    from lit_qlora.inference import fast_cpu_4bit_decoding
    from lit_qlora.loader import load_model, load_model_with_adapter

    if path is None:
        model = load_model(folder, precision="32-true", quantize=quantize)
    else:
        model = load_model_with_adapter(folder, Adapter.load(path), precision="32-true", quantize=quantize)
    model.eval()
    if quantize:
        assert fast_cpu_4bit_decoding(model) > 0
    return model


@pytest.mark.parametrize("quantize", [None, "bnb.nf4", "bnb.nf4-dq"])
def test_rows_of_different_adapters_in_one_step(adapted, quantize):
    """Six rows, base and three adapters (one DoRA) in every step over one base (4-bit through the kernel, each row's
    update inside its call): each row's greedy tokens are what generate/lora.py --merge false's model of that adapter
    gives alone; base rows are the bare base's (no adapter leaks into them). Red with the rows' segments shifted or
    an adapter's update given to its neighbours."""
    folder, paths = adapted
    model = load_served(folder, quantize)
    bank = AdapterBank(model, "32-true", quantize)
    for name, path in paths.items():
        bank.add(name, Adapter.load(path, model.config))
    names = [None, "a0", "a1", "a2", "a1", None]
    got = generate_batch(model, prompts(), Sampling(max_new_tokens=10), bank=bank, adapters=names)
    for prompt, name, c in zip(prompts(), names, got):
        ref = load_served(folder, quantize, paths[name] if name else None)
        assert c.ids == alone(ref, prompt, 10), (name, quantize)
    assert len({tuple(c.ids) for c in got}) == len(got)


def test_adapters_mixed_in_decode_kernel_calls(adapted, monkeypatch):
    """Over a 4-bit base, a step with rows of several adapters is one kernel call per layer (not one per adapter);
    base rows run with no LoRA (a run of rows without one)."""
    from lit_qlora.quant import decode4bit as d

    folder, paths = adapted
    model = load_served(folder, "bnb.nf4")
    bank = AdapterBank(model, "32-true", "bnb.nf4")
    for name, path in paths.items():
        bank.add(name, Adapter.load(path, model.config))
    calls = []
    monkeypatch.setattr(d, "_run_part", lambda *a, _f=d._run_part: calls.append(a[-1]) or _f(*a))
    generate_batch(model, prompts()[:4], Sampling(max_new_tokens=3), bank=bank, adapters=[None, "a0", "a1", "a0"])
    runs = [[lora is not None for lora in s.loras] for s in calls if s is not None]
    # a run of base rows, then a0's and a1's (None where that adapter does not target the layer)
    assert runs and all(len(r) == 3 and not r[0] and any(r) for r in runs)


def test_a_model_being_trained_samples_through_the_kernel_and_trains_on(adapted):
    """GRPO's case: a 4-bit model with an unmerged LoRA in training mode. generate_batch samples it through the
    decode kernel (the update inside the call) for the call only: the tokens are those of the same model decoding
    one sequence at a time without the kernel (bitsandbytes' path), and afterwards its layers, its training mode and
    its gradients are as before; after an optimizer step the next samples follow the new weights (no stale copy)."""
    from helpers import randomize_lora

    from lit_qlora.loader import load_model
    from lit_qlora.lora import LoRAConfig, lora_modules
    from lit_qlora.quant import decode4bit as d

    folder, _ = adapted
    model = load_model(folder, precision="32-true", quantize="bnb.nf4", lora=LoRAConfig(r=4, alpha=8, dropout=0.1,
                                                                                       query=True, value=True))
    randomize_lora(model, 5)
    model.train()
    classes = [type(m) for m in model.modules()]
    calls = []

    def sample():
        return [c.ids for c in generate_batch(model, prompts()[:3], Sampling(max_new_tokens=6))]

    def reference():
        model.eval()
        with torch.no_grad():
            out = [alone(model, p, 6) for p in prompts()[:3]]
        model.train()
        return out

    original = d.run_kernel
    d.run_kernel = lambda *a: calls.append(1) or original(*a)
    try:
        got = sample()
    finally:
        d.run_kernel = original
    assert calls and got == reference()
    assert model.training and [type(m) for m in model.modules()] == classes
    loss = model(torch.tensor([prompts()[3]])).logsumexp(-1).mean()
    loss.backward()
    assert all(m.lora_A.grad is not None for m in lora_modules(model).values())
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.add_(0.5)
    after = sample()
    assert after == reference() and after != got
