"""Generate with a LoRA adapter (ours or a PEFT folder), merged into the base for speed.

    python generate/lora.py                  # the demo: the question, the base model's and the fine-tuned answer
    python generate/lora.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-hf \
        --lora_path out/lora/alpaca/lit_model_lora_finetuned.pth --prompt "Recommend a movie" --quantize bnb.nf4

The generated text alone goes to stdout; loading messages and the speed/memory figures go to stderr.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from lit_qlora import demo
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
        checkpoint_dir: the base model the adapter was trained on (left out: the demo model).
        lora_path: an adapter file written by finetune/lora.py (any checkpoint of it) or a PEFT folder.
        prompt: the instruction. input: optional input for templates that have one.
        max_new_tokens: tokens to generate at most (stops earlier at an eos id of the checkpoint, or with the chat
            template at its end-of-turn token).
        temperature: 0 is greedy; higher samples. top_k / top_p: sampling filters.
        num_samples: how many continuations to generate.
        quantize: bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq or bnb.int8, whatever the adapter was trained with.
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
    demo_run = checkpoint_dir is None and lora_path is None and prompt is None
    if checkpoint_dir is None:
        checkpoint_dir = demo.DEMO_CHECKPOINT
        lora_path = lora_path or Path("out/lora/demo/lit_model_lora_finetuned.pth")
        if prompt is None:
            prompt, input = demo.DEMO_PROMPT
        if not Path(lora_path).is_file():
            raise UserError(f"no demo adapter at {lora_path}; run `python finetune/lora.py` first")
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
    ids, stops = encode_prompt(tokenizer, prompt if prompt is not None else "", input, adapter, template)
    if demo_run:  # what the demo changed: the same question to the base model and to the fine-tuned one
        base, _, _ = load_for_inference(Path(checkpoint_dir), None, quantize, precision, device,
                                        quantize_lm_head=quantize_lm_head)
        print(f"Question: {prompt}" + (f" {input}" if input else ""))
        for name, m in (("Base model", base), ("Fine-tuned", model)):
            print(f"{name}: {greedy_answer(m, tokenizer, ids, stops, max_new_tokens, precision, device)}")
        md, png = run_report(Path(lora_path).parent)
        print(f"Run report: {md}" + (f" (curves: {png})" if png else ""))
        return
    run_prompts(model, tokenizer, ids, max_new_tokens, temperature, top_k, top_p, seed, num_samples, stream, device,
                metrics_file, precision, stops=stops)


def greedy_answer(model, tokenizer, ids: torch.Tensor, stops: list[int], max_new_tokens: int, precision: str,
                  device: torch.device) -> str:
    """The greedy continuation of `ids` as one line of text (or a note saying it is empty)."""
    n = min(max_new_tokens, model.config.block_size - len(ids))
    with autocast_for(precision, device):
        out = generate(model, ids, n, eos_ids=stops)
    text = tokenizer.decode([t for t in out[len(ids):].tolist() if t not in stops]).strip()
    return text.replace("\n", " ") if text else "(nothing: it ends at once)"


if __name__ == "__main__":
    run_cli(main)
