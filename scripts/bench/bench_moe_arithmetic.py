"""How fast a QLoRA training step of a mixture of experts can be on this CPU at all (prints figures; not a test): the
arithmetic of one step of scripts/bench/bench_moe.py's shape, counted by torch's FlopCounterMode on transformers' own
Qwen3-MoE (forward and the input gradients a LoRA on attention needs; the expert weights frozen), against the fp32
matmul throughput this machine reaches on the shapes that step multiplies.

    python scripts/bench/bench_moe_arithmetic.py                   # issue 34's shape: 16 layers, 64 experts, 8 active
    python scripts/bench/bench_moe_arithmetic.py --tokens_per_s 135.1 98.2

The count is of matmuls (aten.mm); transformers' default experts implementation (grouped_mm) is not counted by
FlopCounterMode, so the count runs its eager one (F.linear per expert: the same products). It is taken on 1 and 2
layers and extended to --layers (the layers are alike). For each --tokens_per_s it prints the arithmetic rate that
speed needs: a rate above the best measured matmul throughput cannot be reached by any implementation in fp32.
"""
from __future__ import annotations

import argparse
import time

import torch


def step_flops(a: argparse.Namespace, layers: int) -> int:
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    config = transformers.Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
        moe_intermediate_size=a.hidden * 3 // 8,
        num_experts=a.experts, num_experts_per_tok=a.active, norm_topk_prob=True, num_hidden_layers=layers,
        num_attention_heads=a.hidden // 64, num_key_value_heads=a.hidden // 256, head_dim=64,
        max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, experts_implementation="eager")
    model.requires_grad_(False)
    ids = torch.randint(0, a.vocab, (a.batch, a.length), generator=torch.Generator().manual_seed(1))
    emb = model.get_input_embeddings()(ids).requires_grad_()  # input gradients through every block, as a LoRA needs
    with FlopCounterMode(display=False) as counter:
        model(inputs_embeds=emb, labels=ids).loss.backward()
    return counter.get_total_flops()


def matmul_rate(m: int, k: int, n: int, seconds: float = 2.0) -> float:
    """GFLOP/s of an fp32 [m, k] @ [k, n] product on torch's threads, the best of a few seconds' repetitions."""
    x, w = torch.randn(m, k), torch.randn(k, n)
    for _ in range(3):
        x @ w
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        x @ w
        best = min(best, time.perf_counter() - t)
    return 2 * m * k * n / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 16), ("experts", 64), ("active", 8), ("hidden", 1024), ("vocab", 4096),
                          ("batch", 4), ("length", 256)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--tokens_per_s", type=float, nargs="*", default=[135.1, 270.2, 98.2],
                   help="speeds to check (default: transformers measured, twice that, ours measured)")
    a = p.parse_args()
    one, two = step_flops(a, 1), step_flops(a, 2)
    total = (2 * one - two) + a.layers * (two - one)
    tokens = a.batch * a.length
    print(f"matmul arithmetic of one step ({a.batch} x {a.length} tokens, {a.layers} layers): "
          f"{total / 1e12:.3f} TFLOP, {total / tokens / 1e9:.3f} GFLOP per token")
    inner = a.hidden * 3 // 8
    shapes = {f"expert gate/up {a.batch * a.length * a.active // a.experts}x{a.hidden} @ {a.hidden}x{inner}":
              (a.batch * a.length * a.active // a.experts, a.hidden, inner),
              f"expert down {a.batch * a.length * a.active // a.experts}x{inner} @ {inner}x{a.hidden}":
              (a.batch * a.length * a.active // a.experts, inner, a.hidden),
              f"attention {tokens}x{a.hidden} @ {a.hidden}x{a.hidden}": (tokens, a.hidden, a.hidden),
              "square 2048": (2048, 2048, 2048)}
    rates = {name: matmul_rate(*shape) for name, shape in shapes.items()}
    for name, rate in rates.items():
        print(f"fp32 matmul {name}: {rate:.1f} GFLOP/s ({torch.get_num_threads()} threads)")
    peak = max(rates.values())
    for speed in a.tokens_per_s:
        need = total / tokens * speed / 1e9
        verdict = "above every measured matmul rate: not reachable" if need > peak else f"{need / peak:.0%} of the best"
        print(f"{speed:g} tokens/s needs {need:.0f} GFLOP/s of matmuls ({verdict})")


if __name__ == "__main__":
    main()
