"""Benchmark one QLoRA training step on a random-weight Qwen3-MoE shape (prints figures; not a test): ours (the model
finetune/lora.py trains: every expert a bitsandbytes 4-bit layer, LoRA on attention) against transformers +
bitsandbytes + PEFT (BitsAndBytesConfig, LoRA on q/k/v/o), each in its own fresh process. transformers 5 keeps these
models' experts as stacked parameters, which BitsAndBytesConfig leaves dense: its experts stay in the compute dtype.

    python scripts/bench_moe.py              # 4 layers, 16 experts, 4 active, hidden 256, 2 rows x 128 tokens
    python scripts/bench_moe.py --layers 16 --experts 64 --active 8 --hidden 1024 --batch 4 --length 256  # issue 34

Figures per side: median step time (forward + backward, LoRA gradients only, after one warm-up) as tokens/s, the
process's peak resident set (loading included) and the first step's loss on the same batch.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_folder(folder: Path, a: argparse.Namespace) -> None:
    import transformers

    cfg = transformers.Qwen3MoeConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                                      moe_intermediate_size=a.hidden // 2, num_experts=a.experts,
                                      num_experts_per_tok=a.active, norm_topk_prob=True, num_hidden_layers=a.layers,
                                      num_attention_heads=max(1, a.hidden // 64),
                                      num_key_value_heads=max(1, a.hidden // 256),
                                      head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)


def batch(a: argparse.Namespace) -> torch.Tensor:
    return torch.randint(0, a.vocab, (a.batch, a.length), generator=torch.Generator().manual_seed(1))


def run_ours(folder: Path, a: argparse.Namespace) -> tuple:
    from lit_qlora.loader import load_model
    from lit_qlora.lora import LoRAConfig

    lora = LoRAConfig(r=8, alpha=16, dropout=0.0, query=True, key=True, value=True, projection=True)
    model = load_model(folder, precision=a.precision, quantize=a.quantize, lora=lora, seed=0)
    model.train()
    idx = batch(a)

    def step() -> float:
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        return loss.item()
    return step, model


def run_hf(folder: Path, a: argparse.Namespace) -> tuple:
    import transformers
    from peft import LoraConfig, get_peft_model

    dtype = {"32-true": torch.float32, "bf16-true": torch.bfloat16}[a.precision]
    kind = a.quantize.removeprefix("bnb.").removesuffix("-dq")
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_compute_dtype=dtype,
                                        bnb_4bit_use_double_quant=a.quantize.endswith("-dq"))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=q, dtype=dtype,
                                                              device_map="cpu")
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.train()
    idx = batch(a)

    def step() -> float:
        logits = model(input_ids=idx[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        return loss.item()
    return step, model


def child(side: str, folder: Path, a: argparse.Namespace) -> None:
    torch.manual_seed(0)
    step, model = (run_ours if side == "ours" else run_hf)(folder, a)
    first = step()  # warm-up, and the loss of the untrained adapter on the batch
    times = []
    for _ in range(a.steps):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    sec = statistics.median(times)
    print(json.dumps(dict(side=side, loss=first, step_s=sec, tokens_per_s=a.batch * (a.length - 1) / sec,
                          peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("layers", 4), ("experts", 16), ("active", 4), ("hidden", 256), ("vocab", 4096),
                          ("batch", 2), ("length", 128), ("steps", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--quantize", default="bnb.nf4-dq")
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-true"])
    p.add_argument("--side", choices=["ours", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.side:
        return child(a.side, a.folder, a)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen3-moe"
        make_folder(folder, a)
        rows = []
        for side in ("ours", "hf"):
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--side", side, "--folder", str(folder)],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"Qwen3-MoE shape: {a.layers} layers, {a.experts} experts ({a.active} active), hidden {a.hidden}; "
          f"{a.quantize}, {a.precision}, LoRA r 8 on attention; {a.batch} x {a.length} tokens; CPU: {cpu_name()}")
    print(f"{'':6} {'tokens/s':>10} {'step s':>8} {'peak RSS GiB':>13} {'first loss':>11}")
    for r in rows:
        print(f"{r['side']:6} {r['tokens_per_s']:10.1f} {r['step_s']:8.3f} {r['peak_rss_gib']:13.3f} {r['loss']:11.5f}")
    ours, hf = rows
    loss = 100 * (ours["loss"] / hf["loss"] - 1)
    print(f"ours / hf: {ours['tokens_per_s'] / hf['tokens_per_s']:.2f}x tokens/s, "
          f"{ours['peak_rss_gib'] / hf['peak_rss_gib']:.2f}x peak RSS, first loss {loss:+.3f}%")


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
