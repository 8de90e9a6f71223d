"""Training pieces used by finetune/lora.py: loss, LR schedule, optimizers, checkpoints, metrics, signals.

No trainer class: the loop itself lives in the script, readable top to bottom.
"""
from __future__ import annotations

import csv
import math
import os
import random
import re
import shutil
import signal
import sys
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch

from lit_qlora.adapter import ADAPTER_FORMAT
from lit_qlora.data.streaming import check_stream_state
from lit_qlora.lora import LoRAConfig, lora_state_dict
from lit_qlora.quant.quantize import load_bnb
from lit_qlora.readers import check_fields, load_torch_checked, read_csv_rows
from lit_qlora.utils import UserError, atomic_torch_save, atomic_write

OPTIMIZERS = ("AdamW", "AdamW8bit", "PagedAdamW", "PagedAdamW8bit", "PagedAdamW32bit")
CKPT_DIR = "checkpoints"
FINAL_ADAPTER = "lit_model_lora_finetuned.pth"


class TrainingDiverged(UserError):
    """The loss became NaN/inf: stop with a one-line message (exit code 2), keeping the last good checkpoint."""


# ---- loss -------------------------------------------------------------------------------------
def head_chunk(config) -> int:
    """Positions per lm_head chunk for `GPT(lm_head_chunk=...)`: large vocabularies project 256 positions at a time,
    so the loss's fp32 upcast is made per chunk; 0 (all at once) below 32000 entries."""
    return 256 if config.vocab_size >= 32000 else 0


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """targets[t] = labels[t + 1]; the last position predicts nothing. Keeps the [B, T] shape, so logits need no
    slicing."""
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    return out


# ---- learning rate ------------------------------------------------------------------------------
def lr_at(step: int, max_steps: int, lr: float, min_lr: float, warmup_steps: int) -> float:
    """Linear warm-up to `lr`, then cosine decay to `min_lr` at `max_steps` (step counts optimizer steps)."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


# ---- optimizers -------------------------------------------------------------------------------
def loraplus_groups(named_params: list[tuple[str, torch.nn.Parameter]], lr: float, ratio: Optional[float]) -> list:
    """The trainable parameters as optimizer groups: one group without LoRA+ (`ratio` None); with it, as PEFT's
    `create_loraplus_optimizer` groups a LoRA model: every lora_B and every 1-D parameter (DoRA's magnitudes) at
    `ratio` times the learning rate, the rest (lora_A) at `lr`. Each group records its factor as "lr_ratio", which
    the learning-rate schedule multiplies (a plain list of parameters when there is one group)."""
    if ratio is None:
        return [p for _, p in named_params]
    b = [p for n, p in named_params if "lora_B" in n or p.ndim == 1]
    a = [p for n, p in named_params if not ("lora_B" in n or p.ndim == 1)]
    return [{"params": a, "lr": lr, "lr_ratio": 1.0}, {"params": b, "lr": lr * ratio, "lr_ratio": ratio}]


def make_optimizer(name: str, params: list, lr: float, weight_decay: float, device_type: str) -> torch.optim.Optimizer:
    """`params`: parameters, or groups of them (`loraplus_groups`)."""
    if name not in OPTIMIZERS:
        raise UserError(f"unknown --optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)
    bnb = load_bnb()

    if name.startswith("Paged") and device_type == "cpu":
        # bitsandbytes falls back to the non-paged optimizer on CPU and warns about it (at the first step, when it
        # makes the state); say it once, plainly, and not again in its words
        print(f"note: {name} pages optimizer state to CPU memory only on CUDA; on CPU it runs as the non-paged variant",
              file=sys.stderr)
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
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


def _why(e: Exception) -> str:
    """An exception as a few words on one line: its type and the start of its first line."""
    first = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def load_latest_checkpoint(out_dir: Path) -> tuple[Optional[Path], Optional[dict]]:
    """Newest checkpoint that loads intact; a damaged newest one is reported and the previous one used."""
    for path in reversed(list_checkpoints(out_dir)):
        try:
            state = load_torch_checked(path)
        except Exception as e:  # torn or corrupted file: fall back
            print(f"warning: {path} is damaged ({_why(e)}); trying the previous one", file=sys.stderr)
            continue
        if not (isinstance(state, dict) and state.get("format") == ADAPTER_FORMAT and "resume" in state):
            print(f"warning: {path} is not a resumable checkpoint; trying the previous one", file=sys.stderr)
            continue
        try:
            check_checkpoint_state(state, path)
        except UserError as e:  # loads, but its content is not what finetune writes: as damaged as a torn one
            print(f"warning: {path} is damaged ({e}); trying the previous one", file=sys.stderr)
            continue
        return path, state
    return None, None


_RESUME_FIELDS = {"step": "count", "train_time": "number", "optimizer": "object", "data": "object", "rng": "object",
                  "settings": "object", "scaler": "object"}
_DATA_FIELDS = {"epoch": "count", "position": "count", "row": "count", "seed": "count"}


def check_checkpoint_state(state: dict, where: object) -> None:
    """A loaded checkpoint is used only when every part of it is what finetune/lora.py writes: the adapter
    (`adapter.check_payload`: LoRA settings, base config, tensor shapes, finite values) and the resume state (a step,
    the data position, RNG states the generators accept, the finite optimizer state of exactly these LoRA tensors).
    A UserError naming the part otherwise: checked when the checkpoint is read, before the run writes anything."""
    from lit_qlora.adapter import Adapter
    from lit_qlora.lora import LoRAConfig, meta_model

    fix = "use an earlier checkpoint (or --resume auto)"
    Adapter.from_payload(state, where)
    r = check_fields(state["resume"], f"{where} resume", _RESUME_FIELDS, ("step", "optimizer", "data", "rng"), fix)
    if isinstance(r["data"], dict) and "streaming" in r["data"]:  # --streaming: a place in the source's files
        check_stream_state(r["data"], f"{where} resume.data", fix)
    else:
        check_fields(r["data"], f"{where} resume.data", _DATA_FIELDS, ("epoch", "position"), fix)
    rng = r["rng"]
    try:
        torch.Generator().set_state(rng["torch"])
        random.Random().setstate(rng["python"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise UserError(f"{where} resume.rng is not a saved RNG state ({type(e).__name__}); {fix}") from None
    opt = r["optimizer"]
    groups, per_param = opt.get("param_groups"), opt.get("state")
    if not (isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
            and isinstance(per_param, dict)):
        raise UserError(f"{where} resume.optimizer is not an optimizer state (param_groups, state); {fix}")
    from lit_qlora.config import Config

    lora = LoRAConfig.from_dict(state["lora_config"])
    model = meta_model(Config.from_dict(state["model_config"]), lora)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ordered = loraplus_groups(trainable, 1.0, lora.loraplus_lr_ratio)  # the optimizer's order: its groups' (LoRA+)
    shapes = [tuple(p.shape) for g in ordered for p in (g["params"] if isinstance(g, dict) else [g])]
    ids = [i for g in groups for i in g["params"]]
    if all(isinstance(i, int) for i in ids):  # one process's optimizer: by position in the trainable parameters
        if sorted(ids) != list(range(len(shapes))):
            raise UserError(f"{where} resume.optimizer holds {len(ids)} parameters, the adapter {len(shapes)}; {fix}")
        for i, entry in per_param.items():
            if not (isinstance(entry, dict) and isinstance(i, int) and 0 <= i < len(shapes)):
                raise UserError(f"{where} resume.optimizer state {i!r} is not of a parameter of the adapter; {fix}")
            for name in ("exp_avg", "exp_avg_sq"):
                t = entry.get(name)
                if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != shapes[i]):
                    raise UserError(f"{where} resume.optimizer state {i} {name} has shape "
                                    f"{tuple(getattr(t, 'shape', ()))}, its parameter {shapes[i]}; {fix}")
                if t is not None and t.is_floating_point() and not torch.isfinite(t).all():
                    raise UserError(f"{where} resume.optimizer state {i} {name} holds non-finite values (NaN or inf)"
                                    f"; {fix}")


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
    free = shutil.disk_usage(out_dir).free
    if free < needed_bytes * 2 + (64 << 20):  # the temp file and the previous checkpoint exist side by side
        raise UserError(f"only {free / 2**20:.0f} MiB free in {out_dir}, a checkpoint needs about "
                        f"{needed_bytes / 2**20:.0f} MiB; "
                        "free disk space or choose another --out_dir")


# ---- metrics ------------------------------------------------------------------------------------
METRICS_JSON = "metrics.json"
MEMORY_KINDS = ("peak RSS", "cuda max allocated")
# metrics.json's figures that reports show, as finetune/lora.py's summarize writes them: the kind of each, the most a
# real run can reach (memory in GB, seconds, tokens/s), and the keys every metrics.json has had
_METRICS_FIELDS = {"model": "str", "precision": "str", "quantize": "str", "optimizer": "str",
                   "micro_batch_size": "size", "batch_size": "size", "devices": "size", "num_nodes": "size",
                   "iterations": "count", "max_seq_length": "size", "activation_checkpointing": "bool",
                   "compile": "bool", "packing": "bool", "training_time_s": "number", "tokens_per_sec": "number",
                   "peak_memory_gb": "number", "rss_after_load_gb": "number", "memory_kind": "str",
                   "first_train_loss": "float", "final_train_loss": "float", "final_val_loss": "float",
                   "best_val_loss": "float", "skipped_steps": "count", "fp16_overflow_skips": "count",
                   "real_token_share": "fraction", "row_fill": "fraction", "trainable_params": "count",
                   "quantized_params": "count", "quantized_bytes": "count", "dense_bytes": "count",
                   "bits_per_quantized_param": "number", "stopped_early": "bool", "stopped_at_iter": "count",
                   "early_stopping_patience": "count", "best_iter": "count", "best_adapter": "str"}
_METRICS_REQUIRED = ("model", "precision", "quantize", "optimizer", "micro_batch_size", "iterations",
                     "training_time_s", "peak_memory_gb", "memory_kind", "trainable_params")
_METRICS_KEYS = (*_METRICS_REQUIRED, "batch_size", "devices", "max_seq_length", "lora", "activation_checkpointing",
                 "tokens_per_sec", "final_train_loss", "final_val_loss", "first_train_loss", "rss_after_load_gb",
                 "quantized_bytes", "bits_per_quantized_param", "dense_bytes")  # in every metrics.json (some null)
_METRICS_BOUNDS = {"training_time_s": 1e9, "tokens_per_sec": 1e12, "peak_memory_gb": 1e6, "rss_after_load_gb": 1e6,
                   "bits_per_quantized_param": 64}
_METRICS_ABOVE_ZERO = ("peak_memory_gb", "rss_after_load_gb")  # a process that loaded a model holds some memory


def check_metrics_json(m: dict, where: object, fix: str) -> dict:
    """A metrics.json object as finetune/lora.py writes it (`m`, read by `readers.read_json`): every figure a report
    shows of its kind, within what a run can reach (no negative time, no 1e308 GB), the settings among the values
    they can take, a loss non-negative (or NaN / inf: a diverged run). A UserError naming the field otherwise."""
    from lit_qlora.precision import PRECISIONS
    from lit_qlora.quant.quant_mode import QuantMode

    check_fields(m, where, {**_METRICS_FIELDS, "lora": "object"}, _METRICS_REQUIRED, fix)
    missing = next((k for k in _METRICS_KEYS if k not in m), None)
    if missing:
        raise UserError(f"{where} has no {missing!r} (every metrics.json finetune/lora.py writes has it); {fix}")
    for key, most in _METRICS_BOUNDS.items():
        v = m.get(key)
        if v is not None and not 0 <= v <= most:
            raise UserError(f"{where}: {key} is {v!r}, expected a number from 0 to {most:g}; {fix}")
        if v is not None and key in _METRICS_ABOVE_ZERO and v == 0:
            raise UserError(f"{where}: {key} is {v!r}, but a run that loaded a model holds memory (above 0 GB); {fix}")
    for key in ("first_train_loss", "final_train_loss", "final_val_loss", "best_val_loss"):
        v = m.get(key)
        if v is not None and v < 0:
            raise UserError(f"{where}: {key} is {v!r}, expected a loss (0 or more, or NaN for a diverged run); {fix}")
    choices = {"precision": PRECISIONS, "quantize": ("none", *(q.value for q in QuantMode)), "optimizer": OPTIMIZERS,
               "memory_kind": MEMORY_KINDS}
    for key, allowed in choices.items():
        if m.get(key) is not None and m[key] not in allowed:
            shown = m[key] if len(m[key]) <= 40 else m[key][:37] + "..."
            raise UserError(f"{where}: {key} is {shown!r}, expected one of {', '.join(allowed)}; {fix}")
    return m


class MetricsLog:
    """Per-iteration metrics in out_dir/metrics.csv (and TensorBoard when it is installed)."""

    FIELDS = ("iter", "step", "loss", "lr", "iter_time_ms", "tokens", "tokens_per_sec", "val_loss", "val_ppl")

    def __init__(self, out_dir: Path, resume_iter: int = 0, enabled: bool = True, extra_fields: tuple = ()) -> None:
        """`extra_fields`: more columns after FIELDS (finetune/dpo.py's rewards)."""
        self.enabled = enabled
        self.FIELDS = (*self.FIELDS, *extra_fields)
        self.path = Path(out_dir) / "metrics.csv"
        self.tb = None
        if not enabled:
            return
        rows = []
        if resume_iter and os.path.lexists(self.path):  # keep the rows up to the resumed iteration, drop the lost tail
            rows = [r for r in self.read_rows(self.path) if int(r["iter"]) <= resume_iter]

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

    def close(self) -> None:
        """Write out what TensorBoard still buffers (its writer flushes on its own every two minutes)."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None

    @classmethod
    def read_rows(cls, path: Path) -> list[dict]:
        """Whole rows only: the last line of a run killed while appending may be cut short. A row holds a training
        loss, or (iteration 0, the starting point) a validation loss alone. A file that is not CSV text (undecodable
        bytes, a broken quote, a folder in its place) is a UserError naming it: finetune reads it before it writes
        anything (`check_out_dir`), so a resumed run never starts over a metrics.csv it cannot keep."""
        fix = "move it away (its rows are lost) and resume again"
        rows = []
        for r in read_csv_rows(path, "metrics file", fix):
            if r.get(None) is not None or any(r.get(k) is None for k in cls.FIELDS):
                continue
            try:
                int(r["iter"]), float(r["loss"] or r["val_loss"])
            except ValueError:
                continue
            rows.append(r)
        return rows


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
        print(f"\n{signal.Signals(signum).name} received: saving a checkpoint after this iteration ...",
              file=sys.stderr)

    @property
    def requested(self) -> bool:
        return self.signum is not None


def fmt_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def is_tty() -> bool:
    return sys.stderr.isatty() and os.environ.get("TERM", "") != "dumb"


# ---- what finetune/lora.py checks before it starts ----------------------------------------------------
def check_out_dir(out_dir: Path, resume: Optional[str]) -> None:
    """Refuse to start over a previous run (it would be overwritten) unless resuming it."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-test-{os.getpid()}"  # several processes may check at once (torchrun)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write to --out_dir {out_dir} ({e.strerror}); choose a writable folder")
    if resume in (None, "false", "no") and list_checkpoints(out_dir):
        raise UserError(f"{out_dir} already holds checkpoints of a run; pass --resume to continue it or choose "
                        "another --out_dir")
    # what the run will write must be writable as files (a folder or a symlink loop in their place would fail only at
    # the end, after the training), and what a resumed run keeps must be readable, before anything is written
    for name in OUTPUT_FILES:
        path = out_dir / name
        if os.path.lexists(path) and not os.path.isfile(path):
            kind = "a folder" if os.path.isdir(path) else "not a regular file"
            raise UserError(f"{path} is {kind}, where the run writes its {name}; move it away or choose another "
                            "--out_dir")
    ckpts = out_dir / CKPT_DIR
    if os.path.lexists(ckpts) and not os.path.isdir(ckpts):
        raise UserError(f"{ckpts} is not a folder, where the run keeps its checkpoints; move it away or choose "
                        "another --out_dir")
    if resume not in (None, "false", "no") and (out_dir / "metrics.csv").is_file():
        MetricsLog.read_rows(out_dir / "metrics.csv")


OUTPUT_FILES = ("metrics.csv", "metrics.json", "hyperparameters.json", FINAL_ADAPTER)


def find_resume(out_dir: Path, resume: Optional[str]) -> tuple[Optional[Path], Optional[dict]]:
    """The checkpoint `--resume` names (auto/true: the newest intact one in out_dir) and its content."""
    if resume in (None, "false", "no"):
        return None, None
    if resume in ("auto", "true", "yes"):
        path, state = load_latest_checkpoint(out_dir)
        if state is None and resume != "auto":
            raise UserError(f"--resume: no intact checkpoint in {out_dir / CKPT_DIR}; use --resume auto to start fresh")
        return path, state
    path = Path(resume)
    if not path.is_file():
        raise UserError(f"--resume {path}: no such checkpoint; pass --resume auto or an iter-*.pth file")
    try:
        state = load_torch_checked(path)
    except Exception as e:
        raise UserError(f"--resume {path}: the checkpoint is damaged ({_why(e)}); pass an earlier one or "
                        "--resume auto") from None
    if not (isinstance(state, dict) and state.get("format") == ADAPTER_FORMAT and "resume" in state):
        raise UserError(f"--resume {path} is not a resumable checkpoint of finetune/lora.py; pass an iter-*.pth file")
    check_checkpoint_state(state, f"--resume {path}")
    return path, state


def check_resume_compatible(state: dict, now: dict) -> None:
    """A run resumes only with the settings its checkpoint was made with (`now`: the same keys as saved)."""
    saved = dict(state["resume"].get("settings", {}))
    if isinstance(saved.get("lora"), dict):  # LoRA fields added since it was saved (rslora, dora, ...): their defaults
        saved["lora"] = {**asdict(LoRAConfig()), **saved["lora"]}
    for k, v in now.items():
        if k in saved and saved[k] != v and k != "checkpoint_dir":
            raise UserError(f"the checkpoint was made with {k}={saved[k]} but this run uses {k}={v}; resume with the "
                            "same settings or start a new --out_dir")


# ---- during the loop -------------------------------------------------------------------------------
def shard_batch(batch: dict, rank: int, world: int) -> dict:
    """This device's rows of a global micro-batch, trimmed to their own longest row."""
    if world == 1:
        return batch
    rows = slice(rank, None, world)
    part = {k: v[rows] for k, v in batch.items()}
    T = int(part["lengths"].max()) if len(part["lengths"]) else 1
    return {k: v[:, :T] if v.dim() == 2 else v for k, v in part.items()}


def all_finite(tensors) -> bool:
    """True when no element of the tensors (None entries skipped) is NaN or inf; one device sync in all. Sharded
    tensors (FSDP's DTensors) are checked shard by shard and the ranks agree on the answer (every rank must call)."""
    peaks, sharded, device = [], False, None
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # a DTensor: this rank's shard (maybe empty)
            sharded, device, t = True, t.device, t.to_local()
        if t.numel():
            peaks.append(t.detach().abs().amax().float())
    ok = torch.isfinite(torch.stack(peaks)).all() if peaks else torch.tensor(True, device=device)
    if sharded:
        ok = ok.to(device=device, dtype=torch.float32)
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
    return bool(ok)


def check_ranks_agree(fabric, model: torch.nn.Module) -> float:
    """DDP keeps one model: compare every LoRA tensor with rank 0's and say how far apart the ranks are."""
    diff = torch.zeros((), device=fabric.device)
    for v in lora_state_dict(model).values():
        ref = fabric.broadcast(v.detach().clone(), src=0)
        diff = torch.maximum(diff, (v.float() - ref.to(v.device).float()).abs().max())
    diff = float(fabric.all_reduce(diff, reduce_op="max"))
    if diff <= 1e-6:
        fabric.print(f"ranks agree: max diff {diff:.3g}", file=sys.stderr)
    else:
        fabric.print(f"warning: DDP ranks disagree: max diff {diff:.3g} between LoRA weights", file=sys.stderr)
    return diff


def show_progress(step: int, max_steps: int, loss: float, dt: float, tokens: int, elapsed: float) -> None:
    """A progress bar on a terminal; otherwise one parsable line per iteration (the benchmark harness reads it)."""
    eta = elapsed / step * (max_steps - step)
    if is_tty():
        bar = "#" * int(30 * step / max_steps)
        print(f"\r[{bar:<30}] iter {step}/{max_steps} | loss {loss:.4f} | {tokens / dt:.0f} tok/s | ETA {fmt_eta(eta)} "
              " ",
              end="" if step < max_steps else "\n", file=sys.stderr, flush=True)
    else:
        print(f"iter {step} | loss {loss:.4f} | iter time: {dt * 1000:.1f} ms | tokens {tokens} | ETA {fmt_eta(eta)}",
              flush=True)


# ---- one run per out_dir ------------------------------------------------------------------------------------------
_HELD: dict[str, int] = {}  # out_dir -> the fd holding its lock, for the life of the process


def _launched_rank_above_zero() -> bool:
    """Whether this process is a rank other than 0 of a launched run (torchrun, SLURM, Fabric's own launcher): the
    lock of out_dir is rank 0's."""
    return any(os.environ.get(k, "0") not in ("", "0") for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                                                                  "SLURM_PROCID"))


def _lock_holder(fd: int) -> Optional[int]:
    """The pid holding the flock on the file open as `fd`, from /proc/locks (None where it cannot be told)."""
    st = os.fstat(fd)
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if "FLOCK" in parts and len(parts) >= 6:
                    i = parts.index("FLOCK")
                    pid, dev_ino = parts[i + 3], parts[i + 4]
                    if dev_ino.rsplit(":", 1)[-1] == str(st.st_ino) and pid.isdigit():
                        return int(pid)
    except (OSError, ValueError, IndexError):
        pass
    return None


def lock_out_dir(out_dir: Path) -> None:
    """Hold an exclusive flock on the --out_dir folder itself for the life of this process: a second run on the same
    folder is refused in one line naming the first one's pid. The kernel releases the lock when the process ends,
    however it ends (a SIGKILLed run leaves nothing to clean up: `--resume` just works), and no file is created."""
    import fcntl

    out_dir = Path(out_dir)
    key = str(out_dir.resolve())
    if key in _HELD or _launched_rank_above_zero():
        return
    fd = os.open(out_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pid = _lock_holder(fd)
        os.close(fd)
        who = f"process {pid}" if pid else "another process"
        raise UserError(f"--out_dir {out_dir} is in use by another run ({who}); wait for it to end, stop it, or "
                        "choose another --out_dir") from None
    _HELD[key] = fd


def unlock_out_dir(out_dir: Path) -> None:
    """Release `lock_out_dir`'s lock (a process ending releases it anyway)."""
    import fcntl

    fd = _HELD.pop(str(Path(out_dir).resolve()), None)
    if fd is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
