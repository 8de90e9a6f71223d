"""Generate from a base model (no adapter).

    python generate/base.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-hf --prompt "Hello, my name is" \
        --quantize bnb.nf4

The generated text alone goes to stdout; loading messages and the speed/memory figures go to stderr.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from lit_qlora import demo
from lit_qlora.inference import load_for_inference, pick_device, resolve_generation_precision, run_prompts
from lit_qlora.utils import UserError, run_cli


def main(
    checkpoint_dir: Optional[Path] = None,
    prompt: str = "Hello, my name is",
    max_new_tokens: int = 50,
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
    metrics_file: Optional[Path] = None,
) -> None:
    """Generate a continuation of `prompt` (raw text, no template).

    Args:
        checkpoint_dir: model folder (Hugging Face format is converted on first use); left out: the demo model.
        prompt: the text to continue. max_new_tokens: at most this many new tokens.
        temperature: 0 is greedy; higher samples. top_k / top_p: sampling filters.
        quantize: bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq or bnb.int8.
        quantize_lm_head: with --quantize, also quantize the output layer; default: as the adapter was trained,
            else no. Decoding is faster with a 4-bit head (tutorials/quantize.md), prefill at the same speed.
        precision: auto (bf16 where the device computes it natively, else fp32; 16-mixed on GPUs without bf16),
            32-true, 16-true, bf16-true, 16-mixed or bf16-mixed.
        stream: print tokens as they are produced. metrics_file: also write the figures as JSON there.
    """
    if checkpoint_dir is None:
        checkpoint_dir = demo.ensure_demo_checkpoint()
    if devices != 1:
        raise UserError(f"generation runs on one device, got --devices {devices}; use --devices 1")
    device = pick_device(accelerator)
    precision, precision_why = resolve_generation_precision(precision, device)
    model, tokenizer, _ = load_for_inference(Path(checkpoint_dir), None, quantize, precision, device,
                                             quantize_lm_head=quantize_lm_head, precision_why=precision_why)
    run_prompts(model, tokenizer, prompt, max_new_tokens, temperature, top_k, top_p, seed, num_samples, stream, device,
                metrics_file, precision)


if __name__ == "__main__":
    run_cli(main)
