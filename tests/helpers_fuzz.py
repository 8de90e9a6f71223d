"""A seeded fuzzer of every file kind the CLIs read: each case damages one file of a pristine set (truncation, byte
flips, random bytes, invalid UTF-8, JSON / YAML of the wrong shape, non-finite and huge numbers, safetensors header
lies, checkpoint payload lies, a folder or a symlink loop in the file's place, a huge line), runs the reading path of
the CLI that reads it, and classifies the outcome:

- "accepted": the path returned (the damage is undetectable or harmless: tensor payload bytes, an older checkpoint
  used and said so);
- "refused": a UserError of one line (what the CLI prints as `error: ...` with exit 2);
- "traceback": anything else (what the CLI would print as a Python traceback);
- "changed": a file that existed before the case was modified by it.

The table splits "accepted" by what was read: the same as from the pristine file; something else, and a warning named
the file ("said so"); data bytes of a safetensors or parquet file changed ("undetectable": the format has no
checksum); a damaged file that is still valid, read as the format's reference reads it ("valid file": `valid_edit`);
or something else without a word ("wrong": a reader to fix).

In-process, the reading path is the function the CLI calls (the CLI's own first steps for finetune); `run_cli_case`
runs a damaged file through the real script as a subprocess.

    python tests/helpers_fuzz.py --seed 1000 --per_kind 40     # the outcome table on other seeds
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import random
import shutil
import struct
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import helpers_train as h  # noqa: E402

from lit_qlora.utils import UserError  # noqa: E402

# ---- the pristine set ------------------------------------------------------------------------------------------------


def build_pristine(base: Path, setup: dict | None = None) -> dict[str, Path]:
    """{ckpt, hf_only, run, data, chat, yaml}: the tiny converted model (with its HF files), a copy with only the HF
    files, a finished 2-iteration run (checkpoints, adapter, metrics), Alpaca and chat data, a --config YAML."""
    base = Path(base)
    setup = dict(setup or h.build_tiny_setup(base / "setup"))
    shutil.copytree(setup["ckpt"], base / "ckpt")  # a private copy: the shared setup is never touched
    setup["ckpt"] = base / "ckpt"
    (setup["ckpt"] / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # before training: the prepared data's key
    run = base / "run"
    h.train(setup, run, max_iters=2, save_interval=1, keep_checkpoints=0)
    hf_only = base / "hf_only"
    shutil.copytree(setup["ckpt"], hf_only, ignore=shutil.ignore_patterns("lit_model.safetensors", "model_config.json"))
    (setup["ckpt"] / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2]}))
    chat = base / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                       {"role": "assistant", "content": f"a{i}"}]})
                              for i in range(8)) + "\n")
    yaml_file = base / "run.yaml"
    yaml_file.write_text(f"checkpoint_dir: {setup['ckpt']}\ndata_dir: {setup['data']}\nmax_iters: 2\n"
                         "lora_r: 8\nlearning_rate: 0.001\n")
    from lit_qlora.adapter import Adapter
    from lit_qlora.config import Config

    config = Config.from_file(setup["ckpt"] / "model_config.json")
    Adapter.load(run / "lit_model_lora_finetuned.pth", config).export_peft(config, base / "peft")
    extra = base / "extra"  # the record formats and files beside the Alpaca JSON: parquet, preference pairs, a mixture
    extra.mkdir()
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = json.loads(Path(setup["data_file"]).read_text())
    pq.write_table(pa.Table.from_pylist([{k: r.get(k, "") for k in ("instruction", "input", "output")}
                                         for r in records]), extra / "train.parquet", row_group_size=8)
    (extra / "pref").mkdir()
    (extra / "pref" / "train.jsonl").write_text("".join(
        json.dumps({"prompt": f"name a color {i}", "chosen": " red", "rejected": f" cat {i}"}) + "\n"
        for i in range(8)))
    prepared = sorted(Path(setup["data"]).glob(".prepared-*"))  # what the run prepared: a --data_dir of its own
    shutil.copytree(prepared[-1], extra / "prep")
    (extra / "mix.yaml").write_text("- path: train.parquet\n  weight: 2\n- path: pref/train.jsonl\n  epochs: 0.5\n")
    return {"ckpt": setup["ckpt"], "hf_only": hf_only, "run": run, "data": setup["data"],
            "data_file": setup["data_file"], "chat": chat, "yaml": yaml_file, "peft": base / "peft", "extra": extra}


# a tiny chat template (the tokenizer's own, as transformers >= 4.43 saves it beside tokenizer_config.json)
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


# ---- corruptions -----------------------------------------------------------------------------------------------------
HUGE_NUMBERS = [None, -1, 0, 1e308, float("inf"), float("nan"), 10**18, 2**64 + 1, "x", [], {}, True, 2.5, -1e-9]


def _json_lie(data, rng: random.Random):
    """A JSON value of the wrong shape, or `data` with one field set to a wrong value or deleted."""
    kind = rng.randrange(4)
    if kind == 0 or not isinstance(data, (dict, list)) or not data:
        return rng.choice([[], [1, 2], "text", 3, None, {"a": 1}])
    if isinstance(data, list):
        data = list(data)
        i = rng.randrange(len(data))
        data[i] = _json_lie(data[i], rng) if isinstance(data[i], (dict, list)) and rng.random() < 0.7 \
            else rng.choice(HUGE_NUMBERS)
        return data
    data = dict(data)
    key = rng.choice(sorted(data))
    if kind == 1:
        del data[key]
    elif kind == 2 and isinstance(data[key], (dict, list)) and data[key]:
        data[key] = _json_lie(data[key], rng)
    else:
        data[key] = rng.choice(HUGE_NUMBERS)
    return data


def _bytes_corruption(raw: bytes, rng: random.Random, header_bytes: int = 64) -> bytes:
    kind = rng.randrange(7)
    if kind == 0:  # truncation
        return raw[: rng.randrange(len(raw))] if raw else raw
    if kind == 1:  # a byte flip in the header
        b = bytearray(raw)
        if b:
            i = rng.randrange(min(len(b), header_bytes))
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b)
    if kind == 2:  # a byte flip anywhere
        b = bytearray(raw)
        if b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b)
    if kind == 3:  # random bytes
        return rng.randbytes(max(1, len(raw) if rng.random() < 0.5 else rng.randrange(1, 200)))
    if kind == 4:  # invalid UTF-8
        i = rng.randrange(len(raw) + 1)
        return raw[:i] + rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80"]) + raw[i:]
    if kind == 5:  # a huge line
        i = rng.randrange(len(raw) + 1)
        return raw[:i] + b"a" * (4 << 20) + raw[i:]
    return b""  # empty


def _safetensors_lie(raw: bytes, rng: random.Random) -> bytes:
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    e = header[name]
    kind = rng.randrange(8)
    if kind == 0:
        e["dtype"] = rng.choice(["F64", "X", "", 7, None, "I8", "BF16", "U16", "F8_E4M3"])
    elif kind == 1:
        e["shape"] = rng.choice([[d * 2 for d in e["shape"]], [-1] + e["shape"][1:], [2**62, 2**62], "x", [],
                                 e["shape"] + [1, 3]])
    elif kind == 2:
        lo, hi = e["data_offsets"]
        e["data_offsets"] = rng.choice([[lo + 8, hi + 8], [hi, lo], [lo], [lo, hi + 10**12], [-8, hi], "x",
                                        [0, hi - lo]])
    elif kind == 3:
        del e[rng.choice(["dtype", "shape", "data_offsets"])]
    elif kind == 4:
        header = rng.choice([[1, 2], "x", None, 3])
    elif kind == 5:
        header["__metadata__"] = rng.choice([[1], {"a": 1}, "x"])
    elif kind == 6:  # a header length that lies
        out = json.dumps(header).encode()
        bad = rng.choice([len(out) + 1, len(out) - 1, 0, 2**63, len(out) + len(body) + 1, 10**9])
        return struct.pack("<Q", bad) + out + body
    else:
        del header[name]
    out = json.dumps(header).encode()
    return struct.pack("<Q", len(out)) + out + body


def _samples_lie(samples: list, rng: random.Random) -> list:
    """Prepared samples that load but lie: a sample's ids of another dtype, out of the vocabulary, labels of another
    length or missing, a sample dropped or empty."""
    samples = [dict(x) for x in samples]
    i = rng.randrange(len(samples))
    x = samples[i]
    kind = rng.randrange(6)
    if kind == 0:
        x["input_ids"] = x["input_ids"].to(rng.choice([torch.float32, torch.int8, torch.bool]))
    elif kind == 1:
        x["input_ids"] = x["input_ids"].clone()
        x["input_ids"][rng.randrange(len(x["input_ids"]))] = rng.choice([-1, 10**6, 2**40])
    elif kind == 2:
        x["labels"] = x["labels"][:-1]
    elif kind == 3:
        del x[rng.choice(["input_ids", "labels"])]
    elif kind == 4:
        samples.pop(i)
    else:
        x["input_ids"], x["labels"] = x["input_ids"][:0], x["labels"][:0]
    return samples


def _payload_lie(payload: dict, rng: random.Random) -> dict:
    """A training checkpoint / adapter whose content lies (it loads, but is not what finetune writes)."""
    p = {k: (dict(v) if isinstance(v, dict) else v) for k, v in payload.items()}
    kind = rng.randrange(11)
    if kind == 0:
        p["lora_config"]["r"] = rng.choice([10**18, 0, -2, 2.5, "8", 10**6])
    elif kind == 1:
        p["model_config"].pop(rng.choice(sorted(p["model_config"])))
    elif kind == 2:
        p["model_config"][rng.choice(["n_embd", "n_head", "vocab_size", "n_layer", "head_size"])] = \
            rng.choice(HUGE_NUMBERS)
    elif kind == 3:
        k = rng.choice(sorted(p["lora"]))
        p["lora"][k] = rng.choice([torch.zeros(3, 5), torch.zeros(1, dtype=torch.long), "x"])
    elif kind == 4:
        p["lora"].pop(rng.choice(sorted(p["lora"])))
    elif kind == 5:
        p[rng.choice(["lora", "lora_config", "model_config"])] = rng.choice([[1], "x", None, 3])
    elif kind == 6 and isinstance(p.get("resume"), dict):
        r = p["resume"]
        key = rng.choice(["step", "data", "rng", "optimizer", "train_time"])
        r[key] = rng.choice([None, -1, "x", [1], {}, float("nan")])
    elif kind == 7:
        p["lora_config"]["dropout"] = rng.choice([1.5, -0.1, float("nan"), "x"])
    elif kind == 8:
        p["format"] = rng.choice(["x", None, 3])
    elif kind == 9 or not isinstance(p.get("resume"), dict):  # the right shape, a value no training writes
        k = rng.choice(sorted(p["lora"]))
        p["lora"][k] = _non_finite(p["lora"][k], rng)
    else:  # the optimizer's moments (Adam's second moment inf: every later update NaN)
        r = p["resume"] = dict(p["resume"])
        opt = r["optimizer"] = dict(r["optimizer"])
        state = opt["state"] = {i: dict(v) for i, v in opt["state"].items()}
        i = rng.choice(sorted(state))
        name = rng.choice(["exp_avg", "exp_avg_sq"])
        state[i][name] = _non_finite(state[i][name], rng)
    return p


def _non_finite(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """`t` with one element NaN, inf or -inf."""
    t = t.clone()
    t.view(-1)[rng.randrange(t.numel())] = rng.choice([float("nan"), float("inf"), float("-inf")])
    return t


def _place_corruption(path: Path, rng: random.Random) -> bool:
    """Sometimes a folder or a symlink loop takes the file's place (True when done)."""
    r = rng.random()
    if r < 0.05:
        path.unlink()
        path.mkdir()
        return True
    if r < 0.10:
        path.unlink()
        os.symlink(path.name, path)  # a link to itself: ELOOP
        return True
    return False


def corrupt(path: Path, kind: str, rng: random.Random) -> str:
    """Damage `path` in place; returns what was done."""
    if _place_corruption(path, rng):
        return "folder or symlink loop"
    raw = path.read_bytes()
    r = rng.random()
    if kind.startswith(("safetensors_", "peft_weights")) and r < 0.6:
        path.write_bytes(_safetensors_lie(raw, rng))
        return "safetensors header lie"
    if kind in ("adapter", "train_ckpt") and r < 0.6:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        torch.save(_payload_lie(payload, rng), path)
        return "payload lie"
    if kind == "prepared_pt" and r < 0.6:
        torch.save(_samples_lie(torch.load(path, map_location="cpu", weights_only=True), rng), path)
        return "samples lie"
    if kind in JSON_KINDS and r < 0.5:
        try:
            if kind in ("config_yaml", "data_sources_yaml"):
                import yaml

                data = yaml.safe_load(raw)
            else:
                data = json.loads(raw) if kind not in JSONL_KINDS else [json.loads(ln) for ln in raw.splitlines() if ln]
        except Exception:  # noqa: BLE001 - not parseable: a lie of any shape
            data = None
        lie = _json_lie(data, rng)
        if kind in JSONL_KINDS:
            text = "\n".join(json.dumps(x) for x in lie) if isinstance(lie, list) else json.dumps(lie)
        elif kind in ("config_yaml", "data_sources_yaml"):
            import yaml

            text = yaml.safe_dump(lie) if rng.random() < 0.5 else json.dumps(lie)
        else:
            text = json.dumps(lie)
        path.write_text(text)
        return "wrong shape or value"
    path.write_bytes(_bytes_corruption(raw, rng))
    return "bytes"


# ---- the reading paths -----------------------------------------------------------------------------------------------
# Each returns what it read, so that an accepted case can be told apart: the same reading as the pristine file's
# (the damage changed nothing that is used) or another one (a valid file saying something else, or tensor bytes).
def _tensors(sd) -> dict:
    return {k: (tuple(v.shape), str(v.dtype), float(v.double().sum())) for k, v in sorted(sd.items())}


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _read_tokenizer(d: Path):
    from lit_qlora.tokenizer import Tokenizer

    tok = Tokenizer(d / "ckpt")
    return tok.vocab_size, tok.bos_id, tok.eos_id, tok.encode("hello world, 12").tolist()


def _convert(d: Path):
    from lit_qlora.checkpoint import read_safetensors
    from lit_qlora.convert import ensure_converted

    config = ensure_converted(d / "hf_only", quiet=True, verify=True)
    return config, _tensors(dict(read_safetensors(d / "hf_only" / "lit_model.safetensors")))


def _read_lit(d: Path):
    from lit_qlora.checkpoint import read_safetensors
    from lit_qlora.convert import ensure_converted

    config = ensure_converted(d / "ckpt", quiet=True, verify=True)
    return config, _tensors(dict(read_safetensors(d / "ckpt" / "lit_model.safetensors")))


def _read_adapter(d: Path):
    from lit_qlora.adapter import Adapter
    from lit_qlora.config import Config

    a = Adapter.load(d / "run" / "lit_model_lora_finetuned.pth", Config.from_file(d / "ckpt" / "model_config.json"))
    return a.config, a.train, _tensors(a.lora)


def _read_peft(d: Path):
    from lit_qlora.adapter import Adapter
    from lit_qlora.config import Config

    a = Adapter.load(d / "peft", Config.from_file(d / "ckpt" / "model_config.json"))
    return a.config, _tensors(a.lora)


def _export_hf(d: Path):
    from lit_qlora.convert import convert_lit_checkpoint

    convert_lit_checkpoint(d / "ckpt", d / "hf_export")
    return _files(d / "hf_export")


def _resume(d: Path):
    from lit_qlora.train.training import check_out_dir, find_resume

    check_out_dir(d / "run", "auto")
    path, state = find_resume(d / "run", "auto")
    return path and path.name, state and state["resume"]["step"]


def _resume_named(d: Path):
    from lit_qlora.train.training import find_resume

    path, state = find_resume(d / "run", str(d / "run" / "checkpoints" / "iter-000002.pth"))
    return path and path.name, state and state["resume"]["step"]


def _parsed_flags(config_file: Path) -> dict:
    """The flags of a --config file as finetune/lora.py reads them, and the folders they name opened as its
    check_inputs opens them next (a damaged path is refused there, not trained on)."""
    from lit_qlora.args import parse_finetune_args
    from lit_qlora.convert import ensure_converted
    from lit_qlora.data.sources import resolve
    from lit_qlora.precision import resolve_accelerator
    from lit_qlora.quant.quant_mode import QuantMode
    from lit_qlora.train.loop import check_flags

    args = parse_finetune_args(["--config", str(config_file)])
    quantize = QuantMode.parse(args.run.quantize)
    check_flags(args, quantize and quantize.value, args.lora.config(),  # finetune's checks of the flags
                resolve_accelerator(args.run.accelerator))
    ensure_converted(args.run.checkpoint_dir, quiet=True)
    if resolve(args.data.data_dir) is None:
        raise UserError(f"no data in {args.data.data_dir}")
    return args.as_flat_dict()


def _read_config(d: Path):
    return _parsed_flags(d / "run.yaml")


def _read_hparams(d: Path):
    return _parsed_flags(d / "run" / "hyperparameters.json")


def _read_alpaca(d: Path):
    from lit_qlora.data.records import load_records

    return load_records(d / "data" / "tasks.json")


def _read_data_dir(d: Path):
    """--data_dir as finetune/lora.py prepares it: the files the folder holds (`sources.resolve`), tokenized into its
    cache (the fuzzer found a symlink loop in a data file's place ending here in a traceback)."""
    from lit_qlora.data.prepare import DataSettings, ensure_prepared
    from lit_qlora.tokenizer import Tokenizer

    train, val, _ = ensure_prepared(d / "data", Tokenizer(d / "ckpt"), DataSettings(128, template="plain"))
    return [{k: v.tolist() for k, v in sorted(x.items())} for x in train + val]


def _read_chat(d: Path):
    from lit_qlora.data.chat_template import load_conversation_rows

    return load_conversation_rows(d / "chat.jsonl")


def _read_chat_template(d: Path):
    """A conversation rendered with the checkpoint's chat template (chat_template.jinja), as prepare and generate do."""
    from lit_qlora.data.chat_template import encode_chat
    from lit_qlora.tokenizer import Tokenizer

    tok = Tokenizer(d / "ckpt")
    return encode_chat(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                       add_generation_prompt=False)


def _export_gguf(d: Path):
    """scripts/export_gguf.py: the model and its tokenizer (tokenizer.json, tokenizer_config.json) as one GGUF."""
    from lit_qlora.export.gguf_export import export_gguf

    out = export_gguf(d / "ckpt", d / "model.gguf")
    return hashlib.sha256(out.read_bytes()).hexdigest()


def _read_parquet(d: Path):
    from lit_qlora.data.records import load_records

    return load_records(d / "extra" / "train.parquet")


def _read_pairs(d: Path):
    """finetune/dpo.py's data: preference pairs rendered with the alpaca template."""
    from lit_qlora.data.prepare import DataSettings
    from lit_qlora.tokenizer import Tokenizer
    from lit_qlora.train.preference import load_pairs

    train, val, _ = load_pairs(d / "extra" / "pref", Tokenizer(d / "ckpt"), DataSettings(64, template="alpaca"))
    return [{k: v.tolist() if hasattr(v, "tolist") else v for k, v in sorted(p.items())} for p in train + val]


def _read_mixture(d: Path):
    """--data_sources: the mixture file's entries and the sources they name, opened as finetune opens them."""
    from lit_qlora.data.sources import read_mixture, resolve

    entries = read_mixture(d / "extra" / "mix.yaml")
    for e in entries:
        if resolve(e.path, "--data_sources") is None:
            raise UserError(f"no data in {e.path}")
    return [(Path(e.path).name, e.weight, e.epochs) for e in entries]


def _read_prepared(d: Path):
    """A prepared --data_dir (train.pt, val.pt, prepare_config.json) as finetune loads it."""
    from lit_qlora.data.prepare import DataSettings, ensure_prepared
    from lit_qlora.tokenizer import Tokenizer

    train, val, meta = ensure_prepared(d / "extra" / "prep", Tokenizer(d / "ckpt"), DataSettings(128))
    return [{k: v.tolist() for k, v in sorted(x.items())} for x in train + val], meta.get("template")  # what is used


def _run_report(d: Path):
    """scripts/report.py OUT_DIR: one run's report.md (no plots)."""
    from lit_qlora.train.tracking import run_report

    md, _ = run_report(d / "run", plots=False)
    return md.read_text()


def _report(d: Path):
    """scripts/report.py over a matrix of one cell: the table, the CSV and the plots."""
    import runpy

    report = runpy.run_path(str(h.ROOT / "scripts" / "report.py"))
    cells = report["collect"](d / "matrix")
    report["markdown"](cells)
    report["write_csv"](cells, d / "matrix" / "report.csv")
    report["plots"](cells, d / "matrix")
    return report["markdown"](cells)


# kind -> (file relative to the case folder, reading path)
KINDS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "hf_config": ("hf_only/config.json", _convert),  # what reads it: the conversion, with the weights it describes
    "generation_config": ("ckpt/generation_config.json", _read_tokenizer),
    "tokenizer_config": ("ckpt/tokenizer_config.json", _read_tokenizer),
    "safetensors_hf": ("hf_only/model.safetensors", _convert),
    "safetensors_lit": ("ckpt/lit_model.safetensors", _read_lit),
    "model_config": ("ckpt/model_config.json", _read_lit),
    "adapter": ("run/lit_model_lora_finetuned.pth", _read_adapter),
    "peft_config": ("peft/adapter_config.json", _read_peft),
    "peft_weights": ("peft/adapter_model.safetensors", _read_peft),
    "safetensors_lit_export": ("ckpt/lit_model.safetensors", _export_hf),
    "train_ckpt": ("run/checkpoints/iter-000002.pth", _resume),
    "train_ckpt_named": ("run/checkpoints/iter-000002.pth", _resume_named),
    "metrics_csv": ("run/metrics.csv", _resume),
    "config_yaml": ("run.yaml", _read_config),
    "hparams_json": ("run/hyperparameters.json", _read_hparams),
    "alpaca_json": ("data/tasks.json", _read_alpaca),
    "data_dir_file": ("data/tasks.json", _read_data_dir),
    "chat_jsonl": ("chat.jsonl", _read_chat),
    "report_metrics_json": ("matrix/tiny/32-true/metrics.json", _report),
    "report_metrics_csv": ("matrix/tiny/32-true/metrics.csv", _report),
    "run_report_metrics_json": ("run/metrics.json", _run_report),
    "tokenizer_json": ("ckpt/tokenizer.json", _read_tokenizer),
    "tokenizer_json_gguf": ("ckpt/tokenizer.json", _export_gguf),
    "tokenizer_config_gguf": ("ckpt/tokenizer_config.json", _export_gguf),
    "chat_template_jinja": ("ckpt/chat_template.jinja", _read_chat_template),
    "parquet_records": ("extra/train.parquet", _read_parquet),
    "preference_jsonl": ("extra/pref/train.jsonl", _read_pairs),
    "data_sources_yaml": ("extra/mix.yaml", _read_mixture),
    "prepared_pt": ("extra/prep/train.pt", _read_prepared),
    "prepared_config": ("extra/prep/prepare_config.json", _read_prepared),
}
JSONL_KINDS = {"chat_jsonl", "preference_jsonl"}
JSON_KINDS = {"report_metrics_json", "run_report_metrics_json", "peft_config",
              "hf_config", "generation_config", "tokenizer_config", "model_config", "config_yaml", "hparams_json",
              "alpaca_json", "data_dir_file", "chat_jsonl", "tokenizer_json", "tokenizer_json_gguf",
              "tokenizer_config_gguf", "preference_jsonl", "data_sources_yaml", "prepared_config"}


def _snapshot(folder: Path, skip: Path) -> dict[str, str]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p == skip or not p.is_file() or p.is_symlink():
            continue
        out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _case_folder(pristine: dict[str, Path], dest: Path) -> Path:
    """A private copy of the pristine set (the files a case may touch), laid out as KINDS expects."""
    dest.mkdir(parents=True)
    shutil.copytree(pristine["ckpt"], dest / "ckpt", ignore=shutil.ignore_patterns(".*"))
    shutil.copytree(pristine["hf_only"], dest / "hf_only")
    shutil.copytree(pristine["run"], dest / "run", ignore=shutil.ignore_patterns("tensorboard"))
    shutil.copytree(pristine["data"], dest / "data", ignore=shutil.ignore_patterns(".*", "*.pt", "prepare*"))
    shutil.copy(pristine["chat"], dest / "chat.jsonl")
    shutil.copytree(pristine["peft"], dest / "peft")
    shutil.copy(pristine["yaml"], dest / "run.yaml")
    shutil.copytree(pristine["extra"], dest / "extra")
    cell = dest / "matrix" / "tiny" / "32-true"
    cell.mkdir(parents=True)
    for name in ("metrics.json", "metrics.csv"):
        shutil.copy(pristine["run"] / name, cell / name)
    (cell / "status.json").write_text(json.dumps({"status": "ok", "exit_code": 0}))
    (cell / "cell.json").write_text(json.dumps({"model": "tiny", "setting": "32-true"}))
    return dest


def run_case(pristine: dict[str, Path], kind: str, seed: int, work: Path) -> dict:
    """One seeded case: copy, damage, read, classify."""
    rng = random.Random(f"{kind}:{seed}")
    d = _case_folder(pristine, work / f"{kind}-{seed}")
    rel, read = KINDS[kind]
    target = d / rel
    original = target.read_bytes() if target.is_file() else b""
    what = corrupt(target, kind, rng)
    before = _snapshot(d, target)
    outcome, detail = "accepted", ""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            reading = _reading(read(d), d)
        detail = "same reading" if reading == pristine_reading(pristine, kind, work) else "reads differently"
        warned = [ln for ln in said.getvalue().splitlines() if ln.startswith("warning: ") and target.name in ln]
        if detail == "reads differently" and warned:  # not silent: the reader said what it left out or used instead
            detail = "reads differently, said so"
    except UserError as e:
        msg = str(e)
        outcome, detail = ("refused", msg) if "\n" not in msg and msg.strip() else ("traceback", "multi-line: " + msg)
    except SystemExit as e:
        outcome, detail = ("refused", "") if e.code == 2 else ("traceback", f"SystemExit {e.code}")
    except BaseException as e:  # noqa: BLE001 - exactly what the fuzzer looks for
        if isinstance(e, KeyboardInterrupt):
            raise
        outcome, detail = "traceback", f"{type(e).__name__}: {e}"[:300]
    after = _snapshot(d, target)
    changed = sorted(k for k in before if before[k] != after.get(k))
    if changed:
        outcome, detail = "changed", f"modified {changed[:3]}"
    if detail == "reads differently" and _payload_only(original, target):
        detail = "undetectable: payload bytes"  # safetensors / parquet data: no checksum, another valid value
    elif detail == "reads differently" and (why := valid_edit(kind, original, d, target)):
        detail = f"valid file: {why}"
    damage = _text_diff(original, target) if detail.startswith(("reads differently", "valid file")) else ""
    shutil.rmtree(d, ignore_errors=True)
    return {"kind": kind, "seed": seed, "corruption": what, "outcome": outcome, "detail": detail, "damage": damage}


# ---- valid files that say something else ----------------------------------------------------------------------------
# A damaged file that is still a valid file of its kind is another input, not a reader to fix: an Alpaca record whose
# output now reads "cohor", a chat template whose text changed, a flag file that leaves a flag out. Each rule below
# decides that by the format's reference (transformers' tokenizer and chat template on the damaged folder, compared
# with what we read) or by the format's definition (what a field may hold), never by our own reader's acceptance.
PROBE = "<s>hello</s> world <pad>, 12<unk>"


def _ref_tokenizer_agrees(d: Path) -> str | None:
    """transformers loads the damaged tokenizer folder and reads it as we do: the same special ids and ids of a
    probe text with every special token in it."""
    import transformers

    from lit_qlora.tokenizer import Tokenizer

    try:
        ref = transformers.AutoTokenizer.from_pretrained(d / "ckpt")
    except Exception:  # noqa: BLE001 - the reference refuses it: not a valid file
        return None
    ours = Tokenizer(d / "ckpt")
    same = (ours.bos_id == ref.bos_token_id and ours.eos_id == ref.eos_token_id
            and ours.encode(PROBE, bos=False).tolist() == ref(PROBE, add_special_tokens=False)["input_ids"])
    return "transformers reads the tokenizer as we do" if same else None


def _ref_gguf_agrees(d: Path) -> str | None:
    """The exported GGUF's special ids and token types are what llama.cpp's converter takes from the damaged folder:
    token types from transformers' tokenizer (an added token: control if special, else user-defined), bos / eos /
    unk / pad from gguf-py's SpecialVocab or as transformers' tokenizer has them."""
    import gguf
    import transformers

    try:
        ref = transformers.AutoTokenizer.from_pretrained(d / "ckpt")
    except Exception:  # noqa: BLE001
        return None
    reader = gguf.GGUFReader(d / "model.gguf")

    def field(name):  # the field's values (one per element of an array), or None without it
        f = reader.fields.get(name)
        return None if f is None else [int(f.parts[i][0]) for i in f.data]

    types = field("tokenizer.ggml.token_type")
    ids = {k: field(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")}
    ids = {k: v[0] if v else None for k, v in ids.items()}
    # the special ids as the converter takes them: gguf-py's SpecialVocab (tokenizer_config.json, then config.json)
    special = gguf.SpecialVocab(d / "ckpt", load_merges=False).special_token_ids
    want = {"bos": special.get("bos"), "eos": special.get("eos"), "unknown": special.get("unk"),
            "padding": special.get("pad")}
    # or as transformers reads them (the tokenizer the model trains with): the two differ where tokenizer_config.json
    # names a token of the vocabulary that tokenizer.json's added list leaves out (SpecialVocab looks only there;
    # gguf 0.19, seed 1: pad_token "x")
    tf = {"bos": ref.bos_token_id, "eos": ref.eos_token_id, "unknown": ref.unk_token_id, "padding": ref.pad_token_id}
    added = {i: (gguf.TokenType.CONTROL if t.special else gguf.TokenType.USER_DEFINED)
             for i, t in ref.added_tokens_decoder.items()}
    same = all(ids[k] in (want[k], tf[k]) for k in ids) and all(types[i] == t for i, t in added.items())
    return "the GGUF's special ids as llama.cpp's converter or transformers read the tokenizer" if same else None


def _ref_chat_template_agrees(d: Path) -> str | None:
    """transformers' apply_chat_template on the damaged folder renders what we render."""
    import transformers

    from lit_qlora.data.chat_template import render_chat
    from lit_qlora.tokenizer import Tokenizer

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    try:
        text = transformers.AutoTokenizer.from_pretrained(d / "ckpt").apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001
        return None
    same = text == render_chat(Tokenizer(d / "ckpt"), messages)
    return "transformers renders the template as we do" if same else None


def _ref_model_agrees(d: Path) -> str | None:
    """transformers builds the model of the damaged config.json (with its weights) and its logits on a probe are
    ours (the converted folder) within 1e-4: the conversion read the file as transformers reads it."""
    import transformers
    from helpers import load_ours

    try:
        ref = transformers.AutoModelForCausalLM.from_pretrained(d / "hf_only", dtype=torch.float32).eval()
    except Exception:  # noqa: BLE001 - the reference refuses it: not a valid file
        return None
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        same = torch.allclose(load_ours(d / "hf_only")(ids), ref(ids).logits, atol=1e-4)
    return "transformers builds the same model from it" if same else None


def _first_change(original: bytes, target: Path):
    """(path, old value, new value or DELETED) of the one changed JSON value, or None (not JSON / not one change)."""
    try:
        old, new = json.loads(original), json.loads(target.read_bytes())
    except (ValueError, OSError):
        return None
    path, a, b = [], old, new
    while isinstance(a, (dict, list)) and type(a) is type(b):
        if isinstance(a, dict):
            diff = [k for k in set(a) | set(b) if a.get(k, DELETED) != b.get(k, DELETED)]
        else:
            if len(a) != len(b):
                break
            diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        if len(diff) != 1:
            break
        path.append(diff[0])
        a, b = (a.get(diff[0], DELETED), b.get(diff[0], DELETED)) if isinstance(a, dict) else (a[diff[0]], b[diff[0]])
        if b is DELETED or a is DELETED or not isinstance(a, (dict, list)):
            return path, a, b
    return None


DELETED = object()


def _alpaca_record_edit(original: bytes, target: Path) -> str | None:
    """Stanford Alpaca's format: a list of records with text instruction and output, and a text input that may be
    left out. One record's text changed, or its input left out, is another valid file."""
    change = _first_change(original, target)
    if change is None or len(change[0]) != 2:
        return None
    (_, key), _, new = change
    if key in ("instruction", "output", "input") and isinstance(new, str) or key == "input" and new in (DELETED, None):
        return "an Alpaca record's text (input is optional)"
    return None


def _jsonl_rows_valid(original: bytes, target: Path) -> str | None:
    """Chat JSONL: every line an object whose messages have a role and text content; a file cut at a line end is a
    valid shorter file."""
    try:
        rows = [json.loads(ln) for ln in target.read_bytes().decode().splitlines() if ln.strip()]
    except (ValueError, OSError):
        return None
    ok = rows and all(isinstance(r, dict) and isinstance(r.get("messages"), list) and all(
        isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str)
        for m in r["messages"]) for r in rows)
    return "valid chat rows (fewer, or other text)" if ok else None


def _flag_edit(original: bytes, target: Path) -> str | None:
    """A --config / hyperparameters.json file: a flag left out (its default) or set to another value of its type is
    another valid setting (values out of a flag's range are refused by the reader, so an accepted one is in range)."""
    change = _first_change(original, target)
    if change is None or len(change[0]) != 1:
        return None
    (name,), old, new = change
    from typing import get_args, get_type_hints

    from lit_qlora.args import _groups

    hints = {n: h for g in _groups(preference=False) for n, h in get_type_hints(g).items()}
    if name not in hints:
        return None
    admits = {t for t in get_args(hints[name]) or (hints[name],) if isinstance(t, type)}  # the flag's declared types
    if float in admits and not isinstance(new, bool):
        admits.add(int)  # a whole number is a float flag's value too (jsonargparse, YAML)
    if new is DELETED or any(isinstance(new, t) for t in admits) or type(new) is type(old):
        return f"the flag {name} left out or set to another value of its type"
    return None


def _mixture_entry_removed(original: bytes, target: Path) -> str | None:
    """A --data_sources file with one whole entry (file and weight) removed, or one source's weight / epochs set to
    another positive number, is a valid mixture."""
    import yaml

    try:
        old, new = yaml.safe_load(original), yaml.safe_load(target.read_bytes())
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        return None
    if isinstance(old, dict) and isinstance(new, dict) and old.keys() == new.keys():
        changed = [k for k in old if old[k] != new[k]]
        if len(changed) != 1:
            return None
        old, new = old[changed[0]], new[changed[0]]
    if isinstance(old, list) and isinstance(new, list) and new and len(new) == len(old) - 1 and \
            any(old[:i] + old[i + 1:] == new for i in range(len(old))):
        return "a mixture with one of its sources left out"
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        diff = [(a, b) for a, b in zip(old, new) if a != b]
        if len(diff) == 1 and isinstance(diff[0][1], dict) and diff[0][0].keys() == diff[0][1].keys():
            (a, b), = diff
            keys = [k for k in a if a[k] != b[k]]
            if keys in (["weight"], ["epochs"]) and isinstance(b[keys[0]], (int, float)) and \
                    not isinstance(b[keys[0]], bool) and math.isfinite(b[keys[0]]) and b[keys[0]] > 0:
                return f"a source's {keys[0]} set to another positive number"
    return None


def valid_edit(kind: str, original: bytes, d: Path, target: Path) -> str | None:
    """Why the damaged file of a case that read differently without a word is a valid file of its kind, or None."""
    if kind in ("tokenizer_config", "tokenizer_json", "generation_config"):
        return _ref_tokenizer_agrees(d)
    if kind in ("tokenizer_config_gguf", "tokenizer_json_gguf"):
        return _ref_gguf_agrees(d)
    if kind == "chat_template_jinja":
        return _ref_chat_template_agrees(d)
    if kind in ("alpaca_json", "data_dir_file"):
        return _alpaca_record_edit(original, target)
    if kind in ("chat_jsonl",):
        return _jsonl_rows_valid(original, target)
    if kind in ("hparams_json",):
        return _flag_edit(original, target)
    if kind == "hf_config":
        return _ref_model_agrees(d)
    if kind == "data_sources_yaml":
        return _mixture_entry_removed(original, target)
    change = _first_change(original, target)
    if kind in ("model_config", "run_report_metrics_json", "report_metrics_json") and change and \
            change[0] in (["name"], ["model"]) and isinstance(change[2], str):
        return "the model's display name"
    if kind in ("run_report_metrics_json", "report_metrics_json") and change and \
            all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in change[1:]) and \
            (all(math.isfinite(v) and v >= 0 for v in change[1:]) or "loss" in str(change[0][-1])):
        return ("a run's recorded figure, another number (the report shows what the run wrote; a loss may be inf "
                "or NaN: a diverged run's)")
    if kind == "prepared_config" and change and change[0] == ["template"] and change[2] is DELETED:
        return "template left out (allowed in a hand-written prepared folder: the run records its --template)"
    return None


def _payload_only(original: bytes, target: Path) -> bool:
    """Whether the damage lies wholly in a file's data bytes, which its format does not checksum: a safetensors
    file's tensor bytes (the header untouched), a parquet file's data pages (the magic and the footer, its metadata,
    untouched; pyarrow writes no page checksums unless asked). The size kept."""
    try:
        damaged = target.read_bytes()
    except OSError:
        return False
    if len(original) < 12 or len(damaged) != len(original):
        return False
    if target.name.endswith(".parquet"):
        footer = 8 + struct.unpack("<I", original[-8:-4])[0]
        return original[:4] == damaged[:4] and original[-footer:] == damaged[-footer:]
    if not target.name.endswith(".safetensors"):
        return False
    start = 8 + struct.unpack("<Q", original[:8])[0]
    return original[:start] == damaged[:start]


def _json_diff(old, new, path: str = "") -> str:
    if type(old) is not type(new) or not isinstance(old, (dict, list)):
        return f"{path or '(top)'}: {json.dumps(old)[:60]} -> {json.dumps(new)[:60]}" if old != new else ""
    if isinstance(old, dict):
        for k in sorted(set(old) | set(new), key=str):
            if k not in new:
                return f"{path}.{k} deleted"
            if k not in old:
                return f"{path}.{k} added"
            if (d := _json_diff(old[k], new[k], f"{path}.{k}")):
                return d
        return ""
    if len(old) != len(new):
        return f"{path}: {len(old)} -> {len(new)} items"
    return next((d for i, (a, b) in enumerate(zip(old, new)) if (d := _json_diff(a, b, f"{path}[{i}]"))), "")


def _text_diff(original: bytes, target: Path, width: int = 160) -> str:
    """The first changed line of a damaged text file (what a reader accepted as different but valid), for review."""
    import difflib

    try:
        old, new = original.decode(), target.read_bytes().decode()
    except (UnicodeDecodeError, OSError):
        return "(binary)"
    try:  # JSON: the first value that differs, by its path
        return _json_diff(json.loads(old), json.loads(new))[:width]
    except ValueError:
        pass
    for line in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0):
        if line.startswith(("+", "-")) and not line.startswith(("+++", "---")):
            return line[:width]
    return ""


def _reading(value, d: Path) -> str:
    return repr(value).replace(str(d), "<case>")


_PRISTINE_READINGS: dict[tuple[str, str], str] = {}


def pristine_reading(pristine: dict[str, Path], kind: str, work: Path) -> str:
    """What the reading path of `kind` returns for the undamaged files (computed once per pristine set)."""
    key = (str(pristine["ckpt"]), kind)
    if key not in _PRISTINE_READINGS:
        d = _case_folder(pristine, work / f"{kind}-pristine")
        _PRISTINE_READINGS[key] = _reading(KINDS[kind][1](d), d)
        shutil.rmtree(d, ignore_errors=True)
    return _PRISTINE_READINGS[key]


def run_cases(pristine: dict[str, Path], seeds: range, kinds=None, work: Path | None = None) -> list[dict]:
    work = Path(work or tempfile.mkdtemp(prefix="fuzz-"))
    return [run_case(pristine, kind, seed, work) for kind in (kinds or KINDS) for seed in seeds]


def _class(r: dict) -> str:
    """refused | same reading | said so | undetectable | wrong (a silent different reading) | traceback | changed."""
    if r["outcome"] != "accepted":
        return r["outcome"]
    if r["detail"].startswith("valid file: "):
        return "valid file"
    return {"same reading": "same reading", "reads differently, said so": "said so",
            "reads differently": "wrong"}.get(r["detail"], "undetectable")


CLASSES = ("refused", "same reading", "said so", "undetectable", "valid file", "wrong", "traceback", "changed")


def table(results: list[dict]) -> str:
    """The outcome table: refused (one line), accepted with the same reading as the pristine file, accepted reading
    differently and saying so (a warning naming the file), undetectable (payload bytes), valid file (read as the
    format's reference reads it), wrong (a silent different reading of a file that is not valid: a reader to fix),
    traceback, changed."""
    counts = Counter(_class(r) for r in results)
    lines = ["| outcome | cases |", "|---|---|"]
    for name in CLASSES:
        lines.append(f"| {name} | {counts.get(name, 0)} |")
    lines.append(f"| **total** | {len(results)} |")
    accepted = Counter((r["kind"], r["corruption"], r["detail"]) for r in results if r["outcome"] == "accepted")
    if accepted:
        lines += ["", "| accepted: file kind | damage | reading | cases |", "|---|---|---|---|"]
        lines += [f"| {k} | {what} | {how} | {n} |" for (k, what, how), n in sorted(accepted.items())]
    by_kind = Counter((r["kind"], _class(r)) for r in results)
    lines += ["", "| file kind | " + " | ".join(CLASSES) + " |", "|---|" + "---|" * len(CLASSES)]
    for kind in dict.fromkeys(r["kind"] for r in results):
        lines.append(f"| {kind} | " + " | ".join(str(by_kind.get((kind, o), 0)) for o in CLASSES) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--per_kind", type=int, default=40)
    p.add_argument("--kinds", nargs="*", default=None)
    p.add_argument("--show_accepted", action="store_true", help="print what each accepted, changed reading was")
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="fuzz-pristine-"))
    pristine = build_pristine(base)
    results = run_cases(pristine, range(args.seed, args.seed + args.per_kind), args.kinds, base / "work")
    for r in results:
        if r["outcome"] in ("traceback", "changed"):
            print(f"{r['kind']} seed {r['seed']} ({r['corruption']}): {r['outcome']}: {r['detail']}")
        if args.show_accepted and r["detail"].startswith(("reads differently", "valid file")):
            print(f"accepted, {r['detail']}: {r['kind']} seed {r['seed']} ({r['corruption']}): {r['damage']}")
    print(table(results))
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
