"""Time to the first optimizer step and peak RSS of finetune/lora.py on a large record source: prepared (every record
tokenized and cached before the first step, what --data_dir does) vs streamed (--streaming true: tokenized ahead in a
bounded buffer as it trains).

    python scripts/bench/bench_data.py --sizes_mb 200,2048 --formats jsonl,parquet --modes streamed
    python scripts/bench/bench_data.py --sizes_mb 50,200 --formats jsonl --modes prepared

Generates instruction records (about 0.2 KB of JSON, ~160 demo tokens each) of each size as JSONL, or as parquet
holding the same records (smaller on disk: its size is printed), in a temporary folder (--work) deleted at the end;
builds the demo model (random weights) and tokenizer once (tiny, so the data path dominates; the tokenizer is a real
BPE, `tokenizers`); then runs finetune/lora.py once per (format, size, mode) as a fresh process: 1 iteration, micro
batch 4, --max_seq_length 256, no validation (--eval_iters 0), 32-true, no quantization. Each line: seconds from the
process start to its "Training" line (startup, model, data), to its "iter 1" line (`first_step_s`: the first optimizer
step done) and to its exit, and the process's peak RSS (wait4's ru_maxrss). Prepared data needs memory in proportion
to the source (and a cache on disk): mind `free -g` before a large prepared size. Name the CPU next to any figure you
quote; timings need a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "green", "quick", "seven"]


def generate(folder: Path, size_mb: int, fmt: str) -> Path:
    """`folder`/train.<fmt> of about `size_mb` MiB of JSON text (records of ~0.2 KB), and a small val.jsonl beside
    it."""
    rng = random.Random(0)
    folder.mkdir(parents=True)
    path = folder / f"train.{fmt}"
    target, written, batch, writer = size_mb * 2**20, 0, [], None
    with open(path, "w") if fmt == "jsonl" else open(os.devnull, "w") as f:
        while written < target:
            rec = {"instruction": " ".join(rng.choices(WORDS, k=15)), "input": "",
                   "output": " ".join(rng.choices(WORDS, k=15))}
            line = json.dumps(rec) + "\n"
            written += len(line)
            if fmt == "jsonl":
                f.write(line)
            else:
                batch.append(rec)
                if len(batch) == 20_000:
                    writer, batch = _write_parquet(path, batch, writer), []
    if fmt == "parquet":
        writer = _write_parquet(path, batch, writer) if batch else writer
        writer.close()
    (folder / "val.jsonl").write_text("".join(json.dumps({"instruction": "alpha beta", "input": "",
                                                          "output": "gamma"}) + "\n" for _ in range(8)))
    return path


def _write_parquet(path: Path, batch: list, writer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(batch)
    writer = writer or pq.ParquetWriter(path, table.schema)
    writer.write_table(table, row_group_size=5_000)
    return writer


def run_finetune(ckpt: Path, data: Path, out: Path, streaming: bool) -> dict:
    """One finetune/lora.py process: seconds to its "Training" line, to its "iter 1" line (the first optimizer step
    done) and to its exit; its peak RSS (GiB)."""
    args = ["--checkpoint_dir", ckpt, "--data_dir", data, "--out_dir", out, "--max_iters", "1", "--eval_iters", "0",
            "--micro_batch_size", "4", "--max_seq_length", "256", "--precision", "32-true", "--save_interval", "1000",
            "--log_interval", "1", "--streaming", str(streaming).lower()]
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, str(ROOT / "finetune" / "lora.py"), *map(str, args)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen: dict = {}
    lines: list[str] = []

    def read() -> None:
        for line in p.stdout:
            lines.append(line)
            for key, start in (("to_training_s", "Training "), ("first_step_s", "iter 1 ")):
                if line.startswith(start) and key not in seen:
                    seen[key] = round(time.perf_counter() - t0, 2)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    _, status, usage = os.wait4(p.pid, 0)
    total = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    reader.join(timeout=10)
    if p.returncode:
        return {"error": "".join(lines)[-600:]}
    return {**seen, "exit_s": round(total, 2), "peak_rss_gb": round(usage.ru_maxrss / 2**20, 3)}  # KiB on Linux


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes_mb", default="200,2048", help="source sizes in MiB of JSON text, comma-separated")
    p.add_argument("--formats", default="jsonl,parquet")
    p.add_argument("--modes", default="streamed,prepared")
    p.add_argument("--work", default=None, help="where the sources are generated (deleted at the end)")
    a = p.parse_args()
    from lit_qlora.demo import ensure_demo_checkpoint

    work = Path(tempfile.mkdtemp(prefix="bench-data-", dir=a.work))
    try:
        ckpt = ensure_demo_checkpoint(work / "demo", pretrain=False)
        for fmt in a.formats.split(","):
            for size in map(int, a.sizes_mb.split(",")):
                folder = work / f"{fmt}-{size}"
                path = generate(folder, size, fmt)
                on_disk = path.stat().st_size / 2**20
                for mode in a.modes.split(","):
                    r = run_finetune(ckpt, folder, work / f"out-{fmt}-{size}-{mode}", mode == "streamed")
                    print(f"{fmt} {size} MiB of JSON ({on_disk:.0f} MiB on disk) {mode}: {json.dumps(r)}", flush=True)
                    shutil.rmtree(work / f"out-{fmt}-{size}-{mode}", ignore_errors=True)
                shutil.rmtree(folder)  # the source and a prepared cache in it
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
