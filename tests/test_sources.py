"""Every record source --data_dir accepts (.json, .jsonl, .csv, .parquet, a folder of shards, a datasets save_to_disk
folder, a dataset in the local hub cache) read to the records its reference reader (pandas, pyarrow, datasets) reads
from the files the test writes; conversations in parquet prepared as transformers renders them; column mapping; bad
input refused in one line."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers_data import CharTokenizer, assert_one_line_message

from lit_qlora.data.prepare import DataSettings, ensure_prepared
from lit_qlora.data.records import iter_rows
from lit_qlora.data.sources import Source, resolve
from lit_qlora.utils import UserError

pd = pytest.importorskip("pandas")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

RECS = [{"instruction": f"Say {i} in words, ünïcode 😀", "input": "" if i % 3 else f"ctx {i}", "output": f"w{i}"}
        for i in range(10)]
HASH = "0123456789abcdef0123456789abcdef01234567"


def records_of(path, **kw) -> tuple[list, list | None]:
    train, val = resolve(path, **kw)
    return [r for _, _, r in train.rows()], (None if val is None else [r for _, _, r in val.rows()])


def write_hub_dataset(cache, repo_id: str, files: dict) -> None:
    """A dataset as huggingface_hub lays it out in its cache (refs/main -> snapshots/<commit>/...)."""
    root = cache / f"datasets--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(HASH)
    for rel, df in files.items():
        (root / "snapshots" / HASH / rel).parent.mkdir(parents=True, exist_ok=True)
        df.to_parquet(root / "snapshots" / HASH / rel)
    (root / "snapshots" / HASH / "README.md").write_text("# a dataset card, not data\n")


@pytest.mark.parametrize("kind", ["json", "jsonl", "csv", "parquet"])
def test_each_file_type_reads_as_its_reference_reader(tmp_path, kind):
    df = pd.DataFrame(RECS)
    path = tmp_path / f"data.{kind}"
    if kind == "json":
        df.to_json(path, orient="records", force_ascii=False)
        want = pd.read_json(path, orient="records", dtype=False).to_dict("records")
    elif kind == "jsonl":
        df.to_json(path, orient="records", lines=True, force_ascii=False)
        want = pd.read_json(path, orient="records", lines=True, dtype=False).to_dict("records")
    elif kind == "csv":
        df.to_csv(path, index=False)
        want = pd.read_csv(path, dtype=str, keep_default_na=False).to_dict("records")
    else:
        df.to_parquet(path, row_group_size=3)
        assert pq.ParquetFile(path).num_row_groups == 4  # the reader goes group by group
        want = pd.read_parquet(path).to_dict("records")
    got, val = records_of(path)
    assert got == want == RECS and val is None


def test_parquet_is_read_a_row_group_at_a_time(tmp_path, monkeypatch):
    pd.DataFrame(RECS).to_parquet(tmp_path / "d.parquet", row_group_size=2)
    reads = []
    real = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, i, *a, **k: reads.append(i) or real(self, i))
    rows = iter_rows(tmp_path / "d.parquet")
    assert [next(rows) for _ in range(3)] == [(1, RECS[0]), (2, RECS[1]), (3, RECS[2])]
    assert reads == [0, 1]  # the three first rows need the first two groups, no more


def test_folders_of_shards_and_splits(tmp_path):
    df = pd.DataFrame(RECS)
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):  # the shards of one set, read in name order, metadata files left alone
        df.iloc[i * 4:(i + 1) * 4].to_parquet(shards / f"part-{i:05d}.parquet")
    (shards / "dataset_info.json").write_text("{}")
    got, val = records_of(shards)
    assert got == pd.concat([pd.read_parquet(shards / f"part-{i:05d}.parquet") for i in range(3)]).to_dict("records")
    assert got == RECS and val is None

    hf = tmp_path / "hf" / "data"  # the hub's layout: data/train-*.parquet, data/validation-*.parquet
    hf.mkdir(parents=True)
    df.iloc[:4].to_parquet(hf / "train-00000-of-00002.parquet")
    df.iloc[4:8].to_json(hf / "train-00001-of-00002.jsonl", orient="records", lines=True, force_ascii=False)
    df.iloc[8:].to_parquet(hf / "validation-00000-of-00001.parquet")
    assert records_of(tmp_path / "hf") == (RECS[:8], RECS[8:])


def test_datasets_folders(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(RECS)
    ds.save_to_disk(str(tmp_path / "one"))
    got, val = records_of(tmp_path / "one")
    assert got == datasets.load_from_disk(str(tmp_path / "one")).to_list() == RECS and val is None

    dd = datasets.DatasetDict(train=datasets.Dataset.from_list(RECS[:7]),
                              validation=datasets.Dataset.from_list(RECS[7:]))
    dd.save_to_disk(str(tmp_path / "dict"))
    ref = datasets.load_from_disk(str(tmp_path / "dict"))
    assert records_of(tmp_path / "dict") == (ref["train"].to_list(), ref["validation"].to_list())
    assert ref["train"].to_list() == RECS[:7]


def test_a_dataset_in_the_local_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    df = pd.DataFrame(RECS)
    write_hub_dataset(tmp_path / "hub", "me/tasks", {"data/train-00000-of-00001.parquet": df.iloc[:8],
                                                     "data/test-00000-of-00001.parquet": df.iloc[8:]})
    monkeypatch.chdir(tmp_path)  # owner/name is no folder here
    train, val = resolve("me/tasks")
    assert [r for _, _, r in train.rows()] == RECS[:8] and val is None
    samples, _, meta = ensure_prepared("me/tasks", CharTokenizer(), DataSettings(200, template="plain"))
    assert meta["n_train"] + meta["n_val"] == 8 and meta["template"] == "plain"

    with pytest.raises(UserError) as e:
        resolve("me/absent")
    assert_one_line_message(e, "me/absent", str(tmp_path / "hub" / "datasets--me--absent"), "nothing is downloaded")


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from helpers_chat import load_template, make_chat_checkpoint

    from lit_qlora.tokenizer import Tokenizer

    folder = make_chat_checkpoint("chatml_smollm", tmp_path_factory.mktemp("chatml"),
                                  load_template("chatml_generation"))
    return Tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)


CHATS = [[{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi, ünïcode 😀"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
          {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 2 + 3?"},
          {"role": "assistant", "content": "5."}],
         [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]]


def test_conversations_in_parquet_and_a_renamed_column(chatml, tmp_path):
    tok, ref = chatml
    (tmp_path / "a").mkdir()
    pq.write_table(pa.Table.from_pylist([{"messages": m, "id": i} for i, m in enumerate(CHATS)]),
                   tmp_path / "a" / "train.parquet")
    pq.write_table(pa.Table.from_pylist([{"messages": CHATS[0], "id": 0}]), tmp_path / "a" / "validation.parquet")
    want = [r["messages"] for r in pq.read_table(tmp_path / "a" / "train.parquet").to_pylist()]
    assert want == CHATS
    train, _, meta = ensure_prepared(tmp_path / "a", tok, DataSettings(512))
    assert meta["template"] == "chat"  # auto: the parquet rows are conversations
    for sample, messages in zip(train, want):
        out = ref.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        labels = [i if m else -100 for i, m in zip(out["input_ids"], out["assistant_masks"])]
        assert sample["input_ids"].tolist() == out["input_ids"] and sample["labels"].tolist() == labels

    # ShareGPT turns in a column of another name, named by --messages_column
    (tmp_path / "b").mkdir()
    share = [[{"from": {"user": "human", "assistant": "gpt"}.get(t["role"], t["role"]), "value": t["content"]}
              for t in m] for m in CHATS]
    pd.DataFrame({"dialog": share}).to_json(tmp_path / "b" / "train.jsonl", orient="records", lines=True,
                                            force_ascii=False)
    pd.DataFrame({"dialog": share[:1]}).to_json(tmp_path / "b" / "val.jsonl", orient="records", lines=True)
    renamed, _, _ = ensure_prepared(tmp_path / "b", tok, DataSettings(512, messages_column="dialog"))
    assert [s["input_ids"].tolist() for s in renamed] == [s["input_ids"].tolist() for s in train]
    with pytest.raises(UserError) as e:
        ensure_prepared(tmp_path / "b", tok, DataSettings(512, messages_column="turns"))
    assert_one_line_message(e, "row 1 of", "train.jsonl", "'turns'", "--messages_column", "dialog")


def test_column_mapping(tmp_path):
    df = pd.DataFrame({"question": [r["instruction"] for r in RECS], "ctx": [r["input"] for r in RECS],
                       "answer": [r["output"] for r in RECS]})
    df.to_parquet(tmp_path / "qa.parquet")
    s = DataSettings(200, template="plain", instruction_key="question", input_key="ctx", output_key="answer")
    train, val, _ = ensure_prepared(tmp_path / "qa.parquet", CharTokenizer(), s)
    tok = CharTokenizer()
    want = [(r["instruction"] + (f"\n{r['input']}" if r["input"] else "") + "\n" + r["output"]) for r in RECS]
    assert sorted(x["input_ids"].tolist() for x in train + val) == sorted(tok.encode(w, eos=True).tolist()
                                                                          for w in want)
    with pytest.raises(UserError) as e:
        ensure_prepared(tmp_path / "qa.parquet", CharTokenizer(), DataSettings(200, template="plain"))
    assert_one_line_message(e, "row 1 of", "qa.parquet", "'instruction'", "--prompt_column", "question, ctx, answer")


def test_bad_sources_are_one_line(tmp_path, monkeypatch):
    pd.DataFrame(RECS * 10).to_parquet(tmp_path / "good.parquet", row_group_size=10)
    data = (tmp_path / "good.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[:len(data) // 2])
    with pytest.raises(UserError) as e:
        list(iter_rows(tmp_path / "cut.parquet"))
    assert_one_line_message(e, "cut.parquet", "not a readable parquet file", "damaged or cut short")
    torn = bytearray(data)
    torn[len(data) // 3:len(data) // 3 + 200] = b"Z" * 200  # a data page overwritten, the footer intact
    (tmp_path / "torn.parquet").write_bytes(bytes(torn))
    with pytest.raises(UserError) as e:
        list(iter_rows(tmp_path / "torn.parquet"))
    assert_one_line_message(e, "torn.parquet", "row group", "rows ")

    (tmp_path / "bad.jsonl").write_text('{"instruction": "a", "output": "b"}\n\n{"instruction": oops}\n')
    with pytest.raises(UserError) as e:
        list(iter_rows(tmp_path / "bad.jsonl"))
    assert_one_line_message(e, "line 3 of", "bad.jsonl", "not valid JSON")

    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # the optional `data` extra not installed
    with pytest.raises(UserError) as e:
        list(iter_rows(tmp_path / "good.parquet"))
    assert_one_line_message(e, "pyarrow.parquet", "pip install 'lit-qlora[data]'")


def test_source_names(tmp_path):
    assert str(Source((tmp_path / "a.jsonl",))) == str(tmp_path / "a.jsonl")
    assert Source((tmp_path / "a.parquet", tmp_path / "b.parquet")).short_name() == "2 shards (a.parquet ... b.parquet)"


# ---- mixtures ------------------------------------------------------------------------------------------------------
def test_mixture_proportions_and_determinism():
    from lit_qlora.data.sources import MixEntry, mix

    pools = [[("a", i) for i in range(3000)], [("b", i) for i in range(5000)], [("c", i) for i in range(2000)]]
    entries = [MixEntry("a", weight=0.7), MixEntry("b", weight=0.2), MixEntry("c", weight=0.1)]
    mixed, realized = mix(pools, entries, seed=7)
    assert len(mixed) == 10_000 and [r["used"] for r in realized] == [7000, 2000, 1000]
    for name, w in (("a", 0.7), ("b", 0.2), ("c", 0.1)):  # the whole set exactly, and its first half within 2%
        assert sum(x[0] == name for x in mixed) / 10_000 == pytest.approx(w)
        share = sum(x[0] == name for x in mixed[:5000]) / 5000
        assert abs(share - w) <= 0.02, (name, share)
    assert mix(pools, entries, seed=7)[0] == mixed and mix(pools, entries, seed=8)[0] != mixed
    a = [x for x in mixed if x[0] == "a"]  # upsampled: every record of a twice or thrice, none left out
    assert {n for n in (a.count(x) for x in set(a))} == {2, 3} and len(set(a)) == 3000

    from lit_qlora.data.sources import mixture_counts
    thirds = [MixEntry("x", weight=2), MixEntry("y", weight=1)]  # 10 samples at 2:1: 6.67 and 3.33 round to 7 and 3
    assert mixture_counts(thirds, [5, 5]) == [7, 3] and mixture_counts(thirds * 3, [1] * 6) == [1] * 6

    epochs = [MixEntry("a", epochs=0.5), MixEntry("c", epochs=2)]
    mixed, realized = mix([pools[0], pools[2]], epochs, seed=1)
    c = [x for x in mixed if x[0] == "c"]
    assert [r["used"] for r in realized] == [1500, 4000] and all(c.count(x) == 2 for x in pools[2])
    assert len({x for x in mixed if x[0] == "a"}) == 1500  # half a pass: no record twice


def test_mixture_files_prepare_every_source(tmp_path):
    from lit_qlora.data.prepare import ensure_mixture

    df = pd.DataFrame(RECS)
    (tmp_path / "ours").mkdir()
    df.iloc[:4].to_json(tmp_path / "ours" / "train.jsonl", orient="records", lines=True)
    df.iloc[4:].to_parquet(tmp_path / "public.parquet")
    (tmp_path / "mix.yaml").write_text("- {path: ours, weight: 3}\n- {path: public.parquet, weight: 1}\n")
    s = DataSettings(200, template="plain", test_split_fraction=0.2)
    train, val, meta = ensure_mixture(tmp_path / "mix.yaml", CharTokenizer(), s, seed=3)
    n_ours, n_public = 4 - 1, 6 - 1  # one of each held out for validation
    assert [r["available"] for r in meta["mixture"]] == [n_ours, n_public] and len(val) == 2
    assert [r["used"] for r in meta["mixture"]] == [6, 2] and len(train) == 8 and meta["n_train"] == 8
    ours = {tuple(x["input_ids"].tolist()) for x in ensure_prepared(tmp_path / "ours", CharTokenizer(), s)[0]}
    assert sum(tuple(x["input_ids"].tolist()) in ours for x in train) == 6
    assert [x["input_ids"].tolist() for x in ensure_mixture(tmp_path / "mix.yaml", CharTokenizer(), s, 3)[0]] == \
        [x["input_ids"].tolist() for x in train]


@pytest.mark.parametrize("text,expect", [
    ('[{"path": "d", "weight": 0}]', ["entry 1", "weight is 0", "> 0"]),
    ('[{"path": "d", "weight": -1}]', ["entry 1", "weight is -1"]),
    ('[{"path": "d", "weight": "lots"}]', ["entry 1", "weight is 'lots'"]),
    ('[{"path": "d", "weight": true}]', ["entry 1", "weight is True"]),
    ('[{"path": "d", "weight": 1}, {"path": "e"}]', ["entry 2", "neither weight nor epochs"]),
    ('[{"path": "d", "weight": 1, "epochs": 2}]', ["entry 1", "both weight and epochs"]),
    ('[{"path": "d", "weight": 1, "wieght": 2}]', ["entry 1", "unknown key 'wieght'"]),
    ('[{"weight": 1}]', ["entry 1", "has no 'path'"]),
    ('{"path": "d"}', ["holds an object where a list belongs"]),
    ('[]', ["holds no list of sources"]),
])
def test_bad_mixture_files_are_one_line(tmp_path, text, expect):
    from lit_qlora.data.sources import read_mixture

    (tmp_path / "mix.json").write_text(text)
    with pytest.raises(UserError) as e:
        read_mixture(tmp_path / "mix.json")
    assert_one_line_message(e, str(tmp_path / "mix.json"), *expect)


def test_a_mixture_trains_reports_and_resumes(train_setup, tmp_path):
    """finetune/lora.py --data_sources: the realized mixture in metrics.json; a run resumed from its iteration-2
    checkpoint retraces the uninterrupted one (the same mixed sequence, LoRA dropout on)."""
    import json
    import shutil

    import helpers_train as h

    recs = h.make_records(40, seed=5)
    pd.DataFrame(recs).to_parquet(tmp_path / "other.parquet")
    (tmp_path / "mix.json").write_text(json.dumps([{"path": str(train_setup["data"]), "weight": 1},
                                                   {"path": "other.parquet", "epochs": 2}]))
    common = dict(data_dir=None, data_sources=tmp_path / "mix.json", max_iters=4, save_interval=2, keep_checkpoints=0,
                  eval_interval=4, lora_dropout=0.1)
    a = tmp_path / "a"
    h.train(train_setup, a, **common)
    mixture = json.loads((a / "metrics.json").read_text())["data_mixture"]
    n_tasks = round(64 * 0.95)  # tasks.json: 64 records, 5% held out; other.parquet: 40, 2 held out, twice
    assert [(m["available"], m["used"]) for m in mixture] == [(n_tasks, n_tasks), (38, 76)]
    assert sum(m["share"] for m in mixture) == pytest.approx(1)
    b = tmp_path / "b"
    (b / "checkpoints").mkdir(parents=True)
    shutil.copy(a / "checkpoints" / "iter-000002.pth", b / "checkpoints")
    h.train(train_setup, b, resume="true", **common)
    la, lb = h.losses_by_iter(a), h.losses_by_iter(b)
    assert all(abs(la[i] - lb[i]) <= 1e-6 for i in (3, 4)), (la, lb)
    final = "lit_model_lora_finetuned.pth"
    assert h.max_abs_diff(h.load_lora(a / final), h.load_lora(b / final)) < 1e-6


# ---- streaming: the sample stream (finetune --streaming: tests/test_streaming.py) -----------------------------------
def _stream(src, tok, s, **kw):
    from lit_qlora.data.streaming import SampleStream, record_tokenizer, source_rows_from

    return SampleStream(source_rows_from(src), record_tokenizer(tok, s), **kw)


def _ids(samples) -> list[list[int]]:
    return [x["input_ids"].tolist() for x in samples]


def test_a_stream_gives_the_prepared_samples_in_file_order(tmp_path):
    import torch

    from lit_qlora.data.batching import collate
    from lit_qlora.data.prepare import prepare_samples
    from lit_qlora.data.streaming import stream_batches

    recs = RECS * 3
    pd.DataFrame(recs[:12]).to_parquet(tmp_path / "a.parquet", row_group_size=5)
    pd.DataFrame(recs[12:]).to_json(tmp_path / "b.jsonl", orient="records", lines=True, force_ascii=False)
    src = Source((tmp_path / "a.parquet", tmp_path / "b.jsonl"))
    tok, s = CharTokenizer(), DataSettings(40, template="plain")  # some samples truncated, some dropped
    want, _ = prepare_samples(recs, tok, s)
    assert _ids(_stream(src, tok, s, buffer=3, max_epochs=1)) == _ids(want)
    batches = list(stream_batches(_stream(src, tok, s, buffer=3, max_epochs=1), 4))
    ref = [collate(want[i:i + 4]) for i in range(0, len(want), 4)]
    assert len(batches) == len(ref) and all(torch.equal(a[k], b[k]) for a, b in zip(batches, ref) for k in a)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_resumed_stream_equals_the_uninterrupted_one(tmp_path, monkeypatch, kind):
    recs = RECS * 3
    df = pd.DataFrame(recs)
    path = tmp_path / f"d.{kind}"
    df.to_parquet(path, row_group_size=4) if kind == "parquet" else df.to_json(path, orient="records", lines=True)
    src, tok, s = Source((path,)), CharTokenizer(), DataSettings(200, template="plain")
    whole = _ids(_stream(src, tok, s, buffer=2, max_epochs=2))
    assert len(whole) == 60
    first = _stream(src, tok, s, buffer=2, max_epochs=2)
    it = iter(first)
    head = [next(it)["input_ids"].tolist() for _ in range(37)]  # into the second epoch, mid-file
    state = first.state_dict()
    first.close()
    assert state["epoch"] == 1 and state["place"][0] == 7
    if kind == "jsonl":  # entered at the byte offset after the 7th line (read from line 1, it would repeat them)
        assert state["place"][1] == sum(len(ln) for ln in path.read_bytes().splitlines(keepends=True)[:7])
    else:
        reads = []
        real_read = pq.ParquetFile.read_row_group
        monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, i, *a, **k: reads.append(i) or
                            real_read(self, i))
    rest = _ids(_stream(src, tok, s, buffer=2, max_epochs=2, state=state))
    assert head + rest == whole
    if kind == "parquet":
        assert reads[0] == 1  # rows 8 on: the first row group (rows 1-4) is skipped unread


def test_a_stream_holds_a_bounded_buffer_of_an_endless_source():
    import time

    from lit_qlora.data.streaming import SampleStream

    made = []

    def endless(state):  # a source never materialized: rows are made as they are asked for
        i = state.get("place", [0])[0]
        while True:
            i += 1
            made.append(i)
            yield Path("gen"), i, {"instruction": f"n{i}", "output": "x"}, {"file": 0, "place": [i, 0, 0]}

    tok, s = CharTokenizer(), DataSettings(64, template="plain")
    from lit_qlora.data.streaming import record_tokenizer

    stream = SampleStream(endless, record_tokenizer(tok, s), buffer=5)
    it = iter(stream)
    got = [next(it) for _ in range(10)]
    time.sleep(0.5)  # the worker runs ahead as far as the buffer lets it
    assert len(got) == 10 and 10 + 5 <= len(made) <= 10 + 5 + 2
    stream.close()


def test_a_bad_row_in_a_stream_is_one_line(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"instruction": "a", "output": "b"}\n{"instruction": oops}\n')
    stream = _stream(Source((tmp_path / "d.jsonl",)), CharTokenizer(), DataSettings(64, template="plain"))
    with pytest.raises(UserError) as e:
        list(stream)
    assert_one_line_message(e, "line 2 of", "d.jsonl", "not valid JSON")
