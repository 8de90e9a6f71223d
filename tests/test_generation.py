"""Sampling and the generation loop: greedy, top-k, top-p, eos stopping, the context limit."""
import pytest
import torch
from helpers import load_ours, random_tokens

from lit_qlora.convert import convert_hf_checkpoint
from lit_qlora.generation import generate, sample
from lit_qlora.utils import UserError
from tests.helpers import make_tiny_hf_model


@pytest.fixture(scope="module")
def gen_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_gen")
    make_tiny_hf_model("llama", folder, initializer_range=0.2)
    convert_hf_checkpoint(folder)
    return load_ours(folder)


def test_generate_stops_at_eos_and_checks_length(gen_llama):
    prompt = random_tokens(5, seed=3)
    greedy = generate(gen_llama, prompt, max_new_tokens=6)
    assert len(set(greedy[5:].tolist())) >= 3
    eos = int(greedy[7])  # the third new token
    first = int((greedy[5:] == eos).nonzero()[0])  # it may also appear earlier
    out = generate(gen_llama, prompt, max_new_tokens=6, eos_ids=[eos, 10**6])
    assert out.tolist() == greedy[:5 + first + 1].tolist()  # eos included, nothing after
    with pytest.raises(UserError, match="context"):
        generate(gen_llama, prompt, max_new_tokens=gen_llama.config.block_size)


def test_sample():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.5, -1.0])
    assert sample(logits).tolist() == [1]
    assert sample(logits, temperature=1.0, top_k=1).tolist() == [1]
    assert sample(logits, temperature=1.0, top_p=0.01).tolist() == [1]

    def draws(**kw) -> list[int]:
        return [int(sample(logits, 1.0, generator=torch.Generator().manual_seed(s), **kw)) for s in range(200)]

    assert set(draws(top_k=2)) == {1, 3}
    # p = softmax: ~[.03 .55 .07 .34 .01]; top_p=0.8 keeps 1 and 3 (0.55 < 0.8 <= 0.89)
    assert set(draws(top_p=0.8)) == {1, 3}
    assert len(set(draws())) >= 4
    assert draws() == draws()  # the generator makes sampling reproducible


def test_prefill_runs_the_output_layer_on_the_last_position_only(gen_llama, monkeypatch):
    """The prompt's logits but the last are never used: the output layer sees one row in the prefill as in every
    step (not the prompt's 12), and the tokens equal a loop that computes every position's logits without a cache
    (the same logits up to fp32 summation order)."""
    prompt = random_tokens(12, seed=4)
    import lit_qlora.model as model_module

    rows, linear = [], model_module.linear
    monkeypatch.setattr(model_module, "linear", lambda m, x: (
        rows.append(x.shape[:-1].numel()) if m is gen_llama.lm_head else None) or linear(m, x))
    out = generate(gen_llama, prompt, max_new_tokens=5)
    monkeypatch.undo()
    assert rows == [1] * 5  # the prefill and 4 decoding steps (the fifth token needs no forward)
    seq = prompt
    with torch.no_grad():
        for _ in range(5):
            seq = torch.cat([seq, gen_llama(seq[None])[0, -1].argmax().view(1)])
    assert torch.equal(out, seq)


def test_a_session_reuses_the_cached_prefix(gen_llama):
    """A KVSession keeps the cache between calls: a prompt that continues the last sequence (a chat's next turn)
    runs only its new ids through the model, one that departs from it midway only the ids from there, and the
    tokens are those of a call without a session each time, also when the cache had to grow; an interrupted call
    leaves nothing to reuse; the model holds no cache between calls."""
    from lit_qlora.generation import KVSession

    fed = []
    hook = gen_llama.transformer.wte.register_forward_hook(lambda m, args, out: fed.append(args[0].numel()))
    session = KVSession()
    try:
        first = generate(gen_llama, random_tokens(9, seed=5), max_new_tokens=4, session=session)
        assert fed == [9, 1, 1, 1] and gen_llama.kv_caches is None
        capacity = session.caches[0].k.size(2)
        turn = torch.cat([first, random_tokens(3, seed=6)])  # the next message after the reply
        fed.clear()
        second = generate(gen_llama, turn, max_new_tokens=4, session=session)
        assert fed[0] == 4 and session.caches[0].k.size(2) > capacity  # the reply's last token + 3; grown and copied
        assert torch.equal(second, generate(gen_llama, turn, max_new_tokens=4))
        edited = second.clone()
        edited[6] = (edited[6] + 1) % gen_llama.config.vocab_size  # a conversation rendered differently from id 6
        fed.clear()
        third = generate(gen_llama, edited, max_new_tokens=3, session=session)
        assert fed[0] == len(edited) - 6
        assert torch.equal(third, generate(gen_llama, edited, max_new_tokens=3))

        def interrupt(token):
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            generate(gen_llama, third, max_new_tokens=3, session=session, on_token=interrupt)
        assert session.reusable(third) == 0 and gen_llama.kv_caches is None
        fed.clear()
        assert torch.equal(generate(gen_llama, third, max_new_tokens=3, session=session),
                           generate(gen_llama, third, max_new_tokens=3))
        assert fed[0] == len(third)
    finally:
        hook.remove()
