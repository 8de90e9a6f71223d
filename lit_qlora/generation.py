"""Autoregressive generation with the KV cache: one prefill pass over the prompt, then one token per step."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from lit_qlora.utils import UserError


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Pick the next token from `logits` [V]: argmax when temperature is 0, else sample. Returns a LongTensor [1]."""
    if temperature <= 0:
        # in fp32: the same index (the conversion is exact, ties go to the first), and torch's CPU argmax of a
        # 16-bit vector takes 3-4x as long (49152 bf16 logits: 178 against 49 us, a 1% of a 4-bit decoding step)
        return logits.float().argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # nucleus: keep the most likely tokens whose cumulative probability reaches top_p (always at least one)
        sorted_logits, order = torch.sort(logits, descending=True)
        p = sorted_logits.softmax(-1)
        drop = p.cumsum(-1) - p >= top_p  # the more likely tokens already cover top_p
        drop[0] = False
        logits = logits.masked_fill(torch.empty_like(drop).scatter_(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    if generator is not None:  # the generator draws on its own device
        return torch.multinomial(probs.to(generator.device), 1, generator=generator).to(logits.device)
    return torch.multinomial(probs, 1)


class KVSession:
    """A model's KV cache kept between `generate` calls, and the ids whose keys and values it holds: a call whose
    prompt starts with those ids (a chat's next turn: the conversation so far, rendered again, plus the new message)
    runs the prefill over the rest only, so a turn's latency no longer grows with the conversation."""

    def __init__(self) -> None:
        self.ids: Optional[torch.Tensor] = None  # 1-D, on the model's device
        self.caches: Optional[list] = None  # the model's KV caches (model.kv_caches) holding them, between calls

    def reusable(self, prompt: torch.Tensor) -> int:
        """How many leading prompt ids are in the cache already (at most all but the last: its logits are needed)."""
        if self.ids is None or self.caches is None:
            return 0
        n = min(len(self.ids), len(prompt) - 1)
        differ = (self.ids[:n] != prompt[:n]).nonzero()
        return int(differ[0]) if len(differ) else n


def _cache_for(model, session: Optional[KVSession], keep: int, needed: int, device) -> None:
    """Gives the model a KV cache of at least `needed` positions whose first `keep` are the session's (its own, or
    a copy into a larger one when it is too short: room for twice as many, up to the model's context)."""
    caches = session.caches if session is not None else None
    if caches is not None and caches[0].k.size(2) >= needed:
        model.kv_caches = caches
        return
    size = needed if caches is None else min(model.config.block_size, max(needed, 2 * caches[0].k.size(2)))
    model.set_kv_cache(batch_size=1, max_seq_length=size, device=device)
    for old, new in zip(caches or [], model.kv_caches):
        new.k, new.v = new.k.to(old.k.dtype), new.v.to(old.v.dtype)
        new.k[:, :, :keep] = old.k[:, :, :keep]
        new.v[:, :, :keep] = old.v[:, :, :keep]


@torch.inference_mode()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None, eos_ids: Sequence[int] = (), generator: Optional[torch.Generator] = None,
             on_token: Optional[Callable[[int], None]] = None, session: Optional[KVSession] = None) -> torch.Tensor:
    """Continue the 1-D `prompt` by up to `max_new_tokens` tokens; returns prompt + new tokens (an eos token included).

    `on_token(id)` is called as soon as each new token is chosen (for streaming). With a `session` the KV cache
    outlives the call and the prompt's ids already in it are not computed again (see `KVSession`).
    """
    T = prompt.size(0)
    limit = model.config.block_size
    if T + max_new_tokens > limit:
        raise UserError(f"the prompt ({T} tokens) plus max_new_tokens={max_new_tokens} exceed the model's context of "
                        f"{limit} "
                        "tokens; shorten the prompt or lower --max_new_tokens")
    device = model.transformer.ln_f.weight.device
    prompt = prompt.to(device)
    eos = set(eos_ids)
    keep = session.reusable(prompt) if session is not None else 0
    _cache_for(model, session, keep, T + max_new_tokens, device)
    if session is not None:  # until this call ends well: an interrupted one leaves the cache half written
        session.ids, session.caches = None, None
    try:
        # Why only the last position through the output layer: the prompt's other logits are never used, and they
        # cost the output layer's matmul T times over and [T, vocab] of memory (200 MB at bf16 for 2000 tokens of a
        # 49k vocabulary, 600 MB with 152k)
        last = torch.zeros(1, T - keep, dtype=torch.bool, device=device)
        last[0, -1] = True
        logits = model(prompt[keep:].view(1, T - keep), input_pos=torch.arange(keep, T, device=device),
                       output_mask=last)[0]
        tokens = [prompt]
        for step in range(max_new_tokens):
            token = sample(logits, temperature, top_k, top_p, generator)
            tokens.append(token)
            if on_token is not None:
                on_token(int(token))
            if int(token) in eos or step == max_new_tokens - 1:
                break
            logits = model(token.view(1, 1), input_pos=torch.tensor([T + step], device=device))[0, -1]
        out = torch.cat(tokens)
        if session is not None:  # (the last token was never fed through the model)
            session.ids, session.caches = out[:-1], model.kv_caches
    finally:
        model.clear_kv_cache()  # a session holds its own cache: the model keeps no state between calls
    return out
