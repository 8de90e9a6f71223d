"""Benchmark the batched engine in one process (prints figures; not a test): generated tokens/s with B sequences
decoded together, next to transformers' own batched `generate` and continuous-batching `generate_batch` on the same
prompts, and what mixing two adapters in every batch costs.

    python scripts/bench/bench_engine.py                       # SmolLM2-135M's shape, nf4 and dense, 1 and 2 threads
    python scripts/bench/bench_engine.py --model gemma-3-270m --batches 1,16
    python scripts/bench/bench_engine.py --modes ours,mixed --settings bnb.nf4 --threads 2

A random-weight checkpoint of the model's shape is written once (bf16; the tutorials' figures say which), and each
(mode, setting, threads, B) runs in a fresh process so that its peak RSS is its own. B prompts of `prompt_len` random
ids, each continued greedily by `new_tokens` ids (no stop: every sequence runs to its length). Modes:
  ours       the engine (lit_qlora.engine), model loaded as generate/*.py loads it (4-bit layers on the decode kernel)
  mixed      the same with two adapters (r 8, every target, random) over the base, rows alternating between them
  hf         transformers' generate on the batch (left padding), the same weights (BitsAndBytesConfig for 4-bit)
  hf-cb      transformers' generate_batch (its continuous batching) on the same prompts
tokens/s: B x new_tokens over the wall time from the first submit to the last token (prefill included), after a
warm-up run; "decode": the tokens after each sequence's first over the time of the decoding steps only (ours).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from bench_generate import cpu_description, vm_hwm_gb, vm_rss_gb  # noqa: E402
from bench_serve import write_adapters, write_tokenizer  # noqa: E402

from lit_qlora.checkpoint import LIT_WEIGHTS  # noqa: E402
from lit_qlora.config import Config  # noqa: E402
from lit_qlora.convert import write_random_checkpoint  # noqa: E402
from lit_qlora.utils import run_cli  # noqa: E402


def prompts_for(vocab: int, batch: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(16, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def child_ours(folder: Path, setting: str, precision: str, batch: int, new_tokens: int, prompt_len: int,
               mixed: bool) -> dict:
    from lit_qlora.adapter import Adapter
    from lit_qlora.engine import Engine, Sampling
    from lit_qlora.engine.adapters import AdapterBank
    from lit_qlora.inference import load_for_inference

    quantize = None if setting == "none" else setting
    runtime = vm_rss_gb()
    model, _, _ = load_for_inference(folder, None, quantize, precision, torch.device("cpu"))
    bank, names = None, [None] * batch
    if mixed:
        bank = AdapterBank(model, precision, quantize)
        for i, path in enumerate(write_adapters(folder, 2)):
            bank.add(f"a{i}", Adapter.load(path, model.config))
        names = [f"a{i % 2}" for i in range(batch)]
    loaded = vm_rss_gb()

    def run(n_new: int) -> tuple[float, float, int]:
        engine = Engine(model, bank=bank, max_batch=batch, precision=precision,
                        kv_cache_tokens=batch * (prompt_len + n_new + 16))
        t0 = time.perf_counter()
        for p, name in zip(prompts_for(model.config.vocab_size, batch, prompt_len), names):
            engine.submit(p, Sampling(max_new_tokens=n_new), name)
        while not engine.running or engine.prefilling or engine.waiting:
            engine.step()
        t1, d0 = time.perf_counter(), engine.stats["decode_tokens"]
        engine.run()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1, engine.stats["decode_tokens"] - d0

    run(4)  # warm-up: the kernel, the shapes
    total, decode, decoded = run(new_tokens)
    return dict(tokens_per_s=batch * new_tokens / total, decode_tokens_per_s=decoded / decode, peak_rss_gb=vm_hwm_gb(),
                loaded_rss_gb=loaded, runtime_rss_gb=runtime)


def child_hf(folder: Path, setting: str, precision: str, batch: int, new_tokens: int, prompt_len: int,
             continuous: bool) -> dict:
    import transformers

    dtype = torch.float32 if precision == "32-true" else torch.bfloat16
    kw = dict(dtype=dtype, device_map="cpu")
    if setting != "none":
        kw["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=setting.split(".")[1].split("-")[0],
            bnb_4bit_use_double_quant=setting.endswith("-dq"), bnb_4bit_compute_dtype=dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder / "hf"), **kw).eval()
    prompts = prompts_for(model.config.vocab_size, batch, prompt_len)

    def run(n_new: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            if continuous:
                config = transformers.GenerationConfig(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                                       eos_token_id=None, pad_token_id=0)
                # its cache sized as ours is (left alone it takes a share of the machine's memory: 13 GB here)
                pages = (batch * (prompt_len + n_new + 256) + 255) // 256
                cb = transformers.generation.configuration_utils.ContinuousBatchingConfig(
                    num_blocks=pages, max_batch_tokens=256, max_requests_per_batch=batch)
                model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=cb,
                                     progress_bar=False)
            else:
                ids = torch.tensor(prompts)
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                               min_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - t0

    run(4)
    return dict(tokens_per_s=batch * new_tokens / run(new_tokens), peak_rss_gb=vm_hwm_gb())


def child(folder: str, mode: str, setting: str, precision: str, threads: int, batch: int, new_tokens: int,
          prompt_len: int) -> None:
    torch.set_num_threads(threads)
    folder = Path(folder)
    if mode in ("ours", "mixed"):
        r = child_ours(folder, setting, precision, batch, new_tokens, prompt_len, mode == "mixed")
    else:
        r = child_hf(folder, setting, precision, batch, new_tokens, prompt_len, mode == "hf-cb")
    print(json.dumps(dict(r, mode=mode, setting=setting, precision=precision, threads=threads, batch=batch)))


def main(model: str = "SmolLM2-135M", settings: str = "bnb.nf4,none", precision: str = "auto",
         modes: str = "ours,mixed,hf,hf-cb", threads: str = "1,2", batches: str = "1,4,16,32", new_tokens: int = 64,
         prompt_len: int = 32, out_dir: str = "", json_out: str = "") -> None:
    """Write the checkpoint (once, in `out_dir`), then measure every combination in its own process."""
    from lit_qlora.precision import resolve_precision

    config = Config.from_name(model)
    folder = Path(out_dir or Path(tempfile.gettempdir()) / f"bench-engine-{model}")
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / LIT_WEIGHTS).is_file():
        write_random_checkpoint(folder, config)
    if not (folder / "tokenizer.json").is_file():
        write_tokenizer(folder, config.vocab_size)
    wanted = modes.split(",")
    if any(m.startswith("hf") for m in wanted) and not (folder / "hf" / "config.json").is_file():
        from lit_qlora.convert import convert_lit_checkpoint

        convert_lit_checkpoint(folder, folder / "hf")
    precision, _ = resolve_precision(precision, "cpu")
    print(f"model: {config.name} shape, random weights; {precision}; prompts of {prompt_len} ids, {new_tokens} new "
          f"ids each (greedy, no stop)\nCPU: {cpu_description()}")
    if "mixed" in wanted:
        write_adapters(folder, 2)  # here, once: a child's peak RSS is its generation's, not the adapters' writing
    rows = []
    for mode in wanted:
        for setting in settings.split(","):
            for n_threads in (int(t) for t in threads.split(",")):
                for batch in (int(b) for b in batches.split(",")):
                    if mode == "mixed" and batch < 2:
                        continue
                    r = subprocess.run([sys.executable, __file__, "child", str(folder), mode, setting, precision,
                                        str(n_threads), str(batch), str(new_tokens), str(prompt_len)],
                                       capture_output=True, text=True)
                    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
                    if r.returncode or not lines:
                        print(f"{mode} {setting} {n_threads}t B={batch}: FAILED: {r.stderr.strip()[-600:]}")
                        continue
                    rows.append(json.loads(lines[-1]))
                    print(json.dumps(rows[-1]), flush=True)
                    if json_out:
                        with open(json_out, "a") as f:
                            f.write(json.dumps(dict(rows[-1], model=config.name, cpu=cpu_description())) + "\n")
    print_table(rows, batches)


def print_table(rows: list[dict], batches: str) -> None:
    bs = [int(b) for b in batches.split(",")]
    print("\n| mode | setting | threads | " + " | ".join(f"B={b} tokens/s" for b in bs)
          + f" | B={bs[-1]} / B={bs[0]} | peak RSS GB at B={bs[0]} / {bs[-1]} |")
    print("|---|---|---|" + "---|" * (len(bs) + 2))
    keys = dict.fromkeys((r["mode"], r["setting"], r["threads"]) for r in rows)
    for mode, setting, threads in keys:
        got = {r["batch"]: r for r in rows if (r["mode"], r["setting"], r["threads"]) == (mode, setting, threads)}
        rate = [f"{got[b]['tokens_per_s']:.1f}" if b in got else "-" for b in bs]
        ratio = (f"{got[bs[-1]]['tokens_per_s'] / got[bs[0]]['tokens_per_s']:.2f}x"
                 if bs[0] in got and bs[-1] in got else "-")
        mem = " / ".join(f"{got[b]['peak_rss_gb']:.2f}" if b in got else "-" for b in (bs[0], bs[-1]))
        print(f"| {mode} | {setting} | {threads} | " + " | ".join(rate) + f" | {ratio} | {mem} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]), int(sys.argv[7]),
              int(sys.argv[8]), int(sys.argv[9]))
    else:
        run_cli(main)
