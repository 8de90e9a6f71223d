"""The evidence behind `--precision auto` on this CPU: its flags, what auto picks, and how fast fp32 and bf16 matmuls
run here (a training step's work is mostly matmuls, so their ratio is about the ratio of step times).

    python scripts/bench/bench_precision.py            # the shapes of a 135M model's MLP and attention, micro batch 4

Each figure is the median of --repeats timed calls after a warm-up, forward (x @ W) and the two backward matmuls
(grad @ W^T for the input, x^T @ grad for a weight) counted separately, at torch's default number of threads.
"""
from __future__ import annotations

import statistics
import time

import torch

from lit_qlora.precision import cpu_flags, cpu_has_native_bf16, resolve_precision
from lit_qlora.utils import run_cli


def gflops(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / statistics.median(times) / 1e9


def main(tokens: int = 1024, shapes: str = "576x1536,1536x576,576x576", repeats: int = 20) -> None:
    """
    Args:
        tokens: rows of the activations (micro batch x sequence length)
        shapes: weight shapes in x out, comma-separated
        repeats: timed calls per figure (the median is reported)
    """
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    print(f"CPU flags: {', '.join(flags) or 'none of avx2/avx512f/avx512_bf16/amx'}; native bf16: "
          f"{cpu_has_native_bf16()}; threads: {torch.get_num_threads()}")
    print("--precision auto on this CPU: {} ({})".format(*resolve_precision("auto", "cpu")))
    print("| weight in x out | matmul | fp32 GFLOP/s | bf16 GFLOP/s | bf16 / fp32 |")
    print("|---|---|---|---|---|")
    for shape in shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        x, w, g = torch.randn(tokens, k), torch.randn(k, n), torch.randn(tokens, n)
        cases = {"forward x @ W": (x, w), "input grad g @ W^T": (g, w.t()), "weight grad x^T @ g": (x.t(), g)}
        for name, (a, b) in cases.items():
            f32 = gflops(a.contiguous(), b.contiguous(), repeats)
            b16 = gflops(a.contiguous().bfloat16(), b.contiguous().bfloat16(), repeats)
            print(f"| {k} x {n} | {name} | {f32:.1f} | {b16:.1f} | {b16 / f32:.2f}x |")


if __name__ == "__main__":
    run_cli(main)
