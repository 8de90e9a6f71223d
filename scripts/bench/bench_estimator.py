"""Benchmark: predicted (lit_qlora.memory) vs measured peak training memory on CPU.

    python scripts/bench/bench_estimator.py                       # the full matrix (12 cells, ~10 iterations each)
    python scripts/bench/bench_estimator.py --cells 0 --iters 3   # one cell, to check that it runs
    python scripts/bench/bench_estimator.py --calibrate_runtime   # re-measure the CPU runtime constant first
    python scripts/bench/bench_estimator.py --model moe --precision 32-true --lora attention --iters 3 --cells 0,1,2
                                              # the mixture of experts of scripts/bench/bench_moe.py (issue 34's shape)
    python scripts/bench/bench_estimator.py --model moe-tiny --precision 32-true --lora attention --iters 3

Writes a random Llama-shaped checkpoint of ~56M parameters (vocab 32000, 8 layers, n_embd 512, GQA) in our format
(`lit_model.safetensors` streamed tensor by tensor + `model_config.json`) with the demo tokenizer, and a prepared
dataset whose samples all have exactly `--seq_length` tokens (so every micro-batch has the same shape). Each cell
runs `finetune/lora.py` in a fresh process and reads its measured peak (metrics.json `peak_memory_gb`: peak RSS
on CPU). Prints figures only (not a test). Goal: every cell within 15% of its prediction.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from lit_qlora.checkpoint import lit_param_shapes
from lit_qlora.config import Config
from lit_qlora.lora import LoRAConfig
from lit_qlora.memory import GiB, estimate_training_memory

ROOT = Path(__file__).resolve().parents[2]

MODEL = dict(name="bench-llama-56m", hf_architecture="LlamaForCausalLM", block_size=1024, vocab_size=32000, n_layer=8,
             n_head=8, n_query_groups=4, n_embd=512, intermediate_size=1408)
TINY = dict(name="bench-tiny", hf_architecture="LlamaForCausalLM", block_size=64, vocab_size=384, n_layer=1, n_head=2,
            n_embd=64, intermediate_size=128)
# Qwen3-MoE as bench_moe.py builds it for issue 34 (16 layers, 64 experts, 8 active, hidden 1024, experts of
# 384 = 3/8 x hidden as Qwen3-30B-A3B's): 1.21G expert weights, 0.62 GiB in nf4-dq; and a tiny one
MOE = dict(name="bench-qwen3-moe", hf_architecture="Qwen3MoeForCausalLM", block_size=1024, vocab_size=4096, n_layer=16,
           n_head=16, n_query_groups=4, n_embd=1024, head_size=64, intermediate_size=3072, norm_eps=1e-6,
           qk_norm="head", moe_n_expert=64, moe_top_k=8, moe_intermediate_size=384, moe_norm_topk=True)
MOE_TINY = dict(name="bench-moe-tiny", hf_architecture="Qwen3MoeForCausalLM", block_size=256, vocab_size=384, n_layer=2,
                n_head=4, n_query_groups=2, n_embd=64, head_size=16, intermediate_size=128, qk_norm="head",
                moe_n_expert=8, moe_top_k=2, moe_intermediate_size=32, moe_norm_topk=True)
MODELS = {"llama": MODEL, "moe": MOE, "moe-tiny": MOE_TINY}
CELLS = [(q, mbs, ac) for q in ("none", "bnb.nf4-dq", "bnb.int8") for mbs in (1, 4) for ac in (False, True)]
# a mixture of experts: the 4-bit modes first (the benchmark's cell is 0)
MOE_CELLS = [("bnb.nf4-dq", 4, False), ("bnb.nf4-dq", 1, False), ("bnb.nf4-dq", 4, True), ("bnb.nf4", 4, False),
             ("none", 4, False), ("bnb.int8", 4, False)]
LORA = {"qv": LoRAConfig(), "attention": LoRAConfig(key=True, projection=True)}


def write_checkpoint(folder: Path, config: Config) -> None:
    from lit_qlora import demo
    from lit_qlora.checkpoint import LIT_CONFIG, LIT_WEIGHTS
    from lit_qlora.convert import write_random_checkpoint

    done = (folder / LIT_WEIGHTS).is_file() and (folder / LIT_CONFIG).is_file()
    if done and Config.from_file(folder / LIT_CONFIG) == config:
        return
    folder.mkdir(parents=True, exist_ok=True)
    demo._write_tokenizer(folder)  # the demo's byte-level BPE (384 ids); the model's larger vocab is just unused rows
    write_random_checkpoint(folder, config, seed=0)


def write_data(folder: Path, checkpoint: Path, seq_length: int, n_train: int = 64, n_val: int = 4) -> None:
    """A prepared dataset (train.pt, val.pt, prepare_config.json) of random samples of exactly seq_length tokens."""
    from lit_qlora.data.prepare import CONFIG_NAME
    from lit_qlora.tokenizer import Tokenizer

    tok = Tokenizer(checkpoint)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(1)

    def samples(n: int) -> list[dict]:
        out = []
        for _ in range(n):
            ids = torch.randint(4, tok.vocab_size, (seq_length,), generator=gen)
            labels = ids.clone()
            labels[:8] = -100  # a masked "prompt", as prepared instruction data has
            out.append({"input_ids": ids, "labels": labels})
        return out

    torch.save(samples(n_train), folder / "train.pt")
    torch.save(samples(n_val), folder / "val.pt")
    (folder / CONFIG_NAME).write_text(json.dumps({"tokenizer_fingerprint": tok.fingerprint,
                                                  "max_seq_length": seq_length,
                                                  "template": "plain", "mask_inputs": True, "n_train": n_train,
                                                  "n_val": n_val}))


def run_cell(ckpt: Path, data: Path, out: Path, precision: str, quantize: str, optimizer: str, mbs: int, ac: bool,
             iters: int, seq_length: int, lora: str = "qv") -> tuple[float | None, str]:
    """Run finetune/lora.py; returns (measured peak GiB or None, the error's last line)."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, str(ROOT / "finetune" / "lora.py"), "--checkpoint_dir", str(ckpt), "--data_dir", str(data),
           "--out_dir", str(out), "--precision", precision, "--quantize", quantize, "--optimizer", optimizer,
           "--micro_batch_size", str(mbs), "--max_iters", str(iters), "--activation_checkpointing", str(ac).lower(),
           "--max_seq_length", str(seq_length), "--eval_interval", str(10**6), "--eval_iters", "1",
           "--eval_max_new_tokens", "1", "--save_interval", str(10**6), "--warmup_steps", "1"]
    if lora == "attention":
        cmd += ["--lora_key", "true", "--lora_projection", "true"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0 or not (out / "metrics.json").is_file():
        last = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        return None, f"exit {res.returncode}: {last}"
    return json.loads((out / "metrics.json").read_text())["peak_memory_gb"], ""


def predict(config: Config, precision: str, quantize: str, optimizer: str, mbs: int, ac: bool, seq_length: int,
            lora: str = "qv"):
    return estimate_training_memory(config, lora=LORA[lora], precision=precision, quantize=quantize,
                                    optimizer=optimizer,
                                    micro_batch_size=mbs, seq_length=seq_length, activation_checkpointing=ac,
                                    device_type="cpu")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out_dir", type=Path, default=Path("/tmp/bench_estimator"))
    p.add_argument("--iters", type=int, default=10,
                   help="training iterations per cell (the peak is reached from the 2nd)")
    p.add_argument("--seq_length", type=int, default=256)
    p.add_argument("--precision", default="bf16-true")
    p.add_argument("--optimizer", default="AdamW")
    p.add_argument("--cells", default="all", help="'all' or comma-separated indices into the matrix")
    p.add_argument("--calibrate_runtime", action="store_true", help="first measure the runtime on a ~0-size model")
    p.add_argument("--model", choices=list(MODELS), default="llama",
                   help="llama: 56M dense; moe: the Qwen3-MoE of bench_moe.py; moe-tiny: a tiny Qwen3-MoE")
    p.add_argument("--lora", choices=list(LORA), default="qv", help="LoRA r=8 on q,v or on all of attention")
    p.add_argument("--n_layer", type=int, help="override the model's layer count")
    args = p.parse_args()

    out_root = args.out_dir
    model = MODELS[args.model]
    config = Config(**{**model, "n_layer": args.n_layer or model["n_layer"]})
    ckpt, data = out_root / f"checkpoint-{config.name}", out_root / f"data-{args.seq_length}"
    write_checkpoint(ckpt, config)
    write_data(data, ckpt, args.seq_length)
    n_params = sum(s.numel() for s in lit_param_shapes(config).values())
    print(f"Model: {config.name}, {n_params / 1e6:.1f}M parameters, seq {args.seq_length}, {args.iters} iterations per "
          "cell, "
          f"{args.precision}, {args.optimizer}, LoRA r=8 on {'q,v' if args.lora == 'qv' else 'q,k,v,o'}; CPU: "
          f"{cpu_kind()}", flush=True)

    if args.calibrate_runtime:
        tiny = Config(**TINY)
        tckpt, tdata = out_root / "tiny", out_root / "tiny-data"
        write_checkpoint(tckpt, tiny)
        write_data(tdata, tckpt, 16)
        for q in ("none", "bnb.nf4"):
            measured, err = run_cell(tckpt, tdata, out_root / f"tiny-{q}", args.precision, q, args.optimizer, 1, False,
                                     3, 16)
            e = predict(tiny, args.precision, q, args.optimizer, 1, False, 16)
            model_part = e.total - e.parts["runtime"]
            if measured is None:
                print(f"runtime calibration ({q}) failed: {err}")
            else:
                print(f"runtime calibration ({q}): peak {measured:.3f} GiB - predicted tensors {model_part / GiB:.3f} "
                      "GiB = "
                      f"runtime {measured - model_part / GiB:.3f} GiB (lit_qlora.memory assumes "
                      f"{e.parts['runtime'] / GiB:.3f})",
                      flush=True)

    cells = list(enumerate(MOE_CELLS if config.moe_n_expert else CELLS))
    if args.cells != "all":
        keep = {int(i) for i in args.cells.split(",")}
        cells = [c for c in cells if c[0] in keep]
    print("\n| # | quantize | micro batch | checkpointing | predicted GiB | measured GiB | error | time s |",
          flush=True)
    print("|---|---|---|---|---|---|---|---|", flush=True)
    worst = 0.0
    for i, (q, mbs, ac) in cells:
        e = predict(config, args.precision, q, args.optimizer, mbs, ac, args.seq_length, args.lora)
        t0 = time.perf_counter()
        measured, err = run_cell(ckpt, data, out_root / f"cell-{i}", args.precision, q, args.optimizer, mbs, ac,
                                 args.iters, args.seq_length, args.lora)
        dt = time.perf_counter() - t0
        if measured is None:
            print(f"| {i} | {q} | {mbs} | {ac} | {e.total_gb:.3f} | FAILED | {err} | {dt:.0f} |", flush=True)
            continue
        error = (e.total_gb - measured) / measured
        worst = max(worst, abs(error))
        print(f"| {i} | {q} | {mbs} | {ac} | {e.total_gb:.3f} | {measured:.3f} | {100 * error:+.1f}% | {dt:.0f} |",
              flush=True)
        if len(cells) == 1:
            print("\n" + e.table())
    print(f"\nWorst error: {100 * worst:.1f}% (goal: within 15% for every cell) -> "
          f"{'OK' if worst <= 0.15 else 'MISSED'}")


def cpu_kind() -> str:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return "unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "unknown")
    flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split()
    kind = next((k for f, k in (("amx_tile", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX512"),
                                ("avx2", "AVX2")) if f in flags), "no AVX2")
    return f"{name} ({kind})"


if __name__ == "__main__":
    main()
