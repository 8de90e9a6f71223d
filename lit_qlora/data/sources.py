"""Where records come from: what `--data_dir` (or an entry of `--data_sources`) names, resolved to train and
validation `Source`s, and mixtures of several sources.

A path is a data file (.json, .jsonl, .csv, .parquet), a folder of them (train* and val* / validation* files or
subfolders, else every data file in it: the shards of one set, split for validation), a `datasets` save_to_disk
folder (its train and validation splits), or `owner/name` of a dataset already in the local Hugging Face cache
(nothing is downloaded: a dataset that is not there is one line naming where it was looked for). Every file is read
by `records.iter_rows`.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from lit_qlora.data.records import RAW_SUFFIXES, is_dataset_folder, iter_rows, optional_module
from lit_qlora.readers import check_file, read_json
from lit_qlora.utils import UserError

# files a data folder may hold that are not records
METADATA_FILES = ("prepare_config.json", "dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json")
TRAIN_NAMES = ("train",)
VAL_NAMES = ("validation", "valid", "val", "dev")
TEST_NAMES = ("test",)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class Source:
    """One set of records: data files read in order (the shards of one set), or a `datasets` save_to_disk folder
    (`dataset`, with its `split` for a DatasetDict)."""

    files: tuple[Path, ...] = ()
    dataset: Path | None = None
    split: str | None = None
    name: str = field(default="", compare=False)

    def __str__(self) -> str:
        if self.name:
            return self.name
        if self.dataset is not None:
            return f"{self.dataset}" + (f" (split {self.split})" if self.split else "")
        return str(self.files[0]) if len(self.files) == 1 else f"{len(self.files)} files in {self.files[0].parent}"

    def short_name(self) -> str:
        """The file names (a dataset folder's name and split), for progress lines."""
        if self.dataset is not None:
            return self.dataset.name + (f"[{self.split}]" if self.split else "")
        names = [f.name for f in self.files]
        return names[0] if len(names) == 1 else f"{len(names)} shards ({names[0]} ... {names[-1]})"

    def rows(self) -> Iterator[tuple[Path, int, Any]]:
        """(file, row, record) of every record, file after file (rows from 1 in each file)."""
        if self.dataset is not None:
            for row, rec in iter_rows(self.dataset, self.split):
                yield self.dataset, row, rec
            return
        for f in self.files:
            for row, rec in iter_rows(f):
                yield f, row, rec

    def key_files(self) -> list[Path]:
        """The files whose contents decide the records (what a prepared cache is keyed on)."""
        if self.dataset is not None:
            return sorted(p for p in self.dataset.rglob("*") if p.is_file())
        return list(self.files)


def resolve(path: Path | str, flag: str = "--data_dir") -> tuple[Source, Source | None] | None:
    """(train, validation or None) of what `path` names; None for a folder that holds no data files."""
    text = str(path)
    path = Path(path)
    if not path.exists():
        if _REPO_ID.match(text) and not text.startswith((".", "/")):
            path = hub_snapshot(text)
        else:
            raise UserError(f"data folder {path} does not exist; check {flag} or prepare data there first")
    if path.is_file():
        if path.suffix.lower() not in RAW_SUFFIXES:
            raise UserError(f"{flag} {path} is not a data file ({', '.join(RAW_SUFFIXES)}); pass one, or the folder "
                            "that holds the data")
        return Source((path,)), None
    if is_dataset_folder(path):
        return _dataset_sources(path)
    return _folder_sources(path)


def _dataset_sources(path: Path) -> tuple[Source, Source | None]:
    if not (path / "dataset_dict.json").is_file():
        return Source(dataset=path), None
    splits = read_json(path / "dataset_dict.json", dict, fix="save the dataset again with save_to_disk").get("splits")
    if not (isinstance(splits, list) and splits and all(isinstance(s, str) for s in splits)):
        raise UserError(f"{path / 'dataset_dict.json'} lists no splits; save the dataset again with save_to_disk")
    train = "train" if "train" in splits else splits[0]
    val = next((s for s in VAL_NAMES if s in splits), None)
    return Source(dataset=path, split=train), (Source(dataset=path, split=val) if val else None)


def _split_of(rel: Path) -> str | None:
    """train / val / test for a file whose name or folder begins so (train.jsonl, train-00000-of-00002.parquet,
    validation/0000.parquet), None for any other."""
    for part in (*rel.parts[:-1], rel.name):
        low = part.lower()
        for split, names in (("train", TRAIN_NAMES), ("val", VAL_NAMES), ("test", TEST_NAMES)):
            if any(low == n or low.startswith((n + ".", n + "-", n + "_")) for n in names):
                return split
    return None


def data_files(folder: Path) -> list[Path]:
    """The data files under a folder (its subfolders too), in name order; hidden files and folders (a prepared
    cache, .git) and dataset metadata are not data. A data file's name on something that is no file (a symlink
    loop, a link to nothing) is refused in one line: it would be read, or its path resolved, later."""
    out = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if (not name.startswith(".") and name not in METADATA_FILES
                    and os.path.splitext(name)[1].lower() in RAW_SUFFIXES):
                out.append(check_file(Path(root) / name, "data file", "replace it with the file, or remove it"))
    return out


def _folder_sources(folder: Path) -> tuple[Source, Source | None] | None:
    files = data_files(folder)
    if not files:
        return None
    groups: dict[str | None, list[Path]] = {}
    for f in files:
        groups.setdefault(_split_of(f.relative_to(folder)), []).append(f)
    if "train" not in groups:
        if "val" in groups or "test" in groups:
            named = ", ".join(str(f.relative_to(folder)) for f in files[:4])
            raise UserError(f"{folder} holds validation or test files ({named}) but no train file; name the "
                            "training data train.jsonl (or train-*.parquet)")
        return Source(tuple(files)), None  # the shards of one set
    others = groups.get(None, [])
    if others:
        raise UserError(f"{folder} holds train files and others that are neither train nor validation "
                        f"({', '.join(str(f.relative_to(folder)) for f in others[:4])}); move those out, or name "
                        "them train-*/val-*")
    val = groups.get("val")
    return Source(tuple(groups["train"])), (Source(tuple(val)) if val else None)


def hub_cache_dir() -> Path:
    """Where the Hugging Face hub keeps its downloads (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub),
    read when called."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot folder of dataset `repo_id` in the hub cache. Nothing is downloaded: a dataset that is not
    there is a one-line UserError naming where it was looked for."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    hub = optional_module("huggingface_hub", f"reading the dataset {repo_id} from the Hugging Face cache")
    cache = hub_cache_dir()
    owner, name = repo_id.split("/")
    where = cache / f"datasets--{owner}--{name}"
    try:
        return Path(hub.snapshot_download(repo_id, repo_type="dataset", cache_dir=str(cache), local_files_only=True))
    except Exception:  # not in the cache (LocalEntryNotFoundError), or a half-written snapshot
        raise UserError(f"{repo_id} is neither a folder nor a dataset in the local Hugging Face cache (looked in "
                        f"{where}); nothing is downloaded during a run: fetch it once with `huggingface-cli download "
                        f"--repo-type dataset {repo_id}`, or pass a folder") from None


# ---- mixtures ----------------------------------------------------------------------------------------------------
MIXTURE_KEYS = ("path", "weight", "epochs")


@dataclass(frozen=True)
class MixEntry:
    """One source of a mixture: what `path` names (anything --data_dir accepts) and its share: a `weight` (the
    weighted sources share, in proportion, as many samples as they hold together) or `epochs` (that many passes over
    it: 2 repeats it, 0.5 takes half)."""

    path: str
    weight: float | None = None
    epochs: float | None = None


def read_mixture(path: Path | str) -> list[MixEntry]:
    """The entries of a --data_sources file: a JSON or YAML list of {path, weight} or {path, epochs} objects (a
    relative path is read from the file's folder). Anything else is a one-line UserError naming the entry."""
    from lit_qlora.readers import check_fields, check_path, read_yaml

    path = Path(path)
    fix = "write a list of {path, weight} or {path, epochs} entries"
    if path.suffix.lower() == ".json":
        data = read_json(path, list, what="--data_sources file", fix=fix)
    elif path.suffix.lower() in (".yaml", ".yml"):
        data = read_yaml(path, "--data_sources file", fix)
    else:
        raise UserError(f"--data_sources {path} is neither .json nor .yaml; {fix} in a .json or .yaml file")
    if not isinstance(data, list) or not data:
        raise UserError(f"--data_sources file {path} holds no list of sources; {fix}")
    entries = []
    for i, e in enumerate(data, start=1):
        where = f"entry {i} of --data_sources file {path}"
        check_fields(e, where, {"path": "str", "weight": "positive", "epochs": "positive"}, ("path",), fix,
                     nullable=False)
        unknown = [k for k in e if k not in MIXTURE_KEYS]
        if unknown:
            raise UserError(f"{where} has unknown key {unknown[0]!r}; use only {', '.join(MIXTURE_KEYS)}")
        if ("weight" in e) == ("epochs" in e):
            which = "both weight and epochs" if "weight" in e else "neither weight nor epochs"
            raise UserError(f"{where} has {which}; give it one of them (a positive number)")
        p = e["path"]
        check_path(p, f"the path of {where}")
        if not Path(p).is_absolute() and (path.parent / p).exists():
            p = str(path.parent / p)
        entries.append(MixEntry(p, e.get("weight"), e.get("epochs")))
    return entries


def mixture_counts(entries: list[MixEntry], sizes: list[int]) -> list[int]:
    """How many samples each source gives: epochs x its size; the weighted ones share their total size in proportion
    to the weights (largest remainders, so the counts add up exactly)."""
    counts = [round(e.epochs * n) if e.epochs is not None else 0 for e, n in zip(entries, sizes)]
    weighted = [i for i, e in enumerate(entries) if e.weight is not None]
    if weighted:
        total, w_sum = sum(sizes[i] for i in weighted), sum(entries[i].weight for i in weighted)
        exact = {i: total * entries[i].weight / w_sum for i in weighted}
        for i in weighted:
            counts[i] = int(exact[i])
        for i in sorted(weighted, key=lambda i: (exact[i] - int(exact[i]), -i), reverse=True)[:total - sum(
                counts[i] for i in weighted)]:
            counts[i] += 1
    return counts


def mix(samples: list[list], entries: list[MixEntry], seed: int) -> tuple[list, list[dict]]:
    """The mixed training set and what it realized ({path, weight, epochs, available, used, share} per source).

    Source k gives `mixture_counts` samples: whole passes over it, each in its own order drawn from `seed` and k, then
    the part of one more pass; the mixture is then shuffled with `seed`. The same seed and sources give the same list
    (so a resumed run, whose stream position indexes it, continues the same sequence)."""
    import torch

    counts = mixture_counts(entries, [len(s) for s in samples])
    mixed = []
    for k, (pool, n) in enumerate(zip(samples, counts)):
        if n and not pool:
            raise UserError(f"data source {entries[k].path} gives no training samples; drop it from --data_sources")
        g = torch.Generator().manual_seed(seed * 1_000_003 + k)
        taken = []
        while len(taken) < n:
            taken += torch.randperm(len(pool), generator=g).tolist()
        mixed += [pool[i] for i in taken[:n]]
    if not mixed:
        raise UserError("the --data_sources mixture gives no training samples; raise a weight or an epochs")
    order = torch.randperm(len(mixed), generator=torch.Generator().manual_seed(seed)).tolist()
    realized = [{"path": e.path, "weight": e.weight, "epochs": e.epochs, "available": len(pool), "used": n,
                 "share": n / len(mixed)} for e, pool, n in zip(entries, samples, counts)]
    return [mixed[i] for i in order], realized
