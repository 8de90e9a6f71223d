"""Raw records: JSON / JSONL / CSV loading, one-line errors, custom keys, the deterministic split."""
from __future__ import annotations

import csv
import json

import pytest
from helpers_data import RECORDS, assert_one_line_message, write_json

from lit_qlora.records import load_records, split
from lit_qlora.utils import UserError


def test_load_formats(tmp_path):
    assert load_records(write_json(tmp_path / "a.json", RECORDS)) == RECORDS
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n\n")
    assert load_records(tmp_path / "a.jsonl") == RECORDS
    # JSON Lines saved as .json is accepted rather than rejected
    (tmp_path / "lines.json").write_text("\n".join(json.dumps(r) for r in RECORDS))
    assert load_records(tmp_path / "lines.json") == RECORDS
    with open(tmp_path / "a.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["instruction", "input", "output"])
        w.writeheader()
        w.writerows({"input": "", **r} for r in RECORDS)
    assert [r["output"] for r in load_records(tmp_path / "a.csv")] == [r["output"] for r in RECORDS]


def test_load_errors(tmp_path):
    cases = {
        "missing.json": (None, ["does not exist"]),
        "bad.json": ('[{"instruction": "x", "output": }]', ["not valid JSON", "line 1"]),
        "bad.jsonl": ('{"instruction": "a", "output": "b"}\n{"instruction": oops}\n', ["line 2", "not valid JSON"]),
        "empty.json": ("  \n", ["is empty"]),
        "none.json": ("[]", ["no records"]),
        "dict.json": ('{"data": []}', ["not a list"]),
        "nofield.json": (json.dumps([RECORDS[0], {"instruction": "x", "answer": "y"}]),
                         ["record 1", "'output'", "--output_key"]),
        "notobj.jsonl": ('{"instruction": "a", "output": "b"}\n[1, 2]\n', ["record 1", "not an object"]),
        "data.txt": ("hello", ["unsupported"]),
    }
    for name, (content, parts) in cases.items():
        if content is not None:
            (tmp_path / name).write_text(content)
        with pytest.raises(UserError) as e:
            load_records(tmp_path / name)
        assert_one_line_message(e, *parts)


def test_split_deterministic():
    recs = list(range(100))
    train, val = split(recs, 0.1, seed=42)
    assert (train, val) == split(recs, 0.1, seed=42)
    assert val != split(recs, 0.1, seed=43)[1]
    assert len(val) == 10 and sorted(train + val) == recs
    assert len(split(recs[:3], 0.05, seed=1)[1]) == 1  # a fraction > 0 always yields a validation record
    assert split(recs, 0.0, seed=1)[1] == []
    for bad in (1.0, -0.1):
        with pytest.raises(UserError):
            split(recs, bad, seed=1)
