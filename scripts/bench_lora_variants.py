"""LoRA variants side by side on the same batches: iteration-1 loss of plain nf4-dq vs PiSSA vs LoftQ vs the
unquantized model (the quantization-aware starts should land nearer the unquantized loss), and for plain LoRA, rsLoRA,
DoRA and LoRA+ on nf4-dq the loss after --iters iterations, the median step time and the peak RSS.

    python scripts/bench_lora_variants.py [--iters 40] [--checkpoint_dir DIR --data_dir DIR]

Each row is one `finetune/lora.py` run (the demo model and data by default, the same seed, so the same batches),
its figures read from its BENCH_JSON line and metrics. Name the CPU beside the figures you report.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: extra flags (every run: the demo preset's model and data, --lora_head off so every init applies)
RUNS = {
    "unquantized": ["--quantize", "none"],
    "nf4-dq": [],
    "nf4-dq pissa": ["--lora_init", "pissa"],
    "nf4-dq loftq (1 step)": ["--lora_init", "loftq", "--loftq_iters", "1"],
    "nf4-dq loftq (4 steps)": ["--lora_init", "loftq", "--loftq_iters", "4"],
    "nf4-dq rslora": ["--lora_rslora", "true"],
    "nf4-dq dora": ["--lora_dora", "true"],
    "nf4-dq lora+ (16)": ["--loraplus_lr_ratio", "16", "--learning_rate", "0.0015"],
}


def run(name: str, flags: list[str], iters: int, out: Path, base: list[str]) -> dict:
    cmd = [sys.executable, str(ROOT / "finetune" / "lora.py"), *base, "--out_dir", str(out), "--max_iters",
           str(iters), "--eval_iters", "0", "--micro_batch_size", "2", "--template", "plain", "--warmup_steps", "0",
           "--lora_head", "false", "--lora_dropout", "0", "--precision", "32-true", "--quantize", "bnb.nf4-dq",
           "--save_interval", str(iters), "--bench_json", "true", *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"{name}: finetune failed:\n{r.stderr[-2000:]}")
    bench = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("BENCH_JSON "))[11:])
    metrics = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").is_file() else {}
    times = bench["iter_times"][1:] or bench["iter_times"]  # the first step includes one-time work
    return dict(first=bench["losses"][0], last=bench["losses"][-1], step_ms=1000 * statistics.median(times),
                peak=metrics.get("peak_memory_gb"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--checkpoint_dir", default=None)
    p.add_argument("--data_dir", default=None)
    a = p.parse_args()
    base = [] if a.checkpoint_dir is None else ["--checkpoint_dir", a.checkpoint_dir, "--data_dir", a.data_dir]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in RUNS.items():
            rows[name] = run(name, flags, a.iters, Path(tmp) / name.replace(" ", "_"), base)
            print(f"{name:24s} done", file=sys.stderr)
    ref, plain = rows["unquantized"], rows["nf4-dq"]
    print(f"{'run':24s} {'loss@1':>8s} {'|-unq|':>8s} {f'loss@{a.iters}':>9s} {'step ms':>8s} {'x plain':>8s} "
          f"{'peak GB':>8s}")
    for name, r in rows.items():
        peak = f"{r['peak']:.2f}" if r["peak"] else "-"
        print(f"{name:24s} {r['first']:8.4f} {abs(r['first'] - ref['first']):8.4f} {r['last']:9.4f} "
              f"{r['step_ms']:8.1f} {r['step_ms'] / plain['step_ms']:8.2f} {peak:>8s}")


if __name__ == "__main__":
    main()
