"""Tokenizer of a checkpoint folder: Hugging Face `tokenizer.json` or sentencepiece `tokenizer.model`.

Encoding matches what `transformers` produces for the same folder, without depending on it: the
`tokenizers` / `sentencepiece` libraries do the work, and the special-token settings are read from
tokenizer_config.json, generation_config.json and config.json.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from lit_qlora.readers import (
    GENERATION_CONFIG_FIELDS,
    TOKEN_ID_FIELDS,
    TOKENIZER_CONFIG_FIELDS,
    check_file,
    read_side_json,
    read_text,
)
from lit_qlora.utils import UserError

_FIELDS = {"tokenizer_config.json": TOKENIZER_CONFIG_FIELDS, "generation_config.json": GENERATION_CONFIG_FIELDS,
           "config.json": TOKEN_ID_FIELDS}


MAX_CHAT_TEMPLATE = 1 << 20  # characters: 30x the largest published chat template; more is a damaged file
# the special tokens tokenizer_config.json names by role (transformers' SPECIAL_TOKENS_ATTRIBUTES)
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _steps(component: Any) -> list[dict]:
    """The steps of a tokenizer.json component (a normalizer, pre-tokenizer or decoder; a Sequence's in order)."""
    if not isinstance(component, dict):
        return []
    inner = component.get("pretokenizers") or component.get("normalizers") or component.get("decoders")
    return [c for c in inner if isinstance(c, dict)] if component.get("type") == "Sequence" and isinstance(
        inner, list) else [component]


def _check_byte_level(processor: Any, path: Path) -> None:
    """A tokenizer.json that decodes byte-level (GPT-2, Llama 3, Qwen) maps text to bytes first, in its pre-tokenizer
    (or normalizer): one without that step loads, and encodes every space and non-ASCII character into other ids
    (the fuzzer, seed 14053: pre_tokenizer deleted). Refused in one line naming the file. Reads the loaded
    tokenizer's components (their own small JSON), not the file again."""
    def steps(name: str) -> list[dict]:
        component = getattr(processor, name, None)
        return _steps(json.loads(component.__getstate__()) if component is not None else None)

    if not any(d.get("type") == "ByteLevel" for d in steps("decoder")):
        return
    if not any(d.get("type") == "ByteLevel" for key in ("pre_tokenizer", "normalizer") for d in steps(key)):
        raise UserError(f"{path} decodes byte-level but has no ByteLevel step in its pre_tokenizer or normalizer, so "
                        "text would encode into other ids; re-copy the tokenizer files of the model")


def _check_template_specials(processor: Any, path: Path) -> None:
    """A TemplateProcessing post-processor (Llama 3's bos, BERT's [CLS] / [SEP]) adds the tokens its templates name
    from its own special_tokens table; one whose table lost a name loads, and tokenizers panics on the first encode
    with special tokens (the fuzzer, seed 25003: special_tokens.<s> deleted; transformers fails the same way).
    Refused in one line naming the token."""
    component = getattr(processor, "post_processor", None)
    state = json.loads(component.__getstate__()) if component is not None else None
    steps = state.get("processors") if isinstance(state, dict) and state.get("type") == "Sequence" else [state]
    for step in (s for s in steps or [] if isinstance(s, dict) and s.get("type") == "TemplateProcessing"):
        table = step.get("special_tokens") or {}
        for piece in (p for key in ("single", "pair") for p in step.get(key) or []):
            name = piece.get("SpecialToken", {}).get("id") if isinstance(piece, dict) else None
            if name is not None and name not in table:
                raise UserError(f"{path}'s post_processor template adds {name!r}, which its special_tokens table "
                                "does not hold; re-copy the tokenizer files of the model")


def _read_json(path: Path) -> dict[str, Any]:
    """An optional side file of the tokenizer ({} without it), its fields checked (lit_qlora.readers)."""
    return read_side_json(path, _FIELDS.get(path.name, {}))


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as "<s>" or as an AddedToken dict {"content": "<s>", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    """generation_config.json / config.json ids may be null, an int, or a list (several stop tokens)."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _first(*candidates: int | None) -> int | None:
    return next((c for c in candidates if c is not None), None)


def _flag(config: dict[str, Any], key: str, default: bool) -> bool:
    """A boolean setting where a missing key and an explicit null both mean "use the default"."""
    value = config.get(key)
    return default if value is None else bool(value)


class Tokenizer:
    def __init__(self, checkpoint_dir: Path | str) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self._load_processor()
        tok_config = _read_json(self.checkpoint_dir / "tokenizer_config.json")
        # kept for chat templates: the special-token strings a template sees, sentencepiece prefix settings
        self.tokenizer_config: dict[str, Any] = tok_config
        if self.backend == "huggingface":
            self._check_added_tokens(tok_config)
            self._add_named_specials(tok_config)
        self._read_special_ids(tok_config)
        # Whether encode() adds bos/eos by default. An explicit add_bos_token / add_eos_token wins
        # (transformers 4's Llama/Gemma tokenizers honour it even with a tokenizer.json). Otherwise a
        # tokenizer.json says so through its post-processor (Llama 3 adds <|begin_of_text|> there),
        # and a bare tokenizer.model (Llama 1/2 style) gets bos, as Meta's and HF's code did.
        post_bos, post_eos = self._post_processor_specials()
        default_bos = post_bos if self.backend == "huggingface" else self.bos_id is not None
        self.add_bos: bool = _flag(tok_config, "add_bos_token", default_bos) and self.bos_id is not None
        self.add_eos: bool = _flag(tok_config, "add_eos_token", post_eos) and self.eos_id is not None
        self.chat_template: str | None = self._read_chat_template(tok_config)

    def _load_processor(self) -> None:
        """The tokenizer itself (`backend`, `processor`, `model_path`): tokenizer.json, else tokenizer.model."""
        for name in ("tokenizer.json", "tokenizer.model", "chat_template.jinja"):  # a folder or a symlink loop in a
            if os.path.lexists(self.checkpoint_dir / name):  # file's place is refused, never read past to the next
                check_file(self.checkpoint_dir / name, "tokenizer file", "re-copy the tokenizer files of the model")
        # Like transformers' fast tokenizers, prefer tokenizer.json: when both exist it is the
        # authoritative one (tokenizer.model is often kept only for the slow tokenizer).
        if (path := self.checkpoint_dir / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as HFTokenizer

            self.backend = "huggingface"
            try:
                self.processor: Any = HFTokenizer.from_file(str(path))
            except Exception as e:
                raise UserError(f"cannot read {path} ({e}); re-copy the tokenizer files of the model") from e
            _check_byte_level(self.processor, path)
            # A tokenizer.json may carry truncation/padding settings; encode() must return every id.
            self.processor.no_truncation()
            self.processor.no_padding()
        elif (path := self.checkpoint_dir / "tokenizer.model").is_file():
            import sentencepiece

            self.backend = "sentencepiece"
            try:
                self.processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
            except Exception as e:
                raise UserError(f"cannot read {path} ({e}); re-copy the tokenizer files of the model") from e
        else:
            raise UserError(
                f"no tokenizer found in {self.checkpoint_dir} (expected tokenizer.json or tokenizer.model); "
                "copy the tokenizer files of the model into it"
            )
        self.model_path = path

    def _read_special_ids(self, tok_config: dict[str, Any]) -> None:
        """`bos_id`, `eos_id` and `stop_ids`, most specific source first: the tokenizer's own config names the token
        that encode() adds; generation_config.json / config.json only give ids. sentencepiece models also record
        bos/eos ids themselves (-1 when absent)."""
        gen_config = _read_json(self.checkpoint_dir / "generation_config.json")
        model_config = _read_json(self.checkpoint_dir / "config.json")
        own_bos = own_eos = None
        if self.backend == "sentencepiece":
            own_bos = self.processor.bos_id() if self.processor.bos_id() >= 0 else None
            own_eos = self.processor.eos_id() if self.processor.eos_id() >= 0 else None
        gen_eos = _id_list(gen_config.get("eos_token_id"))
        cfg_eos = _id_list(model_config.get("eos_token_id"))
        self.bos_id: int | None = _first(
            self.token_to_id(_token_str(tok_config.get("bos_token"))),
            *_id_list(gen_config.get("bos_token_id")),
            *_id_list(model_config.get("bos_token_id")),
            own_bos,
        )
        self.eos_id: int | None = _first(
            self.token_to_id(_token_str(tok_config.get("eos_token"))), *gen_eos, *cfg_eos, own_eos
        )
        # Generation stops at any of them: e.g. Llama 3 instruct lists <|end_of_text|>, <|eom_id|>, <|eot_id|>.
        stops = [self.eos_id, *gen_eos, *cfg_eos]
        self.stop_ids: list[int] = list(dict.fromkeys(i for i in stops if i is not None))

    def _read_chat_template(self, tok_config: dict[str, Any]) -> str | None:
        """The chat template: chat_template.jinja (transformers >= 4.43 may save it as its own file, which then takes
        priority), else tokenizer_config.json's, whose older multi-template form gives its "default" one."""
        template_file = self.checkpoint_dir / "chat_template.jinja"
        template = tok_config.get("chat_template")
        if template_file.is_file():
            template = read_text(template_file)
        if isinstance(template, list):  # older multi-template form: [{"name": "default", "template": ...}, ...]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if isinstance(template, str) and len(template) > MAX_CHAT_TEMPLATE:  # a 4 MiB line spliced into one
            source = template_file if template_file.is_file() else self.checkpoint_dir / "tokenizer_config.json"
            raise UserError(f"{source} holds a chat template of {len(template):,} characters; published templates "
                            "are a few KB (tool-calling ones up to ~30 KB): the file is damaged, re-copy it")
        return template

    def _check_added_tokens(self, tok_config: dict[str, Any]) -> None:
        """tokenizer_config.json's added tokens (id -> token) must be what tokenizer.json has at those ids:
        transformers restores a token missing from tokenizer.json from this list, so a tokenizer.json that lost one
        (the chat markers, usually) would split them into pieces here without a word."""
        added = {i: t.content for i, t in self.processor.get_added_tokens_decoder().items()}
        for key, entry in (tok_config.get("added_tokens_decoder") or {}).items():
            content = _token_str(entry)
            if content is None or not str(key).isdigit() or added.get(int(key)) == content:
                continue
            have = f"{added[int(key)]!r}" if int(key) in added else "no added token"
            raise UserError(f"{self.checkpoint_dir / 'tokenizer_config.json'} has the added token {content!r} at id "
                            f"{key}, {self.model_path} has {have} there; the two files disagree: re-copy the "
                            "tokenizer files of the model")

    def _add_named_specials(self, tok_config: dict[str, Any]) -> None:
        """The tokens tokenizer_config.json names (bos, eos, ..., additional_special_tokens) as special tokens of the
        tokenizer, as transformers adds them when it loads the folder (whatever tokenizer.json's added_tokens list
        says: a token of the vocabulary that the list left out still encodes as one special token there, and
        llama.cpp's converter marks it a control token). Only tokens of the vocabulary: a name that is none of its
        tokens would be a new id beyond the model's embedding."""
        from tokenizers import AddedToken

        extra = tok_config.get("additional_special_tokens") or tok_config.get("extra_special_tokens") or []
        named = [_token_str(tok_config.get(k)) for k in NAMED_SPECIAL_TOKENS]
        named += [_token_str(t) for t in (extra if isinstance(extra, list) else [])]
        added = {t.content for t in self.processor.get_added_tokens_decoder().values() if t.special}
        named = [t for t in dict.fromkeys(named) if t and t not in added]
        for t in (t for t in named if self.processor.token_to_id(t) is None):
            shown = t if len(t) <= 40 else f"{t[:40]}... ({len(t):,} characters)"
            print(f"warning: {self.checkpoint_dir / 'tokenizer_config.json'} names the special token {shown!r}, "
                  f"which is no token of {self.model_path.name}: not used (transformers would add it as a new id "
                  "beyond the model's embedding); re-copy the file if it was not meant so", file=sys.stderr)
        missing = [t for t in named if self.processor.token_to_id(t) is not None]
        if missing:
            self.processor.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])

    def _post_processor_specials(self) -> tuple[bool, bool]:
        """Whether tokenizer.json's post-processor adds bos at the start / eos at the end.

        We always encode without the post-processor and add bos/eos ourselves (so bos is never added
        twice); this tells us what its default is. Probing beats parsing the many post-processor kinds.
        """
        if self.backend != "huggingface":
            return False, False
        plain = self.processor.encode("a", add_special_tokens=False).ids
        _check_template_specials(self.processor, self.model_path)
        try:
            full = self.processor.encode("a", add_special_tokens=True).ids
        except BaseException as e:  # tokenizers panics (a BaseException) where a post-processor cannot run
            if type(e).__name__ != "PanicException":
                raise
            raise UserError(f"{self.model_path}'s post_processor fails on the text 'a' ({e}); re-copy the tokenizer "
                            "files of the model") from None
        if self.bos_id is None and len(full) > len(plain) and full[1:][: len(plain)] == plain:
            self.bos_id = full[0]  # the configs named no bos, but the post-processor uses one
        starts = bool(full) and full[0] == self.bos_id and plain[:1] != [self.bos_id]
        ends = bool(full) and full[-1] == self.eos_id and plain[-1:] != [self.eos_id]
        return starts, ends

    def token_to_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        if self.backend == "huggingface":
            return self.processor.token_to_id(token)
        i = self.processor.piece_to_id(token)
        # sentencepiece maps unknown pieces to unk_id instead of failing
        return i if self.processor.id_to_piece(i) == token else None

    @property
    def vocab_size(self) -> int:
        if self.backend == "huggingface":
            return self.processor.get_vocab_size(with_added_tokens=True)
        return self.processor.vocab_size()

    def encode(
        self, text: str, bos: bool | None = None, eos: bool | None = False, max_length: int = -1
    ) -> torch.Tensor:
        """Token ids of `text` as a 1-D long tensor.

        bos / eos: None means the tokenizer's default (`add_bos` / `add_eos`). max_length >= 0 keeps
        the first max_length ids (an appended eos is cut off too); negative means no limit.
        """
        if self.backend == "huggingface":
            ids: list[int] = self.processor.encode(text, add_special_tokens=False).ids
        else:
            ids = self.processor.encode(text)
        if self.add_bos if bos is None else bos:
            if self.bos_id is None:
                raise ValueError(f"the tokenizer in {self.checkpoint_dir} has no bos token; use bos=False")
            ids = [self.bos_id, *ids]
        if self.add_eos if eos is None else eos:
            if self.eos_id is None:
                raise ValueError(f"the tokenizer in {self.checkpoint_dir} has no eos token; use eos=False")
            ids.append(self.eos_id)
        if max_length >= 0:
            ids = ids[:max_length]
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """Text of `ids`; special tokens (bos, eos, pad, ...) are left out, as sentencepiece always does."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        if self.backend == "huggingface":
            return self.processor.decode(ids, skip_special_tokens=True)
        return self.processor.decode(ids)

    @cached_property
    def fingerprint(self) -> str:
        """Short stable hash of everything that decides the ids: the tokenizer file's bytes and the
        special-token settings read from the JSON configs. Data caches key on it, so unrelated edits
        to those configs (say model_max_length) don't invalidate them."""
        h = hashlib.sha256()
        h.update(self.model_path.read_bytes())
        settings = [self.backend, self.bos_id, self.eos_id, self.add_bos, self.add_eos, self.stop_ids]
        h.update(json.dumps([*settings, self.chat_template]).encode())
        return h.hexdigest()[:16]
