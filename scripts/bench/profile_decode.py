"""Profile: where the time of one decoding step (batch 1, one new token with the KV cache) goes, by part of the model.

    python scripts/bench/profile_decode.py --checkpoint_dir /tmp/bench-generate-XXXX --quantize bnb.nf4
    python scripts/bench/profile_decode.py --checkpoint_dir ... --quantize none --precision 32-true

Loads the model as generate/*.py does (4-bit output layer, a tied embedding read from it, the decode kernel), fills
the KV cache with a `--prompt_len`-token prompt, then times `--steps` decoding steps, with a wall-clock timer around
each part of every block: the norms, the projections (dense, or the 4-bit kernel and its call), rotary embedding, the
KV cache update, attention and the MLP. Parts nest (an "attn" includes its "qkv", "rope", ...);
"outside" is the step's time not inside any block, embedding or output layer. The timers add about 1 us per part
call. Prints figures only (not a test); `scripts/bench/bench_generate.py` measures tokens/s without timers.
"""
from __future__ import annotations

import collections
import time
from pathlib import Path

import torch

import lit_qlora.model as gpt_module
from lit_qlora.inference import fast_cpu_4bit_decoding
from lit_qlora.loader import load_model
from lit_qlora.precision import autocast_for
from lit_qlora.utils import run_cli


def timed(spent: collections.Counter, label: str, fn):
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        spent[label] += time.perf_counter() - t0
        return out
    return call


def main(checkpoint_dir: Path, precision: str = "bf16-true", quantize: str = "bnb.nf4", prompt_len: int = 16,
         steps: int = 100, threads: int = 1) -> None:
    """Time `steps` decoding steps part by part, after a `prompt_len`-token prompt, with `threads` torch threads (0:
    torch's default). `quantize`: a --quantize mode, or none."""
    if threads:
        torch.set_num_threads(threads)
    mode = None if quantize == "none" else quantize
    model = load_model(checkpoint_dir, precision=precision, quantize=mode, quantize_lm_head=True,
                       embedding_from_head=True).eval()
    on_kernel = fast_cpu_4bit_decoding(model) if mode else 0

    spent: collections.Counter = collections.Counter()
    # Every projection goes through model.linear (dense or 4-bit): one timer there, labelled by the layer it runs
    labels = {id(model.lm_head): "output layer"}
    for block in model.transformer.h:  # instance attributes shadow the class's methods, for this model only
        labels[id(block.attn.qkv)], labels[id(block.attn.proj)] = "attn: qkv", "attn: proj"
        for layer in block.mlp.children():
            labels[id(layer)] = "mlp: projections"
        parts = [(block, "forward", "block"), (block.attn, "forward", "attn"), (block.norm_1, "forward", "norms"),
                 (block.attn, "attend", "attn: attention"), (block.mlp, "forward", "mlp")]
        if block.norm_2 is not None:
            parts.append((block.norm_2, "forward", "norms"))
        for obj, name, label in parts:
            setattr(obj, name, timed(spent, label, getattr(obj, name)))
    for obj, label in ((model.transformer.wte, "embedding"), (model.transformer.ln_f, "final norm")):
        obj.forward = timed(spent, label, obj.forward)
    rope, update, linear = gpt_module.apply_rope, gpt_module.KVCache.update, gpt_module.linear

    def timed_linear(module, x):
        t0 = time.perf_counter()
        out = linear(module, x)
        spent[labels.get(id(module), "other projections")] += time.perf_counter() - t0
        return out

    gpt_module.apply_rope = timed(spent, "attn: rope", rope)
    gpt_module.KVCache.update = timed(spent, "attn: kv cache update", update)
    gpt_module.linear = timed_linear
    try:
        vocab = model.config.vocab_size
        prompt = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(1))
        with autocast_for(precision, torch.device("cpu")), torch.inference_mode():
            model.set_kv_cache(1, prompt_len + steps + 8)
            model(prompt, input_pos=torch.arange(prompt_len))
            for i in range(8):  # warm-up steps: first calls map code and size buffers
                model(torch.tensor([[i]]), input_pos=torch.tensor([prompt_len + i]))
            spent.clear()
            t0 = time.perf_counter()
            for i in range(steps):
                pos = prompt_len + 8 + i
                model(torch.tensor([[(7 * i) % vocab]]), input_pos=torch.tensor([pos]))
            wall = time.perf_counter() - t0
    finally:
        gpt_module.apply_rope, gpt_module.KVCache.update, gpt_module.linear = rope, update, linear
    n = steps
    print(f"{model.config.name}: {quantize}, {precision}, {torch.get_num_threads()} thread(s), "
          f"{on_kernel} layers on the 4-bit decode kernel; {n} steps after a {prompt_len}-token prompt")
    print(f"| part | ms per token | share |\n|---|---|---|\n| step (wall) | {1e3 * wall / n:.2f} | 100% |")
    rows = dict(spent)
    rows["outside"] = wall - sum(rows.get(k, 0.0) for k in ("block", "embedding", "output layer", "final norm"))
    for label, s in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"| {label} | {1e3 * s / n:.2f} | {100 * s / wall:.0f}% |")


if __name__ == "__main__":
    run_cli(main)
