"""From raw records to tokenized training samples, and the prepared folders that cache them.

A prepared folder holds `train.pt` and `val.pt` (lists of {"input_ids", "labels"} LongTensors) and
`prepare_config.json` (how they were made). The config is written last, so a folder without it is an unfinished
write and is never trusted. A raw data folder passed to finetune is prepared once into a cache subfolder, reused
while the cache key (`DataSettings`, the tokenizer's fingerprint and the source files' hashes) matches.

Records are instructions (instruction / input / output, rendered with a prompt template) or conversations
(`messages` of role/content, or ShareGPT `conversations` of from/value), rendered with the model's own chat
template (template `chat`) exactly as transformers' apply_chat_template does, with the loss on the assistant turns.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor

from lit_qlora.data import chat_template as ct
from lit_qlora.data.records import (
    Conversation,
    check_record,
    check_records,
    is_conversation_record,
    normalize_conversation,
    split,
    text_of,
    with_messages_column,
)
from lit_qlora.data.sources import Source, mix, read_mixture, resolve
from lit_qlora.data.templates import AUTO, CHAT, TEMPLATE_NAMES, check_template_name, get_template
from lit_qlora.readers import check_fields, load_torch, read_json
from lit_qlora.tokenizer import Tokenizer
from lit_qlora.utils import UserError, atomic_torch_save, atomic_write

FORMAT_VERSION = 1
CONFIG_NAME = "prepare_config.json"


class TokenizerLike(Protocol):
    """What preparing needs of a tokenizer (lit_qlora.tokenizer.Tokenizer; tests use stand-ins)."""

    bos_id: int | None
    eos_id: int | None
    fingerprint: str

    def encode(self, text: str, bos: bool | None = None, eos: bool = False, max_length: int = -1) -> Tensor: ...


@dataclass(frozen=True)
class DataSettings:
    """How records become samples. Every field changes the prepared tensors: with the tokenizer's fingerprint and the
    source files they are the cache key of a prepared folder."""

    max_seq_length: int
    template: str = AUTO  # alpaca, plain, chat, or auto (resolved by `resolve_template` before it keys a cache)
    mask_inputs: bool = True
    ignore_index: int = -100
    test_split_fraction: float = 0.05  # only when no separate validation file is given
    seed: int = 42  # of the split
    instruction_key: str = "instruction"
    input_key: str = "input"
    output_key: str = "output"
    messages_column: Optional[str] = None  # the column of conversation turns; None: "messages" / "conversations"

    def cache_key(self, tokenizer: TokenizerLike, sources: list[Path], has_val_file: bool) -> dict:
        """Everything that decides the prepared tensors (the keys of prepare_config.json). The template is keyed as
        asked (`template_flag`: auto is resolved from the data, which the source hashes key), so a cache is found
        without reading the data; the prepared folder's `template` is the resolved one."""
        key = asdict(self)
        key["template_flag"] = key.pop("template")
        if has_val_file:  # no split: the split settings do not matter
            key.update(test_split_fraction=None, seed=None)
        key["tokenizer_fingerprint"] = tokenizer.fingerprint
        key["source_files"] = [str(Path(s).resolve()) for s in sources]
        key["source_sha256"] = [_sha256(Path(s)) for s in sources]
        return key


# ---- tokenizing --------------------------------------------------------------------------------------
def resolve_template(name: str | None, holds_conversations: bool, tokenizer: TokenizerLike,
                     source: object = "the data") -> str:
    """The template records are prepared with: `name` when given (alpaca, plain, chat); for auto (or None) chat
    when the data holds conversations, alpaca otherwise. Conversations need chat, and chat needs a tokenizer with a
    chat template: anything else is a one-line UserError."""
    name = check_template_name(name, allow_auto=True)
    if name in (None, AUTO):
        name = CHAT if holds_conversations else "alpaca"
    if holds_conversations and name != CHAT:
        raise UserError(f"{source} holds conversations (\"messages\" / \"conversations\" rows), which the {name} "
                        "prompt template cannot render; use --template chat (the model's own chat template) or "
                        "leave --template out")
    if name == CHAT and not getattr(tokenizer, "chat_template", None):
        what = "holds conversations" if holds_conversations else "is to be rendered with --template chat"
        raise UserError(f"{source} {what}, but the tokenizer in {getattr(tokenizer, 'checkpoint_dir', '?')} has no "
                        "chat template (no chat_template.jinja, no chat_template in tokenizer_config.json); use an "
                        "instruct/chat model's folder, or instruction records with --template alpaca")
    return name


def read_rows(source: Source, s: DataSettings) -> list[tuple[Path, int, Any]]:
    """(file, row, record) of every record of a source, read once (the conversation column renamed to "messages"
    when --messages_column names it); an empty source is a one-line UserError."""
    rows = [(f, row, with_messages_column(rec, s.messages_column, f"row {row} of {f}")) for f, row, rec in
            source.rows()]
    if not rows:
        raise UserError(f"{source} holds no records; add some or pick another source")
    return rows


def holds_conversations(rows: list[tuple[Path, int, Any]]) -> bool:
    """Whether rows are conversation records, judged by the first."""
    return bool(rows) and is_conversation_record(rows[0][2])


def checked_records(rows: list[tuple[Path, int, Any]], s: DataSettings) -> list:
    """Every record checked before anything is tokenized (a bad row is a one-line UserError naming its file and row).
    With the chat template conversation rows become `Conversation`s; instruction records stay dicts."""
    if s.template == CHAT and holds_conversations(rows):
        return [Conversation(normalize_conversation(rec, row, f), f"row {row} of {f}") for f, row, rec in rows]
    flags = {s.instruction_key: "--prompt_column", s.output_key: "--response_column"}
    for f, row, rec in rows:
        check_record(rec, (s.instruction_key, s.output_key), f"row {row} of {f}", flags, optional=(s.input_key,))
    return [rec for _, _, rec in rows]


def prepare_samples(records: list[dict], tokenizer: TokenizerLike, s: DataSettings,
                    allow_empty: bool = False) -> tuple[list[dict], int]:
    """Tokenize records into {"input_ids", "labels"}; returns (samples, number truncated).

    With mask_inputs, samples whose response was truncated away entirely are left out (counted as truncated), so
    len(samples) can be less than len(records); none left is a UserError unless `allow_empty` (a record at a time,
    as `streaming` tokenizes).

    Prompt templates: input_ids = tokenize(prompt + output) with eos. The prompt is tokenized on its own only to know
    how many leading tokens to mask: tokenizing the joined text keeps the merges the model will see. The chat
    template: see `chat_samples`.
    """
    if s.max_seq_length < 1:
        raise UserError(f"max_seq_length must be at least 1, got {s.max_seq_length}; pass a positive number")
    conversations = bool(records) and (isinstance(records[0], Conversation) or is_conversation_record(records[0]))
    s = replace(s, template=resolve_template(s.template, conversations, tokenizer))
    if s.template == CHAT:
        return chat_samples(records, tokenizer, s, allow_empty)
    tmpl = get_template(s.template)
    check_records(records, (s.instruction_key, s.output_key), optional=(s.input_key,))
    if tokenizer.eos_id is None:
        raise UserError("the tokenizer has no eos token, so the model could not learn where a response ends; "
                        "set eos_token in the checkpoint's tokenizer_config.json")
    samples, n_truncated = [], 0
    for rec in records:
        prompt = tmpl.format(text_of(rec[s.instruction_key]), text_of(rec.get(s.input_key)))
        prompt_ids = tokenizer.encode(prompt)
        input_ids = tokenizer.encode(prompt + text_of(rec[s.output_key]), eos=True).long()
        if len(input_ids) > s.max_seq_length:
            input_ids = input_ids[:s.max_seq_length]
            n_truncated += 1
        labels = input_ids.clone()
        if s.mask_inputs:
            labels[:len(prompt_ids)] = s.ignore_index
            if len(prompt_ids) >= len(input_ids):
                # Truncation cut the whole response: nothing to learn, and a batch of only such samples would make
                # the loss NaN. Dropped; the caller's warning counts them.
                continue
        samples.append({"input_ids": input_ids, "labels": labels})
    if not samples and not allow_empty:
        raise UserError(f"max_seq_length={s.max_seq_length} leaves no response tokens in any of the {len(records)} "
                        "samples; raise --max_seq_length")
    return samples, n_truncated


def chat_samples(records: list[dict], tokenizer: TokenizerLike, s: DataSettings,
                 allow_empty: bool = False) -> tuple[list[dict], int]:
    """Conversations (or instruction records, as one user turn and the reply) rendered with the tokenizer's chat
    template: input_ids are transformers' apply_chat_template(tokenize=True) ids (bos only where the template writes
    it, no eos added: the template ends each turn with its own end-of-turn token); labels keep the assistant turns,
    each through its end-of-turn token (`chat_template.assistant_mask`), or every token without mask_inputs.
    Samples longer than max_seq_length are truncated; with mask_inputs those left with no assistant token are
    dropped (counted as truncated). A conversation the template refuses is a one-line UserError naming its row."""
    samples, n_truncated = [], 0
    for i, rec in enumerate(records, start=1):
        source = f"row {i} of the data"
        if isinstance(rec, Conversation):  # checked when its file was read
            messages, source = rec.messages, rec.source
        elif is_conversation_record(rec) or not isinstance(rec, dict):
            messages = normalize_conversation(rec, i, "the data")
        else:
            check_records([rec], (s.instruction_key, s.output_key), "the data", optional=(s.input_key,))
            messages = ct.instruction_messages(text_of(rec[s.instruction_key]), text_of(rec.get(s.input_key)),
                                               text_of(rec[s.output_key]))
        try:
            ids, labels = ct.assistant_mask(tokenizer, None, messages, s.mask_inputs, s.ignore_index)
        except UserError as e:
            raise UserError(f"{source}: {e}") from None
        if len(ids) > s.max_seq_length:
            ids, labels = ids[:s.max_seq_length], labels[:s.max_seq_length]
            n_truncated += 1
            if s.mask_inputs and all(t == s.ignore_index for t in labels):
                continue  # no assistant token left to learn from (see prepare_samples)
        samples.append({"input_ids": torch.tensor(ids, dtype=torch.long),
                        "labels": torch.tensor(labels, dtype=torch.long)})
    if not samples and not allow_empty:
        raise UserError(f"max_seq_length={s.max_seq_length} leaves no assistant tokens in any of the {len(records)} "
                        "conversations; raise --max_seq_length")
    return samples, n_truncated


# ---- prepared folders --------------------------------------------------------------------------------
def save_prepared(dest: Path | str, train: list, val: list, meta: dict) -> dict:
    """Writes train.pt, val.pt and the config (last: a folder without it reads as unfinished); returns the config."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    # Drop the old config first: if we die between files, the folder reads as unfinished instead of pairing the old
    # config with a new train.pt.
    (dest / CONFIG_NAME).unlink(missing_ok=True)
    atomic_torch_save(train, dest / "train.pt")
    atomic_torch_save(val, dest / "val.pt")
    meta = {**meta, "format_version": FORMAT_VERSION, "n_train": len(train), "n_val": len(val)}
    atomic_write(dest / CONFIG_NAME, lambda p: p.write_text(json.dumps(meta, indent=2) + "\n"))
    return meta


def read_prepared_meta(dest: Path | str) -> dict | None:
    """The prepare config of a finished prepared folder, or None if the folder isn't one."""
    dest = Path(dest)
    cfg = dest / CONFIG_NAME
    if not (cfg.is_file() and (dest / "train.pt").is_file() and (dest / "val.pt").is_file()):
        return None
    fix = f"it is corrupt: delete {dest} and prepare the data again"
    meta = check_fields(read_json(cfg, dict, fix=fix), cfg, PREPARED_FIELDS, fix=fix)
    # the adapter records it: generation renders with it (preparing always writes one; a file written by hand may
    # leave it out, never null it)
    if meta.get("template") not in (None, *TEMPLATE_NAMES) or "template" in meta and meta["template"] is None:
        raise UserError(f"{cfg}: template is {meta['template']!r}, expected one of {', '.join(TEMPLATE_NAMES)}; {fix}")
    return meta


# the fields of prepare_config.json that are read back (the rest is the cache key, compared as written)
PREPARED_FIELDS = {"template": "str", "tokenizer_fingerprint": "str", "max_seq_length": "size", "n_train": "count",
                   "n_val": "count", "format_version": "int"}


def load_prepared(dest: Path | str, vocab_size: Optional[int] = None) -> tuple[list, list, dict]:
    """(train, val, meta) of a prepared folder, every sample checked (`check_samples`; token ids below `vocab_size`
    when given) and the counts against its config: a file of another preparation, or one whose tensors lie, is a
    one-line UserError naming it, never a training step that fails on it."""
    dest = Path(dest)
    meta = read_prepared_meta(dest)
    if meta is None:
        raise UserError(f"{dest} does not hold prepared data (train.pt, val.pt and {CONFIG_NAME}); run "
                        "scripts/prepare_alpaca.py or scripts/prepare_json.py with --destination_path there")
    # weights_only: these files are plain lists/dicts of tensors, never arbitrary pickles.
    fix = f"delete {dest} and prepare the data again"
    train, val = (load_torch(dest / name, "prepared data", fix) for name in ("train.pt", "val.pt"))
    for name, samples in (("train.pt", train), ("val.pt", val)):
        if not (isinstance(samples, list) and all(isinstance(x, dict) for x in samples)):
            raise UserError(f"prepared data {dest / name} holds no list of samples; {fix}")
        check_samples(samples, f"prepared data {dest / name}", vocab_size, fix)
        counted = meta.get("n_train" if name == "train.pt" else "n_val")
        if counted is not None and counted != len(samples):
            raise UserError(f"prepared data {dest / name} holds {len(samples)} samples, its {CONFIG_NAME} says "
                            f"{counted!r} (files of two preparations); {fix}")
    return train, val, meta


def check_samples(samples: list, where: str, vocab_size: Optional[int], fix: str) -> None:
    """Every sample {input_ids, labels}: 1-D integer tensors of the same length (at least 1), ids from 0 (below
    `vocab_size` when given), labels an id or an ignore index (negative). Else a UserError naming the sample."""
    for i, x in enumerate(samples):
        ids, labels = x.get("input_ids"), x.get("labels")
        bad = None
        if not all(isinstance(t, torch.Tensor) for t in (ids, labels)):
            bad = "no input_ids and labels tensors"
        elif ids.dtype not in (torch.int64, torch.int32) or labels.dtype not in (torch.int64, torch.int32):
            bad = f"{ids.dtype} / {labels.dtype} tensors, not token ids"
        elif ids.ndim != 1 or labels.shape != ids.shape or ids.numel() == 0:
            bad = f"input_ids of shape {tuple(ids.shape)} and labels of {tuple(labels.shape)}"
        elif int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size):
            bad = f"token ids from {int(ids.min())} to {int(ids.max())}" + (
                f", outside the tokenizer's {vocab_size}" if vocab_size is not None else "")
        elif vocab_size is not None and int(labels.max()) >= vocab_size:
            bad = f"a label {int(labels.max())} outside the tokenizer's {vocab_size} ids"
        if bad:
            raise UserError(f"{where}: sample {i} has {bad}; {fix}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _warn_truncated(n_truncated: int, n_records: int, n_kept: int, max_seq_length: int) -> None:
    if n_truncated:
        dropped = f" ({n_records - n_kept} left out: no response tokens remained)" if n_kept < n_records else ""
        print(f"warning: {n_truncated} of {n_records} samples were longer than max_seq_length={max_seq_length} and "
              f"were truncated{dropped}; raise --max_seq_length to keep them whole", file=sys.stderr)


def prepare_files(train: Path | Source, val: Optional[Path | Source], tokenizer: TokenizerLike,
                  destination_path: Path, s: DataSettings) -> tuple[list, list, dict]:
    """Load, split (when no `val`), tokenize and save. Each source is read once, and every record of both is checked
    before anything is tokenized. Returns (train, val, meta) as saved, so that no caller reads them back: several
    processes preparing the same cache at once (the ranks of a multi-machine run on a shared disk) each rewrite it, and
    a read between another's first and last file finds it unfinished."""
    train, val = (Source((Path(x),)) if isinstance(x, (str, Path)) else x for x in (train, val))
    train_rows = read_rows(train, s)
    resolved = replace(s, template=resolve_template(s.template, holds_conversations(train_rows), tokenizer, train))
    train_recs = checked_records(train_rows, resolved)
    del train_rows
    if val is None:
        train_recs, val_recs = split(train_recs, s.test_split_fraction, s.seed)
    else:
        val_recs = checked_records(read_rows(val, resolved), resolved)
    train_samples, n_tr = prepare_samples(train_recs, tokenizer, resolved)
    val_samples, n_va = prepare_samples(val_recs, tokenizer, resolved)
    _warn_truncated(n_tr + n_va, len(train_recs) + len(val_recs), len(train_samples) + len(val_samples),
                    s.max_seq_length)
    files = [f for src in (train, val) if src is not None for f in src.key_files()]
    meta = {**s.cache_key(tokenizer, files, val is not None), "template": resolved.template,
            "n_truncated": n_tr + n_va}
    return train_samples, val_samples, save_prepared(destination_path, train_samples, val_samples, meta)


def ensure_prepared(data_dir: Path | str, tokenizer: TokenizerLike, s: DataSettings) -> tuple[list, list, dict]:
    """What finetuning calls with --data_dir: returns (train, val, meta).

    Uses the prepared files in data_dir when made for this tokenizer with samples that fit max_seq_length; otherwise
    prepares the records of what data_dir names (a data file, a folder of them, a datasets folder, a dataset in the
    local Hugging Face cache: `sources.resolve`) into a cache subfolder and reuses it.
    """
    data_dir = Path(data_dir)
    meta = read_prepared_meta(data_dir) if data_dir.is_dir() else None
    fp = tokenizer.fingerprint
    # Samples prepared with a smaller max_seq_length still fit, so they are fine to use as is.
    if (meta is not None and meta.get("tokenizer_fingerprint") == fp
            and meta.get("max_seq_length", 1 << 62) <= s.max_seq_length):
        return load_prepared(data_dir, getattr(tokenizer, "vocab_size", None))

    raw = resolve(data_dir)
    if raw is None:
        if meta is not None:
            raise UserError(f"{data_dir} was prepared for tokenizer {meta.get('tokenizer_fingerprint')} with "
                            f"max_seq_length={meta.get('max_seq_length')}, but this run uses tokenizer {fp} with "
                            f"max_seq_length={s.max_seq_length}; re-run scripts/prepare_alpaca.py (or "
                            "prepare_json.py) with this --checkpoint_dir and --max_seq_length")
        raise UserError(f"{data_dir} holds no data (no prepared train.pt/val.pt/{CONFIG_NAME}, no "
                        ".json/.jsonl/.csv/.parquet file, no datasets folder); put data there or run "
                        "scripts/prepare_alpaca.py with --destination_path pointing at it")

    train_src, val_src = raw
    files = [f for src in raw if src is not None for f in src.key_files()]
    home = data_dir if data_dir.is_dir() else data_dir.parent if data_dir.is_file() else Path(os.path.commonpath(files))
    home = home if home.is_dir() else home.parent
    cache = home / (f".prepared-{fp}-{s.max_seq_length}" if data_dir.is_dir() or not data_dir.is_file()
                    else f".prepared-{data_dir.name}-{fp}-{s.max_seq_length}")
    key = s.cache_key(tokenizer, files, val_src is not None)
    cached = read_prepared_meta(cache)
    if cached is not None and all(cached.get(k) == v for k, v in key.items()):
        print(f"Using data prepared earlier in {cache}", file=sys.stderr)
        return load_prepared(cache, getattr(tokenizer, "vocab_size", None))

    names = train_src.short_name() + (f" + {val_src.short_name()}" if val_src else "")
    try:
        train, val, prepared = prepare_files(train_src, val_src, tokenizer, cache, s)
    except PermissionError:  # e.g. a shared, read-only dataset folder
        raise UserError(f"cannot write the prepared cache into {home}; prepare the data with "
                        "scripts/prepare_json.py --destination_path <a writable folder> and pass that folder as "
                        "--data_dir") from None
    # Said after the fact, so a file with a bad record fails with its one-line error alone
    print(f"Preparing {names} from {data_dir}: {prepared['n_train']} train and {prepared['n_val']} validation samples "
          f"(cached in {cache} for later runs)", file=sys.stderr)
    return train, val, prepared


def ensure_mixture(sources_file: Path | str, tokenizer: TokenizerLike, s: DataSettings, seed: int,
                   load: Callable = ensure_prepared) -> tuple[list, list, dict]:
    """What finetuning calls with --data_sources: every entry prepared (and cached) as --data_dir would prepare it
    (`load`, the same (path, tokenizer, settings) -> (train, val, meta) as for --data_dir: preference pairs give
    lit_qlora.train.preference.load_pairs), the training samples mixed by weight or epochs (`sources.mix`,
    deterministic in `seed`), the validation samples of every source together. The meta is the first source's with
    the realized `mixture`."""
    entries = read_mixture(sources_file)
    parts = [load(e.path, tokenizer, s) for e in entries]
    templates = {m.get("template") for _, _, m in parts}
    if len(templates) > 1:
        named = ", ".join(f"{e.path}: {m.get('template')}" for e, (_, _, m) in zip(entries, parts))
        raise UserError(f"the --data_sources are rendered with different templates ({named}); one adapter learns "
                        "one format: pass --template chat (conversations and instruction records alike)")
    train, realized = mix([p[0] for p in parts], entries, seed)
    val = [x for _, v, _ in parts for x in v]
    meta = {**parts[0][2], "n_train": len(train), "n_val": len(val), "data_sources": str(sources_file),
            "mixture": realized}
    print("Mixture of " + ", ".join(f"{r['path']}: {r['used']} of {r['available']} ({100 * r['share']:.1f}%)"
                                    for r in realized), file=sys.stderr)
    return train, val, meta


def prepare_dataset(data_file: Path, checkpoint_dir: Path, destination_path: Path, s: DataSettings) -> dict:
    """The body of scripts/prepare_*.py: the tokenizer from checkpoint_dir, then prepare_files.
    `s.max_seq_length` 0 means the model's context length."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise UserError(f"checkpoint folder {checkpoint_dir} does not exist; pass the --checkpoint_dir of a downloaded "
                        "model")
    tokenizer = Tokenizer(checkpoint_dir)
    s = replace(s, max_seq_length=s.max_seq_length or default_max_seq_length(checkpoint_dir))
    _, _, meta = prepare_files(Path(data_file), None, tokenizer, Path(destination_path), s)
    print(f"Saved {meta['n_train']} train and {meta['n_val']} validation samples to {destination_path} "
          f"(template={meta['template']}, max_seq_length={s.max_seq_length})")
    return meta


def default_max_seq_length(checkpoint_dir: Path | str) -> int:
    """The model's context length: block_size from our model_config.json, else Hugging Face config.json
    max_position_embeddings, else 2048."""
    checkpoint_dir = Path(checkpoint_dir)
    for name, key in (("model_config.json", "block_size"), ("config.json", "max_position_embeddings")):
        f = checkpoint_dir / name
        if f.is_file():
            try:
                value = read_json(f, dict).get(key)
            except UserError:  # a damaged file is refused where it is read in full; here only a default is sought
                value = None
            if isinstance(value, int) and value > 0:
                return value
    return 2048
