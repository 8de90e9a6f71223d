"""What generate/base.py, generate/lora.py and generate/chat.py share: loading a model for inference (adapter merged
before quantization) and running prompts with the figures users compare (tokens/s, memory)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from lit_qlora.convert import ensure_converted
from lit_qlora.data import get_template
from lit_qlora.generation import generate
from lit_qlora.loader import load_model
from lit_qlora.lora import load_adapter
from lit_qlora.quantize import check_quantize, enable_cpu_inference_packing, format_memory_report, memory_report
from lit_qlora.tokenizer import Tokenizer
from lit_qlora.utils import UserError, memory_used_gb


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pick_device(accelerator: str) -> torch.device:
    if accelerator == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise UserError("--accelerator cuda but no GPU is visible; use --accelerator cpu")
    return torch.device(accelerator)


def load_for_inference(checkpoint_dir: Path, lora_path: Optional[Path], quantize: Optional[str], precision: str,
                       device: torch.device, merge: bool = True, fast_cpu_4bit: bool = True):
    """(model, tokenizer, adapter or None). The adapter is added to the full-precision weights as they load
    (`merge`), so a quantized model rounds once; `merge=False` keeps separate LoRA layers."""
    quantize = None if quantize in (None, "none", "None") else quantize
    check_quantize(quantize, precision, device)
    config = ensure_converted(checkpoint_dir)
    tokenizer = Tokenizer(checkpoint_dir)
    adapter = load_adapter(Path(lora_path), config) if lora_path else None
    t0 = time.perf_counter()
    if adapter is not None and not merge:
        from lit_qlora.loader import load_model_with_adapter

        model = load_model_with_adapter(checkpoint_dir, adapter, precision=precision, quantize=quantize, device=device,
                                        config=config)
    else:
        model = load_model(checkpoint_dir, precision=precision, quantize=quantize, device=device, config=config,
                           merge_adapter=adapter)
    model.eval()
    if quantize and device.type == "cpu" and fast_cpu_4bit:
        fast_cpu_4bit_decoding(model)
    say(f"Loaded {config.name} in {time.perf_counter() - t0:.2f}s ({quantize or 'no quantization'}, {precision}"
        f"{', adapter ' + str(lora_path) + (' merged' if merge else '') if adapter else ''}) | "
        f"{format_memory_report(memory_report(model))}")
    return model, tokenizer, adapter


def fast_cpu_4bit_decoding(model) -> int:
    """For a CPU model that is never trained again: its 4-bit layers decode through lit_qlora/decode4bit.py's
    kernel (read the packed weights, no dense copy per token), and bitsandbytes' packed AVX512-BF16 layout is
    allowed for any layer the kernel cannot take. Returns the number of layers on the kernel."""
    from lit_qlora.decode4bit import enable_fast_decode

    enable_cpu_inference_packing(model, True)
    return enable_fast_decode(model)


def format_prompt(prompt: str, input: str, adapter: Optional[dict], template: Optional[str]) -> str:
    """The prompt as the adapter saw it in training: its stored template unless one is given."""
    name = template or (adapter or {}).get("train", {}).get("template")
    if not name:
        return prompt if not input else f"{prompt}\n{input}"
    return get_template(name).format(prompt, input)


def autocast_for(precision: str, device: torch.device):
    """*-mixed keeps embeddings and norms in fp32 and Linear weights low: compute under autocast, as in training."""
    from contextlib import nullcontext

    from lit_qlora.quantize import parse_precision

    prec = parse_precision(precision)
    return torch.autocast(device.type, dtype=prec.dtype) if prec.mixed else nullcontext()


def run_prompts(model, tokenizer, text: str, max_new_tokens: int, temperature: float, top_k: Optional[int],
                top_p: Optional[float], seed: int, num_samples: int, stream: bool, device: torch.device,
                metrics_file: Optional[Path] = None, precision: str = "bf16-true") -> list[str]:
    """Generate `num_samples` continuations of `text`; the generated text alone goes to stdout."""
    ids = tokenizer.encode(text)
    max_new_tokens = min(max_new_tokens, model.config.block_size - len(ids))
    if max_new_tokens <= 0:
        raise UserError(f"the prompt has {len(ids)} tokens, the model's context is {model.config.block_size}; shorten the prompt")
    gen = torch.Generator(device=device).manual_seed(seed)
    outputs, total_time, total_tokens = [], 0.0, 0
    stops = tokenizer.stop_ids or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
    for _ in range(num_samples):
        printed = ""
        new: list[int] = []

        def on_token(tok: int) -> None:
            nonlocal printed
            if not stream:
                return
            new.append(tok)
            text_now = tokenizer.decode([t for t in new if t not in stops])
            if text_now.startswith(printed) and not text_now.endswith("\ufffd"):  # wait for complete characters
                sys.stdout.write(text_now[len(printed):])
                sys.stdout.flush()
                printed = text_now

        t0 = time.perf_counter()
        with autocast_for(precision, device):
            out = generate(model, ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, eos_ids=stops,
                           generator=gen, on_token=on_token)
        dt = time.perf_counter() - t0
        new_ids = [t for t in out[len(ids):].tolist() if t not in stops]
        text_out = tokenizer.decode(new_ids)
        if stream:
            sys.stdout.write(text_out[len(printed):] + "\n")
        else:
            sys.stdout.write(text_out + "\n")
        sys.stdout.flush()
        outputs.append(text_out)
        total_time += dt
        total_tokens += len(out) - len(ids)
    mem = memory_used_gb(device)
    say(f"Time for inference: {total_time:.2f} sec total, {total_tokens / total_time:.2f} tokens/sec")
    say(f"Memory used: {mem:.2f} GB")
    if metrics_file:
        Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
        Path(metrics_file).write_text(json.dumps(dict(tokens_per_sec=total_tokens / total_time, seconds=total_time,
                                                      new_tokens=total_tokens, memory_gb=mem, outputs=outputs), indent=2))
    return outputs
