"""Instruction-tuning data: prompt templates, loading JSON/JSONL/CSV, tokenizing with prompt masking,
saving/loading prepared splits, and reproducible, resumable batching.

A prepared folder holds `train.pt` and `val.pt` (lists of {"input_ids", "labels"} LongTensors) and
`prepare_config.json` (how they were made). The config is written last, so a folder without it is
an unfinished write and is never trusted.
"""
from __future__ import annotations

import csv
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lit_qlora.utils import UserError, atomic_torch_save, atomic_write

FORMAT_VERSION = 1
RAW_SUFFIXES = (".json", ".jsonl", ".csv")
CONFIG_NAME = "prepare_config.json"


class TokenizerLike(Protocol):
    bos_id: int | None
    eos_id: int | None
    fingerprint: str

    def encode(self, text: str, bos: bool | None = None, eos: bool = False, max_length: int = -1) -> Tensor: ...


# ----------------------------------------------------------------------------------------------
# Prompt templates


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    with_input: str  # uses {instruction} and {input}
    without_input: str  # uses {instruction}; chosen when the input is empty

    def format(self, instruction: str, input: str = "") -> str:
        if input.strip():
            return self.with_input.format(instruction=instruction, input=input)
        return self.without_input.format(instruction=instruction)


TEMPLATES: dict[str, PromptTemplate] = {
    t.name: t
    for t in (
        PromptTemplate(
            name="alpaca",
            with_input=(
                "Below is an instruction that describes a task, paired with an input that provides "
                "further context. Write a response that appropriately completes the request.\n\n"
                "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
            ),
            without_input=(
                "Below is an instruction that describes a task. "
                "Write a response that appropriately completes the request.\n\n"
                "### Instruction:\n{instruction}\n\n### Response:\n"
            ),
        ),
        PromptTemplate(name="plain", with_input="{instruction}\n{input}\n", without_input="{instruction}\n"),
    )
}


def get_template(name: str | PromptTemplate) -> PromptTemplate:
    if isinstance(name, PromptTemplate):
        return name
    if name not in TEMPLATES:
        raise UserError(f"unknown prompt template {name!r}; use one of: {', '.join(TEMPLATES)}")
    return TEMPLATES[name]


# ----------------------------------------------------------------------------------------------
# Loading raw records


def load_records(path: Path | str, required: tuple[str, ...] = ("instruction", "output")) -> list[dict]:
    """Read a .json (list of objects), .jsonl (one object per line) or .csv (with header) file.

    Every record must have the `required` fields; anything wrong is a one-line UserError.
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"data file {path} does not exist; check the path")
    if path.is_dir():
        raise UserError(f"data file {path} is a folder; pass a .json, .jsonl or .csv file")
    suffix = path.suffix.lower()
    if suffix not in RAW_SUFFIXES:
        raise UserError(f"unsupported data file type {path.name!r}; use a .json, .jsonl or .csv file")
    text = path.read_text(encoding="utf-8-sig")  # -sig: tolerate the BOM some editors/Excel write
    if not text.strip():
        raise UserError(f"data file {path} is empty; fill it with records or pick another file")

    if suffix == ".csv":
        records: list = list(csv.DictReader(text.splitlines()))
    elif suffix == ".jsonl":
        records = _parse_jsonl(text, path)
    else:
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            # A common mix-up: JSON Lines saved as .json. Accept it rather than fail.
            if e.msg == "Extra data" and text.lstrip().startswith("{"):
                records = _parse_jsonl(text, path)
            else:
                raise UserError(
                    f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                    "fix the file, it must hold a list of objects"
                ) from None
        if not isinstance(records, list):
            kind = f"an object with keys {list(records)[:5]}" if isinstance(records, dict) else type(records).__name__
            raise UserError(f"{path} holds {kind}, not a list of records; make the top level a JSON list of objects")
    if not records:
        raise UserError(f"data file {path} holds no records; add some or pick another file")
    check_records(records, required, path)
    return records


def _parse_jsonl(text: str, path: Path) -> list:
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise UserError(
                f"line {lineno} of {path} is not valid JSON ({e.msg} at column {e.colno}); "
                "fix that line, each line must be one JSON object"
            ) from None
    return records


def check_records(records: list, required: tuple[str, ...], source: Path | str = "the data") -> None:
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise UserError(f"record {i} in {source} is a {type(rec).__name__}, not an object; make every record an object")
        for key in required:
            if rec.get(key) is None:
                raise UserError(
                    f"record {i} in {source} has no {key!r} field (it has: {', '.join(map(str, rec)) or 'nothing'}); "
                    f"add it, or name the right field with --{_key_flag(key)}"
                )


def _key_flag(key: str) -> str:
    return {"instruction": "instruction_key", "input": "input_key", "output": "output_key"}.get(key, "*_key")


def _text(value: Any) -> str:
    # CSV gives strings already; JSON may hold numbers ("12 + 7" -> 19), which are fine as text.
    return "" if value is None else str(value)


# ----------------------------------------------------------------------------------------------
# Tokenizing


def prepare_samples(
    records: list[dict],
    tokenizer: TokenizerLike,
    template: str | PromptTemplate,
    max_seq_length: int,
    mask_inputs: bool = True,
    ignore_index: int = -100,
    instruction_key: str = "instruction",
    input_key: str = "input",
    output_key: str = "output",
) -> tuple[list[dict[str, Tensor]], int]:
    """Tokenize records into {"input_ids", "labels"}; returns (samples, number truncated).

    With mask_inputs, samples whose response was truncated away entirely are left out (counted as
    truncated), so len(samples) can be less than len(records).

    input_ids = tokenize(prompt + output) with eos. The prompt is tokenized on its own only to know
    how many leading tokens to mask: tokenizing the joined text keeps the merges the model will see.
    """
    if max_seq_length < 1:
        raise UserError(f"max_seq_length must be at least 1, got {max_seq_length}; pass a positive number")
    tmpl = get_template(template)
    check_records(records, (instruction_key, output_key))
    if tokenizer.eos_id is None:
        raise UserError("the tokenizer has no eos token, so the model could not learn where a response ends; "
                        "set eos_token in the checkpoint's tokenizer_config.json")
    samples, n_truncated = [], 0
    for rec in records:
        prompt = tmpl.format(_text(rec[instruction_key]), _text(rec.get(input_key)))
        prompt_ids = tokenizer.encode(prompt)
        input_ids = tokenizer.encode(prompt + _text(rec[output_key]), eos=True).long()
        if len(input_ids) > max_seq_length:
            input_ids = input_ids[:max_seq_length]
            n_truncated += 1
        labels = input_ids.clone()
        if mask_inputs:
            labels[: len(prompt_ids)] = ignore_index
            if len(prompt_ids) >= len(input_ids):
                # Truncation cut the whole response: nothing to learn, and a batch of only such
                # samples would make the loss NaN. Dropped; the caller's warning counts them.
                continue
        samples.append({"input_ids": input_ids, "labels": labels})
    if not samples:
        raise UserError(
            f"max_seq_length={max_seq_length} leaves no response tokens in any of the {len(records)} samples; "
            "raise --max_seq_length"
        )
    return samples, n_truncated


def split(records: list, test_split_fraction: float, seed: int) -> tuple[list, list]:
    """Shuffle deterministically and split into (train, val). Val gets at least one record when the
    fraction is > 0 (so validation is never silently skipped) and train keeps at least one."""
    if not 0 <= test_split_fraction < 1:
        raise UserError(f"test_split_fraction must be in [0, 1), got {test_split_fraction}; pass e.g. 0.05")
    n = len(records)
    n_val = round(n * test_split_fraction)
    if test_split_fraction > 0:
        n_val = max(n_val, 1)
    n_val = min(n_val, n - 1)
    if n_val < 1 and test_split_fraction > 0:
        raise UserError(f"cannot split {n} record(s) into train and validation; add more records")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return [records[i] for i in order[n_val:]], [records[i] for i in order[:n_val]]


# ----------------------------------------------------------------------------------------------
# Prepared folders


def save_prepared(dest: Path | str, train: list, val: list, meta: dict) -> None:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    # Drop the old config first: if we die between files, the folder reads as unfinished instead of
    # pairing the old config with a new train.pt.
    (dest / CONFIG_NAME).unlink(missing_ok=True)
    atomic_torch_save(train, dest / "train.pt")
    atomic_torch_save(val, dest / "val.pt")
    meta = {**meta, "format_version": FORMAT_VERSION, "n_train": len(train), "n_val": len(val)}
    atomic_write(dest / CONFIG_NAME, lambda p: p.write_text(json.dumps(meta, indent=2) + "\n"))


def read_prepared_meta(dest: Path | str) -> dict | None:
    """The prepare config of a finished prepared folder, or None if the folder isn't one."""
    dest = Path(dest)
    cfg = dest / CONFIG_NAME
    if not (cfg.is_file() and (dest / "train.pt").is_file() and (dest / "val.pt").is_file()):
        return None
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError:
        raise UserError(f"{cfg} is corrupt; delete {dest} and prepare the data again") from None


def load_prepared(dest: Path | str) -> tuple[list, list, dict]:
    dest = Path(dest)
    meta = read_prepared_meta(dest)
    if meta is None:
        raise UserError(
            f"{dest} does not hold prepared data (train.pt, val.pt and {CONFIG_NAME}); "
            "run scripts/prepare_alpaca.py or scripts/prepare_json.py with --destination_path there"
        )
    # weights_only: these files are plain lists/dicts of tensors, never arbitrary pickles.
    train = torch.load(dest / "train.pt", weights_only=True)
    val = torch.load(dest / "val.pt", weights_only=True)
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
        print(
            f"warning: {n_truncated} of {n_records} samples were longer than max_seq_length={max_seq_length} "
            f"and were truncated{dropped}; raise --max_seq_length to keep them whole",
            file=sys.stderr,
        )


def prepare_files(
    train_file: Path,
    val_file: Path | None,
    tokenizer: TokenizerLike,
    destination_path: Path,
    max_seq_length: int,
    template: str = "alpaca",
    mask_inputs: bool = True,
    ignore_index: int = -100,
    test_split_fraction: float = 0.05,
    seed: int = 42,
    instruction_key: str = "instruction",
    input_key: str = "input",
    output_key: str = "output",
) -> dict:
    """Load, split (when no val_file), tokenize and save. Returns the saved meta."""
    tmpl = get_template(template)  # fail on a bad name before the (slow) tokenizing
    required = (instruction_key, output_key)
    train_recs = load_records(train_file, required)
    if val_file is None:
        train_recs, val_recs = split(train_recs, test_split_fraction, seed)
    else:
        val_recs = load_records(val_file, required)
    kw = dict(mask_inputs=mask_inputs, ignore_index=ignore_index, instruction_key=instruction_key,
              input_key=input_key, output_key=output_key)
    train, n_tr = prepare_samples(train_recs, tokenizer, tmpl, max_seq_length, **kw)
    val, n_va = prepare_samples(val_recs, tokenizer, tmpl, max_seq_length, **kw)
    _warn_truncated(n_tr + n_va, len(train_recs) + len(val_recs), len(train) + len(val), max_seq_length)
    sources = [f for f in (train_file, val_file) if f is not None]
    meta = _settings(tokenizer, max_seq_length, tmpl.name, sources, mask_inputs, ignore_index,
                     None if val_file else test_split_fraction, None if val_file else seed,
                     instruction_key, input_key, output_key)
    meta["n_truncated"] = n_tr + n_va
    save_prepared(destination_path, train, val, meta)
    return read_prepared_meta(destination_path) or meta


def _settings(tokenizer, max_seq_length, template, sources, mask_inputs, ignore_index,
              test_split_fraction, seed, instruction_key, input_key, output_key) -> dict:
    # Everything that changes the prepared tensors; a cache is reused only if all of it matches.
    return {
        "template": template,
        "max_seq_length": max_seq_length,
        "mask_inputs": mask_inputs,
        "ignore_index": ignore_index,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "source_files": [str(Path(s).resolve()) for s in sources],
        "source_sha256": [_sha256(Path(s)) for s in sources],
        "test_split_fraction": test_split_fraction,
        "seed": seed,
        "instruction_key": instruction_key,
        "input_key": input_key,
        "output_key": output_key,
    }


def _find_raw(data_dir: Path) -> tuple[Path, Path | None] | None:
    """(train, val) raw files in data_dir: train.* + val.*, else one lone data file to split."""
    def first(stem: str) -> Path | None:
        return next((data_dir / f"{stem}{s}" for s in RAW_SUFFIXES if (data_dir / f"{stem}{s}").is_file()), None)

    train, val = first("train"), first("val")
    if train and val:
        return train, val
    files = sorted(
        p for p in data_dir.iterdir()
        if p.is_file() and p.suffix.lower() in RAW_SUFFIXES and p.name != CONFIG_NAME and not p.name.startswith(".")
    )
    if len(files) == 1:
        return files[0], None
    if len(files) > 1:
        raise UserError(
            f"{data_dir} holds several data files ({', '.join(p.name for p in files)}) and no train/val pair; "
            "keep one file there, or name them train.json and val.json"
        )
    return None


def ensure_prepared(
    data_dir: Path | str,
    tokenizer: TokenizerLike,
    max_seq_length: int,
    template: str = "alpaca",
    mask_inputs: bool = True,
    ignore_index: int = -100,
    test_split_fraction: float = 0.05,
    seed: int = 42,
    instruction_key: str = "instruction",
    input_key: str = "input",
    output_key: str = "output",
) -> tuple[list, list, dict]:
    """What finetuning calls with --data_dir: returns (train, val, meta).

    Uses the prepared files in data_dir when made for this tokenizer with samples that fit
    max_seq_length; otherwise prepares raw files found there into a cache subfolder and reuses it.
    """
    data_dir = Path(data_dir)
    if not data_dir.exists():
        raise UserError(f"data folder {data_dir} does not exist; check --data_dir or prepare data there first")
    if not data_dir.is_dir():
        raise UserError(f"--data_dir {data_dir} is a file, not a folder; pass the folder that holds it")

    meta = read_prepared_meta(data_dir)
    fp = tokenizer.fingerprint
    # Samples prepared with a smaller max_seq_length still fit, so they are fine to use as is.
    if meta is not None and meta.get("tokenizer_fingerprint") == fp and meta.get("max_seq_length", 1 << 62) <= max_seq_length:
        return load_prepared(data_dir)

    raw = _find_raw(data_dir)
    if raw is None:
        if meta is not None:
            raise UserError(
                f"{data_dir} was prepared for tokenizer {meta.get('tokenizer_fingerprint')} with "
                f"max_seq_length={meta.get('max_seq_length')}, but this run uses tokenizer {fp} with "
                f"max_seq_length={max_seq_length}; re-run scripts/prepare_alpaca.py (or prepare_json.py) "
                "with this --checkpoint_dir and --max_seq_length"
            )
        raise UserError(
            f"{data_dir} holds no data (no prepared train.pt/val.pt/{CONFIG_NAME}, no .json/.jsonl/.csv file); "
            "put a data file there or run scripts/prepare_alpaca.py with --destination_path pointing at it"
        )

    train_file, val_file = raw
    cache = data_dir / f".prepared-{fp}-{max_seq_length}"
    settings = _settings(tokenizer, max_seq_length, get_template(template).name, [f for f in raw if f],
                         mask_inputs, ignore_index, None if val_file else test_split_fraction,
                         None if val_file else seed, instruction_key, input_key, output_key)
    cached = read_prepared_meta(cache)
    if cached is not None and all(cached.get(k) == v for k, v in settings.items()):
        print(f"Using data prepared earlier in {cache}", file=sys.stderr)
        return load_prepared(cache)

    names = train_file.name + (f" + {val_file.name}" if val_file else "")
    try:
        prepared = prepare_files(train_file, val_file, tokenizer, cache, max_seq_length, template, mask_inputs,
                                 ignore_index, test_split_fraction, seed, instruction_key, input_key, output_key)
    except PermissionError:  # e.g. a shared, read-only dataset folder
        raise UserError(
            f"cannot write the prepared cache into {data_dir}; prepare the data with scripts/prepare_json.py "
            "--destination_path <a writable folder> and pass that folder as --data_dir"
        ) from None
    # Said after the fact, so a file with a bad record fails with its one-line error alone
    print(f"Preparing {names} from {data_dir}: {prepared['n_train']} train and {prepared['n_val']} validation samples "
          f"(cached in {cache} for later runs)", file=sys.stderr)
    return load_prepared(cache)


def prepare_dataset(
    data_file: Path,
    checkpoint_dir: Path,
    destination_path: Path,
    max_seq_length: int | None = None,
    mask_inputs: bool = True,
    test_split_fraction: float = 0.05,
    seed: int = 42,
    template: str = "alpaca",
    instruction_key: str = "instruction",
    input_key: str = "input",
    output_key: str = "output",
) -> dict:
    """The body of scripts/prepare_*.py: tokenizer from checkpoint_dir, then prepare_files."""
    from lit_qlora.tokenizer import Tokenizer

    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise UserError(f"checkpoint folder {checkpoint_dir} does not exist; pass the --checkpoint_dir of a downloaded model")
    tokenizer = Tokenizer(checkpoint_dir)
    max_seq_length = max_seq_length or default_max_seq_length(checkpoint_dir)
    meta = prepare_files(
        Path(data_file), None, tokenizer, Path(destination_path), max_seq_length, template, mask_inputs,
        test_split_fraction=test_split_fraction, seed=seed,
        instruction_key=instruction_key, input_key=input_key, output_key=output_key,
    )
    print(f"Saved {meta['n_train']} train and {meta['n_val']} validation samples to {destination_path} "
          f"(template={meta['template']}, max_seq_length={max_seq_length})")
    return meta


def default_max_seq_length(checkpoint_dir: Path | str) -> int:
    """The model's context length: block_size from our model_config.json, else Hugging Face
    config.json max_position_embeddings, else 2048."""
    checkpoint_dir = Path(checkpoint_dir)
    for name, key in (("model_config.json", "block_size"), ("config.json", "max_position_embeddings")):
        f = checkpoint_dir / name
        if f.is_file():
            try:
                value = json.loads(f.read_text()).get(key)
            except (json.JSONDecodeError, AttributeError):
                value = None
            if isinstance(value, int) and value > 0:
                return value
    return 2048


# ----------------------------------------------------------------------------------------------
# Dataset, collate and batching


class SFTDataset(Dataset):
    def __init__(self, samples: list[dict[str, Tensor]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return self.samples[i]


def collate(
    samples: list[dict[str, Tensor]], pad_id: int = 0, ignore_index: int = -100, pad_multiple_of: int | None = None
) -> dict[str, Tensor]:
    """Right-pad to the longest sample (rounded up to pad_multiple_of). Padded labels get
    ignore_index, so padding never counts in the loss whatever pad_id is."""
    T = max(len(s["input_ids"]) for s in samples)
    if pad_multiple_of:
        T = -(-T // pad_multiple_of) * pad_multiple_of
    input_ids = torch.full((len(samples), T), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), T), ignore_index, dtype=torch.long)
    lengths = torch.zeros(len(samples), dtype=torch.long)  # real (non-pad) tokens per row
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        input_ids[i, :n] = s["input_ids"]
        labels[i, :n] = s["labels"]
        lengths[i] = n
    return {"input_ids": input_ids, "labels": labels, "lengths": lengths}


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """Sample order of one epoch, rebuilt from (seed, epoch) alone so a resumed run needs no saved generator state.
    The first epoch's order is the one `DataLoader(shuffle=True, generator=Generator().manual_seed(seed))` gives,
    so a run sees its samples in the same order as tools built on that (e.g. LitGPT, the HF recipe)."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator().manual_seed(seed)
    for e in range(epoch + 1):
        # Each epoch the DataLoader's iterator draws its base seed from the generator, then the sampler permutes
        torch.empty((), dtype=torch.int64).random_(generator=g)
        order = torch.randperm(n, generator=g)
    return order.tolist()


class BatchStream:
    """Endless stream of collated batches, epoch after epoch, reproducible from `seed` and resumable
    from `state_dict()` (epoch, position, seed). The last batch of an epoch may be smaller.

    length_grouped: within chunks of 64 batches of the shuffled order, sort samples by length so a
    batch holds similar lengths (less padding); batches stay in an order fixed by the seed.
    """

    def __init__(
        self,
        samples: list[dict[str, Tensor]],
        batch_size: int,
        seed: int = 42,
        shuffle: bool = True,
        length_grouped: bool = False,
        pad_id: int = 0,
        ignore_index: int = -100,
        pad_multiple_of: int | None = None,
    ) -> None:
        if not samples:
            raise UserError("no samples to train on; check the data folder")
        self.samples, self.batch_size, self.seed = samples, batch_size, seed
        self.shuffle, self.length_grouped = shuffle, length_grouped
        self.collate_kw = dict(pad_id=pad_id, ignore_index=ignore_index, pad_multiple_of=pad_multiple_of)
        self.epoch, self.position = 0, 0
        self._order: list[int] | None = None

    @property
    def batches_per_epoch(self) -> int:
        return -(-len(self.samples) // self.batch_size)

    def _epoch_order(self) -> list[int]:
        order = epoch_order(len(self.samples), self.seed, self.epoch, self.shuffle)
        if self.length_grouped:
            chunk = self.batch_size * 64
            order = [i for c in range(0, len(order), chunk)
                     for i in sorted(order[c:c + chunk], key=lambda j: -len(self.samples[j]["input_ids"]))]
        return order

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        return self

    def __next__(self) -> dict[str, Tensor]:
        if self._order is None:
            self._order = self._epoch_order()
        idx = self._order[self.position:self.position + self.batch_size]
        self.position += len(idx)
        if self.position >= len(self._order):
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return collate([self.samples[i] for i in idx], **self.collate_kw)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # The saved seed wins over the current one: resuming must replay the same order.
        self.seed = int(state.get("seed", self.seed))
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None
