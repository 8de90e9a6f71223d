"""Training samples of a source larger than memory: read in file order and tokenized ahead by a worker thread into a
bounded buffer, epoch after epoch, resumable at the next sample not yet handed out.

`SampleStream(source, tokenize)` yields tokenized samples ({"input_ids", "labels"}) while at most `buffer` of them
wait; `state_dict()` says where the next one starts (epoch, file, `records.Place`), and a stream built with that state
goes on from there without reading what came before where the format allows (a JSONL file is entered at a byte
offset, a parquet file skips its row groups before it unread). `stream_batches` collates them, `batch_size` at a time.

`finetune/lora.py --streaming true` reads its data through a `StreamPlan` (`plan_stream`): the training sources (one,
or a mixture drawn by weight), the held-out validation part, and `StreamBatches`, the batches as `BatchStream` makes
them from the same samples in the same order (padded or packed), resumable from `state_dict()`.

The held-out part is decided record by record, never by reading the whole source: a source with a validation file or
split validates on its first records; otherwise a record is held out when a hash of (seed, file name, row) falls in
the first `HELD_OUT` of its range, so the training stream skips it wherever it is, and validation takes the first
held-out records it meets (it reads only as far as it needs them).
"""
from __future__ import annotations

import hashlib
import queue
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from lit_qlora.data.batching import collate, collate_packed, pack_window
from lit_qlora.data.prepare import DataSettings, TokenizerLike, checked_records, prepare_samples, resolve_template
from lit_qlora.data.records import is_conversation_record, iter_rows_from, parquet_rows, with_messages_column
from lit_qlora.data.sources import MixEntry, Source, read_mixture, resolve
from lit_qlora.data.templates import AUTO, CHAT
from lit_qlora.readers import check_fields
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
        for sample, _ in self.pairs():
            yield sample

    def pairs(self) -> Iterator[tuple[dict, dict]]:
        """(sample, the stream state after it)."""
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
            yield value, state

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


# ---- streamed training data (finetune/lora.py --streaming) -----------------------------------------------------------
HELD_OUT = 0.05  # of a source's records, for validation, when it has no validation file (as `prepare` splits)
BUFFER = 256  # samples tokenized ahead, per source


def held_out(path: Path, row: int, seed: int, fraction: float) -> bool:
    """Whether row `row` of the file `path` is held out for validation: decided from (seed, file name, row) alone."""
    if fraction <= 0:
        return False
    h = hashlib.blake2b(f"{seed}\0{Path(path).name}\0{row}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") < fraction * 2**64


def _draw(seed: int, i: int) -> float:
    """The i-th uniform draw of a mixture in [0, 1), from (seed, i) alone: a resumed run needs no generator state."""
    h = hashlib.blake2b(f"mix\0{seed}\0{i}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64


@dataclass(frozen=True)
class StreamPlan:
    """What a streamed run reads (small and picklable: handed to every process). Source k's training rows are those not
    held out (`held_out[k]`: the fraction of its rows held out; 0 when it has a validation file, `val[k]`); with
    several sources (`weights`), each sample is drawn from source k with probability weight k / the weights' sum."""

    sources: tuple[Source, ...]
    val: tuple[Optional[Source], ...]
    held_out: tuple[float, ...]
    settings: DataSettings  # its template resolved
    seed: int
    weights: Optional[tuple[float, ...]] = None  # a mixture's; None: one source, read epoch after epoch
    names: tuple[str, ...] = ()  # a mixture's entry paths, as the --data_sources file names them
    files: tuple[tuple[str, int], ...] = ()  # (name, size) of every training file: resume checks the data is the same

    def describe(self) -> str:
        if self.weights is None:
            return f"{self.sources[0].short_name()} streamed"
        return "a streamed mixture of " + ", ".join(f"{n} ({w:g})" for n, w in zip(self.names, self.weights))

    def training_rows(self, k: int) -> RowsFrom:
        rows, fraction, seed = source_rows_from(self.sources[k]), self.held_out[k], self.seed

        def train(state: dict) -> Iterator[tuple[Path, int, Any, dict]]:
            for path, row, rec, after in rows(state):
                if not held_out(path, row, seed, fraction):
                    yield path, row, rec, after
        return train

    def validation(self, tokenizer: TokenizerLike, n: int) -> list[dict]:
        """The first `n` samples of the held-out part (each source's share of them with a mixture), tokenized now: a
        source's validation file from its start, or the rows held out of its training file as they come."""
        if n < 1:
            return []
        tokenize = record_tokenizer(tokenizer, self.settings)
        share = -(-n // len(self.sources))
        out: list[dict] = []
        for source, val, fraction in zip(self.sources, self.val, self.held_out):
            rows = ((f, r, rec) for f, r, rec in source.rows() if held_out(f, r, self.seed, fraction)) \
                if val is None else val.rows()
            got = 0
            for f, row, rec in rows:
                sample = tokenize(f, row, rec)
                if sample is not None:
                    out.append(sample)
                    got += 1
                    if got == share:
                        break
        if not out:
            source, val = self.sources[0], self.val[0]
            what = (f"the validation file {val}" if val is not None else f"{source} (no validation file, and none "
                    f"of its records falls in the {100 * HELD_OUT:g}% that --seed holds out)")
            if len(self.sources) > 1:
                what = "none of the --data_sources (no validation files, and none of their records falls in the part "\
                       "that --seed holds out)"
            raise UserError(f"{what} gives no validation samples; add a validation file (val.jsonl beside "
                            "train.jsonl) or more records, or set --eval_iters 0")
        return out[:n]

    def batches(self, tokenizer: TokenizerLike, batch_size: int, packing: bool = False,
                max_seq_length: Optional[int] = None, pad_id: int = 0, ignore_index: int = -100,
                buffer: int = BUFFER) -> "StreamBatches":
        tokenize = record_tokenizer(tokenizer, self.settings)

        def open_stream(state: Optional[dict]) -> "_Samples":
            if self.weights is None:
                return _Samples([SampleStream(self.training_rows(0), tokenize, buffer, state)])
            state = state or {}
            subs = state.get("sources") or [None] * len(self.sources)
            return _Samples([SampleStream(self.training_rows(k), record_tokenizer(tokenizer, self.settings), buffer,
                                          subs[k]) for k in range(len(self.sources))],
                            self.weights, self.seed, int(state.get("draws", 0)))
        return StreamBatches(open_stream, batch_size, packing, max_seq_length, pad_id, ignore_index, self)


def plan_stream(data_dir: Optional[Path | str], data_sources: Optional[Path | str], tokenizer: TokenizerLike,
                s: DataSettings, seed: int) -> tuple[StreamPlan, dict]:
    """The `StreamPlan` of --data_dir (or of a --data_sources mixture, by weight) and the data meta finetune records.
    Reads no more than each source's first record (with --template auto: its template) and each parquet file's footer
    (a file cut short is refused now, not mid-run): nothing is tokenized."""
    if data_sources is not None:
        entries = read_mixture(data_sources)
        by_epochs = next((i for i, e in enumerate(entries, start=1) if e.epochs is not None), None)
        if by_epochs:
            raise UserError(f"entry {by_epochs} of --data_sources file {data_sources} gives epochs, which a streamed "
                            "mixture cannot count (the sources' sizes are not read up front); give every entry a "
                            "weight, or leave --streaming out")
    else:
        entries = [MixEntry(str(data_dir), 1.0)]
    flag = "--data_dir" if data_sources is None else f"an entry of --data_sources file {data_sources}"
    resolved = [_raw_source(e.path, flag) for e in entries]
    templates = [_template_of(train, tokenizer, s) for train, _ in resolved]
    if len(set(templates)) > 1:
        named = ", ".join(f"{e.path}: {t}" for e, t in zip(entries, templates))
        raise UserError(f"the --data_sources are rendered with different templates ({named}); one adapter learns one "
                        "format: pass --template chat (conversations and instruction records alike)")
    files = []
    for train, val in resolved:
        for f in train.key_files() + (val.key_files() if val is not None else []):
            if f.suffix.lower() == ".parquet":
                parquet_rows(f)
        files += [(f.name, f.stat().st_size) for f in train.key_files()]
    plan = StreamPlan(tuple(t for t, _ in resolved), tuple(v for _, v in resolved),
                      tuple(0.0 if v is not None else HELD_OUT for _, v in resolved), replace(s, template=templates[0]),
                      seed, tuple(e.weight for e in entries) if data_sources is not None else None,
                      tuple(e.path for e in entries), tuple(files))
    meta = {"template": templates[0], "streaming": True}
    if data_sources is not None:
        meta["data_sources"] = str(data_sources)
    return plan, meta


def _raw_source(path: Path | str, flag: str) -> tuple[Source, Optional[Source]]:
    raw = resolve(path, flag)
    if raw is None:
        prepared = (Path(path) / "train.pt").is_file()
        why = ("it is a prepared folder, tokenized already: leave --streaming out" if prepared else
               "no .json/.jsonl/.csv/.parquet file, no datasets folder")
        raise UserError(f"{path} ({flag}) holds no records to stream ({why}); pass the raw data")
    return raw


def _template_of(source: Source, tokenizer: TokenizerLike, s: DataSettings) -> str:
    """The template a source's records are rendered with: --template as given (a record it cannot render is refused
    when the stream reaches it), or for auto from the source's first record (the only one read before training)."""
    if s.template not in (None, AUTO):
        return resolve_template(s.template, s.template == CHAT, tokenizer, source)
    first = next(iter(source.rows()), None)
    if first is None:
        raise UserError(f"{source} holds no records; add some or pick another source")
    f, row, rec = first
    rec = with_messages_column(rec, s.messages_column, f"row {row} of {f}")
    return resolve_template(s.template, is_conversation_record(rec), tokenizer, source)


class _Samples:
    """(sample, state after it, its epoch) from one SampleStream (epochs kept), or drawn from several by weight (the
    i-th sample from the source `_draw(seed, i)` picks; no epochs: each source starts over on its own)."""

    def __init__(self, streams: list[SampleStream], weights: Optional[tuple[float, ...]] = None, seed: int = 0,
                 draws: int = 0) -> None:
        self.streams, self.seed, self.draws = streams, seed, draws
        self.iters = [s.pairs() for s in streams]
        self.states = [s.state_dict() for s in streams]
        total = sum(weights) if weights else 1.0
        self.bounds = [sum(weights[:k + 1]) / total for k in range(len(weights))] if weights else None

    def __next__(self) -> tuple[dict, dict, Optional[int], int]:
        if self.bounds is None:
            sample, state = next(self.iters[0])
            return sample, state, state["epoch"], 0
        u = _draw(self.seed, self.draws)
        k = next((k for k, b in enumerate(self.bounds) if u < b), len(self.bounds) - 1)
        sample, self.states[k] = next(self.iters[k])
        self.draws += 1
        return sample, {"draws": self.draws, "sources": [dict(s) for s in self.states]}, None, k

    def close(self) -> None:
        for s in self.streams:
            s.close()


def check_stream_state(state: Any, where: str, fix: str) -> None:
    """That a saved `StreamBatches.state_dict()` is one (a UserError naming the part otherwise): a stream state of one
    source (epoch, file, place: three counts) or of a mixture (draws, one such state or null per source), the rows of
    a window given out, the samples per source, the files' (name, size)."""
    check_fields(state, where, {"streaming": "count", "stream": "object", "row": "count", "used": "list",
                                "files": "list"}, ("streaming", "used", "files"), fix)
    if not all(_is_count(u) for u in state["used"]):
        raise UserError(f"{where}: used is not a list of counts; {fix}")
    if not all(isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) and _is_count(f[1])
               for f in state["files"]):
        raise UserError(f"{where}: files is not a list of [name, size]; {fix}")
    stream = state.get("stream")
    subs = [stream] if stream is None or "draws" not in stream else None
    if subs is None:
        check_fields(stream, f"{where}.stream", {"draws": "count", "sources": "list"}, ("draws", "sources"), fix)
        subs = stream["sources"]
    for sub in subs:
        if sub is None:
            continue
        check_fields(sub, f"{where}.stream", {"epoch": "count", "file": "count", "place": "list"},
                     ("epoch", "file", "place"), fix)
        if not (len(sub["place"]) == 3 and all(_is_count(x) for x in sub["place"])):
            raise UserError(f"{where}.stream: place is not three counts (records, byte offset, lines); {fix}")


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class StreamBatches:
    """Batches of a stream of samples as `BatchStream(samples in stream order, shuffle=False)` makes them: `batch_size`
    samples at a time (padded), or with `packing` rows of up to `max_seq_length` tokens packed a window of batches at
    a time (`pack_window`); a batch or window never spans two epochs of one source. Endless. `state_dict()` holds the
    stream state where the current window (or the next batch) starts and the rows of it given out; a stream loaded
    with it re-reads only that window."""

    def __init__(self, open_stream: Callable[[Optional[dict]], _Samples], batch_size: int, packing: bool = False,
                 max_seq_length: Optional[int] = None, pad_id: int = 0, ignore_index: int = -100,
                 plan: Optional[StreamPlan] = None) -> None:
        if packing and not max_seq_length:
            raise ValueError("packing needs max_seq_length, the length of a packed row")
        self.open_stream, self.batch_size, self.packing, self.max_seq_length = open_stream, batch_size, packing, \
            max_seq_length
        self.pad_id, self.ignore_index, self.plan = pad_id, ignore_index, plan
        self.start: Optional[dict] = None  # stream state where the current window / next batch starts
        self.row = 0  # rows of the current window given out
        self.used = [0] * (len(plan.sources) if plan is not None else 1)  # samples given out, per source
        self._samples: Optional[_Samples] = None
        self._pending: Optional[tuple] = None
        self._rows: Optional[list] = None
        self._window_end: Optional[dict] = None

    def __iter__(self) -> Iterator[dict]:
        return self

    def _next_sample(self) -> tuple:
        if self._pending is not None:
            item, self._pending = self._pending, None
            return item
        if self._samples is None:
            self._samples = self.open_stream(self.start)
        return next(self._samples)

    def _group(self) -> tuple[list, dict]:
        """The next batch's samples (or window's, packing), all of one epoch, and the state after the last."""
        first = self._next_sample()
        group, tokens = [first], len(first[0]["input_ids"])
        limit = 16 * self.batch_size * (self.max_seq_length or 0)  # batching.PACKING_WINDOW batches of rows
        while self.packing or len(group) < self.batch_size:
            item = self._next_sample()
            n = len(item[0]["input_ids"])
            if item[2] != first[2] or (self.packing and tokens + n > limit):
                self._pending = item
                break
            group.append(item)
            tokens += n
        return group, group[-1][1]

    def __next__(self) -> dict:
        if not self.packing:
            group, self.start = self._group()
            self._count(x[3] for x in group)
            return collate([x[0] for x in group], pad_id=self.pad_id, ignore_index=self.ignore_index)
        if self._rows is None:
            group, self._window_end = self._group()
            samples = [dict(x[0], source=x[3]) for x in group]
            self._rows, end = pack_window(samples, list(range(len(samples))), 0, self.batch_size, self.max_seq_length)
            assert end == len(samples), (end, len(samples))  # _group cut the window where pack_window would
        rows = self._rows[self.row:self.row + self.batch_size]
        self._count(s["source"] for row in rows for s in row)
        self.row += self.batch_size
        if self.row >= len(self._rows):
            self.start, self.row, self._rows = self._window_end, 0, None
        return collate_packed(rows, self.pad_id, self.ignore_index)

    def _count(self, sources: Iterator[int]) -> None:
        for k in sources:
            self.used[k] += 1

    def state_dict(self) -> dict:
        return {"streaming": 1, "stream": self.start, "row": self.row, "used": list(self.used),
                "files": [list(f) for f in self.plan.files] if self.plan is not None else []}

    def load_state_dict(self, state: Any) -> None:
        if not (isinstance(state, dict) and state.get("streaming") == 1):
            raise UserError("the checkpoint's data position was not made by a --streaming run; resume without "
                            "--streaming, or start a new --out_dir")
        check_stream_state(state, "the checkpoint's data position", "start a new --out_dir")
        if self.plan is not None:
            now = [list(f) for f in self.plan.files]
            saved = state.get("files") or []
            changed = next((f"{a[0]} was {a[1]} bytes, now {b[1]}" for a, b in zip(saved, now) if a != b), None)
            if changed or len(saved) != len(now):
                what = changed or f"{len(saved)} training files then, {len(now)} now"
                raise UserError(f"the streamed data changed since the checkpoint ({what}); a streamed run resumes at a "
                                "byte offset in the same files: resume with the data as it was, or start a new "
                                "--out_dir")
        if self._samples is not None:
            self._samples.close()
        self.start, self.row = state.get("stream"), int(state.get("row", 0))
        self.used = list(state.get("used", self.used))
        self._samples = self._pending = self._rows = None  # a packed window is rebuilt from `start`, `row` skipped

    def mixture(self) -> Optional[list[dict]]:
        """The realized mixture so far ({path, weight, epochs, available, used, share} per source), None for one
        source."""
        if self.plan is None or self.plan.weights is None:
            return None
        total = sum(self.used) or 1
        return [{"path": n, "weight": w, "epochs": None, "available": None, "used": u, "share": u / total}
                for n, w, u in zip(self.plan.names, self.plan.weights, self.used)]

    def close(self) -> None:
        if self._samples is not None:
            self._samples.close()
