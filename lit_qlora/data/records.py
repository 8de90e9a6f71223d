"""Raw training records: the one reader of every record file (.json, .jsonl, .csv, .parquet, a `datasets`
save_to_disk folder), the checks of each record, conversation records normalized to role/content messages, and the
train/validation split.

Every row comes with where it was read (`row N of FILE`; a JSONL file's row is its line number), so a bad row is one
line naming it. Parquet files are read a row group at a time and JSONL files a line at a time (`iter_rows`).
pyarrow (parquet) and datasets (save_to_disk folders) are the optional `data` extra, imported when such a source is
read.
"""
from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from lit_qlora.readers import check_file, decode_text, parse_csv, read_text
from lit_qlora.utils import UserError

RAW_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
DATA_EXTRA = "pip install 'lit-qlora[data]'"


def optional_module(name: str, what: str) -> Any:
    """An optional dependency of the `data` extra, or a one-line UserError naming how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise UserError(f"{what} needs the {name} package, which is not installed; {DATA_EXTRA}") from None


# ---- reading rows ----------------------------------------------------------------------------------------------------
def is_dataset_folder(path: Path) -> bool:
    """A `datasets` save_to_disk folder: a Dataset (state.json + dataset_info.json) or a DatasetDict
    (dataset_dict.json)."""
    path = Path(path)
    return (path / "dataset_dict.json").is_file() or ((path / "state.json").is_file()
                                                      and (path / "dataset_info.json").is_file())


def iter_rows(path: Path | str, split: str | None = None) -> Iterator[tuple[int, Any]]:
    """(row, record) of a data file or a save_to_disk folder, rows from 1 (a JSONL file's row is its line number).
    Anything unreadable is a one-line UserError naming the file (and the line, row group or offset)."""
    for row, rec, _ in iter_rows_from(path, split):
        yield row, rec


Place = tuple[int, int, int]  # where the next record of a file starts: (records before it, byte offset, lines before)


def iter_rows_from(path: Path | str, split: str | None = None,
                   place: Place = (0, 0, 0)) -> Iterator[tuple[int, Any, Place]]:
    """`iter_rows` from a `Place` on, each row with the place of the one after it. Resuming at a place reads nothing
    before it where the format allows: a JSONL file is entered at its byte offset, a parquet file skips the row groups
    before it unread; other formats read past the records before it."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".parquet") and not path.is_dir():
        check_file(path, "data file", "check the path")
        yield from _jsonl_rows(path, *place) if suffix == ".jsonl" else _parquet_rows(path, place[0])
        return
    for n, (row, rec) in enumerate(_rows(path, split), start=1):
        if n > place[0]:
            yield row, rec, (n, 0, 0)


def _rows(path: Path, split: str | None) -> Iterator[tuple[int, Any]]:
    if path.is_dir() and is_dataset_folder(path):
        yield from _dataset_rows(path, split)
        return
    if path.is_dir():
        raise UserError(f"data file {path} is a folder; pass a {', '.join(RAW_SUFFIXES)} file")
    check_file(path, "data file", "check the path")
    suffix = path.suffix.lower()
    if suffix not in RAW_SUFFIXES:
        raise UserError(f"unsupported data file type {path.name!r}; use a .json, .jsonl, .csv or .parquet file")
    else:
        text = read_text(path, "data file", "save it as UTF-8 text")  # a BOM (some editors, Excel) is dropped
        if not text.strip():
            raise UserError(f"data file {path} is empty; fill it with records or pick another file")
        if suffix == ".csv":
            yield from enumerate(parse_csv(text, str(path), "fix the file"), start=1)  # fields of any size
        else:
            yield from _json_rows(text, path)


def _json_rows(text: str, path: Path) -> Iterator[tuple[int, Any]]:
    try:
        records = json.loads(text)
    except RecursionError:
        raise UserError(f"{path} is not usable JSON (nested too deeply); fix the file") from None
    except json.JSONDecodeError as e:
        # A common mix-up: JSON Lines saved as .json. Accept it rather than fail.
        if e.msg == "Extra data" and text.lstrip().startswith("{"):
            yield from _jsonl_lines(text.splitlines(), path)
            return
        raise UserError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); fix the file, it "
                        "must hold a list of objects") from None
    if not isinstance(records, list):
        kind = f"an object with keys {list(records)[:5]}" if isinstance(records, dict) else type(records).__name__
        raise UserError(f"{path} holds {kind}, not a list of records; make the top level a JSON list of objects")
    yield from enumerate(records, start=1)


def _jsonl_rows(path: Path, n: int = 0, offset: int = 0, lines: int = 0) -> Iterator[tuple[int, Any, Place]]:
    """A line at a time from byte `offset` (`n` records and `lines` lines before it): a JSONL file is never held in
    memory whole. A record's row is its line number."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            empty = offset == 0
            for lineno, raw in enumerate(f, start=lines + 1):
                offset += len(raw)
                line = decode_text(raw, f"line {lineno} of {path}", "save the file as UTF-8 text")
                if line.strip():
                    empty = False
                    n += 1
                    for row, rec in _jsonl_lines([line], path, lineno):
                        yield row, rec, (n, offset, lineno)
    except OSError as e:
        raise UserError(f"cannot read data file {path} ({e.strerror}); check the file") from None
    if empty:
        raise UserError(f"data file {path} is empty; fill it with records or pick another file")


def _jsonl_lines(lines: list[str], path: Path, first: int = 1) -> Iterator[tuple[int, Any]]:
    for lineno, line in enumerate(lines, start=first):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except RecursionError:
            raise UserError(f"line {lineno} of {path} is not usable JSON (nested too deeply); fix that line") from None
        except json.JSONDecodeError as e:
            raise UserError(f"line {lineno} of {path} is not valid JSON ({e.msg} at column {e.colno}); fix that line, "
                            "each line must be one JSON object") from None


def _parquet_rows(path: Path, skip: int = 0) -> Iterator[tuple[int, Any, Place]]:
    """A row group at a time (pyarrow), after the first `skip` rows (whole row groups before them not read): a
    parquet file is never held in memory whole."""
    pf = _open_parquet(path)
    n_groups = pf.num_row_groups
    row = 0
    for g in range(n_groups):
        n = pf.metadata.row_group(g).num_rows
        if row + n <= skip:
            row += n
            continue
        try:
            records = pf.read_row_group(g).to_pylist()
        except Exception as e:
            raise UserError(f"rows {row + 1}-{row + n} (row group {g}) of {path} are not readable ({_detail(e)}); the "
                            "file may be damaged: re-copy or re-export it") from None
        for rec in records:
            row += 1
            if row > skip:
                yield row, rec, (row, 0, 0)


def _open_parquet(path: Path) -> Any:
    pq = optional_module("pyarrow.parquet", f"reading {path.name}")
    try:
        pf = pq.ParquetFile(path)
        _ = pf.metadata.num_rows, pf.num_row_groups  # the footer, read now: a damaged one fails here
        return pf
    except Exception as e:  # not parquet, cut short, a torn footer: all the file's fault
        raise UserError(f"{path} is not a readable parquet file ({_detail(e)}); it may be damaged or cut short: "
                        "re-copy or re-export it") from None


def parquet_rows(path: Path | str) -> int:
    """The rows a parquet file holds, from its footer alone (no row group read): a file cut short, or not parquet,
    is a one-line UserError naming it."""
    check_file(Path(path), "data file", "check the path")
    return int(_open_parquet(Path(path)).metadata.num_rows)


def _dataset_rows(path: Path, split: str | None) -> Iterator[tuple[int, Any]]:
    """The rows of a `datasets` save_to_disk folder (the `split` of a DatasetDict)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # reading a local folder never needs the network
    datasets = optional_module("datasets", f"reading the datasets folder {path}")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise UserError(f"{path} is not a readable datasets folder ({_detail(e)}); save it again with "
                        "Dataset.save_to_disk") from None
    if isinstance(ds, datasets.DatasetDict):
        split = split or ("train" if "train" in ds else next(iter(ds)))
        if split not in ds:
            raise UserError(f"{path} has no split {split!r} (it has: {', '.join(ds)}); name one of those")
        ds = ds[split]
    for row, rec in enumerate(ds, start=1):
        yield row, rec


def _detail(e: Exception) -> str:
    text = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
    return f"{type(e).__name__}{': ' + text if text else ''}"


# ---- records ---------------------------------------------------------------------------------------------------------
def load_records(path: Path | str, required: tuple[str, ...] = ("instruction", "output"),
                 optional: tuple[str, ...] = ("input",)) -> list[dict]:
    """Every record of a data file (see `iter_rows`). Every record must have the `required` fields, and they and the
    `optional` ones (where present) must be text (`check_text`); anything wrong is a one-line UserError."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"data file {path} does not exist; check the path")
    records = [rec for _, rec in iter_rows(path)]
    if not records:
        raise UserError(f"data file {path} holds no records; add some or pick another file")
    check_records(records, required, path, optional)
    return records


def check_records(records: list, required: tuple[str, ...], source: Path | str = "the data",
                  optional: tuple[str, ...] = ("input",)) -> None:
    for i, rec in enumerate(records):
        check_record(rec, required, f"record {i} in {source}", optional=optional)


def check_record(rec: Any, required: tuple[str, ...], where: str, flags: dict[str, str] | None = None,
                 optional: tuple[str, ...] = ("input",)) -> None:
    """That `rec` is an object with every `required` field (not null), and that those and the `optional` fields
    present are text (`check_text`); a one-line UserError naming `where` and the flag that names the field (`flags`:
    field -> flag; default: the instruction fields' column flags)."""
    if not isinstance(rec, dict):
        raise UserError(f"{where} is a {type(rec).__name__}, not an object; make every record an object")
    for key in required:
        if rec.get(key) is None:
            flag = (flags or {}).get(key) or _key_flag(key)
            raise UserError(f"{where} has no {key!r} field (it has: {', '.join(map(str, rec)) or 'nothing'}); add it, "
                            f"or name the right field with {flag}")
    for key in (*required, *optional):
        check_text(rec.get(key), key, where)
        if key not in rec:  # an optional field misspelt ('Input', 'inptu'): read as absent, its text lost
            other = next((k for k in rec if isinstance(k, str) and _misspelt(k, key)), None)
            if other is not None:
                raise UserError(f"{where} has a field {other!r} but no {key!r} (a misspelling, or another case: "
                                f"field names are exact); rename it to {key!r}, or name the right field with "
                                f"{_key_flag(key)}")


def _misspelt(name: str, field: str) -> bool:
    """Whether `name` is `field` in another case or with one letter changed (not a column of its own: 'index' is
    three letters from 'input')."""
    a, b = name.strip().lower(), field.lower()
    return a == b or len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1


def check_text(value: Any, key: str, where: str) -> None:
    """A field the model reads as text: a string, or null (absent). Anything else is a one-line UserError naming
    `where`, the field and what it holds, and how to write it: a number is not text (1e-9 would read back as 1e-09,
    an integer beyond 2^53 is not the same number in every JSON reader, and a column of numbers is most often the
    wrong column), nor is a boolean, a list or an object. `datasets`' JSON reader refuses the same mix (a column that
    changes from string to number); a parquet column of numbers is cast to string (pyarrow: `.cast(pa.string())`)."""
    if value is None or isinstance(value, str):
        return
    how = (f'write it as a string (in quotes: "{value}")' if isinstance(value, int) and not isinstance(value, bool)
           and abs(value) < 10**15 else "write it as a string (in quotes)")
    raise UserError(f"{where}: {key!r} is {what_value(value)}, not text; {how}, or cast a parquet / datasets column "
                    "to string, or name the right field")


def what_value(value: Any) -> str:
    """What a value that is not text is, for a message: 'a number (19)', 'a boolean (True)', 'a list ([1, 2])'."""
    kind = {bool: "a boolean", list: "a list", dict: "an object", float: "a number", int: "a number"}.get(
        type(value), f"a {type(value).__name__}")
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return f"{kind} ({shown})"


def _key_flag(key: str) -> str:
    return {"instruction": "--prompt_column (prepare_json.py: --instruction_key)",
            "input": "--input_column (prepare_json.py: --input_key)",
            "output": "--response_column (prepare_json.py: --output_key)"}.get(key, "--*_column")


def text_of(value: Any) -> str:
    """A checked text field (`check_text`: a string or null) as the string the template receives."""
    return "" if value is None else value


def split(records: list, test_split_fraction: float, seed: int) -> tuple[list, list]:
    """Shuffle deterministically and split into (train, val). Val gets at least one record when the
    fraction is > 0 (so validation is never silently skipped) and train keeps at least one."""
    if not 0 <= test_split_fraction < 1:
        raise UserError(f"test_split_fraction must be in [0, 1), got {test_split_fraction}; pass e.g. 0.05")
    n = len(records)
    n_val = round(n * test_split_fraction)
    if test_split_fraction > 0:
        n_val = max(n_val, 1)
    n_val = min(n_val, n - 1)
    if n_val < 1 and test_split_fraction > 0:
        raise UserError(f"cannot split {n} record(s) into train and validation; add more records")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return [records[i] for i in order[n_val:]], [records[i] for i in order[:n_val]]


# ---- conversation records --------------------------------------------------------------------------------------------
ROLES = ("system", "user", "assistant")
_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


@dataclass(frozen=True)
class Conversation:
    """A checked conversation record: role/content messages and where they came from (named in errors)."""

    messages: list
    source: str


def is_conversation_record(rec: Any) -> bool:
    """Whether a data record is a conversation: {"messages": [...]} (OpenAI) or {"conversations": [...]} (ShareGPT)."""
    return isinstance(rec, dict) and ("messages" in rec or "conversations" in rec)


def with_messages_column(rec: Any, column: str | None, where: str) -> Any:
    """A record whose conversation is in `column` (--messages_column) with it under "messages"; a record without
    that column is a one-line UserError."""
    if not column or column in ("messages", "conversations") or not isinstance(rec, dict):
        return rec
    if column not in rec:
        raise UserError(f"{where} has no column {column!r} (named by --messages_column; it has: "
                        f"{', '.join(map(str, rec)) or 'nothing'}); name the column that holds the turns")
    rec = dict(rec)
    rec["messages"] = rec.pop(column)
    return rec


def normalize_conversation(rec: Any, row: int, path: Path | str, need_reply: bool = True,
                           where: str | None = None) -> list[dict]:
    """The messages of a conversation record as [{"role", "content"}, ...] with roles system/user/assistant.

    Accepts OpenAI `messages` (role/content) and ShareGPT `conversations` (from/value; from: system, human, gpt, or
    user, assistant; ShareGPT turns under "messages" too). Refuses, in one line naming the row (1-based) and the file:
    an unknown role, content that is not a string or is empty, a system message anywhere but first, no assistant
    turn (unless `need_reply` is False: a conversation to continue). `where`: how errors name the row (default
    "row ROW of PATH").
    """
    where = where or f"row {row} of {path}"
    if not isinstance(rec, dict):
        raise UserError(f"{where} is a {type(rec).__name__}, not an object; make each row an object with "
                        "\"messages\": [{\"role\": ..., \"content\": ...}, ...]")
    if "messages" in rec:
        key, turns = "messages", rec["messages"]
    elif "conversations" in rec:
        key, turns = "conversations", rec["conversations"]
    else:
        raise UserError(f"{where} has no \"messages\" or \"conversations\" list (it has: {', '.join(map(str, rec))}); "
                        "give every row a \"messages\" list of {\"role\", \"content\"} objects")
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: \"{key}\" must be a non-empty list of turns; fix or drop the row")
    sharegpt = key == "conversations" or (isinstance(turns[0], dict) and "from" in turns[0] and "role" not in turns[0])
    if sharegpt:
        role_key, text_key, roles = "from", "value", _SHAREGPT_ROLES
        allowed = "system, human, gpt (or user, assistant)"
    else:
        role_key, text_key, roles, allowed = "role", "content", {r: r for r in ROLES}, "system, user, assistant"
    out = []
    for i, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict):
            raise UserError(f"{where}: turn {i} is a {type(turn).__name__}, not an object; "
                            f"write each turn as {{\"{role_key}\": ..., \"{text_key}\": ...}}")
        role = roles.get(turn.get(role_key)) if isinstance(turn.get(role_key), str) else None
        if role is None:
            raise UserError(f"{where}: turn {i} has {role_key}={turn.get(role_key)!r}; use one of {allowed}")
        content = turn.get(text_key)
        if not isinstance(content, str):
            kind = "missing" if content is None else f"{what_value(content)}, not a string"
            raise UserError(f"{where}: turn {i} ({role}) {text_key} is {kind}; write the turn's text as a string")
        if not content.strip():
            raise UserError(f"{where}: turn {i} ({role}) has empty {text_key}; fill it in or drop the row")
        if role == "system" and i != 1:
            raise UserError(f"{where}: turn {i} is a system message, but only the first turn may be one; "
                            "move it to the start or merge it into a user turn")
        out.append({"role": role, "content": content})
    if need_reply and not any(m["role"] == "assistant" for m in out):
        raise UserError(f"{where} has no assistant turn, so there is nothing to learn; add the assistant's reply "
                        "or drop the row")
    return out
