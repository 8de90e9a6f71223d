"""Benchmark a mixture of experts on CPU (prints figures; not a test): one QLoRA training step and batch-1 4-bit
decoding on a random-weight Qwen3-MoE, ours against transformers + bitsandbytes (+ PEFT for training), each side of
each task in its own fresh process.

    python scripts/bench/bench_moe.py              # 4 layers, 16 experts, 4 active, hidden 256: a quick check
    python scripts/bench/bench_moe.py --layers 16 --experts 64 --active 8 --hidden 1024 --batch 4 --length 256

Ours is what finetune/lora.py trains (every expert a bitsandbytes 4-bit layer, LoRA on attention, the loss computed
as its step computes it) and what generate/*.py decodes with (the 4-bit decode kernel, only the active experts'
packed bytes read). transformers 5 keeps these models' experts as stacked parameters, which BitsAndBytesConfig leaves
dense: its experts stay in the compute dtype (fp32 at 32-true: 4 bytes per expert weight against our ~0.52).

The expert width defaults to Qwen3-30B-A3B's ratio, moe_intermediate_size = 3/8 x hidden (768 / 2048): 384 at
hidden 1024. The vocabulary is a small 4096 (the experts are what this measures).

Figures per side. Training (--quantize, LoRA r 8 on q/k/v/o): median step time (forward + backward, after one warm-up
step) as tokens/s, the process's peak resident set (loading included), and iteration 1's loss on the same batch (both
sides print a hash of the token ids they trained on; the run stops if they differ). Decoding (--decode_quantize,
greedy, batch 1): new tokens per second after the prompt (the time of --new_tokens tokens minus the time of the
first, which includes the prompt), the best of --decode_runs runs, and the peak resident set. With
--per_expert_decode a third row, "ours/expert", decodes as ours did before one kernel call ran all the active experts
of a projection (`decode4bit.DecodeExpertWeights`): a kernel call per expert and projection (the same tokens).
"""
from __future__ import annotations

import argparse
import hashlib
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


def hf_config(a: argparse.Namespace):
    import transformers

    moe = a.moe_intermediate or a.hidden * 3 // 8
    return transformers.Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden, moe_intermediate_size=moe,
        num_experts=a.experts, num_experts_per_tok=a.active, norm_topk_prob=True, num_hidden_layers=a.layers,
        num_attention_heads=max(1, a.hidden // 64), num_key_value_heads=max(1, a.hidden // 256), head_dim=64,
        max_position_embeddings=4096, tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])


def make_folders(root: Path, a: argparse.Namespace) -> tuple[Path, Path]:
    """(our checkpoint, the same weights as a transformers folder): random bf16 weights written a tensor at a time,
    so the largest shape never needs a whole model in this process."""
    from lit_qlora.config import Config
    from lit_qlora.convert import convert_lit_checkpoint, write_random_checkpoint

    ours, hf = root / "lit", root / "hf"
    ours.mkdir(parents=True)
    (ours / "config.json").write_text(hf_config(a).to_json_string())
    write_random_checkpoint(ours, Config.from_hf_config(ours / "config.json"), seed=0)
    convert_lit_checkpoint(ours, hf)
    return ours, hf


def batch(a: argparse.Namespace) -> torch.Tensor:
    return torch.randint(0, a.vocab, (a.batch, a.length), generator=torch.Generator().manual_seed(1))


def ids_hash(idx: torch.Tensor) -> str:
    return hashlib.sha256(idx.numpy().tobytes()).hexdigest()[:16]


def train_ours(folder: Path, a: argparse.Namespace):
    from lit_qlora.loader import load_model
    from lit_qlora.lora import LoRAConfig
    from lit_qlora.train.training import head_chunk
    from lit_qlora.utils import tune_cpu_allocator

    tune_cpu_allocator()  # as finetune/lora.py does on CPU
    lora = LoRAConfig(r=8, alpha=16, dropout=0.0, query=True, key=True, value=True, projection=True)
    model = load_model(folder, precision=a.precision, quantize=a.quantize, lora=lora, seed=0)
    model.train()
    idx = batch(a)
    chunk = head_chunk(model.config)

    def step() -> float:  # finetune/lora.py's loss: summed over the targets by the model, then the mean
        loss = model(idx[:, :-1], targets=idx[:, 1:], lm_head_chunk=chunk) / idx[:, 1:].numel()
        loss.backward()
        return loss.item()
    return step, model, idx


def train_hf(folder: Path, a: argparse.Namespace):
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb_config(a.quantize, a),
                                                              dtype=dtype_of(a), device_map="cpu")
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.train()
    idx = batch(a)

    def step() -> float:
        logits = model(input_ids=idx[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        return loss.item()
    return step, model, idx


def dtype_of(a: argparse.Namespace) -> torch.dtype:
    return {"32-true": torch.float32, "bf16-true": torch.bfloat16}[a.precision]


def bnb_config(quantize: str, a: argparse.Namespace):
    import transformers

    kind = quantize.removeprefix("bnb.").removesuffix("-dq")
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind,
                                           bnb_4bit_compute_dtype=dtype_of(a),
                                           bnb_4bit_use_double_quant=quantize.endswith("-dq"))


def decode_ours(folder: Path, a: argparse.Namespace, per_expert: bool = False):
    from lit_qlora.generation import generate
    from lit_qlora.inference import fast_cpu_4bit_decoding
    from lit_qlora.loader import load_model
    from lit_qlora.quant.quantize import QuantizedExpertWeights

    model = load_model(folder, precision=a.precision, quantize=a.decode_quantize).eval()
    fast_cpu_4bit_decoding(model)  # as generate/*.py loads it (lit_qlora.inference.load_for_inference)
    if per_expert:  # back to a kernel call per expert and projection
        for m in model.modules():
            if isinstance(m, QuantizedExpertWeights):
                m.__class__ = QuantizedExpertWeights
    prompt = batch(a)[0, :a.prompt]
    return lambda n: generate(model, prompt, n)[a.prompt:].tolist(), prompt


def decode_hf(folder: Path, a: argparse.Namespace):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=bnb_config(a.decode_quantize, a), dtype=dtype_of(a), device_map="cpu").eval()
    prompt = batch(a)[0, :a.prompt]

    def run(n: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(prompt.view(1, -1), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
        return out[0, a.prompt:].tolist()
    return run, prompt


def child(side: str, task: str, folder: Path, a: argparse.Namespace) -> None:
    torch.manual_seed(0)
    if task == "train":
        step, model, idx = (train_ours if side == "ours" else train_hf)(folder, a)
        first = step()  # warm-up, and the loss of the untrained adapter (B = 0: the base model's) on the batch
        times = []
        for _ in range(a.steps):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        sec = statistics.median(times)
        result = dict(loss=first, step_s=sec, tokens_per_s=a.batch * (a.length - 1) / sec, ids=ids_hash(idx))
    else:
        run, prompt = decode_hf(folder, a) if side == "hf" else decode_ours(folder, a, side == "ours/expert")
        run(2)  # warm-up (the kernel's first call compiles or loads it)
        best = float("inf")
        for _ in range(a.decode_runs):
            t0 = time.perf_counter()
            run(1)
            t1 = time.perf_counter()
            tokens = run(a.new_tokens)
            t2 = time.perf_counter()
            best = min(best, (t2 - t1) - (t1 - t0))
        result = dict(tokens_per_s=(a.new_tokens - 1) / best, ids=ids_hash(prompt), first_tokens=tokens[:8])
    result.update(side=side, task=task, peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    print(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default, what in (
            ("layers", 4, "decoder layers"), ("experts", 16, "experts per layer"), ("active", 4, "experts per token"),
            ("hidden", 256, "hidden size"), ("moe_intermediate", 0, "expert width (0: 3/8 x hidden)"),
            ("vocab", 4096, "vocabulary"), ("batch", 2, "training micro batch"), ("length", 128, "tokens per row"),
            ("steps", 3, "timed training steps"), ("prompt", 32, "decode prompt tokens"),
            ("new_tokens", 32, "decoded tokens per run"), ("decode_runs", 2, "decode runs (the best is kept)")):
        p.add_argument(f"--{name}", type=int, default=default, help=what)
    p.add_argument("--quantize", default="bnb.nf4-dq", help="training's --quantize")
    p.add_argument("--decode_quantize", default="bnb.nf4", help="decoding's --quantize")
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-true"])
    p.add_argument("--tasks", default="train,decode")
    p.add_argument("--per_expert_decode", action="store_true",
                   help="also decode with a kernel call per expert and projection (as ours did before)")
    p.add_argument("--side", choices=["ours", "hf", "ours/expert"], help=argparse.SUPPRESS)
    p.add_argument("--task", choices=["train", "decode"], help=argparse.SUPPRESS)
    p.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.side:
        return child(a.side, a.task, a.folder, a)
    cfg = hf_config(a)
    rows: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = dict(zip(("ours", "hf"), make_folders(Path(tmp), a)))
        for task in a.tasks.split(","):
            extra = ("ours/expert",) if task == "decode" and a.per_expert_decode else ()
            for side in ("ours", "hf", *extra):
                out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--side", side, "--task", task,
                                      "--folder", str(folders[side.split("/")[0]])], capture_output=True, text=True)
                if out.returncode:
                    sys.exit(f"{side} {task} failed:\n{out.stderr[-3000:]}")
                rows[task, side] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"Qwen3-MoE, random weights: {a.layers} layers, {a.experts} experts ({a.active} active) of width "
          f"{cfg.moe_intermediate_size}, hidden {a.hidden}, vocab {a.vocab}; {a.precision}; CPU: {cpu_name()}, "
          f"{torch.get_num_threads()} threads")
    if ("train", "ours") in rows:
        ours, hf = rows["train", "ours"], rows["train", "hf"]
        if ours["ids"] != hf["ids"]:
            sys.exit(f"the two sides trained on different token ids ({ours['ids']} vs {hf['ids']})")
        print(f"\nTraining: {a.quantize}, LoRA r 8 on attention, micro batch {a.batch} x {a.length} tokens "
              f"(ids {ours['ids']} on both sides)")
        print(f"{'':6} {'tokens/s':>10} {'step s':>8} {'peak RSS GiB':>13} {'iter-1 loss':>12}")
        for r in (ours, hf):
            print(f"{r['side']:6} {r['tokens_per_s']:10.1f} {r['step_s']:8.3f} {r['peak_rss_gib']:13.3f} "
                  f"{r['loss']:12.5f}")
        print(f"ours / hf: {ours['tokens_per_s'] / hf['tokens_per_s']:.2f}x tokens/s, "
              f"{ours['peak_rss_gib'] / hf['peak_rss_gib']:.2f}x peak RSS, iteration-1 loss "
              f"{100 * (ours['loss'] / hf['loss'] - 1):+.3f}%")
    if ("decode", "ours") in rows:
        ours, hf = rows["decode", "ours"], rows["decode", "hf"]
        print(f"\nBatch-1 decoding: {a.decode_quantize}, greedy, {a.prompt}-token prompt, {a.new_tokens} new tokens")
        per_expert = rows.get(("decode", "ours/expert"))
        print(f"{'':11} {'tokens/s':>10} {'peak RSS GiB':>13}  first tokens")
        for r in (ours, hf, per_expert or None):
            if r:
                print(f"{r['side']:11} {r['tokens_per_s']:10.2f} {r['peak_rss_gib']:13.3f}  {r['first_tokens']}")
        print(f"ours / hf: {ours['tokens_per_s'] / hf['tokens_per_s']:.2f}x tokens/s, "
              f"{ours['peak_rss_gib'] / hf['peak_rss_gib']:.2f}x peak RSS")
        if per_expert:
            print(f"ours / ours/expert: {ours['tokens_per_s'] / per_expert['tokens_per_s']:.2f}x tokens/s")


def cpu_name() -> str:
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
        flags = open("/proc/cpuinfo").read()
        kind = ("AMX" if " amx" in flags else "AVX512-BF16" if "avx512_bf16" in flags
                else "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2")
        return f"{name} ({kind})"
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
