"""Training samples of a source larger than memory: read in file order and tokenized ahead by a worker thread into a
bounded buffer, epoch after epoch, resumable at the next sample not yet handed out.

`SampleStream(source, tokenize)` yields tokenized samples ({"input_ids", "labels"}) while at most `buffer` of them
wait; `state_dict()` says where the next one starts (epoch, file, `records.Place`), and a stream built with that state
goes on from there without reading what came before where the format allows (a JSONL file is entered at a byte
offset, a parquet file skips its row groups before it unread). `stream_batches` collates them, `batch_size` at a time.
Not yet wired to finetune/lora.py (`--streaming`): this is the data side.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from lit_qlora.batching import collate
from lit_qlora.prepare import DataSettings, TokenizerLike, checked_records, prepare_samples, resolve_template
from lit_qlora.records import is_conversation_record, iter_rows_from, with_messages_column
from lit_qlora.sources import Source
from lit_qlora.utils import UserError

RowsFrom = Callable[[dict], Iterator[tuple[Path, int, Any, dict]]]  # state -> (file, row, record, state after it)


def source_rows_from(source: Source) -> RowsFrom:
    """The rows of `source` from a stream state on, each with the state after it (epochs not counted here)."""
    def rows(state: dict) -> Iterator[tuple[Path, int, Any, dict]]:
        paths = [source.dataset] if source.dataset is not None else list(source.files)
        first, place = state.get("file", 0), tuple(state.get("place", (0, 0, 0)))
        for i in range(first, len(paths)):
            for row, rec, after in iter_rows_from(paths[i], source.split, place if i == first else (0, 0, 0)):
                yield paths[i], row, rec, {"file": i, "place": list(after)}
    return rows


def record_tokenizer(tokenizer: TokenizerLike, s: DataSettings) -> Callable[[Path, int, Any], Optional[dict]]:
    """One record -> its sample as `prepare` makes it (None when truncation leaves nothing to learn). The template is
    resolved from the first record given (conversations: chat)."""
    resolved: list[DataSettings] = []

    def tokenize(path: Path, row: int, rec: Any) -> Optional[dict]:
        rec = with_messages_column(rec, s.messages_column, f"row {row} of {path}")
        if not resolved:
            resolved.append(replace(s, template=resolve_template(s.template, is_conversation_record(rec), tokenizer,
                                                                 path)))
        samples, _ = prepare_samples(checked_records([(path, row, rec)], resolved[0]), tokenizer, resolved[0],
                                     allow_empty=True)
        return samples[0] if samples else None
    return tokenize


class SampleStream:
    """Samples of `rows` (see `source_rows_from`), tokenized by `tokenize` in a worker thread at most `buffer` ahead,
    epoch after epoch (`max_epochs` None: endless). Iterate it for samples; `state_dict()` resumes after the last one
    handed out. An error in the worker (a bad row) is raised where the sample would have been."""

    def __init__(self, rows: RowsFrom, tokenize: Callable[[Path, int, Any], Optional[dict]], buffer: int = 256,
                 state: Optional[dict] = None, max_epochs: Optional[int] = None) -> None:
        if buffer < 1:
            raise UserError(f"the stream buffer must hold at least 1 sample, got {buffer}")
        self.rows, self.tokenize, self.max_epochs = rows, tokenize, max_epochs
        self.state = {"epoch": 0, "file": 0, "place": [0, 0, 0], **(state or {})}
        self._queue: queue.Queue = queue.Queue(maxsize=buffer)
        self._stop = threading.Event()
        self._worker: Optional[threading.Thread] = None

    def _work(self) -> None:
        state = dict(self.state)
        try:
            while self.max_epochs is None or state["epoch"] < self.max_epochs:
                whole_epoch, n = state["file"] == 0 and list(state["place"]) == [0, 0, 0], 0
                for path, row, rec, after in self.rows(state):
                    state = {"epoch": state["epoch"], **after}
                    sample = self.tokenize(path, row, rec)
                    if sample is not None:
                        n += 1
                        if not self._put(("sample", sample, dict(state))):
                            return
                if whole_epoch and not n:
                    raise UserError("the streamed source gives no samples (no records, or none with a response "
                                    "within max_seq_length); add records or raise --max_seq_length")
                state = {"epoch": state["epoch"] + 1, "file": 0, "place": [0, 0, 0]}
            self._put(("end", None, state))
        except BaseException as e:  # handed to the consumer, raised there
            self._put(("error", e, state))

    def _put(self, item: tuple) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[dict]:
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, daemon=True, name="lit-qlora-stream")
            self._worker.start()
        while True:
            kind, value, state = self._queue.get()
            if kind == "error":
                raise value
            self.state = state
            if kind == "end":
                return
            yield value

    def state_dict(self) -> dict:
        """Where the next sample starts: epoch, file (index in the source), place in that file."""
        return {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in self.state.items()}

    def close(self) -> None:
        self._stop.set()
        if self._worker is not None:
            self._worker.join(timeout=5)


def stream_batches(stream: SampleStream, batch_size: int, pad_id: int = 0,
                   ignore_index: int = -100) -> Iterator[dict]:
    """Batches of `batch_size` consecutive samples of a stream, collated as `BatchStream` collates them."""
    batch: list[dict] = []
    for sample in stream:
        batch.append(sample)
        if len(batch) == batch_size:
            yield collate(batch, pad_id=pad_id, ignore_index=ignore_index)
            batch = []
    if batch:
        yield collate(batch, pad_id=pad_id, ignore_index=ignore_index)
