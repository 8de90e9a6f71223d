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
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional, Protocol

import torch
from torch import Tensor

from lit_qlora import chat_template as ct
from lit_qlora.readers import load_torch, read_json
from lit_qlora.records import RAW_SUFFIXES, check_records, load_records, split, text_of
from lit_qlora.templates import AUTO, CHAT, check_template_name, get_template
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

    def cache_key(self, tokenizer: TokenizerLike, sources: list[Path], has_val_file: bool) -> dict:
        """Everything that decides the prepared tensors (the keys of prepare_config.json)."""
        key = asdict(self)
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


def file_holds_conversations(path: Path) -> bool:
    """Whether a raw data file holds conversation records, judged by its first record (a .csv never does)."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        return False
    # Only the first record is parsed (the file is read in full later, with its one-line errors); a file that does
    # not parse here is read in full now, so its error comes out the same.
    try:
        text = path.read_text(encoding="utf-8-sig").lstrip()
        start = 1 if text.startswith("[") else 0
        while start < len(text) and text[start].isspace():
            start += 1
        return ct.is_conversation_record(json.JSONDecoder().raw_decode(text, start)[0])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return ct.is_conversation_record(load_records(path, required=())[0])


@dataclass(frozen=True)
class Conversation:
    """A checked conversation record: role/content messages and where they came from (named in errors)."""

    messages: list
    source: str


def load_file_records(path: Path, s: DataSettings) -> list:
    """Every record of a raw data file, checked before anything is tokenized (a bad row is a one-line UserError
    naming it). With the chat template a conversation file's rows become `Conversation`s; instruction records stay
    dicts."""
    if s.template == CHAT and file_holds_conversations(path):
        return [Conversation(messages, f"row {row} of {path}") for row, messages in ct.load_conversation_rows(path)]
    return load_records(path, (s.instruction_key, s.output_key))


def prepare_samples(records: list[dict], tokenizer: TokenizerLike, s: DataSettings) -> tuple[list[dict], int]:
    """Tokenize records into {"input_ids", "labels"}; returns (samples, number truncated).

    With mask_inputs, samples whose response was truncated away entirely are left out (counted as truncated), so
    len(samples) can be less than len(records).

    Prompt templates: input_ids = tokenize(prompt + output) with eos. The prompt is tokenized on its own only to know
    how many leading tokens to mask: tokenizing the joined text keeps the merges the model will see. The chat
    template: see `chat_samples`.
    """
    if s.max_seq_length < 1:
        raise UserError(f"max_seq_length must be at least 1, got {s.max_seq_length}; pass a positive number")
    holds_conversations = bool(records) and (isinstance(records[0], Conversation)
                                             or ct.is_conversation_record(records[0]))
    s = replace(s, template=resolve_template(s.template, holds_conversations, tokenizer))
    if s.template == CHAT:
        return chat_samples(records, tokenizer, s)
    tmpl = get_template(s.template)
    check_records(records, (s.instruction_key, s.output_key))
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
    if not samples:
        raise UserError(f"max_seq_length={s.max_seq_length} leaves no response tokens in any of the {len(records)} "
                        "samples; raise --max_seq_length")
    return samples, n_truncated


def chat_samples(records: list[dict], tokenizer: TokenizerLike, s: DataSettings) -> tuple[list[dict], int]:
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
        elif ct.is_conversation_record(rec) or not isinstance(rec, dict):
            messages = ct.normalize_conversation(rec, i, "the data")
        else:
            check_records([rec], (s.instruction_key, s.output_key), "the data")
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
    if not samples:
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
    return read_json(cfg, dict, fix=f"it is corrupt: delete {dest} and prepare the data again")


def load_prepared(dest: Path | str) -> tuple[list, list, dict]:
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
    return train, val, meta


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


def prepare_files(train_file: Path, val_file: Optional[Path], tokenizer: TokenizerLike, destination_path: Path,
                  s: DataSettings) -> tuple[list, list, dict]:
    """Load, split (when no val_file), tokenize and save. Every record of both files is checked before anything is
    tokenized. Returns (train, val, meta) as saved, so that no caller reads them back: several processes preparing
    the same cache at once (the ranks of a multi-machine run on a shared disk) each rewrite it, and a read between
    another's first and last file finds it unfinished."""
    s = replace(s, template=resolve_template(s.template, file_holds_conversations(train_file), tokenizer, train_file))
    train_recs = load_file_records(train_file, s)
    if val_file is None:
        train_recs, val_recs = split(train_recs, s.test_split_fraction, s.seed)
    else:
        val_recs = load_file_records(val_file, s)
    train, n_tr = prepare_samples(train_recs, tokenizer, s)
    val, n_va = prepare_samples(val_recs, tokenizer, s)
    _warn_truncated(n_tr + n_va, len(train_recs) + len(val_recs), len(train) + len(val), s.max_seq_length)
    sources = [f for f in (train_file, val_file) if f is not None]
    meta = {**s.cache_key(tokenizer, sources, val_file is not None), "n_truncated": n_tr + n_va}
    return train, val, save_prepared(destination_path, train, val, meta)


def find_raw_files(data_dir: Path) -> tuple[Path, Path | None] | None:
    """(train, val) raw files in data_dir: train.* + val.*, else one lone data file to split."""
    def first(stem: str) -> Path | None:
        return next((data_dir / f"{stem}{s}" for s in RAW_SUFFIXES if (data_dir / f"{stem}{s}").is_file()), None)

    train, val = first("train"), first("val")
    if train and val:
        return train, val
    files = sorted(p for p in data_dir.iterdir() if p.is_file() and p.suffix.lower() in RAW_SUFFIXES
                   and p.name != CONFIG_NAME and not p.name.startswith("."))
    if len(files) == 1:
        return files[0], None
    if len(files) > 1:
        raise UserError(f"{data_dir} holds several data files ({', '.join(p.name for p in files)}) and no train/val "
                        "pair; keep one file there, or name them train.json and val.json")
    return None


def ensure_prepared(data_dir: Path | str, tokenizer: TokenizerLike, s: DataSettings) -> tuple[list, list, dict]:
    """What finetuning calls with --data_dir: returns (train, val, meta).

    Uses the prepared files in data_dir when made for this tokenizer with samples that fit max_seq_length; otherwise
    prepares raw files found there into a cache subfolder and reuses it.
    """
    data_dir = Path(data_dir)
    if not data_dir.exists():
        raise UserError(f"data folder {data_dir} does not exist; check --data_dir or prepare data there first")
    if not data_dir.is_dir():
        raise UserError(f"--data_dir {data_dir} is a file, not a folder; pass the folder that holds it")

    meta = read_prepared_meta(data_dir)
    fp = tokenizer.fingerprint
    # Samples prepared with a smaller max_seq_length still fit, so they are fine to use as is.
    if (meta is not None and meta.get("tokenizer_fingerprint") == fp
            and meta.get("max_seq_length", 1 << 62) <= s.max_seq_length):
        return load_prepared(data_dir)

    raw = find_raw_files(data_dir)
    if raw is None:
        if meta is not None:
            raise UserError(f"{data_dir} was prepared for tokenizer {meta.get('tokenizer_fingerprint')} with "
                            f"max_seq_length={meta.get('max_seq_length')}, but this run uses tokenizer {fp} with "
                            f"max_seq_length={s.max_seq_length}; re-run scripts/prepare_alpaca.py (or "
                            "prepare_json.py) with this --checkpoint_dir and --max_seq_length")
        raise UserError(f"{data_dir} holds no data (no prepared train.pt/val.pt/{CONFIG_NAME}, no .json/.jsonl/.csv "
                        "file); put a data file there or run scripts/prepare_alpaca.py with --destination_path "
                        "pointing at it")

    train_file, val_file = raw
    cache = data_dir / f".prepared-{fp}-{s.max_seq_length}"
    s = replace(s, template=resolve_template(s.template, file_holds_conversations(train_file), tokenizer, train_file))
    key = s.cache_key(tokenizer, [f for f in raw if f], val_file is not None)
    cached = read_prepared_meta(cache)
    if cached is not None and all(cached.get(k) == v for k, v in key.items()):
        print(f"Using data prepared earlier in {cache}", file=sys.stderr)
        return load_prepared(cache)

    names = train_file.name + (f" + {val_file.name}" if val_file else "")
    try:
        train, val, prepared = prepare_files(train_file, val_file, tokenizer, cache, s)
    except PermissionError:  # e.g. a shared, read-only dataset folder
        raise UserError(f"cannot write the prepared cache into {data_dir}; prepare the data with "
                        "scripts/prepare_json.py --destination_path <a writable folder> and pass that folder as "
                        "--data_dir") from None
    # Said after the fact, so a file with a bad record fails with its one-line error alone
    print(f"Preparing {names} from {data_dir}: {prepared['n_train']} train and {prepared['n_val']} validation samples "
          f"(cached in {cache} for later runs)", file=sys.stderr)
    return train, val, prepared


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
