"""Every bad input refused: seeded corruptions of every file kind the CLIs read (tests/helpers_fuzz.py) end accepted
(the damage is undetectable or harmless, or the file is still valid and read as the format's reference reads it) or
refused in one line, never in a traceback or a silent other reading of a wrong file, and leave every other file as
it was; a sample goes through the real scripts. And one training run per --out_dir (an OS lock, gone with its
process).

The default run fuzzes DEFAULT_CASES seeds per file kind in-process; `-m fuzz_full` runs FULL_CASES per kind."""
from __future__ import annotations

import json
import signal
import time
from types import SimpleNamespace

import helpers_fuzz as fz
import helpers_train as h
import pytest
import torch

DEFAULT_CASES = 5
FULL_CASES = 40


@pytest.fixture(scope="module")
def pristine(train_setup, tmp_path_factory):
    return fz.build_pristine(tmp_path_factory.mktemp("fuzz"), train_setup)


def _check(results: list[dict]) -> None:
    """No traceback, no file changed, and no silent different reading of a file that is not valid ("wrong")."""
    bad = [r for r in results if fz._class(r) in ("traceback", "changed", "wrong")]
    assert not bad, "\n".join(f"{r['kind']} seed {r['seed']} ({r['corruption']}): {r['outcome']}: {r['detail']}"
                              for r in bad) + "\n" + fz.table(results)


@pytest.mark.parametrize("kind", list(fz.KINDS))
def test_fuzzed_file_is_accepted_or_refused_in_one_line(kind, pristine, tmp_path):
    _check(fz.run_cases(pristine, range(DEFAULT_CASES), [kind], tmp_path))


@pytest.mark.fuzz_full
def test_fuzz_full(pristine, tmp_path, request):
    if "fuzz_full" not in (request.config.getoption("-m") or ""):
        pytest.skip("the full fuzzer runs with -m fuzz_full (the default run has the bounded subset above)")
    results = fz.run_cases(pristine, range(DEFAULT_CASES, DEFAULT_CASES + FULL_CASES), None, tmp_path)
    print(fz.table(results))
    _check(results)


# ---- through the real scripts -------------------------------------------------------------------------------------
def _copy_run(pristine, dest):
    import shutil

    shutil.copytree(pristine["run"], dest)
    return dest


def test_resume_on_a_damaged_metrics_csv_changes_nothing(pristine, tmp_path):
    """The issue's case: --resume over a metrics.csv that is not text rewrote hyperparameters.json before failing."""
    out = _copy_run(pristine, tmp_path / "run")
    (out / "metrics.csv").write_bytes(b"iter,step,loss\n1,1,\xff\xfe2.0\n")
    before = h.snapshot(out)
    setup = {"ckpt": pristine["ckpt"], "data": pristine["data"]}
    r = h.run_script(h.FINETUNE, h.train_args(setup, out, max_iters=4, save_interval=1, keep_checkpoints=0,
                                              resume="auto"))
    h.assert_one_line_error(r, str(out / "metrics.csv"), "not UTF-8")
    assert h.snapshot(out) == before


def test_damaged_adapter_is_refused_by_generate_merge_and_export(pristine, tmp_path):
    """An adapter whose lora_config.r is 10^18 (it loads as a pickle) and one without model_config.bias."""
    payload = torch.load(pristine["run"] / "lit_model_lora_finetuned.pth", weights_only=True)
    huge = {**payload, "lora_config": {**payload["lora_config"], "r": 10**18}}
    no_bias = {**payload, "model_config": {k: v for k, v in payload["model_config"].items() if k != "bias"}}
    torch.save(huge, tmp_path / "huge.pth")
    torch.save(no_bias, tmp_path / "no_bias.pth")
    ck = pristine["ckpt"]
    r = h.run_script(h.GENERATE_LORA, ["--checkpoint_dir", ck, "--lora_path", tmp_path / "huge.pth", "--prompt", "x",
                                       "--max_new_tokens", "2"])
    h.assert_one_line_error(r, str(tmp_path / "huge.pth"), "lora_config", "r is 1000000000000000000")
    r = h.run_script(h.ROOT / "scripts" / "export_gguf.py", ["--checkpoint_dir", ck, "--lora_path",
                                                              tmp_path / "no_bias.pth", "--out_file",
                                                              tmp_path / "x.gguf"])
    h.assert_one_line_error(r, str(tmp_path / "no_bias.pth"), "no 'bias'")
    assert not (tmp_path / "x.gguf").exists()
    r = h.run_script(h.MERGE, ["--checkpoint_dir", ck, "--lora_path", tmp_path / "huge.pth", "--out_dir",
                               tmp_path / "merged"])
    h.assert_one_line_error(r, str(tmp_path / "huge.pth"), "lora_config")


def test_damaged_text_files_are_refused_by_convert_and_prepare(pristine, tmp_path):
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(pristine["hf_only"], hf)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "head_dim": float("inf")}))
    r = h.run_script(h.ROOT / "scripts" / "convert_hf_checkpoint.py", ["--checkpoint_dir", hf])
    h.assert_one_line_error(r, str(hf / "config.json"), "head_dim is inf")
    assert not (hf / "lit_model.safetensors").exists()
    data = tmp_path / "alpaca.json"
    data.write_bytes(pristine["data_file"].read_bytes()[:50] + b"\xff" + pristine["data_file"].read_bytes()[50:])
    r = h.run_script(h.ROOT / "scripts" / "prepare_alpaca.py", ["--data_file", data, "--checkpoint_dir",
                                                                pristine["ckpt"], "--destination_path",
                                                                tmp_path / "prep"])
    h.assert_one_line_error(r, str(data), "not UTF-8", "offset 50")


def test_a_valid_file_is_told_apart_from_a_wrong_reading_by_the_reference(pristine, tmp_path, monkeypatch):
    """The "valid file" class: a damaged file that still is a valid one, read as the format's reference reads it. A
    tokenizer_config.json naming another token as bos is one (transformers agrees with our reading); the same edit
    read by a Tokenizer that ignored the tokens tokenizer_config.json names is not (transformers disagrees); an Alpaca
    record with its input renamed 'Input' is not (the format has no such field)."""
    d = fz._case_folder(pristine, tmp_path / "case")
    target = d / "ckpt" / "tokenizer_config.json"
    original = target.read_bytes()
    data = json.loads(original)
    data["bos_token"] = "x"
    target.write_text(json.dumps(data))
    assert fz.valid_edit("tokenizer_config", original, d, target) == "transformers reads the tokenizer as we do"
    tok_json = d / "ckpt" / "tokenizer.json"
    spec = json.loads(tok_json.read_text())
    spec["added_tokens"] = []  # transformers still makes <s> </s> <unk> <pad> special (tokenizer_config names them)
    tok_json.write_text(json.dumps(spec))
    assert fz.valid_edit("tokenizer_config", original, d, target)
    from lit_qlora.tokenizer import Tokenizer

    monkeypatch.setattr(Tokenizer, "_add_named_specials", lambda self, config: None)  # a reader that forgets them
    assert fz.valid_edit("tokenizer_config", original, d, target) is None

    alpaca = d / "data" / "tasks.json"
    original = alpaca.read_bytes()
    records = json.loads(original)
    records[3]["output"] = "another answer"
    alpaca.write_text(json.dumps(records))
    assert fz.valid_edit("alpaca_json", original, d, alpaca) == "an Alpaca record's text (input is optional)"
    records = json.loads(original)
    records[3]["Input"] = records[3].pop("input", "x")  # the one change: a field renamed
    alpaca.write_text(json.dumps(records))
    assert fz.valid_edit("alpaca_json", original, d, alpaca) is None


def test_hyperparameters_json_is_accepted_as_config(pristine):
    from lit_qlora.args import parse_finetune_args

    hp = pristine["run"] / "hyperparameters.json"
    given = json.loads(hp.read_text())
    args = parse_finetune_args(["--config", str(hp)])
    assert args.lora.config().r == given["lora_r"] and args.train.max_iters == given["max_iters"]
    assert str(args.run.out_dir) == given["out_dir"]


# ---- one run per out_dir --------------------------------------------------------------------------------------------
LOCK_ARGS = dict(max_iters=100000, save_interval=1, eval_interval=100000, log_interval=1, keep_checkpoints=2)


def _wait_for(proc, text: str, timeout: float = 120) -> str:
    seen, end = "", time.time() + timeout
    while time.time() < end:
        line = proc.stderr.readline() if proc.stderr else ""
        if not line and proc.poll() is not None:
            break
        seen += line
        if text in line:
            return seen
    raise AssertionError(f"{text!r} never came:\n{seen}")


def test_second_run_on_the_same_out_dir_is_refused_and_a_killed_run_resumes(train_setup, tmp_path):
    out = tmp_path / "out"
    first = h.spawn_script(h.FINETUNE, h.train_args(train_setup, out, **LOCK_ARGS))
    try:
        _wait_for(first, "Saved checkpoint")  # the first run holds the lock and trains
        second = h.run_script(h.FINETUNE, h.train_args(train_setup, out, resume="auto", max_iters=3))
        h.assert_one_line_error(second, f"--out_dir {out} is in use by another run (process {first.pid})")
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL
    # the kernel dropped the lock with the process: resuming needs no manual step
    newest = sorted((out / "checkpoints").glob("iter-*.pth"))[-1]
    step = int(newest.stem.split("-")[1])
    r = h.train(train_setup, out, resume="auto", **{**LOCK_ARGS, "max_iters": step + 1})
    assert "Resuming from" in r.stderr and "in use by another run" not in r.stderr


def test_two_runs_started_together_one_is_refused(train_setup, tmp_path):
    """Both launched at the same moment on one fresh --out_dir: exactly one trains to the end, the other exits 2 in one
    line (the lock naming the winner's process, or the winner's checkpoints already there), and the folder holds one
    run's files."""
    out = tmp_path / "out"
    args = h.train_args(train_setup, out, max_iters=2, save_interval=1, eval_interval=100000)
    procs = [h.spawn_script(h.FINETUNE, args) for _ in range(2)]
    results = [(p, *p.communicate(timeout=300)) for p in procs]
    codes = sorted(p.returncode for p, _, _ in results)
    assert codes == [0, 2], [(p.returncode, err[-2000:]) for p, _, err in results]
    (winner, _, _), (loser, _, err) = sorted(results, key=lambda r: r[0].returncode)
    line = h.assert_one_line_error(SimpleNamespace(returncode=loser.returncode, stderr=err), str(out))
    # the loser meets the lock while the winner runs, or (if it starts slower) the winner's first checkpoint
    assert (f"is in use by another run (process {winner.pid})" in line
            or "already holds checkpoints of a run; pass --resume" in line), line
    assert [r["iter"] for r in h.read_metrics(out)] == ["1", "2"]
