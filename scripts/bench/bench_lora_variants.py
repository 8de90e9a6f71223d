"""LoRA variants side by side on the same batches: iteration-1 loss of plain nf4-dq vs PiSSA vs LoftQ vs the
unquantized model (the quantization-aware starts should land nearer the unquantized loss), and for plain LoRA, rsLoRA,
DoRA and LoRA+ on nf4-dq the loss after --iters iterations, the median step time and the peak RSS, each against
plain LoRA's; with --peft, transformers + bitsandbytes + PEFT's plain LoRA and DoRA on the same nf4-dq base and
batches beside ours (the same learning-rate schedule and gradient clipping as finetune's).

    python scripts/bench/bench_lora_variants.py [--iters 40] [--checkpoint_dir DIR --data_dir DIR] [--peft] [--start]
        [--start_batches 8] [--all_linear]

Each of our rows is one `finetune/lora.py` run (the demo model and data by default, the same seed, so the same
batches), its figures read from its BENCH_JSON line and metrics.json (peak RSS of the whole process, loading
included). A PEFT row (--peft, an HF checkpoint folder) is a fresh process that takes the batches finetune prepared
(the same samples, in the same order, padded as finetune's stream pads them) through the HF model in a plain loop
(forward with labels, backward, AdamW step), timed the same way. Name the CPU beside the figures you report; step
times are only worth reading on a machine with nothing else running. --start adds, from one more process, how far
each start's adapted weights (base + s*B@A) and next-token distribution are from the unquantized model's, and its
loss, over the first --start_batches batches (the iteration-1 loss is one micro-batch: a few hundred tokens).
--all_linear adapts every linear layer of the blocks (q, k, v, o and the MLP) instead of finetune's default q and v,
in the runs and in the start comparison. For a trained model to measure on with no download:
scripts/bench/make_trained_fixture.py.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# name: extra flags (every run: the demo preset's model and data, --lora_head off so every init applies)
RUNS = {
    "unquantized": ["--quantize", "none"],
    "nf4-dq": [],
    "nf4-dq pissa": ["--lora_init", "pissa"],
    "nf4-dq loftq (1 step)": ["--lora_init", "loftq", "--loftq_iters", "1"],
    "nf4-dq loftq (4 steps)": ["--lora_init", "loftq", "--loftq_iters", "4"],
    "nf4-dq rslora": ["--lora_rslora", "true"],
    "nf4-dq dora": ["--lora_dora", "true"],
    "nf4-dq lora+ (16)": ["--loraplus_lr_ratio", "16", "--learning_rate", "0.0015"],
}
PEFT_RUNS = {"peft nf4-dq": False, "peft nf4-dq dora": True}  # name: use_dora


ALL_LINEAR = ["--lora_key", "true", "--lora_projection", "true", "--lora_mlp", "true"]


def common_flags(a: argparse.Namespace) -> list[str]:
    """What every one of our runs shares (the PEFT worker copies the settings that shape its batches)."""
    return (ALL_LINEAR if a.all_linear else []) + [
        "--eval_iters", "0", "--micro_batch_size", str(a.micro_batch_size), "--template", "plain",
        "--warmup_steps", "0", "--lora_head", "false", "--lora_dropout", "0", "--precision", "32-true",
        "--quantize", "bnb.nf4-dq", "--max_seq_length", str(a.max_seq_length)]


def child_env(threads: int) -> dict:
    """The runs' environment: this repository first on the path; with `threads`, that many OpenMP / torch threads
    (on a machine shared with other jobs, 2 spinning threads per process measured 10-15x slower than 1)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def run(name: str, flags: list[str], iters: int, out: Path, base: list[str], common: list[str], env: dict) -> dict:
    cmd = [sys.executable, str(ROOT / "finetune" / "lora.py"), *base, "--out_dir", str(out), "--max_iters",
           str(iters), *common, "--save_interval", str(iters), "--bench_json", "true", *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{name}: finetune failed:\n{r.stderr[-2000:]}")
    bench = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("BENCH_JSON "))[11:])
    metrics = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").is_file() else {}
    times = bench["iter_times"][1:] or bench["iter_times"]  # the first step includes one-time work
    return dict(first=bench["losses"][0], last=bench["losses"][-1], step_ms=1000 * statistics.median(times),
                peak=metrics.get("peak_memory_gb"))


def peft_worker(cfg: dict) -> None:
    """One PEFT run (in its own process): the HF model quantized by transformers' BitsAndBytesConfig (nf4, double
    quantization, fp32 compute), PEFT's LoRA (or DoRA) on q_proj and v_proj as ours, finetune's batches."""
    import resource

    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from lit_qlora.config import Config
    from lit_qlora.convert import ensure_converted
    from lit_qlora.data.batching import BatchStream
    from lit_qlora.data.prepare import DataSettings, ensure_prepared
    from lit_qlora.tokenizer import Tokenizer
    from lit_qlora.train.training import lr_at

    torch.manual_seed(cfg["seed"])
    ckpt = Path(cfg["checkpoint_dir"])
    tokenizer = Tokenizer(ckpt)
    config: Config = ensure_converted(ckpt)
    max_len = min(cfg["max_seq_length"], config.block_size)
    train, _, _ = ensure_prepared(cfg["data_dir"], tokenizer, DataSettings(max_len, template="plain"))
    stream = BatchStream(train, batch_size=cfg["micro_batch_size"], seed=cfg["seed"], pad_id=tokenizer.eos_id or 0)
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, quantization_config=quant, dtype=torch.float32,
                                                              device_map={"": "cpu"})
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                             use_dora=cfg["dora"], task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.0)
    losses, times = [], []
    for step in range(cfg["iters"]):
        batch = next(stream)
        t0 = time.perf_counter()
        for group in opt.param_groups:  # finetune's schedule (no warm-up here) and gradient clipping
            group["lr"] = lr_at(step, cfg["iters"], 3e-4, 0.0, 0)
        mask = torch.arange(batch["input_ids"].shape[1])[None] < batch["lengths"][:, None]
        loss = model(input_ids=batch["input_ids"], attention_mask=mask.long(), labels=batch["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print("BENCH_JSON " + json.dumps(dict(losses=losses, iter_times=times, peak_memory_gb=peak)))


ALL_TARGETS = dict(key=True, projection=True, mlp=True)  # with finetune's default query and value
START_INITS = {"nf4-dq": ("default", 1), "nf4-dq pissa": ("pissa", 1), "nf4-dq loftq (1 step)": ("loftq", 1),
               "nf4-dq loftq (4 steps)": ("loftq", 4)}


def start_worker(cfg: dict) -> None:
    """How close each quantization-aware start is to the unquantized model, in one process: for the adapted rows of
    every adapted layer, ||dequantized base + s*B@A - W|| / ||W|| (W the checkpoint's weight), and over the first
    `batches` batches (finetune's, as the PEFT worker takes them) the mean |log p - unquantized log p|, the mean KL
    divergence from the unquantized next-token distribution, and the loss on the batches' target tokens (the
    unquantized model's under "unquantized")."""
    import torch

    from lit_qlora.convert import ensure_converted
    from lit_qlora.data.batching import BatchStream
    from lit_qlora.data.prepare import DataSettings, ensure_prepared
    from lit_qlora.loader import load_model
    from lit_qlora.lora import LoRAConfig, lora_modules
    from lit_qlora.quant.quantize import dequantize_weight
    from lit_qlora.tokenizer import Tokenizer
    from lit_qlora.train.training import shift_labels

    ckpt = Path(cfg["checkpoint_dir"])
    tokenizer, config = Tokenizer(ckpt), ensure_converted(ckpt)
    train, _, _ = ensure_prepared(cfg["data_dir"], tokenizer,
                                  DataSettings(min(cfg["max_seq_length"], config.block_size), template="plain"))
    stream = BatchStream(train, batch_size=cfg["micro_batch_size"], seed=1337, pad_id=tokenizer.eos_id or 0)
    batches = [next(stream) for _ in range(cfg.get("batches", 1))]
    targets = ALL_TARGETS if cfg.get("all_linear") else {}

    def next_token(model) -> tuple[torch.Tensor, float]:
        """log p over every batch's real positions, and the mean loss on their target tokens."""
        logps, nll, n = [], 0.0, 0
        with torch.no_grad():
            for batch in batches:
                keep = torch.arange(batch["input_ids"].shape[1])[None] < batch["lengths"][:, None]
                logits = model(batch["input_ids"])
                y = shift_labels(batch["labels"])
                nll += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
                n += int((y != -100).sum())
                logps.append(logits[keep].log_softmax(-1))
        return torch.cat(logps), nll / n

    dense = load_model(ckpt, precision="32-true", lora=LoRAConfig(dropout=0.0, **targets), seed=1337).eval()
    weights = {n: (m.base.weight.detach().clone(), m.dora_rows()) for n, m in lora_modules(dense).items()}
    ref, ref_loss = next_token(dense)
    del dense
    out = {"unquantized": dict(weight_error=0.0, logit_diff=0.0, kl=0.0, loss=ref_loss)}
    for name, (init, iters) in START_INITS.items():
        lora = LoRAConfig(dropout=0.0, init=init, loftq_iters=iters, **targets)
        model = load_model(ckpt, precision="32-true", quantize="bnb.nf4-dq", lora=lora, seed=1337).eval()
        err2 = norm2 = 0.0
        for n, m in lora_modules(model).items():
            w, rows = weights[n]
            effective = dequantize_weight(m.base).float() + m.delta_weight()
            err2 += float((effective[rows] - w[rows]).square().sum())
            norm2 += float(w[rows].square().sum())
        logp, loss = next_token(model)
        out[name] = dict(weight_error=(err2 / norm2) ** 0.5, logit_diff=float((logp - ref).abs().mean()),
                         kl=float((ref.exp() * (ref - logp)).sum(-1).mean()), loss=loss)
        del model
    print("BENCH_JSON " + json.dumps(out))


def run_start(a: argparse.Namespace, env: dict) -> dict:
    cfg = dict(checkpoint_dir=a.checkpoint_dir, data_dir=a.data_dir, micro_batch_size=a.micro_batch_size,
               max_seq_length=a.max_seq_length, batches=a.start_batches, all_linear=a.all_linear)
    r = subprocess.run([sys.executable, __file__, "--_start_worker", json.dumps(cfg)], capture_output=True, text=True,
                       cwd=ROOT, env=env)
    if r.returncode != 0:
        raise SystemExit(f"the start comparison failed:\n{r.stderr[-2000:]}")
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("BENCH_JSON "))[11:])


def run_peft(name: str, dora: bool, iters: int, a: argparse.Namespace, env: dict) -> dict:
    cfg = dict(checkpoint_dir=a.checkpoint_dir, data_dir=a.data_dir, iters=iters, dora=dora, seed=1337,
               micro_batch_size=a.micro_batch_size, max_seq_length=a.max_seq_length)
    r = subprocess.run([sys.executable, __file__, "--_peft_worker", json.dumps(cfg)], capture_output=True, text=True,
                       cwd=ROOT, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{name}: the PEFT run failed:\n{r.stderr[-2000:]}")
    bench = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("BENCH_JSON "))[11:])
    times = bench["iter_times"][1:] or bench["iter_times"]
    return dict(first=bench["losses"][0], last=bench["losses"][-1], step_ms=1000 * statistics.median(times),
                peak=bench["peak_memory_gb"], iters=iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--checkpoint_dir", default=None)
    p.add_argument("--data_dir", default=None)
    p.add_argument("--micro_batch_size", type=int, default=2)
    p.add_argument("--max_seq_length", type=int, default=256)
    p.add_argument("--runs", default=None, help="comma-separated names of RUNS to run (default: all)")
    p.add_argument("--peft", action="store_true", help="PEFT's plain LoRA and DoRA on the same base and batches")
    p.add_argument("--peft_iters", type=int, default=None, help="iterations of the PEFT rows (default --iters)")
    p.add_argument("--threads", type=int, default=0, help="OpenMP threads per run (default: torch's choice)")
    p.add_argument("--start", action="store_true", help="how close each start's weights and logits are to the "
                   "unquantized model's (one process; needs --checkpoint_dir)")
    p.add_argument("--start_batches", type=int, default=8, help="batches the start comparison runs (default 8)")
    p.add_argument("--all_linear", action="store_true", help="adapt q, k, v, o and the MLP (default: q and v)")
    p.add_argument("--_peft_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_start_worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._peft_worker:
        return peft_worker(json.loads(a._peft_worker))
    if a._start_worker:
        return start_worker(json.loads(a._start_worker))
    if a.peft and a.all_linear:
        raise SystemExit("--peft compares LoRA on q and v only; run it without --all_linear")
    if a.peft and a.checkpoint_dir is None:
        raise SystemExit("--peft needs --checkpoint_dir of a Hugging Face folder (the demo model has no HF weights)")
    base = [] if a.checkpoint_dir is None else ["--checkpoint_dir", a.checkpoint_dir, "--data_dir", a.data_dir]
    wanted = RUNS if a.runs is None else {n: RUNS[n] for n in a.runs.split(",")}
    wanted = {"nf4-dq": RUNS["nf4-dq"], **wanted}  # the row every other is compared with
    rows, env = {}, child_env(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in wanted.items():
            rows[name] = run(name, flags, a.iters, Path(tmp) / name.replace(" ", "_"), base, common_flags(a), env)
            print(f"{name:24s} {rows[name]}", file=sys.stderr, flush=True)
        if a.peft:
            for name, dora in PEFT_RUNS.items():
                rows[name] = run_peft(name, dora, a.peft_iters or a.iters, a, env)
                print(f"{name:24s} {rows[name]}", file=sys.stderr, flush=True)
    ref, plain = rows.get("unquantized"), rows["nf4-dq"]
    peft_plain = rows.get("peft nf4-dq")
    print(f"{'run':24s} {'loss@1':>8s} {'|-unq|':>8s} {'loss@N':>8s} {'N':>4s} {'step ms':>8s} {'x plain':>8s} "
          f"{'peak GB':>8s} {'x plain':>8s}")
    for name, r in rows.items():
        against = peft_plain if name.startswith("peft") else plain
        dist = f"{abs(r['first'] - ref['first']):8.4f}" if ref else f"{'-':>8s}"
        peak = f"{r['peak']:8.3f} {r['peak'] / against['peak']:8.2f}" if r["peak"] else f"{'-':>8s} {'-':>8s}"
        print(f"{name:24s} {r['first']:8.4f} {dist} {r['last']:8.4f} {r.get('iters', a.iters):4d} "
              f"{r['step_ms']:8.1f} {r['step_ms'] / against['step_ms']:8.2f} {peak}")
    print("x plain: against our nf4-dq row (PEFT rows: against PEFT's plain LoRA); |-unq|: distance of the "
          "iteration-1 loss to the unquantized model's")
    if a.start:
        start = run_start(a, env)
        gap = start["nf4-dq"]["loss"] - start["unquantized"]["loss"]
        print(f"\n{'start':24s} {'weight err':>10s} {'x nf4-dq':>8s} {'|dlogp|':>9s} {'KL':>9s} {'x nf4-dq':>8s} "
              f"{'loss':>8s} {'-unq':>8s} {'closed':>7s}")
        for name, r in start.items():
            d = r["loss"] - start["unquantized"]["loss"]
            print(f"{name:24s} {r['weight_error']:10.5f} {r['weight_error'] / start['nf4-dq']['weight_error']:8.3f} "
                  f"{r['logit_diff']:9.5f} {r['kl']:9.2e} {r['kl'] / start['nf4-dq']['kl']:8.3f} {r['loss']:8.4f} "
                  f"{d:+8.4f} {1 - abs(d) / abs(gap):7.1%}")
        print(f"weight err: ||dequantized base + s*B@A - W|| / ||W|| over the adapted rows; |dlogp|, KL, loss: mean "
              f"over the tokens of the first {a.start_batches} batches, against the unquantized model; closed: 1 - "
              "|loss - unquantized loss| / |nf4-dq's loss - unquantized loss|")


if __name__ == "__main__":
    main()
