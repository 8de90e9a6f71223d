"""Serve a model and its adapters over HTTP with the OpenAI API (needs `pip install -e ".[serve]"`).

    python generate/serve.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct --quantize bnb.nf4 \
        --lora_path support=out/lora/support/lit_model_lora_finetuned.pth --lora_path sql=out/lora/sql/final.pth

POST /v1/chat/completions and /v1/completions (streaming by server-sent events with "stream": true), GET /v1/models
and /health. The request's "model" picks the base (--model_name, default the checkpoint folder's name) or an adapter
by its NAME. One base is loaded; every adapter is applied unmerged over it (server/serve.py). Requests run together
in the batched engine (lit_qlora/engine): every running request's tokens in each step, adapters mixed in one batch.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from lit_qlora.adapter import Adapter
from lit_qlora.engine.adapters import AdapterBank
from lit_qlora.inference import load_for_inference, pick_device, resolve_generation_precision, say
from lit_qlora.server.serve import Server, Worker, parse_lora_paths, serve
from lit_qlora.server.serve_http import create_app
from lit_qlora.utils import UserError, repeatable, run_cli


def main(
    checkpoint_dir: Path,
    lora_path: list[str] = [],
    model_name: Optional[str] = None,
    quantize: Optional[str] = None,
    quantize_lm_head: Optional[bool] = None,
    precision: str = "auto",
    accelerator: str = "auto",
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: Optional[str] = None,
    max_concurrent: int = 32,
    timeout_s: float = 600.0,
    max_tokens: int = 256,
    grace_s: float = 10.0,
    kv_cache_gb: Optional[float] = None,
    max_batch: int = 32,
) -> None:
    """Serve the base model and each adapter under the OpenAI API.

    Args:
        checkpoint_dir: the base model (an HF folder is converted on first use).
        lora_path: NAME=PATH of an adapter (our file or a PEFT folder); give it once per adapter.
        model_name: the name the base is served under (default: the checkpoint folder's name).
        quantize, quantize_lm_head, precision, accelerator: as in generate/lora.py.
        host: the address to listen on; 127.0.0.1 (the default) serves this machine only.
        api_key: when given, every /v1 request must send `Authorization: Bearer <api_key>` (else 401).
        max_concurrent: requests queued or running at once; more are answered 429.
        timeout_s: a request still unfinished this long after it arrived is stopped (504).
        max_tokens: the tokens a request generates when it names no max_tokens (clipped to the context left).
        grace_s: on SIGTERM / Ctrl-C, how long requests in flight may run on before they are cancelled.
        kv_cache_gb: memory for the keys and values of the running sequences, shared by all of them (default 1 GiB,
            or less where max_batch full contexts take less); a request that does not fit now waits, one that can
            never fit gets 400.
        max_batch: sequences decoded together at most (a request with n choices counts n).
    """
    adapters = parse_lora_paths(lora_path)
    name = model_name or Path(checkpoint_dir).name
    if name in adapters:
        raise UserError(f"the adapter name {name!r} is the base model's name; pick another NAME or --model_name")
    if max_concurrent < 1 or timeout_s <= 0 or max_batch < 1:
        raise UserError("--max_concurrent and --max_batch must be at least 1 and --timeout_s positive; e.g. "
                        "--max_concurrent 32")
    if kv_cache_gb is not None and not kv_cache_gb > 0:
        raise UserError(f"--kv_cache_gb must be positive, got {kv_cache_gb}; e.g. --kv_cache_gb 1")
    device = pick_device(accelerator)
    precision, precision_why = resolve_generation_precision(precision, device)
    model, tokenizer, _ = load_for_inference(Path(checkpoint_dir), None, quantize, precision, device,
                                             quantize_lm_head=quantize_lm_head, precision_why=precision_why)
    bank = AdapterBank(model, precision, quantize)
    for adapter_name, path in adapters.items():
        bank.add(adapter_name, Adapter.load(path, model.config, mmap=True))
        held = bank.adapters[adapter_name]
        how = (f", its --lora_init {held.train['converted_from']} as a rank-{held.config.r} LoRA over the base"
               if held.train.get("converted_from") else "")
        say(f"Adapter {adapter_name}: {path} ({bank.lora_bytes(adapter_name) / 2**20:.1f} MiB, unmerged{how})")
    worker = Worker(bank, tokenizer, device, precision, max_concurrent=max_concurrent, timeout_s=timeout_s,
                    kv_cache_gb=kv_cache_gb, max_batch=max_batch)
    pool = worker.engine.pool
    say(f"KV cache: {worker.engine.kv_bytes / 2**30:.2f} GiB, {pool.blocks * pool.block_size} tokens shared by up to "
        f"{max_batch} sequences")
    app = create_app(Server(worker, name, api_key=api_key, default_max_tokens=max_tokens))
    say(f"Serving {', '.join([name, *adapters])} on http://{host}:{port}/v1")
    serve(app, host, port, grace_s=grace_s)


if __name__ == "__main__":
    sys.argv = repeatable(sys.argv, "--lora_path")
    run_cli(main)
