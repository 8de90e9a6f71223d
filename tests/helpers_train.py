"""One tiny training setup for the CLI tests: a tiny Llama HF folder (converted once), a byte-level BPE tokenizer
and ~64 samples of a learnable task, plus helpers to run the real scripts as subprocesses.

Everything is built locally (no downloads) and small enough that a few training iterations take well under a
second after the ~3 s interpreter + torch import of each subprocess.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
FINETUNE = ROOT / "finetune" / "lora.py"
GENERATE_LORA = ROOT / "generate" / "lora.py"
GENERATE_BASE = ROOT / "generate" / "base.py"
MERGE = ROOT / "scripts" / "merge_lora.py"

VOCAB = 320  # tokenizer and model
KINDS = {"animal": ["cat", "dog", "owl", "bee", "pig", "rat", "yak", "ant", "cow", "elk", "fox"],
         "color": ["red", "tan", "blue", "pink", "gray", "gold", "teal", "jade", "navy", "rose", "lime"],
         "thing": ["map", "pen", "cup", "box", "hat", "key", "log", "net", "van", "bus", "jar"]}


def make_records(n: int = 64, seed: int = 0) -> list[dict]:
    """A learnable task: say whether a short word names an animal, a color or a thing (the word decides)."""
    rng = random.Random(seed)
    pairs = [(w, k) for k, ws in KINDS.items() for w in ws]
    return [{"instruction": "kind", "input": w, "output": k} for w, k in (rng.choice(pairs) for _ in range(n))]


def build_tiny_setup(base: Path) -> dict[str, Path]:
    """{ckpt, data, data_file}: a converted tiny Llama with its tokenizer, and a data folder with one alpaca json."""
    from helpers import make_tiny_hf_model
    from helpers_tokenizer import make_hf_bpe_tokenizer

    from lit_qlora.convert import ensure_converted

    ckpt = Path(base) / "tiny-llama"
    make_tiny_hf_model("llama", ckpt, seed=0, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, max_position_embeddings=128)
    make_hf_bpe_tokenizer(ckpt, vocab_size=VOCAB)
    ensure_converted(ckpt, quiet=True)
    data = Path(base) / "data"
    data.mkdir(parents=True, exist_ok=True)
    data_file = data / "tasks.json"
    data_file.write_text(json.dumps(make_records(), indent=1))
    return {"ckpt": ckpt, "data": data, "data_file": data_file}


_CACHE: dict = {}


def tiny_setup(tmp_path_factory) -> dict[str, Path]:
    """`build_tiny_setup` once per test session, whichever test module asks first."""
    if "setup" not in _CACHE:
        _CACHE["setup"] = build_tiny_setup(tmp_path_factory.mktemp("tiny_setup"))
    return _CACHE["setup"]


LEARN_ARGS = dict(max_iters=40, learning_rate=1e-2, micro_batch_size=4, eval_interval=4, lora_r=8, lora_alpha=16,
                  lora_query=True,
                  lora_key=True, lora_value=True, lora_projection=True, lora_mlp=True, lora_head=True,
                  eval_max_new_tokens=6)


def trained_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """(out_dir, result) of one run that learns the tiny task: 40 iterations, lr 1e-2, every LoRA target, 32-true."""
    if "trained" not in _CACHE:
        setup = tiny_setup(tmp_path_factory)
        out = tmp_path_factory.mktemp("trained") / "out"
        _CACHE["trained"] = (out, train(setup, out, **LEARN_ARGS))
    return _CACHE["trained"]


# LoRA dropout on: a resumed run retraces an uninterrupted one only if the RNG state (the dropout masks) is restored
RESUME_ARGS = dict(max_iters=24, save_interval=4, keep_checkpoints=0, eval_interval=8, batch_size=4, micro_batch_size=2,
                   warmup_steps=4, learning_rate=1e-2, precision="32-true", lora_mlp=True, lora_dropout=0.1)


def resume_reference(tmp_path_factory) -> Path:
    """out_dir of an uninterrupted run with RESUME_ARGS (24 iterations, a checkpoint every 4, all kept)."""
    if "resume_ref" not in _CACHE:
        out = tmp_path_factory.mktemp("resume_ref") / "A"
        train(tiny_setup(tmp_path_factory), out, **RESUME_ARGS)
        _CACHE["resume_ref"] = out
    return _CACHE["resume_ref"]


def losses_by_iter(out: Path) -> dict[int, float]:
    return {int(r["iter"]): float(r["loss"]) for r in read_metrics(out)}


def assert_same_run(a: Path, b: Path, first_iter: int = 1) -> None:
    """b retraced a (RESUME_ARGS runs): same per-iteration losses from `first_iter` on, same final adapter and
    checkpoint."""
    la, lb = losses_by_iter(a), losses_by_iter(b)
    n = RESUME_ARGS["max_iters"]
    assert sorted(lb) == sorted(la) == list(range(1, n + 1)), (sorted(la), sorted(lb))
    for i in range(first_iter, n + 1):
        assert abs(lb[i] - la[i]) <= 1e-6, (i, la[i], lb[i])
    final = "lit_model_lora_finetuned.pth"
    assert max_abs_diff(load_lora(a / final), load_lora(b / final)) < 1e-6
    last = f"checkpoints/iter-{n:06d}.pth"
    assert max_abs_diff(load_lora(a / last), load_lora(b / last)) < 1e-6


def fresh_data_dir(src: Path, dest: Path) -> Path:
    """A copy of a raw data folder (the on-the-fly cache of `src` is not copied, so nothing is shared)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.is_file():
            shutil.copy(f, dest / f.name)
    return dest


def env() -> dict:
    e = dict(os.environ)
    e.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
             PYTHONPATH=str(ROOT), TERM="dumb")
    e.pop("LIT_QLORA_DEBUG", None)
    return e


def train_args(setup: dict, out_dir: Path, max_iters: int = 3, **kw) -> list[str]:
    """The finetune/lora.py command line: fast defaults (tiny evals, no warm-up), overridable by keyword."""
    opts = dict(checkpoint_dir=setup["ckpt"], data_dir=setup["data"], out_dir=out_dir, max_iters=max_iters,
                micro_batch_size=2, eval_interval=max_iters, eval_iters=2, eval_max_new_tokens=4,
                save_interval=max_iters,
                template="plain", precision="32-true", warmup_steps=0, learning_rate=1e-3, lora_dropout=0.0)
    opts.update(kw)
    args = []
    for k, v in opts.items():
        if v is not None:
            args += [f"--{k}", str(v)]
    return args


def run_script(script: Path, args: list, timeout: float = 180, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True, env=env(),
                          cwd=ROOT, timeout=timeout, **kw)


def spawn_script(script: Path, args: list) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT)


def train(setup: dict, out_dir: Path, max_iters: int = 3, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = run_script(FINETUNE, train_args(setup, out_dir, max_iters, **kw))
    if check:
        assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


def read_metrics(out_dir: Path) -> list[dict]:
    import csv

    with open(Path(out_dir) / "metrics.csv") as f:  # training iterations only (row 0 holds the starting validation)
        return [r for r in csv.DictReader(f) if r["loss"]]


def load_lora(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=False)["lora"]


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    """{relative path: (mtime_ns, sha256)} of every file under `folder`."""
    out = {}
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            out[str(p.relative_to(folder))] = (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def assert_one_line_error(r: subprocess.CompletedProcess, *expect: str, code: int = 2) -> str:
    assert r.returncode == code, f"exit {r.returncode}\nstderr:\n{r.stderr}"
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for e in expect:
        assert e in lines[0], f"{e!r} not in {lines[0]!r}"
    return lines[0]


def last_line(text: str) -> Optional[str]:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else None
