"""Collect the cells written by scripts/run_matrix.sh into one comparison table and plots, or report on one run.

    python scripts/report.py out/matrix
    python scripts/report.py out/lora/demo     # one finetune/lora.py run: report.md + report.png in that folder

A run folder (it holds metrics.csv) gets one page: out_dir/report.md with the figures (losses, best validation,
tokens/s, time, peak memory, adapters) and the settings, and out_dir/report.png with the loss and validation curves,
the learning rate, tokens/s per iteration and the memory (lit_qlora.train.tracking.run_report).

Reads OUT_ROOT/<model>/<setting>/{cell.json, status.json, metrics.json, metrics.csv, generate_metrics.json} and
writes OUT_ROOT/report.md (also printed), OUT_ROOT/report.csv and, when matplotlib is installed
(`pip install lit-qlora[plots]`), OUT_ROOT/loss.png (every cell's training loss), OUT_ROOT/memory.png and
OUT_ROOT/time.png (training peak memory and time per cell).
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional

COLUMNS = ["Model", "Settings", "Iterations", "Micro batch size", "Optimizer", "Training Memory", "Training Time",
           "Loss", "Inference tokens/s", "Inference memory", "Status"]
CSV_FIELDS = ["model", "setting", "precision", "quantize", "optimizer", "micro_batch_size", "activation_checkpointing",
              "iterations", "peak_memory_gb", "memory_kind", "training_time_s", "train_tokens_per_sec",
              "first_train_loss",
              "final_train_loss", "final_val_loss", "inference_tokens_per_sec", "inference_memory_gb", "status",
              "exit_code", "error", "stage", "cell_dir"]


CELL_FILE_FIELDS = {  # the fields report.py formats, by file: a value of another type leaves the file out
    "cell.json": {"model": "str", "setting": "str"},
    "status.json": {"status": "str", "exit_code": "int", "error": "str", "stage": "str"},
    "generate_metrics.json": {"tokens_per_sec": "number", "memory_gb": "number"},
}  # metrics.json: lit_qlora.train.training.check_metrics_json (every figure of its kind and within what a run reaches)


def _read_json(path: Path) -> Optional[dict]:
    """A cell file's JSON object; None when there is none. A damaged one (not text, not JSON, not an object) is
    reported in a warning line naming it and left out: the cell shows as incomplete."""
    from lit_qlora.readers import check_fields, read_json
    from lit_qlora.train.training import METRICS_JSON, check_metrics_json
    from lit_qlora.utils import UserError

    if not os.path.lexists(path):
        return None
    fix = "the cell is shown without it"
    try:
        data = read_json(path, dict, fix=fix)
        if path.name == METRICS_JSON:
            return check_metrics_json(data, path, fix)
        data = check_fields(data, path, CELL_FILE_FIELDS.get(path.name, {}), fix=fix)
        if path.name == "generate_metrics.json" and any(v is not None and v < 0 for v in data.values()
                                                        if isinstance(v, (int, float))):
            raise UserError(f"{path} holds a negative figure; {fix}")
        return data
    except UserError as e:
        print(f"warning: {e}", file=sys.stderr)
        return None


def collect(out_root: Path) -> list[dict]:
    """One flat record per cell folder (a folder two levels down holding any of the cell files)."""
    cells = []
    for d in sorted(p for p in out_root.glob("*/*") if p.is_dir()):
        cell, status, m, g = (_read_json(d / n) for n in ("cell.json", "status.json", "metrics.json",
                                                          "generate_metrics.json"))
        if cell is None and status is None and m is None:
            continue
        cell, status, m, g = cell or {}, status or {}, m or {}, g or {}
        setting = cell.get("setting", "")
        fields = setting.split(":") if setting else []
        fields += [""] * (5 - len(fields))
        quantize = m.get("quantize") or fields[1] or "none"
        rec: dict[str, Any] = dict(
            model=cell.get("model", d.parent.name),
            setting=setting or d.name, precision=m.get("precision") or fields[0], quantize=quantize,
            optimizer=m.get("optimizer") or fields[2], micro_batch_size=m.get("micro_batch_size") or fields[3],
            activation_checkpointing=m.get("activation_checkpointing", fields[4] == "ckpt"),
            iterations=m.get("iterations"), peak_memory_gb=m.get("peak_memory_gb"), memory_kind=m.get("memory_kind"),
            training_time_s=m.get("training_time_s"), train_tokens_per_sec=m.get("tokens_per_sec"),
            first_train_loss=m.get("first_train_loss"), final_train_loss=m.get("final_train_loss"),
            final_val_loss=m.get("final_val_loss"), inference_tokens_per_sec=g.get("tokens_per_sec"),
            inference_memory_gb=g.get("memory_gb"),
            status=status.get("status") or ("ok" if m and g else "incomplete"), exit_code=status.get("exit_code"),
            error=status.get("error", ""), stage=status.get("stage", ""), cell_dir=str(d),
            order=cell.get("order", 1 << 30))
        cells.append(rec)
    cells.sort(key=lambda r: (r["order"], r["model"], r["setting"]))
    return cells


def _num(v: Any, fmt: str, unit: str = "") -> str:
    if v is None or v == "" or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:{fmt}}{unit}"


def _seconds(v: Any) -> str:
    return _num(v, ".2f" if isinstance(v, (int, float)) and v < 10 else ".0f", " s")


def _settings(r: dict) -> str:
    s = f"{r['precision']}, {r['quantize']}"
    return s + (", checkpointing" if r["activation_checkpointing"] else "")


def _status(r: dict) -> str:
    if r["status"] == "ok":
        return "ok"
    if r["status"] == "oom":
        return "OOM" + (f" ({r['stage']})" if r["stage"] == "generate" else "")
    if r["status"] in ("running", "incomplete"):
        return "INCOMPLETE"
    reason = (r["error"] or f"exit code {r['exit_code']}").strip()
    reason = reason[len("error: "):] if reason.startswith("error: ") else reason
    reason = reason if len(reason) <= 120 else reason[:117] + "..."
    return f"FAILED: {reason}"


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(cells: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in cells:
        loss = _num(r["final_train_loss"], ".3f")
        if r["final_val_loss"] is not None:
            loss += f" (val {r['final_val_loss']:.3f})"
        row = [r["model"], _settings(r), _num(r["iterations"], "d"), str(r["micro_batch_size"]), r["optimizer"],
               _num(r["peak_memory_gb"], ".2f", " GB"), _seconds(r["training_time_s"]), loss,
               _num(r["inference_tokens_per_sec"], ".1f"), _num(r["inference_memory_gb"], ".2f", " GB"), _status(r)]
        lines.append("| " + " | ".join(_md_escape(str(c)) for c in row) + " |")
    kinds = {r["memory_kind"] for r in cells if r["memory_kind"]}
    if kinds:
        lines.append("")
        lines.append(f"Training memory: {', '.join(sorted(kinds))} of the training process. Loss: final training loss "
                     "(final validation loss).")
    return "\n".join(lines)


def write_csv(cells: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(cells)


def _label(r: dict, many_models: bool) -> str:
    def short(v) -> str:  # a damaged metrics.json may hold megabytes where a name belongs: no plot can draw that
        v = str(v)
        return v if len(v) <= 40 else v[:37] + "..."

    mb = f"mb{short(r['micro_batch_size'])}"
    s = f"{short(r['quantize'])}\n{short(r['precision'])} {short(r['optimizer'])} {mb}" + (
        " ckpt" if r["activation_checkpointing"] else "")
    return f"{short(r['model'])}\n{s}" if many_models else s


def plots(cells: list[dict], out_root: Path) -> list[Path]:
    """loss.png, memory.png, time.png; returns the files written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        matplotlib = None
    from lit_qlora.readers import read_csv_rows
    from lit_qlora.utils import UserError

    if matplotlib is None:
        print("note: matplotlib is not installed, no plots (pip install 'lit-qlora[plots]' or pip install matplotlib)",
              file=sys.stderr)
        return []
    written = []
    many = len({r["model"] for r in cells}) > 1

    fig, ax = plt.subplots(figsize=(9, 5))
    for r in cells:
        path = Path(r["cell_dir"]) / "metrics.csv"
        if not os.path.lexists(path):  # a folder or a symlink loop in its place: a warning below, not a silent skip
            continue
        try:
            rows = [row for row in read_csv_rows(path, "metrics file", "its loss curve is left out")
                    if row.get("loss") and row.get("iter")]
            points = [(int(row["iter"]), float(row["loss"])) for row in rows]
        except (UserError, ValueError) as e:
            print(f"warning: {e if isinstance(e, UserError) else f'{path} holds a row that is not numbers'}",
                  file=sys.stderr)
            continue
        if points:
            ax.plot([i for i, _ in points], [loss for _, loss in points],
                    label=_label(r, many).replace("\n", " "))
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss")
    ax.set_title("Training loss")
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out_root / "loss.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    for key, name, ylabel in (("peak_memory_gb", "memory.png", "peak training memory (GB)"),
                              ("training_time_s", "time.png", "training time (s)")):
        fig, ax = plt.subplots(figsize=(max(7, 2.0 * len(cells)), 5))
        labels = [_label(r, many) for r in cells]
        # a figure a bar can show: a damaged metrics.json (1e308 GB, inf, a negative time) gets no bar, only its text
        shown = [isinstance(r[key], (int, float)) and math.isfinite(r[key]) and 0 <= r[key] < 1e6 for r in cells]
        values = [r[key] if ok else 0.0 for r, ok in zip(cells, shown)]
        bars = ax.bar(range(len(cells)), values,
                      color=["tab:blue" if r["status"] == "ok" else "tab:red" for r in cells])
        for bar, r, ok in zip(bars, cells, shown):
            text = f"{r[key]:.2f}" if ok else f"{r[key]!r:.12}" if isinstance(r[key], (int, float)) \
                else _status(r).split(":")[0]
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=7)
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel(ylabel)
        ax.set_title(ylabel.split(" (")[0].capitalize() + " per setting (red: failed)")
        fig.tight_layout()
        written.append(out_root / name)
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def main() -> None:
    p = argparse.ArgumentParser(description="Collect scripts/run_matrix.sh results into report.md, report.csv and "
                                            "plots.")
    p.add_argument("out_root", type=Path, help="the OUT_ROOT of scripts/run_matrix.sh, or one run's --out_dir")
    p.add_argument("--no_plots", action="store_true", help="skip the PNG plots")
    args = p.parse_args()
    if not args.out_root.is_dir():
        print(f"error: {args.out_root} is not a folder; pass the OUT_ROOT of scripts/run_matrix.sh", file=sys.stderr)
        sys.exit(2)
    if os.path.lexists(args.out_root / "metrics.csv"):  # one run of finetune/lora.py (a damaged one is refused there)
        from lit_qlora.train.tracking import run_report
        from lit_qlora.utils import run_main

        md, png = run_main(lambda: run_report(args.out_root, plots=not args.no_plots))
        print(md.read_text())
        print(f"\nWrote {md}" + (f" and {png}" if png else ""), file=sys.stderr)
        return
    cells = collect(args.out_root)
    if not cells:
        print(f"error: no cells in {args.out_root} (expected <model>/<setting>/status.json); run scripts/run_matrix.sh",
              file=sys.stderr)
        sys.exit(2)
    md = markdown(cells)
    (args.out_root / "report.md").write_text(md + "\n")
    write_csv(cells, args.out_root / "report.csv")
    print(md)
    files = [] if args.no_plots else plots(cells, args.out_root)
    print(f"\nWrote {args.out_root / 'report.md'}, {args.out_root / 'report.csv'}"
          + "".join(f", {f}" for f in files), file=sys.stderr)


if __name__ == "__main__":
    main()
