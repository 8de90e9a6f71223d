"""Benchmark a DPO run of finetune/dpo.py against TRL's DPOTrainer with PEFT + bitsandbytes (prints figures; not a
test): the same random-weight model, the same pairs in the same batches, the same LoRA targets and rank, the same
4-bit quantization, precision and maximum length, each side in its own fresh process.

    python scripts/bench/bench_dpo_trl.py                      # SmolLM2-135M's shape, nf4-dq, 8 steps of 4 pairs
    python scripts/bench/bench_dpo_trl.py --model demo --steps 4 --sides ours,trl   # seconds per side

Sides (each runs `--steps` optimizer steps of `--pairs` pairs, AdamW, constant learning rate, no dropout, no
validation):
  ours         finetune/dpo.py run in the child process (its own flags; --bench_json for the step times): the
               reference log-probabilities computed once before the first step, chosen and rejected rows unpadded in
               one forward, no logits kept.
  trl          DPOTrainer as its QLoRA recipe runs it: AutoModelForCausalLM.from_pretrained with a BitsAndBytesConfig,
               a PEFT LoraConfig passed to the trainer (the reference = the adapter disabled, computed again in every
               step: precompute_ref_log_probs False, the default).
  trl_precompute  the same with precompute_ref_log_probs=True (the reference computed once before training, as ours).
TRL's defaults that would change the comparison are set to ours: gradient checkpointing off (TRL's default is on:
--checkpointing true turns it on for both sides), bf16 autocast off under 32-true, weight decay 0. TRL keeps its
QLoRA choice of bf16 LoRA weights. Both sides get the pairs as token ids (TRL's own tokenization is bypassed, so the
tokens are the same): the pairs as lit_qlora.train.preference.load_pairs reads them, in the order finetune/dpo.py draws
them (its PairStream with --seed), which TRL follows with train_sampling_strategy "sequential".

Figures per side: median step time after the first step, tokens/s of the steps (real tokens of chosen + rejected rows:
the same count on both sides), the reference pass (where there is one) and tokens/s with it included, the process's
peak resident set (VmHWM: loading included) and the resident set after loading, the losses of the first and last
step (the first is ln 2 on both sides: policy = reference).
"""
from __future__ import annotations

import argparse
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

SIDES = ("ours", "trl", "trl_precompute")
WORDS = "w{}"  # the bench tokenizer's words: one token each


def status_gb(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 2**20


def cpu_description() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    isa = "AVX512-BF16" if "avx512_bf16" in flags else "AVX512F" if "avx512f" in flags else "AVX2"
    return f"{name}, {isa}{', AMX' if 'amx_bf16' in flags else ', no AMX'}, {torch.get_num_threads()} threads"


# ---- the model, its tokenizer and the pairs (written once, in the parent) ------------------------------------
def make_model(folder: Path, model: str) -> None:
    """An HF folder (config.json, model.safetensors, tokenizer) of random weights with `model`'s shape, and a word-level
    tokenizer of its vocabulary size ("w0" .. one token per word, so text and token ids map one to one)."""
    import tokenizers

    from lit_qlora.config import Config
    from lit_qlora.convert import convert_lit_checkpoint, write_random_checkpoint

    if (folder / "tokenizer.json").is_file():
        return
    if model == "demo":
        from lit_qlora.demo import DEMO_CONFIG

        config = Config(**DEMO_CONFIG)
    else:
        config = Config.from_name(model)
    lit = folder.parent / (folder.name + "-lit")
    write_random_checkpoint(lit, config, seed=0)
    convert_lit_checkpoint(lit, folder)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({WORDS.format(i): i for i in range(len(specials), config.vocab_size)})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>", "add_bos_token": False,
         "add_eos_token": False, "model_max_length": config.block_size,
         "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))


def make_pairs(data: Path, n: int, length: int, vocab: int, seed: int = 0) -> None:
    """train.jsonl of n pairs of words and val.jsonl of 2: prompts of length/4 to length/2 words, answers of length/8
    to length/2 (chosen and rejected of different lengths, so padding costs what it costs on real data)."""
    g = torch.Generator().manual_seed(seed)

    def words(lo: int, hi: int) -> str:
        k = int(torch.randint(lo, hi + 1, (1,), generator=g))
        return " ".join(WORDS.format(int(i)) for i in torch.randint(3, vocab, (k,), generator=g))

    data.mkdir(parents=True, exist_ok=True)
    for name, count in (("train.jsonl", n), ("val.jsonl", 2)):
        rows = [{"prompt": words(length // 4, length // 2), "chosen": " " + words(length // 8, length // 2 - 2),
                 "rejected": " " + words(length // 8, length // 2 - 2)} for _ in range(count)]
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_batches(folder: Path, data: Path, a: argparse.Namespace) -> Path:
    """The pairs as token ids, in the order finetune/dpo.py draws them (PairStream, --seed), split as TRL's collator
    takes them (prompt_ids, chosen_ids, rejected_ids), and the validation pairs."""
    from lit_qlora.data.prepare import DataSettings
    from lit_qlora.tokenizer import Tokenizer
    from lit_qlora.train import preference as pf

    train, val, _ = pf.load_pairs(data, Tokenizer(folder), DataSettings(a.max_seq_length, template="plain"))
    stream = pf.PairStream(train, batch_size=a.pairs, seed=a.seed)
    ordered = [p for _ in range(a.steps) for p in next(stream)]

    def split(p: dict) -> dict:
        n = int((p["chosen_labels"] == -100).sum())
        prompt = p["chosen_ids"][:n]
        assert torch.equal(prompt, p["rejected_ids"][:n]) and int((p["rejected_labels"] == -100).sum()) == n
        return {"prompt_ids": prompt.tolist(), "chosen_ids": p["chosen_ids"][n:].tolist(),
                "rejected_ids": p["rejected_ids"][n:].tolist()}

    out = data.parent / (data.name + "-batches.json")  # beside the folder: finetune/dpo.py reads all of it
    out.write_text(json.dumps({"train": [split(p) for p in ordered], "val": [split(p) for p in val],
                               "tokens": [sum(len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in
                                              ordered[i:i + a.pairs]) for i in range(0, len(ordered), a.pairs)]}))
    return out


# ---- the sides (each in a fresh child process) --------------------------------------------------------------
def run_ours(folder: Path, data: Path, a: argparse.Namespace) -> dict:
    import contextlib
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location("finetune_dpo", ROOT / "finetune" / "dpo.py")
    dpo = sys.modules["finetune_dpo"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dpo)
    timing = {}
    reference_logps = dpo.reference_logps

    def timed_reference(s, pairs):  # the reference pass (train and val), timed
        t0 = time.perf_counter()
        out = reference_logps(s, pairs)
        timing["reference_s"] = timing.get("reference_s", 0.0) + time.perf_counter() - t0
        timing.setdefault("rss_loaded_gb", status_gb("VmRSS"))
        return out

    dpo.reference_logps = timed_reference
    out_dir = Path(tempfile.mkdtemp(prefix="bench-dpo-ours-"))
    argv = ["--checkpoint_dir", folder, "--data_dir", data, "--out_dir", out_dir, "--quantize", a.quantize,
            "--precision", a.precision, "--template", "plain", "--loss", "dpo", "--beta", "0.1", "--seed", a.seed,
            "--max_seq_length", a.max_seq_length, "--micro_batch_size", a.pairs, "--batch_size", a.pairs,
            "--max_iters", a.steps, "--learning_rate", "1e-4", "--warmup_steps", "0", "--weight_decay", "0",
            "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0", "--lora_query", "true", "--lora_key", "true",
            "--lora_value", "true", "--lora_projection", "true", "--lora_mlp", "true", "--eval_iters", "0",
            "--save_interval", "100000", "--activation_checkpointing", a.checkpointing, "--bench_json", "true"]
    sys.argv = ["dpo.py", *map(str, argv)]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        dpo.cli()
    line = next(ln for ln in buf.getvalue().splitlines() if ln.startswith("BENCH_JSON "))
    b = json.loads(line[len("BENCH_JSON "):])
    return dict(step_s=b["iter_times"], losses=b["losses"], **timing)


def run_trl(folder: Path, data: Path, a: argparse.Namespace, precompute: bool) -> dict:
    import datasets
    import transformers
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    batches = json.loads((data.parent / (data.name + "-batches.json")).read_text())
    dtype = {"32-true": torch.float32, "bf16-true": torch.bfloat16}[a.precision]
    kind = a.quantize.removeprefix("bnb.").removesuffix("-dq")
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_compute_dtype=dtype,
                                            bnb_4bit_use_double_quant=a.quantize.endswith("-dq"),
                                            bnb_4bit_quant_storage=torch.uint8)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, dtype=dtype,
                                                              device_map="cpu")
    # bitsandbytes repacks a 4-bit layer for its AVX512-BF16 CPU inference kernel on the first no-grad forward in
    # eval mode (TRL's reference precompute runs so: from_pretrained returns the model in eval mode); after that the
    # layer passes no input gradient, so training would run a cheaper, wrong backward. Kept off, and checked below.
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    rss_loaded = status_gb("VmRSS")
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    args = DPOConfig(output_dir=tempfile.mkdtemp(prefix="bench-dpo-trl-"), per_device_train_batch_size=a.pairs,
                     per_device_eval_batch_size=a.pairs, gradient_accumulation_steps=1, max_steps=a.steps,
                     learning_rate=1e-4, lr_scheduler_type="constant", weight_decay=0.0, beta=0.1,
                     loss_type=["sigmoid"], max_length=a.max_seq_length, precompute_ref_log_probs=precompute,
                     gradient_checkpointing=a.checkpointing, bf16=a.precision == "bf16-true", use_cpu=True,
                     train_sampling_strategy="sequential", eval_strategy="no", save_strategy="no", logging_steps=1,
                     report_to="none", dataloader_num_workers=0, seed=a.seed, disable_tqdm=True)

    class PreTokenized(DPOTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):  # the ids are given: no tokenization, no EOS added
            return dataset

    step_s, losses, timing = [], [], {}

    class Times(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            step_s.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    precompute_ref = DPOTrainer._precompute_ref_logps

    def timed_precompute(self, *args_, **kw):
        t0 = time.perf_counter()
        out = precompute_ref(self, *args_, **kw)
        timing["reference_s"] = timing.get("reference_s", 0.0) + time.perf_counter() - t0
        return out

    PreTokenized._precompute_ref_logps = timed_precompute
    trainer = PreTokenized(model=model, args=args, processing_class=tok, peft_config=lora,
                           train_dataset=datasets.Dataset.from_list(batches["train"]),
                           eval_dataset=datasets.Dataset.from_list(batches["val"]))
    trainer.add_callback(Times())
    trainer.train()
    repacked = sum(bool(getattr(getattr(getattr(m, "weight", None), "quant_state", None), "packing_format_for_cpu",
                                False)) for m in model.modules())
    assert repacked == 0, f"{repacked} 4-bit layers were repacked for CPU inference: their gradients stopped"
    return dict(step_s=step_s, losses=losses, rss_loaded_gb=rss_loaded, **timing)


def child(side: str, folder: Path, data: Path, a: argparse.Namespace) -> None:
    out = run_ours(folder, data, a) if side == "ours" else run_trl(folder, data, a, precompute=side != "trl")
    out.update(side=side, peak_rss_gb=status_gb("VmHWM"))
    print("RESULT " + json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="SmolLM2-135M", help="a named config (random weights of its shape) or 'demo'")
    p.add_argument("--quantize", default="bnb.nf4-dq")
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-true"])
    p.add_argument("--pairs", type=int, default=4, help="pairs per step (micro batch = batch)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--length", type=int, default=256, help="the longest prompt + answer in words (= tokens)")
    p.add_argument("--max_seq_length", type=int, default=0, help="both sides' maximum length (default: --length)")
    p.add_argument("--checkpointing", type=lambda s: s.lower() == "true", default=False,
                   help="activation / gradient checkpointing on both sides")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--out_dir", default="", help="where the model and pairs are written once")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    a.max_seq_length = a.max_seq_length or a.length
    work = Path(a.out_dir or Path(tempfile.gettempdir()) / f"bench-dpo-trl-{a.model}")
    folder, data = work / "model", work / f"pairs-{a.pairs}x{a.steps}x{a.length}"
    if a.child:
        return child(a.child, folder, data, a)
    make_model(folder, a.model)
    if not (data.parent / (data.name + "-batches.json")).is_file():
        from lit_qlora.config import Config
        from lit_qlora.convert import ensure_converted

        ensure_converted(folder, quiet=True)  # finetune/dpo.py would convert it in its own timed process
        vocab = Config.from_file(folder / "model_config.json").vocab_size
        make_pairs(data, a.pairs * a.steps, a.length, vocab, seed=a.seed)
        write_batches(folder, data, a)
    tokens = json.loads((data.parent / (data.name + "-batches.json")).read_text())["tokens"]
    print(f"model: {a.model} shape, random weights, {a.quantize}, {a.precision}, LoRA r 8 alpha 16 on q,k,v,o,gate,"
          f"up,down, AdamW lr 1e-4; {a.steps} steps of {a.pairs} pairs (max {a.max_seq_length} tokens, "
          f"{statistics.mean(tokens):.0f} real tokens per step), DPO beta 0.1, checkpointing "
          f"{'on' if a.checkpointing else 'off'}\nCPU: {cpu_description()}")
    results = {}
    for side in a.sides.split(","):
        argv = [sys.executable, __file__, "--child", side, *sum(([f"--{k}", str(v)] for k, v in vars(a).items()
                                                                 if k not in ("child", "sides")), [])]
        r = subprocess.run(argv, capture_output=True, text=True)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"side {side} failed:\n{r.stderr[-4000:]}")
        results[side] = json.loads(line[len("RESULT "):])
    print("\n| side | step s (median) | tokens/s | reference pass s | tokens/s with it | peak RSS GB | RSS after load "
          "GB | loss first / last |\n|---|---|---|---|---|---|---|---|")
    for side, r in results.items():
        steps = r["step_s"]
        median = statistics.median(steps[1:] or steps)
        ref = r.get("reference_s", 0.0)
        with_ref = sum(tokens) / (sum(steps) + ref)
        print(f"| {side} | {median:.3f} | {statistics.mean(tokens) / median:.0f} | {ref:.2f} | {with_ref:.0f} | "
              f"{r['peak_rss_gb']:.3f} | {r['rss_loaded_gb']:.3f} | {r['losses'][0]:.4f} / {r['losses'][-1]:.4f} |")
    if "ours" in results:
        o = results["ours"]

        def median(r: dict) -> float:
            return statistics.median(r["step_s"][1:] or r["step_s"])

        def total(r: dict) -> float:
            return sum(r["step_s"]) + r.get("reference_s", 0.0)

        for side in (s for s in results if s != "ours"):
            t = results[side]
            print(f"ours vs {side}: {median(t) / median(o):.2f}x its tokens/s (steps), {total(t) / total(o):.2f}x with "
                  f"the reference pass, {o['peak_rss_gb'] / t['peak_rss_gb']:.2f}x its peak RSS")


if __name__ == "__main__":
    main()
