"""lit_qlora.data.chat_template against transformers (the reference; never imported by the package).

1. Rendering and ids equal `apply_chat_template(tokenize=False / True)` token for token for 11 real templates
   (tests/fixtures/chat_templates/SOURCES.md), single and multi-turn, with and without a system message (both
   raise where the template refuses one), with add_generation_prompt True and False, on byte-level BPE, Metaspace
   BPE and sentencepiece tokenizers that carry each template's special tokens.
2. Assistant-only labels equal spans found in transformers' rendering by hand-written per-template rules (assistant
   header, then through the end-of-turn token), mapped to tokens with transformers' own offsets; and equal
   transformers' return_assistant_tokens_mask for templates with {% generation %} markers.
3. Details of the environment (tojson, namespace, loop controls, dict, strftime_now, undefined tokens), tools,
   end-of-turn ids, conversation records and their one-line errors, and generate/chat.py's prompt.
"""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import jinja2
import pytest
from helpers_chat import load_template, make_chat_checkpoint, make_sp_without_byte_fallback

from lit_qlora.data import chat_template as ct
from lit_qlora.tokenizer import Tokenizer
from lit_qlora.utils import UserError

transformers = pytest.importorskip("transformers")
pytest.importorskip("google.protobuf")  # transformers reads tokenizer.model through it

ROOT = Path(__file__).resolve().parents[1]

# template: (tokenizer kind, accepts a system message, assistant header, end-of-turn token). The last two are the
# hand-written rule for where assistant turns are in transformers' rendering: after the header, through the token.
TEMPLATES = {
    "llama3_instruct": ("llama3", True, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "llama31_instruct": ("llama3", True, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "llama2_chat": ("sp", True, "[/INST]", "</s>"),
    "mistral_v01_instruct": ("sp", False, "[/INST]", "</s>"),
    "mixtral_v01_instruct": ("sp_legacy", False, "[/INST]", "</s>"),
    "mistral_v03_instruct": ("mistral3", True, "[/INST]", "</s>"),  # drops a system message silently
    "qwen25_instruct": ("chatml_qwen", True, "<|im_start|>assistant\n", "<|im_end|>"),
    "smollm2_instruct": ("chatml_smollm", True, "<|im_start|>assistant\n", "<|im_end|>"),
    "gemma_it": ("gemma", False, "<start_of_turn>model\n", "<end_of_turn>"),
    "zephyr": ("sp", True, "<|assistant|>\n", "</s>"),
    "qwen3": ("chatml_qwen", True, "<|im_start|>assistant\n", "<|im_end|>"),
    "gemma3_it": ("gemma", True, "<start_of_turn>model\n", "<end_of_turn>"),  # folds a system message into user
    "phi4": ("chatml_phi4", True, "<|im_start|>assistant<|im_sep|>", "<|im_end|>"),
    # gpt-oss's harmony: a system message becomes the developer message; the model writes the channel header itself
    "gpt_oss": ("harmony", True, "<|start|>assistant", "<|return|>"),
}
# Where the hand rule's turns end when not all at the end-of-turn token: harmony ends every message with <|end|>
# (the reasoning before an answer too) and only the conversation's last answer with <|return|>, the stop token
TURN_ENDS = {"gpt_oss": ("<|end|>", "<|return|>")}

SINGLE = [{"role": "user", "content": "Hello, how are you?"},
          {"role": "assistant", "content": "I'm fine, thanks! 😀"}]
MULTI = [{"role": "user", "content": "Hello, how are you?"},
         {"role": "assistant", "content": "  I'm fine, thanks!\nAnd you? "},  # whitespace: templates trim or keep it
         {"role": "user", "content": "What is 2 + 2?"},
         {"role": "assistant", "content": "Sure: 2 + 2 = 4."}]
SYSTEM = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}, *MULTI]
CONVERSATIONS = {"single": SINGLE, "multi": MULTI, "system": SYSTEM}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(our Tokenizer, transformers' tokenizer) per template, built once per module."""
    made: dict[str, tuple] = {}

    def get(name: str, template: str | None = None, kind: str | None = None):
        key = f"{name}/{kind}"
        if key not in made:
            folder = make_chat_checkpoint(kind or TEMPLATES[name][0], tmp_path_factory.mktemp(name),
                                          template or load_template(name))
            made[key] = Tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
        return made[key]

    return get


def ref_text(ref, messages, agp=False, **kw) -> str:
    return ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp, **kw)


def ref_ids(ref, messages, agp=False, **kw) -> list[int]:
    return ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=agp, **kw)["input_ids"]


def hand_spans(text: str, header: str, end_token: str | tuple[str, ...]) -> list[tuple[int, int]]:
    """The hand rule: each assistant turn runs from the end of `header` through the next `end_token` (the nearest of
    several)."""
    ends = (end_token,) if isinstance(end_token, str) else end_token
    spans = []
    for m in re.finditer(re.escape(header), text):
        at, token = min((text.find(t, m.end()), t) for t in ends if t in text[m.end():])
        spans.append((m.end(), at + len(token)))
    return spans


def expected_labels(ref, text: str, header: str, end_token: str, spans=None) -> tuple[list[int], list[int]]:
    """Labels from the hand rule (or given spans): a token is trained when its range in transformers' offsets
    overlaps a turn."""
    spans = spans if spans is not None else hand_spans(text, header, end_token)
    enc = ref(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = []
    for tid, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]):
        inside = any((s <= a < e) if a == b else (a < e and b > s) for s, e in spans)
        labels.append(tid if inside else ct.IGNORE_INDEX)
    return enc["input_ids"], labels


def trained_text(tok, ids, labels) -> str:
    return tok.decode([i for i, lab in zip(ids, labels) if lab != ct.IGNORE_INDEX])


# ----------------------------------------------------------------------------------------------
# 1. rendering and ids


@pytest.mark.parametrize("name", TEMPLATES)
def test_render_and_ids_equal_transformers(checkpoints, name):
    tok, ref = checkpoints(name)
    allows_system = TEMPLATES[name][1]
    for label, conversation in CONVERSATIONS.items():
        # the whole conversation, and its prompt (ending with a user turn) as used for generation
        for messages in (conversation, conversation[:-1]):
            for agp in (False, True):
                if label == "system" and not allows_system:
                    with pytest.raises(Exception, match="System role|alternate|Only user and assistant"):
                        ref_text(ref, messages, agp)
                    with pytest.raises(UserError, match=r"^the chat template refuses this conversation: .*; "):
                        ct.render_chat(tok, messages, agp)
                    continue
                expected = ref_text(ref, messages, agp)
                assert ct.render_chat(tok, messages, agp) == expected, (label, agp)
                assert ct.encode_chat(tok, messages, agp) == ref_ids(ref, messages, agp), (label, agp)
    # the bos the template writes appears once: never added again on top (transformers >= 4.4x semantics)
    ids = ct.encode_chat(tok, SINGLE)
    if tok.bos_id is not None and "bos_token" in tok.chat_template:
        assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id


def test_render_matches_transformers_for_chatml_without_bos(checkpoints):
    # Qwen's tokenizer has no bos token: the variable is undefined for the template, not "" or "None"
    tok, ref = checkpoints("qwen25_instruct")
    probe = "{{ bos_token is defined }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token is defined }}"
    assert ct.render_chat(tok, SINGLE, template=probe) == ref_text(ref, SINGLE, chat_template=probe)
    assert ct.render_chat(tok, SINGLE, template=probe) == "False|<|im_end|>|<|endoftext|>|False"


@pytest.mark.parametrize("name", ["qwen25_instruct", "llama31_instruct", "mistral_v03_instruct", "qwen3", "gpt_oss"])
def test_tools_render_like_transformers(checkpoints, name):
    # tools go through tojson (indent, non-ASCII, "<" kept as is) exactly as transformers' override does
    tok, ref = checkpoints(name)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather at a place; use <city>, e.g. Zürich",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Zürich", "Paris"]}},
                       "required": ["city"]}}}]
    messages = [{"role": "user", "content": "What is the weather in Zürich?"}]
    expected = ref_text(ref, messages, True, tools=tools)
    assert "Zürich" in expected and "<city>" in expected
    assert ct.render_chat(tok, messages, True, tools=tools) == expected


ENVIRONMENT_TEMPLATES = [
    # loop controls, namespace, dict(), filters and whitespace control
    ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
     "{% set ns.n = ns.n + 1 %}{{ ns.n }}:{{ m.content | trim }}\n{% if loop.index > 3 %}{% break %}{% endif %}"
     "{% endfor %}{{ dict(a=1, b=[2, 3]) | tojson }}"),
    # tojson options and plain json.dumps spacing
    "{{ messages | tojson(indent=2) }}{{ {'b': 1, 'a': '<&>'} | tojson(sort_keys=true, separators=(',', ':')) }}",
    # trim_blocks / lstrip_blocks
    "{% for m in messages %}\n    {% if m.role == 'user' %}\n  U: {{ m.content }}\n    {% endif %}\n{% endfor %}\n",
    # None-valued keys are dropped before rendering; a reasoning text is visible under both names
    "{% for m in messages %}{{ m.name is defined }}{{ m.reasoning_content | default('-') }}{% endfor %}",
    # add_generation_prompt, extra variables, {% generation %} blocks render their body
    ("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
     "{{ add_generation_prompt }}{{ greeting | default('none') }}"),
]


@pytest.mark.parametrize("template", ENVIRONMENT_TEMPLATES)
def test_environment_matches_transformers(checkpoints, template):
    tok, ref = checkpoints("smollm2_instruct")
    messages = [*SYSTEM, {"role": "user", "content": " more ", "name": None, "thinking": "hmm"}]
    for agp, extra in ((False, {}), (True, {"greeting": "hi"})):
        expected = ref_text(ref, messages, agp, chat_template=template, **extra)
        assert ct.render_chat(tok, messages, agp, template=template, **extra) == expected


def test_strftime_now_and_refusals_match_transformers(checkpoints):
    tok, ref = checkpoints("smollm2_instruct")
    template = "{{ strftime_now('%Y-%m-%d') }}"
    assert ct.render_chat(tok, SINGLE, template=template) == ref_text(ref, SINGLE, chat_template=template)
    refuse = "{% if messages | length > 1 %}{{ raise_exception('Too many\nmessages') }}{% endif %}ok"
    with pytest.raises(Exception, match="Too many"):
        ref_text(ref, MULTI, chat_template=refuse)
    with pytest.raises(UserError) as e:
        ct.render_chat(tok, MULTI, template=refuse)
    assert "\n" not in str(e.value) and "Too many messages" in str(e.value)
    # namespaces refuse underscore names (a sandbox escape route) in both
    sneaky = "{% set ns = namespace(_x=1) %}{{ ns._x }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        ref_text(ref, SINGLE, chat_template=sneaky)
    with pytest.raises(UserError, match="underscore"):
        ct.render_chat(tok, SINGLE, template=sneaky)


def test_template_errors_are_one_line(checkpoints, tmp_path):
    tok, _ = checkpoints("smollm2_instruct")
    with pytest.raises(UserError, match=r"^the chat template does not compile \(.*line 1\); fix the template"):
        ct.render_chat(tok, SINGLE, template="{% for m in messages %}")
    with pytest.raises(UserError, match="UndefinedError"):
        ct.render_chat(tok, SINGLE, template="{{ messages[5].content.x.y }}")
    no_template = Tokenizer(make_chat_checkpoint("chatml_smollm", tmp_path / "plain", template=None))
    with pytest.raises(UserError, match=r"has no chat template .*; use a chat/instruct model"):
        ct.encode_chat(no_template, SINGLE)


# ----------------------------------------------------------------------------------------------
# 2. assistant-only masks


@pytest.mark.parametrize("name", TEMPLATES)
def test_assistant_mask_equals_hand_rule(checkpoints, name):
    tok, ref = checkpoints(name)
    _, allows_system, header, end_token = TEMPLATES[name]
    checked = 0
    for label, conversation in CONVERSATIONS.items():
        if label == "system" and not allows_system:
            with pytest.raises(UserError, match="refuses this conversation"):
                ct.assistant_mask(tok, None, conversation)
            continue
        text = ref_text(ref, conversation)
        exp_ids, exp_labels = expected_labels(ref, text, header, TURN_ENDS.get(name, end_token))
        ids, labels = ct.assistant_mask(tok, None, conversation)
        assert ids == exp_ids
        assert labels == exp_labels, (label, trained_text(tok, ids, labels), trained_text(tok, ids, exp_labels))
        n_turns = sum(m["role"] == "assistant" for m in conversation)
        assert len(re.findall(re.escape(header), text)) == n_turns  # the rule found every turn
        # every turn's end-of-turn token is trained, nothing after the last one is
        eot = {tok.token_to_id(t) for t in TURN_ENDS.get(name, (end_token,))}
        assert sum(1 for i, lab in zip(ids, labels) if lab in eot) >= n_turns
        checked += 1
    assert checked >= 2


def test_assistant_mask_spans_read_naturally(checkpoints):
    # what is trained, in words: each reply plus its end token; no header, no newline after <|im_end|>
    tok, _ = checkpoints("smollm2_instruct")
    text, spans = ct.assistant_spans(tok, MULTI)
    assert [text[s:e] for s, e in spans] == ["  I'm fine, thanks!\nAnd you? <|im_end|>", "Sure: 2 + 2 = 4.<|im_end|>"]
    tok, _ = checkpoints("llama2_chat")
    text, spans = ct.assistant_spans(tok, SYSTEM)
    assert [text[s:e] for s, e in spans] == [" I'm fine, thanks!\nAnd you? </s>", " Sure: 2 + 2 = 4. </s>"]
    assert "<<SYS>>" in text[:spans[0][0]]  # the system prompt sits inside the first user turn


@pytest.mark.parametrize("name,kind", [("chatml_generation", "chatml_smollm"), ("llama2_chat_generation", "sp")])
def test_assistant_mask_equals_transformers_generation_mask(checkpoints, name, kind):
    # templates with {% generation %} markers let transformers compute the mask itself
    tok, ref = checkpoints(name, kind=kind)
    for conversation in (SINGLE, MULTI, SYSTEM):
        out = ref.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        expected = [i if m else ct.IGNORE_INDEX for i, m in zip(out["input_ids"], out["assistant_masks"])]
        ids, labels = ct.assistant_mask(tok, None, conversation)
        assert ids == out["input_ids"] and labels == expected


def test_assistant_mask_with_template_that_rerenders_earlier_turns(checkpoints):
    # Qwen3 keeps the reasoning only of turns after the last user message, so an earlier turn renders differently
    # once later turns follow
    tok, ref = checkpoints("qwen3")
    messages = [{"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."},
                {"role": "user", "content": "And 3 + 3?"},
                {"role": "assistant", "content": "<think>\nadd again\n</think>\n\nIt is 6."}]
    text = ref_text(ref, messages)
    assert "add them" not in text and "add again" in text
    exp_ids, exp_labels = expected_labels(ref, text, "<|im_start|>assistant\n", "<|im_end|>")
    ids, labels = ct.assistant_mask(tok, None, messages)
    assert ids == exp_ids and labels == exp_labels, trained_text(tok, ids, labels)
    assert trained_text(tok, ids, labels) == "It is 4.<think>\nadd again\n</think>\n\nIt is 6."  # specials skipped
    # enable_thinking=False: the generation prompt opens and closes an empty block, "<think>\n\n</think>\n\n".
    # Text the generation prompt already holds is given to the model at inference, so it is not trained: here the
    # "<think>\n" the last turn shares with it; everything after it is.
    spans = hand_spans(text, "<|im_start|>assistant\n", "<|im_end|>")
    spans[-1] = (spans[-1][0] + len("<think>\n"), spans[-1][1])
    exp_ids, exp_labels = expected_labels(ref, text, "", "", spans)
    ids, labels = ct.assistant_mask(tok, None, messages, enable_thinking=False)
    assert ids == exp_ids and labels == exp_labels, trained_text(tok, ids, labels)
    assert trained_text(tok, ids, labels) == "It is 4.add again\n</think>\n\nIt is 6."


def test_harmony_reasoning_masks_and_stops(checkpoints):
    """gpt-oss's harmony template with reasoning ("thinking"): the earlier turn's reasoning is dropped, the last
    turn's kept in the analysis channel; both render as transformers renders them (reasoning_effort too). Trained: the
    earlier answer through <|end|>, and the last turn from its channel header through <|return|>, reasoning, the
    second assistant header and answer included (the model writes all of it after the prompt's "<|start|>assistant").
    Generation stops at <|return|> and generation_config.json's eos ids (<|endoftext|>, <|call|>), never at <|end|>,
    which also ends the reasoning."""
    tok, ref = checkpoints("gpt_oss")
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "thinking": "add them", "content": "It is 4."},
                {"role": "user", "content": "And 3 + 3?"},
                {"role": "assistant", "thinking": "add again", "content": "It is 6."}]
    for agp, msgs in ((False, messages), (True, messages[:-1])):
        expected = ref_text(ref, msgs, agp, reasoning_effort="high")
        assert ct.render_chat(tok, msgs, agp, reasoning_effort="high") == expected
        assert "Reasoning: high" in expected
    text = ref_text(ref, messages)
    assert "add them" not in text and "<|channel|>analysis<|message|>add again<|end|>" in text
    first = text.index("<|start|>assistant") + len("<|start|>assistant")
    last = text.index("<|start|>assistant", text.index("And 3 + 3?")) + len("<|start|>assistant")
    spans = [(first, text.index("<|end|>", first) + len("<|end|>")), (last, len(text))]
    assert text.endswith("It is 6.<|return|>")
    exp_ids, exp_labels = expected_labels(ref, text, "", "", spans)
    ids, labels = ct.assistant_mask(tok, None, messages)
    assert ids == exp_ids and labels == exp_labels, trained_text(tok, ids, labels)
    ids_of = {t: ref.convert_tokens_to_ids(t) for t in ("<|return|>", "<|endoftext|>", "<|call|>", "<|end|>")}
    stops = ct.stop_ids(tok, tok.chat_template)
    assert sorted(stops) == sorted(ids_of[t] for t in ("<|return|>", "<|endoftext|>", "<|call|>"))
    assert ids_of["<|end|>"] not in stops


def test_special_token_between_header_and_content(checkpoints):
    # a turn may hold special tokens before its content (like Functionary's <|content|>): the turn still ends at
    # the first special token after the content, and that token is the end-of-turn id
    template = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.role == 'assistant' %}"
                "{{ '<|endoftext|>' }}{% endif %}{{ m.content + '<|im_end|>\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    tok, ref = checkpoints("smollm2_instruct")
    text = ref_text(ref, MULTI, chat_template=template)
    assert text.count("<|endoftext|>") == 2
    exp_ids, exp_labels = expected_labels(ref, text, "<|im_start|>assistant\n", "<|im_end|>")
    assert ct.assistant_mask(tok, template, MULTI) == (exp_ids, exp_labels)
    assert ct.end_of_turn_ids(tok, template) == [ref.convert_tokens_to_ids("<|im_end|>")]


def test_token_offsets_tile_the_text(checkpoints):
    # each token's range is exactly its own text: no gaps where a post-processor would trim spaces (GPT-2 style
    # ByteLevel trim_offsets gives a lone space an empty range), no overlaps except bytes of one character
    text = "<|im_start|>user\n  Hi  there \t😀 x<|im_end|>\n<|im_start|>assistant\n Sure:  4 ."
    for name in ("qwen25_instruct", "gemma_it", "zephyr"):
        tok, _ = checkpoints(name)
        _, offsets = ct.encode_with_offsets(tok, text)
        pos, last = 0, None
        for a, b in offsets:
            assert a == pos or (a, b) == last, (name, a, b, pos)
            last, pos = (a, b), b
        assert pos == len(text), name


def test_mask_inputs_false_trains_every_token(checkpoints):
    tok, ref = checkpoints("llama3_instruct")
    ids, labels = ct.assistant_mask(tok, None, SYSTEM, mask_inputs=False)
    assert ids == labels == ref_ids(ref, SYSTEM)
    ids, labels = ct.assistant_mask(tok, None, SYSTEM, ignore_index=-1)
    assert -1 in labels and ct.IGNORE_INDEX not in labels


def test_sentencepiece_offsets_cover_the_text(checkpoints):
    # byte-fallback pieces, the dummy prefix and special tokens map back onto the text, as transformers reports
    tok, ref = checkpoints("zephyr")
    text = "<|user|>\n 你好😀  x</s>\n<|assistant|>\n\tÅngström ≈ 1e-10 m</s> "
    ids, offsets = ct.encode_with_offsets(tok, text)
    enc = ref(text, add_special_tokens=False, return_offsets_mapping=True)
    assert ids == enc["input_ids"]
    assert [tuple(o) for o in offsets] == [tuple(o) for o in enc["offset_mapping"]]


def test_sentencepiece_unknown_pieces_keep_their_text(tmp_path):
    # Without byte fallback rare characters become <unk>, which covers them; checked against sentencepiece's own
    # piece positions (transformers 5's converted tokenizer drops such characters, so it can't be the reference)
    import sentencepiece  # a dependency of lit-qlora

    tok = Tokenizer(make_sp_without_byte_fallback(tmp_path))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    text = "Жук SOS 龍龍 ok"
    ids, offsets = ct.encode_with_offsets(tok, text)
    assert ids == sp.encode(text) and ids.count(sp.unk_id()) >= 3
    proto = sp.encode(text, return_type="proto")  # sentencepiece >= 0.2 (the dependency's floor)
    for (a, b), piece in zip(offsets, proto.pieces):
        if piece.id == sp.unk_id():
            assert text[a:b] == piece.surface


# ----------------------------------------------------------------------------------------------
# 3. end-of-turn ids, records, chat.py


@pytest.mark.parametrize("name", TEMPLATES)
def test_end_of_turn_ids(checkpoints, name):
    tok, ref = checkpoints(name)
    end_token = TEMPLATES[name][3]
    assert ct.end_of_turn_ids(tok) == [ref.convert_tokens_to_ids(end_token)]


def _write(path: Path, rows, jsonl: bool) -> Path:
    text = "\n".join(json.dumps(r) for r in rows) if jsonl else json.dumps(rows)
    path.write_text(text, encoding="utf-8")
    return path


def test_conversation_records(tmp_path):
    openai = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
                           {"role": "assistant", "content": "Bye!"}]}
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
                                  {"from": "user", "value": "Bye"}, {"from": "assistant", "value": "Bye!"}]}
    assert ct.is_conversation_record(openai) and ct.is_conversation_record(sharegpt)
    assert not ct.is_conversation_record({"instruction": "x", "output": "y"})
    for jsonl in (False, True):
        path = _write(tmp_path / f"chats.json{'l' if jsonl else ''}", [openai, sharegpt], jsonl)
        loaded = ct.load_conversations(path)
        assert loaded[0] == openai["messages"]
        assert loaded[1] == [{"role": r, "content": c} for r, c in
                             (("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye"), ("assistant", "Bye!"))]


BAD_ROWS = [
    ({"messages": [{"role": "bot", "content": "x"}]}, r"turn 1 has role='bot'; use one of system, user, assistant"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "robot", "value": "y"}]},
     r"turn 2 has from='robot'; use one of system, human, gpt"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, r"has no assistant turn, .*; add the assistant's reply"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  "}]},
     r"turn 2 \(assistant\) has empty content; fill it in or drop the row"),
    ({"messages": [{"role": "user", "content": ["Hi"]}, {"role": "assistant", "content": "x"}]},
     r"turn 1 \(user\) content is a list \(\['Hi'\]\), not a string; write the turn's text as a string"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": 19}]},
     r"turn 2 \(assistant\) content is a number \(19\), not a string; write the turn's text as a string"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "x"},
                   {"role": "assistant", "content": "y"}]},
     r"turn 2 is a system message, but only the first turn may be one; move it to the start"),
    ({"messages": []}, r"\"messages\" must be a non-empty list"),
    ({"prompt": "x"}, r"has no \"messages\" or \"conversations\" list \(it has: prompt\)"),
    ("just text", r"is a str, not an object"),
]


@pytest.mark.parametrize("rec,message", BAD_ROWS)
@pytest.mark.parametrize("jsonl", [False, True])
def test_bad_rows_are_refused_in_one_line(tmp_path, rec, message, jsonl):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    path = _write(tmp_path / ("data.jsonl" if jsonl else "data.json"), [good, good, rec], jsonl)
    with pytest.raises(UserError) as e:
        ct.load_conversations(path)
    text = str(e.value)
    assert "\n" not in text and f"row 3 of {path}" in text and "; " in text
    assert re.search(message, text), text


def test_record_files_that_are_not_lists(tmp_path):
    (tmp_path / "obj.json").write_text('{"messages": "x"}\n{"a": 1}')
    with pytest.raises(UserError, match=r"row 1 of .*obj.json: \"messages\" must be a non-empty list"):
        ct.load_conversations(tmp_path / "obj.json")  # JSON Lines saved as .json is read as JSON Lines
    (tmp_path / "bad.jsonl").write_text('{"messages": []}\n{oops\n')
    with pytest.raises(UserError, match=r"^line 2 of .*bad.jsonl is not valid JSON"):
        ct.load_conversations(tmp_path / "bad.jsonl")
    (tmp_path / "one.json").write_text('{\n  "messages": [{"role": "user", "content": "Hi"}]\n}\n')
    with pytest.raises(UserError, match=r"holds an object with keys \['messages'\], not a list of records; make "
                       "the top level a JSON list"):
        ct.load_conversations(tmp_path / "one.json")
    (tmp_path / "broken.json").write_text('[{"messages": ]')
    with pytest.raises(UserError, match=r"broken.json is not valid JSON \(Expecting value at line 1 column 15\)"):
        ct.load_conversations(tmp_path / "broken.json")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="data.csv holds no conversations; add some"):  # a header and no rows
        ct.load_conversations(tmp_path / "data.csv")
    assert ct.is_conversation_record({"messages": "x"})  # so its error is about messages, not a missing field


def test_chat_script_prompt_keeps_eos_between_turns(checkpoints):
    # generate/chat.py rendered with eos_token="": Zephyr's "</s>" separators went missing
    spec = importlib.util.spec_from_file_location("chat_script", ROOT / "generate" / "chat.py")
    chat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chat)
    tok, ref = checkpoints("zephyr")
    messages = MULTI[:3]
    ids = chat.encode_prompt(messages, tok, adapter=None, template=None)
    assert ids.tolist() == ref_ids(ref, messages, True)
    assert tok.decode(ids).count("<|assistant|>") == 2 and "</s>" in ref_text(ref, messages, True)
    assert ref_text(ref, [MULTI[0]], True) == "<|user|>\nHello, how are you?</s>\n<|assistant|>\n"
