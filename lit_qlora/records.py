"""Raw training records: reading JSON / JSONL / CSV files, checking every record, and the train/validation split."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lit_qlora.readers import parse_csv, read_text
from lit_qlora.utils import UserError

RAW_SUFFIXES = (".json", ".jsonl", ".csv")


def load_records(path: Path | str, required: tuple[str, ...] = ("instruction", "output")) -> list[dict]:
    """Read a .json (list of objects), .jsonl (one object per line) or .csv (with header) file.

    Every record must have the `required` fields; anything wrong is a one-line UserError.
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"data file {path} does not exist; check the path")
    if path.is_dir():
        raise UserError(f"data file {path} is a folder; pass a .json, .jsonl or .csv file")
    suffix = path.suffix.lower()
    if suffix not in RAW_SUFFIXES:
        raise UserError(f"unsupported data file type {path.name!r}; use a .json, .jsonl or .csv file")
    text = read_text(path, "data file", "save it as UTF-8 text")  # a BOM (some editors, Excel) is dropped
    if not text.strip():
        raise UserError(f"data file {path} is empty; fill it with records or pick another file")

    if suffix == ".csv":
        records: list = parse_csv(text, str(path), "fix the file")  # fields of any size
    elif suffix == ".jsonl":
        records = _parse_jsonl(text, path)
    else:
        try:
            records = json.loads(text)
        except RecursionError:
            raise UserError(f"{path} is not usable JSON (nested too deeply); fix the file") from None
        except json.JSONDecodeError as e:
            # A common mix-up: JSON Lines saved as .json. Accept it rather than fail.
            if e.msg == "Extra data" and text.lstrip().startswith("{"):
                records = _parse_jsonl(text, path)
            else:
                raise UserError(
                    f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                    "fix the file, it must hold a list of objects"
                ) from None
        if not isinstance(records, list):
            kind = f"an object with keys {list(records)[:5]}" if isinstance(records, dict) else type(records).__name__
            raise UserError(f"{path} holds {kind}, not a list of records; make the top level a JSON list of objects")
    if not records:
        raise UserError(f"data file {path} holds no records; add some or pick another file")
    check_records(records, required, path)
    return records


def _parse_jsonl(text: str, path: Path) -> list:
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except RecursionError:
            raise UserError(f"line {lineno} of {path} is not usable JSON (nested too deeply); fix that line") from None
        except json.JSONDecodeError as e:
            raise UserError(
                f"line {lineno} of {path} is not valid JSON ({e.msg} at column {e.colno}); "
                "fix that line, each line must be one JSON object"
            ) from None
    return records


def check_records(records: list, required: tuple[str, ...], source: Path | str = "the data") -> None:
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise UserError(f"record {i} in {source} is a {type(rec).__name__}, not an object; make every record an "
                            "object")
        for key in required:
            if rec.get(key) is None:
                raise UserError(
                    f"record {i} in {source} has no {key!r} field (it has: {', '.join(map(str, rec)) or 'nothing'}); "
                    f"add it, or name the right field with --{_key_flag(key)}"
                )


def _key_flag(key: str) -> str:
    return {"instruction": "instruction_key", "input": "input_key", "output": "output_key"}.get(key, "*_key")


def text_of(value: Any) -> str:
    # CSV gives strings already; JSON may hold numbers ("12 + 7" -> 19), which are fine as text.
    return "" if value is None else str(value)


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
