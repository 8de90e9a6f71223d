"""Records to tokenized samples (prompt masking, truncation), prepared folders and their cache, the prepare scripts."""
from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import helpers_train
import pytest
import torch
from helpers_data import DEMO, RECORDS, REPO, CharTokenizer, assert_one_line_message, write_json

from lit_qlora.data.prepare import DataSettings, ensure_prepared, load_prepared, prepare_samples, save_prepared
from lit_qlora.data.templates import get_template
from lit_qlora.utils import UserError

MASKING_RECORDS = [
    {"instruction": "Reverse the word.", "input": "cat", "output": "tac"},
    {"instruction": "Translate to German.", "input": "the quick brown fox", "output": "der schnelle braune Fuchs"},
    {"instruction": "Write a function.", "input": "", "output": "def add(a, b):\n    return a + b"},
    {"instruction": "Say hello in Japanese.", "output": "こんにちは、世界。 😀"},
    {"instruction": "Count.", "input": "1 to 3", "output": " 1 2 3"},  # a response that starts with a space
]


@pytest.fixture(scope="module")
def masking_tokenizers(tmp_path_factory) -> dict:
    """A byte-level BPE (Llama 3 style) and a sentencepiece model (Llama 2 style), each with transformers' own
    tokenizer for the same folder: the reference the masks are checked against."""
    import transformers
    from helpers_tokenizer import make_hf_bpe_tokenizer, make_sentencepiece_tokenizer

    from lit_qlora.tokenizer import Tokenizer

    out = {}
    for kind, make in (("bpe", make_hf_bpe_tokenizer), ("sentencepiece", make_sentencepiece_tokenizer)):
        folder = make(tmp_path_factory.mktemp(kind))
        out[kind] = (Tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder))
    return out


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
@pytest.mark.parametrize("template", ["alpaca", "plain"])
def test_prompt_masking_against_transformers(masking_tokenizers, kind, template):
    """The trained (unmasked) tokens are exactly the response followed by eos, and the masked ones exactly the prompt,
    as transformers' tokenizer reads them back; the ids are what transformers gives for prompt + response. The
    reference never calls our code, so a mask that is off by a token, or a boundary merge that moves response text
    into the masked part, fails."""
    ours, ref = masking_tokenizers[kind]
    samples, n_trunc = samples_of(MASKING_RECORDS, ours, template, max_seq_length=10_000)
    assert n_trunc == 0 and len(samples) == len(MASKING_RECORDS)
    for rec, s in zip(MASKING_RECORDS, samples):
        prompt = get_template(template).format(rec["instruction"], rec.get("input", ""))
        ids, labels = s["input_ids"].tolist(), s["labels"]
        assert ids == ref(prompt + rec["output"])["input_ids"] + [ref.eos_token_id]
        trained = [i for i, lab in zip(ids, labels.tolist()) if lab != -100]
        masked = ids[:len(ids) - len(trained)]
        assert (labels[:len(masked)] == -100).all() and trained == ids[len(masked):]  # one masked prefix
        assert ref.decode(masked, skip_special_tokens=True) == ref.decode(ref(prompt)["input_ids"],
                                                                           skip_special_tokens=True)
        assert ref.decode(trained) == ref.decode(ref(prompt + rec["output"])["input_ids"][len(masked):]) + ref.eos_token
        response = ref.decode(trained[:-1])
        if kind == "sentencepiece":  # sentencepiece's decode drops the leading space of what it decodes
            response = " " * (len(rec["output"]) - len(rec["output"].lstrip(" "))) + response
        assert response == rec["output"] and trained[-1] == ref.eos_token_id
    unmasked, _ = samples_of(MASKING_RECORDS, ours, template, 10_000, mask_inputs=False)
    assert all(torch.equal(s["input_ids"], s["labels"]) for s in unmasked)
    custom, _ = samples_of(MASKING_RECORDS[:1], ours, template, 10_000, ignore_index=-1)
    assert custom[0]["labels"][0] == -1


def samples_of(records, tokenizer, template, max_seq_length, **kw):
    return prepare_samples(records, tokenizer, DataSettings(max_seq_length, template=template, **kw))


def prepared(data_dir, tokenizer, max_seq_length, **kw):
    return ensure_prepared(data_dir, tokenizer, DataSettings(max_seq_length, **kw))


def test_custom_keys_and_missing_field():
    recs = [{"q": "Add.", "ctx": "1 + 1", "a": "2"}]
    samples, _ = samples_of(recs, CharTokenizer(), "plain", 100, instruction_key="q", input_key="ctx", output_key="a")
    assert CharTokenizer().decode(samples[0]["input_ids"]) == "Add.\n1 + 1\n2"
    with pytest.raises(UserError) as e:  # a number where text belongs: refused, with how to write it
        samples_of([{**recs[0], "a": 2}], CharTokenizer(), "plain", 100, instruction_key="q", input_key="ctx",
                   output_key="a")
    assert_one_line_message(e, "record 0", "'a' is a number (2), not text", 'in quotes: "2"')
    with pytest.raises(UserError) as e:
        samples_of(recs, CharTokenizer(), "plain", 100)
    assert_one_line_message(e, "record 0", "'instruction'")


def test_truncation_counts():
    tok = CharTokenizer()
    full, _ = samples_of(RECORDS, tok, "plain", 1000)
    lengths = [len(s["input_ids"]) for s in full]
    limit = sorted(lengths)[1]  # exactly one sample fits at length == limit, two are longer
    samples, n_trunc = samples_of(RECORDS, tok, "plain", limit)
    assert n_trunc == sum(n > limit for n in lengths) == 2
    for s, n in zip(samples, lengths):
        assert len(s["input_ids"]) == len(s["labels"]) == min(n, limit)

    # Cut inside the prompt: no response token is left to learn from, so those samples are left out
    n_prompt = len(tok.encode(get_template("plain").format(RECORDS[2]["instruction"], RECORDS[2]["input"])))
    samples, n_trunc = samples_of(RECORDS, tok, "plain", n_prompt)
    assert n_trunc == 4 and len(samples) == 3
    assert all((s["labels"] != -100).any() for s in samples)
    with pytest.raises(UserError) as e:
        samples_of(RECORDS, tok, "plain", 5)
    assert_one_line_message(e, "max_seq_length=5")
    samples, _ = samples_of(RECORDS, tok, "plain", 5, mask_inputs=False)  # unmasked: all kept
    assert len(samples) == 4


def test_save_load_roundtrip(tmp_path):
    samples, _ = samples_of(RECORDS, CharTokenizer(), "alpaca", 1000)
    save_prepared(tmp_path / "p", samples[:3], samples[3:], {"template": "alpaca"})
    train, val, meta = load_prepared(tmp_path / "p")
    assert len(train) == 3 and len(val) == 1 and torch.equal(train[0]["labels"], samples[0]["labels"])
    assert meta["template"] == "alpaca" and meta["n_train"] == 3 and meta["n_val"] == 1
    (tmp_path / "p" / "prepare_config.json").unlink()  # an unfinished write is not trusted
    with pytest.raises(UserError):
        load_prepared(tmp_path / "p")


@pytest.mark.parametrize("lie, expect", [
    (lambda x: {"input_ids": x["input_ids"].float(), "labels": x["labels"]}, "torch.float32 / torch.int64 tensors"),
    (lambda x: {"input_ids": x["input_ids"]}, "no input_ids and labels tensors"),
    (lambda x: {"input_ids": x["input_ids"], "labels": x["labels"][:-1]}, "labels of"),
    (lambda x: {"input_ids": x["input_ids"] * 0 + 10**6, "labels": x["labels"]}, "token ids from 1000000"),
    (lambda x: {"input_ids": x["input_ids"] * 0 - 5, "labels": x["labels"]}, "token ids from -5"),
    (lambda x: {"input_ids": x["input_ids"][:0], "labels": x["labels"][:0]}, "input_ids of shape (0,)"),
    (lambda x: {"input_ids": x["input_ids"], "labels": x["labels"] * 0 + 10**6}, "a label 1000000 outside"),
    (None, "holds 2 samples, its prepare_config.json says 3"),
])
def test_prepared_samples_that_lie_are_refused_when_loaded(tmp_path, lie, expect):
    """A train.pt whose samples are not token ids of the tokenizer (floats, a label list of another length, ids
    beyond the vocabulary, an empty sample) or a count its prepare_config.json does not say: one line naming the file
    and the sample, as ensure_prepared loads it (the training step would fail on it, or index outside the embedding)."""
    tok = CharTokenizer()
    samples, _ = samples_of(RECORDS, tok, "alpaca", 1000)
    save_prepared(tmp_path / "p", samples[:3], samples[3:], {"template": "alpaca", "tokenizer_fingerprint":
                                                                tok.fingerprint, "max_seq_length": 1000})
    train = [lie(x) if lie and i == 1 else x for i, x in enumerate(samples[:3 if lie else 2])]
    torch.save(train, tmp_path / "p" / "train.pt")
    with pytest.raises(UserError) as e:
        ensure_prepared(tmp_path / "p", tok, DataSettings(1000, template="alpaca"))
    assert_one_line_message(e, f"prepared data {tmp_path / 'p' / 'train.pt'}", expect)
    if lie:
        assert "sample 1 has" in str(e.value)


def test_ensure_prepared_caches_single_file(tmp_path, capsys):
    write_json(tmp_path / "alpaca.json", RECORDS * 5)
    tok = CharTokenizer()
    kw = dict(template="plain", test_split_fraction=0.2)
    train, val, meta = prepared(tmp_path, tok, 30, **kw)
    cache = tmp_path / ".prepared-char-a-30"
    assert (cache / "prepare_config.json").is_file()
    assert len(train) == 16 and len(val) == 4 and meta["tokenizer_fingerprint"] == "char-a"
    err = capsys.readouterr().err
    assert "Preparing alpaca.json" in err and "warning: 5 of 20 samples" in err  # RECORDS[3] is 37 chars

    train2, val2, _ = prepared(tmp_path, tok, 30, **kw)
    assert "Using data prepared earlier" in capsys.readouterr().err
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(train + val, train2 + val2))

    write_json(tmp_path / "alpaca.json", RECORDS * 6)  # edited source: prepared again, not reused
    train3, val3, _ = prepared(tmp_path, tok, 30, **kw)
    assert len(train3) + len(val3) == 24 and "Preparing" in capsys.readouterr().err
    prepared(tmp_path, tok, 30, mask_inputs=False, **kw)  # other settings: prepared again
    assert "Preparing" in capsys.readouterr().err
    prepared(tmp_path, CharTokenizer("char-b"), 30, **kw)  # another tokenizer gets its own cache
    assert (tmp_path / ".prepared-char-b-30").is_dir()


def test_ensure_prepared_with_another_process_preparing_the_same_cache(tmp_path, monkeypatch, capsys):
    """The ranks of a multi-machine run on a shared disk prepare the same cache at once, each rewriting it (its
    config first removed, written last): one that just wrote it may find the config gone when it looks again. It
    returns what it prepared, counts included, without reading the folder back."""
    import lit_qlora.data.prepare as prep

    write_json(tmp_path / "alpaca.json", RECORDS * 5)
    save = prep.save_prepared

    def save_then_another_starts(dest, *args, **kw):
        meta = save(dest, *args, **kw)
        (Path(dest) / "prepare_config.json").unlink()  # another process begins its own rewrite
        return meta

    monkeypatch.setattr(prep, "save_prepared", save_then_another_starts)
    train, val, meta = prepared(tmp_path, CharTokenizer(), 512, template="plain", test_split_fraction=0.2)
    assert len(train) == 16 and len(val) == 4 and meta["n_train"] == 16 and meta["n_val"] == 4
    assert "16 train and 4 validation samples" in capsys.readouterr().err


def test_ensure_prepared_train_val_pair(tmp_path):
    write_json(tmp_path / "train.json", RECORDS * 2)
    (tmp_path / "val.jsonl").write_text(json.dumps(RECORDS[0]))
    train, val, meta = prepared(tmp_path, CharTokenizer(), 512)
    assert len(train) == 8 and len(val) == 1 and meta["n_truncated"] == 0


def test_ensure_prepared_prepared_folder(tmp_path):
    samples, _ = samples_of(RECORDS, CharTokenizer(), "alpaca", 256)
    save_prepared(tmp_path, samples[:3], samples[3:], {"tokenizer_fingerprint": "char-a", "max_seq_length": 256})
    train, val, _ = prepared(tmp_path, CharTokenizer(), 256)
    assert len(train) == 3 and len(val) == 1
    prepared(tmp_path, CharTokenizer(), 512)  # samples that fit 256 fit 512 too
    assert not any(p.name.startswith(".prepared") for p in tmp_path.iterdir())

    with pytest.raises(UserError) as e:
        prepared(tmp_path, CharTokenizer("char-b"), 256)
    assert_one_line_message(e, "char-a", "char-b", "prepare_alpaca.py")
    with pytest.raises(UserError) as e:
        prepared(tmp_path, CharTokenizer(), 128)
    assert_one_line_message(e, "max_seq_length=256", "max_seq_length=128")


def test_ensure_prepared_errors(tmp_path):
    with pytest.raises(UserError) as e:
        prepared(tmp_path / "nope", CharTokenizer(), 64)
    assert_one_line_message(e, "does not exist")
    with pytest.raises(UserError) as e:
        prepared(tmp_path, CharTokenizer(), 64)
    assert_one_line_message(e, "holds no data")
    write_json(tmp_path / "train.json", RECORDS)
    write_json(tmp_path / "b.json", RECORDS)  # neither train nor validation: refused, not silently left out
    with pytest.raises(UserError) as e:
        prepared(tmp_path, CharTokenizer(), 64)
    assert_one_line_message(e, "b.json", "neither train nor validation")


@pytest.fixture(scope="module")
def prepare_ckpt(tmp_path_factory) -> Path:
    pytest.importorskip("lit_qlora.tokenizer")
    from tests.helpers_tokenizer import make_hf_bpe_tokenizer

    folder = make_hf_bpe_tokenizer(tmp_path_factory.mktemp("ckpt"), vocab_size=300)
    write_json(folder / "config.json", {"max_position_embeddings": 256})
    return folder


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    return helpers_train.run_script(REPO / "scripts" / name, list(args), timeout=120)


def test_prepare_alpaca_script(prepare_ckpt, tmp_path):
    dest = tmp_path / "alpaca"
    r = run_script("prepare_alpaca.py", "--data_file", str(DEMO), "--checkpoint_dir", str(prepare_ckpt),
                   "--destination_path", str(dest))
    assert r.returncode == 0, r.stderr
    train, val, meta = load_prepared(dest)
    assert (len(train), len(val)) == (380, 20)
    assert meta["max_seq_length"] == 256 and meta["template"] == "alpaca"  # default from config.json
    # finetuning's entry point accepts the folder for the same tokenizer
    from lit_qlora.tokenizer import Tokenizer

    assert len(prepared(dest, Tokenizer(prepare_ckpt), 256)[0]) == 380

    (tmp_path / "bad.json").write_text('[{"instruction": "x",')
    r = run_script("prepare_alpaca.py", "--data_file", str(tmp_path / "bad.json"), "--checkpoint_dir",
                   str(prepare_ckpt), "--destination_path", str(tmp_path / "x"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_prepare_json_script(prepare_ckpt, tmp_path):
    with open(tmp_path / "qa.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["question", "answer"])
        w.writerows([[f"What is {i} + 1?", str(i + 1)] for i in range(20)])
    dest = tmp_path / "qa"
    common = ["--checkpoint_dir", str(prepare_ckpt), "--destination_path", str(dest), "--template", "plain",
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


# ---- conversations, rendered with the model's chat template ------------------------------------------------------
CHATS = [
    {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "Hello, how are you?"},
                  {"role": "assistant", "content": "I'm fine, thanks! 😀"}]},
    {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "Sure: 4."},
                  {"role": "user", "content": "And 2 + 3?"}, {"role": "assistant", "content": "5, Grüße!"}]},
    {"conversations": [{"from": "system", "value": "Answer briefly."}, {"from": "human", "value": "Tell me a joke"},
                       {"from": "gpt", "value": "Why did the robot cross the road?"}]},
]


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    """(our Tokenizer, transformers' tokenizer) of a ChatML checkpoint whose template marks the assistant turns with
    {% generation %}, so transformers' return_assistant_tokens_mask gives the reference labels."""
    transformers = pytest.importorskip("transformers")
    from helpers_chat import load_template, make_chat_checkpoint

    from lit_qlora.tokenizer import Tokenizer

    folder = make_chat_checkpoint("chatml_smollm", tmp_path_factory.mktemp("chatml"),
                                  load_template("chatml_generation"))
    return Tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)


def ref_sample(ref, messages) -> tuple[list[int], list[int]]:
    """transformers' ids of a conversation, and labels that keep the tokens it marks as the assistant's."""
    out = ref.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return out["input_ids"], [i if m else -100 for i, m in zip(out["input_ids"], out["assistant_masks"])]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_conversations_are_prepared_as_transformers_renders_them(chatml, tmp_path):
    from lit_qlora.data.chat_template import load_conversations

    tok, ref = chatml
    write_jsonl(tmp_path / "train.jsonl", CHATS)
    write_json(tmp_path / "val.json", CHATS[1:2])
    train, val, meta = prepared(tmp_path, tok, 512)  # --template left as auto: the data holds conversations
    assert meta["template"] == "chat" and (len(train), len(val)) == (3, 1)
    for sample, messages in zip(train + val, load_conversations(tmp_path / "train.jsonl") + [CHATS[1]["messages"]]):
        ids, labels = ref_sample(ref, messages)
        assert sample["input_ids"].tolist() == ids and sample["labels"].tolist() == labels
        assert ref.convert_tokens_to_ids("<|im_end|>") in sample["labels"].tolist()  # the end of turn is learned
    everything, _, meta = prepared(tmp_path, tok, 512, mask_inputs=False)
    assert meta["mask_inputs"] is False and all(torch.equal(s["input_ids"], s["labels"]) for s in everything)


def test_instruction_records_in_the_chat_template(chatml):
    tok, ref = chatml
    samples, _ = samples_of(RECORDS, tok, "chat", 512)
    for rec, s in zip(RECORDS, samples):
        user = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input") else "")
        ids, labels = ref_sample(ref, [{"role": "user", "content": user}, {"role": "assistant", "content":
                                                                            rec["output"]}])
        assert s["input_ids"].tolist() == ids and s["labels"].tolist() == labels


def test_conversation_truncation(chatml):
    tok, ref = chatml
    ids, labels = ref_sample(ref, CHATS[1]["messages"])
    first_trained = next(i for i, t in enumerate(labels) if t != -100)
    samples, n_trunc = samples_of(CHATS[1:2] * 2 + CHATS[:1], tok, "auto", first_trained + 2)
    assert n_trunc == 3 and len(samples) == 2  # CHATS[0] has a longer prompt: no assistant token left, left out
    assert all(s["labels"].tolist() == labels[:first_trained + 2] for s in samples)
    with pytest.raises(UserError) as e:
        samples_of(CHATS[1:2], tok, "chat", first_trained)
    assert_one_line_message(e, f"max_seq_length={first_trained}", "raise --max_seq_length")


@pytest.mark.parametrize("row,message", [
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "robot", "content": "x"}]}, "turn 2 has role='robot'"),
    ({"conversations": [{"from": "human", "value": "Hi"}]}, "has no assistant turn"),
    ({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]},
     "turn 1 (user) has empty content"),
])
def test_bad_conversation_rows_are_refused_before_tokenizing(chatml, tmp_path, row, message):
    tok, _ = chatml
    write_jsonl(tmp_path / "train.jsonl", CHATS)
    write_jsonl(tmp_path / "val.jsonl", [CHATS[0], row])  # the second file too, before anything is tokenized
    with pytest.raises(UserError) as e:
        prepared(tmp_path, tok, 512)
    assert_one_line_message(e, f"row 2 of {tmp_path / 'val.jsonl'}", message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.jsonl", "val.jsonl"]  # nothing written


def test_template_choice_errors(chatml, tmp_path):
    tok, _ = chatml
    write_json(tmp_path / "chats.json", CHATS)
    with pytest.raises(UserError) as e:
        prepared(tmp_path, tok, 512, template="alpaca")
    assert_one_line_message(e, "holds conversations", "--template chat")
    with pytest.raises(UserError) as e:
        prepared(tmp_path, CharTokenizer(), 512)  # a tokenizer without a chat template
    assert_one_line_message(e, "has no chat template")
    with pytest.raises(UserError) as e:
        prepared(tmp_path, tok, 512, template="vicuna")
    assert_one_line_message(e, "unknown prompt template 'vicuna'", "chat", "auto")
    write_json(tmp_path / "chats.json", RECORDS)
    assert prepared(tmp_path, tok, 512)[2]["template"] == "alpaca"  # instruction records: alpaca unless told


def test_prepare_dataset_with_conversations(chatml, tmp_path):
    from lit_qlora.data.chat_template import load_conversations
    from lit_qlora.data.prepare import prepare_dataset

    tok, ref = chatml
    data = write_jsonl(tmp_path / "chats.jsonl", CHATS * 4)
    meta = prepare_dataset(data, tok.checkpoint_dir, tmp_path / "out", DataSettings(0, test_split_fraction=0.25))
    assert meta["template"] == "chat" and (meta["n_train"], meta["n_val"]) == (9, 3)
    train, val, _ = load_prepared(tmp_path / "out")
    want = {tuple(ref_sample(ref, m)[0]) for m in load_conversations(data)}
    assert len(want) == 3 and {tuple(s["input_ids"].tolist()) for s in train + val} == want


@pytest.mark.parametrize("change, expect", [({"template": "x"}, "template is 'x', expected one of"),
                                            ({"template": 3}, "template is 3, expected a string"),
                                            # the file fuzzer, seed 15015: "plain" -> null was read as no template
                                            ({"template": None}, "template is None, expected one of"),
                                            ({"max_seq_length": "9"}, "max_seq_length is '9', expected an integer"),
                                            ({"n_train": -1}, "n_train is -1, expected an integer from 0")])
def test_a_prepare_config_that_lies_is_refused(tmp_path, change, expect):
    """prepare_config.json's template is recorded in the adapter and renders every generation prompt: a value no
    template has (or a field of the wrong kind) is refused in one line naming the file and the field, never trained
    on and written into the adapter."""
    tok = CharTokenizer()
    samples, _ = samples_of(RECORDS, tok, "alpaca", 1000)
    save_prepared(tmp_path / "p", samples[:3], samples[3:], {"template": "alpaca", "tokenizer_fingerprint":
                                                                tok.fingerprint, "max_seq_length": 1000})
    cfg = tmp_path / "p" / "prepare_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), **change}))
    with pytest.raises(UserError) as e:
        ensure_prepared(tmp_path / "p", tok, DataSettings(1000, template="alpaca"))
    assert_one_line_message(e, str(cfg), expect)
