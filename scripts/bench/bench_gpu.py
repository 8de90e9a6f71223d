"""Benchmark: QLoRA training step time and peak GPU memory, ours vs transformers + PEFT (figures, not a test).

    python scripts/bench/bench_gpu.py                        # Llama-2-7B shape, micro batch 1, seq 512, 20 iterations
    python scripts/bench/bench_gpu.py --cells ours:bnb.nf4-dq,hf:bnb.nf4-dq --out /tmp/bench_gpu.jsonl
    python scripts/bench/bench_gpu.py --tiny --device cpu    # a 2-layer model, to check the script on a CPU

Six cells, {ours, hf} x {none, bnb.nf4, bnb.nf4-dq}, all bf16-true, each in a fresh process so that its peak
memory is its own. Nothing is downloaded: each cell builds the model's skeleton on the meta device and then makes
its weights on the device, one tensor at a time (normal, std 0.02; norms at 1), quantizing every Linear weight as
soon as it exists, so the bf16 model never exists whole when it is quantized.

- ours: `GPT` + LoRA (r 8, alpha 16, dropout 0.05 on query, key, value and projection), Linear layers swapped for
  bitsandbytes ones (`lit_qlora.quant.quantize.swap_linears`, output layer included unless `--quantize_lm_head false`),
  filled as `lit_qlora.loader.load_model` fills them. Step: forward with finetune/lora.py's `lm_head_chunk`,
  `chunked_cross_entropy` (mean over the targets), backward, AdamW on the LoRA weights (lr 3e-4), zero_grad.
- hf: `LlamaForCausalLM` (from `lit_qlora.convert.to_hf_config`). 4-bit is made the way
  `from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
  bnb_4bit_use_double_quant=..., bnb_4bit_compute_dtype=torch.bfloat16))` makes it, minus the checkpoint files:
  transformers' own bnb quantizer (`AutoHfQuantizer.from_config`) replaces the Linear layers of the meta model
  (`preprocess_model`: lm_head stays unquantized), each random weight goes through the quantizer's own per-tensor
  operation (`get_quantize_ops`, i.e. `bnb.nn.Params4bit(...).to(device)`), then `postprocess_model`. The quantized
  cells then follow PEFT's QLoRA recipe: `prepare_model_for_kbit_training` (it casts the other weights to fp32 and,
  by default, turns on gradient checkpointing: `--hf_gradient_checkpointing false` turns that off) and
  `get_peft_model(LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=[q,k,v,o]_proj))`; the bf16
  cell uses `get_peft_model` alone. Step: `model(input_ids, labels=input_ids).loss`, backward, the same AdamW.

Both peers train on the same random token batch (fixed seed) for `--iters` iterations; each iteration is timed
between two `torch.cuda.synchronize()`. s/iter is the median after 2 warm-up iterations. Peak memory is
`torch.cuda.max_memory_allocated` (and `max_memory_reserved`) over the whole cell, building included; on CPU it is
the peak RSS. Weights GB is measured from the tensors (`lit_qlora.quant.quantize.memory_report`). GB = 10^9 bytes.

Goal (for the 7B shape on CUDA): ours nf4-dq peak <= 12 GB and s/iter <= 1.15 x ours bf16, both better than HF's
nf4-dq in the same run. A cell that fails (OOM included) is a row of the table, not the end of the run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn

from lit_qlora.config import Config
from lit_qlora.lora import LoRAConfig

ROOT = Path(__file__).resolve().parents[2]

GB = 1e9
PRECISION = "bf16-true"
PEERS = ("ours", "hf")
SETTINGS = ("none", "bnb.nf4", "bnb.nf4-dq")
CELLS = [f"{peer}:{setting}" for setting in SETTINGS for peer in PEERS]  # side by side in the table
LORA = LoRAConfig(r=8, alpha=16, dropout=0.05, query=True, key=True, value=True, projection=True)
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # the same layers as LORA, in HF's names
LEARNING_RATE = 3e-4
WARMUP_ITERS = 2
SEED = 1337
# --tiny: every in_features a multiple of 64, as in the real shapes (bitsandbytes' CPU 4-bit kernels expect it)
TINY = dict(n_layer=2, n_embd=256, n_head=4, n_query_groups=4, head_size=64, intermediate_size=704, vocab_size=1000)
TINY_SEQ, TINY_ITERS = 64, 4
CELL_MARK = "CELL_JSON "


# ---- shared pieces ------------------------------------------------------------------------------
def model_config(name: str, tiny: bool, seq_length: int) -> Config:
    config = Config.from_name(name)
    if tiny:
        config = replace(config, name=f"{name} (tiny)", block_size=max(seq_length, 64), **TINY)
    if seq_length > config.block_size:
        raise SystemExit(f"error: --seq_length {seq_length} is longer than {name}'s context ({config.block_size}); "
                         "pass a shorter one")
    return config


def token_batch(config: Config, micro_batch_size: int, seq_length: int, device: torch.device) -> torch.Tensor:
    # made on CPU with its own generator, so both peers (and every device) see the same tokens
    gen = torch.Generator().manual_seed(SEED)
    return torch.randint(0, config.vocab_size, (micro_batch_size, seq_length), generator=gen).to(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gb(device: torch.device) -> tuple[float, Optional[float]]:
    """(peak allocated, peak reserved) on CUDA; (peak RSS, None) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GB, torch.cuda.max_memory_reserved(device) / GB
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB, None


def weights_gb(model: nn.Module) -> float:
    from lit_qlora.quant.quantize import memory_report

    r = memory_report(model)
    return (r["quantized_bytes"] + r["dense_bytes"]) / GB


# ---- ours ---------------------------------------------------------------------------------------
def build_ours(config: Config, quantize: Optional[str], device: torch.device, quantize_lm_head: bool) -> nn.Module:
    """Our model with LoRA on `device`, filled by the loader from random weights made there one tensor at a time
    (each 4-bit weight is quantized as soon as it exists, so the bf16 copies never coexist)."""
    from lit_qlora.checkpoint import lit_param_shapes
    from lit_qlora.convert import random_weight
    from lit_qlora.loader import load_model

    gen = torch.Generator(device=device).manual_seed(SEED)
    tensors = ((key, random_weight(key, shape, gen, device=device)) for key, shape in lit_param_shapes(config).items())
    return load_model(None, precision=PRECISION, quantize=quantize, lora=LORA, device=device,
                      quantize_lm_head=quantize_lm_head, config=config, seed=SEED, tensors=tensors)


def ours_cell(config: Config, quantize: Optional[str], device: torch.device, batch: torch.Tensor,
              args: argparse.Namespace) -> tuple[nn.Module, Callable[[], torch.Tensor], str]:
    from lit_qlora.losses import chunked_cross_entropy
    from lit_qlora.train.training import head_chunk, shift_labels

    model = build_ours(config, quantize, device, args.quantize_lm_head)
    model.activation_checkpointing = args.activation_checkpointing
    targets = shift_labels(batch)
    n_targets = int((targets != -100).sum())
    chunk = head_chunk(config)  # finetune's chunking, so the step is finetune's step

    def step() -> torch.Tensor:
        loss = chunked_cross_entropy(model(batch, lm_head_chunk=chunk), targets) / n_targets
        loss.backward()
        return loss.detach()

    note = "act. ckpt" if args.activation_checkpointing else ""
    return model, step, note


# ---- Hugging Face ---------------------------------------------------------------------------------
def build_hf(config: Config, quantize: Optional[str], device: torch.device) -> nn.Module:
    """transformers' model on `device` from random weights made there tensor by tensor; 4-bit as from_pretrained does
    it."""
    import transformers
    from accelerate import init_empty_weights

    from lit_qlora.convert import random_weight, to_hf_config

    hf_dict = to_hf_config(config)
    hf_config = transformers.AutoConfig.for_model(**hf_dict)
    hf_config.use_cache = False
    quantizer = None
    if quantize:
        from transformers.quantizers import AutoHfQuantizer

        bnb_config = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=quantize.endswith("-dq"),
            bnb_4bit_compute_dtype=torch.bfloat16)
        hf_config.quantization_config = bnb_config  # as from_pretrained records it
        quantizer = AutoHfQuantizer.from_config(bnb_config, pre_quantized=False)
        quantizer.validate_environment(device_map={"": device})
    with init_empty_weights():  # parameters on meta; buffers (RoPE frequencies) are computed for real
        model = getattr(transformers, hf_dict["architectures"][0])(hf_config)
    if quantizer is not None:
        # bnb Linear4bit layers in place of nn.Linear, lm_head excepted (HF's default skip list)
        quantizer.preprocess_model(model=model, dtype=torch.bfloat16, device_map={"": device})
    gen = torch.Generator(device=device).manual_seed(SEED)
    for name, p in list(model.named_parameters()):
        module_name, _, param = name.rpartition(".")
        value = random_weight(name, p.shape, gen, device=device)
        if quantizer is not None and quantizer.param_needs_quantization(model, name):
            value = hf_quantize(quantizer, model, name, value)
        else:
            value = nn.Parameter(value, requires_grad=False)
        model.get_submodule(module_name)._parameters[param] = value
        del value
    for module in model.modules():  # the RoPE frequencies were computed on CPU
        for buffer_name, b in module._buffers.items():
            if b is not None:
                module._buffers[buffer_name] = b.to(device)
    model.tie_weights()
    if quantizer is not None:
        model.hf_quantizer = quantizer
        quantizer.postprocess_model(model)  # sets is_loaded_in_4bit, which PEFT's recipe looks for
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"{len(left)} HF parameters were not filled, e.g. {left[0]}")
    return model


def hf_quantize(quantizer, model: nn.Module, name: str, value: torch.Tensor) -> nn.Parameter:
    """The 4-bit parameter from_pretrained would make of `value` for parameter `name` (quantized on value's device)."""
    if hasattr(quantizer, "get_quantize_ops"):  # transformers 5: the quantizer's own per-tensor operation
        return quantizer.get_quantize_ops().convert({name: value}, model=model, full_layer_name=name)[name]
    # transformers 4.x has no such operation; its loader makes the same call as the one above
    import bitsandbytes as bnb

    return bnb.nn.Params4bit(value, requires_grad=False, **model.get_parameter(name).__dict__).to(value.device)


def hf_cell(config: Config, quantize: Optional[str], device: torch.device, batch: torch.Tensor,
            args: argparse.Namespace) -> tuple[nn.Module, Callable[[], torch.Tensor], str]:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = build_hf(config, quantize, device)
    note = ""
    if quantize:  # PEFT's QLoRA recipe; a bf16 model is wrapped as it is
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.hf_gradient_checkpointing)
        note = "grad ckpt" if args.hf_gradient_checkpointing else ""
    lora = LoraConfig(r=LORA.r, lora_alpha=LORA.alpha, lora_dropout=LORA.dropout, target_modules=HF_TARGETS,
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)

    def step() -> torch.Tensor:
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        return loss.detach()

    return model, step, note


# ---- one cell (child process) ----------------------------------------------------------------------
def train(model: nn.Module, step: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer, iters: int,
          device: torch.device) -> tuple[list[float], list[float]]:
    """Per-iteration seconds and losses. Losses are read after the loop so that reading them costs no extra sync."""
    model.train()
    times, losses = [], []
    for _ in range(iters):
        synchronize(device)
        t0 = time.perf_counter()
        losses.append(step())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times, [float(x) for x in losses]


def versions() -> dict:
    import importlib.metadata as md

    out = {"torch": torch.__version__}
    for pkg in ("transformers", "peft", "bitsandbytes"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def run_cell(cell: str, args: argparse.Namespace) -> dict:
    """Build, train `args.iters` iterations and measure one cell. Errors (OOM included) go into the result."""
    peer, _, setting = cell.partition(":")
    quantize = None if setting == "none" else setting
    device = torch.device(args.device)
    result: dict = dict(cell=cell, peer=peer, setting=setting, ok=False, note="", device=str(device))
    try:
        from lit_qlora.quant.quantize import quiet_bnb_import
        from lit_qlora.train.training import make_optimizer

        if device.type == "cuda":
            result["device_name"] = torch.cuda.get_device_name(device)
        quiet_bnb_import()
        torch.manual_seed(SEED)
        config = model_config(args.model_name, args.tiny, args.seq_length)
        batch = token_batch(config, args.micro_batch_size, args.seq_length, device)
        t0 = time.perf_counter()
        model, step, result["note"] = (ours_cell if peer == "ours" else hf_cell)(config, quantize, device, batch, args)
        synchronize(device)
        result["build_s"] = time.perf_counter() - t0
        result["build_peak_gb"] = peak_gb(device)[0]
        result["weights_gb"] = weights_gb(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        result["trainable_params"] = sum(p.numel() for p in trainable)
        optimizer = make_optimizer("AdamW", trainable, LEARNING_RATE, 0.0, device.type)
        times, losses = train(model, step, optimizer, args.iters, device)
        timed = times[WARMUP_ITERS:] or times
        median = statistics.median(timed)
        result.update(ok=True, s_per_iter=median, tokens_per_s=args.micro_batch_size * args.seq_length / median,
                      iter_times=times, losses=losses)
    except torch.OutOfMemoryError as e:
        result["error"] = "OOM: " + str(e).splitlines()[0][:200]
    except Exception as e:  # reported in the table; the traceback goes to stderr for the parent to show
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    try:
        result["peak_allocated_gb"], result["peak_reserved_gb"] = peak_gb(device)
    except Exception:  # a device that failed to start has no figures; the error above says why
        result["peak_allocated_gb"] = result["peak_reserved_gb"] = None
    result["versions"] = versions()
    return result


# ---- the parent: run the cells, print the table -----------------------------------------------------
def launch(cell: str, argv: list[str], timeout: float) -> dict:
    """Run one cell in a fresh Python process and return its JSON line (or a failed row)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--_cell", cell]
    peer, _, setting = cell.partition(":")
    failed = dict(cell=cell, peer=peer, setting=setting, ok=False, note="")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(failed, error=f"timed out after {timeout:.0f}s (--cell_timeout)")
    lines = [ln[len(CELL_MARK):] for ln in r.stdout.splitlines() if ln.startswith(CELL_MARK)]
    if not lines:
        tail = (r.stderr or r.stdout).strip().splitlines()
        return dict(failed, error=f"exit code {r.returncode}: {tail[-1] if tail else 'no output'}",
                    stderr=r.stderr[-3000:])
    result = json.loads(lines[-1])
    if not result["ok"] and r.stderr:
        result["stderr"] = r.stderr[-3000:]
    return result


def fmt(x: Optional[float], spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict], on_cuda: bool) -> None:
    peak = "peak GB (alloc / reserved)" if on_cuda else "peak RSS GB"
    print(f"\n| peer | setting | s/iter (median) | tokens/s | {peak} | weights GB | loss first -> last | status |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        setting = r["setting"] + (f" ({r['note']})" if r.get("note") else "")
        mem = fmt(r.get("peak_allocated_gb"), ".3f")
        if r.get("peak_reserved_gb") is not None:
            mem += f" / {fmt(r['peak_reserved_gb'], '.3f')}"
        losses = r.get("losses") or []
        loss = f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-"
        status = "ok" if r["ok"] else f"error: {r.get('error', '?')}"
        print(f"| {r['peer']} | {setting} | {fmt(r.get('s_per_iter'), '.4f')} | {fmt(r.get('tokens_per_s'), '.0f')} | "
              f"{mem} | {fmt(r.get('weights_gb'), '.3f')} | {loss} | {status} |")


def print_goals(rows: list[dict], on_cuda: bool, tiny: bool) -> None:
    by = {r["cell"]: r for r in rows if r["ok"]}
    dq, bf16, hf_dq = by.get("ours:bnb.nf4-dq"), by.get("ours:none"), by.get("hf:bnb.nf4-dq")

    def verdict(ok: bool) -> str:
        return "OK" if ok else "MISSED"

    print("\nGoals" + ("" if on_cuda and not tiny else " (defined for the full-size model on CUDA; shown for form "
                                                       "only)") + ":")
    if dq is None:
        print("- ours nf4-dq did not run: no goal can be checked")
        return
    p = dq["peak_allocated_gb"]
    print(f"- ours nf4-dq peak {p:.2f} GB <= 12 GB: {verdict(p <= 12)}")
    if bf16 is not None:
        ratio = dq["s_per_iter"] / bf16["s_per_iter"]
        print(f"- ours nf4-dq step {dq['s_per_iter']:.4f} s = {ratio:.3f} x ours bf16 ({bf16['s_per_iter']:.4f} s), "
              f"<= 1.15: {verdict(ratio <= 1.15)}")
    else:
        print("- ours nf4-dq step vs ours bf16: n/a (ours:none did not run)")
    if hf_dq is not None:
        hp, hs = hf_dq["peak_allocated_gb"], hf_dq["s_per_iter"]
        print(f"- peak vs HF nf4-dq ({hp:.2f} GB): ours {p:.2f} GB -> {verdict(p < hp)}")
        print(f"- step vs HF nf4-dq ({hs:.4f} s): ours {dq['s_per_iter']:.4f} s -> {verdict(dq['s_per_iter'] < hs)}")
        if hf_dq.get("note"):
            print(f"  (HF nf4-dq ran with {hf_dq['note']}, as PEFT's recipe does by default)")
    else:
        print("- vs HF nf4-dq: n/a (hf:bnb.nf4-dq did not run)")
    counts = {r["peer"]: r.get("trainable_params") for r in rows if r["ok"]}
    if len(set(counts.values())) > 1:
        print(f"- note: trainable LoRA parameters differ between peers: {counts}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    def flag(s: str) -> bool:
        if s.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")
        return s.lower() in ("true", "1", "yes")

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="Cells: " + ", ".join(CELLS))
    p.add_argument("--model_name", default="Llama-2-7b-hf", help="a named config of lit_qlora.config (its shape only)")
    p.add_argument("--seq_length", type=int, default=None,
                   help=f"tokens per sample (default 512; {TINY_SEQ} with --tiny)")
    p.add_argument("--micro_batch_size", type=int, default=1)
    p.add_argument("--iters", type=int, default=None,
                   help=f"iterations per cell, the first {WARMUP_ITERS} untimed (default 20; {TINY_ITERS} with --tiny)")
    p.add_argument("--cells", default="all",
                   help="'all' or a comma-separated subset, e.g. ours:bnb.nf4-dq,hf:bnb.nf4-dq")
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (with --tiny, to check the script)")
    p.add_argument("--out", type=Path, default=None, help="also append each cell's JSON line to this file")
    p.add_argument("--tiny", action="store_true",
                   help="a 2-layer, 256-wide model, seq 64, 4 iterations: checks the script")
    p.add_argument("--quantize_lm_head", type=flag, default=False,
                   help="ours: quantize the output layer too (not finetune's default)")
    p.add_argument("--activation_checkpointing", type=flag, default=False, help="ours: recompute blocks in backward")
    p.add_argument("--hf_gradient_checkpointing", type=flag, default=True,
                   help="hf quantized cells: what prepare_model_for_kbit_training turns on (true by default there)")
    p.add_argument("--cell_timeout", type=float, default=180, help="seconds before a cell is stopped and reported")
    p.add_argument("--_cell", default=None, help=argparse.SUPPRESS)  # set by the parent for a child process
    args = p.parse_args(argv)
    args.seq_length = args.seq_length or (TINY_SEQ if args.tiny else 512)
    args.iters = args.iters or (TINY_ITERS if args.tiny else 20)
    if args.micro_batch_size < 1 or args.seq_length < 2 or args.iters < 1:
        p.error("--micro_batch_size and --iters must be at least 1, --seq_length at least 2")
    return args


def main() -> None:
    args = parse_args()
    if args._cell:  # child: one cell, one JSON line on stdout
        print(CELL_MARK + json.dumps(run_cell(args._cell, args)), flush=True)
        return
    cells = CELLS if args.cells == "all" else [c.strip() for c in args.cells.split(",") if c.strip()]
    unknown = [c for c in cells if c not in CELLS]
    if unknown:
        raise SystemExit(f"error: unknown cell {unknown[0]!r}; choose from {', '.join(CELLS)} or 'all'")
    config = model_config(args.model_name, args.tiny, args.seq_length)
    from lit_qlora.checkpoint import lit_param_shapes

    n_params = sum(s.numel() for s in lit_param_shapes(config).values())
    print(f"model: {config.name}, {n_params / 1e9:.3f}B parameters, random bf16 weights built on {args.device}; "
          f"{PRECISION}, "
          f"micro batch {args.micro_batch_size}, seq {args.seq_length}, {args.iters} iterations ({WARMUP_ITERS} "
          "warm-up); "
          f"LoRA r={LORA.r} alpha={LORA.alpha} dropout={LORA.dropout} on q,k,v,o; AdamW lr {LEARNING_RATE}", flush=True)
    child_argv = sys.argv[1:]  # a child parses the same options (and ignores --cells and --out)
    rows = []
    t_start = time.perf_counter()
    for cell in cells:
        t0 = time.perf_counter()
        r = launch(cell, child_argv, args.cell_timeout)
        r["cell_wall_s"] = time.perf_counter() - t0
        rows.append(r)
        status = "ok" if r["ok"] else f"FAILED ({r.get('error')})"
        print(f"  {cell}: {status} in {r['cell_wall_s']:.0f}s", flush=True)
        if not r["ok"] and r.get("stderr"):
            print("    " + "\n    ".join(r["stderr"].strip().splitlines()[-8:]), flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "a") as f:
                f.write(json.dumps({k: v for k, v in r.items() if k != "stderr"}) + "\n")
    first = next((r for r in rows if r.get("versions")), {})
    if first:
        where = first.get("device_name") or first.get("device")
        print(f"device: {where} | " + ", ".join(f"{k} {v}" for k, v in first["versions"].items()))
    on_cuda = torch.device(args.device).type == "cuda"
    print_table(rows, on_cuda)
    print_goals(rows, on_cuda, args.tiny)
    print(f"\nTotal: {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
