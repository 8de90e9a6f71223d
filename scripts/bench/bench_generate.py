"""Benchmark: batch-1 decoding speed, prefill time and peak memory of generation, dense vs 4-bit (prints figures;
not a test).

    python scripts/bench/bench_generate.py --model SmolLM2-135M --precision 32-true,bf16-true   # the 135M shape, tied
    python scripts/bench/bench_generate.py                         # ~150M-parameter Llama-shaped model (untied head)
    python scripts/bench/bench_generate.py --settings none,bnb.nf4,bnb.nf4:nokernel,hf.nf4 --new_tokens 64
    python scripts/bench/bench_generate.py table runs.jsonl      # the table (medians) of runs written with --json_out

A random-weight checkpoint (bf16 on disk) is written once, then each setting runs in its own process so that its
peak RSS is its own (VmHWM: the child's high-water mark, which, unlike ru_maxrss, does not inherit this parent's),
read after loading and generating, before the prefill timing (--json_out also records the peak after it).
Settings:
  none                  dense weights
  bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq, bnb.int8
                        our model loaded as generate/*.py loads it with --quantize_lm_head true: 4-bit layers
                        on the decode kernel of lit_qlora/quant/decode4bit.py (`inference.fast_cpu_4bit_decoding`);
                        the output layer 4-bit, for a tied model the embedding read from it (TiedEmbedding4bit)
  <mode>:nokernel       the same without the kernel, and with a dense embedding: bitsandbytes dequantizes every
                        weight per call (its packed layout where the CPU has AVX512-BF16): generation before both
  <mode>:densehead      the output layer is not quantized (for a tied model: shared with the dense embedding)
  <mode>:stored         as <mode>, loading the quantized weights scripts/quantize_checkpoint.py stores (run
                        first for each mode and precision: a no-op once stored); the other settings quantize
  <mode>:lora           as <mode>, with an adapter on every target (r 8, random, written once next to the
                        checkpoint) kept as separate LoRA layers (generate/lora.py --merge false); none:lora too
  <mode>:lora-merged    the same adapter merged while loading (generate/lora.py's default)
  hf.nf4, hf.nf4-dq     Hugging Face transformers + bitsandbytes (`BitsAndBytesConfig`), from the same weights
                        exported to a transformers folder; transformers keeps its output layer dense
Decode tokens/s counts the new tokens after the first (the prefill's): (n - 1) / (time of the last - time of the
first). Prefill is the median of 3 forwards over a `prefill_len`-token prompt with the KV cache, the output layer on
its last position only, as generation runs it (transformers: logits_to_keep=1, as its generate passes).
"runtime GB" is the child's resident memory after its imports (python, torch, bitsandbytes, ours or transformers),
before any weight: the part of the peak no choice of weights changes, which dominates below ~300M parameters.
"above runtime vs dense" compares peak minus runtime: what the model itself costs to load and generate with.
"load s" is the time `load_model` (or from_pretrained) takes: for 4-bit settings mostly quantizing on the CPU.
"""
from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lit_qlora.checkpoint import LIT_WEIGHTS, lit_param_shapes
from lit_qlora.config import Config
from lit_qlora.convert import write_random_checkpoint
from lit_qlora.utils import run_cli

BENCH_ADAPTER = "bench_adapter.pth"  # the :lora settings' adapter, next to the checkpoint
SETTINGS = ["none", "bnb.nf4", "bnb.nf4-dq", "bnb.nf4:nokernel", "hf.nf4"]


def vm_hwm_gb() -> float:
    """Peak resident memory of this process (its own, from exec on), GiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20


def vm_rss_gb() -> float:
    """Resident memory of this process now, GiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 2**20


def cpu_description() -> str:
    """The CPU model and the flags that decide the 4-bit paths (AVX2, AVX512F, AVX512-BF16, AMX)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("", platform.machine()):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    return f"{name}; {torch.get_num_threads()} threads; " + ", ".join(
        f"{f} {'yes' if f in flags else 'no'}" for f in wanted)


def timed_prefill(forward, set_cache, clear_cache, prompt: torch.Tensor) -> float:
    """Median seconds of 3 prefill forwards of `prompt` (the KV cache set up before each, outside the timing)."""
    times = []
    for _ in range(3):
        set_cache()
        t0 = time.perf_counter()
        forward(prompt)
        times.append(time.perf_counter() - t0)
        clear_cache()
    return statistics.median(times)


def child_ours(folder: str, setting: str, precision: str, new_tokens: int, prompt_len: int, prefill_len: int) -> dict:
    from lit_qlora.adapter import Adapter
    from lit_qlora.generation import generate
    from lit_qlora.inference import fast_cpu_4bit_decoding
    from lit_qlora.loader import load_model, load_model_with_adapter
    from lit_qlora.precision import autocast_for

    runtime = vm_rss_gb()  # python, torch, bitsandbytes and our modules: paid before any weight
    quantize, _, flag = setting.partition(":")
    quantize = None if quantize == "none" else quantize
    t0 = time.perf_counter()
    if flag == "lora":  # as generate/lora.py --merge false loads it
        model = load_model_with_adapter(Path(folder), Adapter.load(Path(folder) / BENCH_ADAPTER), precision=precision,
                                        quantize=quantize, quantize_lm_head=True, use_stored=False).eval()
    else:
        model = load_model(Path(folder), precision=precision, quantize=quantize, quantize_lm_head=flag != "densehead",
                           embedding_from_head=flag != "nokernel",  # as generate/*.py load (but "before")
                           use_stored=flag == "stored",
                           merge_adapter=Adapter.load(Path(folder) / BENCH_ADAPTER) if flag == "lora-merged" else None
                           ).eval()
    load_s = time.perf_counter() - t0
    if (flag == "stored") != (getattr(model, "stored_quantization", None) is not None):
        raise RuntimeError(f"{setting}: the stored quantization was {'not ' if flag == 'stored' else ''}used")
    on_kernel = fast_cpu_4bit_decoding(model) if quantize and flag != "nokernel" else 0
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(1))
    long_prompt = torch.randint(0, vocab, (prefill_len,), generator=torch.Generator().manual_seed(2))
    stamps: list[float] = []
    with autocast_for(precision, torch.device("cpu")):
        generate(model, prompt, 8)  # warm-up
        out = generate(model, prompt, new_tokens, on_token=lambda _: stamps.append(time.perf_counter()))
        peak = vm_hwm_gb()  # generation's peak: before the long prefills below
        with torch.inference_mode():
            prefill_s = timed_prefill(lambda p: model(p[None], input_pos=torch.arange(len(p)),
                                                      output_mask=torch.arange(len(p))[None] == len(p) - 1),
                                      lambda: model.set_kv_cache(1, prefill_len + 1), model.clear_kv_cache,
                                      long_prompt)
    n = len(out) - prompt_len
    return dict(tokens_per_sec=(n - 1) / (stamps[-1] - stamps[0]), new_tokens=n, prefill_s=prefill_s, load_s=load_s,
                layers_on_kernel=on_kernel, peak_rss_gb=peak, peak_rss_after_prefill_gb=vm_hwm_gb(),
                runtime_rss_gb=runtime)


def child_hf(folder: str, setting: str, precision: str, new_tokens: int, prompt_len: int, prefill_len: int) -> dict:
    """transformers' model from the exported folder, 4-bit by its bitsandbytes integration."""
    import bitsandbytes  # noqa: F401  (transformers imports it while loading: part of its runtime)
    import transformers

    runtime = vm_rss_gb()
    dtype = {"32-true": torch.float32, "bf16-true": torch.bfloat16}[precision]
    mode = setting.split(".", 1)[1]
    bnb_config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=mode.split("-")[0],
                                                 bnb_4bit_use_double_quant=mode.endswith("-dq"),
                                                 bnb_4bit_compute_dtype=dtype)
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(Path(folder) / "hf"), quantization_config=bnb_config,
                                                              dtype=dtype, device_map="cpu").eval()
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    long_prompt = torch.randint(0, vocab, (1, prefill_len), generator=torch.Generator().manual_seed(2))
    stamps: list[float] = []

    class Stamp(transformers.LogitsProcessor):  # called once per new token, right after its forward
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=8, min_new_tokens=8, **kw)  # warm-up
        stamps.clear()
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             logits_processor=transformers.LogitsProcessorList([Stamp()]), **kw)
        peak = vm_hwm_gb()
        prefill_s = timed_prefill(lambda p: model(p, use_cache=True, logits_to_keep=1), lambda: None, lambda: None,
                                  long_prompt)
    n = out.shape[1] - prompt_len
    return dict(tokens_per_sec=(n - 1) / (stamps[-1] - stamps[0]), new_tokens=n, prefill_s=prefill_s, load_s=load_s,
                layers_on_kernel=0, peak_rss_gb=peak, peak_rss_after_prefill_gb=vm_hwm_gb(), runtime_rss_gb=runtime)


def write_bench_adapter(folder: Path) -> None:
    """An adapter on every target of the checkpoint's model (r 8, alpha 16), A as initialized and B random (it
    starts at zero), for the :lora settings."""
    from lit_qlora.adapter import Adapter
    from lit_qlora.loader import load_model
    from lit_qlora.lora import LoRAConfig, lora_modules

    lora = LoRAConfig(r=8, alpha=16, dropout=0.0, query=True, key=True, value=True, projection=True, mlp=True)
    model = load_model(folder, precision="32-true", lora=lora, seed=1)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.copy_(0.02 * torch.randn(m.lora_B.shape, generator=g))
    Adapter.of_model(model, lora).save(folder / BENCH_ADAPTER)


def child(folder: str, setting: str, precision: str, new_tokens: int, prompt_len: int, prefill_len: int,
          threads: int) -> None:
    """One setting in this fresh process; prints one JSON line."""
    if threads:
        torch.set_num_threads(threads)
    fn = child_hf if setting.startswith("hf.") else child_ours
    r = fn(folder, setting, precision, new_tokens, prompt_len, prefill_len)
    print(json.dumps(dict(r, setting=setting, precision=precision, threads=torch.get_num_threads())))


def hf_available() -> bool:
    try:
        from lit_qlora.quant.quantize import load_bnb

        load_bnb()  # its import-time notes silenced
        import transformers  # noqa: F401
    except Exception:
        return False
    return True


def bench_config(model: str, n_layer: int, n_embd: int, n_head: int, n_query_groups: int, intermediate_size: int,
                 vocab_size: int) -> Config:
    if model:
        return Config.from_name(model)
    return Config(name="bench-llama", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_query_groups=n_query_groups,
                  intermediate_size=intermediate_size, vocab_size=vocab_size, block_size=1024)


def main(model: str = "", n_layer: int = 12, n_embd: int = 768, n_head: int = 12, n_query_groups: int = 4,
         intermediate_size: int = 2048, vocab_size: int = 32000, new_tokens: int = 64, prompt_len: int = 16,
         prefill_len: int = 128, precision: str = "bf16-true", settings: str = ",".join(SETTINGS),
         out_dir: str = "", repeat: int = 1, json_out: str = "", threads: int = 0) -> None:
    """Write the model (`model`: a named config such as SmolLM2-135M, else the dimensions given), then measure each
    setting x precision in a fresh process, `repeat` times (the table shows the median of each figure), with
    `threads` torch threads (0: torch's default, one per core)."""
    config = bench_config(model, n_layer, n_embd, n_head, n_query_groups, intermediate_size, vocab_size)
    folder = Path(out_dir or tempfile.mkdtemp(prefix="bench-generate-"))
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / LIT_WEIGHTS).is_file():
        write_random_checkpoint(folder, config)
    wanted = settings.split(",")
    if any(s.startswith("hf.") for s in wanted):
        if not hf_available():
            print("transformers or bitsandbytes is not importable: skipping the hf.* settings")
            wanted = [s for s in wanted if not s.startswith("hf.")]
        elif not (folder / "hf" / "config.json").is_file():
            from lit_qlora.convert import convert_lit_checkpoint

            convert_lit_checkpoint(folder, folder / "hf")
    if any(s.partition(":")[2] in ("lora", "lora-merged") for s in wanted) and not (folder / BENCH_ADAPTER).is_file():
        write_bench_adapter(folder)
    for prec in precision.split(","):  # what the :stored settings load
        for mode in dict.fromkeys(s.partition(":")[0] for s in wanted if s.endswith(":stored")):
            subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "quantize_checkpoint.py"),
                            "--checkpoint_dir", str(folder), "--quantize", mode, "--precision", prec], check=True)
    params = sum(s.numel() for s in lit_param_shapes(config).values())
    print(f"model: {config.name}, {params / 1e6:.0f}M parameters ({config.n_layer} layers, n_embd {config.n_embd}, "
          f"vocab {config.vocab_size}, {'tied' if config.tie_embeddings else 'untied'} head), bf16 on disk; batch 1, "
          f"prompt {prompt_len} tokens, {new_tokens} new tokens (greedy), prefill {prefill_len} tokens\n"
          f"CPU: {cpu_description()}")
    rows = []
    for _ in range(repeat):
        for prec in precision.split(","):
            for setting in wanted:
                r = subprocess.run([sys.executable, __file__, "child", str(folder), setting, prec, str(new_tokens),
                                    str(prompt_len), str(prefill_len), str(threads)], capture_output=True, text=True)
                lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
                if r.returncode or not lines:
                    print(f"{setting} {prec}: FAILED\n{r.stderr[-2000:]}")
                    continue
                rows.append(json.loads(lines[-1]))
                rows[-1].update(model=config.name, cpu=cpu_description())
                if json_out:
                    with open(json_out, "a") as f:
                        f.write(json.dumps(rows[-1]) + "\n")
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    """Medians per (model, precision, setting), relative to dense and to transformers' nf4 of the same precision."""
    def med(key: str, **match) -> float | None:
        vals = [r[key] for r in rows if key in r and all(r.get(k) == v for k, v in match.items())]
        return statistics.median(vals) if vals else None

    def rel(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a and b else "-"

    def fmt(x: float | None) -> str:
        return f"{x:.2f}" if x is not None else "-"

    for r in rows:  # the model's own memory: peak less what the imports alone hold (rows of older runs lack it)
        if "runtime_rss_gb" in r:
            r["above_runtime_gb"] = r["peak_rss_gb"] - r["runtime_rss_gb"]

    print("\n| model | threads | precision | setting | runs | decode tokens/s | vs dense | vs hf.nf4 | prefill ms | "
          "peak RSS GB | vs dense | runtime GB | above runtime vs dense | load s |\n" + "|---" * 14 + "|")
    keys = list(dict.fromkeys((r.get("model", "-"), r.get("threads"), r["precision"], r["setting"]) for r in rows))
    for model, threads, prec in dict.fromkeys((m, t, p) for m, t, p, _ in keys):
        base = dict(model=model, threads=threads, precision=prec)
        dense_tps, dense_rss = med("tokens_per_sec", **base, setting="none"), med("peak_rss_gb", **base, setting="none")
        dense_above = med("above_runtime_gb", **base, setting="none")
        hf_tps = med("tokens_per_sec", **base, setting="hf.nf4")
        for m, t, p, s in keys:
            if (m, t, p) != (model, threads, prec):
                continue
            tps, rss = med("tokens_per_sec", **base, setting=s), med("peak_rss_gb", **base, setting=s)
            runs = sum(all(r.get(k) == v for k, v in dict(base, setting=s).items()) for r in rows)
            name = "dense" if s == "none" else s
            print(f"| {model} | {threads} | {prec} | {name} | {runs} | {tps:.1f} | {rel(tps, dense_tps)} | "
                  f"{rel(tps, hf_tps)} | {1000 * med('prefill_s', **base, setting=s):.0f} | {rss:.2f} | "
                  f"{rel(rss, dense_rss)} | {fmt(med('runtime_rss_gb', **base, setting=s))} | "
                  f"{rel(med('above_runtime_gb', **base, setting=s), dense_above)} | "
                  f"{fmt(med('load_s', **base, setting=s))} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]),
              int(sys.argv[8]))
    elif len(sys.argv) > 2 and sys.argv[1] == "table":  # medians of earlier --json_out files
        print_table([json.loads(ln) for path in sys.argv[2:] for ln in Path(path).read_text().splitlines() if ln])
    else:
        run_cli(main)
