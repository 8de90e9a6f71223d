"""Benchmarks behind the 4-bit decode kernel (lit_qlora/quant/decode4bit.py); figures, not tests.

    python scripts/bench/bench_decode_kernel.py layers [--rows 1,16,32] [--threads 1] [--compiled true]
        [--shapes 4096x4096]
    python scripts/bench/bench_decode_kernel.py paired --folder CKPT [--precision 32-true] [--threads 1] [--rounds 3]
    python scripts/bench/bench_decode_kernel.py head --folder CKPT [--precision 32-true] [--threads 1] [--rounds 5]

layers: one 1536x576 and one 49152x576 layer (SmolLM2-135M's MLP and output layer; others with --shapes): dense
  fp32 and bf16 `nn.Linear`, bitsandbytes' `Linear4bit` (dequantize + matmul; on AVX512-BF16 CPUs also its
  repacked layout with its own gemv, "bnb packed") and the kernel, per quantization, per row count; optionally a
  torch.compile'd fused dequantize-and-multiply (the alternative that was measured and rejected). A layer timed
  over and over stays in the CPU's cache: these are compute figures; decoding a model reads its weights from
  memory (tutorials/quantize.md).
  With one thread the time is the thread's CPU time, so other processes on a shared machine count less.
paired: decode tokens/s of one checkpoint (ours, e.g. written by bench_generate.py; transformers' nf4 from its
  `hf/` subfolder when present) in one process, the settings alternating round by round: dense, nf4 on the
  kernel, nf4 without it, transformers' nf4. Ratios measured this way survive a machine whose load changes.
head: a tied model with its output layer in 4-bit on the kernel against the output layer shared with the dense
  embedding (`quantize_lm_head=False`), paired the same way.
"""
from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from lit_qlora.utils import run_cli


def timer(threads: int):
    """The thread's CPU time with one thread (what other processes take does not count), else wall time."""
    return time.thread_time if threads == 1 else time.perf_counter


def median_us(fn, clock, rounds: int = 7) -> float:
    """Median over `rounds` of the mean time of a batch of calls lasting ~0.1 s, in microseconds."""
    fn()
    fn()
    t0 = clock()
    fn()
    inner = max(3, int(0.1 / max(clock() - t0, 1e-6)))
    times = []
    for _ in range(rounds):
        t0 = clock()
        for _ in range(inner):
            fn()
        times.append((clock() - t0) / inner)
    return statistics.median(times) * 1e6


def fused_gemv(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Dequantize-and-multiply written in torch for torch.compile: packed [N, K/2], absmax [N, K/64], x [K]."""
    n = packed.shape[0]
    w = torch.stack((code[(packed >> 4).long()], code[(packed & 15).long()]), -1).reshape(n, -1, 64)
    return ((w * absmax[:, :, None]).reshape(n, -1) * x).sum(-1)


def layers(rows: str = "1", threads: int = 1, modes: str = "bnb.nf4,bnb.nf4-dq,bnb.fp4",
           compiled: bool = False, shapes: str = "1536x576,49152x576") -> None:
    """Time one layer per shape (`out x in`, comma-separated), dtype and row count (see the module docstring). On a
    CPU with AVX512-BF16 also bitsandbytes' own fast path ("bnb packed": its repacked layout and gemv kernel)."""
    from lit_qlora.quant import decode4bit as d
    from lit_qlora.quant.quantize import (
        enable_cpu_inference_packing,
        make_quantized_linear,
        quantize_into,
        quiet_bnb_import,
    )

    has_avx512bf16 = quiet_bnb_import().functional.has_avx512bf16

    torch.set_num_threads(threads)
    clock = timer(threads)
    lib = d.kernel()
    print(f"torch threads {torch.get_num_threads()}, clock {clock.__name__}, kernel {d.isa_name(lib) if lib else None}")
    compiled_fn = torch.compile(fused_gemv, dynamic=False) if compiled else None
    packed_too = has_avx512bf16()
    for out_f, in_f in [tuple(int(v) for v in shape.split("x")) for shape in shapes.split(",")]:
        w = 0.02 * torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(0))
        for dtype in (torch.float32, torch.bfloat16):
            dense = nn.Linear(in_f, out_f, bias=False, dtype=dtype)
            dense.weight.data.copy_(w)
            quantized = {}
            for mode in modes.split(","):
                q = make_quantized_linear(nn.Linear(in_f, out_f, bias=False, device="meta"), mode, dtype)
                quantize_into(q, w.to(dtype), torch.device("cpu"))
                packed = None
                if packed_too:  # a second copy, repacked by bitsandbytes at its first eval forward
                    packed = make_quantized_linear(nn.Linear(in_f, out_f, bias=False, device="meta"), mode, dtype)
                    quantize_into(packed, w.to(dtype), torch.device("cpu"))
                    packed = nn.Sequential(packed).eval()
                    enable_cpu_inference_packing(packed, True)
                quantized[mode] = (q.eval(), d._State(q, lib) if lib else None, packed)
            for r in (int(v) for v in rows.split(",")):
                x = torch.randn(1, r, in_f).to(dtype)
                with torch.inference_mode():
                    dense_us = median_us(lambda: dense(x), clock)
                    line = [f"{out_f}x{in_f} {str(dtype)[6:]:8} rows {r:3}: dense {dense_us:9.1f}"]
                    for mode, (q, state, packed) in quantized.items():
                        line.append(f"{mode}: bnb {median_us(lambda: q(x), clock):9.1f}")
                        if packed is not None:
                            line.append(f"bnb packed {median_us(lambda: packed(x), clock):8.1f}")
                        if state is not None:
                            line.append(f"kernel {median_us(lambda: d.run_kernel(lib, state, x, out_f), clock):8.1f}")
                    if compiled_fn is not None and r == 1 and dtype == torch.float32:
                        q = next(iter(quantized.values()))[0]
                        args = (q.weight.data.view(torch.uint8).reshape(out_f, -1),
                                d.block_scales(q).reshape(out_f, -1), q.weight.quant_state.code, x[0, 0])
                        line.append(f"torch.compile fused {median_us(lambda: compiled_fn(*args), clock):9.1f}")
                print("  ".join(line) + "  (us)", flush=True)


def _decode_tps(model, prompt: torch.Tensor, n: int) -> float:
    from lit_qlora.generation import generate

    stamps: list[float] = []
    generate(model, prompt, n, on_token=lambda _: stamps.append(time.perf_counter()))
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _hf_tps(model, prompt: torch.Tensor, n: int) -> float:
    import transformers

    stamps: list[float] = []

    class Stamp(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    with torch.inference_mode():
        model.generate(prompt[None], max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                       pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                       logits_processor=transformers.LogitsProcessorList([Stamp()]))
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _alternate(settings: dict, rounds: int) -> dict[str, float]:
    """Median tokens/s per setting over `rounds` rounds (after one warm-up round), settings alternating."""
    results: dict[str, list[float]] = {k: [] for k in settings}
    for i in range(rounds + 1):
        for name, fn in settings.items():
            v = fn()
            if i:
                results[name].append(v)
    return {k: statistics.median(v) for k, v in results.items()}


def paired(folder: str, precision: str = "32-true", threads: int = 1, rounds: int = 3, new_tokens: int = 32) -> None:
    """Dense, nf4 on the kernel, nf4 without it and transformers' nf4, alternating in one process."""
    from lit_qlora.loader import load_model
    from lit_qlora.quant import decode4bit as d

    torch.set_num_threads(threads)
    dense = load_model(Path(folder), precision=precision).eval()
    q = load_model(Path(folder), precision=precision, quantize="bnb.nf4").eval()
    prompt = torch.randint(0, dense.config.vocab_size, (16,), generator=torch.Generator().manual_seed(1))

    def kernel_on():
        d.enable_fast_decode(q)
        return _decode_tps(q, prompt, new_tokens)

    def kernel_off():
        d.disable_fast_decode(q)
        return _decode_tps(q, prompt, new_tokens)

    settings = {"dense": lambda: _decode_tps(dense, prompt, new_tokens), "nf4 kernel": kernel_on,
                "nf4 no kernel": kernel_off}
    if (Path(folder) / "hf" / "config.json").is_file():
        import transformers

        dtype = {"32-true": torch.float32, "bf16-true": torch.bfloat16}[precision]
        cfg = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                              bnb_4bit_compute_dtype=dtype)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(Path(folder) / "hf"), dtype=dtype, device_map="cpu",
                                                               quantization_config=cfg).eval()
        settings["transformers nf4"] = lambda: _hf_tps(hf, prompt, new_tokens)
    med = _alternate(settings, rounds)
    vs_hf = f", vs transformers {med['nf4 kernel'] / med['transformers nf4']:.2f}x" if "transformers nf4" in med else ""
    print(f"{precision}, {threads} thread(s), {rounds} rounds of {new_tokens} tokens: "
          + ", ".join(f"{k} {v:.1f}" for k, v in med.items()) + " tokens/s"
          + f" | kernel vs dense {med['nf4 kernel'] / med['dense']:.2f}x{vs_hf}")


def head(folder: str, precision: str = "32-true", threads: int = 1, rounds: int = 5, new_tokens: int = 32) -> None:
    """A tied model's output layer in 4-bit on the kernel against shared with the dense embedding, alternating."""
    from lit_qlora.inference import fast_cpu_4bit_decoding
    from lit_qlora.loader import load_model

    torch.set_num_threads(threads)
    models = {}
    for name, quantize_head in (("4-bit head", True), ("dense head", False)):
        models[name] = load_model(Path(folder), precision=precision, quantize="bnb.nf4",
                                  quantize_lm_head=quantize_head).eval()
        fast_cpu_4bit_decoding(models[name])
    if not models["dense head"].config.tie_embeddings:
        print("note: this model's head is not tied to its embedding")
    prompt = torch.randint(0, models["dense head"].config.vocab_size, (16,), generator=torch.Generator().manual_seed(1))
    med = _alternate({k: (lambda m=m: _decode_tps(m, prompt, new_tokens)) for k, m in models.items()}, rounds)
    print(f"{precision}, {threads} thread(s), {rounds} rounds: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
          + f" tokens/s | 4-bit head vs dense head {med['4-bit head'] / med['dense head']:.2f}x")


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    commands = {"layers": layers, "paired": paired, "head": head}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(commands)}}} [options]  (see the docstring)")
    name = sys.argv.pop(1)
    run_cli(commands[name])
