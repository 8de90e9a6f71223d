"""Benchmark a GRPO run of finetune/grpo.py against TRL's GRPOTrainer with PEFT + bitsandbytes (prints figures; not a
test): the same random-weight model, the same prompts, the same LoRA targets and rank, the same 4-bit quantization,
precision, group size and completion length, each side in its own fresh process.

    python scripts/bench/bench_grpo.py                 # SmolLM2-135M's shape, nf4-dq, 32-true, 2 prompts x 4, 64 tokens
    python scripts/bench/bench_grpo.py --model demo --steps 2 --sides ours,trl      # seconds per side

Sides (each runs --steps optimizer steps of --prompts prompts x --generations completions of --completion_tokens
tokens, AdamW, constant learning rate, no dropout, no validation, beta 0, loss dapo, num_iterations 1):
  ours      finetune/grpo.py in the child process: sampling by the model as it trains (4-bit base, adapter unmerged),
            the policy's log-probabilities through the chunked output layer; metrics.csv's time/* columns split
            its step (sampling, rewards, old/reference log-probabilities, forward, backward).
  ours_g16  the same with 16 completions per prompt (the memory goal: within what TRL takes with 4), all of a step's
            completions sampled together, the update over micro batches of --g16_micro prompts (default 1: 16
            completions a forward, against TRL's 8; accumulated to the same step) and --activation_checkpointing true.
  ours_ckpt, trl_ckpt  ours and trl, each recomputing its blocks in backward (--activation_checkpointing true;
            GRPOConfig's default gradient_checkpointing=True, which the trl side turns off)
  trl       GRPOTrainer as its QLoRA recipe runs it: AutoModelForCausalLM.from_pretrained with a BitsAndBytesConfig,
            a PEFT LoraConfig on every linear layer (target_modules "all-linear"), transformers' generate.
The random model never ends a completion early (no eos sampled), so both sides generate and train on exactly
--completion_tokens tokens per completion. The reward is the completion's length (the same on both sides; its value
does not matter to the cost). Figures per side: median step time after the first step, the process's peak resident
set (VmHWM, loading included) and, for ours, the split of the step.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from bench_dpo_trl import cpu_description, status_gb  # noqa: E402  (the same figures, the same way)

SIDES = ("ours", "ours_g16", "trl")
WORDS = "w{}"  # the bench tokenizer's words: one token each
SPLIT = ("time/sampling_ms", "time/rewards_ms", "time/old_ref_logps_ms", "time/forward_ms", "time/backward_ms")


def make_model(folder: Path, model: str, prompts: int) -> Path:
    """An HF folder of random weights with `model`'s shape, a word-level tokenizer of its vocabulary ("w0" .. one
    token per word), and a data folder of `prompts` prompts of 16 words."""
    from bench_dpo_trl import make_model as make_hf_folder  # the same random folder and word-level tokenizer

    from lit_qlora.config import Config
    from lit_qlora.demo import DEMO_CONFIG

    data = folder.parent / "prompts"
    config = Config(**DEMO_CONFIG) if model == "demo" else Config.from_name(model)
    make_hf_folder(folder, model)
    from lit_qlora.convert import ensure_converted

    ensure_converted(folder, quiet=True)  # once, here: no side's peak holds the conversion (a one-time step)
    g = torch.Generator().manual_seed(0)
    data.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.jsonl", prompts), ("val.jsonl", 1)):
        ids = torch.randint(3, config.vocab_size, (n, 16), generator=g).tolist()
        rows = [{"prompt": " ".join(WORDS.format(i) for i in row)} for row in ids]
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def length_reward(completion_ids, **kwargs):
    return [len(ids) / 64 for ids in completion_ids]


# ---- the sides (each in a fresh child process) --------------------------------------------------------------
def run_ours(folder: Path, data: Path, a: argparse.Namespace, generations: int, micro: int,
             checkpointing: bool) -> dict:
    out_dir = Path(tempfile.mkdtemp(prefix="bench-grpo-ours-"))
    argv = ["--checkpoint_dir", folder, "--data_dir", data, "--out_dir", out_dir, "--quantize", a.quantize,
            "--precision", a.precision, "--seed", 1, "--micro_batch_size", micro, "--batch_size", a.prompts,
            "--max_iters", a.steps, "--learning_rate", "1e-5", "--min_lr", "1e-5", "--warmup_steps", "0",
            "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0", "--lora_query", "true", "--lora_key", "true",
            "--lora_value", "true", "--lora_projection", "true", "--lora_mlp", "true", "--eval_iters", "0",
            "--save_interval", "100000", "--num_generations", generations, "--max_completion_length",
            a.completion_tokens, "--temperature", "1.0", "--reward", f"{Path(__file__).resolve()}:length_reward",
            "--loss_type", "dapo", "--beta", "0",
            "--activation_checkpointing", str(checkpointing).lower()]
    sys.argv = ["grpo.py", *map(str, argv)]
    import runpy

    try:
        runpy.run_path(str(ROOT / "finetune" / "grpo.py"), run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
    rows = list(csv.DictReader(open(out_dir / "metrics.csv")))
    rows = [r for r in rows if r["loss"]]
    return dict(step_s=[float(r["iter_time_ms"]) / 1000 for r in rows],
                split_s={k: [float(r[k]) / 1000 for r in rows] for k in SPLIT},
                completion_tokens=[float(r["completions/mean_length"]) for r in rows])


def run_trl(folder: Path, data: Path, a: argparse.Namespace, checkpointing: bool) -> dict:
    import datasets
    import transformers
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    dtype = {"32-true": torch.float32, "bf16-true": torch.bfloat16}[a.precision]
    kind = a.quantize.removeprefix("bnb.").removesuffix("-dq")
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_compute_dtype=dtype,
                                            bnb_4bit_use_double_quant=a.quantize.endswith("-dq"),
                                            bnb_4bit_quant_storage=torch.uint8)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, dtype=dtype,
                                                              device_map="cpu")
    for m in model.modules():  # bitsandbytes' AVX512-BF16 repacking would pass no input gradient in training
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules="all-linear")
    n = a.prompts * a.generations
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="bench-grpo-trl-"), per_device_train_batch_size=n,
                      num_generations=a.generations, max_completion_length=a.completion_tokens, max_steps=a.steps,
                      gradient_accumulation_steps=1, learning_rate=1e-5, lr_scheduler_type="constant",
                      weight_decay=0.0, beta=0.0, loss_type="dapo", temperature=1.0, use_cpu=True,
                      bf16=a.precision == "bf16-true", gradient_checkpointing=checkpointing, report_to=[],
                      logging_steps=1,
                      save_strategy="no", seed=1, dataloader_num_workers=0)
    times: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *args, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, *args, **kw):
            times.append(time.perf_counter() - self.t0)

    trainer = GRPOTrainer(model=model, reward_funcs=[length_reward], args=args, processing_class=tok,
                          train_dataset=datasets.Dataset.from_list(rows), peft_config=lora, callbacks=[Clock()])
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return dict(step_s=times, completion_tokens=lengths)


def child(a: argparse.Namespace) -> None:
    folder, data = Path(a.folder), Path(a.folder).parent / "prompts"
    if a.child.startswith("trl"):
        out = run_trl(folder, data, a, checkpointing=a.child == "trl_ckpt")
    else:
        g16 = a.child == "ours_g16"
        out = run_ours(folder, data, a, 16 if g16 else a.generations, a.g16_micro if g16 else a.prompts,
                       checkpointing=a.child == "ours_ckpt" or g16 and a.checkpointing)
    out["peak_rss_gb"] = status_gb("VmHWM")
    print("BENCH_CHILD " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="SmolLM2-135M", help="a Config name (lit_qlora/config.py) or demo")
    p.add_argument("--quantize", default="bnb.nf4-dq")
    p.add_argument("--precision", default="32-true", choices=("32-true", "bf16-true"))
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--completion_tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--g16_micro", type=int, default=1, help="ours_g16's --micro_batch_size (prompts; the step's "
                   "samples are drawn together, the update accumulates over micro batches)")
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--checkpointing", type=lambda v: v.lower() == "true", default=True,
                   help="ours_g16 recomputes each block in backward (--activation_checkpointing; TRL's GRPOConfig "
                        "default, gradient_checkpointing, is on too, off here for its run)")
    p.add_argument("--work", default=None, help="folder for the model and data (default: a temporary one)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)
    work = Path(a.work or tempfile.mkdtemp(prefix="bench-grpo-"))
    folder = work / f"{a.model}-random"
    make_model(folder, a.model, a.prompts * max(a.steps, 1))
    print(f"CPU: {cpu_description()} | {a.model}, {a.quantize}, {a.precision}, LoRA r 8 on every linear layer, "
          f"{a.prompts} prompts x {a.generations} completions of {a.completion_tokens} tokens, {a.steps} steps",
          flush=True)
    results = {}
    for side in a.sides.split(","):
        cmd = [sys.executable, __file__, "--child", side, "--folder", str(folder), *sys.argv[1:]]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("BENCH_CHILD ")), None)
        if line is None:
            print(f"{side}: failed (exit {r.returncode})\n{r.stderr[-3000:]}", flush=True)
            continue
        results[side] = res = json.loads(line[len("BENCH_CHILD "):])
        steady = res["step_s"][1:] or res["step_s"]
        res["median_step_s"] = statistics.median(steady)
        split = ""
        if "split_s" in res:
            split = " | " + ", ".join(f"{k.split('/')[1][:-3]} {statistics.median(v[1:] or v):.2f}"
                                      for k, v in res["split_s"].items())
        print(f"{side:9s} median step {res['median_step_s']:.2f} s (steps: "
              f"{', '.join(f'{t:.2f}' for t in res['step_s'])}), peak RSS {res['peak_rss_gb']:.2f} GB, completion "
              f"tokens {res['completion_tokens']}{split}", flush=True)
    if "ours" in results and "trl" in results:
        o, t = results["ours"], results["trl"]
        print(f"ours / TRL: step time {o['median_step_s'] / t['median_step_s']:.2f}x (goal <= 0.4x), peak RSS "
              f"{o['peak_rss_gb'] / t['peak_rss_gb']:.2f}x (goal <= 0.6x)"
              + (f"; 16 generations: {results['ours_g16']['peak_rss_gb']:.2f} GB against TRL's "
                 f"{t['peak_rss_gb']:.2f} GB with 4" if "ours_g16" in results else ""), flush=True)
    if "ours_ckpt" in results and "trl_ckpt" in results:
        o, t = results["ours_ckpt"], results["trl_ckpt"]
        print(f"both recomputing in backward (TRL's default): step time "
              f"{o['median_step_s'] / t['median_step_s']:.2f}x, "
              f"peak RSS {o['peak_rss_gb'] / t['peak_rss_gb']:.2f}x", flush=True)
    print("BENCH_JSON " + json.dumps(results))


if __name__ == "__main__":
    main()
