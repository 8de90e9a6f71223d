"""Profile: where the time of one LoRA training step goes, by kind of work (torch.profiler, CPU or CUDA).

    python scripts/profile_step.py --checkpoint_dir checkpoints/... --quantize bnb.nf4-dq --seq_length 128
    python scripts/profile_step.py --checkpoint_dir ... --quantize none     # the same step on the dense model

Loads the model as finetune/lora.py does (same loader, LoRA and precision rules), then runs `--warmup` steps and
times `--steps` more on one fixed random batch of micro_batch_size x seq_length tokens (forward, chunked loss,
backward, AdamW step). A profiled pass over the same steps then splits the time into matmuls, 4-bit/8-bit
dequantization, attention, dropout masks, loss, optimizer and the rest, with the top operators. Prints figures
only (not a test); the profiler adds some overhead, so the categories are shares, the step time is the untimed run.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# (category, substrings of operator names), first match wins; self time is counted, so nothing is counted twice
CATEGORIES = [
    ("dequantize (bitsandbytes)", ("bitsandbytes::dequantize", "bitsandbytes::int8")),
    ("attention", ("scaled_dot_product", "_CausalAttention", "aten::bmm")),
    ("matmul (frozen + LoRA)", ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear")),
    ("dropout masks", ("bernoulli", "dropout")),
    ("loss (log-softmax)", ("log_softmax", "nll_loss", "cross_entropy")),
    ("optimizer", ("_foreach", "adam", "Adam")),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint_dir", type=Path, required=True)
    p.add_argument("--precision", default="bf16-true")
    p.add_argument("--quantize", default="bnb.nf4-dq", help="a --quantize mode, or none")
    p.add_argument("--micro_batch_size", type=int, default=4)
    p.add_argument("--seq_length", type=int, default=128)
    p.add_argument("--lora", default="query,key,value,projection", help="comma-separated LoRA targets")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--top", type=int, default=12, help="how many operators to list")
    args = p.parse_args()

    from lit_qlora.loader import load_model
    from lit_qlora.lora import LoRAConfig
    from lit_qlora.losses import chunked_cross_entropy
    from lit_qlora.training import head_chunk
    from lit_qlora.utils import tune_cpu_allocator

    device = torch.device(args.device)
    if device.type == "cpu":
        tune_cpu_allocator()  # as finetune/lora.py does on CPU
    quantize = None if args.quantize == "none" else args.quantize
    lora = LoRAConfig(**{t: True for t in args.lora.split(",")})
    model = load_model(args.checkpoint_dir, precision=args.precision, quantize=quantize, lora=lora, device=device,
                       seed=0)
    model.train()
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=3e-4)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, model.config.vocab_size, (args.micro_batch_size, args.seq_length), generator=gen).to(device)
    chunk = head_chunk(model.config)  # as finetune/lora.py
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> None:
        loss = chunked_cross_entropy(model(idx, lm_head_chunk=chunk), idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        sync()
    events = prof.key_averages()
    use_cuda = device.type == "cuda"
    self_us = {e.key: (e.self_device_time_total if use_cuda else e.self_cpu_time_total) for e in events}
    total = sum(self_us.values()) or 1.0
    per_cat = {name: 0.0 for name, _ in CATEGORIES}
    per_cat["everything else (norms, RoPE, activations, copies, ...)"] = 0.0
    for key, us in self_us.items():
        cat = next((name for name, subs in CATEGORIES if any(s in key for s in subs)),
                   "everything else (norms, RoPE, activations, copies, ...)")
        per_cat[cat] += us

    print(f"{args.checkpoint_dir.name} | {args.precision} | quantize {args.quantize} | micro batch "
          f"{args.micro_batch_size} x "
          f"{args.seq_length} tokens | LoRA on {args.lora} | {device.type}, {torch.get_num_threads()} threads")
    print(f"step time (median of {args.steps}, no profiler): {step_s * 1e3:.1f} ms\n")
    print("| kind of work | ms per step | share |")
    print("|---|---|---|")
    for name, us in sorted(per_cat.items(), key=lambda kv: -kv[1]):
        ms = step_s * 1e3 * us / total  # profiled shares applied to the unprofiled step time
        print(f"| {name} | {ms:.1f} | {100 * us / total:.1f}% |")
    print(f"\nTop {args.top} operators by self time (profiled, per step):")
    for key, us in sorted(self_us.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {us / 1e3 / args.steps:8.1f} ms  {key}")


if __name__ == "__main__":
    main()
