"""What generate/base.py, generate/lora.py and generate/chat.py share: loading a model for inference (adapter merged
before quantization), the prompt as the adapter saw it in training (a prompt template or the chat template, with the
stop ids that go with it), printing text while it is generated (`StreamPrinter`) and running prompts with the figures
users compare (tokens/s, memory)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import torch

from lit_qlora.adapter import Adapter
from lit_qlora.convert import ensure_converted
from lit_qlora.data.chat_template import common_prefix_len, encode_chat, instruction_messages, stop_ids, template_of
from lit_qlora.data.templates import CHAT, check_template_name, get_template
from lit_qlora.engine import Engine, Sampling, choice_seed
from lit_qlora.loader import load_model, load_model_with_adapter
from lit_qlora.precision import (
    bound_cpu_matmul_caches,
    resolve_accelerator,
    resolve_precision,
    slow_precision_warning,
)
from lit_qlora.quant.decode4bit import enable_fast_decode
from lit_qlora.quant.prequantized import load_note
from lit_qlora.quant.quantize import check_quantize, enable_cpu_inference_packing, format_memory_report, memory_report
from lit_qlora.tokenizer import Tokenizer
from lit_qlora.utils import UserError, memory_used_gb


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pick_device(accelerator: str) -> torch.device:
    """The device a generate script runs on (--accelerator auto, cpu or cuda), which must be here."""
    device_type = resolve_accelerator(accelerator)
    if device_type == "cuda" and not torch.cuda.is_available():
        raise UserError("--accelerator cuda but no GPU is visible; use --accelerator cpu")
    return torch.device(device_type)


def resolve_generation_precision(precision: str, device: torch.device) -> tuple[str, str]:
    """--precision of a generate script: `auto` resolved for this device (with the reason), and a warning printed for
    a 16-bit precision the CPU has no native support for."""
    bound_cpu_matmul_caches()  # every new prompt length is a new matmul shape
    precision, why = resolve_precision(precision, device.type)
    warning = slow_precision_warning(precision, device.type)
    if warning:
        say(warning)
    return precision, why


def load_for_inference(checkpoint_dir: Path, lora_path: Optional[Path], quantize: Optional[str], precision: str,
                       device: torch.device, merge: bool = True, fast_cpu_4bit: bool = True,
                       quantize_lm_head: Optional[bool] = None, precision_why: str = ""):
    """(model, tokenizer, adapter or None). The adapter is added to the full-precision weights as they load
    (`merge`), so a quantized model rounds once; `merge=False` keeps separate LoRA layers. `quantize_lm_head` None:
    as the adapter was trained (its file records it), else the loader's default. `precision` is resolved
    (`resolve_generation_precision`); `precision_why` says how, in the "Loaded" line."""
    quantize = check_quantize(quantize, precision, device)
    config = ensure_converted(checkpoint_dir)
    tokenizer = Tokenizer(checkpoint_dir)
    adapter = Adapter.load(Path(lora_path), config) if lora_path else None
    if quantize_lm_head is None and adapter is not None and adapter.train.get("quantize"):
        # files from before the record were trained with a 4-bit head (the default then)
        quantize_lm_head = adapter.train.get("quantize_lm_head", True)
    t0 = time.perf_counter()
    if adapter is not None and not merge:
        model = load_model_with_adapter(checkpoint_dir, adapter, precision=precision, quantize=quantize, device=device,
                                        config=config, quantize_lm_head=quantize_lm_head)
    else:
        # a tied 4-bit head also serves the embedding rows: no dense vocabulary x hidden copy (never trained here)
        model = load_model(checkpoint_dir, precision=precision, quantize=quantize, device=device, config=config,
                           merge_adapter=adapter, quantize_lm_head=quantize_lm_head, embedding_from_head=True)
    model.eval()
    if quantize and device.type == "cpu" and fast_cpu_4bit:
        fast_cpu_4bit_decoding(model)  # this model is never trained: decode from the packed 4-bit weights
    why = f" ({precision_why})" if precision_why else ""
    seconds = time.perf_counter() - t0
    say(f"Loaded {config.name} in {seconds:.2f}s ({quantize or 'no quantization'}, {precision}{why}"
        f"{', adapter ' + str(lora_path) + (' merged' if merge else '') if adapter else ''}) | "
        f"{format_memory_report(memory_report(model))}{load_note(model, quantize, device, seconds)}")
    return model, tokenizer, adapter


def fast_cpu_4bit_decoding(model) -> int:
    """For a CPU model that is never trained again: its 4-bit layers decode through lit_qlora/quant/decode4bit.py's
    kernel (read the packed weights, no dense copy per token), and bitsandbytes' packed AVX512-BF16 layout is
    allowed for any layer the kernel cannot take. Returns the number of layers on the kernel."""
    enable_cpu_inference_packing(model, True)
    return enable_fast_decode(model)


def format_prompt(prompt: str, input: str, adapter: Optional[Adapter], template: Optional[str]) -> str:
    """The prompt as the adapter saw it in training with a prompt template (alpaca, plain): its stored template
    unless one is given; none: the prompt as it is."""
    name = template or (adapter.train.get("template") if adapter is not None else None)
    if not name:
        return prompt if not input else f"{prompt}\n{input}"
    return get_template(name).format(prompt, input)


def prompt_template(adapter: Optional[Adapter], template: Optional[str]) -> Optional[str]:
    """The template prompts are rendered with: `template` (--template) when given, else the one the adapter was
    trained with (alpaca, plain or chat); None: none recorded."""
    return check_template_name(template) or (adapter.train.get("template") if adapter is not None else None)


def chat_template_text(tokenizer: Tokenizer, adapter: Optional[Adapter]) -> str:
    """The chat template to render with: the text the adapter was trained with (recorded in it), so the prompt is
    tokenized exactly as in training, else the checkpoint's (a one-line UserError when there is none)."""
    recorded = adapter.train.get("chat_template") if adapter is not None else None
    if recorded and tokenizer.chat_template and recorded != tokenizer.chat_template:
        say(f"note: the chat template in {tokenizer.checkpoint_dir} differs from the one the adapter was trained "
            "with; rendering with the adapter's")
    return recorded or template_of(tokenizer)


def encode_prompt(tokenizer: Tokenizer, prompt: str, input: str, adapter: Optional[Adapter],
                  template: Optional[str]) -> tuple[torch.Tensor, list[int]]:
    """(prompt ids, stop ids) for one instruction, as the adapter saw it in training (see `prompt_template`).

    chat: one user turn (`chat_template.instruction_messages`, as training renders instruction records) and the
    assistant header, the ids transformers' apply_chat_template(add_generation_prompt=True) gives; generation stops
    at the template's end-of-turn token as well as at the checkpoint's eos ids. Otherwise the prompt template's text
    (or the raw prompt) tokenized as in training, stopping at the eos ids.
    """
    if prompt_template(adapter, template) == CHAT:
        chat = chat_template_text(tokenizer, adapter)
        ids = encode_chat(tokenizer, instruction_messages(prompt, input), add_generation_prompt=True, template=chat)
        return torch.tensor(ids, dtype=torch.long), stop_ids(tokenizer, chat)
    return tokenizer.encode(format_prompt(prompt, input, adapter, template)), stop_ids(tokenizer)


def _write_stdout(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


class StreamPrinter:
    """Prints generated text while it is generated, so that what it prints adds up to `tokenizer.decode(ids)`.

    `feed(id)` for each new token: the text is written as soon as the ids so far decode to whole characters (a
    character split over several byte tokens is held back until its last byte arrives). `finish()` writes what is
    still held back (e.g. a character cut off by max_new_tokens, which decodes to U+FFFD as in the non-streamed
    reply) and returns the whole text. Ids in `skip_ids` (stop tokens) are not part of the text. `write` gets each
    piece (default: stdout, flushed).
    """

    def __init__(self, tokenizer: Tokenizer, skip_ids: Iterable[int] = (),
                 write: Optional[Callable[[str], Any]] = None) -> None:
        self.tokenizer, self.skip = tokenizer, set(skip_ids)
        self.write = write or _write_stdout
        self.ids: list[int] = []
        self.printed = ""

    def feed(self, token_id: int) -> None:
        """Take one generated id; write the new text if it decodes to whole characters."""
        if token_id in self.skip:
            return
        self.ids.append(int(token_id))
        # Decoding all ids (not the new one alone) keeps merges across tokens, e.g. a multi-byte character or a
        # sentencepiece word boundary; a trailing U+FFFD is an incomplete character for now.
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd") and text.startswith(self.printed):
            self._emit(text)

    def finish(self) -> str:
        """Write whatever was held back; returns the whole text (what the non-streamed reply would be)."""
        text = self.tokenizer.decode(self.ids)
        if text.startswith(self.printed):
            self._emit(text)
        else:  # a decoder that rewrote earlier text (none of ours): the rest after what both share
            self.write(text[common_prefix_len(text, self.printed):])
            self.printed = text
        return text

    def _emit(self, text: str) -> None:
        if len(text) > len(self.printed):
            self.write(text[len(self.printed):])
        self.printed = text


def run_prompts(model, tokenizer, prompt: Union[str, torch.Tensor], max_new_tokens: int, temperature: float,
                top_k: Optional[int], top_p: Optional[float], seed: int, num_samples: int, stream: bool,
                device: torch.device, metrics_file: Optional[Path] = None, precision: str = "bf16-true",
                stops: Optional[list[int]] = None) -> list[str]:
    """Generate `num_samples` continuations of `prompt` (text, tokenized with the tokenizer's defaults, or ids) as one
    batch of the engine (the prompt computed once; sample i draws with `choice_seed(seed, i)`); the generated text
    alone goes to stdout, one line per sample in order, the first printed while it is generated with `stream`.
    Generation stops at `stops` (default: the checkpoint's eos ids), which are not printed."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    max_new_tokens = min(max_new_tokens, model.config.block_size - len(ids))
    if max_new_tokens <= 0:
        raise UserError(f"the prompt has {len(ids)} tokens, the model's context is {model.config.block_size}; shorten "
                        "the prompt")
    stops = stop_ids(tokenizer) if stops is None else stops
    engine = Engine(model, precision=precision, max_batch=num_samples,
                    kv_cache_tokens=num_samples * (len(ids) + max_new_tokens + 16))
    printer = StreamPrinter(tokenizer, skip_ids=stops) if stream else None

    def first(seq, kind: str, value) -> None:  # the first sample's tokens, printed as they come
        if kind == "token":
            printer.feed(value)

    seqs = [engine.submit(ids.tolist(), Sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                                 top_p=top_p, seed=choice_seed(seed, i), stop_ids=tuple(stops)),
                          on_event=first if i == 0 and printer else None) for i in range(num_samples)]
    t0 = time.perf_counter()
    engine.run()
    total_time = time.perf_counter() - t0
    outputs = []
    for i, seq in enumerate(seqs):
        text_out = tokenizer.decode([t for t in seq.new_ids if t not in stops])
        if i == 0 and printer is not None:
            printer.finish()  # the text held back, if any: the printed text is text_out
        else:
            sys.stdout.write(text_out)
        sys.stdout.write("\n")
        sys.stdout.flush()
        outputs.append(text_out)
    total_tokens = sum(len(seq.new_ids) for seq in seqs)
    mem = memory_used_gb(device)
    say(f"Time for inference: {total_time:.2f} sec total, {total_tokens / total_time:.2f} tokens/sec")
    say(f"Memory used: {mem:.2f} GB")
    if metrics_file:
        Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
        Path(metrics_file).write_text(json.dumps(dict(tokens_per_sec=total_tokens / total_time, seconds=total_time,
                                                      new_tokens=total_tokens, memory_gb=mem, outputs=outputs),
                                                      indent=2))
    return outputs
