"""finetune/lora.py's arguments: grouped dataclasses with flat flags, --config / --print_config round trips, the demo
preset under the flags given, --help from the field docstrings, and the `lit-qlora` console command."""
from __future__ import annotations

import json
import math
import runpy
import subprocess
import sys
from dataclasses import fields

import helpers_train as h
import pytest
import yaml

from lit_qlora import demo
from lit_qlora.args import GROUPS, finetune_parser, parse_finetune_args
from lit_qlora.utils import UserError

FLAG_COUNT = 66  # the 45 flags finetune/lora.py had before the groups (none renamed, none lost) + packing, num_nodes,
# lora_rslora, loraplus_lr_ratio, lora_dora, logger, logger_dir, early_stopping_patience, early_stopping_min_delta,
# save_best, lora_init, loftq_iters,
# prompt_column, input_column, response_column, messages_column, data_sources, streaming, lora_experts, lora_router,
# router_aux_loss_coef


def test_flags_are_flat_and_unchanged():
    names = [f.name for g in GROUPS for f in fields(g)]
    assert len(names) == len(set(names)) == FLAG_COUNT
    args = parse_finetune_args(["--checkpoint_dir", "ckpt", "--learning_rate", "0.01", "--lora_r", "4",
                                "--eval_iters", "3", "--micro_batch_size", "auto", "--quantize", "bnb.nf4"])
    assert (args.train.learning_rate, args.lora.lora_r, args.eval.eval_iters) == (0.01, 4, 3)
    assert args.train.micro_batch_size == "auto" and args.run.quantize == "bnb.nf4"
    assert args.lora.config().r == 4 and args.lora.config().alpha == 16


def test_print_config_round_trips_through_config(tmp_path, capsys):
    argv = ["--checkpoint_dir", "ckpt", "--data_dir", "data", "--learning_rate", "0.02", "--lora_mlp", "true",
            "--grad_clip", "null", "--precision", "32-true"]
    with pytest.raises(SystemExit):
        parse_finetune_args([*argv, "--print_config"])
    printed = capsys.readouterr().out
    mapping = yaml.safe_load(printed)
    assert isinstance(mapping, dict) and len(mapping) == FLAG_COUNT and mapping["learning_rate"] == 0.02
    (tmp_path / "run.yaml").write_text(printed)
    assert parse_finetune_args(["--config", str(tmp_path / "run.yaml")]) == parse_finetune_args(argv)
    # flags after --config override it
    later = parse_finetune_args(["--config", str(tmp_path / "run.yaml"), "--learning_rate", "0.5"])
    assert later.train.learning_rate == 0.5


def test_demo_preset_lies_under_the_flags_given():
    preset = yaml.safe_load(demo.PRESET.read_text())
    args = parse_finetune_args([])
    assert args.run.checkpoint_dir == demo.DEMO_CHECKPOINT and args.data.data_dir == demo.DEMO_DATA_DIR
    flat = args.as_flat_dict()
    assert all(flat[k] == (str(v) if k.endswith("_dir") else v) for k, v in preset.items()), (preset, flat)
    mine = parse_finetune_args(["--learning_rate", "0.01", "--lora_r", "4"])
    assert (mine.train.learning_rate, mine.lora.lora_r, mine.lora.lora_alpha) == (0.01, 4, preset["lora_alpha"])
    # with a model of one's own, nothing of the demo applies
    own = parse_finetune_args(["--checkpoint_dir", "ckpt", "--data_dir", "data"])
    assert own.lora.lora_r == 8 and own.train.learning_rate == 3e-4 and own.run.quantize is None


def test_help_shows_every_field_docstring():
    text = finetune_parser().format_help()
    for group in GROUPS:
        assert group.__doc__.splitlines()[0] in text
    assert "Peak learning rate." in text and "Rank of the LoRA matrices." in text
    documented = sum(1 for g in GROUPS for f in fields(g) if f"--{f.name} " in text)
    assert documented == FLAG_COUNT


def test_a_run_from_a_config_file_records_the_arguments_as_given(train_setup, tmp_path):
    out = tmp_path / "out"
    args = h.train_args(train_setup, out, max_iters=2, lora_r=4, learning_rate=0.004)
    config = {k.lstrip("-"): v for k, v in zip(args[::2], args[1::2])}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({k: yaml.safe_load(str(v)) for k, v in config.items()}))
    h.run_script(h.FINETUNE, ["--config", tmp_path / "run.yaml"]).check_returncode()
    hp = json.loads((out / "hyperparameters.json").read_text())
    assert hp["lora_r"] == 4 and hp["learning_rate"] == 0.004 and hp["max_iters"] == 2 and hp["micro_batch_size"] == 2
    assert hp["checkpoint_dir"] == str(train_setup["ckpt"]) and hp["quantize"] is None
    assert {f.name for g in GROUPS for f in fields(g)} <= set(hp)


def test_console_command_runs_the_same_script():
    via_script = h.run_script(h.FINETUNE, ["--checkpoint_dir", "x", "--print_config"])
    via_command = subprocess.run([sys.executable, "-m", "lit_qlora.cli", "finetune", "--checkpoint_dir", "x",
                                  "--print_config"], capture_output=True, text=True, env=h.env(), cwd=h.ROOT)
    assert via_script.returncode == via_command.returncode == 0, via_command.stderr
    assert via_command.stdout == via_script.stdout and "learning_rate: 0.0003" in via_command.stdout
    bad = subprocess.run([sys.executable, "-m", "lit_qlora.cli", "finetnue"], capture_output=True, text=True,
                         env=h.env(), cwd=h.ROOT)
    h.assert_one_line_error(bad, "unknown command 'finetnue'")



@pytest.mark.parametrize("argv,expect", [
    (["--learning_rate", "-1"], "--learning_rate is -1.0"),
    (["--learning_rate", "0"], "--learning_rate is 0.0"),
    (["--min_lr", "1", "--learning_rate", "0.01"], "--min_lr is 1.0"),
    (["--save_interval", "0"], "--save_interval is 0"),
    (["--grad_clip", "0"], "--grad_clip is 0.0"),
    (["--warmup_steps", "-3"], "--warmup_steps is -3"),
    # each group checks its own fields when it is built (they were checked by finetune/lora.py's check_flags once the
    # demo files were built and the precision resolved)
    (["--micro_batch_size", "0"], "--micro_batch_size must be at least 1, got 0"),
    (["--max_iters", "0"], "--max_iters must be at least 1, got 0"),
    (["--optimizer", "SGD"], "unknown --optimizer 'SGD'; choose one of AdamW, AdamW8bit"),
    (["--nan_policy", "ignore"], "unknown --nan_policy 'ignore'; choose stop or skip"),
    (["--eval_interval", "0"], "--eval_interval must be at least 1, got 0"),
    (["--devices", "0"], "--devices must be at least 1, got 0"),
    (["--num_nodes", "0"], "--num_nodes must be at least 1, got 0"),
    (["--strategy", "zero3"], "unknown --strategy 'zero3'; choose one of auto, ddp, fsdp"),
    (["--accelerator", "gpu"], "unknown --accelerator 'gpu'; choose one of auto, cpu, cuda"),
    (["--data_dir", "d", "--data_sources", "mix.yaml"], "--data_dir and --data_sources both name the data"),
    # the file fuzzer (seed 16006): a 10**18 --max_seq_length in hyperparameters.json was clamped to the model's
    # context without a word; Fabric's seed_everything replaces a seed outside 0..2**32-1 by 0
    (["--max_seq_length", str(10**18)], "--max_seq_length is 1000000000000000000, larger than any count"),
    (["--eval_iters", str(2**31)], "--eval_iters is 2147483648, larger than any count this tool takes"),
    (["--seed", "-1"], "--seed -1 is out of range; give a number from 0 to 4294967295"),
    (["--seed", str(2**32)], "--seed 4294967296 is out of range"),
])
def test_values_that_cannot_train_are_refused_when_parsed(argv, expect):
    """Found by the file fuzzer: a hand-edited --config with learning_rate -1 parsed and would have trained."""
    from lit_qlora.utils import UserError

    with pytest.raises(UserError) as e:
        parse_finetune_args(["--checkpoint_dir", "ckpt", *argv])
    assert expect in str(e.value) and "\n" not in str(e.value)


def _float_flags() -> dict[str, bool]:
    """Every float flag of finetune/lora.py and finetune/dpo.py -> whether it may be left out (None)."""
    from typing import get_args, get_type_hints

    from lit_qlora.args import PreferenceArgs

    out = {}
    for group in (*GROUPS, PreferenceArgs):
        for name, hint in get_type_hints(group).items():
            if float in (get_args(hint) or (hint,)):
                out[name] = type(None) in get_args(hint)
    return out


def _outside(r) -> list[float]:
    """Values just outside a FLOAT_RANGES range, and the non-finite ones."""
    out = [math.inf, -math.inf, math.nan]
    for end, is_open, step in ((r.low, r.low_open, -1), (r.high, r.high_open, 1)):
        if math.isfinite(end):
            out.append(end if is_open else end + step * max(abs(end), 1) * 1e-3)
    if math.isfinite(r.high):
        out.append(18446744073709551617)  # the file fuzzer's lora_dropout (a 2**64 + 1 in a --config YAML)
    return out


@pytest.mark.parametrize("flag", sorted(_float_flags()))
def test_every_float_flag_has_a_range_checked_when_parsed(flag, tmp_path):
    """The file fuzzer: `lora_dropout: 18446744073709551617` in a --config YAML parsed and ended in torch's
    ValueError (dropout probability has to be between 0 and 1) once the model was built. Every float flag has a range
    (lit_qlora/args.py FLOAT_RANGES); a value outside it, from a --config file or the command line, is one line naming
    the flag and the file, when the flags are read; the default is inside it."""
    from lit_qlora.args import FLOAT_RANGES

    assert flag in FLOAT_RANGES, f"--{flag} is a float flag without a range in FLOAT_RANGES"
    preference = flag in ("beta", "gamma")
    for value in _outside(FLOAT_RANGES[flag]):
        (tmp_path / "run.yaml").write_text(yaml.safe_dump({"checkpoint_dir": "ckpt", flag: value}))
        with pytest.raises(UserError) as e:
            parse_finetune_args(["--config", str(tmp_path / "run.yaml")], preference=preference)
        assert f"--{flag} is " in str(e.value) and str(tmp_path / "run.yaml") in str(e.value), (value, str(e.value))
        assert "\n" not in str(e.value)
        if math.isfinite(value):  # (a non-finite one is text on the command line)
            with pytest.raises(UserError, match=f"--{flag} is "):
                parse_finetune_args(["--checkpoint_dir", "ckpt", f"--{flag}", str(value)], preference=preference)
    parse_finetune_args(["--checkpoint_dir", "ckpt"], preference=preference)  # every default is inside its range


def test_the_demo_data_lies_under_data_sources():
    """The demo preset's --data_dir is not a second name for the data: --data_sources replaces it."""
    args = parse_finetune_args(["--data_sources", "mix.yaml"])
    assert args.data.data_dir == demo.DEMO_DATA_DIR and str(args.data.data_sources) == "mix.yaml"


def test_estimate_memory_takes_finetunes_lora_flags(capsys):
    """scripts/estimate_memory.py reuses the LoRA group (LoRAArgs): the same flags, defaults and help as
    finetune/lora.py, checked the same way, and every one of them reaches the estimate."""
    from helpers import run_in_process

    from lit_qlora.args import LoRAArgs
    from lit_qlora.config import Config
    from lit_qlora.memory import estimate_training_memory

    estimate = h.ROOT / "scripts" / "estimate_memory.py"
    parser = runpy.run_path(str(estimate))["estimate_parser"]()

    def lora_flags(p) -> dict:
        names = {f.name for f in fields(LoRAArgs)}
        return {a.dest: (a.option_strings, a.default, a.help) for a in p._actions if a.dest in names}

    assert lora_flags(parser) == lora_flags(finetune_parser()) and len(lora_flags(parser)) == len(fields(LoRAArgs))
    r = run_in_process(estimate, "--model_name", "Llama-2-7b-hf", "--lora_init", "bogus")
    assert r.returncode == 2 and r.stderr.strip() == "error: unknown --lora_init 'bogus'; choose one of " \
        "default, gaussian, pissa, olora, loftq"
    flags = ["--lora_r", "64", "--lora_mlp", "true", "--lora_head", "true", "--lora_dora", "true"]
    r = run_in_process(estimate, "--model_name", "Llama-2-7b-hf", "--seq_length", "64", "--precision", "32-true",
                       "--json", "true", *flags)
    assert r.returncode == 0, r.stderr
    got = json.loads(capsys.readouterr().out)
    lora = LoRAArgs(lora_r=64, lora_mlp=True, lora_head=True, lora_dora=True).config()
    want = estimate_training_memory(Config.from_name("Llama-2-7b-hf"), lora, "32-true", None, micro_batch_size=1,
                                    seq_length=64)
    assert got["parts_gb"] == json.loads(json.dumps(want.as_dict()))["parts_gb"]


def test_a_config_file_holding_null_is_refused_an_empty_one_is_not(tmp_path):
    from lit_qlora.utils import UserError

    (tmp_path / "null.json").write_text("null")
    (tmp_path / "empty.yaml").write_text("\n")
    with pytest.raises(UserError, match="holds null"):
        parse_finetune_args(["--config", str(tmp_path / "null.json")])
    args = parse_finetune_args(["--config", str(tmp_path / "empty.yaml"), "--checkpoint_dir", str(tmp_path)])
    assert args.run.checkpoint_dir == tmp_path


@pytest.mark.parametrize("text", ["", "\n", "#checkpoint_dir: ckpt\nmax_iters: 2\n", "checkpoint_dir: null\n"])
def test_a_config_file_without_a_model_never_falls_back_to_the_demo(tmp_path, text):
    """Found by the file fuzzer (seeds 9104, 9106, 9107): a --config file truncated to nothing or with its
    checkpoint_dir line damaged into a comment parsed as the demo preset's flags, and the run would have trained the
    demo model instead of the user's."""
    from lit_qlora.utils import UserError

    (tmp_path / "run.yaml").write_text(text)
    with pytest.raises(UserError, match="sets no checkpoint_dir") as e:
        parse_finetune_args(["--config", str(tmp_path / "run.yaml")])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flag, value", [("checkpoint_dir", "/tmp/" + "a" * 5000), ("data_dir", "d/" + "n" * 300),
                                         ("out_dir", "out\x00x"), ("data_sources", "x" * 4100)])
def test_a_path_no_file_system_can_look_up_is_one_line(tmp_path, flag, value):
    """A --config file whose path value became megabytes long (the file fuzzer, seeds 12002-12015: 'File name too
    long' tracebacks), a 300-byte name, a NUL byte: refused when the arguments are built, naming the flag. A script
    reading a too-long path elsewhere (generate/base.py's own flags) says so in one line too."""
    from helpers import run_in_process

    (tmp_path / "run.yaml").write_text(json.dumps({"checkpoint_dir": "ckpt", "data_dir": "data", flag: value}))
    with pytest.raises(UserError) as e:
        parse_finetune_args(["--config", str(tmp_path / "run.yaml")])
    assert f"--{flag}" in str(e.value) and "not a usable path" in str(e.value) and "\n" not in str(e.value)
    r = run_in_process(h.GENERATE_BASE, "--checkpoint_dir", "/tmp/" + "a" * 5000, "--prompt", "x")
    h.assert_one_line_error(r, "too long a path")


@pytest.mark.parametrize("text", ["lora_key: null", "lora_r: ~", "precision: null", '{"learning_rate": null}'])
def test_a_null_where_a_flag_has_no_left_out_meaning_is_refused(tmp_path, text):
    """hyperparameters.json with lora_key false -> null (the file fuzzer, seed 13006) was taken by --config and ran
    with lora_key None (jsonargparse type-checks a null on the command line, not in a config file); a null for a flag
    whose left-out value means something (--max_iters, --resume) still passes."""
    (tmp_path / "run.yaml").write_text(f"checkpoint_dir: ckpt\n{text}\n" if ":" in text and "{" not in text
                                       else json.dumps({"checkpoint_dir": "ckpt", **json.loads(text)}))
    flag = text.strip("{").split(":")[0].strip('"')
    with pytest.raises(UserError) as e:
        parse_finetune_args(["--config", str(tmp_path / "run.yaml")])
    assert f"--{flag} is null in --config {tmp_path / 'run.yaml'}" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "ok.yaml").write_text("checkpoint_dir: ckpt\nmax_iters: null\nresume: null\n")
    assert parse_finetune_args(["--config", str(tmp_path / "ok.yaml")]).train.max_iters is None


@pytest.mark.parametrize("line, expect", [("quantize: 1e+308", "unknown --quantize '1e+308'"),
                                          ("precision: bf32-true", "unknown --precision 'bf32-true'"),
                                          # seed 14003: hyperparameters.json's nan_policy "stop" -> Infinity was read
                                          # as the text 'Infinity' and refused only by finetune's later checks
                                          ("nan_policy: .inf", "--nan_policy is inf in --config"),
                                          ("nan_policy: halt", "unknown --nan_policy 'halt'; choose stop or skip"),
                                          ("accelerator: gpu", "unknown --accelerator 'gpu'; choose one of auto, cpu, "
                                                               "cuda")])
def test_an_unknown_quantize_or_precision_in_a_config_file_is_refused_when_read(tmp_path, line, expect):
    """hyperparameters.json with quantize null -> 1e+308 (the file fuzzer, seed 13029; YAML reads 1e+308 as text) was
    taken when the flags were read, and refused only later by finetune's checks: now refused as the arguments are
    built, naming the flag and the --config file."""
    (tmp_path / "run.yaml").write_text(f"checkpoint_dir: ckpt\n{line}\n")
    with pytest.raises(UserError) as e:
        parse_finetune_args(["--config", str(tmp_path / "run.yaml")])
    assert expect in str(e.value) and f"--config {tmp_path / 'run.yaml'}" in str(e.value)


@pytest.mark.parametrize("text, expect", [('"messages_column": NaN', "--messages_column is nan in --config {}, not a"),
                                          ('"learning_rate": Infinity', "--learning_rate is inf in --config {}, not a"),
                                          ('"template": 5', "--template is 5 in --config {}, not text; write it in"),
                                          ('"out_dir": false', "--out_dir is False in --config {}, not text"),
                                          ('"prompt_column": ["a"]', "--prompt_column is ['a'] in --config {}, not")])
def test_a_config_value_of_the_wrong_kind_is_refused_when_read(tmp_path, text, expect):
    """The file fuzzer (seeds 14076-14087): hyperparameters.json's messages_column turned NaN was read as the text
    'NaN' (jsonargparse turns a number into text for a text flag) and trained on a column of that name; a non-finite
    number or a number, bool or list where text belongs is refused naming the file and the flag."""
    (tmp_path / "run.json").write_text('{"checkpoint_dir": "ckpt", %s}' % text)
    with pytest.raises(UserError) as e:
        parse_finetune_args(["--config", str(tmp_path / "run.json")])
    assert expect.format(tmp_path / "run.json") in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "ok.json").write_text('{"checkpoint_dir": "ckpt", "learning_rate": 0.5, "template": "alpaca"}')
    assert parse_finetune_args(["--config", str(tmp_path / "ok.json")]).train.learning_rate == 0.5


@pytest.mark.parametrize("name", ["gpu", "mps", "cuda:0", ""])
def test_an_unknown_accelerator_of_a_generate_script_is_one_line(name):
    """generate/*.py and the server pass --accelerator to pick_device: torch.device('gpu') was a RuntimeError
    traceback, 'mps' a device nothing here supports."""
    from lit_qlora.inference import pick_device

    with pytest.raises(UserError, match=f"unknown --accelerator {name!r}; choose one of auto, cpu, cuda"):
        pick_device(name)
    assert pick_device("cpu").type == "cpu"
