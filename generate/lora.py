"""Generate with a LoRA adapter (ours or a PEFT folder), merged into the base for speed.

    python generate/lora.py                  # the demo: the held-out questions, base model against fine-tuned
    python generate/lora.py --prompt "Reverse the word." --input echo    # the demo's fine-tuned model, any question
    python generate/lora.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-hf \
        --lora_path out/lora/alpaca/lit_model_lora_finetuned.pth --prompt "Recommend a movie" --quantize bnb.nf4

The generated text alone goes to stdout; loading messages and the speed/memory figures go to stderr.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from lit_qlora import demo
from lit_qlora.adapter import Adapter
from lit_qlora.demo import score
from lit_qlora.generation import generate
from lit_qlora.inference import (
    encode_prompt,
    load_for_inference,
    pick_device,
    resolve_generation_precision,
    run_prompts,
)
from lit_qlora.precision import autocast_for
from lit_qlora.train.tracking import run_report
from lit_qlora.utils import UserError, run_cli


def main(
    checkpoint_dir: Optional[Path] = None,
    lora_path: Optional[Path] = None,
    prompt: Optional[str] = None,
    input: str = "",
    max_new_tokens: int = 100,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    seed: int = 1234,
    num_samples: int = 1,
    quantize: Optional[str] = None,
    quantize_lm_head: Optional[bool] = None,
    precision: str = "auto",
    devices: int = 1,
    accelerator: str = "auto",
    stream: bool = False,
    merge: bool = True,
    template: Optional[str] = None,
    metrics_file: Optional[Path] = None,
) -> None:
    """Generate from a base model plus a LoRA adapter.

    Args:
        checkpoint_dir: the base model the adapter was trained on. Left out: the demo model and its adapter, and
            with no --prompt either, the demo's held-out questions answered by the base and the fine-tuned model.
        lora_path: an adapter file written by finetune/lora.py (any checkpoint of it) or a PEFT folder.
        prompt: the instruction. input: optional input for templates that have one.
        max_new_tokens: tokens to generate at most (stops earlier at an eos id of the checkpoint, or with the chat
            template at its end-of-turn token).
        temperature: 0 is greedy; higher samples. top_k / top_p: sampling filters.
        num_samples: how many continuations to generate.
        quantize: bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq or bnb.int8, whatever the adapter was trained with
            (default: none; for the demo model, what its adapter was trained with).
        quantize_lm_head: with --quantize, also quantize the output layer; default: as the adapter was trained,
            else no. Decoding is faster with a 4-bit head (tutorials/quantize.md), prefill at the same speed.
        precision: auto (bf16 where the device computes it natively, else fp32; 16-mixed on GPUs without bf16),
            32-true, 16-true, bf16-true, 16-mixed or bf16-mixed.
        devices: generation runs on one device; more are refused.
        stream: print tokens as they are produced.
        merge: add the adapter to the weights before quantizing (fast); false keeps separate LoRA layers.
        template: alpaca, plain or chat (the model's chat template, one user turn); default: the one the adapter was
            trained with (for chat, the very template text recorded in it).
        metrics_file: also write tokens/s, time and memory as JSON there.
    """
    demo_run = checkpoint_dir is None and prompt is None  # the demo's held-out questions (lit_qlora/demo/score.py)
    if checkpoint_dir is None:
        checkpoint_dir, lora_path = demo.DEMO_CHECKPOINT, Path(lora_path or demo.DEMO_ADAPTER)
        if not lora_path.is_file():
            raise UserError(f"no demo adapter at {lora_path}; run `python finetune/lora.py` first")
        quantize = quantize or Adapter.load(lora_path, mmap=True).train.get("quantize")  # as trained: QLoRA
    if lora_path is None:
        raise UserError("--lora_path is required with --checkpoint_dir; use generate/base.py to generate without an "
                        "adapter")
    if devices != 1:
        raise UserError(f"generation runs on one device, got --devices {devices}; use --devices 1")
    device = pick_device(accelerator)
    precision, precision_why = resolve_generation_precision(precision, device)
    model, tokenizer, adapter = load_for_inference(Path(checkpoint_dir), Path(lora_path), quantize, precision, device,
                                                   merge, quantize_lm_head=quantize_lm_head,
                                                   precision_why=precision_why)
    if demo_run:
        base, _, _ = load_for_inference(Path(checkpoint_dir), None, quantize, precision, device,
                                        quantize_lm_head=quantize_lm_head)
        show_held_out(base, model, tokenizer, adapter, Path(lora_path), min(max_new_tokens, score.ANSWER_TOKENS),
                      precision, device)
        return
    ids, stops = encode_prompt(tokenizer, prompt, input, adapter, template)
    run_prompts(model, tokenizer, ids, max_new_tokens, temperature, top_k, top_p, seed, num_samples, stream, device,
                metrics_file, precision, stops=stops)


def show_held_out(base, tuned, tokenizer, adapter, lora_path: Path, max_new_tokens: int, precision: str,
                  device: torch.device) -> None:
    """What the demo's fine-tuning changed: the base model's and the fine-tuned model's greedy answers to every
    held-out question (in the adapter's prompt template), a few shown, both scored; the run report; what to try next."""
    def answers(model):
        def answer(r: dict) -> str:
            ids, stops = encode_prompt(tokenizer, r["instruction"], r["input"], adapter, None)
            return greedy_answer(model, tokenizer, ids, stops, max_new_tokens, precision, device)
        return answer

    rows = score.answer_all(score.held_out(), answers(base), answers(tuned))
    print("\n".join(score.report(rows)))
    if (lora_path.parent / "metrics.csv").is_file():  # the run's folder (not that of a checkpoints/iter-* file)
        md, png = run_report(lora_path.parent)
        print(f"Run report: {md}" + (f" (curves: {png})" if png else ""))
    print(f"Next, ask it a question of your own: {score.NEXT_COMMAND}")


def greedy_answer(model, tokenizer, ids: torch.Tensor, stops: list[int], max_new_tokens: int, precision: str,
                  device: torch.device) -> str:
    """The greedy continuation of `ids` up to a stop token, as text (surrounding spaces dropped)."""
    n = min(max_new_tokens, model.config.block_size - len(ids))
    with autocast_for(precision, device):
        out = generate(model, ids, n, eos_ids=stops)
    return tokenizer.decode([t for t in out[len(ids):].tolist() if t not in stops]).strip()


if __name__ == "__main__":
    run_cli(main)
