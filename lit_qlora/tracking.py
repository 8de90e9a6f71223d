"""Following a run: experiment trackers (--logger, through Lightning's own loggers) and early stopping on the
validation loss (--early_stopping_patience, --save_best), for finetune/lora.py's loop.

`RunWatch` is what the loop talks to: `log(row)` after each row of metrics.csv, `validated(step, val_loss, save_best)`
after each validation (True: stop now), `finish(summary, adapter)` at the end. Its early-stopping state is a function
of the validation losses alone, so a resumed run rebuilds it from the rows of metrics.csv it keeps.

Loggers (lightning.pytorch.loggers, the ones that also take hyperparameters): csv and tensorboard under
<logger_dir>/logs/, wandb (offline, under <logger_dir>/wandb/, unless W&B is configured: WANDB_MODE, WANDB_API_KEY or
a `wandb login`) and mlflow (a file store at <logger_dir>/mlruns unless MLFLOW_TRACKING_URI names another).
logger_dir: --logger_dir, default out_dir. Each package is imported only when its logger is chosen.
"""
from __future__ import annotations

import importlib.util
import json
import math
import netrc
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from lit_qlora.utils import UserError

LOGGERS = {"csv": None, "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # name: package needed
BEST_ADAPTER = "lit_model_lora_best.pth"
PROJECT = "lit-qlora"  # the W&B project and the MLflow experiment


def parse_loggers(value: Optional[str]) -> list[str]:
    """`--logger csv,wandb` -> ["csv", "wandb"]; a one-line UserError for an unknown name or a missing package."""
    names = [n.strip().lower() for n in (value or "").replace("+", ",").split(",") if n.strip()]
    for n in names:
        if n not in LOGGERS:
            raise UserError(f"unknown --logger {n!r}; choose any of {', '.join(LOGGERS)} (comma-separated)")
        package = LOGGERS[n]
        if package and importlib.util.find_spec(package) is None:
            extra = "mlflow-skinny" if package == "mlflow" else package
            raise UserError(f"--logger {n} needs the {package} package, which is not installed; "
                            f"`pip install {extra}` (or `pip install 'lit-qlora[track]'`)")
    return list(dict.fromkeys(names))


def wandb_configured() -> bool:
    """Whether the user set W&B up to sync (a mode or key in the environment, or `wandb login`'s netrc entry)."""
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(os.environ.get("WANDB_BASE_URL", "api.wandb.ai").split("//")[-1]) \
            is not None
    except (OSError, netrc.NetrcParseError):
        return False


def make_loggers(names: list[str], logger_dir: Path, run_name: str) -> list:
    """Lightning logger objects for `names`, writing under `logger_dir`."""
    loggers = []
    for n in names:
        if n == "csv":
            from lightning.pytorch.loggers import CSVLogger

            loggers.append(CSVLogger(save_dir=str(logger_dir / "logs"), name="csv"))
        elif n == "tensorboard":
            from lightning.pytorch.loggers import TensorBoardLogger

            loggers.append(TensorBoardLogger(save_dir=str(logger_dir / "logs"), name="tensorboard"))
        elif n == "wandb":
            from lightning.pytorch.loggers import WandbLogger

            loggers.append(WandbLogger(name=run_name, project=os.environ.get("WANDB_PROJECT", PROJECT),
                                       save_dir=str(logger_dir), offline=not wandb_configured()))
        elif n == "mlflow":
            from lightning.pytorch.loggers import MLFlowLogger

            uri = os.environ.get("MLFLOW_TRACKING_URI")
            if not uri:  # mlflow 3 refuses a file store unless allowed: the one place that needs no server
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
                uri = (logger_dir / "mlruns").resolve().as_uri()
            loggers.append(MLFlowLogger(experiment_name=os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT),
                                        run_name=run_name, tracking_uri=uri))
    return loggers


def flat(d: dict, prefix: str = "") -> dict:
    """{"lora": {"r": 8}} -> {"lora/r": 8}: one level of names every tracker shows as columns."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}/"))
        elif isinstance(v, (list, tuple)):
            out[f"{prefix}{k}"] = json.dumps(v, default=str)
        else:
            out[f"{prefix}{k}"] = v if v is None or isinstance(v, (int, float, str, bool)) else str(v)
    return out


class EarlyStopping:
    """Stop after `patience` validations in a row without a val_loss below the best by more than `min_delta`
    (patience None: never stop; the best is still tracked)."""

    def __init__(self, patience: Optional[int] = None, min_delta: float = 0.0) -> None:
        self.patience, self.min_delta = patience, min_delta
        self.best: Optional[float] = None
        self.best_iter: Optional[int] = None
        self.bad = 0  # validations since the best

    def update(self, step: int, val_loss: float) -> bool:
        """Take one validation; True when it is a new best."""
        if math.isfinite(val_loss) and (self.best is None or val_loss < self.best - self.min_delta):
            self.best, self.best_iter, self.bad = val_loss, step, 0
            return True
        self.bad += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.bad >= self.patience


class RunWatch:
    """The loggers and early stopping of one run (rank 0 logs; every rank decides to stop, on the same losses)."""

    def __init__(self, out_dir: Path, loggers: Optional[str] = None, logger_dir: Optional[Path] = None,
                 patience: Optional[int] = None, min_delta: float = 0.0, save_best: bool = False,
                 resume_iter: int = 0, enabled: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.save_best = save_best
        self.stopping = EarlyStopping(patience, min_delta)
        self.stopped_at: Optional[int] = None
        self.loggers: list = []
        if resume_iter:  # the validations before the resumed iteration, as metrics.csv kept them
            self._replay(resume_iter)
        if enabled:
            hparams_file = self.out_dir / "hyperparameters.json"
            hparams = json.loads(hparams_file.read_text()) if hparams_file.is_file() else {}
            self.loggers = make_loggers(parse_loggers(loggers), Path(logger_dir or out_dir), self.out_dir.name)
            for lg in self.loggers:
                lg.log_hyperparams(flat(hparams))

    def _replay(self, resume_iter: int) -> None:
        from lit_qlora.training import MetricsLog

        path = self.out_dir / "metrics.csv"
        if not path.is_file():
            return
        for r in MetricsLog.read_rows(path):
            if int(r["iter"]) <= resume_iter and r.get("val_loss"):
                self.stopping.update(int(r["iter"]), float(r["val_loss"]))

    def log(self, row: dict) -> None:
        metrics = {k: v for k, v in row.items() if k not in ("iter", "step") and isinstance(v, (int, float))
                   and not isinstance(v, bool)}
        for lg in self.loggers:
            lg.log_metrics(metrics, step=int(row["iter"]))

    def validated(self, step: int, val_loss: float, save_best: Callable[[Path], Any]) -> bool:
        """After a validation at `step`: write the best adapter when it improved (--save_best; `save_best(path)`
        writes it, on every rank), and True when early stopping says stop."""
        if self.stopping.update(step, val_loss) and self.save_best:
            save_best(self.out_dir / BEST_ADAPTER)
        if self.stopping.should_stop:
            self.stopped_at = step
            return True
        return False

    def summary(self) -> dict:
        """What metrics.json records about early stopping and the best adapter."""
        best = self.out_dir / BEST_ADAPTER if self.save_best and self.stopping.best_iter is not None else None
        return dict(stopped_early=self.stopped_at is not None, stopped_at_iter=self.stopped_at,
                    early_stopping_patience=self.stopping.patience, best_iter=self.stopping.best_iter,
                    best_val_loss=self.stopping.best, best_adapter=str(best) if best else None)

    def closing_line(self, final_adapter: Path) -> str:
        """One line saying which adapter is which (and why the run ended early, when it did)."""
        s = self.stopping
        why = (f"Stopped early at iteration {self.stopped_at}: no val_loss improvement in {s.patience} validations"
               f"{f' (min delta {s.min_delta:g})' if s.min_delta else ''}. " if self.stopped_at is not None else "")
        if s.best_iter is None:
            return f"{why}Last adapter: {final_adapter}"
        best = f"best adapter (iteration {s.best_iter}, val_loss {s.best:.4f}): " + (
            str(self.out_dir / BEST_ADAPTER) if self.save_best else "not kept (--save_best true keeps it)")
        return f"{why}Last adapter: {final_adapter}; {best}"

    def finish(self, summary: dict, final_adapter: Path, status: str = "success") -> None:
        """The run's figures (memory report, time, tokens/s, the best validation) and the adapter paths, to every
        logger, then close them."""
        figures = {f"final/{k}": v for k, v in summary.items() if isinstance(v, (int, float)) and
                   not isinstance(v, bool) and v is not None}
        paths = {"adapter_path": str(final_adapter), "best_adapter_path": summary.get("best_adapter") or "",
                 "memory_kind": summary.get("memory_kind", "")}
        for lg in self.loggers:
            try:
                lg.log_metrics(figures, step=int(summary.get("iterations") or 0))
                lg.log_hyperparams(paths)
                lg.finalize(status)
            except Exception as e:  # a tracker that fails at the end must not lose the run's own files
                print(f"warning: the {type(lg).__name__} failed at the end ({type(e).__name__}: {e}); the run's "
                      "files in out_dir are complete", file=sys.stderr)
        if any(type(lg).__name__ == "WandbLogger" for lg in self.loggers):
            import wandb

            wandb.finish()
        self.loggers = []
