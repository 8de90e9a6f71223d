"""Chat with a model (and optionally an adapter) in the terminal.

    python generate/chat.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct --quantize bnb.nf4

Multi-turn in the model's own chat template, rendered as transformers' apply_chat_template does (the real bos/eos
strings, bos once), when the adapter was trained with it (`--template chat`, recorded in the adapter: its very template
text is used) or, without an adapter template, when the checkpoint has one; otherwise each turn uses the adapter's
prompt template with the conversation so far. Replies stop at the checkpoint's eos ids and the chat template's
end-of-turn token, and are printed while they are generated. The KV cache is kept between turns
(`generation.KVSession`): a turn computes only the ids after those the last one left in it, so its latency does
not grow with the conversation. Type `!reset` to start over, `!quit` (or Ctrl-D) to leave.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch

from lit_qlora import demo
from lit_qlora.data.chat_template import encode_chat, stop_ids
from lit_qlora.data.templates import CHAT
from lit_qlora.generation import KVSession, generate
from lit_qlora.inference import (
    StreamPrinter,
    chat_template_text,
    format_prompt,
    load_for_inference,
    pick_device,
    prompt_template,
    resolve_generation_precision,
)
from lit_qlora.precision import autocast_for
from lit_qlora.utils import run_cli


def chat_template_for(tokenizer, adapter, template: Optional[str]) -> Optional[str]:
    """The chat template text the conversation is rendered with, or None for a prompt template: with --template chat,
    or no --template and an adapter trained with chat, or neither template named and a checkpoint that has one."""
    name = prompt_template(adapter, template)
    if name == CHAT or (name is None and tokenizer.chat_template):
        return chat_template_text(tokenizer, adapter)
    return None


def conversation_ids(messages: list[dict], tokenizer, chat: Optional[str], adapter, template: Optional[str]
                     ) -> torch.Tensor:
    """Prompt ids of the conversation so far. With a chat template: the ids transformers' apply_chat_template gives
    (add_generation_prompt=True); otherwise the adapter's prompt template over the conversation so far."""
    if chat:
        return torch.tensor(encode_chat(tokenizer, messages, add_generation_prompt=True, template=chat),
                            dtype=torch.long)
    history = "".join(f"{m['role']}: {m['content']}\n" for m in messages[:-1])
    return tokenizer.encode(history + format_prompt(messages[-1]["content"], "", adapter, template))


def encode_prompt(messages: list[dict], tokenizer, adapter, template: Optional[str]) -> torch.Tensor:
    """`conversation_ids` with the template `chat_template_for` picks."""
    return conversation_ids(messages, tokenizer, chat_template_for(tokenizer, adapter, template), adapter, template)


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
    """Interactive chat. Arguments as in generate/lora.py (lora_path optional).

    Args:
        template: alpaca, plain or chat; default: the adapter's (for chat, the template text it was trained with),
            else chat when the checkpoint has a chat template.
    """
    if checkpoint_dir is None:
        checkpoint_dir = demo.ensure_demo_checkpoint()
        default_adapter = Path("out/lora/demo/lit_model_lora_finetuned.pth")
        lora_path = lora_path or (default_adapter if default_adapter.is_file() else None)
    device = pick_device(accelerator)
    precision, precision_why = resolve_generation_precision(precision, device)
    model, tokenizer, adapter = load_for_inference(Path(checkpoint_dir), lora_path, quantize, precision, device,
                                                   quantize_lm_head=quantize_lm_head, precision_why=precision_why)
    gen = torch.Generator(device=device).manual_seed(seed)
    chat = chat_template_for(tokenizer, adapter, template)
    stops = stop_ids(tokenizer, chat)  # eos ids, and the template's end-of-turn token (e.g. <|im_end|>)
    messages: list[dict] = []
    session = KVSession()  # the KV cache between turns: each turn computes only what the last one did not
    while True:
        try:
            line = input(">> You: ")
        except EOFError:
            break
        if line.strip() == "!quit":
            break
        if line.strip() == "!reset":
            messages, session = [], KVSession()
            continue
        messages.append({"role": "user", "content": line})
        ids = conversation_ids(messages, tokenizer, chat, adapter, template)
        budget = min(max_new_tokens, model.config.block_size - len(ids))
        if budget <= 0:
            print(f"(the conversation is {len(ids)} tokens, longer than the model's context of "
                  f"{model.config.block_size}; type !reset to start over)", file=sys.stderr, flush=True)
            messages.pop()
            continue
        print(">> Model: ", end="", flush=True)
        printer = StreamPrinter(tokenizer, skip_ids=stops)
        with autocast_for(precision, device):
            generate(model, ids, budget, temperature=temperature, top_k=top_k, top_p=top_p, eos_ids=stops,
                     generator=gen, on_token=printer.feed, session=session)
        reply = printer.finish()  # prints what was held back (a character cut off at the end): all of the reply
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})


if __name__ == "__main__":
    run_cli(main)
