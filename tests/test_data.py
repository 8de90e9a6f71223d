"""Data preparation: templates, loading errors, masking, truncation, splits, caching, batching, scripts."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_qlora.data import (
    BatchStream,
    collate,
    ensure_prepared,
    get_template,
    load_prepared,
    load_records,
    prepare_samples,
    save_prepared,
    split,
)
from lit_qlora.utils import UserError

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "lit_qlora" / "demo" / "demo_data.json"

RECORDS = [
    {"instruction": "Reverse the word.", "input": "cat", "output": "tac"},
    {"instruction": "Count from 1 to 3.", "input": "", "output": "1 2 3"},
    {"instruction": "Add the numbers.", "input": "12 + 7", "output": "19"},
    {"instruction": "Uppercase the text.", "output": "NO INPUT FIELD"},
]


class CharTokenizer:
    """Stand-in with the Tokenizer interface: one id per character, bos=1, eos=2."""

    bos_id, eos_id, vocab_size = 1, 2, 260

    def __init__(self, fingerprint: str = "char-a") -> None:
        self.fingerprint = fingerprint

    def encode(self, text: str, bos: bool | None = None, eos: bool = False, max_length: int = -1) -> torch.Tensor:
        ids = ([self.bos_id] if bos is not False else []) + [3 + ord(c) % 256 for c in text]
        ids += [self.eos_id] if eos else []
        return torch.tensor(ids[:max_length] if max_length > 0 else ids, dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(chr(i - 3) for i in torch.as_tensor(ids).tolist() if i > 2)


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


def assert_one_line_error(exc: pytest.ExceptionInfo, *parts: str) -> None:
    msg = str(exc.value)
    assert "\n" not in msg and ";" in msg, msg
    for p in parts:
        assert p in msg, msg


# ---------------------------------------------------------------------------------------------- templates


def test_templates():
    alpaca = get_template("alpaca")
    with_input = alpaca.format("Reverse the word.", "cat")
    assert "### Instruction:\nReverse the word.\n\n### Input:\ncat\n\n### Response:\n" in with_input
    without = alpaca.format("Say hi.")
    assert "### Input" not in without and without.endswith("### Instruction:\nSay hi.\n\n### Response:\n")
    assert alpaca.format("Say hi.", "  ") == without  # whitespace-only input counts as no input
    assert get_template("plain").format("Do it.", "x") == "Do it.\nx\n"
    with pytest.raises(UserError) as e:
        get_template("vicuna")
    assert_one_line_error(e, "alpaca", "plain")


# ---------------------------------------------------------------------------------------------- loading


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
        "nofield.json": (json.dumps([RECORDS[0], {"instruction": "x", "answer": "y"}]), ["record 1", "'output'", "--output_key"]),
        "notobj.jsonl": ('{"instruction": "a", "output": "b"}\n[1, 2]\n', ["record 1", "not an object"]),
        "data.txt": ("hello", ["unsupported"]),
    }
    for name, (content, parts) in cases.items():
        if content is not None:
            (tmp_path / name).write_text(content)
        with pytest.raises(UserError) as e:
            load_records(tmp_path / name)
        assert_one_line_error(e, *parts)


# ---------------------------------------------------------------------------------------------- tokenizing


@pytest.mark.parametrize("template", ["alpaca", "plain"])
def test_prompt_masking(template):
    tok = CharTokenizer()
    samples, n_trunc = prepare_samples(RECORDS, tok, template, max_seq_length=1000)
    assert n_trunc == 0 and len(samples) == len(RECORDS)
    for rec, s in zip(RECORDS, samples):
        prompt = get_template(template).format(rec["instruction"], rec.get("input", ""))
        n_prompt = len(tok.encode(prompt))  # encoded independently of prepare_samples
        ids, labels = s["input_ids"], s["labels"]
        assert ids.dtype == labels.dtype == torch.long
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert (labels[:n_prompt] == -100).all()
        assert torch.equal(labels[n_prompt:], ids[n_prompt:])
        assert tok.decode(ids[n_prompt:]) == rec["output"]

    unmasked, _ = prepare_samples(RECORDS, tok, template, 1000, mask_inputs=False)
    assert all(torch.equal(s["input_ids"], s["labels"]) for s in unmasked)
    custom, _ = prepare_samples(RECORDS[:1], tok, template, 1000, ignore_index=-1)
    assert custom[0]["labels"][0] == -1


def test_custom_keys_and_missing_field():
    recs = [{"q": "Add.", "ctx": "1 + 1", "a": 2}]  # a number as output is fine
    samples, _ = prepare_samples(recs, CharTokenizer(), "plain", 100, instruction_key="q", input_key="ctx", output_key="a")
    assert CharTokenizer().decode(samples[0]["input_ids"]) == "Add.\n1 + 1\n2"
    with pytest.raises(UserError) as e:
        prepare_samples(recs, CharTokenizer(), "plain", 100)
    assert_one_line_error(e, "record 0", "'instruction'")


def test_truncation_counts():
    tok = CharTokenizer()
    full, _ = prepare_samples(RECORDS, tok, "plain", 1000)
    lengths = [len(s["input_ids"]) for s in full]
    limit = sorted(lengths)[1]  # exactly one sample fits at length == limit, two are longer
    samples, n_trunc = prepare_samples(RECORDS, tok, "plain", limit)
    assert n_trunc == sum(n > limit for n in lengths) == 2
    for s, n in zip(samples, lengths):
        assert len(s["input_ids"]) == len(s["labels"]) == min(n, limit)

    # Cut inside the prompt: no response token is left to learn from, so those samples are left out
    n_prompt = len(tok.encode(get_template("plain").format(RECORDS[2]["instruction"], RECORDS[2]["input"])))
    samples, n_trunc = prepare_samples(RECORDS, tok, "plain", n_prompt)
    assert n_trunc == 4 and len(samples) == 3
    assert all((s["labels"] != -100).any() for s in samples)
    with pytest.raises(UserError) as e:
        prepare_samples(RECORDS, tok, "plain", 5)
    assert_one_line_error(e, "max_seq_length=5")
    samples, _ = prepare_samples(RECORDS, tok, "plain", 5, mask_inputs=False)  # unmasked: all kept
    assert len(samples) == 4


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


# ---------------------------------------------------------------------------------------------- prepared folders


def test_save_load_roundtrip(tmp_path):
    samples, _ = prepare_samples(RECORDS, CharTokenizer(), "alpaca", 1000)
    save_prepared(tmp_path / "p", samples[:3], samples[3:], {"template": "alpaca"})
    train, val, meta = load_prepared(tmp_path / "p")
    assert len(train) == 3 and len(val) == 1 and torch.equal(train[0]["labels"], samples[0]["labels"])
    assert meta["template"] == "alpaca" and meta["n_train"] == 3 and meta["n_val"] == 1
    (tmp_path / "p" / "prepare_config.json").unlink()  # an unfinished write is not trusted
    with pytest.raises(UserError):
        load_prepared(tmp_path / "p")


def test_ensure_prepared_caches_single_file(tmp_path, capsys):
    write_json(tmp_path / "alpaca.json", RECORDS * 5)
    tok = CharTokenizer()
    kw = dict(template="plain", test_split_fraction=0.2)
    train, val, meta = ensure_prepared(tmp_path, tok, 30, **kw)
    cache = tmp_path / ".prepared-char-a-30"
    assert (cache / "prepare_config.json").is_file()
    assert len(train) == 16 and len(val) == 4 and meta["tokenizer_fingerprint"] == "char-a"
    err = capsys.readouterr().err
    assert "Preparing alpaca.json" in err and "warning: 5 of 20 samples" in err  # RECORDS[3] is 37 chars

    train2, val2, _ = ensure_prepared(tmp_path, tok, 30, **kw)
    assert "Using data prepared earlier" in capsys.readouterr().err
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(train + val, train2 + val2))

    write_json(tmp_path / "alpaca.json", RECORDS * 6)  # edited source: prepared again, not reused
    train3, val3, _ = ensure_prepared(tmp_path, tok, 30, **kw)
    assert len(train3) + len(val3) == 24 and "Preparing" in capsys.readouterr().err
    ensure_prepared(tmp_path, tok, 30, mask_inputs=False, **kw)  # other settings: prepared again
    assert "Preparing" in capsys.readouterr().err
    ensure_prepared(tmp_path, CharTokenizer("char-b"), 30, **kw)  # another tokenizer gets its own cache
    assert (tmp_path / ".prepared-char-b-30").is_dir()


def test_ensure_prepared_train_val_pair(tmp_path):
    write_json(tmp_path / "train.json", RECORDS * 2)
    (tmp_path / "val.jsonl").write_text(json.dumps(RECORDS[0]))
    train, val, meta = ensure_prepared(tmp_path, CharTokenizer(), 512)
    assert len(train) == 8 and len(val) == 1 and meta["n_truncated"] == 0


def test_ensure_prepared_prepared_folder(tmp_path):
    samples, _ = prepare_samples(RECORDS, CharTokenizer(), "alpaca", 256)
    save_prepared(tmp_path, samples[:3], samples[3:], {"tokenizer_fingerprint": "char-a", "max_seq_length": 256})
    train, val, _ = ensure_prepared(tmp_path, CharTokenizer(), 256)
    assert len(train) == 3 and len(val) == 1
    ensure_prepared(tmp_path, CharTokenizer(), 512)  # samples that fit 256 fit 512 too
    assert not any(p.name.startswith(".prepared") for p in tmp_path.iterdir())

    with pytest.raises(UserError) as e:
        ensure_prepared(tmp_path, CharTokenizer("char-b"), 256)
    assert_one_line_error(e, "char-a", "char-b", "prepare_alpaca.py")
    with pytest.raises(UserError) as e:
        ensure_prepared(tmp_path, CharTokenizer(), 128)
    assert_one_line_error(e, "max_seq_length=256", "max_seq_length=128")


def test_ensure_prepared_errors(tmp_path):
    with pytest.raises(UserError) as e:
        ensure_prepared(tmp_path / "nope", CharTokenizer(), 64)
    assert_one_line_error(e, "does not exist")
    with pytest.raises(UserError) as e:
        ensure_prepared(tmp_path, CharTokenizer(), 64)
    assert_one_line_error(e, "holds no data")
    write_json(tmp_path / "a.json", RECORDS)
    write_json(tmp_path / "b.json", RECORDS)
    with pytest.raises(UserError) as e:
        ensure_prepared(tmp_path, CharTokenizer(), 64)
    assert_one_line_error(e, "a.json", "b.json")


# ---------------------------------------------------------------------------------------------- batching


def _sample(n: int, start: int = 10) -> dict:
    ids = torch.arange(start, start + n)
    return {"input_ids": ids, "labels": torch.cat([torch.full((1,), -100), ids[1:]])}


def test_collate_pads_right():
    batch = collate([_sample(3), _sample(5)], pad_id=0)
    assert batch["input_ids"].shape == batch["labels"].shape == (2, 5)
    assert batch["input_ids"][0].tolist() == [10, 11, 12, 0, 0]
    assert batch["labels"][0].tolist() == [-100, 11, 12, -100, -100]
    assert batch["input_ids"][1].tolist() == list(range(10, 15))
    padded = collate([_sample(3), _sample(5)], pad_id=7, ignore_index=-1, pad_multiple_of=8)
    assert padded["input_ids"].shape == (2, 8) and padded["input_ids"][1, 5:].tolist() == [7, 7, 7]
    assert padded["labels"][1, 5:].tolist() == [-1, -1, -1]


def test_batch_stream_reproducible_and_resumable():
    samples = [_sample(1 + i % 7, start=100 * i) for i in range(10)]
    first = lambda b: b["input_ids"][:, 0].tolist()  # noqa: E731 - sample identity
    a = BatchStream(samples, batch_size=4, seed=3)
    run = [first(next(a)) for _ in range(9)]  # 3 epochs of 4 + 4 + 2
    epoch0 = sorted(sum(run[:3], []))
    assert epoch0 == [100 * i for i in range(10)] and run[:3] != run[3:6]  # full coverage, reshuffled
    assert run == [first(b) for b, _ in zip(BatchStream(samples, 4, seed=3), range(9))]

    b = BatchStream(samples, batch_size=4, seed=3)
    for _ in range(4):
        next(b)
    state = b.state_dict()
    assert state == {"epoch": 1, "position": 4, "seed": 3}
    resumed = BatchStream(samples, batch_size=4, seed=99)
    resumed.load_state_dict(state)
    assert [first(next(resumed)) for _ in range(5)] == run[4:]

    grouped = BatchStream(samples, batch_size=5, seed=3, length_grouped=True)
    lengths = [sorted(len(samples[i // 100]["input_ids"]) for i in first(next(grouped))) for _ in range(2)]
    assert min(lengths[0]) >= max(lengths[1])  # longest samples batched together


# ---------------------------------------------------------------------------------------------- scripts


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    pytest.importorskip("lit_qlora.tokenizer")
    from tests.helpers_tokenizer import make_hf_bpe_tokenizer

    folder = make_hf_bpe_tokenizer(tmp_path_factory.mktemp("ckpt"), vocab_size=300)
    write_json(folder / "config.json", {"max_position_embeddings": 256})
    return folder


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / name), *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_real_tokenizer_masking(tiny_checkpoint):
    from lit_qlora.tokenizer import Tokenizer

    tok = Tokenizer(tiny_checkpoint)
    recs = json.loads(DEMO.read_text())[:20]
    samples, _ = prepare_samples(recs, tok, "alpaca", 10_000)
    for rec, s in zip(recs, samples):
        n_prompt = len(tok.encode(get_template("alpaca").format(rec["instruction"], rec["input"])))
        assert (s["labels"][:n_prompt] == -100).all() and (s["labels"][n_prompt:] != -100).all()
        assert s["input_ids"][-1] == tok.eos_id
        assert tok.decode(s["input_ids"][n_prompt:-1]).strip() == rec["output"]


def test_prepare_alpaca_script(tiny_checkpoint, tmp_path):
    dest = tmp_path / "alpaca"
    r = run_script("prepare_alpaca.py", "--data_file", str(DEMO), "--checkpoint_dir", str(tiny_checkpoint),
                   "--destination_path", str(dest))
    assert r.returncode == 0, r.stderr
    train, val, meta = load_prepared(dest)
    assert (len(train), len(val)) == (380, 20)
    assert meta["max_seq_length"] == 256 and meta["template"] == "alpaca"  # default from config.json
    # finetuning's entry point accepts the folder for the same tokenizer
    from lit_qlora.tokenizer import Tokenizer

    assert len(ensure_prepared(dest, Tokenizer(tiny_checkpoint), 256)[0]) == 380

    (tmp_path / "bad.json").write_text('[{"instruction": "x",')
    r = run_script("prepare_alpaca.py", "--data_file", str(tmp_path / "bad.json"), "--checkpoint_dir",
                   str(tiny_checkpoint), "--destination_path", str(tmp_path / "x"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_prepare_json_script(tiny_checkpoint, tmp_path):
    with open(tmp_path / "qa.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["question", "answer"])
        w.writerows([[f"What is {i} + 1?", str(i + 1)] for i in range(20)])
    dest = tmp_path / "qa"
    common = ["--checkpoint_dir", str(tiny_checkpoint), "--destination_path", str(dest), "--template", "plain",
              "--max_seq_length", "32", "--test_split_fraction", "0.1", "--mask_inputs", "false"]
    r = run_script("prepare_json.py", "--data_file", str(tmp_path / "qa.csv"), "--instruction_key", "question",
                   "--output_key", "answer", *common)
    assert r.returncode == 0, r.stderr
    train, val, meta = load_prepared(dest)
    assert (len(train), len(val)) == (18, 2) and meta["mask_inputs"] is False and meta["max_seq_length"] == 32
    assert torch.equal(train[0]["input_ids"], train[0]["labels"])

    r = run_script("prepare_json.py", "--data_file", str(tmp_path / "qa.csv"), *common)  # default keys missing
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "'instruction'" in r.stderr, r.stderr
