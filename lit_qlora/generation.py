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


@torch.inference_mode()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None, eos_ids: Sequence[int] = (), generator: Optional[torch.Generator] = None,
             on_token: Optional[Callable[[int], None]] = None) -> torch.Tensor:
    """Continue the 1-D `prompt` by up to `max_new_tokens` tokens; returns prompt + new tokens (an eos token included).

    `on_token(id)` is called as soon as each new token is chosen (for streaming).
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
    model.set_kv_cache(batch_size=1, max_seq_length=T + max_new_tokens, device=device)
    try:
        # Why only the last position through the output layer: the prompt's other logits are never used, and they
        # cost the output layer's matmul T times over and [T, vocab] of memory (200 MB at bf16 for 2000 tokens of a
        # 49k vocabulary, 600 MB with 152k)
        last = torch.zeros(1, T, dtype=torch.bool, device=device)
        last[0, -1] = True
        logits = model(prompt.view(1, T), input_pos=torch.arange(T, device=device), output_mask=last)[0]
        tokens = [prompt]
        for step in range(max_new_tokens):
            token = sample(logits, temperature, top_k, top_p, generator)
            tokens.append(token)
            if on_token is not None:
                on_token(int(token))
            if int(token) in eos or step == max_new_tokens - 1:
                break
            logits = model(token.view(1, 1), input_pos=torch.tensor([T + step], device=device))[0, -1]
    finally:
        model.clear_kv_cache()
    return torch.cat(tokens)
