import json
import shutil
from pathlib import Path

import pytest
import torch

from lit_qlora.tokenizer import Tokenizer
from lit_qlora.utils import UserError
from tests.helpers_tokenizer import (
    make_hf_bpe_tokenizer,
    make_sentencepiece_tokenizer,
    tokenizer_test_corpus,
)

CORPUS = tokenizer_test_corpus()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_hf_bpe_tokenizer(tmp_path_factory.mktemp("hf_bpe"))


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory) -> Path:
    return make_sentencepiece_tokenizer(tmp_path_factory.mktemp("spm"))


def _update_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update(changes)
    path.write_text(json.dumps(data))


def test_corpus_covers_the_hard_cases():
    assert len(CORPUS) >= 200 and len(set(CORPUS)) > 190
    text = "".join(CORPUS)
    for needle in ["你好", "Привет", "مرحبا", "😀", "\t", "\n", "   ", "def ", "2048"]:
        assert needle in text
    assert CORPUS == tokenizer_test_corpus()  # deterministic


def test_no_tokenizer_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError,
                       match=r"no tokenizer found in .* \(expected tokenizer.json or tokenizer.model\); copy"):
        Tokenizer(tmp_path)


def test_hf_bpe_matches_transformers(hf_dir):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(hf_dir)
    tok = Tokenizer(hf_dir)
    assert tok.backend == "huggingface"
    assert tok.add_bos and tok.bos_id == ref.bos_token_id == 1 and tok.eos_id == ref.eos_token_id == 2
    assert tok.vocab_size == len(ref) == 512

    round_trips = 0
    for text in CORPUS:
        ids = tok.encode(text)
        assert ids.dtype == torch.long and ids.ndim == 1
        # our default (bos from the post-processor) equals transformers' add_special_tokens=True
        assert ids.tolist() == ref(text)["input_ids"], repr(text)
        assert tok.encode(text, bos=False).tolist() == ref(text, add_special_tokens=False)["input_ids"], repr(text)
        expected = ref.decode(ids.tolist(), skip_special_tokens=True)
        assert tok.decode(ids) == expected, repr(text)
        if expected == text:
            round_trips += 1
    assert round_trips == len(CORPUS)  # byte-level BPE: every string round-trips


def test_sentencepiece_matches_sentencepiece_and_transformers(sp_dir):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("google.protobuf")  # transformers needs it to read tokenizer.model
    import sentencepiece

    spm = sentencepiece.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    ref = transformers.AutoTokenizer.from_pretrained(sp_dir)
    assert type(ref).__name__.startswith("LlamaTokenizer")
    tok = Tokenizer(sp_dir)
    assert tok.backend == "sentencepiece"
    assert tok.add_bos and tok.bos_id == ref.bos_token_id == 1 and tok.eos_id == ref.eos_token_id == 2
    assert tok.vocab_size == spm.vocab_size() == 512

    round_trips = byte_fallbacks = leading_space = 0
    for text in CORPUS:
        ids = tok.encode(text).tolist()
        plain = ids[1:]
        # 1. exactly what sentencepiece itself produces
        assert ids[0] == tok.bos_id and plain == spm.encode(text), repr(text)
        byte_fallbacks += any(4 <= i < 260 for i in plain)  # ids 4..259 are <0x00>..<0xFF>
        # 2. transformers 5 converts tokenizer.model into a `tokenizers` BPE with a Metaspace
        # pre-tokenizer whose prepend_scheme="first" skips sentencepiece's dummy "▁" prefix when the
        # text already starts with a space: its first space becomes the prefix, so " x" is encoded
        # like sentencepiece's "x". Everywhere else the ids agree.
        ref_ids = ref(text)["input_ids"]
        if text.startswith(" ") and ref_ids != ids:
            leading_space += 1
            without_prefix = spm.encode(text[1:]) if len(text) > 1 else [spm.piece_to_id("▁")]
            assert ref_ids == [tok.bos_id, *without_prefix], repr(text)
        else:
            assert ref_ids == ids, repr(text)
        # decoding agrees with both references, and round-trips wherever they do
        expected = ref.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids) == expected == spm.decode(ids), repr(text)
        if expected == text:
            round_trips += 1
            assert tok.decode(torch.tensor(ids)) == text
    assert byte_fallbacks > 20  # emoji and rare characters are exercised, not just present
    assert leading_space < 40
    assert round_trips >= len(CORPUS) - 5, round_trips  # byte fallback: (nearly) everything round-trips


def test_encode_options(hf_dir, sp_dir):
    for folder in (hf_dir, sp_dir):
        tok = Tokenizer(folder)
        plain = tok.encode("hello world", bos=False).tolist()
        assert plain and tok.bos_id not in plain
        assert tok.encode("hello world").tolist() == [tok.bos_id, *plain]  # bos added once, never twice
        assert tok.encode("hello world", bos=True).tolist() == [tok.bos_id, *plain]
        assert tok.encode("hello world", eos=True).tolist() == [tok.bos_id, *plain, tok.eos_id]
        assert tok.encode("hello world", eos=None).tolist() == [tok.bos_id, *plain]  # add_eos_token is off
        assert tok.encode("hello world", eos=True, max_length=2).tolist() == [tok.bos_id, plain[0]]
        assert tok.encode("hello world", max_length=0).tolist() == []
        assert tok.encode("", bos=False).shape == (0,)
        assert tok.decode(tok.encode("hello world", eos=True)) == "hello world"
        assert tok.decode([*plain]) == tok.decode(torch.tensor(plain)) == "hello world"


def test_special_tokens_from_configs(tmp_path, hf_dir):
    folder = tmp_path / "ckpt"
    shutil.copytree(hf_dir, folder)
    cfg = folder / "tokenizer_config.json"

    # an explicit add_bos_token=False wins over a post-processor that adds bos
    _update_json(cfg, add_bos_token=False)
    tok = Tokenizer(folder)
    assert not tok.add_bos and tok.encode("hi").tolist() == tok.encode("hi", bos=False).tolist()

    # without tokenizer_config's tokens: ids from generation_config.json (a list of eos: first is
    # eos_id, all stop generation), then config.json
    data = json.loads(cfg.read_text())
    for key in ("bos_token", "eos_token", "add_bos_token"):
        data.pop(key)
    cfg.write_text(json.dumps(data))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [3, 2]}))
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))
    tok = Tokenizer(folder)
    assert (tok.bos_id, tok.eos_id, tok.stop_ids) == (1, 3, [3, 2, 0])
    assert tok.add_bos  # from the post-processor
    (folder / "generation_config.json").unlink()
    tok = Tokenizer(folder)
    assert (tok.bos_id, tok.eos_id, tok.stop_ids) == (0, 0, [0])


def test_add_bos_defaults(tmp_path):
    # tokenizer.json without a bos post-processor and no add_bos_token: no bos (like Qwen / GPT-2)
    tok = Tokenizer(make_hf_bpe_tokenizer(tmp_path / "a", bos_in_post_processor=False, add_bos_token=None))
    assert not tok.add_bos and tok.bos_id == 1
    assert tok.encode("hi").tolist() == tok.encode("hi", bos=False).tolist()
    # ... unless tokenizer_config.json asks for it
    tok = Tokenizer(make_hf_bpe_tokenizer(tmp_path / "b", bos_in_post_processor=False, add_bos_token=True))
    assert tok.add_bos and tok.encode("hi")[0] == 1
    # a bare tokenizer.model (Llama 1/2 style) gets bos
    folder = make_sentencepiece_tokenizer(tmp_path / "c", add_bos_token=None)
    (folder / "tokenizer_config.json").unlink()
    tok = Tokenizer(folder)
    assert tok.add_bos and (tok.bos_id, tok.eos_id, tok.stop_ids) == (1, 2, [2])
    assert tok.chat_template is None


def test_no_bos_token(tmp_path):
    folder = make_hf_bpe_tokenizer(tmp_path, bos_in_post_processor=False, add_bos_token=None)
    _update_json(folder / "tokenizer_config.json", bos_token=None)
    tok = Tokenizer(folder)
    assert tok.bos_id is None and not tok.add_bos
    assert tok.encode("hi").tolist() == tok.encode("hi", bos=False).tolist()
    with pytest.raises(ValueError, match="no bos token"):
        tok.encode("hi", bos=True)


def test_prefers_tokenizer_json(tmp_path, hf_dir, sp_dir):
    folder = tmp_path / "both"
    shutil.copytree(hf_dir, folder)
    shutil.copy(sp_dir / "tokenizer.model", folder)
    assert Tokenizer(folder).backend == "huggingface"
    (folder / "tokenizer.json").unlink()
    assert Tokenizer(folder).backend == "sentencepiece"


def test_chat_template_and_fingerprint(tmp_path, hf_dir, sp_dir):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    a = Tokenizer(make_hf_bpe_tokenizer(tmp_path / "a", chat_template=template))
    b = Tokenizer(make_hf_bpe_tokenizer(tmp_path / "b", chat_template=template))
    assert a.chat_template == template
    assert len(a.fingerprint) == 16 and a.fingerprint == b.fingerprint  # stable across folders and builds
    assert Tokenizer(hf_dir).fingerprint != a.fingerprint  # the template is part of it
    assert Tokenizer(sp_dir).fingerprint == Tokenizer(make_sentencepiece_tokenizer(tmp_path / "c")).fingerprint
    assert Tokenizer(sp_dir).fingerprint != Tokenizer(hf_dir).fingerprint

    # a separate chat_template.jinja (newer transformers) takes priority; the older list form works too
    (tmp_path / "a" / "chat_template.jinja").write_text("{{ messages }}")
    assert Tokenizer(tmp_path / "a").chat_template == "{{ messages }}"
    _update_json(tmp_path / "b" / "tokenizer_config.json", chat_template=[{"name": "default", "template": "X"}])
    assert Tokenizer(tmp_path / "b").chat_template == "X"

    # changing what encode() does changes the fingerprint; unrelated config edits don't
    _update_json(tmp_path / "c" / "tokenizer_config.json", model_max_length=4096)
    c = Tokenizer(tmp_path / "c")
    assert c.fingerprint == Tokenizer(sp_dir).fingerprint
    _update_json(tmp_path / "c" / "tokenizer_config.json", add_bos_token=False)
    assert Tokenizer(tmp_path / "c").fingerprint != c.fingerprint


def test_unreadable_files(tmp_path):
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(UserError, match="cannot read"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.model").write_bytes(b"garbage")
    with pytest.raises(UserError, match="cannot read"):
        Tokenizer(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer.json", "chat_template.jinja"])
@pytest.mark.parametrize("place", ["folder", "symlink loop"])
def test_a_folder_or_symlink_loop_in_a_tokenizer_file_place_is_refused(tmp_path, hf_dir, sp_dir, name, place):
    """A folder or a symlink loop where tokenizer.json or chat_template.jinja belongs was read past: the
    sentencepiece tokenizer.model beside it (another tokenizer), the chat template in tokenizer_config.json (another
    template) were used without a word. Now one line naming the file and what is there."""
    import os

    folder = tmp_path / "tok"
    make_hf_bpe_tokenizer(folder, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    shutil.copy(sp_dir / "tokenizer.model", folder)
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    (folder / name).unlink()
    if place == "folder":
        (folder / name).mkdir()
    else:
        os.symlink(name, folder / name)
    with pytest.raises(UserError) as e:
        Tokenizer(folder)
    what = "is a folder" if place == "folder" else "is a symlink loop"
    assert f"{folder / name} {what}" in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_a_chat_template_of_megabytes_is_refused(tmp_path, where):
    """The fuzzer, seed 14025: 4 MiB of one byte spliced into chat_template.jinja rendered every conversation into
    other text (an undefined key reads as empty) without a word. A template over 1 MiB (30x the largest published) is
    refused in one line naming the file."""
    template = "{% for m in messages %}{{ m['r" + "a" * (1 << 20) + "ole'] }}{{ m['content'] }}{% endfor %}"
    folder = make_hf_bpe_tokenizer(tmp_path / "tok", chat_template=template if where != "chat_template.jinja"
                                   else None)
    if where == "chat_template.jinja":
        (folder / where).write_text(template)
    with pytest.raises(UserError) as e:
        Tokenizer(folder)
    assert f"{folder / where} holds a chat template of {len(template):,} characters" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_byte_level_tokenizer_without_its_byte_level_step_is_refused(tmp_path, hf_dir):
    """The fuzzer, seed 14053: tokenizer.json with its pre_tokenizer deleted loads in tokenizers and encodes every
    space into other ids. A tokenizer that decodes byte-level without a ByteLevel pre-tokenizer (or normalizer) step is
    refused in one line naming the file; the intact one loads."""
    folder = tmp_path / "tok"
    shutil.copytree(hf_dir, folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    assert data["decoder"]["type"] == "ByteLevel" and Tokenizer(folder).encode("a b").numel() > 0
    del data["pre_tokenizer"]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(UserError) as e:
        Tokenizer(folder)
    assert f"{folder / 'tokenizer.json'} decodes byte-level but has no ByteLevel step" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_tokenizer_json_that_lost_an_added_token_is_refused(hf_dir, tmp_path):
    """The file fuzzer (seeds 14076-14087): tokenizer.json with its added chat marker deleted was read as it stood, the
    marker split into byte pieces everywhere, while transformers restores it from tokenizer_config.json's
    added_tokens_decoder. The two files must agree on every added token."""
    import transformers

    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    hf.save_pretrained(tmp_path)
    marker = hf.convert_tokens_to_ids("<|im_start|>")
    added = json.loads((tmp_path / "tokenizer.json").read_text())["added_tokens"]  # as published checkpoints (saved
    _update_json(tmp_path / "tokenizer_config.json",  # by transformers 4) list them
                 added_tokens_decoder={str(t.pop("id")): t for t in added})
    assert Tokenizer(tmp_path).encode("<|im_start|>", bos=False).tolist() == [marker]  # the files agree: read
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<|im_start|>"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(UserError) as e:
        Tokenizer(tmp_path)
    assert (f"has the added token '<|im_start|>' at id {marker}, {tmp_path / 'tokenizer.json'} has no added token "
            "there; the two files disagree" in str(e.value)) and "\n" not in str(e.value)


def test_the_special_tokens_tokenizer_config_names_are_special_as_in_transformers(hf_dir, tmp_path):
    """The file fuzzer (seed 16000): tokenizer.json with its added_tokens list emptied still encodes "</s>" as one
    special token in transformers (it adds the tokens tokenizer_config.json names), and llama.cpp's converter marks
    them control tokens; we read them as plain text pieces and wrote them as normal tokens to GGUF."""
    import transformers

    shutil.copytree(hf_dir, tmp_path, dirs_exist_ok=True)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    assert {t["content"] for t in data["added_tokens"]} >= {"<s>", "</s>"}
    data["added_tokens"] = []
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = Tokenizer(tmp_path)
    for text in ["a</s>b", "<s>x <pad> </s></s>", "<unk>", CORPUS[3] + "</s>"]:
        assert tok.encode(text, bos=False).tolist() == ref(text, add_special_tokens=False)["input_ids"], repr(text)
    special = {i for i, t in tok.processor.get_added_tokens_decoder().items() if t.special}
    assert special == {i for i, t in ref.added_tokens_decoder.items() if t.special} == {0, 1, 2, 3}
    del data["added_tokens"]  # transformers cannot load this one (a KeyError); tokenizers can, and so do we
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    ids = Tokenizer(tmp_path).encode("a</s>b", bos=False).tolist()
    assert ids == ref("a</s>b", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("nested", [False, True], ids=["template", "in_a_sequence"])
def test_a_post_processor_template_naming_a_token_its_table_lost_is_refused(tmp_path, hf_dir, nested):
    """The fuzzer, seed 25003: tokenizer.json's TemplateProcessing with special_tokens.<s> deleted loads in tokenizers
    and panics (pyo3's PanicException, a BaseException) on the first encode with special tokens, in transformers too.
    Refused in one line naming the token, whether the template is the post-processor or one step of a Sequence."""
    import transformers

    folder = tmp_path / "tok"
    shutil.copytree(hf_dir, folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    assert data["post_processor"]["type"] == "TemplateProcessing" and Tokenizer(folder).add_bos  # intact: read
    del data["post_processor"]["special_tokens"]["<s>"]
    if nested:
        data["post_processor"] = {"type": "Sequence", "processors": [data["post_processor"]]}
    (folder / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(BaseException, match="no entry found"):  # the reference cannot use the file either
        transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))("a")
    with pytest.raises(UserError) as e:
        Tokenizer(folder)
    assert (f"{folder / 'tokenizer.json'}'s post_processor template adds '<s>', which its special_tokens table does "
            "not hold" in str(e.value)) and "\n" not in str(e.value)
