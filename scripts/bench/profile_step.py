"""Profile: where the time of one LoRA training step goes, by kind of work (torch.profiler, CPU or CUDA), ours or
Hugging Face PEFT + bitsandbytes' on the same batch.

    python scripts/bench/profile_step.py --checkpoint_dir checkpoints/... --quantize bnb.nf4-dq --seq_length 128
    python scripts/bench/profile_step.py --checkpoint_dir ... --quantize none     # the same step on the dense model
    # one real batch of a data folder (the harness's data-gemma3), ours and then HF's recipe, shares side by side:
    python scripts/bench/profile_step.py --checkpoint_dir fixture-gemma3 --data_dir data-gemma3 --precision 32-true \\
        --lora query,key,value,projection,mlp --batch_index 3
    python scripts/bench/profile_step.py ... (same) --peer hf

ours: loads the model as finetune/lora.py does (same loader, LoRA and precision rules) and runs its step: padding
dropped (`batching.unpad`), the output layer and loss only at target positions (`GPT(targets=...)`), backward, AdamW.
hf (needs transformers, peft, bitsandbytes): `BitsAndBytesConfig` (nf4/fp4, double quantization as --quantize says),
`prepare_model_for_kbit_training`, `get_peft_model` with LoRA on the same projections, forward with labels and the
attention mask on the padded batch, backward, AdamW (the harness's peer_hf.py recipe).

The batch: with --data_dir, batch number --batch_index of the training order finetune/lora.py uses (`--seed`, 42 is
the harness's), padded as both tools pad it; without, micro_batch_size x seq_length random tokens, every position a
target. `--warmup` steps, then `--steps` timed ones on that batch; a profiled pass over the same steps splits the
time into matmuls, the output layer and loss (every operator on a vocabulary-wide tensor), 4-bit/8-bit
dequantization, attention, dropout masks, the embedding, optimizer and the rest, with the top operators. Prints
figures only (not a test); the profiler adds some overhead, so the categories are shares, the step time is the
unprofiled run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

OUTPUT = "output layer + loss (vocabulary-wide)"
REST = "everything else (norms, RoPE, activations, copies, ...)"
# (category, substrings of operator names), first match wins; self time is counted, so nothing is counted twice.
# Before these, any operator with a vocabulary-wide input counts as OUTPUT (`category`).
CATEGORIES = [
    ("dequantize (bitsandbytes)", ("bitsandbytes::dequantize", "bitsandbytes::int8")),
    ("embedding", ("embedding",)),
    ("attention", ("scaled_dot_product", "_CausalAttention", "aten::bmm", "attention")),
    ("matmul (frozen + LoRA)", ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear")),
    ("dropout masks", ("bernoulli", "dropout")),
    ("loss (log-softmax)", ("log_softmax", "nll_loss", "cross_entropy")),
    ("optimizer", ("_foreach", "adam", "Adam")),
]


def category(key: str, shapes: list, vocab: int) -> str:
    if any(vocab in s for s in shapes if isinstance(s, (list, tuple))) and "embedding" not in key:
        return OUTPUT
    return next((name for name, subs in CATEGORIES if any(s in key for s in subs)), REST)


def data_batch(args: argparse.Namespace, tokenizer_dir: Path) -> dict:
    """Batch `batch_index` of the training order finetune/lora.py would use on --data_dir (padded, with lengths)."""
    from lit_qlora.data.batching import BatchStream
    from lit_qlora.data.prepare import DataSettings, ensure_prepared
    from lit_qlora.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_dir)
    train, _, _ = ensure_prepared(args.data_dir, tok, DataSettings(args.max_seq_length))
    stream = BatchStream(train, batch_size=args.micro_batch_size, seed=args.seed, pad_id=tok.eos_id or 0)
    for _ in range(args.batch_index):
        next(stream)
    return next(stream)


def random_batch(args: argparse.Namespace, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vocab, (args.micro_batch_size, args.seq_length), generator=gen)
    return {"input_ids": idx, "labels": idx.clone(), "lengths": torch.full((args.micro_batch_size,), args.seq_length)}


def ours(args: argparse.Namespace, device: torch.device):
    """(step function, vocabulary size, batch) for our model, stepped as finetune/lora.py steps it."""
    from lit_qlora.data.batching import unpad
    from lit_qlora.loader import load_model
    from lit_qlora.lora import LoRAConfig
    from lit_qlora.train.training import head_chunk, shift_labels
    from lit_qlora.utils import tune_cpu_allocator

    if device.type == "cpu":
        tune_cpu_allocator()  # as finetune/lora.py does on CPU
    quantize = None if args.quantize == "none" else args.quantize
    lora = LoRAConfig(**{t: True for t in args.lora.split(",")})
    model = load_model(args.checkpoint_dir, precision=args.precision, quantize=quantize, lora=lora, device=device,
                       seed=0)
    model.train()
    vocab = model.config.vocab_size
    batch = data_batch(args, args.checkpoint_dir) if args.data_dir else random_batch(args, vocab)
    tgt = shift_labels(batch["labels"])
    small, tgt = unpad(batch, tgt)  # finetune/lora.py drops the padding before the forward
    idx, has_target = small["input_ids"].to(device), (tgt != -100).to(device)
    packed = {k: small[k].to(device) for k in ("positions", "segments") if k in small}
    targets = tgt.to(device)[has_target]
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=3e-4)
    chunk = head_chunk(model.config)

    def step() -> float:
        loss = model(idx, lm_head_chunk=chunk, output_mask=has_target, targets=targets, **packed)
        (loss / targets.numel()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach()) / targets.numel()

    return step, vocab, batch


def hf(args: argparse.Namespace, device: torch.device):
    """(step function, vocabulary size, batch) for transformers + PEFT + bitsandbytes (peer_hf.py's recipe)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from lit_qlora.precision import parse_precision

    dtype = parse_precision(args.precision).dtype
    qcfg = None
    if args.quantize != "none":
        mode = args.quantize.removeprefix("bnb.")
        if mode not in ("nf4", "nf4-dq", "fp4", "fp4-dq"):
            raise SystemExit(f"--peer hf profiles the 4-bit modes (bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq) or none, "
                             f"not {args.quantize}")
        qcfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=mode.split("-")[0],
                                  bnb_4bit_use_double_quant=mode.endswith("-dq"), bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint_dir, quantization_config=qcfg, dtype=dtype,
                                                 device_map={"": str(device)})
    if qcfg is not None:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model.config.use_cache = False
    names = {"query": ["q_proj"], "key": ["k_proj"], "value": ["v_proj"], "projection": ["o_proj"],
             "mlp": ["gate_proj", "up_proj", "down_proj"], "head": ["lm_head"]}
    targets = [n for t in args.lora.split(",") for n in names[t]]
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=targets,
                                             bias="none", task_type="CAUSAL_LM"))
    model.train()
    vocab = model.config.vocab_size
    batch = data_batch(args, args.checkpoint_dir) if args.data_dir else random_batch(args, vocab)
    ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
    mask = (torch.arange(ids.size(1))[None, :] < batch["lengths"][:, None]).long().to(device)
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=3e-4)

    def step() -> float:
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(out.loss.detach())

    return step, vocab, batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint_dir", type=Path, required=True)
    p.add_argument("--peer", choices=("ours", "hf"), default="ours", help="whose training step to profile")
    p.add_argument("--precision", default="bf16-true")
    p.add_argument("--quantize", default="bnb.nf4-dq", help="a --quantize mode, or none")
    p.add_argument("--micro_batch_size", type=int, default=4)
    p.add_argument("--seq_length", type=int, default=128, help="tokens per row of the random batch (no --data_dir)")
    p.add_argument("--data_dir", type=Path, default=None, help="profile a real batch of this data folder")
    p.add_argument("--max_seq_length", type=int, default=256, help="with --data_dir: samples cut to this length")
    p.add_argument("--batch_index", type=int, default=0, help="with --data_dir: which batch of the training order")
    p.add_argument("--seed", type=int, default=42, help="with --data_dir: the data order's seed (finetune's --seed)")
    p.add_argument("--lora", default="query,key,value,projection", help="comma-separated LoRA targets")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--top", type=int, default=12, help="how many operators to list")
    args = p.parse_args()

    device = torch.device(args.device)
    step, vocab, batch = (hf if args.peer == "hf" else ours)(args, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    first_loss = step()  # the first step's loss: the model before any update, comparable between the peers
    for _ in range(args.warmup - 1):
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
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(args.steps):
            step()
        sync()
    use_cuda = device.type == "cuda"
    per_cat: dict[str, float] = {name: 0.0 for name in (OUTPUT, *(n for n, _ in CATEGORIES), REST)}
    per_op: dict[str, float] = {}
    for e in prof.key_averages(group_by_input_shape=True):
        us = e.self_device_time_total if use_cuda else e.self_cpu_time_total
        per_cat[category(e.key, e.input_shapes or [], vocab)] += us
        per_op[e.key] = per_op.get(e.key, 0.0) + us
    total = sum(per_cat.values()) or 1.0

    rows, width = batch["input_ids"].shape
    print(f"{args.checkpoint_dir.name} | {args.peer} | {args.precision} | quantize {args.quantize} | batch {rows} x "
          f"{width} ({int(batch['lengths'].sum())} real tokens, {int((batch['labels'] != -100).sum())} labelled) | "
          f"LoRA on {args.lora} | {device.type}, {torch.get_num_threads()} threads")
    print(f"loss of the first step: {first_loss:.4f}")
    print(f"step time (median of {args.steps}, no profiler): {step_s * 1e3:.1f} ms\n")
    print("| kind of work | ms per step | share |")
    print("|---|---|---|")
    for name, us in sorted(per_cat.items(), key=lambda kv: -kv[1]):
        ms = step_s * 1e3 * us / total  # profiled shares applied to the unprofiled step time
        print(f"| {name} | {ms:.1f} | {100 * us / total:.1f}% |")
    print(f"\nTop {args.top} operators by self time (profiled, per step):")
    for key, us in sorted(per_op.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {us / 1e3 / args.steps:8.1f} ms  {key}")


if __name__ == "__main__":
    main()
