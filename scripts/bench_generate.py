"""Benchmark: batch-1 decoding speed and peak memory for every --quantize value (prints figures; not a test).

    python scripts/bench_generate.py                      # ~150M-parameter Llama-shaped model, 128 new tokens
    python scripts/bench_generate.py --n_layer 12 --n_embd 1024 --new_tokens 128

A random-weight checkpoint (bf16 on disk) is written once, then each setting runs in its own process so its
peak RSS is its own. Decoding uses the same path as generate/*.py (KV cache; 4-bit layers in bitsandbytes' packed
CPU inference layout unless `nopack` is in the setting's name).
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lit_qlora.checkpoint import LIT_WEIGHTS, lit_param_shapes
from lit_qlora.config import Config
from lit_qlora.convert import write_random_checkpoint
from lit_qlora.utils import run_cli

SETTINGS = ["none", "bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8", "bnb.nf4:nopack"]


def child(folder: str, setting: str, precision: str, new_tokens: int, prompt_len: int) -> None:
    """One setting: load, warm up, decode `new_tokens` greedily; print one JSON line."""
    from lit_qlora.generation import generate
    from lit_qlora.loader import load_model
    from lit_qlora.quantize import enable_cpu_inference_packing

    quantize, _, flag = setting.partition(":")
    t0 = time.perf_counter()
    model = load_model(Path(folder), precision=precision, quantize=None if quantize == "none" else quantize).eval()
    load_s = time.perf_counter() - t0
    if quantize != "none" and flag != "nopack":
        enable_cpu_inference_packing(model, True)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(1))
    generate(model, prompt, 8)  # warm-up (and the one-time repacking of 4-bit weights)
    t0 = time.perf_counter()
    out = generate(model, prompt, new_tokens)
    dt = time.perf_counter() - t0
    n = len(out) - prompt_len
    print(json.dumps(dict(setting=setting, tokens_per_sec=n / dt, new_tokens=n, load_s=load_s,
                          peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)))


def main(n_layer: int = 12, n_embd: int = 768, n_head: int = 12, n_query_groups: int = 4, intermediate_size: int = 2048,
         vocab_size: int = 32000, new_tokens: int = 128, prompt_len: int = 16, precision: str = "bf16-true",
         settings: str = ",".join(SETTINGS), out_dir: str = "") -> None:
    """Write the model, then measure each setting in a fresh process."""
    config = Config(name="bench-llama", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_query_groups=n_query_groups,
                    intermediate_size=intermediate_size, vocab_size=vocab_size, block_size=1024)
    folder = Path(out_dir or tempfile.mkdtemp(prefix="bench-generate-"))
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / LIT_WEIGHTS).is_file():
        write_random_checkpoint(folder, config)
    params = sum(s.numel() for s in lit_param_shapes(config).values())
    print(f"model: {params / 1e6:.0f}M parameters ({n_layer} layers, n_embd {n_embd}), bf16 on disk; {precision}, "
          "batch 1, "
          f"prompt {prompt_len} tokens, {new_tokens} new tokens, torch threads {torch.get_num_threads()}")
    rows = []
    for setting in settings.split(","):
        r = subprocess.run([sys.executable, __file__, "child", str(folder), setting, precision, str(new_tokens),
                            str(prompt_len)],
                           capture_output=True, text=True)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode or not lines:
            print(f"{setting}: FAILED\n{r.stderr[-2000:]}")
            continue
        rows.append(json.loads(lines[-1]))
    base = next((r["tokens_per_sec"] for r in rows if r["setting"] == "none"), None)
    print("\n| setting | tokens/s | vs bf16 | peak RSS GB | load s |\n|---|---|---|---|---|")
    for r in rows:
        rel = f"{r['tokens_per_sec'] / base:.2f}x" if base else "-"
        name = "bf16 (no quantization)" if r["setting"] == "none" else r["setting"]
        print(f"| {name} | {r['tokens_per_sec']:.1f} | {rel} | {r['peak_rss_gb']:.2f} | {r['load_s']:.1f} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    else:
        run_cli(main)
