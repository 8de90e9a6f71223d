"""Following a run: experiment trackers (--logger, through Lightning's own loggers) and early stopping on the
validation loss (--early_stopping_patience, --save_best), for finetune/lora.py's loop.

`RunWatch` is what the loop talks to: `log(row)` after each row of metrics.csv, `validated(step, val_loss, save_best)`
after each validation (True: stop now), `finish(summary, adapter)` at the end. Its early-stopping state is a function
of the validation losses alone, so a resumed run rebuilds it from the rows of metrics.csv it keeps.

Loggers (lightning.pytorch.loggers, the ones that also take hyperparameters): csv and tensorboard under
<logger_dir>/logs/, wandb (offline, under <logger_dir>/wandb/, unless W&B is configured: WANDB_MODE, WANDB_API_KEY or
a `wandb login`) and mlflow (MLflow's recommended local store, a SQLite database at <logger_dir>/mlflow.db, unless
MLFLOW_TRACKING_URI names another; MLflow 3 refuses to open its older file store, ./mlruns, without an opt-in).
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
MLFLOW_DB = "mlflow.db"  # the local MLflow store under --logger_dir (sqlite:///<logger_dir>/mlflow.db)
MLFLOW_LOCAL_STORE = ("sqlalchemy", "alembic")  # what MLflow's SQLite store needs beyond mlflow-skinny
BEST_ADAPTER = "lit_model_lora_best.pth"
PROJECT = "lit-qlora"  # the W&B project and the MLflow experiment


def parse_loggers(value: Optional[str]) -> list[str]:
    """`--logger csv,wandb` -> ["csv", "wandb"]; a one-line UserError for an unknown name or a missing package."""
    names = [n.strip().lower() for n in (value or "").replace("+", ",").split(",") if n.strip()]
    for n in names:
        if n not in LOGGERS:
            raise UserError(f"unknown --logger {n!r}; choose any of {', '.join(LOGGERS)} (comma-separated)")
        local_store = MLFLOW_LOCAL_STORE if n == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI") else ()
        for package in (LOGGERS[n], *local_store):
            if package and importlib.util.find_spec(package) is None:
                extra = "mlflow-skinny" if package == "mlflow" else package
                raise UserError(f"--logger {n} needs the {package} package, which is not installed; "
                                f"`pip install {extra}` (or `pip install 'lit-qlora[track]'`)")
    return list(dict.fromkeys(names))


def mlflow_store(logger_dir: Path) -> tuple[str, Optional[str]]:
    """(tracking URI, artifact location) of the MLflow logger: MLFLOW_TRACKING_URI's store (a server, a database),
    else a SQLite database at <logger_dir>/mlflow.db with its artifacts beside it, which `mlflow ui --backend-store-uri
    sqlite:///<logger_dir>/mlflow.db` and MlflowClient open as they are."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri, None
    folder = Path(logger_dir).resolve()
    return f"sqlite:///{folder / MLFLOW_DB}", (folder / "mlartifacts").as_uri()


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

            uri, artifacts = mlflow_store(logger_dir)
            loggers.append(MLFlowLogger(experiment_name=os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT),
                                        run_name=run_name, tracking_uri=uri, artifact_location=artifacts))
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
        from lit_qlora.train.training import MetricsLog

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


# ---- the run report (scripts/report.py OUT_DIR) ---------------------------------------------------------------------
REPORT_MD, REPORT_PNG = "report.md", "report.png"


def _read_optional_json(path: Path) -> dict:
    from lit_qlora.readers import read_json
    from lit_qlora.train.training import METRICS_JSON, check_metrics_json

    if not os.path.lexists(path):  # absent: a run in progress; a folder or a symlink loop in its place is a warning
        return {}
    fix = "the report is written without it"
    try:
        data = read_json(path, dict, fix=fix)
        return check_metrics_json(data, path, fix) if path.name == METRICS_JSON else data
    except UserError as e:
        print(f"warning: {e}", file=sys.stderr)
        return {}


def _floats(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = []
    for r in rows:
        try:
            points.append((int(r["iter"]), float(r[key])))
        except (TypeError, ValueError, KeyError):
            continue
    return [i for i, _ in points], [v for _, v in points]


def _fmt(v: Any, spec: str = ".4g", unit: str = "") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    try:
        return f"{v:{spec}}{unit}"
    except (TypeError, ValueError):  # not reached by metrics.json's figures (checked when read): a settings value
        return f"{v}{unit}"


def _number(m: dict, key: str) -> Optional[float]:
    v = m.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def run_report(out_dir: Path, plots: bool = True) -> tuple[Path, Optional[Path]]:
    """One page about one run of finetune/lora.py: out_dir/report.md (the figures and the settings) and, with
    matplotlib, out_dir/report.png (training and validation loss, learning rate, tokens/s per iteration, memory).
    Reads metrics.csv (required), metrics.json and hyperparameters.json (either may be missing: a run in progress)."""
    from lit_qlora.readers import check_file
    from lit_qlora.train.training import MetricsLog

    out_dir = Path(out_dir)
    if not os.path.lexists(out_dir / "metrics.csv"):
        raise UserError(f"{out_dir} holds no metrics.csv; pass the --out_dir of a finetune/lora.py run")
    check_file(out_dir / "metrics.csv", "metrics file", "the run report needs the metrics.csv finetune/lora.py wrote")
    rows = MetricsLog.read_rows(out_dir / "metrics.csv")
    m = _read_optional_json(out_dir / "metrics.json")
    hp = _read_optional_json(out_dir / "hyperparameters.json")
    resolved = hp.get("resolved", {}) if isinstance(hp.get("resolved"), dict) else {}
    it, loss = _floats(rows, "loss")
    vit, vloss = _floats(rows, "val_loss")
    _, tps = _floats(rows, "tokens_per_sec")
    median_tps = sorted(tps)[len(tps) // 2] if tps else m.get("tokens_per_sec")
    png = out_dir / REPORT_PNG if plots and _plot(out_dir / REPORT_PNG, rows, m, str(out_dir)) else None

    best = min(zip(vloss, vit)) if vloss else None
    lines = [f"# Run report: {out_dir}", ""]
    status = "finished" if m else "in progress (no metrics.json yet)"
    if not m and os.path.lexists(out_dir / "metrics.json"):  # a folder or a symlink loop in its place too
        status = "finished, but its metrics.json is damaged (see the warning): its figures are left out"
    if m.get("stopped_early"):
        status = f"stopped early at iteration {m.get('stopped_at_iter')} (patience {m.get('early_stopping_patience')})"
    lines += [f"Model **{m.get('model', hp.get('checkpoint_dir', '?'))}**, {status}.", ""]
    if png:
        lines += [f"![training curves]({png.name})", ""]
    figures = [
        ("Iterations", _fmt(m.get("iterations", it[-1] if it else None), "d")),
        ("Training loss (first -> last)", f"{_fmt(loss[0] if loss else None)} -> {_fmt(loss[-1] if loss else None)}"),
        ("Validation loss (first -> last)",
         f"{_fmt(vloss[0] if vloss else None)} -> {_fmt(vloss[-1] if vloss else None)}"),
        ("Best validation loss", f"{_fmt(best[0])} at iteration {best[1]}" if best else "-"),
        ("Tokens/s (median of iterations)", _fmt(median_tps, ".1f")),
        ("Training time", _fmt(m.get("training_time_s"), ".1f", " s")),
        ("Peak memory", _fmt(m.get("peak_memory_gb"), ".2f", f" GB ({m.get('memory_kind', '')})")),
        ("Weights in memory", _fmt(((_number(m, "quantized_bytes") or 0) + _number(m, "dense_bytes")) / 2**20
                                   if _number(m, "dense_bytes") is not None else None, ".1f", " MiB")),
        ("Trainable parameters", _fmt(m.get("trainable_params"), ",d")),
        ("Last adapter", f"`{out_dir / 'lit_model_lora_finetuned.pth'}`" if m else "-"),
        ("Best adapter", f"`{m['best_adapter']}`" if m.get("best_adapter") else "-"),
    ]
    lines += ["| Figure | Value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in figures] + [""]
    settings = {**{k: v for k, v in hp.items() if k not in ("resolved", "lora")}, **resolved}
    keys = ("checkpoint_dir", "data_dir", "precision", "quantize", "optimizer", "learning_rate", "warmup_steps",
            "batch_size", "micro_batch_size", "max_seq_length", "max_steps", "lora_r", "lora_alpha", "lora_dropout",
            "template", "packing", "seed")
    lines += ["## Settings", "", "| Setting | Value |", "|---|---|"]
    lines += [f"| {k} | `{settings[k]}` |" for k in keys if k in settings] + [""]
    rest = {k: v for k, v in settings.items() if k not in keys}
    if rest:
        lines += ["<details><summary>All flags</summary>", "", "| Flag | Value |", "|---|---|"]
        lines += [f"| {k} | `{v}` |" for k, v in sorted(rest.items())] + ["", "</details>", ""]
    md = out_dir / REPORT_MD
    md.write_text("\n".join(lines))
    return md, png


def _plot(path: Path, rows: list[dict], m: dict, title: str) -> bool:
    """report.png: four panels; False without matplotlib (a note says how to get it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, so no report.png (pip install 'lit-qlora[plots]' or pip install "
              "matplotlib)", file=sys.stderr)
        return False
    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))
    it, loss = _floats(rows, "loss")
    vit, vloss = _floats(rows, "val_loss")
    a = ax[0][0]
    a.plot(it, loss, color="tab:blue", lw=1, label="training loss")
    if vloss:
        a.plot(vit, vloss, "o-", color="tab:orange", ms=4, label="validation loss")
        b = min(range(len(vloss)), key=vloss.__getitem__)
        a.plot([vit[b]], [vloss[b]], "*", color="tab:red", ms=12, label=f"best: {vloss[b]:.3f} (iter {vit[b]})")
    if m.get("stopped_early"):
        a.axvline(m.get("stopped_at_iter") or 0, color="gray", ls="--", lw=1, label="early stop")
    a.set(title="Loss", xlabel="iteration", ylabel="loss (per target token)")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    for a, key, name, color in ((ax[0][1], "lr", "Learning rate", "tab:green"),
                                (ax[1][0], "tokens_per_sec", "Training tokens/s", "tab:purple")):
        x, y = _floats(rows, key)
        a.plot(x, y, color=color, lw=1)
        a.set(title=name, xlabel="iteration")
        a.grid(alpha=0.3)
    ax[0][1].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    a = ax[1][1]
    gib = 2**30
    dense = _number(m, "dense_bytes")
    bars = [("weights", ((_number(m, "quantized_bytes") or 0) + dense) / gib if dense is not None else None),
            ("after load", _number(m, "rss_after_load_gb")), ("peak", _number(m, "peak_memory_gb"))]
    bars = [(k, v) for k, v in bars if isinstance(v, (int, float))]
    if bars:
        rects = a.bar([k for k, _ in bars], [v for _, v in bars], color=["tab:gray", "tab:cyan", "tab:red"][:len(bars)])
        for r, (_, v) in zip(rects, bars):
            label = f"{v:.2f} GB" if v >= 0.1 else f"{v * 1024:.1f} MiB"
            a.annotate(label, (r.get_x() + r.get_width() / 2, r.get_height()), ha="center", va="bottom", fontsize=8)
    else:  # a run in progress: its memory figures come with metrics.json at the end
        a.text(0.5, 0.5, "written at the end of the run (metrics.json)", ha="center", va="center",
               transform=a.transAxes, color="gray")
        a.set_xticks([])
        a.set_yticks([])
    a.set(title=f"Memory ({m.get('memory_kind', 'no metrics.json yet')})", ylabel="GB")
    settings = ", ".join(str(v) for v in (m.get("precision"), m.get("quantize"), m.get("optimizer")) if v)
    fig.suptitle(f"{m.get('model', '')} {settings}\n{title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
