"""What goes wrong in real use: bad inputs, full disks, kills, signals and diverging runs.

What is shown here:
1. every bad input is refused up front (before Lightning or the model load) with exit code 2 and one `error: ...` line
   naming the cause, and no file of the previous run in --out_dir is modified (also what --strategy fsdp cannot
   shard, --num_nodes without a launcher, and flags that disagree with the world torchrun or SLURM made);
2. a sample longer than --max_seq_length is truncated with a warning that counts them (the run goes on);
3. an adapter made for another base model is refused by generate/lora.py;
4. not enough disk space is found before training and a failed checkpoint write keeps the previous checkpoint;
5. SIGKILL at random moments of a run that checkpoints every iteration: every checkpoint file on disk is intact and the
   next run resumes from the newest one, ten times in a row, and the last run finishes;
6. SIGTERM saves a checkpoint and exits with 143; resuming retraces an uninterrupted run exactly; with two DDP
   processes a signal to one stops both at the same iteration;
7. an exploding learning rate in 16-true stops with the NaN message, and the last good checkpoint loads.

The error cases call finetune/lora.py's CLI entry point (`cli()`) in-process, which is what `python
finetune/lora.py` runs, to spare a Python + torch start per case; a sample of them also runs as a real subprocess.
"""
from __future__ import annotations

import errno
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import helpers_train as h
import pytest
import torch

from lit_qlora.adapter import Adapter
from lit_qlora.data.prepare import DataSettings, prepare_files
from lit_qlora.tokenizer import Tokenizer
from lit_qlora.train.training import list_checkpoints, load_latest_checkpoint
from lit_qlora.utils import UserError, atomic_torch_save, atomic_write


@pytest.fixture
def prev_run(tmp_path_factory, tmp_path):
    """A copy of a finished run's out_dir (checkpoints, adapter, metrics): a bad command must leave it untouched."""
    src, _ = h.trained_run(tmp_path_factory)
    out = tmp_path / "prev_run"
    shutil.copytree(src, out)
    return out


_MODULE = {}


def finetune_module():
    if "ft" not in _MODULE:
        spec = importlib.util.spec_from_file_location("finetune_lora_cli", h.FINETUNE)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # jsonargparse resolves the string annotations through sys.modules
        spec.loader.exec_module(mod)
        _MODULE["ft"] = mod
    return _MODULE["ft"]


def run_inprocess(args: list, capfd) -> SimpleNamespace:
    """`python finetune/lora.py ARGS` without a new interpreter: the same `cli()` with the same argv."""
    mod = finetune_module()
    capfd.readouterr()
    argv, sys.argv = sys.argv, [str(h.FINETUNE), *map(str, args)]
    try:
        mod.cli()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
    out, err = capfd.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def copy_ckpt(train_setup, dest: Path, drop: tuple = ()) -> Path:
    shutil.copytree(train_setup["ckpt"], dest, ignore=shutil.ignore_patterns(*drop) if drop else None)
    return dest


def write_data(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return folder


def prepared_folder(train_setup, dest: Path, tokenizer_dir: Path, max_seq_length: int) -> Path:
    prepare_files(train_setup["data_file"], None, Tokenizer(tokenizer_dir), dest,
                  DataSettings(max_seq_length, template="plain"))
    return dest


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


# case -> function(train_setup, tmp_path) returning ({flag: value} overrides, [substrings the error line must hold])
def _ckpt_missing(t, p):
    return dict(checkpoint_dir=p / "nope"), ["checkpoint folder", str(p / "nope"), "does not exist"]


def _ckpt_not_converted(t, p):
    d = copy_ckpt(t, p / "ckpt", drop=("*.safetensors", "*config.json"))
    return dict(checkpoint_dir=d), [str(d), "holds no model", "config.json"]


def _ckpt_truncated(t, p):
    d = copy_ckpt(t, p / "ckpt")
    _truncate(d / "lit_model.safetensors")
    return dict(checkpoint_dir=d), [str(d / "lit_model.safetensors"), "truncated"]


def _ckpt_garbage_header(t, p):  # a header length of 2^64 - 1: must be refused, not read
    d = copy_ckpt(t, p / "ckpt")
    w = d / "lit_model.safetensors"
    w.write_bytes(b"\xff" * 8 + w.read_bytes()[8:])
    return dict(checkpoint_dir=d), [str(w), "damaged or truncated"]


def _ckpt_partial(t, p):
    d = copy_ckpt(t, p / "ckpt", drop=("model_config.json", "config.json", "model.safetensors"))
    return dict(checkpoint_dir=d), ["partially converted", "model_config.json is missing"]


def _ckpt_disagrees(t, p):
    d = copy_ckpt(t, p / "ckpt")
    _edit_config(d / "model_config.json", n_embd=96)
    return dict(checkpoint_dir=d), [str(d / "lit_model.safetensors"), "disagree", "(320, 64)", "(320, 96)"]


def _ckpt_config_corrupt(t, p):
    d = copy_ckpt(t, p / "ckpt")
    (d / "model_config.json").write_text('{"name": "train_setup-llama", "n_embd": ')
    return dict(checkpoint_dir=d), [str(d / "model_config.json"), "is damaged"]


def _tokenizer_missing(t, p):
    d = copy_ckpt(t, p / "ckpt", drop=("tokenizer*",))
    return dict(checkpoint_dir=d), ["no tokenizer found in", str(d), "tokenizer.json or tokenizer.model"]


def _tokenizer_of_another_model(t, p):
    from helpers_tokenizer import make_hf_bpe_tokenizer

    d = copy_ckpt(t, p / "ckpt", drop=("tokenizer*",))
    make_hf_bpe_tokenizer(d, vocab_size=512)
    return dict(checkpoint_dir=d), ["has 512 tokens but the model only 320"]


def _data_missing(t, p):
    return dict(data_dir=p / "nodata"), ["data folder", str(p / "nodata"), "does not exist"]


def _data_other_tokenizer(t, p):
    from helpers_tokenizer import make_hf_bpe_tokenizer

    other = make_hf_bpe_tokenizer(p / "other_tok", vocab_size=300)
    return dict(data_dir=prepared_folder(t, p / "prep", other, 128)), ["was prepared for tokenizer",
                                                                       "this run uses tokenizer"]


def _data_other_max_len(t, p):
    d = prepared_folder(t, p / "prep", t["ckpt"], 128)
    return dict(data_dir=d, max_seq_length=64), ["max_seq_length=128", "max_seq_length=64"]


def _data_not_json(t, p):
    d = write_data(p / "data", "tasks.json", "instruction: kind\noutput: animal\n")
    return dict(data_dir=d), [str(d / "tasks.json"), "is not valid JSON"]


def _data_bad_jsonl(t, p):
    d = write_data(p / "data", "tasks.jsonl",
                   '{"instruction": "kind", "input": "owl", "output": "animal"}\n{"instruction": \n')
    return dict(data_dir=d), ["line 2 of", "is not valid JSON"]


def _data_missing_field(t, p):
    recs = h.make_records()
    del recs[3]["output"]
    d = write_data(p / "data", "tasks.json", json.dumps(recs))
    return dict(data_dir=d), [f"row 4 of {d / 'tasks.json'}", "has no 'output' field"]


def _data_unknown_column(t, p):
    pd = pytest.importorskip("pandas")
    (p / "data").mkdir()
    pd.DataFrame(h.make_records()).to_parquet(p / "data" / "train.parquet")
    return dict(data_dir=p / "data", prompt_column="question"), [
        f"row 1 of {p / 'data' / 'train.parquet'}", "has no 'question' field", "--prompt_column"]


def _data_torn_parquet(t, p):
    pd = pytest.importorskip("pandas")
    (p / "data").mkdir()
    pd.DataFrame(h.make_records()).to_parquet(p / "data" / "train.parquet")
    data = (p / "data" / "train.parquet").read_bytes()
    (p / "data" / "train.parquet").write_bytes(data[:len(data) // 2])
    return dict(data_dir=p / "data"), [str(p / "data" / "train.parquet"), "not a readable parquet file"]


def _data_sources_bad_weight(t, p):
    (p / "mix.yaml").write_text(f"- {{path: {t['data']}, weight: 0.7}}\n- {{path: {t['data']}, weight: -1}}\n")
    return dict(data_dir=None, data_sources=p / "mix.yaml"), [f"entry 2 of --data_sources file {p / 'mix.yaml'}",
                                                              "weight is -1, expected a finite number > 0"]


def _data_empty(t, p):
    d = write_data(p / "data", "tasks.json", "")
    return dict(data_dir=d), [str(d / "tasks.json"), "is empty"]


def _data_symlink_loop(t, p):  # the file fuzzer: a traceback (RuntimeError: Symlink loop from '.../alpaca.json')
    d = write_data(p / "data", "tasks.json", json.dumps(h.make_records()))
    os.symlink("alpaca.json", d / "alpaca.json")  # a link to itself: ELOOP
    return dict(data_dir=d), [str(d / "alpaca.json"), "is a symlink loop"]


def _lora_dropout_huge(t, p):  # the file fuzzer: torch's ValueError (dropout probability) after the model was built
    (p / "run.yaml").write_text("lora_dropout: 18446744073709551617\n")
    return dict(config=p / "run.yaml", lora_dropout=None, out_dir=p / "new"), [
        "--lora_dropout is 1.8446744073709552e+19", "from 0 to 1 (excluded)", f"--config {p / 'run.yaml'}"]


def _batch_size(t, p):
    return dict(batch_size=6), ["--batch_size 6 is not a multiple of --micro_batch_size 4 x devices 1"]


def _batch_size_devices(t, p):
    return dict(batch_size=12, devices=2), ["--batch_size 12 is not a multiple of --micro_batch_size 4 x devices 2"]


def _quantize(t, p):
    return dict(quantize="bnb.nf5"), ["unknown --quantize 'bnb.nf5'",
                                      "bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq, bnb.int8"]


def _precision(t, p):
    return dict(precision="fp8-true"), ["unknown --precision 'fp8-true'",
                                        "32-true, 16-true, bf16-true, 16-mixed, bf16-mixed"]


def _optimizer(t, p):
    return dict(optimizer="SGD"), ["unknown --optimizer 'SGD'",
                                   "AdamW, AdamW8bit, PagedAdamW, PagedAdamW8bit, PagedAdamW32bit"]


def _interval_zero(t, p):
    return dict(eval_interval=0), ["--eval_interval must be at least 1, got 0"]


def _strategy_unknown(t, p):
    return dict(strategy="zero3"), ["unknown --strategy 'zero3'", "auto, ddp, fsdp"]


def _fsdp_8bit_optimizer(t, p):  # bitsandbytes' optimizers have no rule for sharded (DTensor) parameters
    return dict(strategy="fsdp", optimizer="AdamW8bit"), ["--optimizer AdamW8bit", "FSDP cannot shard",
                                                          "bitsandbytes#89", "--optimizer AdamW"]


def _fsdp_int8(t, p):
    return dict(strategy="fsdp", quantize="bnb.int8"), ["--quantize bnb.int8 cannot be sharded", "bnb.nf4-dq"]


def _fsdp_fp16_mixed(t, p):
    return dict(strategy="fsdp", precision="16-mixed"), ["--precision 16-mixed", "--strategy fsdp", "bf16-mixed"]


def _num_nodes_without_launcher(t, p):
    return dict(num_nodes=2), ["--num_nodes 2 needs a launcher", "torchrun --nnodes", "SLURM", "Several machines"]


def _cuda_without_a_gpu(t, p):  # before: the data was prepared, then Fabric failed with a traceback
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    return dict(accelerator="cuda"), ["--accelerator cuda but no GPU is visible", "--accelerator cpu"]


def _num_nodes_zero(t, p):
    return dict(num_nodes=0), ["--num_nodes must be at least 1, got 0"]


def _resume_other_settings(t, p):
    return dict(lora_r=4), ["the checkpoint was made with lora=", "'r': 8", "'r': 4"]


def _resume_no_such_file(t, p):
    return dict(resume=p / "iter-000001.pth"), ["no such checkpoint"]


def _resume_non_finite_lora(t, p):  # the file fuzzer: hyperparameters.json rewritten, then a NaN loss at step 1
    ckpt = list_checkpoints(p / "prev_run")[0]  # not the last: the run would train on from it
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    name = sorted(state["lora"])[0]
    state["lora"][name].view(-1)[0] = float("nan")
    atomic_torch_save(state, ckpt)
    return dict(resume=ckpt), [f"--resume {ckpt}", f"LoRA tensor {name} holds non-finite values (1 NaN or inf)"]


def _resume_non_finite_optimizer_state(t, p):  # Adam's second moments: inf makes every later update NaN
    ckpt = list_checkpoints(p / "prev_run")[0]
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    state["resume"]["optimizer"]["state"][0]["exp_avg_sq"].view(-1)[0] = float("inf")
    atomic_torch_save(state, ckpt)
    return dict(resume=ckpt), [f"--resume {ckpt}", "resume.optimizer state 0 exp_avg_sq holds non-finite values"]


def _loftq_without_4bit(t, p):
    return dict(lora_init="loftq", quantize="bnb.int8", out_dir=p / "new"), [
        "--lora_init loftq needs a 4-bit --quantize", "--lora_init pissa"]


def _loftq_on_a_dense_head(t, p):  # LEARN_ARGS adapt the head: without --quantize_lm_head it stays dense
    return dict(lora_init="loftq", quantize="bnb.nf4", out_dir=p / "new"), [
        "--lora_init loftq with --lora_head true needs --quantize_lm_head true"]


def _pissa_rank_above_a_part(t, p):  # the tiny Llama's k and v parts of the fused qkv have 32 rows
    return dict(lora_init="pissa", lora_r=48, out_dir=p / "new"), [
        "--lora_init pissa needs --lora_r at most the smaller side", "transformer.h.0.attn.qkv has one of 32",
        "--lora_r 32 or less"]


def _rank_above_the_layers(t, p):  # the tiny Llama's n_embd is 64: Adapter.load refuses the adapter it would write
    return dict(lora_r=96, out_dir=p / "new"), ["--lora_r 96 is larger than the layers it adapts", "n_embd 64",
                                                "--lora_r 64 or less"]


def _dora_on_moe_experts(t, p):  # the one layer kind DoRA does not cover: a mixture's experts (LoRA does)
    from helpers import make_tiny_hf_model

    from lit_qlora.convert import convert_hf_checkpoint

    d = p / "moe"
    make_tiny_hf_model("qwen3_moe", d)
    convert_hf_checkpoint(d)
    for f in t["ckpt"].glob("tokenizer*"):
        shutil.copy(f, d / f.name)
    return dict(checkpoint_dir=d, lora_dora="true", lora_mlp="false", lora_experts="true", out_dir=p / "new"), [
        "--lora_dora on the experts", "not implemented", "leave --lora_dora off"]


CASES = {f.__name__[1:]: f for f in (
    _ckpt_missing, _ckpt_not_converted, _ckpt_truncated, _ckpt_garbage_header, _ckpt_partial, _ckpt_disagrees,
    _ckpt_config_corrupt,
    _tokenizer_missing, _tokenizer_of_another_model, _data_missing, _data_other_tokenizer, _data_other_max_len,
    _data_not_json, _data_bad_jsonl, _data_missing_field, _data_unknown_column,
    _data_torn_parquet, _data_sources_bad_weight, _data_empty, _data_symlink_loop, _lora_dropout_huge,
    _batch_size, _batch_size_devices, _quantize,
    _precision, _optimizer, _interval_zero, _resume_other_settings, _resume_no_such_file, _resume_non_finite_lora,
    _resume_non_finite_optimizer_state, _strategy_unknown,
    _fsdp_8bit_optimizer, _fsdp_int8, _fsdp_fp16_mixed, _num_nodes_without_launcher, _num_nodes_zero,
    _cuda_without_a_gpu,
    _loftq_without_4bit, _loftq_on_a_dense_head, _pissa_rank_above_a_part, _rank_above_the_layers,
    _dora_on_moe_experts)}
# also through a fresh interpreter
SUBPROCESS = {"ckpt_missing", "ckpt_truncated", "data_not_json", "data_unknown_column", "optimizer"}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_up_front(case, train_setup, prev_run, tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("LIT_QLORA_DEBUG", raising=False)
    overrides, expect = CASES[case](train_setup, tmp_path)
    out_dir = overrides.pop("out_dir", prev_run)  # a new folder: a check the resume check would come before
    args = h.train_args(train_setup, out_dir, **{**h.LEARN_ARGS, "resume": "auto", **overrides})
    before = h.snapshot(prev_run)
    r = run_inprocess(args, capfd)
    line = h.assert_one_line_error(r, *expect)  # one line: nothing was loaded or printed before the check
    assert "Loaded" not in r.stderr and "Seed set" not in r.stderr
    assert h.snapshot(prev_run) == before, f"{case} modified files of the previous run"
    if case in SUBPROCESS:
        r2 = h.run_script(h.FINETUNE, args)
        assert h.assert_one_line_error(r2, *expect) == line
        assert h.snapshot(prev_run) == before


# Launched by torchrun or SLURM on several machines: the flags must describe the world the launcher made, and that
# world must divide the batch (torchrun and SLURM are recognized from their environment variables, as Fabric does)
TORCHRUN = dict(TORCHELASTIC_RUN_ID="test", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", RANK="0", LOCAL_RANK="0",
                GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
SLURM = dict(SLURM_NTASKS="4", SLURM_NNODES="2", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NAME="train")
LAUNCHED = {
    "batch_not_divided_by_the_world": (TORCHRUN, dict(devices=2, num_nodes=2, batch_size=12),
                                       ["--batch_size 12 is not a multiple of --micro_batch_size 4 x devices 2 x "
                                        "nodes 2", "--batch_size 16"]),
    "torchrun_world_differs": (dict(TORCHRUN, WORLD_SIZE="2", LOCAL_WORLD_SIZE="1"), dict(devices=2, num_nodes=1),
                               ["torchrun starts 2 processes, 1 per machine", "pass --devices 1 --num_nodes 2"]),
    "slurm_nodes_differ": (SLURM, dict(devices=2, num_nodes=1), ["SLURM gave the job 2 nodes", "--num_nodes 2"]),
}


@pytest.mark.parametrize("case", list(LAUNCHED))
def test_bad_world_under_a_launcher_is_refused_up_front(case, train_setup, prev_run, capfd, monkeypatch):
    monkeypatch.delenv("LIT_QLORA_DEBUG", raising=False)
    env, overrides, expect = LAUNCHED[case]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    before = h.snapshot(prev_run)
    r = run_inprocess(h.train_args(train_setup, prev_run, **{**h.LEARN_ARGS, "resume": "auto", **overrides}), capfd)
    h.assert_one_line_error(r, *expect)
    assert "Loaded" not in r.stderr and "Seed set" not in r.stderr and h.snapshot(prev_run) == before


def test_out_dir_under_a_regular_file(train_setup, tmp_path, capfd):
    (tmp_path / "afile").write_text("x")
    r = run_inprocess(h.train_args(train_setup, tmp_path / "afile" / "out"), capfd)
    h.assert_one_line_error(r, "cannot write to --out_dir", str(tmp_path / "afile" / "out"))


def test_out_dir_not_writable(train_setup, tmp_path, capfd, monkeypatch):
    """A read-only folder. Root writes into a chmod 555 folder anyway (CI runs as root), so there the file system's
    refusal is simulated where the probe file is created: the same PermissionError a user gets."""
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    if os.geteuid() == 0:
        write_text = Path.write_text

        def refuse(path: Path, *args, **kwargs):
            if path.parent == out:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return write_text(path, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", refuse)
    try:
        r = run_inprocess(h.train_args(train_setup, out), capfd)
    finally:
        out.chmod(0o755)
    h.assert_one_line_error(r, "cannot write to --out_dir", str(out), "Permission denied")


def test_resume_true_without_checkpoint(train_setup, prev_run, capfd):
    shutil.rmtree(prev_run / "checkpoints")
    before = h.snapshot(prev_run)
    r = run_inprocess(h.train_args(train_setup, prev_run, **{**h.LEARN_ARGS, "resume": "true"}), capfd)
    h.assert_one_line_error(r, "--resume: no intact checkpoint in", "--resume auto")
    assert h.snapshot(prev_run) == before


def test_new_run_over_a_previous_one_is_refused(train_setup, prev_run, capfd):
    before = h.snapshot(prev_run)
    r = run_inprocess(h.train_args(train_setup, prev_run, **h.LEARN_ARGS), capfd)
    h.assert_one_line_error(r, "already holds checkpoints", "--resume")
    assert h.snapshot(prev_run) == before


# ---- 2. long samples ---------------------------------------------------------------------------------------
def test_long_sample_is_truncated_with_a_warning(train_setup, tmp_path):
    recs = h.make_records()
    recs[5]["output"] = "a very long answer that goes on and on " * 3
    data = write_data(tmp_path / "data", "tasks.json", json.dumps(recs))
    r = h.train(dict(train_setup, data=data), tmp_path / "out", max_iters=2, max_seq_length=24)
    assert "warning: 1 of 64 samples were longer than max_seq_length=24 and were truncated" in r.stderr
    assert (tmp_path / "out" / "lit_model_lora_finetuned.pth").is_file()


# ---- 3. adapter of another base model ------------------------------------------------------------------------
def test_adapter_for_another_base_model_is_refused(train_setup, tmp_path):
    from lit_qlora.config import Config
    from lit_qlora.lora import LoRAConfig, apply_lora
    from lit_qlora.model import GPT

    other = Config.from_file(train_setup["ckpt"] / "model_config.json")
    other.name, other.n_embd, other.intermediate_size = "other-train_setup", 32, 64
    model = GPT(other)
    lora = LoRAConfig(r=4, alpha=8)
    apply_lora(model, lora)
    with torch.no_grad():  # (apply_lora leaves them uninitialized: an adapter holding NaN is refused for that first)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_()
    Adapter.of_model(model, lora, train={"template": "plain"}).save(tmp_path / "other.pth")
    r = h.run_script(h.GENERATE_LORA, ["--checkpoint_dir", train_setup["ckpt"], "--lora_path", tmp_path / "other.pth",
                                       "--prompt", "kind", "--precision", "32-true"])
    h.assert_one_line_error(r, str(tmp_path / "other.pth"), "other-train_setup (n_embd=32)", "(n_embd=64)")
    assert r.stdout == ""


# ---- 4. disk space -----------------------------------------------------------------------------------------------
def test_files_written_atomically_get_the_umask_permissions_not_the_temporary_files(tmp_path):
    """Checkpoints, converted weights, stored quantizations and exports are written through a private (0600) temporary
    file; the file itself must be readable as any new file is (a checkpoint folder shared by a team)."""
    old = os.umask(0o027)
    try:
        atomic_write(tmp_path / "a.bin", lambda p: p.write_bytes(b"x"))
        atomic_torch_save({"x": 1}, tmp_path / "b.pt")
    finally:
        os.umask(old)
    for name in ("a.bin", "b.pt"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o640, name


def test_not_enough_disk_space_is_found_before_training(train_setup, prev_run, capfd, monkeypatch):
    import shutil as shutil_mod

    real = shutil_mod.disk_usage
    monkeypatch.setattr(shutil_mod, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    before = h.snapshot(prev_run)
    r = run_inprocess(h.train_args(train_setup, prev_run, **{**h.LEARN_ARGS, "resume": "auto"}), capfd)
    h.assert_one_line_error(r, "only 1 MiB free in", str(prev_run), "free disk space or choose another --out_dir")
    assert h.snapshot(prev_run) == before


def test_compile_without_a_cpp_compiler_is_refused_up_front(train_setup, tmp_path, capfd, monkeypatch):
    import shutil as shutil_mod

    monkeypatch.setattr(shutil_mod, "which", lambda name, *a, **k: None)  # no g++ / clang++ on PATH
    r = run_inprocess(h.train_args(train_setup, tmp_path / "out", compile="true"), capfd)
    h.assert_one_line_error(r, "--compile on CPU needs a C++ compiler", "leave --compile off")
    assert not (tmp_path / "out").exists()


def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    import lit_qlora.utils as utils
    from lit_qlora.train.training import save_checkpoint

    payload = {"format": "lit-qlora-adapter-v1", "lora": {"w": torch.ones(3)}, "resume": {"step": 1}}
    first = tmp_path / "checkpoints" / "iter-000001.pth"
    save_checkpoint(first, payload)

    def full_disk(obj, f, *a, **k):
        Path(f).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(utils.torch, "save", full_disk)
    with pytest.raises(UserError, match=r"could not write checkpoint .*iter-000002.pth \(No space left on device\); "
                                        r"the previous checkpoint is intact"):
        save_checkpoint(tmp_path / "checkpoints" / "iter-000002.pth", payload)
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["iter-000001.pth"]  # no temp file left
    # the previous checkpoint is intact (this payload is a stand-in, not a resumable checkpoint: load it as a file)
    assert list_checkpoints(tmp_path) == [first] and torch.load(first, weights_only=True)["resume"] == {"step": 1}


# ---- 5. SIGKILL at random moments ----------------------------------------------------------------------------------
# r=64 on every target: ~2 MB checkpoints, so writing one (with its fsyncs) is a good part of each iteration
KILL_ARGS = dict(max_iters=100000, save_interval=1, eval_interval=100000, log_interval=100000, keep_checkpoints=3,
                 resume="auto", micro_batch_size=2, lora_r=64, lora_alpha=64, lora_key=True, lora_projection=True,
                 lora_mlp=True, lora_head=True)


def _wait_for_temp_file(folder: Path, timeout: float = 3.0) -> bool:
    """Poll (busily) until a checkpoint is being written, i.e. its temp file exists."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if any(e.name.startswith(".iter-") and e.name.endswith(".tmp") for e in os.scandir(folder)):
                return True
        except FileNotFoundError:
            pass
    return False


def test_sigkill_at_random_moments_always_resumes(train_setup, tmp_path):
    """Six kills in a row, each at a random moment (seeded): while loading, a random time into the training loop
    (where much of the time goes to writing a checkpoint, one per iteration), or right when a checkpoint's temp file
    appears. After each kill every checkpoint on disk must load, and the next run must resume from the newest one."""
    rng = random.Random(20240531)
    out = tmp_path / "out"
    expect_resume, mid_write, trials = None, 0, 6
    for trial in range(trials + 1):
        last = trial == trials
        args = h.train_args(train_setup, out,
                            **{**KILL_ARGS, **({"max_iters": expect_resume[1] + 3, "resume": "true"} if last else {})})
        if last:
            r = h.run_script(h.FINETUNE, args)
            assert r.returncode == 0, r.stderr
            err = r.stderr
        else:
            proc = h.spawn_script(h.FINETUNE, args)
            kind = rng.choice(["loading", "training", "training", "writing"])
            anchor = "Seed set" if kind == "loading" else "Training "
            lines = []
            for line in proc.stderr:
                lines.append(line)
                if anchor in line:
                    break
            if kind == "writing":
                _wait_for_temp_file(out / "checkpoints")
            else:
                time.sleep(rng.uniform(0.0, 0.6 if kind == "loading" else 0.4))
            proc.kill()
            _, rest = proc.communicate(timeout=60)
            assert proc.returncode == -signal.SIGKILL, "".join(lines) + rest
            err = "".join(lines) + rest
        # the run resumed from the newest checkpoint left by the previous kill (or started fresh when there was none)
        if expect_resume is not None and ("Training " in err or last):
            assert f"Resuming from {expect_resume[0]} at iteration {expect_resume[1]}" in err, (trial, err)
        assert "is damaged" not in err and "Traceback" not in err, err
        if last:
            break
        # every checkpoint file on disk is whole: atomic writes leave either the old file or the new one
        ckpts = list_checkpoints(out)
        for p in ckpts:
            state = torch.load(p, map_location="cpu", weights_only=False)
            assert state["resume"]["step"] == int(p.stem.split("-")[1])
        mid_write += bool(list((out / "checkpoints").glob(".iter-*.tmp"))) if (out / "checkpoints").is_dir() else 0
        path, state = load_latest_checkpoint(out)
        if state is not None:
            expect_resume = (path, state["resume"]["step"])
    assert expect_resume is not None, "no kill happened after the first checkpoint; the test did not test anything"
    assert (out / "lit_model_lora_finetuned.pth").is_file()
    assert len(list_checkpoints(out)) <= 3 and not list((out / "checkpoints").glob(".iter-*.tmp"))
    assert mid_write >= 1, "no kill hit a checkpoint write"
    print(f"{trials} kills, {mid_write} of them while a checkpoint was being written; last resume at iteration "
          f"{expect_resume[1]}")


# ---- 6. SIGTERM ------------------------------------------------------------------------------------------------------
def test_sigterm_saves_a_checkpoint_and_resume_continues(train_setup, tmp_path_factory, tmp_path):
    a, c = h.resume_reference(tmp_path_factory), tmp_path / "C"
    proc = h.spawn_script(h.FINETUNE, h.train_args(train_setup, c, **h.RESUME_ARGS))
    err = []
    for line in proc.stderr:  # the signal handler is in place once "Training ..." is printed
        err.append(line)
        if line.startswith("Training "):
            proc.send_signal(signal.SIGTERM)
            break
    _, rest = proc.communicate(timeout=120)
    err = "".join(err) + rest
    assert proc.returncode == 128 + signal.SIGTERM, err
    m = re.search(r"Stopped at iteration (\d+); continue with --resume \(checkpoint (.+)\)", err)
    assert m, err
    step, path = int(m.group(1)), Path(m.group(2))
    assert 1 <= step < h.RESUME_ARGS["max_iters"] and path == c / f"checkpoints/iter-{step:06d}.pth" and path.is_file()
    assert not (c / "lit_model_lora_finetuned.pth").exists()
    r = h.train(train_setup, c, resume="true", **h.RESUME_ARGS)
    assert f"Resuming from {path} at iteration {step}" in r.stderr
    h.assert_same_run(a, c)


def test_sigterm_to_one_of_two_ddp_processes_stops_both_and_resume_continues(train_setup, tmp_path):
    """Two DDP processes (Fabric starts the second): SIGTERM reaches the first only, yet both stop at the same
    iteration after one checkpoint, exit, and leave nothing running; two processes resuming from it end where one
    uninterrupted process over the same global batches does."""
    import psutil

    args = dict(h.RESUME_ARGS, max_iters=12, lora_dropout=0.0, accelerator="cpu")
    ref = tmp_path / "one"
    h.train(train_setup, ref, **dict(args, micro_batch_size=4))
    out = tmp_path / "ddp"
    proc = h.spawn_script(h.FINETUNE, h.train_args(train_setup, out, devices=2, **args))
    err, ranks = [], []
    for line in proc.stderr:
        err.append(line)
        if line.startswith("Training "):  # both processes run by now, each with its signal handler in place
            ranks = psutil.Process(proc.pid).children(recursive=True)
            proc.send_signal(signal.SIGTERM)
            break
    try:
        _, rest = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        for p in [proc, *ranks]:
            p.kill()
        raise
    err = "".join(err) + rest
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert ranks and not psutil.wait_procs(ranks, timeout=30)[1], "the second process is still running"
    m = re.search(r"Stopped at iteration (\d+); continue with --resume \(checkpoint (.+)\)", err)
    assert m, err
    step, path = int(m.group(1)), Path(m.group(2))
    assert 1 <= step < args["max_iters"] and path == out / f"checkpoints/iter-{step:06d}.pth" and path.is_file()
    assert not (out / "lit_model_lora_finetuned.pth").exists()
    r = h.train(train_setup, out, resume="true", devices=2, **args)
    assert f"Resuming from {path} at iteration {step}" in r.stderr
    la, lb = h.losses_by_iter(ref), h.losses_by_iter(out)
    assert sorted(la) == sorted(lb) == list(range(1, 13)) and all(abs(la[i] - lb[i]) < 1e-5 for i in la), (la, lb)
    final = "lit_model_lora_finetuned.pth"
    assert h.max_abs_diff(h.load_lora(ref / final), h.load_lora(out / final)) < 1e-5


# ---- 7. NaN ---------------------------------------------------------------------------------------------------------
def test_exploding_learning_rate_stops_with_nan_message(train_setup, tmp_path):
    from lit_qlora.config import Config

    out = tmp_path / "out"
    r = h.train(train_setup, out, check=False, max_iters=20, precision="16-true", learning_rate=1e4, save_interval=1,
                eval_interval=100)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    line = h.last_line(r.stderr)
    m = re.fullmatch(r"error: (loss|weights) became (nan|inf|-inf|non-finite) at iteration (\d+) \((.+?)\); .+", line)
    assert m, line
    n, ckpts = int(m.group(3)), list_checkpoints(out)
    assert n >= 2 and ckpts[-1].name == f"iter-{n - 1:06d}.pth", (n, ckpts)
    assert m.group(4) == f"the last good checkpoint is {ckpts[-1]}"
    adapter = Adapter.load(ckpts[-1], Config.from_file(train_setup["ckpt"] / "model_config.json"))
    assert all(torch.isfinite(v).all() for v in adapter.lora.values())
    assert not (out / "lit_model_lora_finetuned.pth").exists()


def test_nan_policy_skip_skips_steps_then_gives_up(train_setup, tmp_path):
    """--nan_policy skip: a step with a non-finite loss changes nothing and training goes on; ten of them end the run
    (exit 2, one line) with the checkpoints written before intact."""
    out = tmp_path / "out"
    r = h.train(train_setup, out, check=False, max_iters=30, precision="16-true", learning_rate=30.0, save_interval=1,
                eval_interval=100, nan_policy="skip")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    skipped = re.findall(r"warning: non-finite loss at iteration (\d+); step skipped \((\d+) so far\)", r.stderr)
    assert [int(n) for _, n in skipped] == list(range(1, 11)), skipped
    assert re.fullmatch(r"error: 10 non-finite losses, the last at iteration (\d+); .+", h.last_line(r.stderr))
    steps = [int(i) for i, _ in skipped]
    ckpts = [int(p.stem.split("-")[1]) for p in list_checkpoints(out)]
    assert ckpts and not set(ckpts) & set(steps) and max(ckpts) < steps[0]  # skipped steps write no checkpoint
    for path in list_checkpoints(out)[-1:]:
        state = torch.load(path, map_location="cpu", weights_only=False)
        assert all(torch.isfinite(v).all() for v in state["lora"].values())
    assert not (out / "lit_model_lora_finetuned.pth").exists()


def _flip_a_tensor_byte(path: Path) -> str:
    """One bit flipped in the middle of the largest tensor's bytes of a torch file (a zip of stored entries): what
    torch.load reads back as another number. Returns the entry's name."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little"), \
        int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
    raw[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    return info.filename


def test_a_changed_byte_in_a_torch_files_tensors_is_found_by_its_crc(prev_run, capfd):
    """An adapter .pth with one flipped bit in a tensor (the file fuzzer, seeds 13001 / 13007: loaded silently, since
    torch.load never checks the zip's CRC-32 sums) is refused in one line naming the file and the entry; the newest
    training checkpoint so damaged is passed over for the previous one, said so, and --resume naming it refuses it."""
    from lit_qlora.config import Config
    from lit_qlora.train.training import find_resume

    config = Config.from_file(Path(json.loads((prev_run / "hyperparameters.json").read_text())["checkpoint_dir"])
                              / "model_config.json")
    adapter = prev_run / "lit_model_lora_finetuned.pth"
    entry = _flip_a_tensor_byte(adapter)
    assert torch.load(adapter, weights_only=True)  # what torch itself does with it: loads
    with pytest.raises(UserError) as e:
        Adapter.load(adapter, config)
    assert str(adapter) in str(e.value) and entry in str(e.value) and "CRC-32" in str(e.value)
    assert "\n" not in str(e.value)
    previous = list_checkpoints(prev_run)[-1]
    newest = previous.with_name("iter-999999.pth")  # the run keeps one: a newer copy of it is the one damaged
    shutil.copy(previous, newest)
    _flip_a_tensor_byte(newest)
    path, state = load_latest_checkpoint(prev_run)
    assert path == previous and state is not None
    assert f"{newest} is damaged (ValueError: its entry" in capfd.readouterr().err
    with pytest.raises(UserError, match="CRC-32"):
        find_resume(prev_run, str(newest))
