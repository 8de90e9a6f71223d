"""Estimate the peak memory of a LoRA / QLoRA training run before loading anything.

    python scripts/estimate_memory.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-hf --quantize bnb.nf4-dq \
        --micro_batch_size 4 --seq_length 512 --device cuda
    python scripts/estimate_memory.py --model_name Llama-2-7b-hf --quantize bnb.nf4-dq --memory_budget 16 --device cuda

Prints the breakdown (runtime, quantized and dense weights, LoRA weights/gradients/optimizer state,
activations, logits, temporaries) and, with --memory_budget, the largest micro batch size that fits. The same
table comes from `python finetune/lora.py ... --estimate_only true`. CPU: peak RSS; CUDA: max allocated.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from jsonargparse import ArgumentParser

from lit_qlora.args import LoRAArgs, add_lora_flags, pop_lora_args
from lit_qlora.config import Config
from lit_qlora.memory import GiB, estimate_to_json, estimate_training_memory, pick_micro_batch_size, read_config
from lit_qlora.precision import resolve_precision
from lit_qlora.utils import UserError, run_main


def main(
    checkpoint_dir: Optional[Path] = None,
    model_name: Optional[str] = None,
    precision: str = "auto",
    quantize: Optional[str] = None,
    optimizer: str = "AdamW",
    micro_batch_size: int = 1,
    seq_length: Optional[int] = None,
    activation_checkpointing: bool = False,
    quantize_lm_head: Optional[bool] = None,
    device: str = "cpu",
    memory_budget: Optional[float] = None,
    sweep: bool = False,
    json: bool = False,
    lora: Optional[LoRAArgs] = None,
) -> None:
    """Estimate peak training memory.

    Args:
        checkpoint_dir: a model folder (only its model_config.json or config.json is read).
        model_name: or a named config (lit_qlora.config.NAMES), e.g. Llama-2-7b-hf.
        precision, quantize, optimizer, micro_batch_size, activation_checkpointing, quantize_lm_head: as in
            finetune/lora.py.
        seq_length: tokens per sample (the longest sample of a batch); default: the model's context length.
        device: cpu (peak RSS) or cuda (max allocated).
        memory_budget: GB; also print the largest micro batch size whose estimate fits.
        sweep: also print the total for micro batch sizes 1, 2, 4, ... 64.
        json: print the estimate as JSON instead of the table.
        lora: the --lora_* flags, finetune/lora.py's own (lit_qlora.args.LoRAArgs).
    """
    if (checkpoint_dir is None) == (model_name is None):
        raise UserError("pass one of --checkpoint_dir or --model_name; e.g. --model_name Llama-2-7b-hf")
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device must be cpu or cuda, got {device!r}")
    config = read_config(checkpoint_dir) if checkpoint_dir is not None else Config.from_name(model_name)
    lora = (lora or LoRAArgs()).config()
    precision, _ = resolve_precision(precision, device)
    kw = dict(config=config, lora=lora, precision=precision, quantize=quantize, optimizer=optimizer,
              seq_length=seq_length,
              activation_checkpointing=activation_checkpointing, quantize_lm_head=quantize_lm_head, device_type=device)
    est = estimate_training_memory(micro_batch_size=micro_batch_size, **kw)
    print(estimate_to_json(est) if json else est.table())
    if sweep:
        print("\n| Micro batch size | Estimated peak GiB |\n|---|---|")
        for mbs in (1, 2, 4, 8, 16, 32, 64):
            print(f"| {mbs} | {estimate_training_memory(micro_batch_size=mbs, **kw).total_gb:.2f} |")
    if memory_budget is not None:
        if memory_budget <= 0:
            raise UserError(f"--memory_budget must be positive (GB), got {memory_budget}")
        mbs, fit = pick_micro_batch_size(memory_budget * GiB, **kw)
        if mbs == 0:
            print(f"\nNot even micro batch size 1 fits {memory_budget} GB (it needs about {fit.total_gb:.2f} GB).")
        else:
            print(f"\nLargest micro batch size within {memory_budget} GB: {mbs} (estimated {fit.total_gb:.2f} GiB)")


def estimate_parser() -> ArgumentParser:
    """main's flags, and finetune/lora.py's --lora_* flags as they are there."""
    parser = ArgumentParser(prog="scripts/estimate_memory.py", description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="config", help="A YAML file of flags (as --print_config writes it).")
    parser.add_function_arguments(main, None, skip={"lora"})
    add_lora_flags(parser)
    return parser


def cli(argv: Optional[list[str]] = None) -> None:
    values = estimate_parser().parse_args(argv).as_dict()
    values.pop("config", None)
    lora = pop_lora_args(values)
    main(**values, lora=lora)


if __name__ == "__main__":
    run_main(cli)
