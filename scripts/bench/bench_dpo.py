"""Benchmark a preference (DPO) step against a supervised (SFT) step on the same model and sequence length (prints
figures; not a test): peak resident memory and step time, each variant in its own fresh process.

    python scripts/bench/bench_dpo.py                     # SmolLM2-135M's shape, random weights, bnb.nf4, 4 pairs x 256
    python scripts/bench/bench_dpo.py --checkpointing true   # with activation checkpointing (QLoRA recipes' way)
    python scripts/bench/bench_dpo.py --model demo --pairs 8 --length 128 --steps 3   # the demo model's shape
    python scripts/bench/bench_dpo.py --accuracy true   # held-out accuracy before / after training on demo pairs

Variants, all with LoRA r 8 on every target and AdamW, the base quantized with --quantize:
  sft      : a step on B rows of `length` tokens (the chosen rows), as finetune/lora.py computes it
  sft_2x   : a step on 2B rows (as many tokens as a DPO step)
  dpo      : a DPO step on B pairs as finetune/dpo.py computes it: one forward, each pair's prompt once and its
             chosen and rejected answers after it (preference.share_prefixes), the reference log-probabilities
             computed before (one no-grad forward per pair, done once per run)
  dpo_rows : the same step on the 2B whole rows (prompt twice) in one forward (finetune/dpo.py before sharing)
  dpo_2fwd : the same step on whole rows, chosen and rejected in two forwards
Memory: the process's peak resident set (VmHWM) during the steps, the high-water mark reset after loading
(/proc/self/clear_refs), next to the resident set after loading: one copy of the weights serves the policy and the
reference, so a DPO step adds activations, not a model. Step time: median of --steps steps after one warm-up.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lit_qlora.checkpoint import LIT_WEIGHTS  # noqa: E402
from lit_qlora.config import Config  # noqa: E402
from lit_qlora.convert import write_random_checkpoint  # noqa: E402
from lit_qlora.data.batching import collate, unpad  # noqa: E402
from lit_qlora.loader import load_model  # noqa: E402
from lit_qlora.lora import LoRAConfig  # noqa: E402
from lit_qlora.precision import resolve_precision  # noqa: E402
from lit_qlora.train import preference as pf  # noqa: E402
from lit_qlora.train.training import head_chunk, shift_labels  # noqa: E402
from lit_qlora.utils import run_cli, tune_cpu_allocator  # noqa: E402

VARIANTS = ("sft", "sft_2x", "dpo", "dpo_rows", "dpo_2fwd")


def cpu_description() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    isa = "AVX512-BF16" if "avx512_bf16" in flags else "AVX512F" if "avx512f" in flags else "AVX2"
    amx = ", AMX" if "amx_bf16" in flags else ", no AMX"
    return f"{name}, {isa}{amx}, {torch.get_num_threads()} threads"


def status_gb(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 2**20


def make_pairs(n: int, length: int, vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for i in range(n):
        prompt = torch.randint(0, vocab, (length // 2,), generator=g)
        pair = {"index": i}
        for side in ("chosen", "rejected"):
            ids = torch.cat([prompt, torch.randint(0, vocab, (length - length // 2,), generator=g)])
            labels = ids.clone()
            labels[:len(prompt)] = -100
            pair[f"{side}_ids"], pair[f"{side}_labels"] = ids, labels
        pairs.append(pair)
    return pairs


def sft_loss(model, rows: list[dict], chunk: int) -> torch.Tensor:
    batch = collate(rows)
    tgt = shift_labels(batch["labels"])
    batch, tgt = unpad(batch, tgt)
    has = tgt != -100
    loss = model(batch["input_ids"], lm_head_chunk=chunk, output_mask=has, positions=batch["positions"],
                 segments=batch["segments"], targets=tgt[has])  # as finetune/lora.py's step: no logits kept
    return loss / has.sum()


def dpo_loss(model, pairs: list[dict], ref: torch.Tensor, chunk: int, two_forwards: bool, share: bool) -> torch.Tensor:
    if two_forwards:  # chosen rows, then rejected rows: each its own forward
        sides = []
        for side in ("chosen", "rejected"):
            rows = [{"input_ids": p[f"{side}_ids"], "labels": p[f"{side}_labels"]} for p in pairs]
            batch = collate(rows)
            tgt = shift_labels(batch["labels"])
            flat, tgt = unpad(batch, tgt)
            has = tgt != -100
            nll = model(flat["input_ids"], lm_head_chunk=chunk, output_mask=has, positions=flat["positions"],
                        segments=flat["segments"], targets=tgt[has], reduction="none")
            seq = flat["segments"][has] // batch["input_ids"].size(1)
            sides.append(pf.sequence_logps(-nll, seq, len(pairs)))
        lp = pf.PairLogps(sides[0][0], sides[1][0], sides[0][1], sides[1][1])
    else:
        lp = pf.batch_logps(model, pf.collate_pairs(pairs), lm_head_chunk=chunk, share=share)
    per_pair, _, _ = pf.pair_losses("dpo", lp, ref[:, 0], ref[:, 1], beta=0.1)
    return per_pair.mean()


def child(variant: str, folder: str, quantize: str, precision: str, pairs_n: int, length: int, steps: int,
          checkpointing: bool) -> None:
    """One variant in this process; prints one JSON line."""
    tune_cpu_allocator()  # as finetune/lora.py does on CPU
    lora = LoRAConfig(r=8, alpha=16, dropout=0.0, query=True, key=True, value=True, projection=True, mlp=True)
    model = load_model(Path(folder), precision=precision, quantize=None if quantize == "none" else quantize,
                       lora=lora, seed=0)
    model.activation_checkpointing = checkpointing  # as finetune's --activation_checkpointing sets it
    chunk = head_chunk(model.config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    pairs = make_pairs(pairs_n, length, model.config.vocab_size)
    rss_loaded = status_gb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from the current RSS
    ref = None
    if variant.startswith("dpo"):
        with torch.no_grad():  # what finetune/dpo.py does once before training
            model.eval()
            lp = pf.batch_logps(model, pf.collate_pairs(pairs), lm_head_chunk=chunk)
            ref = torch.stack([lp.chosen, lp.rejected], 1).float()
    model.train()
    rows = [{"input_ids": p["chosen_ids"], "labels": p["chosen_labels"]} for p in pairs]
    if variant == "sft_2x":
        rows += [{"input_ids": p["rejected_ids"], "labels": p["rejected_labels"]} for p in pairs]
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        if variant.startswith("sft"):
            loss = sft_loss(model, rows, chunk)
        else:
            loss = dpo_loss(model, pairs, ref, chunk, two_forwards=variant == "dpo_2fwd", share=variant == "dpo")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t0)
    tokens = len(rows) * length if variant.startswith("sft") else 2 * pairs_n * length
    print("RESULT " + json.dumps(dict(variant=variant, rss_loaded_gb=rss_loaded, step_peak_gb=status_gb("VmHWM"),
                                      step_s=statistics.median(times), tokens=tokens)))


KINDS = ("cut", "shuffled", "other")  # how a rejected answer is made from the record's own (see demo_pairs)


def demo_pairs(folder: Path, val_fraction: float = 0.2, seed: int = 0) -> Path:
    """train.jsonl + val.jsonl of {prompt, chosen, rejected, kind} from the demo records: the chosen answer is the
    record's output; each record gives up to three pairs, one per kind of rejected answer: "cut" (its first half),
    "shuffled" (its characters in another order) and "other" (another record's answer to the same instruction: right
    for another input). The held-out pairs are those of `val_fraction` of the records (every pair of a record on one
    side, so no held-out prompt is trained on)."""
    import random

    from lit_qlora.data.records import split
    from lit_qlora.demo import DEMO_DATA_FILE

    records = json.loads(DEMO_DATA_FILE.read_text())
    rng = random.Random(seed)
    outputs: dict = {}
    for r in records:
        outputs.setdefault(r["instruction"], set()).add(r["output"])

    def pairs_of(r: dict) -> list[dict]:
        out, chosen = [], r["output"]
        rejected = {"cut": chosen[:len(chosen) // 2].rstrip()}
        chars = list(chosen)
        for _ in range(10):
            rng.shuffle(chars)
            if "".join(chars) != chosen:
                rejected["shuffled"] = "".join(chars)
                break
        others = sorted(outputs[r["instruction"]] - {chosen})
        if others:
            rejected["other"] = rng.choice(others)
        prompt = f"{r['instruction']}\n{r['input']}" if r.get("input") else r["instruction"]
        for kind in KINDS:
            if rejected.get(kind) and rejected[kind] != chosen:
                out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected[kind], "kind": kind})
        return out

    train_recs, val_recs = split(records, val_fraction, seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name, recs in (("train.jsonl", train_recs), ("val.jsonl", val_recs)):
        (folder / name).write_text("".join(json.dumps(q) + "\n" for r in recs for q in pairs_of(r)))
    return folder


def held_out_logps(checkpoint: Path, adapter: Path | None, data: Path, quantize: str) -> torch.Tensor:
    """[n_val, 2]: the (chosen, rejected) log-probabilities of the held-out pairs under the model (with `adapter`)."""
    from lit_qlora.adapter import Adapter
    from lit_qlora.data.prepare import DataSettings
    from lit_qlora.tokenizer import Tokenizer

    tok = Tokenizer(checkpoint)
    _, val, _ = pf.load_pairs(data, tok, DataSettings(256, template="plain"))
    a = Adapter.load(adapter) if adapter else None
    model = load_model(checkpoint, precision="32-true", quantize=quantize, lora=a.config if a else None).eval()
    if a:
        a.load_into(model)
    with torch.no_grad():
        lp = pf.batch_logps(model, pf.collate_pairs(val, pad_id=tok.eos_id))
    return torch.stack([lp.chosen, lp.rejected], 1)


def accuracy_run(quantize: str, out_dir: str, loss: str, learning_rate: float, beta: float, epochs: int,
                 lora_r: int, micro_batch_size: int) -> None:
    import csv

    from lit_qlora.demo import ensure_demo_checkpoint

    work = Path(out_dir or Path(tempfile.gettempdir()) / "bench-dpo-accuracy")
    ckpt = ensure_demo_checkpoint(work / "demo")  # built here once (not shared with other runs building it)
    data = demo_pairs(work / "pairs")
    n_train, n_val = (sum(1 for _ in open(data / f)) for f in ("train.jsonl", "val.jsonl"))
    out = work / f"out-{loss}-lr{learning_rate:g}-b{beta:g}-e{epochs}-r{lora_r}-{int(time.time())}"
    args = ["--checkpoint_dir", ckpt, "--data_dir", data, "--out_dir", out, "--quantize", quantize, "--template",
            "plain", "--loss", loss, "--beta", beta, "--learning_rate", learning_rate, "--epochs", epochs,
            "--micro_batch_size", micro_batch_size, "--eval_interval", 25,
            "--eval_iters", -(-n_val // micro_batch_size), "--save_interval", 100000, "--lora_r", lora_r,
            "--lora_alpha", 2 * lora_r, "--lora_key", "true", "--lora_projection", "true", "--lora_mlp", "true",
            "--warmup_steps", 10, "--lora_dropout", 0.0]
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, str(ROOT / "finetune" / "dpo.py"), *map(str, args)], capture_output=True,
                       text=True)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    vals = [row for row in rows if row["val_loss"]]
    losses = [float(row["loss"]) for row in rows if row["loss"]]
    first, last = vals[0], vals[-1]
    print(f"demo model (lit_qlora/demo, {quantize}), {loss} beta {beta:g}, lr {learning_rate:g} (10 warm-up steps, "
          f"cosine), LoRA r {lora_r} alpha {2 * lora_r} on every layer but the head, {epochs} epoch(s) of {n_train} "
          f"pairs, micro batch {micro_batch_size}; {n_val} held-out pairs; {time.perf_counter() - t0:.0f} s\n"
          f"CPU: {cpu_description()}\nout: {out}")
    k = min(10, len(losses) // 2)
    print(f"train loss: mean of the first {k} steps {statistics.mean(losses[:k]):.3f}, of the last {k} "
          f"{statistics.mean(losses[-k:]):.3f}")
    print(f"\n| held-out pairs ({n_val}) | start (iter 0) | end (iter {last['iter']}) |\n|---|---|---|")
    for key in ("val_loss", "val_rewards/accuracies", "val_rewards/margins"):
        print(f"| {key} | {float(first[key]):.3f} | {float(last[key]):.3f} |")
    kinds = [json.loads(line)["kind"] for line in open(data / "val.jsonl")]
    before = held_out_logps(ckpt, None, data, quantize)
    after = held_out_logps(ckpt, out / "lit_model_lora_finetuned.pth", data, quantize)
    ratio = after - before  # the rewards / beta: the log-ratios to the reference (the base)
    won = ratio[:, 0] > ratio[:, 1]
    print("\nBy kind of rejected answer: the reward accuracy at the end (chosen's log-ratio above rejected's), and the "
          "share of pairs whose chosen answer has the higher log-probability before and after (a longer answer "
          "starts behind: it sums more tokens)\n\n| held-out pairs | reward accuracy | log p(chosen) > log p(rejected) "
          "before | after |\n|---|---|---|---|")
    for kind in (None, *KINDS):
        sel = torch.tensor([kind is None or k_ == kind for k_ in kinds])
        name = "all" if kind is None else f"rejected {kind}"
        print(f"| {name} ({int(sel.sum())}) | {won[sel].float().mean():.3f} | "
              f"{(before[sel, 0] > before[sel, 1]).float().mean():.3f} | "
              f"{(after[sel, 0] > after[sel, 1]).float().mean():.3f} |")


def main(model: str = "SmolLM2-135M", quantize: str = "bnb.nf4", precision: str = "auto", pairs: int = 4,
         length: int = 256, steps: int = 3, out_dir: str = "", variants: str = ",".join(VARIANTS),
         checkpointing: bool = False, accuracy: bool = False, loss: str = "dpo", learning_rate: float = 1e-3,
         beta: float = 0.1, epochs: int = 2, lora_r: int = 16) -> None:
    """Write the random-weight checkpoint once (in `out_dir`), then run each variant in a fresh process
    (`checkpointing`: every variant with activation checkpointing, finetune's --activation_checkpointing).
    `accuracy`: the held-out before / after run instead (its settings: loss .. lora_r, micro batch `pairs`)."""
    if accuracy:
        return accuracy_run(quantize, out_dir, loss, learning_rate, beta, epochs, lora_r, pairs)
    if model == "demo":  # lit_qlora/demo's shape (4 layers, 256 wide, 384 tokens): seconds per variant
        from lit_qlora.demo import DEMO_CONFIG

        config = Config(**DEMO_CONFIG)
    else:
        config = Config.from_name(model)
    folder = Path(out_dir or Path(tempfile.gettempdir()) / f"bench-dpo-{model}")
    if not (folder / LIT_WEIGHTS).is_file():
        write_random_checkpoint(folder, config)
    precision, _ = resolve_precision(precision, "cpu")
    print(f"model: {config.name} shape, random weights, {quantize}, {precision}, LoRA r 8 on every target, AdamW, "
          f"activation checkpointing {'on' if checkpointing else 'off'}; {pairs} pairs (DPO) / {pairs} rows (SFT) of "
          f"{length} tokens (half prompt)\nCPU: {cpu_description()} (shared machine: times are noisy)")
    results = []
    for v in variants.split(","):
        r = subprocess.run([sys.executable, __file__, "--child", v, str(folder), quantize, precision, str(pairs),
                            str(length), str(steps), str(checkpointing)], capture_output=True, text=True)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"variant {v} failed:\n{r.stderr[-3000:]}")
        results.append(json.loads(line[7:]))
    sft = next((r for r in results if r["variant"] == "sft"), results[0])
    print("\n| variant | RSS after load GB | peak during steps GB | peak / sft | step s | tokens/s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['rss_loaded_gb']:.3f} | {r['step_peak_gb']:.3f} | "
              f"{r['step_peak_gb'] / sft['step_peak_gb']:.2f}x | {r['step_s']:.3f} | {r['tokens'] / r['step_s']:.0f} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        v, folder, q, prec, n, length, steps, ckpt = sys.argv[2:]
        child(v, folder, q, prec, int(n), int(length), int(steps), ckpt == "True")
    else:
        run_cli(main)
