"""Raw records: JSON / JSONL / CSV loading, one-line errors, custom keys, the deterministic split."""
from __future__ import annotations

import csv
import json

import pytest
from helpers_data import RECORDS, assert_one_line_message, write_json

from lit_qlora.data.records import load_records, split
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


@pytest.mark.parametrize("field,value", [("output", 10**18), ("output", 1e18), ("output", 2.5), ("output", True),
                                         ("output", float("nan")), ("instruction", [1, 2]), ("input", {"a": 1}),
                                         ("input", False), ("output", -(2**53)),
                                         # the fuzzer, seeds 13000-13059: a number where text belongs read as its digits
                                         ("output", 19), ("instruction", 0), ("input", -1), ("output", 2**53 - 1)])
def test_a_value_that_is_not_text_is_refused_where_text_belongs(tmp_path, field, value):
    """A number's text is kept only where it is exact: an integer within 2^53 (every JSON reader reads it to the same
    digits). A float (1e-9 would read back as 1e-09), a huge integer, a boolean, a list or an object where an
    instruction, input or output belongs is refused in one line naming the record, the field and what it holds,
    by load_records and by the prepare path (which names the file and row)."""
    from dataclasses import replace

    from helpers_data import CharTokenizer

    from lit_qlora.data.prepare import DataSettings, prepare_files

    recs = [dict(r) for r in RECORDS]
    recs[1][field] = value
    path = tmp_path / "a.json"
    path.write_text(json.dumps(recs))
    with pytest.raises(UserError) as e:
        load_records(path)
    assert_one_line_message(e, "record 1", repr(field), "not text", "as a string")
    s = replace(DataSettings(64, template="alpaca"), test_split_fraction=0.0)
    with pytest.raises(UserError) as e:
        prepare_files(path, None, CharTokenizer(), tmp_path / "prep", s)
    assert_one_line_message(e, f"row 2 of {path}", repr(field), "not text")


def test_numbers_where_text_belongs_are_refused_in_every_format(tmp_path):
    """A column of numbers where an instruction / input / output belongs: a JSONL line, a parquet column of int64 or
    double, a datasets folder: refused in one line naming the file, the row and the field, with how to write it.
    A CSV field is always text ("19" stays the answer 19), as is a JSON string of digits."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lit_qlora.data.records import check_records, text_of

    recs = [{"instruction": "12 + 7", "input": "", "output": "19"}, {"instruction": "x", "input": "0", "output": "-1"}]
    check_records(recs, ("instruction", "output"))
    assert [text_of(r["output"]) for r in recs] == ["19", "-1"]
    with open(tmp_path / "a.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["instruction", "input", "output"])
        w.writeheader()
        w.writerows([{"instruction": "12 + 7", "input": "", "output": 19}])
    assert load_records(tmp_path / "a.csv")[0]["output"] == "19"
    (tmp_path / "a.jsonl").write_text(json.dumps(recs[0]) + "\n" + json.dumps({**recs[1], "output": -1}) + "\n")
    with pytest.raises(UserError) as e:
        load_records(tmp_path / "a.jsonl")
    assert_one_line_message(e, "record 1", str(tmp_path / "a.jsonl"), "'output' is a number (-1), not text",
                            'in quotes: "-1"')
    for column in (pa.array([19, 7], pa.int64()), pa.array([1.5, 2.0], pa.float64())):
        table = pa.table({"instruction": ["a", "b"], "output": column})
        pq.write_table(table, tmp_path / "a.parquet")
        with pytest.raises(UserError) as e:
            load_records(tmp_path / "a.parquet")
        assert_one_line_message(e, "record 0", str(tmp_path / "a.parquet"), "'output' is a number", "not text",
                                "cast a parquet / datasets column to string")
    import datasets

    datasets.Dataset.from_dict({"instruction": ["a", "b"], "output": [3, 4]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(UserError) as e:
        load_records(tmp_path / "ds")
    assert_one_line_message(e, "record 0", "'output' is a number (3)", "not text")




@pytest.mark.parametrize("name", ["Input", "inrut", " input"])
def test_a_misspelt_input_field_is_refused_not_read_as_absent(tmp_path, name):
    """The file fuzzer (seeds 3, 23018): an Alpaca record whose 'input' became 'Input' or 'inrut' was read with no
    input at all, its text silently lost. A column of another name ('index', 'context') is still the user's own."""
    records = [{"instruction": "a", "input": "b", "output": "c"}, {"instruction": "d", name: "e", "output": "f"}]
    path = write_json(tmp_path / "data.json", records)
    with pytest.raises(UserError) as e:
        load_records(path)
    assert f"record 1 in {path} has a field {name!r} but no 'input'" in str(e.value) and "\n" not in str(e.value)
    records[1] = {"instruction": "d", "index": 3, "context": "x", "output": "f"}
    assert load_records(write_json(tmp_path / "ok.json", records))[1]["index"] == 3
