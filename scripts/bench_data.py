"""Time to the first batch and peak RSS of reading a large record source: prepared whole (what --data_dir does today:
every record tokenized and cached before the first step) vs streamed (lit_qlora.streaming: tokenized ahead in a
bounded buffer).

    python scripts/bench_data.py --size_mb 200 --format jsonl
    python scripts/bench_data.py --size_mb 200 --format parquet --modes streamed

Generates instruction records (about 1 KB each) of `--size_mb` as JSON text (a parquet file of them is smaller:
its size is printed) in a temporary folder, then runs each mode in a fresh
interpreter and prints one line per mode: seconds to the first batch, peak RSS (ru_maxrss), samples read. The
tokenizer is a byte-level stand-in (one id per UTF-8 byte), so the figures are the data path's (reading, checking,
tokenizing, caching), not a BPE tokenizer's speed. Name the CPU next to any figure you quote.
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class ByteTokenizer:
    """One id per UTF-8 byte (+3), bos 1, eos 2: the `TokenizerLike` preparing needs."""

    bos_id, eos_id, fingerprint, chat_template = 1, 2, "bytes", None

    def encode(self, text: str, bos=None, eos: bool = False, max_length: int = -1):
        import torch

        ids = ([1] if bos is not False else []) + [3 + b for b in text.encode("utf-8")] + ([2] if eos else [])
        return torch.tensor(ids[:max_length] if max_length > 0 else ids, dtype=torch.long)


def generate(folder: Path, size_mb: int, fmt: str) -> Path:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "green", "quick", "seven"]
    path = folder / "data" / f"train.{fmt}"
    path.parent.mkdir(parents=True)
    target, written, batch = size_mb * 2**20, 0, []
    writer = None
    with open(path, "w") if fmt == "jsonl" else open(path.with_suffix(".tmp"), "w") as f:
        while written < target:
            rec = {"instruction": " ".join(rng.choices(words, k=80)), "input": "",
                   "output": " ".join(rng.choices(words, k=80))}
            line = json.dumps(rec) + "\n"
            written += len(line)
            if fmt == "jsonl":
                f.write(line)
            else:
                batch.append(rec)
                if len(batch) == 20_000:
                    writer = _write_parquet(path, batch, writer)
                    batch = []
    if fmt == "parquet":
        path.with_suffix(".tmp").unlink()
        writer = _write_parquet(path, batch, writer) if batch else writer
        writer.close()
    return path


def _write_parquet(path: Path, batch: list, writer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(batch)
    writer = writer or pq.ParquetWriter(path, table.schema)
    writer.write_table(table, row_group_size=5_000)
    return writer


def child(mode: str, path: Path, batches: int) -> None:
    from lit_qlora.prepare import DataSettings, ensure_prepared
    from lit_qlora.sources import Source
    from lit_qlora.streaming import SampleStream, record_tokenizer, source_rows_from, stream_batches

    tok, s = ByteTokenizer(), DataSettings(512, template="plain", test_split_fraction=0.0)
    t0 = time.perf_counter()
    if mode == "prepared":
        from lit_qlora.batching import BatchStream

        train, _, _ = ensure_prepared(path.parent, tok, DataSettings(512, template="plain"))
        stream = BatchStream(train, batch_size=8, seed=0)
        first = next(stream)
        t_first = time.perf_counter() - t0
        for _ in range(batches - 1):
            next(stream)
        n = len(train)
    else:
        samples = SampleStream(source_rows_from(Source((path,))), record_tokenizer(tok, s), buffer=256)
        it = stream_batches(samples, 8)
        first = next(it)
        t_first = time.perf_counter() - t0
        for _ in range(batches - 1):
            next(it)
        n = batches * 8
        samples.close()
    assert first["input_ids"].shape[0] == 8
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(json.dumps({"mode": mode, "first_batch_s": round(t_first, 2), "peak_rss_gb": round(rss, 3),
                      "samples": n, "batches": batches}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size_mb", type=int, default=200)
    p.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    p.add_argument("--modes", default="streamed,prepared")
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.child[0], Path(a.child[1]), a.batches)
    with tempfile.TemporaryDirectory() as tmp:
        path = generate(Path(tmp), a.size_mb, a.format)
        size = path.stat().st_size / 2**20
        for mode in a.modes.split(","):
            r = subprocess.run([sys.executable, __file__, "--batches", str(a.batches), "--child", mode, str(path)],
                               capture_output=True, text=True)
            out = r.stdout.strip().splitlines()[-1] if r.returncode == 0 else f"failed: {r.stderr.strip()[-300:]}"
            print(f"{a.format} {size:.0f} MB {mode}: {out}", flush=True)


if __name__ == "__main__":
    main()
