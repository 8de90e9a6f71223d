"""Fine-tuning an instruct model on conversations, end to end, on the scripted chat checkpoint (helpers_chat: a tiny
Llama 3-style model that answers "Hi €" and ends its turn with <|eot_id|>, a token only its chat template names).

What is shown here, against transformers (prompt ids, stop ids) and the library's own non-streamed generation:
1. stop ids: the eos id, every id of generation_config.json's eos_token_id and the template's end-of-turn token;
2. finetune/lora.py on a conversations file (OpenAI messages with a system turn, multi-turn, ShareGPT) renders it with
   the model's chat template by itself, records the template in the adapter, and its validation sample stops at
   <|eot_id|>; a bad row is refused in one line naming it, before the model loads, with nothing written;
3. generate/lora.py renders with the adapter's template (transformers' prompt ids) and stops at <|eot_id|>;
   --template alpaca overrides it; chat.py picks its template the same way;
4. merged and HF-exported folders render the same tokens and stop at the same ids as the original;
5. generate/chat.py through stdin: two turns, !reset, a conversation longer than the context (one line), the
   streamed replies byte for byte equal to the non-streamed ones, one of them ending in a "€" cut by the context.
"""
from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

import helpers_train as h
import pytest
import torch
from helpers_chat import SCRIPTED_FALLBACK, SCRIPTED_REPLY, load_template

from lit_qlora.adapter import Adapter
from lit_qlora.data import chat_template as ct
from lit_qlora.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
CHAT = ROOT / "generate" / "chat.py"

CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                  {"role": "assistant", "content": SCRIPTED_REPLY}]},
    {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": SCRIPTED_REPLY},
                  {"role": "user", "content": "And now?"}, {"role": "assistant", "content": SCRIPTED_REPLY}]},
    {"conversations": [{"from": "human", "value": "Hey"}, {"from": "gpt", "value": SCRIPTED_REPLY}]},
]


def reference(folder: Path):
    """transformers' tokenizer of the folder and the ids generation must stop at: its eos, every eos id of
    generation_config.json, and the Llama 3 template's end-of-turn token."""
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    gen_eos = transformers.GenerationConfig.from_pretrained(folder).eos_token_id
    stops = {ref.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos]),
             ref.convert_tokens_to_ids("<|eot_id|>")}
    return ref, stops


def ref_ids(ref, messages, **kw) -> list[int]:
    return ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kw)["input_ids"]


def run_here(capsys, script: Path, *args) -> tuple[int, str, str]:
    """A script's CLI in this process (no interpreter start): (exit code, stdout, stderr)."""
    argv, sys.argv = sys.argv, [str(script), *map(str, args)]
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
    out, err = capsys.readouterr()
    return code, out, err


# ---- 1. stop ids ----------------------------------------------------------------------------------------
def test_stop_ids_are_every_eos_and_the_end_of_turn_token(scripted_chat):
    folder = scripted_chat["folder"]
    tok = Tokenizer(folder)
    _, stops = reference(folder)
    assert len(stops) == 3  # <|end_of_text|>, <|eom_id|> (generation_config.json) and <|eot_id|> (the template)
    assert set(ct.stop_ids(tok, tok.chat_template)) == stops
    assert scripted_chat["eot"] not in ct.stop_ids(tok)  # a prompt template does not end turns with it


# ---- 2. finetune on conversations -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_run(scripted_chat, tmp_path_factory):
    """(setup, out_dir, stderr) of finetune/lora.py on .jsonl files of conversations, --template left out."""
    base = tmp_path_factory.mktemp("chat_run")
    data = base / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in CONVERSATIONS * 3) + "\n")
    (data / "val.jsonl").write_text(json.dumps(CONVERSATIONS[1]) + "\n")  # multi-turn: sampled up to its 1st reply
    setup = {"ckpt": scripted_chat["folder"], "data": data}
    out = base / "out"
    r = h.train(setup, out, max_iters=2, template=None, eval_iters=1, eval_max_new_tokens=10)
    return setup, out, r.stderr


def test_finetune_on_conversations_uses_and_records_the_chat_template(chat_run, scripted_chat):
    setup, out, stderr = chat_run
    adapter = Adapter.load(out / "lit_model_lora_finetuned.pth")
    assert adapter.train["template"] == "chat"
    assert adapter.train["chat_template"] == scripted_chat["template"]
    # the validation sample (the untrained start and the end) stops at <|eot_id|>, which only the template names
    samples = [line.split("| sample: ", 1)[1] for line in stderr.splitlines() if "| sample: " in line]
    assert samples == [repr(SCRIPTED_REPLY)] * 2, stderr
    # the prepared samples are transformers' ids of the conversations
    from lit_qlora.data.prepare import load_prepared

    cache = next(setup["data"].glob(".prepared-*"))
    train, val, meta = load_prepared(cache)
    assert meta["template"] == "chat"
    ref, _ = reference(setup["ckpt"])
    want = {tuple(ref.apply_chat_template(m, tokenize=True)["input_ids"])
            for m in ct.load_conversations(setup["data"] / "train.jsonl")}
    assert len(want) == 3 and {tuple(s["input_ids"].tolist()) for s in train + val} == want


def test_bad_row_is_refused_in_one_line_before_loading(scripted_chat, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    rows = [CONVERSATIONS[0], {"messages": [{"role": "user", "content": "Hello"}, {"role": "bot", "content": "x"}]}]
    (data / "chats.json").write_text(json.dumps(rows))
    args = h.train_args({"ckpt": scripted_chat["folder"], "data": data}, tmp_path / "out", template=None)
    code, _, err = run_here(capsys, h.FINETUNE, *args)  # the CLI's error path, in this process
    h.assert_one_line_error(SimpleNamespace(returncode=code, stderr=err),
                            f"row 2 of {data / 'chats.json'}: turn 2 has role='bot'")
    assert sorted(p.name for p in data.iterdir()) == ["chats.json"]  # no prepared cache, not even a folder
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.pth"))


# ---- 3. generate/lora.py and chat.py pick the adapter's template ----------------------------------------
def test_generate_lora_renders_with_the_adapters_template(chat_run, scripted_chat, capsys):
    setup, out, _ = chat_run
    folder, adapter_path = setup["ckpt"], out / "lit_model_lora_finetuned.pth"
    ref, stops = reference(folder)
    from lit_qlora.inference import encode_prompt

    tok, adapter = Tokenizer(folder), Adapter.load(adapter_path)
    ids, stop = encode_prompt(tok, "Name a color", "a warm one", adapter, None)
    assert ids.tolist() == ref_ids(ref, [{"role": "user", "content": "Name a color\n\na warm one"}])
    assert set(stop) == stops
    common = ["--checkpoint_dir", folder, "--lora_path", adapter_path, "--prompt", "Name a color", "--precision",
              "32-true", "--max_new_tokens", 12]
    code, stdout, err = run_here(capsys, ROOT / "generate" / "lora.py", *common, "--stream", "true")
    assert code == 0, err
    assert stdout == SCRIPTED_REPLY + "\n"  # stopped at <|eot_id|>
    code, stdout, err = run_here(capsys, ROOT / "generate" / "lora.py", *common, "--template", "alpaca")
    assert code == 0, err
    assert stdout.startswith(SCRIPTED_REPLY + "X")  # alpaca does not end turns at <|eot_id|>: the model runs on


def test_chat_picks_the_adapters_template(scripted_chat, tmp_path):
    spec = runpy.run_path(str(CHAT))  # chat.py's functions, without running it
    tok = Tokenizer(scripted_chat["folder"])
    other = load_template("llama31_instruct")  # the text an adapter could have been trained with
    trained = Adapter({}, None, {}, {"template": "chat", "chat_template": other})
    pick = spec["chat_template_for"]
    assert pick(tok, trained, None) == other and pick(tok, trained, "plain") is None
    assert pick(tok, None, None) == tok.chat_template  # no adapter: the checkpoint's own template
    assert pick(tok, Adapter({}, None, {}, {"template": "alpaca"}), None) is None
    messages = [{"role": "user", "content": "Hello"}]
    ref, _ = reference(scripted_chat["folder"])
    ids = spec["encode_prompt"](messages, tok, trained, None)
    assert ids.tolist() == ref_ids(ref, messages, chat_template=other)


# ---- 4. merged and exported folders chat like the original --------------------------------------------------
def test_merged_and_exported_folders_render_the_same_tokens(chat_run, tmp_path):
    from lit_qlora.export.merge import export_hf, merge_checkpoint

    setup, out, _ = chat_run
    folder, adapter = setup["ckpt"], out / "lit_model_lora_finetuned.pth"
    merged = merge_checkpoint(folder, adapter, tmp_path / "merged")
    exported = export_hf(folder, tmp_path / "hf", adapter)
    messages = CONVERSATIONS[1]["messages"][:3]
    ref, stops = reference(folder)
    want = ref_ids(ref, messages)
    for copy in (merged, exported):
        assert (copy / "chat_template.jinja").is_file() and (copy / "generation_config.json").is_file()
        tok = Tokenizer(copy)
        assert ct.encode_chat(tok, messages, add_generation_prompt=True) == want
        assert set(ct.stop_ids(tok, tok.chat_template)) == stops
    ref_exported, stops_exported = reference(exported)  # what transformers users of the export get
    assert ref_ids(ref_exported, messages) == want and stops_exported == stops


# ---- 5. chat.py through stdin ---------------------------------------------------------------------------------
def test_chat_script_through_stdin(scripted_chat):
    from lit_qlora.generation import generate
    from lit_qlora.loader import load_model

    folder, max_new = scripted_chat["folder"], 10
    ref, stops = reference(folder)
    model = load_model(folder, precision="32-true").eval()
    block = model.config.block_size

    def reply(messages) -> str:
        """The non-streamed reply to the conversation so far, from transformers' prompt ids."""
        ids = torch.tensor(ref_ids(ref, messages))
        out = generate(model, ids, min(max_new, block - len(ids)), eos_ids=stops)
        return Tokenizer(folder).decode([t for t in out[len(ids):].tolist() if t not in stops])

    first = [{"role": "user", "content": "Hello"}]
    a1 = reply(first)
    # the second question is as long as leaves room for 5 new tokens: the reply is cut inside "€"
    second = next(q for n in range(1, 200) if len(ref_ids(ref, [*first, {"role": "assistant", "content": a1},
                                                               {"role": "user", "content": (q := "x" * n)}]))
                  == block - 5)
    a2 = reply([*first, {"role": "assistant", "content": a1}, {"role": "user", "content": second}])
    a3 = reply(first)  # after !reset
    assert (a1, a2, a3) == (SCRIPTED_REPLY, SCRIPTED_REPLY[:-1] + "\ufffd", SCRIPTED_REPLY)
    too_long = "hello " * 100
    stdin = "\n".join(["Hello", second, "!reset", too_long, "Hello"]) + "\n"
    r = h.run_script(CHAT, ["--checkpoint_dir", folder, "--precision", "32-true", "--temperature", 0,
                            "--max_new_tokens", max_new], input=stdin)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    you, model_says = ">> You: ", ">> Model: "
    assert r.stdout == (you + model_says + a1 + "\n" + you + model_says + a2 + "\n" + you + you + you + model_says
                        + a3 + "\n" + you)
    context_lines = [ln for ln in r.stderr.splitlines() if "context" in ln]
    assert len(context_lines) == 1 and "!reset" in context_lines[0], r.stderr
    assert SCRIPTED_FALLBACK not in r.stdout


def test_chat_turns_reuse_the_kv_cache(scripted_chat, monkeypatch, capsys):
    """chat.py keeps one KVSession: the second turn computes only the ids from where the conversation, rendered
    again, departs from what the cache holds (the first turn's prompt and reply); !reset starts a new one."""
    from lit_qlora.generation import KVSession

    kept, reusable = [], KVSession.reusable
    monkeypatch.setattr(KVSession, "reusable", lambda self, p: kept.append(reusable(self, p)) or kept[-1])
    lines = iter(["Hello", "And again", "!reset", "Hello"])

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    runpy.run_path(str(CHAT))["main"](checkpoint_dir=scripted_chat["folder"], precision="32-true", temperature=0.0,
                                      max_new_tokens=10)
    ref, _ = reference(scripted_chat["folder"])
    first = len(ref_ids(ref, [{"role": "user", "content": "Hello"}]))
    # the first prompt but its last id: there the re-rendered conversation tokenizes the header's newline together
    # with the reply's text, so the cache is used up to the last id both share
    assert kept[0] == 0 and kept[1] >= first - 1 and kept[2] == 0, kept
    assert capsys.readouterr().out.count(f">> Model: {SCRIPTED_REPLY}\n") == 3  # the scripted reply, every turn
