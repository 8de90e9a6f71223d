"""LoRA on the experts of a mixture of experts, one low-rank pair per expert against one pair shared by all the
experts of a projection (prints figures; not a test): on a random-weight Qwen3-MoE shape, 4-bit experts, each variant
in its own fresh process trains on the same batches of a learnable synthetic language (a sparse random Markov chain
over the vocabulary) and reports the training loss of its last iterations, the loss on held-out batches, the median
step time, the peak RSS and its trainable parameters; then the trainable parameters and their training state (fp32
weights, gradients and AdamW's two moments: 16 bytes each) of each variant on the real Qwen3-30B-A3B and Mixtral
8x7B shapes, computed from their published configs.

    python scripts/bench/bench_moe_lora.py       # 4 layers, 16 experts, 4 active, hidden 256, 60 iterations of 4 x 128
    python scripts/bench/bench_moe_lora.py --layers 8 --experts 32 --active 4 --hidden 512 --iters 200   # longer

Variants (all with LoRA r 8 on q and v): attention only; + experts, a pair per expert (what --lora_experts trains);
+ experts, one pair shared by every expert of a projection (the alternative, built here on the same code path: the
shared pair runs on each expert's rows, so its step does the same work); the same with rank 8 x experts (as many
trainable parameters as a pair per expert, the same scaling alpha / r = 2); + experts per expert + router.
`--variants a,b` runs only those.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = ("attention", "experts", "shared", "shared-wide", "experts+router")


def make_folder(folder: Path, a: argparse.Namespace) -> None:
    import transformers

    cfg = transformers.Qwen3MoeConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                                      moe_intermediate_size=a.hidden // 2, num_experts=a.experts,
                                      num_experts_per_tok=a.active, norm_topk_prob=True, num_hidden_layers=a.layers,
                                      num_attention_heads=max(1, a.hidden // 64),
                                      num_key_value_heads=max(1, a.hidden // 256), head_dim=64,
                                      max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(folder)


def batches(a: argparse.Namespace, seed: int):
    """Endless [batch, length] token rows of a fixed sparse Markov chain: each token is followed by one of 4 tokens
    (probabilities 0.55 / 0.25 / 0.15 / 0.05), a table drawn once from seed 0 (its entropy bounds the loss)."""
    g = torch.Generator().manual_seed(0)
    nxt = torch.randint(0, a.vocab, (a.vocab, 4), generator=g)
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
    g = torch.Generator().manual_seed(seed)
    while True:
        rows = torch.empty(a.batch, a.length, dtype=torch.long)
        rows[:, 0] = torch.randint(0, a.vocab, (a.batch,), generator=g)
        for t in range(1, a.length):
            pick = torch.multinomial(probs, a.batch, replacement=True, generator=g)
            rows[:, t] = nxt[rows[:, t - 1], pick]
        yield rows


def share_expert_pairs(model: torch.nn.Module, rank: int = 0) -> None:
    """Every LoRAExperts keeps one pair that every expert uses: its expert 0's initial A (B = 0), or with `rank` a
    fresh pair of that rank (A kaiming-uniform as every LoRA A) at the same scaling."""
    import types

    from lit_qlora.lora import LoRAExperts, init_lora_

    def per_expert(self):
        A, B = self.lora_A[0], self.lora_B[0] * self.scaling

        def run(x: torch.Tensor, e: int, bias: bool = True) -> torch.Tensor:
            return torch.addmm(self.base(x, e, bias=bias), x @ A.T, B.T)
        return run

    for m in model.modules():
        if isinstance(m, LoRAExperts):
            A, B = m.lora_A.data[:1].clone(), m.lora_B.data[:1].clone()
            if rank:
                A, B = A.new_empty(1, rank, m.in_features), B.new_empty(1, m.out_features, rank)
                init_lora_(A[0], B[0], 1, rank)
            m.lora_A, m.lora_B = torch.nn.Parameter(A), torch.nn.Parameter(B)
            m.per_expert = types.MethodType(per_expert, m)


def child(variant: str, folder: Path, a: argparse.Namespace) -> None:
    from lit_qlora.loader import load_model
    from lit_qlora.lora import LoRAConfig

    experts = variant != "attention"
    lora = LoRAConfig(r=8, alpha=16, dropout=0.0, query=True, value=True, experts=experts,
                      router=variant == "experts+router")
    model = load_model(folder, precision="32-true", quantize=a.quantize, lora=lora, seed=0)
    if variant.startswith("shared"):
        share_expert_pairs(model, 8 * a.experts if variant == "shared-wide" else 0)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr)
    data, losses, times = batches(a, seed=1), [], []
    for _ in range(a.iters):
        idx = next(data)
        t0 = time.perf_counter()
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    model.eval()
    held_out = batches(a, seed=2)
    with torch.no_grad():
        val = statistics.mean(torch.nn.functional.cross_entropy(model(idx[:, :-1]).flatten(0, 1),
                                                                idx[:, 1:].flatten()).item()
                              for idx in (next(held_out) for _ in range(4)))
    tail = max(1, a.iters // 10)
    print(json.dumps(dict(variant=variant, trainable=sum(p.numel() for p in params), first=losses[0],
                          last=statistics.mean(losses[-tail:]), val=val, step_s=statistics.median(times[1:] or times),
                          peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)))


def real_shapes(r: int = 8) -> list[tuple[str, int, int]]:
    """(model, trainable parameters per expert, shared) of LoRA r on every expert projection, from the published
    configs (Qwen3-30B-A3B: 48 layers, 128 experts, hidden 2048, expert width 768; Mixtral 8x7B: 32 layers, 8
    experts, hidden 4096, expert width 14336)."""
    out = []
    for name, layers, experts, hidden, inner in (("Qwen3-30B-A3B", 48, 128, 2048, 768),
                                                 ("Mixtral-8x7B", 32, 8, 4096, 14336)):
        pair = 3 * r * (hidden + inner)  # fc_1, fc_2: r x (hidden + inner); proj: r x (inner + hidden)
        out.append((name, layers * experts * pair, layers * pair))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("layers", 4), ("experts", 16), ("active", 4), ("hidden", 256), ("vocab", 512),
                          ("batch", 4), ("length", 128), ("iters", 60)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--quantize", default="bnb.nf4-dq")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.variant:
        return child(a.variant, a.folder, a)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen3-moe"
        make_folder(folder, a)
        rows = []
        for variant in a.variants.split(","):
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", variant, "--folder",
                                  str(folder)], capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"Qwen3-MoE shape: {a.layers} layers, {a.experts} experts ({a.active} active), hidden {a.hidden}, vocab "
          f"{a.vocab}; {a.quantize}, 32-true, LoRA r 8 (q, v + the variant's); {a.iters} iterations of {a.batch} x "
          f"{a.length} tokens, AdamW lr {a.lr}; CPU: {cpu_name()}")
    print(f"{'variant':16} {'trainable':>10} {'first loss':>10} {'last loss':>10} {'held-out':>9} {'step s':>7} "
          f"{'peak RSS GiB':>12}")
    for r in rows:
        print(f"{r['variant']:16} {r['trainable']:10,d} {r['first']:10.4f} {r['last']:10.4f} {r['val']:9.4f} "
              f"{r['step_s']:7.3f} {r['peak_rss_gib']:12.3f}")
    print("LoRA r 8 on every expert projection of real shapes: trainable parameters, and with fp32 weights, gradients "
          "and AdamW moments (16 bytes each)")
    for name, per_expert, shared in real_shapes():
        print(f"  {name}: a pair per expert {per_expert / 1e6:.1f}M ({per_expert * 16 / 2**30:.2f} GiB), shared "
              f"{shared / 1e6:.2f}M ({shared * 16 / 2**20:.0f} MiB)")


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
