"""finetune/lora.py end to end, as a real subprocess on a train_setup Llama (no mocks).

What is shown here:
1. every --quantize value, every --optimizer (its class and its state in the checkpoint) and every *-mixed precision
   trains and writes the expected files and figures; --quantize_lm_head false keeps the head dense and is recorded;
   --micro_batch_size auto resolves to the planner's choice and trains;
2. 16-mixed: the gradient scaler skips an overflowing step and lowers its scale (it is not a divergence);
3. the loss goes down on a learnable task;
4. a resumed run (LoRA dropout on, so the RNG state matters) equals an uninterrupted one (per-iteration losses and
   final adapters), starting from a folder whose newest checkpoint is torn (the loader falls back and says so);
5. DDP on CPU (gloo, 2 processes) with a quantized base and gradient accumulation gives the same LoRA weights on both
   ranks as one process with the same global batch, and a resumed DDP run retraces the uninterrupted one.
Prompt masking is shown in tests/test_prepare.py; SIGTERM, SIGKILL and NaN runs in tests/test_reliability.py.
"""
from __future__ import annotations

import csv
import json
import math
import re
import shutil

import helpers_train as h
import pytest
import torch
import torch.nn.functional as F

from lit_qlora.adapter import Adapter
from lit_qlora.config import Config
from lit_qlora.precision import parse_precision, resolve_precision
from lit_qlora.train.training import list_checkpoints

# ---- 1. every --quantize value, every --optimizer ----------------------------------------------
# Each quantize value once, the five optimizers spread over them (AdamW also trains in every other test here).
QUANT_OPT = [("none", "AdamW8bit", "auto"), ("bnb.nf4", "PagedAdamW", "bf16-true"),
             ("bnb.nf4-dq", "PagedAdamW8bit", "bf16-mixed"), ("bnb.fp4", "PagedAdamW32bit", "32-true"),
             ("bnb.fp4-dq", "AdamW", "bf16-true"), ("bnb.int8", "AdamW", "32-true")]
# what the optimizer keeps for the head's lora_B (320 x 16 = 5120 values: bitsandbytes' 8-bit state starts at 4096)
STATE_DTYPE = {"AdamW": None, "AdamW8bit": torch.uint8, "PagedAdamW": torch.float32, "PagedAdamW8bit": torch.uint8,
               "PagedAdamW32bit": torch.float32}
SUMMARY_KEYS = ("peak_memory_gb", "training_time_s", "tokens_per_sec", "final_train_loss", "final_val_loss")


@pytest.mark.parametrize("quantize,optimizer,precision", QUANT_OPT)
def test_quantize_and_optimizer_runs_write_everything(train_setup, tmp_path, quantize, optimizer, precision):
    out = tmp_path / "out"
    extra = {}
    if quantize == "bnb.nf4":  # a 4-bit head, asked for (the default keeps it dense)
        extra["quantize_lm_head"] = True
    if quantize == "bnb.int8":  # the largest micro batch whose estimated peak fits 0.47 GiB (about 6 here), trained
        extra.update(micro_batch_size="auto", memory_budget=0.47)
    r = h.train(train_setup, out, max_iters=3, save_interval=2, quantize=quantize, optimizer=optimizer,
                precision=precision, learning_rate=1e-2, lora_r=16, lora_head=True, **extra)
    assert [p.name for p in list_checkpoints(out)] == ["iter-000002.pth", "iter-000003.pth"]
    for name in ("lit_model_lora_finetuned.pth", "hyperparameters.json", "metrics.csv", "metrics.json"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "metrics.json").read_text())
    for k in SUMMARY_KEYS:
        assert isinstance(summary[k], float) and math.isfinite(summary[k]) and summary[k] > 0, (k, summary[k])
    assert summary["quantize"] == quantize and summary["optimizer"] == optimizer and summary["iterations"] == 3
    hp = json.loads((out / "hyperparameters.json").read_text())
    assert hp["optimizer"] == optimizer and hp["precision"] == precision
    rows = h.read_metrics(out)
    assert [int(r["iter"]) for r in rows] == [1, 2, 3] and all(math.isfinite(float(r["loss"])) for r in rows)
    assert rows[-1]["val_loss"] != ""
    err = r.stderr.strip().splitlines()
    assert re.fullmatch(r"Training time: \d+\.\d+s", err[-2]), err[-2:]
    assert re.fullmatch(r"Memory used: \d+\.\d+ GB", err[-1]), err[-2:]
    # the adapter is a real one: it loads for this base and training moved lora_B away from zero
    adapter = Adapter.load(out / "lit_model_lora_finetuned.pth",
                           Config.from_file(train_setup["ckpt"] / "model_config.json"))
    assert adapter.train["quantize"] == (None if quantize == "none" else quantize)
    resolved = resolve_precision(precision, "cpu")[0]  # auto: 32-true here unless the CPU has native bf16
    assert adapter.train["precision"] == resolved == summary["precision"] == hp["resolved"]["precision"]
    if precision == "auto":
        assert re.search(rf"Loaded .*{resolved} \(auto: this CPU has ", r.stderr), r.stderr
    assert all(torch.isfinite(v).all() for v in adapter.lora.values())
    assert any(v.abs().max() > 0 for k, v in adapter.lora.items() if k.endswith("lora_B"))
    # the optimizer is the one asked for: its state for the head's lora_B (the last parameter) as saved for resuming
    state = torch.load(out / "checkpoints/iter-000003.pth", map_location="cpu", weights_only=False)
    head_b_state = state["resume"]["optimizer"]["state"][len(adapter.lora) - 1]
    if STATE_DTYPE[optimizer] is None:
        trainable = parse_precision(resolved).trainable_dtype  # torch's AdamW keeps its state in the weights' dtype
        assert head_b_state["exp_avg"].dtype == trainable and "__bnb_optimizer_quant_state__" not in head_b_state
    else:
        assert head_b_state["__bnb_optimizer_quant_state__"]["state1"].dtype == STATE_DTYPE[optimizer]
    # --quantize_lm_head: what was quantized (the tiny Llama: 2 x 36864 block weights, a 320 x 64 head), and recorded
    head_quantized = quantize != "none" and extra.get("quantize_lm_head", False)
    expected = 0 if quantize == "none" else 2 * 36864 + (320 * 64 if head_quantized else 0)
    assert summary["quantized_params"] == expected
    assert adapter.train["quantize_lm_head"] is head_quantized
    if quantize == "bnb.int8":  # --micro_batch_size auto: the planner's choice is what trained; the flag as given
        picked = int(re.search(r"--micro_batch_size auto: (\d+)", r.stderr).group(1))
        assert 2 <= picked < 64 and summary["micro_batch_size"] == picked and hp["micro_batch_size"] == "auto"


# ---- 2. 16-mixed: the gradient scaler does its own skipping ---------------------------------------------
@pytest.mark.parametrize("nan_policy", ["stop", "skip"])
def test_16_mixed_lets_the_gradient_scaler_skip_overflowing_steps(train_setup, tmp_path, nan_policy):
    """One-letter answers and micro batches of 1: at the scaler's starting scale (2^16) the fp16 gradients overflow in
    the first steps of a healthy run. The scaler must skip those updates and lower its scale; our NaN handling
    (either policy) must not see them as a divergence."""
    data = tmp_path / "data"
    data.mkdir()
    words = [w for ws in h.KINDS.values() for w in ws][:25]
    (data / "one_letter.json").write_text(json.dumps([{"instruction": "kind", "input": w, "output": w[0]}
                                                      for w in words]))
    out = tmp_path / "out"
    r = h.train({**train_setup, "data": data}, out, max_iters=12, precision="16-mixed", micro_batch_size=1,
                eval_iters=0, nan_policy=nan_policy)
    assert "the gradient scaler skipped the update and lowered its scale from 65536 to 32768" in r.stderr
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["iterations"] == 12 and summary["fp16_overflow_skips"] >= 1 and summary["skipped_steps"] == 0
    scaler = torch.load(out / "checkpoints/iter-000012.pth", weights_only=False)["resume"]["scaler"]
    assert scaler["scale"] < 65536
    assert all(math.isfinite(float(row["loss"])) for row in h.read_metrics(out))
    assert any(v.abs().max() > 0 for k, v in h.load_lora(out / "lit_model_lora_finetuned.pth").items() if "lora_B" in k)


# ---- 3. the loss goes down -------------------------------------------------------------------------
def test_loss_decreases_on_a_learnable_task(tmp_path_factory):
    out, _ = h.trained_run(tmp_path_factory)
    rows = h.read_metrics(out)
    losses = [float(r["loss"]) for r in rows]
    vals = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    assert len(losses) == 40 and len(vals) == 10
    first, last = losses[0], sum(losses[-4:]) / 4  # iteration 1 is the untrained model (lora_B = 0)
    assert first == pytest.approx(math.log(h.VOCAB), abs=0.5) and last < 0.4 * first, (first, last)
    assert vals[-1] < 0.5 * vals[0] and vals[-1] < 0.4 * first, vals
    assert vals[-1] <= min(vals[:-1]) + 0.1, vals
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["final_val_loss"] == pytest.approx(vals[-1])
    assert summary["final_train_loss"] == pytest.approx(losses[-1])


# ---- 4. resume == uninterrupted ----------------------------------------------------------------------
RESUME_ARGS = h.RESUME_ARGS


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return h.resume_reference(tmp_path_factory)


def test_resume_from_torn_checkpoint_equals_uninterrupted(train_setup, uninterrupted, tmp_path):
    """B starts from A's iter-4 checkpoint; the newest file, iter-8, is torn (a truncated copy of A's), and a temp file
    of a killed write lies next to them: B must fall back to iter-4, say so, and then retrace A exactly."""
    a, b = uninterrupted, tmp_path / "B"
    (b / "checkpoints").mkdir(parents=True)
    shutil.copy(a / "checkpoints/iter-000004.pth", b / "checkpoints/iter-000004.pth")
    whole = (a / "checkpoints/iter-000008.pth").read_bytes()
    (b / "checkpoints/iter-000008.pth").write_bytes(whole[: len(whole) // 2])
    (b / "checkpoints/.iter-000012.pth.abc123.tmp").write_bytes(whole[:100])
    shutil.copy(a / "metrics.csv", b / "metrics.csv")  # rows up to iteration 4 are kept, the rest is redone
    r = h.train(train_setup, b, resume="true", **RESUME_ARGS)
    assert f"warning: {b / 'checkpoints/iter-000008.pth'} is damaged" in r.stderr
    assert f"Resuming from {b / 'checkpoints/iter-000004.pth'} at iteration 4" in r.stderr
    h.assert_same_run(a, b, first_iter=5)
    assert not list((b / "checkpoints").glob("*.tmp")), "the stale temp file of the killed write is cleaned up"
    rewritten = torch.load(b / "checkpoints/iter-000008.pth", map_location="cpu", weights_only=False)
    assert rewritten["resume"]["step"] == 8, "the torn checkpoint was written again"
    with open(b / "metrics.csv", newline="") as f:  # the starting validation (iteration 0) survives the resume
        first = next(csv.DictReader(f))
    assert first["iter"] == "0" and first["loss"] == "" and float(first["val_loss"]) > 0


# ---- 5. DDP on CPU -------------------------------------------------------------------------------------
def test_ddp_with_quantization_and_accumulation_equals_one_process_and_resumes(train_setup, tmp_path):
    """A 4-bit base, 2 processes x micro batch 2 x 2 accumulation steps against one process x micro batch 4 x 2 over
    the same global batches: the same losses and LoRA weights. Then a run resumed from the DDP run's iteration-2
    checkpoint retraces it (the data position, optimizer and RNG of a DDP run are restored)."""
    common = dict(max_iters=4, eval_interval=4, learning_rate=1e-2, precision="32-true", accelerator="cpu",
                  lora_dropout=0.0, quantize="bnb.nf4-dq", batch_size=8, save_interval=2, keep_checkpoints=0)
    one = tmp_path / "one"
    h.train(train_setup, one, devices=1, micro_batch_size=4, **common)
    two = tmp_path / "two"
    r = h.train(train_setup, two, devices=2, micro_batch_size=2, **common)
    assert "(micro 2 x 2 devices x 2 accumulation)" in r.stderr, r.stderr
    m = re.search(r"ranks agree: max diff (\S+)", r.stderr)
    assert m and float(m.group(1)) <= 1e-6, r.stderr
    final = "lit_model_lora_finetuned.pth"
    assert h.max_abs_diff(h.load_lora(one / final), h.load_lora(two / final)) < 1e-5
    l1, l2 = h.losses_by_iter(one), h.losses_by_iter(two)
    assert l1.keys() == l2.keys() == {1, 2, 3, 4} and all(abs(l1[i] - l2[i]) < 1e-5 for i in l1), (l1, l2)
    assert json.loads((two / "metrics.json").read_text())["devices"] == 2
    assert [p.name for p in list_checkpoints(two)] == ["iter-000002.pth", "iter-000004.pth"]  # written once

    resumed = tmp_path / "resumed"  # the DDP run as it was at iteration 2
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(two / "checkpoints/iter-000002.pth", resumed / "checkpoints/iter-000002.pth")
    r = h.train(train_setup, resumed, devices=2, micro_batch_size=2, resume="true", **common)
    assert "Resuming from" in r.stderr and "at iteration 2" in r.stderr
    assert h.max_abs_diff(h.load_lora(two / final), h.load_lora(resumed / final)) < 1e-6
    l3 = h.losses_by_iter(resumed)
    assert all(abs(l3[i] - l2[i]) < 1e-6 for i in (3, 4)), (l2, l3)


def test_packed_run_resumes_exactly_and_computes_little_padding(train_setup, tmp_path):
    """--packing true: a run resumed from its iteration-4 checkpoint retraces the uninterrupted one (LoRA dropout on),
    and on answers of very different lengths its rows hold far fewer padding slots than padded batches; neither run
    computes on padding (the batches are unpadded)."""
    data = tmp_path / "data"
    data.mkdir()
    words = [(w, k) for k, ws in h.KINDS.items() for w in ws]
    records = [{"instruction": "kind", "input": w, "output": " ".join([k] * (1 + (7 * i) % 12))}
               for i, (w, k) in enumerate(words * 2)]
    (data / "varied.json").write_text(json.dumps(records))
    setup = {**train_setup, "data": data}
    args = dict(RESUME_ARGS, max_iters=8, packing="true", max_seq_length=64)
    a = tmp_path / "A"
    h.train(setup, a, **args)
    b = tmp_path / "B"
    (b / "checkpoints").mkdir(parents=True)
    shutil.copy(a / "checkpoints/iter-000004.pth", b / "checkpoints/iter-000004.pth")
    h.train(setup, b, resume="true", **args)
    la, lb = h.losses_by_iter(a), h.losses_by_iter(b)
    assert all(abs(la[i] - lb[i]) <= 1e-6 for i in range(5, 9)), (la, lb)
    final = "lit_model_lora_finetuned.pth"
    assert h.max_abs_diff(h.load_lora(a / final), h.load_lora(b / final)) < 1e-6
    unpacked = tmp_path / "unpacked"
    h.train(setup, unpacked, **dict(args, packing="false", max_iters=4))
    metrics = {run: json.loads((run / "metrics.json").read_text()) for run in (a, unpacked)}
    assert [metrics[run]["real_token_share"] for run in (a, unpacked)] == [1.0, 1.0], metrics
    fill = {run: metrics[run]["row_fill"] for run in (a, unpacked)}
    assert fill[a] > 0.85 and fill[a] > fill[unpacked] + 0.1, fill


def test_starting_validation_loss_is_transformers_loss_on_the_validation_samples(train_setup, tmp_path):
    """The validation loss at iteration 0 (lora_B = 0: the base model) is the token-weighted cross-entropy that
    transformers' model of the same checkpoint gives on the validation batches finetune evaluates (the first
    eval_iters x micro_batch_size prepared samples, of different lengths), each sample run on its own."""
    import transformers

    data = h.fresh_data_dir(train_setup["data"], tmp_path / "data")
    out = tmp_path / "out"
    h.train({**train_setup, "data": data}, out, max_iters=1, eval_iters=3, micro_batch_size=2)
    with open(out / "metrics.csv", newline="") as f:
        start = next(r for r in csv.DictReader(f) if r["iter"] == "0")
    (val_file,) = data.rglob("val.pt")
    val = torch.load(val_file, weights_only=True)[:6]
    assert len({len(s["input_ids"]) for s in val}) > 1  # batches with padding
    model = transformers.AutoModelForCausalLM.from_pretrained(train_setup["ckpt"], dtype=torch.float32).eval()
    total = count = 0.0
    with torch.no_grad():
        for s in val:
            logits = model(s["input_ids"][None]).logits[0, :-1]
            tgt = s["labels"][1:]
            keep = tgt != -100
            total += float(F.cross_entropy(logits[keep], tgt[keep], reduction="sum"))
            count += int(keep.sum())
    assert float(start["val_loss"]) == pytest.approx(total / count, abs=2e-5)  # fp32: 1e-6 apart
