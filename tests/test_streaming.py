"""finetune/lora.py --streaming (lit_qlora/data/streaming.py: StreamPlan, StreamBatches): the streamed batches are the
batches `BatchStream` makes of the prepared samples in the same order (padded and packed, across epochs, resumed at
any batch); the held-out validation part is decided record by record; a mixture draws by weight, deterministically,
and resumes; through the CLI a streamed run equals the non-streamed run over the same order, a run resumed mid-stream
equals the uninterrupted one without reading the file before its checkpoint, and corrupt shards are one line naming
the file and the row."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import helpers_train as h
import pytest
import torch
from helpers_data import CharTokenizer, assert_one_line_message

from lit_qlora.data.batching import BatchStream, count_packed_batches, epoch_order
from lit_qlora.data.prepare import DataSettings, prepare_samples
from lit_qlora.data.streaming import HELD_OUT, _draw, held_out, plan_stream
from lit_qlora.utils import UserError

pd = pytest.importorskip("pandas")
pq = pytest.importorskip("pyarrow.parquet")


def varied_records(n: int, seed: int = 0) -> list[dict]:
    """Instruction records of different lengths (some truncated at 60 characters, some left with no response)."""
    return [{"instruction": f"Say {i} " * (1 + (i + seed) % 9), "input": "" if i % 4 else f"ctx {i}",
             "output": f"w{i} " * (1 + (3 * i + seed) % 6)} for i in range(n)]


def write_jsonl(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def shards(folder: Path, recs: list[dict], with_val: bool = True) -> Path:
    """A folder of two training shards (parquet in row groups of 4, then JSONL) and a validation file."""
    folder.mkdir(parents=True, exist_ok=True)
    half = len(recs) // 2
    pd.DataFrame(recs[:half]).to_parquet(folder / "train-0.parquet", row_group_size=4)
    write_jsonl(folder / "train-1.jsonl", recs[half:])
    if with_val:
        write_jsonl(folder / "val.jsonl", varied_records(6, seed=50))
    return folder


def same_batch(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("packing", [False, True])
def test_streamed_batches_are_the_prepared_batches_in_the_same_order_and_resume_anywhere(tmp_path, packing):
    """150 records in two shards, batches of 3, 60 tokens: 3+ epochs of batches equal BatchStream's over the
    prepared samples (shuffle off), padded or packed (windows cut mid-epoch and at each epoch's end); a stream loaded
    with the state after any batch gives the rest."""
    recs = varied_records(150)
    data = shards(tmp_path / "data", recs)
    tok, s = CharTokenizer(), DataSettings(60, template="plain")
    plan, meta = plan_stream(data, None, tok, s, seed=7)
    assert meta["template"] == "plain" and plan.held_out == (0.0,)  # a validation file: nothing held out of train
    want, _ = prepare_samples(recs, tok, s)
    assert 100 < len(want) < len(recs)  # some records leave no response within 60 tokens, as prepare drops them
    ref = BatchStream(want, 3, shuffle=False, packing=packing, max_seq_length=60)
    per_epoch = count_packed_batches(want, 3, 60) if packing else -(-len(want) // 3)
    n = 3 * per_epoch + 5
    expected = [next(ref) for _ in range(n)]
    assert ref.epoch >= 3
    stream = plan.batches(tok, 3, packing=packing, max_seq_length=60)
    states = []
    for i, want_batch in enumerate(expected):
        assert same_batch(next(stream), want_batch), i
        states.append(stream.state_dict())
    stream.close()
    rows_mid_window = [st["row"] for st in states if st["row"]]
    assert not packing or rows_mid_window  # resumed inside a packed window, not only at its start
    for i in range(0, n - 1, 5):
        resumed = plan.batches(tok, 3, packing=packing, max_seq_length=60)
        resumed.load_state_dict(states[i])
        assert all(same_batch(next(resumed), expected[j]) for j in range(i + 1, min(n, i + 12))), i
        resumed.close()


def test_the_held_out_part_is_decided_record_by_record(tmp_path):
    """No validation file: a record is held out by a hash of (seed, file name, row); training never sees it,
    validation takes the first held-out ones in file order; another seed holds out others."""
    recs = varied_records(400)
    data = shards(tmp_path / "data", recs, with_val=False)
    tok, s = CharTokenizer(), DataSettings(400, template="plain")
    plan, _ = plan_stream(data, None, tok, s, seed=3)
    assert plan.held_out == (HELD_OUT,)
    names = ["train-0.parquet"] * 200 + ["train-1.jsonl"] * 200
    rows = list(range(1, 201)) * 2  # rows from 1 in each file (a JSONL row is its line)
    out = [held_out(Path(f), r, 3, HELD_OUT) for f, r in zip(names, rows)]
    assert 10 <= sum(out) <= 30  # ~5% of 400
    kept = [r for r, o in zip(recs, out) if not o]
    heldout = [r for r, o in zip(recs, out) if o]
    stream = plan.batches(tok, 4)
    got = [x for _ in range(len(kept) // 4) for x in next(stream)["input_ids"].tolist()]
    stream.close()
    want, _ = prepare_samples(kept, tok, s)
    ref_stream = BatchStream(want, 4, shuffle=False)
    assert got == [x for _ in range(len(kept) // 4) for x in next(ref_stream)["input_ids"].tolist()]
    val = plan.validation(tok, 5)
    want_val, _ = prepare_samples(heldout[:5], tok, s)
    assert [v["input_ids"].tolist() for v in val] == [v["input_ids"].tolist() for v in want_val]
    assert [held_out(Path(f), r, 4, HELD_OUT) for f, r in zip(names, rows)] != out


def test_a_streamed_mixture_draws_by_weight_deterministically_and_resumes(tmp_path):
    """Two sources weighted 3:1: sample i comes from the source the i-th draw of the seed picks, and over 10k draws
    each source's share is within 2% of its weight's; two runs give the same sequence, a stream resumed after 1000
    samples continues it; the realized mixture counts what was given."""
    a = write_jsonl(tmp_path / "a.jsonl", [{"instruction": f"a{i}", "output": "x"} for i in range(50)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"instruction": f"b{i}", "output": "y"} for i in range(30)])
    (tmp_path / "mix.json").write_text(json.dumps([{"path": str(a), "weight": 3}, {"path": str(b), "weight": 1}]))
    tok, s = CharTokenizer(), DataSettings(64, template="plain")

    def batches(n, state=None):
        plan, _ = plan_stream(None, tmp_path / "mix.json", tok, s, seed=11)
        assert plan.held_out == (HELD_OUT, HELD_OUT)
        stream = plan.batches(tok, 10)
        if state:
            stream.load_state_dict(state)
        out = [next(stream)["input_ids"] for _ in range(n)]
        state, mixture = stream.state_dict(), stream.mixture()
        stream.close()
        return [row.tolist() for batch in out for row in batch], state, mixture

    whole, _, mixture = batches(200)
    from_a = [row[1] == 3 + ord("a") for row in whole]  # each sample's first letter: a or b
    assert from_a == [_draw(11, i) < 0.75 for i in range(2000)]
    assert abs(sum(_draw(11, i) < 0.75 for i in range(10_000)) / 10_000 - 0.75) < 0.02
    assert [m["used"] for m in mixture] == [sum(from_a), 2000 - sum(from_a)]
    assert batches(200)[0] == whole
    head, state, _ = batches(100)
    rest, _, mixture2 = batches(100, state)
    assert head + rest == whole and mixture2 == mixture


def test_streaming_refusals_are_one_line(tmp_path):
    tok, s = CharTokenizer(), DataSettings(64, template="plain")
    a = write_jsonl(tmp_path / "a.jsonl", varied_records(10))
    (tmp_path / "mix.json").write_text(json.dumps([{"path": str(a), "weight": 1}, {"path": str(a), "epochs": 2}]))
    with pytest.raises(UserError) as e:
        plan_stream(None, tmp_path / "mix.json", tok, s, seed=1)
    assert_one_line_message(e, "entry 2 of --data_sources file", "epochs", "weight")
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    for name in ("train.pt", "val.pt"):
        torch.save([], prepared / name)
    (prepared / "prepare_config.json").write_text("{}")
    with pytest.raises(UserError) as e:
        plan_stream(prepared, None, tok, s, seed=1)
    assert_one_line_message(e, str(prepared), "prepared folder", "leave --streaming out")
    plan, _ = plan_stream(a, None, tok, s, seed=1)
    stream = plan.batches(tok, 2)
    with pytest.raises(UserError) as e:  # a checkpoint of a run without --streaming
        stream.load_state_dict({"epoch": 0, "position": 4, "row": 0, "seed": 1})
    assert_one_line_message(e, "not made by a --streaming run")
    state = stream.state_dict()
    write_jsonl(a, varied_records(11))
    changed, _ = plan_stream(a, None, tok, s, seed=1)
    with pytest.raises(UserError) as e:  # the file the byte offsets point into changed
        changed.batches(tok, 2).load_state_dict(state)
    assert_one_line_message(e, "a.jsonl was", "bytes, now", "changed since the checkpoint")


# ---- through finetune/lora.py ----------------------------------------------------------------------------------------
COMMON = dict(max_iters=5, batch_size=4, micro_batch_size=2, eval_iters=2, eval_interval=5, lora_dropout=0.0)


@pytest.mark.parametrize("packing", [False, True])
def test_a_streamed_run_equals_the_prepared_run_over_the_same_order(train_setup, tmp_path, packing):
    """The prepared run shuffles its 80 samples (epoch_order of --seed 1337); the streamed run reads a file holding
    them in that order: every iteration's loss, the validation losses and the adapter are the same, padded or
    packed."""
    recs, val = h.make_records(80, seed=4), h.make_records(6, seed=8)
    prepared, streamed = tmp_path / "prepared", tmp_path / "streamed"
    for folder, order in ((prepared, range(80)), (streamed, epoch_order(80, 1337, 0))):
        folder.mkdir()
        write_jsonl(folder / "train.jsonl", [recs[i] for i in order])
        write_jsonl(folder / "val.jsonl", val)
    args = dict(COMMON, packing=str(packing).lower(), max_seq_length=64)
    h.train({**train_setup, "data": prepared}, tmp_path / "a", **args)
    r = h.train({**train_setup, "data": streamed}, tmp_path / "b", streaming="true", **args)
    assert "train.jsonl streamed" in r.stderr
    assert not list(streamed.glob(".prepared-*"))  # nothing tokenized ahead into a cache
    ma, mb = h.read_metrics(tmp_path / "a"), h.read_metrics(tmp_path / "b")
    assert len(ma) == len(mb) == 5
    for x, y in zip(ma, mb):
        assert abs(float(x["loss"]) - float(y["loss"])) <= 1e-6 and x["tokens"] == y["tokens"], (x, y)
    assert abs(float(ma[-1]["val_loss"]) - float(mb[-1]["val_loss"])) <= 1e-6
    final = "lit_model_lora_finetuned.pth"
    assert h.max_abs_diff(h.load_lora(tmp_path / "a" / final), h.load_lora(tmp_path / "b" / final)) < 1e-6


@pytest.mark.parametrize("packing", [False, True])
def test_a_streamed_run_resumed_mid_stream_equals_the_uninterrupted_one(train_setup, tmp_path, packing):
    """A streamed run's checkpoint (what a killed run leaves) resumed: the later iterations and the adapter equal the
    uninterrupted run's (LoRA dropout on), although the lines of the file before the checkpoint's byte offset were
    overwritten with garbage first (a resumed run that read the file from its start would fail). Padded: iteration 4
    of 8. Packed (rows of 64 tokens, windows of 16 micro-batches, about 110 samples): iteration 10 of 12, inside the
    second window, which is read again from its start and its rows given out skipped."""
    n, iters, at = (300, 12, 10) if packing else (40, 8, 4)
    data = tmp_path / "data"
    data.mkdir()
    train = write_jsonl(data / "train.jsonl", h.make_records(n, seed=9))
    write_jsonl(data / "val.jsonl", h.make_records(6, seed=8))
    setup = {**train_setup, "data": data}
    args = dict(COMMON, max_iters=iters, save_interval=at, keep_checkpoints=0, lora_dropout=0.1, streaming="true",
                packing=str(packing).lower(), max_seq_length=64, eval_interval=4)
    a, b = tmp_path / "a", tmp_path / "b"
    h.train(setup, a, **args)
    (b / "checkpoints").mkdir(parents=True)
    shutil.copy(a / f"checkpoints/iter-{at:06d}.pth", b / "checkpoints")
    state = torch.load(b / f"checkpoints/iter-{at:06d}.pth", weights_only=False)["resume"]["data"]
    offset = state["stream"]["place"][1]
    assert offset > 0 and state["stream"]["epoch"] == 0
    if packing:
        assert state["row"] > 0  # inside a window: it is read again from its start and its first rows skipped
    else:
        assert state["stream"]["place"][0] == 16  # 4 iterations x 4 samples read
    text = train.read_bytes()
    head = b"".join(b"#" * (len(ln) - 1) + b"\n" for ln in text[:offset].splitlines(keepends=True))
    train.write_bytes(head + text[offset:])  # same size, unreadable before the offset
    r = h.train(setup, b, resume="true", **args)
    assert f"at iteration {at}" in r.stderr
    la, lb = h.losses_by_iter(a), h.losses_by_iter(b)
    assert sorted(lb) == list(range(at + 1, iters + 1)), lb
    assert all(abs(la[i] - lb[i]) <= 1e-6 for i in lb), (la, lb)
    final = "lit_model_lora_finetuned.pth"
    assert h.max_abs_diff(h.load_lora(a / final), h.load_lora(b / final)) < 1e-6


def test_corrupt_shards_in_a_streamed_run_are_one_line(train_setup, tmp_path):
    """A parquet shard cut short is refused before the model loads; a bad JSONL line and a torn parquet row group,
    met mid-run, end the run with one error line naming the file and the line / rows (exit 2, no traceback)."""
    recs = h.make_records(60, seed=2)
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "val.jsonl", h.make_records(6, seed=8))
    pd.DataFrame(recs).to_parquet(tmp_path / "whole.parquet", row_group_size=10)
    whole = (tmp_path / "whole.parquet").read_bytes()
    (data / "train-1.parquet").write_bytes(whole[:len(whole) // 2])
    setup, args = {**train_setup, "data": data}, dict(COMMON, max_iters=20, streaming="true")
    r = h.train(setup, tmp_path / "cut", check=False, **args)
    h.assert_one_line_error(r, "train-1.parquet", "not a readable parquet file", "cut short")

    write_jsonl(data / "train-0.jsonl", recs[:20])
    with open(data / "train-0.jsonl", "a") as f:
        f.write('{"instruction": "kind", "input": oops}\n')
    shutil.copy(tmp_path / "whole.parquet", data / "train-1.parquet")
    r = h.train(setup, tmp_path / "bad_line", check=False, **args)
    _assert_ends_in_one_error(r, f"line 21 of {data / 'train-0.jsonl'}", "not valid JSON")

    write_jsonl(data / "train-0.jsonl", recs[:20])
    torn = bytearray(whole)
    column = pq.ParquetFile(tmp_path / "whole.parquet").metadata.row_group(2).column(0)
    at = column.dictionary_page_offset or column.data_page_offset
    torn[at:at + 40] = b"Z" * 40  # the first page of row group 2 overwritten, the footer intact
    (data / "train-1.parquet").write_bytes(bytes(torn))
    r = h.train(setup, tmp_path / "torn", check=False, **args)
    _assert_ends_in_one_error(r, f"rows 21-30 (row group 2) of {data / 'train-1.parquet'}", "not readable")


def _assert_ends_in_one_error(r, *expect: str) -> None:
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "Training 20 iterations" in r.stderr, r.stderr
    for e in expect:
        assert e in last, (e, last)


def test_a_streamed_mixture_through_finetune_and_dpo_refuses(train_setup, tmp_path):
    """--streaming with --data_sources: metrics.json reports the samples each source gave (all the steps' samples);
    finetune/dpo.py refuses --streaming in one line."""
    a = write_jsonl(tmp_path / "a.jsonl", h.make_records(30, seed=1))
    pd.DataFrame(h.make_records(30, seed=2)).to_parquet(tmp_path / "b.parquet")
    (tmp_path / "mix.yaml").write_text(f"- {{path: {a}, weight: 2}}\n- {{path: b.parquet, weight: 1}}\n")
    h.train(train_setup, tmp_path / "out", data_dir=None, data_sources=tmp_path / "mix.yaml", streaming="true",
            **COMMON)
    mixture = json.loads((tmp_path / "out/metrics.json").read_text())["data_mixture"]
    assert [m["weight"] for m in mixture] == [2, 1] and sum(m["used"] for m in mixture) == 5 * 4
    assert all(m["used"] > 0 for m in mixture)
    r = h.run_script(h.ROOT / "finetune" / "dpo.py", h.train_args(train_setup, tmp_path / "dpo", streaming="true"))
    h.assert_one_line_error(r, "--streaming does not apply to finetune/dpo.py")
