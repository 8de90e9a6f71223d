"""Batch inference (generate/batch.py): every row of a data file through the batched engine into a JSONL file, each
input row with its generated text, token counts and finish reason; a rerun continues where the last one stopped.

A row asks for a continuation of a conversation ("messages" or "conversations", rendered with the chat template and
its generation prompt), or of a prompt ("prompt", or Alpaca's "instruction" and "input", rendered as the adapter
was trained: `inference.encode_prompt`). A row that cannot run (not an object, no prompt, too long for the model, an
unknown adapter) is one line on stderr naming it and an output line with its "error"; the other rows go on.
"""
from __future__ import annotations

import json
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from lit_qlora.data.records import is_conversation_record, normalize_conversation, what_value
from lit_qlora.engine import Engine, Sampling, choice_seed
from lit_qlora.utils import UserError

OUT_KEYS = ("row", "finish_reason", "prompt_tokens", "completion_tokens", "error")


def prompt_of(rec: Any, where: str, column: str = "prompt") -> tuple[str, Any]:
    """("messages", [{role, content}, ...]) or ("prompt", (text, input)) of a generation row."""
    if not isinstance(rec, dict):
        raise UserError(f"{where} is a {type(rec).__name__}, not an object; give each row a \"{column}\" text or a "
                        "\"messages\" list")
    if is_conversation_record(rec):
        return "messages", normalize_conversation(rec, 0, "", need_reply=False, where=where)
    for key in (column, "instruction"):
        if key in rec:
            text, extra = rec[key], rec.get("input") if key == "instruction" else ""
            if not isinstance(text, str) or not isinstance(extra, (str, type(None))):
                bad = text if not isinstance(text, str) else extra
                raise UserError(f"{where}: \"{key}\" is {what_value(bad)}, not text; write the prompt as a string")
            return "prompt", (text, extra or "")
    raise UserError(f"{where} has no \"{column}\", \"instruction\" or \"messages\" (it has: "
                    f"{', '.join(map(str, rec)) or 'nothing'}); name the prompt column with --prompt_column")


class ResultsFile:
    """The output JSONL, one line per input row (`row`: its number in the input, from 1). Rows already in it are
    skipped by a rerun; a last line cut off by a killed run is dropped first. Lines are appended and flushed one at
    a time, so a kill loses at most the rows in flight."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.done: set[int] = set()
        if self.path.is_file():
            data = self.path.read_bytes()
            keep = data.rfind(b"\n") + 1  # whole lines only
            for i, line in enumerate(data[:keep].splitlines(), start=1):
                try:
                    self.done.add(int(json.loads(line)["row"]))
                except (ValueError, KeyError, TypeError):
                    raise UserError(f"line {i} of {self.path} is not a row this script wrote; pass another "
                                    "--out_file, or remove that file to start over") from None
            if keep < len(data):
                with open(self.path, "r+b") as f:
                    f.truncate(keep)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class Progress:
    """One line on stderr, rewritten as rows finish: rows done of all, new tokens per second, time left."""

    def __init__(self, total: int, skipped: int) -> None:
        self.total, self.done, self.tokens, self.t0 = total, skipped, 0, time.perf_counter()
        self.first = skipped

    def step(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        elapsed = time.perf_counter() - self.t0
        rate = (self.done - self.first) / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else float("nan")
        eta = f"{int(left // 60)}m{int(left % 60):02d}s" if left == left else "?"
        print(f"\rrows {self.done}/{self.total} | {self.tokens / max(elapsed, 1e-9):.1f} tokens/s | ETA {eta}   ",
              end="", file=sys.stderr, flush=True)


def run_batch(engine: Engine, rows: Iterable[tuple[Any, str]], encode: Callable[[Any, str], tuple],
              decode: Callable[[list[int]], str], sampling: Sampling, num_samples: int, out: ResultsFile,
              output_column: str = "generated", total: Optional[int] = None) -> int:
    """Every (record, where) of `rows` not yet in `out` through `engine`: `encode(record, where)` gives (ids, stop
    ids, adapter) or raises a UserError (that row's error line). Up to 4 x max_batch rows are in flight; their lines
    are written in input order. `num_samples` > 1: the text, finish reason and token counts are lists (sample i
    drawn with `choice_seed(seed, i)`, as generate/lora.py --num_samples draws). Returns the new tokens made."""
    pending: deque = deque()  # (row number, record, sequences or the error)
    progress = Progress(total or 0, len(out.done))
    window = 4 * engine.max_batch

    def flush() -> None:
        while pending and (isinstance(pending[0][2], str) or all(s.finish_reason for s in pending[0][2])):
            n, rec, seqs = pending.popleft()
            record = {**rec} if isinstance(rec, dict) else {"input": rec}
            record.update(_result(n, seqs, decode, output_column, num_samples))
            out.write(record)
            progress.step(0 if isinstance(seqs, str) else sum(len(s.new_ids) for s in seqs))

    for n, (rec, where) in enumerate(rows, start=1):
        if n in out.done:
            continue
        try:
            clash = sorted({output_column, *OUT_KEYS} & set(rec)) if isinstance(rec, dict) else []
            if clash:
                raise UserError(f"{where} has a column {clash[0]!r}, which the output line would overwrite; "
                                "rename it in the data (or pick another --output_column)")
            ids, stops, adapter = encode(rec, where)
            limit = engine.model.config.block_size - len(ids)
            one = Sampling(**{**sampling.__dict__, "stop_ids": tuple(stops),
                              "max_new_tokens": max(1, min(sampling.max_new_tokens, limit))})
            seqs = [engine.submit(ids, Sampling(**{**one.__dict__, "seed": choice_seed(one.seed or 0, i)}), adapter)
                    for i in range(num_samples)]
        except UserError as e:
            print(f"\n{e}; the row is written with this error", file=sys.stderr)
            seqs = str(e)
        pending.append((n, rec, seqs))
        while len(pending) >= window:
            engine.step()
            flush()
    while engine.busy:
        engine.step()
        flush()
    flush()
    print(file=sys.stderr)
    return progress.tokens


def _result(n: int, seqs: Any, decode: Callable, column: str, num_samples: int) -> dict:
    if isinstance(seqs, str):
        return {"row": n, "error": seqs}
    texts = [decode([t for t in s.new_ids if t not in s.stop_ids]) for s in seqs]
    fields = {column: texts, "finish_reason": [s.finish_reason for s in seqs],
              "prompt_tokens": seqs[0].prompt_len, "completion_tokens": [len(s.new_ids) for s in seqs]}
    if num_samples == 1:
        fields = {k: v[0] if isinstance(v, list) else v for k, v in fields.items()}
    return {"row": n, **fields}
