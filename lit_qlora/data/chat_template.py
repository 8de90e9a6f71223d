"""Training and chatting in a model's own chat format.

* `render` turns a conversation into text with the model's Jinja chat template exactly as transformers'
  `apply_chat_template(tokenize=False)` does: the same sandboxed environment, filters, globals and variables.
* `encode_chat` gives the ids of `apply_chat_template(tokenize=True)`: the rendered text tokenized with no bos/eos
  added (bos is in the text when the template writes it) and special-token strings in the text read as those tokens.
* `assistant_mask` gives (input_ids, labels) for supervised fine-tuning where only the assistant turns (content and
  the template's end-of-turn token) are trained, for any template: no `{% generation %}` markers are needed.
* `end_of_turn_ids` finds the token(s) a template ends an assistant turn with; `stop_ids` adds them to the
  checkpoint's eos ids: what generation stops at.
* `load_conversations` / `load_conversation_rows` read OpenAI-style `messages` and ShareGPT `conversations` records
  through the one records reader (`lit_qlora.data.records`, which normalizes them); `instruction_messages` turns an
  instruction record into a conversation.

Nothing here imports transformers; the tests compare every result with it.
"""
from __future__ import annotations

import json
import re
import weakref
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lit_qlora.data.records import ROLES, is_conversation_record, iter_rows, normalize_conversation  # noqa: F401
from lit_qlora.tokenizer import NAMED_SPECIAL_TOKENS
from lit_qlora.utils import UserError

IGNORE_INDEX = -100
# The named special tokens a tokenizer passes to its template (transformers' special_tokens_map).

# ----------------------------------------------------------------------------------------------
# Rendering


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers uses it to find assistant text for
    `return_assistant_tokens_mask`. Templates that carry it must compile and render the same here, so the body is
    simply rendered in place (assistant_mask finds the turns without these markers)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Dict:
    """`dict(...)` for templates, without exposing the dict type itself to attribute tricks."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a chat template cannot store the underscore attribute {name!r}")


class _Namespace(jinja2.utils.Namespace):
    """jinja's `namespace()` refusing underscore-prefixed names, which could reach Python internals (as in
    transformers)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _raise_exception(message: Any) -> None:
    """The template's own refusal (e.g. "System role not supported"), as a one-line user error."""
    text = " ".join(str(message).split())
    raise UserError(f"the chat template refuses this conversation: {text}; change the messages to what the template "
                    "accepts (e.g. merge the system message into the first user turn, alternate user/assistant turns)")


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ' and sorts keys; chat templates expect plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """Compile a chat template once (cached) in the environment transformers uses. A syntax error is a UserError."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"the chat template does not compile ({e.message} at line {e.lineno}); "
                        "fix the template (tokenizer_config.json chat_template or chat_template.jinja)") from None


def _plain(value: Any) -> Any:
    """Only plain JSON-like data reaches the sandbox (transformers rebuilds its inputs the same way)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _template_messages(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: keys with None values dropped (templates handle a missing
    key better than a None), and a reasoning text available under both names templates read."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise UserError(f"a chat message must be an object with role and content, got {message!r}; fix the data")
        message = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render(template: str, messages: list[dict], *, bos_token: str | None, eos_token: str | None,
           add_generation_prompt: bool = False, **extra: Any) -> str:
    """Render `messages` with a chat template as `apply_chat_template(..., tokenize=False)` does.

    bos_token / eos_token: the strings the template sees (None leaves the variable undefined, as transformers does
    for a tokenizer without that token). extra: more variables, e.g. tools=[...], unk_token=..., date_string=...;
    `tools` and `documents` are None unless given. A refusal by the template (raise_exception) or any other template
    error is a one-line UserError.
    """
    compiled = compile_template(template)
    variables = {name: value for name, value in (("bos_token", bos_token), ("eos_token", eos_token))
                 if value is not None}
    variables.update(_plain(extra))
    variables.setdefault("tools", None)
    variables.setdefault("documents", None)
    try:
        return compiled.render(messages=_template_messages(messages), add_generation_prompt=add_generation_prompt,
                               **variables)
    except jinja2.TemplateError as e:
        text = " ".join(str(e).split())
        raise UserError(f"the chat template failed on this conversation ({type(e).__name__}: {text}); "
                        "check the messages, or fix the template") from None


# ----------------------------------------------------------------------------------------------
# A checkpoint's template and special tokens


def template_of(tokenizer: Any) -> str:
    """The checkpoint's chat template (`Tokenizer.chat_template`: chat_template.jinja, else tokenizer_config.json's
    chat_template, string or the named list's "default"), or a UserError when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise UserError(f"the tokenizer in {getattr(tokenizer, 'checkpoint_dir', 'the checkpoint')} has no chat "
                        "template (no chat_template.jinja, no chat_template in tokenizer_config.json); "
                        "use a chat/instruct model's files, or train with a prompt template (--template alpaca)")
    return template


def _config(tokenizer: Any) -> dict[str, Any]:
    return getattr(tokenizer, "tokenizer_config", None) or {}


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # the AddedToken form {"content": "<s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens_map(tokenizer: Any) -> dict[str, str]:
    """The named special tokens the template sees, from tokenizer_config.json (unset or null ones are left out)."""
    config = _config(tokenizer)
    named = {name: _token_str(config.get(name)) for name in NAMED_SPECIAL_TOKENS}
    return {name: value for name, value in named.items() if value is not None}


def render_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = False,
                template: str | None = None, **extra: Any) -> str:
    """`render` with the tokenizer's template (or `template`) and its special-token strings."""
    variables = {**special_tokens_map(tokenizer), **extra}  # extras win, as in transformers
    return render(template or template_of(tokenizer), messages, bos_token=variables.pop("bos_token", None),
                  eos_token=variables.pop("eos_token", None), add_generation_prompt=add_generation_prompt,
                  **variables)


# ----------------------------------------------------------------------------------------------
# Tokenizing rendered text


def special_token_strings(tokenizer: Any) -> list[str]:
    """Strings that encode as one special token wherever they appear in rendered text.

    tokenizer.json: its added tokens flagged special. sentencepiece: bos/eos/unk and the tokens tokenizer_config.json
    names (transformers adds those as special tokens when it converts the model). Longest first.
    """
    config = _config(tokenizer)
    named = set(special_tokens_map(tokenizer).values())
    named.update(t for t in map(_token_str, config.get("additional_special_tokens") or []) if t)
    named.update(t for t in map(_token_str, (config.get("added_tokens_decoder") or {}).values()) if t)
    if tokenizer.backend == "huggingface":
        # tokenizers only matches its own added tokens in text: the special ones, and any the config names
        added = tokenizer.processor.get_added_tokens_decoder().values()
        found = {t.content for t in added if t.special or t.content in named}
    else:
        sp = tokenizer.processor
        found = {sp.id_to_piece(i) for i in (sp.bos_id(), sp.eos_id(), sp.unk_id()) if i >= 0}
        found.update(t for t in named if tokenizer.token_to_id(t) is not None)
    return sorted((t for t in found if t), key=lambda t: (-len(t), t))


# Per-tokenizer helpers built once: a tokenizer.json copy without its post-processor (for offsets), a sentencepiece
# processor without the dummy prefix, the special-token regex.
_HELPERS: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()


def _helpers(tokenizer: Any) -> dict:
    helpers = _HELPERS.get(tokenizer)
    if helpers is None:
        specials = special_token_strings(tokenizer)
        helpers = {"specials": specials,
                   "special_re": re.compile("|".join(map(re.escape, specials))) if specials else None}
        if tokenizer.backend == "huggingface":
            from tokenizers import Tokenizer as HFTokenizer

            # A ByteLevel/Roberta post-processor with trim_offsets moves offsets off spaces (a lone space token gets
            # an empty range); ids are the same without it since no special tokens are added.
            copy = HFTokenizer.from_str(tokenizer.processor.to_str())
            copy.post_processor = None
            copy.no_truncation()
            copy.no_padding()
            helpers["offsets_processor"] = copy
        else:
            import sentencepiece

            proto = _without_dummy_prefix(tokenizer.processor.serialized_model_proto())
            helpers["sp_plain"] = sentencepiece.SentencePieceProcessor(model_proto=proto)
            helpers["prepend"] = _prepend_scheme(_config(tokenizer))
        _HELPERS[tokenizer] = helpers
    return helpers


def _prepend_scheme(config: dict[str, Any]) -> str:
    """Where transformers' converted sentencepiece tokenizer (Metaspace pre-tokenizer) puts the "▁" prefix: before
    the first piece of text only ("first", legacy=false, the default), before every piece between special tokens
    ("always", legacy=true) or nowhere (add_prefix_space=false)."""
    if config.get("add_prefix_space") is False:
        return "never"
    return "always" if config.get("legacy") is True else "first"


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _proto_fields(data: bytes) -> list[tuple[int, bytes, bytes]]:
    """(field number, raw bytes of the whole field, payload) for each top-level field of a protobuf message."""
    fields, i = [], 0
    while i < len(data):
        start = i
        key, i = _read_varint(data, i)
        wire = key & 7
        payload_start = i
        if wire == 0:
            _, i = _read_varint(data, i)
        elif wire == 1:
            i += 8
        elif wire == 2:
            n, payload_start = _read_varint(data, i)
            i = payload_start + n
        elif wire == 5:
            i += 4
        else:
            raise UserError(f"tokenizer.model has an unknown protobuf wire type {wire}; re-copy the tokenizer files")
        fields.append((key >> 3, data[start:i], data[payload_start:i]))
    return fields


def _without_dummy_prefix(model_proto: bytes) -> bytes:
    """The sentencepiece model with normalizer_spec.add_dummy_prefix = false.

    Text between special tokens must be encoded without sentencepiece's leading "▁" (transformers' converted
    tokenizer only adds it at the very start) and sentencepiece has no runtime switch for it, so the flag (field 3
    of NormalizerSpec, itself field 3 of ModelProto) is rewritten in the serialized model; no protobuf needed.
    """
    out, seen = [], False
    for number, raw, payload in _proto_fields(model_proto):
        if number == 3:
            seen = True
            inner = b"".join(r for n, r, _ in _proto_fields(payload) if n != 3) + b"\x18\x00"
            raw = b"\x1a" + _varint(len(inner)) + inner
        out.append(raw)
    if not seen:
        out.append(b"\x1a\x02\x18\x00")
    return b"".join(out)


def _split_specials(text: str, special_re: re.Pattern | None) -> list[tuple[int, int, bool]]:
    """(start, end, is_special) pieces of text; special-token strings match leftmost-longest, as tokenizers does."""
    pieces, pos = [], 0
    if special_re is not None:
        for m in special_re.finditer(text):
            if m.start() > pos:
                pieces.append((pos, m.start(), False))
            pieces.append((m.start(), m.end(), True))
            pos = m.end()
    if pos < len(text):
        pieces.append((pos, len(text), False))
    return pieces


def _sp_offsets(sp: Any, ids: list[int], segment: str, prefixed: bool) -> list[tuple[int, int]]:
    """Character offsets (within `segment`) of sentencepiece ids, rebuilt from the pieces' bytes.

    Pieces spell the normalized text: "▁" for a space (the dummy prefix too), <0xNN> for byte-fallback bytes. A
    byte piece gets the range of the character its byte belongs to, as tokenizers reports it.
    """
    text = (" " if prefixed else "") + segment
    data = text.encode("utf-8")
    char_at = [0] * (len(data) + 1)  # byte position -> index of the character holding it
    pos = 0
    for ci, ch in enumerate(text):
        n = len(ch.encode("utf-8"))
        char_at[pos:pos + n] = [ci] * n
        pos += n
    char_at[len(data)] = len(text)
    spans, pos = [], 0
    for k, i in enumerate(ids):
        if sp.is_byte(i):
            piece = bytes([int(sp.id_to_piece(i)[3:5], 16)])
        elif sp.is_control(i):
            piece = b""
        elif sp.is_unknown(i):  # covers the text up to where the next piece starts
            nxt = next((sp.id_to_piece(j).replace("▁", " ").encode() for j in ids[k + 1:]
                        if not (sp.is_control(j) or sp.is_unknown(j) or sp.is_byte(j))), None)
            end = data.find(nxt, pos + 1) if nxt else len(data)
            piece = data[pos:end if end > pos else len(data)]
        else:
            piece = sp.id_to_piece(i).replace("▁", " ").encode("utf-8")
        if data[pos:pos + len(piece)] != piece:
            raise UserError("the sentencepiece model normalizes text, so token positions cannot be mapped back to "
                            "the chat text; use the model's tokenizer.json instead of tokenizer.model")
        start, end = char_at[pos], char_at[pos + len(piece)] if piece else char_at[pos]
        if piece and end == start:  # a byte inside a multi-byte character
            end = start + 1
        spans.append((start, end))
        pos += len(piece)
    if not prefixed:
        return spans
    # The dummy prefix is not in `segment`; a piece that is the prefix alone gets the first character's range, as
    # tokenizers aligns a prepended "▁" with the character it precedes.
    return [(max(s - 1, 0), max(e - 1, 0)) if e > 1 else (0, min(1, len(segment))) for s, e in spans]


def encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids of rendered chat `text` (no bos/eos added; special-token strings become their tokens) and the character
    range of each id in `text`. These are the ids of transformers' apply_chat_template(tokenize=True)."""
    helpers = _helpers(tokenizer)
    if tokenizer.backend == "huggingface":
        enc = helpers["offsets_processor"].encode(text, add_special_tokens=False)
        return list(enc.ids), [tuple(o) for o in enc.offsets]
    sp, sp_plain, scheme = tokenizer.processor, helpers["sp_plain"], helpers["prepend"]
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    for start, end, special in _split_specials(text, helpers["special_re"]):
        segment = text[start:end]
        if special:
            ids.append(tokenizer.token_to_id(segment))
            offsets.append((start, end))
            continue
        # Metaspace adds "▁" unless the text already starts with a space (which becomes the "▁" itself)
        prefixed = not segment.startswith(" ") and (scheme == "always" or (scheme == "first" and start == 0))
        seg_ids = (sp if prefixed else sp_plain).encode(segment)
        ids.extend(seg_ids)
        offsets.extend((start + s, start + e) for s, e in _sp_offsets(sp, seg_ids, segment, prefixed))
    return ids, offsets


def encode_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = False,
                template: str | None = None, **extra: Any) -> list[int]:
    """The ids transformers' `apply_chat_template(messages, tokenize=True)` gives: the rendered text tokenized with
    add_special_tokens=False (transformers >= 4.4x), so bos appears once, where the template writes bos_token, and
    is not added when the template doesn't write it."""
    return encode_with_offsets(tokenizer, render_chat(tokenizer, messages, add_generation_prompt, template,
                                                      **extra))[0]


# ----------------------------------------------------------------------------------------------
# Assistant-only loss masks


def common_prefix_len(a: str, b: str) -> int:
    """How many leading characters `a` and `b` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on prefix equality: renders are long and mostly equal
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def assistant_spans(tokenizer: Any, messages: list[dict], template: str | None = None,
                    **extra: Any) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant turn in it: the turn's text after the
    template's assistant header (the generation prompt) through the first special token after the content, the
    end-of-turn token (`<|im_end|>`, `<|eot_id|>`, `</s>`, `<end_of_turn>`, ...). Text after that token, such as
    the newline ChatML writes between turns, is not part of the turn.

    Where a turn starts comes from rendering the conversation up to it with add_generation_prompt=True: text the
    generation prompt holds is given to the model at inference, so it is not trained (even where it runs into the
    turn, e.g. a prompt that opens a reasoning block). A turn may render differently once later turns follow (e.g.
    reasoning that templates drop from older turns); only the text before it must agree, so the end is searched
    in the full rendering. A template without special tokens ends a turn where the full rendering and the one
    ending at the turn part.
    """
    text = render_chat(tokenizer, messages, False, template, **extra)
    special_re = _helpers(tokenizer)["special_re"]
    turns = [k for k, m in enumerate(messages) if m.get("role") == "assistant"]
    starts = []
    for k in turns:
        prompt = render_chat(tokenizer, messages[:k], True, template, **extra)
        start = common_prefix_len(prompt, text)
        if start < len(prompt):
            # The generation prompt may differ from the header the turn is rendered with (that's fine), but the
            # conversation before it must render the same.
            history = common_prefix_len(render_chat(tokenizer, messages[:k], False, template, **extra), prompt)
            if start < history:
                raise UserError("the chat template renders earlier turns differently once later turns follow, so "
                                "the assistant turns cannot be located; train with --mask_inputs false or another "
                                "template")
        if starts and start < starts[-1]:
            raise UserError("the chat template's assistant turns could not be located in order; "
                            "train with --mask_inputs false or another template")
        starts.append(start)
    spans = []
    for n, (k, start) in enumerate(zip(turns, starts)):
        bound = starts[n + 1] if n + 1 < len(starts) else len(text)
        content = messages[k].get("content")
        content = content.strip() if isinstance(content, str) else ""
        # The end-of-turn token is the first special token after the content (a template may write special tokens
        # between header and content). Content the template doesn't render as is (e.g. reasoning it drops) isn't
        # found; then the turn ends at the first special token after its start.
        at = text.find(content, start, bound) if content else -1
        body_end = at + len(content) if at >= 0 else start
        eot = special_re.search(text, body_end, bound) if special_re else None
        if eot is not None:
            end = eot.end()
        else:
            ending = render_chat(tokenizer, messages[:k + 1], False, template, **extra)
            end = min(max(common_prefix_len(ending, text), body_end), bound)
        spans.append((start, end))
    return text, spans


def assistant_mask(tokenizer: Any, template: str | None, messages: list[dict], mask_inputs: bool = True,
                   ignore_index: int = IGNORE_INDEX, **extra: Any) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a conversation for supervised fine-tuning.

    input_ids are `encode_chat(messages)`. labels equal input_ids on the tokens of each assistant turn (its content
    and end-of-turn token, see `assistant_spans`) and are ignore_index elsewhere; a token that straddles a turn's
    boundary counts as assistant. mask_inputs=False trains on every token (labels == input_ids).
    template None means the tokenizer's own.
    """
    if not mask_inputs:
        ids = encode_chat(tokenizer, messages, False, template, **extra)
        return ids, list(ids)
    text, spans = assistant_spans(tokenizer, messages, template, **extra)
    ids, offsets = encode_with_offsets(tokenizer, text)
    labels = [ignore_index] * len(ids)
    j = 0
    for i, (a, b) in enumerate(offsets):
        while j < len(spans) and spans[j][1] <= a:
            j += 1  # spans and offsets are both in order: one pass
        if j == len(spans):
            break
        s, e = spans[j]
        inside = (s <= a < e) if a == b else (a < e and b > s)  # zero-width tokens: by position
        if inside:
            labels[i] = ids[i]
    return ids, labels


# ----------------------------------------------------------------------------------------------
# Stopping generation

_PROBE = [{"role": "user", "content": "PROBEQUESTION1"}, {"role": "assistant", "content": "PROBEANSWER1"},
          {"role": "user", "content": "PROBEQUESTION2"}, {"role": "assistant", "content": "PROBEANSWER2"}]


def end_of_turn_ids(tokenizer: Any, template: str | None = None) -> list[int]:
    """Ids of the special token(s) the template ends an assistant turn with (e.g. <|im_end|>, <|eot_id|>,
    <end_of_turn>, </s>, harmony's <|return|>), found by rendering a two-turn probe conversation: the last turn's.
    Generation should stop at these as well as at the tokenizer's stop_ids (generation_config.json's eos ids). Empty
    for templates without special tokens.
    """
    text, spans = assistant_spans(tokenizer, _PROBE, template)
    specials = set(_helpers(tokenizer)["specials"])
    found = []
    for start, end in spans:
        match = next((t for t in sorted(specials, key=len, reverse=True) if text.endswith(t, start, end)), None)
        token_id = tokenizer.token_to_id(match) if match else None
        found.append(token_id)
    # The conversation's last turn says how a reply ends; an earlier turn may end otherwise: gpt-oss's harmony ends
    # every message with <|end|>, the reasoning the model writes before its answer too, and only the last answer with
    # <|return|> (stopping at <|end|> would cut each reply after its reasoning). The earlier turns' tokens only count
    # where the last turn has none.
    if found and found[-1] is not None:
        return [found[-1]]
    return list(dict.fromkeys(t for t in found if t is not None))


# ----------------------------------------------------------------------------------------------
# Conversation records: read and normalized by the records reader (lit_qlora.data.records), named here too


def load_conversation_rows(path: Path | str) -> list[tuple[int, list[dict]]]:
    """(row, messages) of each conversation record of a data file (any the records reader reads: .json, .jsonl,
    .parquet...), normalized; the first bad row is refused in one line (for .jsonl, the row number is the line
    number)."""
    rows = list(iter_rows(path))
    if not rows:
        raise UserError(f"{path} holds no conversations; add some or pick another file")
    return [(row, normalize_conversation(rec, row, path)) for row, rec in rows]


def load_conversations(path: Path | str) -> list[list[dict]]:
    """The normalized messages of every conversation record in a data file (see `load_conversation_rows`)."""
    return [messages for _, messages in load_conversation_rows(path)]


def instruction_messages(instruction: str, input: str = "", output: str | None = None) -> list[dict]:
    """An instruction record as a conversation: one user turn (the instruction, then the input after a blank line
    when there is one) and, when `output` is given, the assistant's reply. Training (`--template chat` on
    instruction data) and generate/lora.py build the user turn the same way."""
    user = instruction if not input.strip() else f"{instruction}\n\n{input}"
    messages = [{"role": "user", "content": user}]
    if output is not None:
        messages.append({"role": "assistant", "content": output})
    return messages


def stop_ids(tokenizer: Any, template: str | None = None) -> list[int]:
    """The ids generation stops at: every eos id of the checkpoint (tokenizer_config.json's eos token and each id
    in generation_config.json's / config.json's eos_token_id, `Tokenizer.stop_ids`) and, when rendering with a chat
    template (`template`, the text), the template's end-of-turn token(s), which an instruct model may end a reply
    with without listing them as eos (e.g. <|im_end|> with eos <|endoftext|>)."""
    stops = list(tokenizer.stop_ids or ([tokenizer.eos_id] if tokenizer.eos_id is not None else []))
    if template:
        stops += end_of_turn_ids(tokenizer, template)
    return list(dict.fromkeys(stops))
