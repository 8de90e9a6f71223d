"""scripts/run_matrix.sh + scripts/report.py on a tiny model: every cell in the table, failures recorded and marked,
finished cells skipped on a re-run, an interrupted cell finished by the re-run."""
import csv
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_tiny_hf_model
from helpers_tokenizer import make_hf_bpe_tokenizer
from helpers_train import env as h_env

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ["32-true:none:AdamW:2", "bf16-true:bnb.nf4-dq:AdamW:2", "32-true:none:AdamW:2:ckpt",
            "bf16-true:none:NoSuchOpt:2"]
SLUGS = ["32-true_none_AdamW_mb2", "bf16-true_bnb.nf4-dq_AdamW_mb2", "32-true_none_AdamW_mb2_ckpt",
         "bf16-true_none_NoSuchOpt_mb2"]
FAILED = SLUGS[3]


def run_matrix(tmp: Path, ckpt: Path, data: Path, out: Path) -> subprocess.CompletedProcess:
    env = dict(h_env(), MODELS=str(ckpt), DATA_DIR=str(data), OUT_ROOT=str(out), MAX_ITERS="2",
               SETTINGS=" ".join(SETTINGS),
               EXTRA_TRAIN_ARGS="--eval_iters 1 --eval_max_new_tokens 2 --template plain",
               EXTRA_GEN_ARGS="--max_new_tokens 3", PYTHON=sys.executable, PROMPT="Say the word: cat")
    return subprocess.run(["bash", str(ROOT / "scripts" / "run_matrix.sh")], capture_output=True, text=True, env=env,
                          cwd=tmp, timeout=300)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("matrix")
    ckpt = tmp / "tiny-llama"
    make_tiny_hf_model("llama", ckpt, seed=0, vocab_size=320, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, max_position_embeddings=128)
    make_hf_bpe_tokenizer(ckpt, vocab_size=320)
    data = tmp / "data"
    data.mkdir()
    records = [{"instruction": "Say the word", "input": w, "output": w} for w in ["cat", "dog", "red", "map", "pen",
                                                                                  "owl"] * 6]
    (data / "train.json").write_text(json.dumps(records))
    out = tmp / "out"
    first = run_matrix(tmp, ckpt, data, out)
    return tmp, ckpt, data, out, first


def test_every_cell_is_in_the_report(matrix):
    tmp, ckpt, data, out, first = matrix
    assert first.returncode == 0, first.stderr
    cells = out / "tiny-llama"
    status = {slug: json.loads((cells / slug / "status.json").read_text()) for slug in SLUGS}
    assert [status[s]["status"] for s in SLUGS] == ["ok", "ok", "ok", "failed"]
    assert status[FAILED]["exit_code"] == 2 and "unknown --optimizer" in status[FAILED]["error"]
    for slug in SLUGS[:3]:
        for name in ("metrics.json", "metrics.csv", "generate_metrics.json", "train_stdout.log", "train_stderr.log",
                     "generate_stdout.log", "lit_model_lora_finetuned.pth"):
            assert (cells / slug / name).is_file(), (slug, name)

    md = (out / "report.md").read_text()
    assert md == first.stdout[first.stdout.index("| Model |"):].rstrip("\n") + "\n"  # printed too
    assert md.splitlines()[0] == ("| Model | Settings | Iterations | Micro batch size | Optimizer | Training Memory | "
                                  "Training Time | Loss | Inference tokens/s | Inference memory | Status |")
    rows = [line for line in md.splitlines()[2:] if line.startswith("| tiny-llama")]
    assert len(rows) == 4
    assert all(r.rstrip().endswith("| ok |") for r in rows[:3])
    assert "FAILED: unknown --optimizer 'NoSuchOpt'" in rows[3]
    assert "bnb.nf4-dq" in rows[1] and "checkpointing" in rows[2]

    with open(out / "report.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["status"] for r in table] == ["ok", "ok", "ok", "failed"]
    for r, slug in zip(table[:3], SLUGS[:3]):  # every figure is the cell's own, as its runs wrote it
        train = json.loads((cells / slug / "metrics.json").read_text())
        gen = json.loads((cells / slug / "generate_metrics.json").read_text())
        assert int(r["iterations"]) == train["iterations"] == 2
        assert float(r["peak_memory_gb"]) == pytest.approx(train["peak_memory_gb"])
        assert float(r["training_time_s"]) == pytest.approx(train["training_time_s"])
        assert float(r["final_train_loss"]) == pytest.approx(train["final_train_loss"])
        assert float(r["inference_tokens_per_sec"]) == pytest.approx(gen["tokens_per_sec"])
    row_cells = [[c.strip() for c in row.split("|")[1:-1]] for row in rows[:3]]
    for c, slug in zip(row_cells, SLUGS[:3]):
        train = json.loads((cells / slug / "metrics.json").read_text())
        assert c[7] == f"{train['final_train_loss']:.3f} (val {train['final_val_loss']:.3f})"
        assert c[5] == f"{train['peak_memory_gb']:.2f} GB"
    for f in ("loss.png", "memory.png", "time.png"):  # PNG files (what they show: test_plots_draw_the_cells_figures)
        assert (out / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f


def test_plots_draw_the_cells_figures(matrix, tmp_path, monkeypatch):
    """The plots hold each cell's numbers: the loss curve of its metrics.csv, its peak memory and training time."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    _, _, _, out, _ = matrix
    report = runpy.run_path(str(ROOT / "scripts" / "report.py"))
    drawn = {}
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: drawn.__setitem__(Path(path).name, fig.axes[0]))
    cells = report["collect"](out)
    written = report["plots"](cells, tmp_path)
    assert [p.name for p in written] == ["loss.png", "memory.png", "time.png"] == sorted(drawn, key=list(drawn).index)
    ok = [c for c in cells if c["status"] == "ok"]
    curves = [list(line.get_ydata()) for line in drawn["loss.png"].lines]
    for c in ok:
        with open(Path(c["cell_dir"]) / "metrics.csv") as f:
            losses = [float(r["loss"]) for r in csv.DictReader(f) if r["loss"]]
        assert losses in curves, (c["cell_dir"], losses, curves)
    for name, key in (("memory.png", "peak_memory_gb"), ("time.png", "training_time_s")):
        heights = [bar.get_height() for bar in drawn[name].patches]
        assert heights == [c[key] if isinstance(c[key], (int, float)) else 0.0 for c in cells]


def test_rerun_skips_done_cells_and_finishes_interrupted_ones(matrix):
    tmp, ckpt, data, out, first = matrix
    cells = out / "tiny-llama"
    stamps = {slug: (cells / slug / "train_stdout.log").stat().st_mtime_ns for slug in SLUGS}
    gen_stamp = (cells / SLUGS[2] / "generate_stdout.log").stat().st_mtime_ns
    # An interrupted cell: training finished, generation never ran, status still "running"
    (cells / SLUGS[2] / "status.json").write_text(json.dumps({"status": "running", "exit_code": 0, "error": "",
                                                              "stage": "generate"}))
    (cells / SLUGS[2] / "generate_metrics.json").unlink()

    again = run_matrix(tmp, ckpt, data, out)
    assert again.returncode == 0, again.stderr
    assert f"[skip] tiny-llama {SLUGS[0]} (ok)" in again.stdout and f"[skip] tiny-llama {SLUGS[1]} (ok)" in again.stdout
    for slug in SLUGS[:3]:  # no finished training ran again
        assert (cells / slug / "train_stdout.log").stat().st_mtime_ns == stamps[slug]
    assert f"[train] tiny-llama {SLUGS[2]}" not in again.stdout and f"[generate] tiny-llama {SLUGS[2]}" in again.stdout
    assert (cells / SLUGS[2] / "generate_stdout.log").stat().st_mtime_ns != gen_stamp
    assert json.loads((cells / SLUGS[2] / "status.json").read_text())["status"] == "ok"
    assert f"[train] tiny-llama {FAILED}" in again.stdout  # failed cells are retried (SKIP_FAILED=1 skips them)
    assert "Cells: 1 done now, 2 skipped (done before), 1 failed" in again.stdout
    assert (out / "report.md").read_text().count("| ok |") == 3


def test_report_marks_oom_and_incomplete_cells(tmp_path):
    for slug, status in (("a", {"status": "oom", "exit_code": 137, "error": "Killed", "stage": "train"}),
                         ("b", {"status": "running", "exit_code": 0, "error": "", "stage": "train"}),
                         ("c", {"status": "failed", "exit_code": 1, "error": "RuntimeError: x | y", "stage": "train"})):
        cell = tmp_path / "model" / slug
        cell.mkdir(parents=True)
        (cell / "status.json").write_text(json.dumps(status))
        (cell / "cell.json").write_text(json.dumps({"model": "model", "setting": "bf16-true:bnb.nf4:AdamW:8",
                                                    "order": ord(slug)}))
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "report.py"), str(tmp_path), "--no_plots"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    rows = (tmp_path / "report.md").read_text().splitlines()[2:5]
    assert rows[0].endswith("| OOM |") and rows[1].endswith("| INCOMPLETE |")
    assert rows[2].endswith("| FAILED: RuntimeError: x \\| y |")  # a | in the message cannot break the table
    assert all("| bf16-true, bnb.nf4 | - | 8 | AdamW |" in r for r in rows)

    empty = subprocess.run([sys.executable, str(ROOT / "scripts" / "report.py"), str(tmp_path / "model" / "a")],
                           capture_output=True, text=True, timeout=60)
    assert empty.returncode == 2 and empty.stderr.startswith("error: no cells")


def test_out_of_memory_cells_are_recorded_as_oom(tmp_path):
    """A training killed by the OOM killer (exit 137) or failing with an out-of-memory error is an OOM cell."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
if [ "$1" = finetune/lora.py ]; then
    case "$*" in
        *"--micro_batch_size 3 "*) kill -KILL $$ ;;
        *"--micro_batch_size 5 "*)
            echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" >&2; exit 1 ;;
    esac
fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    env = dict(h_env(), MODELS=str(tmp_path / "some-model"), DATA_DIR=str(tmp_path), OUT_ROOT=str(tmp_path / "out"),
               SETTINGS="bf16-true:none:AdamW:3 bf16-true:none:AdamW:5", PYTHON=str(fake))
    res = subprocess.run(["bash", str(ROOT / "scripts" / "run_matrix.sh")], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    killed = json.loads((tmp_path / "out" / "some-model" / "bf16-true_none_AdamW_mb3" / "status.json").read_text())
    raised = json.loads((tmp_path / "out" / "some-model" / "bf16-true_none_AdamW_mb5" / "status.json").read_text())
    assert (killed["status"], killed["exit_code"]) == ("oom", 137)
    assert (raised["status"], raised["exit_code"]) == ("oom", 1) and "CUDA out of memory" in raised["error"]
    report = (tmp_path / "out" / "report.md").read_text().splitlines()
    assert [line.rsplit("|", 2)[1].strip() for line in report[2:4]] == ["OOM", "OOM"]
