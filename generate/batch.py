"""Generate for every row of a data file, many rows at once (the batched engine), into a JSONL file.

    python generate/batch.py --checkpoint_dir checkpoints/Qwen/Qwen3-1.7B --lora_path out/lora/chats/final.pth \
        --data_dir data/test.jsonl --out_file preds.jsonl --quantize bnb.nf4
    python generate/batch.py ... --lora_path support=out/support.pth --lora_path sales=out/sales.pth  # per row

Rows: {"messages": [...]} (a conversation to continue, with the chat template) or {"prompt": "..."} (or Alpaca's
"instruction" and "input"), from .jsonl / .json / .csv / .parquet files or a --data_dir folder (the one record reader
of finetune/lora.py). Each output line is the input row plus "generated", "finish_reason", "prompt_tokens",
"completion_tokens" and "row" (its number in the input); a row that cannot run gets an "error" instead. A rerun with
the same --out_file skips the rows already written. Row by row the output is what generate/lora.py prints for the
same prompt and flags.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from lit_qlora.adapter import Adapter
from lit_qlora.batch import ResultsFile, prompt_of, run_batch
from lit_qlora.data.chat_template import encode_chat, stop_ids
from lit_qlora.data.sources import resolve
from lit_qlora.engine import Engine, Sampling
from lit_qlora.engine.adapters import AdapterBank
from lit_qlora.inference import (
    chat_template_text,
    encode_prompt,
    load_for_inference,
    pick_device,
    resolve_generation_precision,
    say,
)
from lit_qlora.server.serve import parse_lora_paths
from lit_qlora.utils import UserError, repeatable, run_cli


def main(
    data_dir: Path,
    out_file: Path,
    checkpoint_dir: Optional[Path] = None,
    lora_path: list[str] = [],
    merge: bool = True,
    prompt_column: str = "prompt",
    adapter_column: str = "adapter",
    output_column: str = "generated",
    template: Optional[str] = None,
    max_new_tokens: int = 100,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    seed: int = 1234,
    num_samples: int = 1,
    quantize: Optional[str] = None,
    quantize_lm_head: Optional[bool] = None,
    precision: str = "auto",
    accelerator: str = "auto",
    kv_cache_gb: Optional[float] = None,
    max_batch: int = 32,
) -> None:
    """Generate a continuation of every row's prompt.

    Args:
        data_dir: a data file (.jsonl, .json, .csv, .parquet) or a folder of them (its first set: the train files of
            a split folder); rows as in the module docstring.
        out_file: the JSONL written (appended to: a rerun skips the rows it already holds).
        checkpoint_dir: the base model (left out: the demo model).
        lora_path: an adapter (every row), or NAME=PATH once per adapter: each row then names its adapter in
            --adapter_column (none: the base), all of them unmerged over one base.
        merge: with one adapter, add it to the weights before quantizing, as generate/lora.py does (false: kept
            as separate LoRA layers).
        prompt_column: the column holding a row's prompt text. output_column: where its generated text goes.
        template: alpaca, plain or chat for prompt rows (default: the one the adapter was trained with).
        max_new_tokens, temperature, top_k, top_p, seed: as in generate/lora.py (each row drawn with the seed).
        num_samples: continuations per row (the output's text, finish reason and counts become lists).
        quantize, quantize_lm_head, precision, accelerator: as in generate/lora.py.
        kv_cache_gb: memory for the keys and values of the rows being generated (default 1 GiB at most).
        max_batch: sequences generated together at most.
    """
    if num_samples < 1 or max_batch < 1:
        raise UserError("--num_samples and --max_batch must be at least 1")
    if checkpoint_dir is None:
        from lit_qlora import demo

        checkpoint_dir = demo.ensure_demo_checkpoint()
    sources = resolve(data_dir)
    if sources is None:
        raise UserError(f"{data_dir} holds no data file (.jsonl, .json, .csv, .parquet); pass a file or a folder of "
                        "them")
    source = sources[0]
    model, tokenizer, adapter, bank, precision = _setup_model(Path(checkpoint_dir), lora_path, merge, quantize,
                                                              quantize_lm_head, precision, accelerator)
    encode = _encoder(tokenizer, adapter, bank, prompt_column, adapter_column, template)
    engine = Engine(model, tokenizer=None, bank=bank, kv_cache_gb=kv_cache_gb, max_batch=max_batch,
                    precision=precision)
    total = sum(1 for _ in source.rows())
    out = ResultsFile(out_file)
    say(f"{total} rows in {source}; {len(out.done)} already in {out_file}")
    sampling = Sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    rows = ((rec, f"row {row} of {path}") for path, row, rec in source.rows())
    try:
        tokens = run_batch(engine, rows, encode, tokenizer.decode, sampling, num_samples, out, output_column, total)
    finally:
        out.close()
    say(f"Wrote {out_file} ({tokens} new tokens)")



def _setup_model(checkpoint_dir: Path, lora_path: list[str], merge: bool, quantize, quantize_lm_head, precision: str,
                 accelerator: str):
    """The model with its one adapter (merged unless --merge false), or the base with every NAME=PATH adapter held
    unmerged in an AdapterBank: (model, tokenizer, adapter, bank, precision)."""
    named = parse_lora_paths(lora_path) if any("=" in p for p in lora_path) else {}
    if len(lora_path) > 1 and not named:
        raise UserError("several --lora_path need names: --lora_path NAME=PATH once per adapter")
    device = pick_device(accelerator)
    precision, why = resolve_generation_precision(precision, device)
    single = Path(lora_path[0]) if lora_path and not named else None
    model, tokenizer, adapter = load_for_inference(checkpoint_dir, single, quantize, precision, device,
                                                   merge=merge, quantize_lm_head=quantize_lm_head,
                                                   precision_why=why)
    bank = None
    if named:
        bank = AdapterBank(model, precision, quantize)
        for name, path in named.items():
            bank.add(name, Adapter.load(path, model.config, mmap=True))
    return model, tokenizer, adapter, bank, precision


def _encoder(tokenizer, adapter, bank, prompt_column: str, adapter_column: str, template):
    """record, where -> (prompt ids, stop ids, adapter name): a conversation with its adapter's chat template, a prompt
    with its template, as generate/lora.py encodes them."""
    def encode(rec, where: str):
        kind, value = prompt_of(rec, where, prompt_column)
        name = rec.get(adapter_column) if bank is not None else None
        if name is not None and name not in bank.adapters:
            raise UserError(f"{where} names the adapter {name!r}, which is not one of --lora_path's "
                            f"({', '.join(bank.adapters)}); fix the row or add that adapter")
        used = bank.adapters[name] if name is not None else adapter
        if kind == "messages":
            chat = chat_template_text(tokenizer, used)
            ids = encode_chat(tokenizer, value, add_generation_prompt=True, template=chat)
            return ids, stop_ids(tokenizer, chat), name
        ids, stops = encode_prompt(tokenizer, value[0], value[1], used, template)
        return ids.tolist(), stops, name

    return encode

if __name__ == "__main__":
    sys.argv = repeatable(sys.argv, "--lora_path")
    run_cli(main)
