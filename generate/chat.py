"""Chat with a model (and optionally an adapter) in the terminal.

    python generate/chat.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-chat-hf --quantize bnb.nf4

Multi-turn with the model's chat template when its tokenizer_config.json has one; otherwise each turn uses the
adapter's prompt template with the conversation so far. Type `!reset` to start over, `!quit` (or Ctrl-D) to leave.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch

from lit_qlora import demo
from lit_qlora.chat_template import encode_chat, end_of_turn_ids
from lit_qlora.generation import generate
from lit_qlora.inference import (
    autocast_for,
    format_prompt,
    load_for_inference,
    pick_device,
    resolve_generation_precision,
)
from lit_qlora.utils import run_cli


def encode_prompt(messages: list[dict], tokenizer, adapter: Optional[dict], template: Optional[str]) -> torch.Tensor:
    """Prompt ids. With a chat template: the ids transformers' apply_chat_template gives (real bos/eos strings in the
    text, bos once); otherwise the adapter's prompt template over the conversation so far."""
    if tokenizer.chat_template:
        return torch.tensor(encode_chat(tokenizer, messages, add_generation_prompt=True), dtype=torch.long)
    history = "".join(f"{m['role']}: {m['content']}\n" for m in messages[:-1])
    return tokenizer.encode(history + format_prompt(messages[-1]["content"], "", adapter, template))


def main(
    checkpoint_dir: Optional[Path] = None,
    lora_path: Optional[Path] = None,
    max_new_tokens: int = 200,
    temperature: float = 0.7,
    top_k: Optional[int] = 50,
    top_p: Optional[float] = None,
    seed: int = 1234,
    quantize: Optional[str] = None,
    quantize_lm_head: Optional[bool] = None,
    precision: str = "auto",
    accelerator: str = "auto",
    template: Optional[str] = None,
) -> None:
    """Interactive chat. Arguments as in generate/lora.py (lora_path optional)."""
    if checkpoint_dir is None:
        checkpoint_dir = demo.ensure_demo_checkpoint()
        default_adapter = Path("out/lora/demo/lit_model_lora_finetuned.pth")
        lora_path = lora_path or (default_adapter if default_adapter.is_file() else None)
    device = pick_device(accelerator)
    precision, precision_why = resolve_generation_precision(precision, device)
    model, tokenizer, adapter = load_for_inference(Path(checkpoint_dir), lora_path, quantize, precision, device,
                                                   quantize_lm_head=quantize_lm_head, precision_why=precision_why)
    gen = torch.Generator(device=device).manual_seed(seed)
    stops = tokenizer.stop_ids or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
    if tokenizer.chat_template:  # the template's end-of-turn token (e.g. <|im_end|>) may not be among the eos ids
        stops = list(dict.fromkeys([*stops, *end_of_turn_ids(tokenizer)]))
    messages: list[dict] = []
    while True:
        try:
            line = input(">> You: ")
        except EOFError:
            break
        if line.strip() == "!quit":
            break
        if line.strip() == "!reset":
            messages = []
            continue
        messages.append({"role": "user", "content": line})
        ids = encode_prompt(messages, tokenizer, adapter, template)
        budget = min(max_new_tokens, model.config.block_size - len(ids))
        if budget <= 0:
            print("(the conversation is longer than the model's context; type !reset)", file=sys.stderr)
            messages.pop()
            continue
        print(">> Model: ", end="", flush=True)
        printed, new = "", []

        def on_token(tok: int) -> None:
            nonlocal printed
            if tok in stops:
                return
            new.append(tok)
            text = tokenizer.decode(new)
            if text.startswith(printed) and not text.endswith("\ufffd"):
                print(text[len(printed):], end="", flush=True)
                printed = text

        with autocast_for(precision, device):
            generate(model, ids, budget, temperature=temperature, top_k=top_k, top_p=top_p, eos_ids=stops,
                     generator=gen, on_token=on_token)
        print()
        messages.append({"role": "assistant", "content": tokenizer.decode(new)})


if __name__ == "__main__":
    run_cli(main)
