"""Training pieces used by finetune/lora.py: loss, LR schedule, optimizers, checkpoints, metrics, signals.

No trainer class: the loop itself lives in the script, readable top to bottom.
"""
from __future__ import annotations

import csv
import math
import os
import random
import re
import signal
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from lit_qlora.lora import ADAPTER_FORMAT
from lit_qlora.utils import UserError, atomic_torch_save, atomic_write

OPTIMIZERS = ("AdamW", "AdamW8bit", "PagedAdamW", "PagedAdamW8bit", "PagedAdamW32bit")
CKPT_DIR = "checkpoints"
FINAL_ADAPTER = "lit_model_lora_finetuned.pth"


class TrainingDiverged(UserError):
    """The loss became NaN/inf: stop with a one-line message (exit code 2), keeping the last good checkpoint."""


# ---- loss -------------------------------------------------------------------------------------
def chunked_cross_entropy(logits: torch.Tensor | list[torch.Tensor], targets: torch.Tensor,
                          ignore_index: int = -100) -> torch.Tensor:
    """Sum (not mean) of token losses. `logits` may come in sequence chunks from `GPT(lm_head_chunk=...)`: the fp32
    upcast is then made chunk by chunk (autograd still keeps every chunk's fp32 log-probabilities for backward)."""
    if isinstance(logits, torch.Tensor):
        logits = [logits]
    total, start = None, 0
    for chunk in logits:
        T = chunk.size(1)
        t = targets[:, start:start + T]
        start += T
        loss = F.cross_entropy(chunk.reshape(-1, chunk.size(-1)).float(), t.reshape(-1), ignore_index=ignore_index,
                               reduction="sum")
        total = loss if total is None else total + loss
    return total


def head_chunk(config) -> int:
    """Positions per lm_head chunk for `GPT(lm_head_chunk=...)`: large vocabularies project 256 positions at a time,
    so the loss's fp32 upcast is made per chunk; 0 (all at once) below 32000 entries."""
    return 256 if config.vocab_size >= 32000 else 0


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """targets[t] = labels[t + 1]; the last position predicts nothing. Keeps the [B, T] shape so logits need no slicing."""
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    return out


# ---- up-front checks --------------------------------------------------------------------------
def check_checkpoint_dir(checkpoint_dir: Path):
    """The model's Config, after making sure the converted checkpoint is whole and agrees with its config.

    Converts a Hugging Face folder on first use. Reads only the safetensors header (and the file size), so a
    broken or partial checkpoint is refused in one line before anything heavy is loaded."""
    from lit_qlora.config import Config
    from lit_qlora.convert import LIT_CONFIG, LIT_WEIGHTS, ensure_converted, lit_param_shapes
    from lit_qlora.loader import safetensors_header

    checkpoint_dir = Path(checkpoint_dir)
    weights, cfg_file = checkpoint_dir / LIT_WEIGHTS, checkpoint_dir / LIT_CONFIG
    hf = (checkpoint_dir / "config.json").is_file()
    if checkpoint_dir.is_dir() and not hf and weights.is_file() != cfg_file.is_file():
        have, lost = (weights, cfg_file) if weights.is_file() else (cfg_file, weights)
        raise UserError(f"{checkpoint_dir} is partially converted: {have.name} is there but {lost.name} is missing "
                        "(and there is no config.json to convert from); convert the Hugging Face checkpoint again")
    if weights.is_file() and cfg_file.is_file():
        try:
            config = Config.from_file(cfg_file)
        except (ValueError, TypeError, AttributeError) as e:  # not JSON, not an object, unexpected values
            raise UserError(f"{cfg_file} is damaged ({type(e).__name__}: {e}); convert the checkpoint again") from None
    else:
        config = ensure_converted(checkpoint_dir)  # converts a Hugging Face folder on first use
    redo = ("delete it and run again to convert the Hugging Face files again" if hf
            else "convert the checkpoint again")
    size = weights.stat().st_size
    try:
        header, base = safetensors_header(weights)
        end = base + max((int(e["data_offsets"][1]) for e in header.values()), default=0)
        shapes = {k: tuple(e["shape"]) for k, e in header.items()}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise UserError(f"{weights} is damaged or truncated (unreadable header, {size} bytes); {redo}") from None
    if size < end:
        raise UserError(f"{weights} is truncated ({size} of {end} bytes); {redo}")
    expected = lit_param_shapes(config)
    for key, shape in expected.items():
        if key not in shapes:
            raise UserError(f"{weights} has no tensor {key}; the checkpoint is incomplete: {redo}")
        if shapes[key] != tuple(shape):
            raise UserError(f"{weights} holds {key} with shape {shapes[key]} but {cfg_file.name} implies "
                            f"{tuple(shape)}; the config and the weights disagree: convert the checkpoint again")
    extra = sorted(set(shapes) - set(expected))
    if extra:
        raise UserError(f"{weights} holds {extra[0]!r}, which the model in {cfg_file.name} has no place for; the config and "
                        "the weights disagree: convert the checkpoint again")
    return config


# ---- learning rate ------------------------------------------------------------------------------
def lr_at(step: int, max_steps: int, lr: float, min_lr: float, warmup_steps: int) -> float:
    """Linear warm-up to `lr`, then cosine decay to `min_lr` at `max_steps` (step counts optimizer steps)."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


# ---- optimizers -------------------------------------------------------------------------------
def make_optimizer(name: str, params: list, lr: float, weight_decay: float, device_type: str) -> torch.optim.Optimizer:
    if name not in OPTIMIZERS:
        raise UserError(f"unknown --optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)
    import bitsandbytes as bnb

    if name.startswith("Paged") and device_type == "cpu":
        # bitsandbytes falls back to the non-paged optimizer on CPU and warns every time; say it once, plainly
        print(f"note: {name} pages optimizer state to CPU memory only on CUDA; on CPU it runs as the non-paged variant",
              file=sys.stderr)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Paged optimizers are not supported on CPU.*")
        return getattr(bnb.optim, name)(params, lr=lr, weight_decay=weight_decay)


# ---- checkpoints ------------------------------------------------------------------------------
def checkpoint_path(out_dir: Path, iter_num: int) -> Path:
    return Path(out_dir) / CKPT_DIR / f"iter-{iter_num:06d}.pth"


def list_checkpoints(out_dir: Path) -> list[Path]:
    """Resumable checkpoints of a run, oldest first."""
    folder = Path(out_dir) / CKPT_DIR
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("iter-*.pth") if re.fullmatch(r"iter-\d{6}\.pth", p.name))


def save_checkpoint(path: Path, payload: dict, keep: int = 3) -> None:
    """Atomically write a resumable checkpoint (also a valid adapter file) and prune old ones.

    Temp files left by a process killed while writing (`.iter-*.tmp`) are removed once a write succeeds."""
    try:
        atomic_torch_save(payload, path)
    except OSError as e:  # disk full, quota, permissions changed mid-run: the previous checkpoints are intact
        raise UserError(f"could not write checkpoint {path} ({e.strerror or e}); the previous checkpoint is intact: "
                        "free disk space or fix the folder, then rerun with --resume") from None
    for stale in path.parent.glob(".iter-*.tmp"):
        stale.unlink(missing_ok=True)
    if keep > 0:
        for old in list_checkpoints(path.parent.parent)[:-keep]:
            old.unlink(missing_ok=True)


def load_latest_checkpoint(out_dir: Path) -> tuple[Optional[Path], Optional[dict]]:
    """Newest checkpoint that loads intact; a damaged newest one is reported and the previous one used."""
    for path in reversed(list_checkpoints(out_dir)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
            if isinstance(state, dict) and state.get("format") == ADAPTER_FORMAT and "resume" in state:
                return path, state
            print(f"warning: {path} is not a resumable checkpoint; trying the previous one", file=sys.stderr)
        except Exception as e:  # torn or corrupted file: fall back
            print(f"warning: {path} is damaged ({type(e).__name__}); trying the previous one", file=sys.stderr)
    return None, None


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_bytes(n_lora_params: int) -> int:
    """About what one resumable checkpoint takes: fp32 LoRA weights + two AdamW moments, with a margin."""
    return n_lora_params * 4 * 4


def check_disk_space(out_dir: Path, needed_bytes: int) -> None:
    import shutil

    free = shutil.disk_usage(out_dir).free
    if free < needed_bytes * 2 + (64 << 20):  # the temp file and the previous checkpoint exist side by side
        raise UserError(f"only {free / 2**20:.0f} MiB free in {out_dir}, a checkpoint needs about {needed_bytes / 2**20:.0f} MiB; "
                        "free disk space or choose another --out_dir")


# ---- metrics ------------------------------------------------------------------------------------
class MetricsLog:
    """Per-iteration metrics in out_dir/metrics.csv (and TensorBoard when it is installed)."""

    FIELDS = ("iter", "step", "loss", "lr", "iter_time_ms", "tokens", "tokens_per_sec", "val_loss", "val_ppl")

    def __init__(self, out_dir: Path, resume_iter: int = 0, enabled: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.csv"
        self.tb = None
        if not enabled:
            return
        rows = []
        if resume_iter and self.path.is_file():  # keep the rows up to the resumed iteration, drop the lost tail
            rows = [r for r in self._read_rows() if int(r["iter"]) <= resume_iter]

        def write(tmp: Path) -> None:
            with open(tmp, "w", newline="") as f:
                w = csv.DictWriter(f, self.FIELDS)
                w.writeheader()
                w.writerows(rows)

        atomic_write(self.path, write)  # a kill while rewriting must not lose the rows of the earlier run
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(out_dir) / "tensorboard"))
        except Exception:
            self.tb = None

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.FIELDS).writerow({k: row.get(k, "") for k in self.FIELDS})
        if self.tb is not None:
            for k, v in row.items():
                if k not in ("iter", "step") and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, row["iter"])

    def _read_rows(self) -> list[dict]:
        """Whole rows only: the last line of a run killed while appending may be cut short."""
        with open(self.path, newline="") as f:
            rows = []
            for r in csv.DictReader(f):
                if r.get(None) is not None or any(r.get(k) is None for k in self.FIELDS):
                    continue
                try:
                    int(r["iter"]), float(r["loss"])
                except ValueError:
                    continue
                rows.append(r)
            return rows

    def read_losses(self) -> list[float]:
        with open(self.path) as f:
            return [float(r["loss"]) for r in csv.DictReader(f) if r["loss"]]


# ---- signals ------------------------------------------------------------------------------------
class StopRequest:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint at the end of the iteration and exits."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # a second Ctrl-C means: stop now
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\n{signal.Signals(signum).name} received: saving a checkpoint after this iteration ...", file=sys.stderr)

    @property
    def requested(self) -> bool:
        return self.signum is not None


def fmt_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def is_tty() -> bool:
    return sys.stderr.isatty() and os.environ.get("TERM", "") != "dumb"
