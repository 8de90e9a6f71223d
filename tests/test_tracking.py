"""--logger (Lightning's CSV, W&B and MLflow loggers) read back with each library's own reader, and early stopping
(--early_stopping_patience, --save_best) on a scripted validation-loss curve in the real training loop, uninterrupted
and resumed.

Also the run report (scripts/report.py OUT_DIR) and the demo's last command (generate/lora.py with no flags).

The scripted curve: finetune/lora.py's own loop and SFT steps, with the validation replaced by a table of losses per
iteration (tests/helpers_train.py's tiny setup; a driver script runs setup() with that objective in a subprocess).
"""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import helpers_train as h
import pytest
import torch

# validations every 2 iterations: best at 4; 6 and 8 are no better -> with patience 2 the run stops at 8
CURVE = {0: 5.0, 2: 4.0, 4: 3.0, 6: 3.5, 8: 3.2, 10: 2.0, 12: 1.0}
DRIVER = '''
import json, os, runpy, sys
from dataclasses import replace
ft = runpy.run_path({finetune!r})
curve = {{int(k): v for k, v in json.loads(os.environ["SCRIPTED_VAL"]).items()}}
objective = replace(ft["SFT"], validate=lambda s: dict(val_loss=curve[s.step], val_ppl=0.0))
from lit_qlora.args import parse_finetune_args
from lit_qlora.utils import run_main
run_main(lambda: ft["setup"](parse_finetune_args(), objective))
'''
ES = dict(max_iters=12, eval_interval=2, save_interval=2, keep_checkpoints=0, early_stopping_patience=2,
          save_best="true", learning_rate=1e-2)


def run_scripted(setup: dict, out: Path, tmp: Path, **kw):
    driver = tmp / "scripted_val.py"
    driver.write_text(DRIVER.format(finetune=str(h.FINETUNE)))
    env = {**h.env(), "SCRIPTED_VAL": json.dumps(CURVE)}
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(driver), *h.train_args(setup, out, **{**ES, **kw})], capture_output=True,
                       text=True, env=env, cwd=h.ROOT, timeout=180)
    assert r.returncode == 0, r.stderr
    return r


def test_early_stopping_on_a_scripted_curve_and_resume(train_setup, tmp_path):
    out = tmp_path / "A"
    r = run_scripted(train_setup, out, tmp_path)
    m = json.loads((out / "metrics.json").read_text())
    assert m["iterations"] == 8 and m["stopped_early"] and m["stopped_at_iter"] == 8
    assert m["best_iter"] == 4 and m["best_val_loss"] == 3.0
    last = h.last_line(r.stderr)
    assert "Stopped early at iteration 8" in last and "iteration 4" in last and "lit_model_lora_best.pth" in last
    best = torch.load(out / "lit_model_lora_best.pth", weights_only=False)
    assert best["train"]["iter"] == 4
    assert h.max_abs_diff(best["lora"], h.load_lora(out / "checkpoints/iter-000004.pth")) == 0
    assert h.max_abs_diff(h.load_lora(out / "lit_model_lora_finetuned.pth"),
                          h.load_lora(out / "checkpoints/iter-000008.pth")) == 0
    assert h.max_abs_diff(best["lora"], h.load_lora(out / "lit_model_lora_finetuned.pth")) > 0  # best != last

    # resumed from iteration 6 (one validation without improvement so far): it stops at 8 again, best still 4
    resumed = tmp_path / "B"
    shutil.copytree(out, resumed)
    (resumed / "metrics.json").unlink()
    (resumed / "lit_model_lora_best.pth").unlink()  # written again only if the run forgot the best was at 4
    run_scripted(train_setup, resumed, tmp_path, resume=resumed / "checkpoints/iter-000006.pth")
    m2 = json.loads((resumed / "metrics.json").read_text())
    assert (m2["iterations"], m2["stopped_at_iter"], m2["best_iter"]) == (8, 8, 4), m2
    assert not (resumed / "lit_model_lora_best.pth").exists()


def wandb_records(run_dir: Path) -> list:
    """The records of an offline W&B run's .wandb file, decoded with wandb's own protobuf Record. (wandb 0.31 no
    longer ships the Python reader of the file; its framing is LevelDB's log format: a 7-byte ":W&B" header, then
    32 KiB blocks of chunks, each crc32c (4 bytes), length (2, little-endian), type (1: full, 2-4: first, middle,
    last).)"""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pos, parts = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # too little room for a chunk header: the rest of the block is padding
            pos += left
            continue
        n, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 0 and n == 0:
            continue
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(parts)
            records.append(rec)
    return records


def wandb_history(run_dir: Path) -> list[dict]:
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "history"]


def wandb_config(run_dir: Path) -> dict:
    config = {}
    for r in wandb_records(run_dir):
        if r.WhichOneof("record_type") == "config":
            config.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                           for item in r.config.update})
    return config


def test_loggers_hold_the_run(train_setup, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    out = tmp_path / "run"
    for k in ("WANDB_MODE", "WANDB_API_KEY", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no netrc: W&B is not configured, so offline
    h.train(train_setup, out, max_iters=4, eval_interval=2, logger="csv,wandb,mlflow")
    losses = h.losses_by_iter(out)
    with open(out / "metrics.csv") as f:
        vals = {int(r["iter"]): float(r["val_loss"]) for r in csv.DictReader(f) if r["val_loss"]}
    metrics = json.loads((out / "metrics.json").read_text())
    adapter = str(out / "lit_model_lora_finetuned.pth")

    # MLflow: the SQLite store at out_dir/mlflow.db, read with MlflowClient as a user would, nothing set first (the
    # file store of earlier versions, ./mlruns, MLflow 3 refuses to open unless MLFLOW_ALLOW_FILE_STORE is set)
    from mlflow.tracking import MlflowClient

    assert (out / "mlflow.db").is_file() and not (out / "mlruns").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lit-qlora").experiment_id])
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")} == pytest.approx(losses)
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val_loss")} == pytest.approx(vals)
    params = run.data.params
    assert params["resolved/precision"] == "32-true" and params["adapter_path"] == adapter
    assert params["lora_r"] == "8" or params["lora/r"] == "8"
    peak = client.get_metric_history(run.info.run_id, "final/peak_memory_gb")
    assert peak and peak[0].value == pytest.approx(metrics["peak_memory_gb"])
    assert client.get_metric_history(run.info.run_id, "final/quantized_bytes")  # the memory report

    # W&B: one offline run folder under out_dir/wandb
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    hist = wandb_history(run_dir)
    assert {int(r["_step"]): r["loss"] for r in hist if "loss" in r} == pytest.approx(losses)
    config = wandb_config(run_dir)
    value = {k: v["value"] if isinstance(v, dict) and "value" in v else v for k, v in config.items()}
    assert value["resolved/precision"] == "32-true" and value["adapter_path"] == adapter, config

    # Lightning's CSV logger
    (csv_file,) = (out / "logs" / "csv").glob("version_*/metrics.csv")
    with open(csv_file) as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss")]
    assert {int(r["step"]): float(r["loss"]) for r in rows} == pytest.approx(losses)


def test_unknown_logger_is_one_line():
    from lit_qlora.args import parse_finetune_args
    from lit_qlora.utils import UserError

    with pytest.raises(UserError, match="unknown --logger 'nosuchlogger'; choose any of csv, tensorboard, wandb"):
        parse_finetune_args(["--checkpoint_dir", "x", "--data_dir", "y", "--logger", "csv,nosuchlogger"])


def test_missing_package_names_it(monkeypatch):
    import importlib.util

    from lit_qlora.train import tracking
    from lit_qlora.utils import UserError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(UserError, match="--logger wandb needs the wandb package.*pip install wandb"):
        tracking.parse_loggers("csv,wandb")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking.parse_loggers("csv,mlflow") == ["csv", "mlflow"]


def test_mlflow_local_store_needs_sqlalchemy(monkeypatch):
    """MLflow's local store is a SQLite database, which mlflow-skinny opens only with sqlalchemy and alembic: without
    them, one line naming the package (the track extra has them); a server (MLFLOW_TRACKING_URI) does not need them."""
    import importlib.util

    from lit_qlora.train import tracking
    from lit_qlora.utils import UserError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sqlalchemy" else real(name, *a))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(UserError, match="--logger mlflow needs the sqlalchemy package.*lit-qlora\\[track\\]"):
        tracking.parse_loggers("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking.parse_loggers("mlflow") == ["mlflow"]
    assert tracking.mlflow_store(Path("out")) == ("http://127.0.0.1:5000", None)


def test_run_report(trained_run, tmp_path):
    """scripts/report.py OUT_DIR on one run: report.md holds metrics.json's figures and the settings, report.png is a
    picture of the four panels."""
    import shutil as sh

    from helpers import run_script_here

    out = tmp_path / "run"
    sh.copytree(trained_run[0], out)
    assert run_script_here("report.py", out) == 0
    md = (out / "report.md").read_text()
    m = json.loads((out / "metrics.json").read_text())
    rows = [r for r in csv.DictReader(open(out / "metrics.csv")) if r["val_loss"]]
    best = min(rows, key=lambda r: float(r["val_loss"]))
    assert f"| Best validation loss | {float(best['val_loss']):.4g} at iteration {best['iter']} |" in md
    assert f"| Peak memory | {m['peak_memory_gb']:.2f} GB (peak RSS) |" in md
    assert f"| Iterations | {m['iterations']} |" in md and "| learning_rate | `0.01` |" in md
    assert "![training curves](report.png)" in md
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1210, 825), (width, height)


def test_demo_generate_scores_the_held_out_questions(train_setup, trained_run, tmp_path, monkeypatch, capsys):
    """`python generate/lora.py` with no flags after the demo's training: each held-out question with the base model's
    and the fine-tuned model's greedy answers (what `generate/base.py` and `generate/lora.py --prompt` print for it),
    both models scored against the expected answers, the run report and the next command. The demo's model and
    held-out set are the tiny setup's here (the real demo trains for minutes): two questions, one whose expected
    answer is the fine-tuned one. Red when an answer is scored against the wrong expectation or the models swapped."""
    import runpy
    import sys

    from lit_qlora import demo
    from lit_qlora.demo import score

    run = tmp_path / "out" / "lora" / "demo"
    shutil.copytree(trained_run[0], run)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo, "DEMO_CHECKPOINT", train_setup["ckpt"])
    n = str(score.ANSWER_TOKENS)
    tuned = h.run_script(h.GENERATE_LORA, ["--checkpoint_dir", train_setup["ckpt"], "--lora_path",
                                            run / "lit_model_lora_finetuned.pth", "--prompt", "kind", "--input", "owl",
                                            "--precision", "32-true", "--max_new_tokens", n])
    assert tuned.returncode == 0, tuned.stderr
    # the base model on the prompt as the adapter's template ("plain") renders it
    base = h.run_script(h.GENERATE_BASE, ["--checkpoint_dir", train_setup["ckpt"], "--prompt", "kind\nowl\n",
                                          "--max_new_tokens", n, "--precision", "32-true"])
    assert base.returncode == 0, base.stderr
    tuned_text, base_text = tuned.stdout.strip(), base.stdout.strip()
    assert base_text != tuned_text  # the adapter changed the answer
    held = [{"instruction": "kind", "input": "owl", "output": tuned_text},
            {"instruction": "kind", "input": "owl", "output": "never said"}]
    monkeypatch.setattr(score, "held_out", lambda path=None: held)
    monkeypatch.setattr(sys, "argv", [str(h.GENERATE_LORA), "--precision", "32-true"])
    runpy.run_path(str(h.GENERATE_LORA), run_name="__main__")
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("Held-out questions") and lines[0].endswith("the first 2 of 2:")
    for line, mark in zip(lines[1:3], ("(right)", "(wrong, expected 'never said')")):
        assert line.startswith("  kind owl  base model: " + score._shown(base_text))
        assert line.endswith(f"fine-tuned: {score._shown(tuned_text)} {mark}")
    assert lines[3] == "Fine-tuned accuracy on the 2 held-out questions: 1/2 (50%); base model: 0/2 (0%)"
    assert lines[4] == f"Run report: {Path('out/lora/demo/report.md')} (curves: {Path('out/lora/demo/report.png')})"
    assert lines[5] == f"Next, ask it a question of your own: {score.NEXT_COMMAND}"
    assert (run / "report.md").is_file() and (run / "report.png").is_file()


def test_demo_tasks_hold_out_their_words():
    """The demo's bundled data is what its generator writes, every answer follows from its question, and no held-out
    word or number range is in the fine-tuning data (the demo's accuracy is on questions no training saw)."""
    import json

    from lit_qlora.demo import DEMO_FILES, tasks
    from lit_qlora.demo.make_demo_data import SEED

    train, val = (json.loads(f.read_text()) for f in DEMO_FILES)
    assert (train, val) == tasks.split(SEED)
    for r in train + val:
        if r["instruction"] in tasks.WORD_TASKS:
            assert r["output"] == tasks.WORD_TASKS[r["instruction"]](r["input"])
        else:
            a, b = tasks.count_range(r)
            assert r["output"] == " ".join(map(str, range(a, b + 1)))
    words = {r["input"] for r in val if r["input"]}
    ranges = {tasks.count_range(r) for r in val} - {None}
    assert len(val) == 60 and words and ranges
    assert not words & {r["input"] for r in train} and not ranges & {tasks.count_range(r) for r in train}


@pytest.mark.parametrize("change", [{"iterations": -1}, {"iterations": "12"}, {"peak_memory_gb": 1e308},
                                    {"training_time_s": -5.0}, {"tokens_per_sec": float("inf")},
                                    {"precision": "x"}, {"quantize": "bnb.nf5"}, {"optimizer": 3},
                                    {"memory_kind": "peak"}, {"final_train_loss": -1.0}, {"micro_batch_size": 0},
                                    {"trainable_params": 2.5}, "iterations", "peak_memory_gb",
                                    "final_val_loss",  # the fuzzer, seed 11008: a deleted figure was shown as "-"
                                    {"peak_memory_gb": 0}, {"rss_after_load_gb": 0.0}])  # seed 13010: 0 GB shown
def test_wrong_figures_in_metrics_json_are_left_out_of_both_reports(trained_run, tmp_path, capsys, change):
    """A metrics.json figure of the wrong kind, out of what a run can reach, a setting no run has, or a figure
    deleted: the run report (scripts/report.py OUT_DIR) and the matrix report (scripts/report.py OUT_ROOT) both say
    so in a warning naming the file and the field, and show none of that file's figures (never the wrong one)."""
    import runpy

    from lit_qlora.train.tracking import run_report

    m = json.loads((trained_run[0] / "metrics.json").read_text())
    field = change if isinstance(change, str) else next(iter(change))
    if isinstance(change, str):
        del m[change]
    else:
        m.update(change)
    out = tmp_path / "run"
    shutil.copytree(trained_run[0], out)
    (out / "metrics.json").write_text(json.dumps(m))
    md_path, _ = run_report(out, plots=False)
    md = md_path.read_text()
    warning = capsys.readouterr().err
    assert f"warning: {out / 'metrics.json'}" in warning and field in warning, warning
    assert "metrics.json is damaged" in md and "| Peak memory | - |" in md and "| Iterations | " in md
    cell = tmp_path / "matrix" / "tiny" / "32-true"
    cell.mkdir(parents=True)
    shutil.copy(out / "metrics.json", cell / "metrics.json")
    (cell / "status.json").write_text(json.dumps({"status": "ok", "exit_code": 0}))
    report = runpy.run_path(str(h.ROOT / "scripts" / "report.py"))
    (row,) = report["collect"](tmp_path / "matrix")
    warning = capsys.readouterr().err
    assert f"warning: {cell / 'metrics.json'}" in warning and field in warning, warning
    assert row["peak_memory_gb"] is None and row["iterations"] is None and row["training_time_s"] is None


@pytest.mark.parametrize("name", ["metrics.json", "hyperparameters.json", "metrics.csv"])
@pytest.mark.parametrize("place", ["folder", "symlink loop"])
def test_a_folder_or_symlink_loop_in_a_run_file_place_is_named_by_both_reports(trained_run, tmp_path, name, place):
    """The fuzzer, seeds 13044 / 13045 / 13057 / 13059: a folder or a symlink loop where metrics.json belongs made the
    run report read 'in progress (no metrics.json yet)' without a word. Now: metrics.json or hyperparameters.json
    in such a state is a warning naming the file and what it is, the report written without it (and saying metrics.json
    is damaged, not absent); metrics.csv, which the report needs, is refused in one line (exit 2) naming it; the
    matrix report (scripts/report.py OUT_ROOT) warns for a cell's metrics.json and metrics.csv the same way."""
    import os

    from helpers import run_in_process

    out = tmp_path / "run"
    shutil.copytree(trained_run[0], out)
    (out / name).unlink()
    if place == "folder":
        (out / name).mkdir()
    else:
        os.symlink(name, out / name)
    what = "is a folder" if place == "folder" else "is a symlink loop"
    r = run_in_process("report.py", out, "--no_plots")
    lines = r.stderr.strip().splitlines()
    if name == "metrics.csv":
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert str(out / name) in lines[0] and what in lines[0], r.stderr
    else:
        assert r.returncode == 0, r.stderr
        warned = [ln for ln in lines if ln.startswith("warning: ")]
        assert len(warned) == 1 and str(out / name) in warned[0] and what in warned[0], r.stderr
        md = (out / "report.md").read_text()
        assert "in progress" not in md
        if name == "metrics.json":
            assert "metrics.json is damaged" in md
    if name == "hyperparameters.json":
        return
    cell = tmp_path / "matrix" / "tiny" / "32-true"
    cell.mkdir(parents=True)
    for f in ("metrics.json", "metrics.csv"):
        shutil.copy(trained_run[0] / f, cell / f)
    (cell / "status.json").write_text(json.dumps({"status": "ok", "exit_code": 0}))
    (cell / name).unlink()
    if place == "folder":
        (cell / name).mkdir()
    else:
        os.symlink(name, cell / name)
    r = run_in_process("report.py", tmp_path / "matrix")
    warned = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: ")]
    assert r.returncode == 0 and any(str(cell / name) in ln and what in ln for ln in warned), r.stderr
