"""generate/lora.py and generate/base.py as real subprocesses, with an adapter trained_adapter by finetune/lora.py.

What is shown here:
1. greedy output with the adapter (merged on load, the default) equals the greedy output of the checkpoint written by
   scripts/merge_lora.py run through generate/base.py with the identically formatted prompt, and equals what the
   library computes in-process; unmerged LoRA layers with --stream true print the same stdout;
2. stdout holds the generated text alone; stderr ends with the speed and memory lines;
3. under every --quantize value generation runs and produces tokens with finite figures.
"""
from __future__ import annotations

import json
import math
import re

import helpers_train as h
import pytest
import torch

PROMPT, INPUT = "kind", "owl"
FORMATTED = "kind\nowl\n"  # the "plain" template the adapter was trained_adapter with
NEW = 8
TIME_RE = r"Time for inference: \d+\.\d+ sec total, \d+\.\d+ tokens/sec"
MEM_RE = r"Memory used: \d+\.\d+ GB"


@pytest.fixture(scope="module")
def trained_adapter(tmp_path_factory):
    setup = h.tiny_setup(tmp_path_factory)
    out, _ = h.trained_run(tmp_path_factory)
    return setup, out / "lit_model_lora_finetuned.pth"


def gen_lora(setup, adapter, *extra, check=True):
    r = h.run_script(h.GENERATE_LORA, ["--checkpoint_dir", setup["ckpt"], "--lora_path", adapter, "--prompt", PROMPT,
                                        "--input", INPUT, "--max_new_tokens", NEW, *extra])
    if check:
        assert r.returncode == 0, r.stderr
    return r


def assert_figures_at_end(stderr: str) -> None:
    lines = stderr.strip().splitlines()
    assert re.fullmatch(TIME_RE, lines[-2]), lines[-3:]
    assert re.fullmatch(MEM_RE, lines[-1]), lines[-3:]


def expected_text(setup, adapter_path) -> str:
    """The greedy continuation computed in-process by the library: the adapter merged into fp32 weights."""
    from lit_qlora.adapter import Adapter
    from lit_qlora.config import Config
    from lit_qlora.generation import generate
    from lit_qlora.loader import load_model
    from lit_qlora.tokenizer import Tokenizer

    config = Config.from_file(setup["ckpt"] / "model_config.json")
    adapter = Adapter.load(adapter_path, config)
    model = load_model(setup["ckpt"], precision="32-true", merge_adapter=adapter, config=config).eval()
    tok = Tokenizer(setup["ckpt"])
    ids = tok.encode(FORMATTED)
    stops = tok.stop_ids or [tok.eos_id]
    out = generate(model, ids, NEW, eos_ids=stops)
    return tok.decode([t for t in out[len(ids):].tolist() if t not in stops])


def test_adapter_output_equals_merged_checkpoint_and_streaming(trained_adapter, tmp_path):
    setup, adapter = trained_adapter
    want = expected_text(setup, adapter)
    assert want.strip(), "the trained_adapter adapter should answer with some text"

    merged = gen_lora(setup, adapter, "--precision", "32-true")
    assert merged.stdout == want + "\n"  # the generated text alone
    assert_figures_at_end(merged.stderr)

    folder = tmp_path / "merged"
    r = h.run_script(h.MERGE, ["--checkpoint_dir", setup["ckpt"], "--lora_path", adapter, "--out_dir", folder])
    assert r.returncode == 0, r.stderr
    base = h.run_script(h.GENERATE_BASE, ["--checkpoint_dir", folder, "--prompt", FORMATTED, "--max_new_tokens", NEW,
                                          "--precision", "32-true"])
    assert base.returncode == 0, base.stderr
    assert base.stdout == merged.stdout
    assert_figures_at_end(base.stderr)

    streamed = gen_lora(setup, adapter, "--precision", "32-true", "--merge", "false", "--stream", "true")
    assert streamed.stdout == merged.stdout
    assert_figures_at_end(streamed.stderr)


@pytest.mark.parametrize("quantize", ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8"])
def test_every_quantization_generates(trained_adapter, tmp_path, quantize):
    setup, adapter = trained_adapter
    metrics = tmp_path / "gen.json"
    r = gen_lora(setup, adapter, "--quantize", quantize, "--metrics_file", metrics)
    assert "Traceback" not in r.stderr and "nan" not in r.stdout.lower()
    assert r.stdout.endswith("\n") and r.stdout.count("\n") == 1, repr(r.stdout)
    assert_figures_at_end(r.stderr)
    m = json.loads(metrics.read_text())
    assert m["new_tokens"] >= 1 and math.isfinite(m["tokens_per_sec"]) and m["tokens_per_sec"] > 0
    assert m["outputs"] == [r.stdout[:-1]]


def test_logits_under_quantization_are_finite(trained_adapter):
    """No NaN hides behind a plausible-looking text: the quantized models' logits for the prompt are finite."""
    setup, adapter = trained_adapter
    from lit_qlora.inference import load_for_inference
    from lit_qlora.tokenizer import Tokenizer

    ids = Tokenizer(setup["ckpt"]).encode(FORMATTED)[None]
    for q in ("bnb.nf4", "bnb.int8"):
        model, _, _ = load_for_inference(setup["ckpt"], adapter, q, "32-true", torch.device("cpu"))
        with torch.no_grad():
            assert torch.isfinite(model(ids)).all(), q
