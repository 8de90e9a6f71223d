"""Benchmark: finetune/lora.py against Hugging Face PEFT + bitsandbytes on the side-by-side harness (`../shared/bench`,
not part of this repository), one after the other on the same batches, and the ratios the issues set goals on
(prints figures; not a test).

    python scripts/bench/bench_peers.py --work /tmp/bench-work --size gemma3 --precision 32-true --iters 20
    python scripts/bench/bench_peers.py --work /tmp/bench-work --size smol --lora qkvo --precision bf16-true

Builds what is missing in --work first: the harness's fixture (`make_fixture.py --size SIZE`, random weights; a few
minutes for gemma3) and the data folder `data-SIZE/` holding exactly the harness's train/val split (the peers'
`train.json` / `val.json`). Then runs `peer_hf.py` and `peer_ours.py` (this checkout, this Python), HF first, each
alone, with the settings the harness shares: LoRA r 8 / alpha 16 / dropout 0.05 on q, k, v, o (and the MLP with
`--lora all-linear`), micro batch 4, at most 256 tokens, AdamW lr 3e-4, warm-up 2, no gradient clipping; for ours
`--seed 42`, which gives the peers' data order (a seeded DataLoader's first epoch), so both see the same tokens in
every iteration (checked: the per-iteration token counts must be identical). Each run's full output goes to
--work/logs/.

Prints each runner's figures (median and mean s/iter, real tokens/s, peak RSS of the process, RSS after loading,
first and last loss) and ours / HF: peak RSS, tokens/s, and the iteration-1 loss difference in percent. Timings
are only worth comparing on a machine doing nothing else; peak RSS and losses are not affected by other load.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT.parent / "shared" / "bench"


def build_inputs(a: argparse.Namespace) -> tuple[Path, Path]:
    """The fixture and the data folder (train.json / val.json: the peers' split), made when missing."""
    fix, data = a.work / f"fixture-{a.size}", a.work / f"data-{a.size}"
    if not (fix / "fixture.json").is_file():
        print(f"[bench_peers] building the harness fixture {fix} (make_fixture.py --size {a.size})", flush=True)
        subprocess.run([a.hf_python, str(a.bench_dir / "make_fixture.py"), "--out", str(fix), "--size", a.size],
                       check=True)
    if not (data / "train.json").is_file():
        sys.path.insert(0, str(a.bench_dir))
        import benchcommon

        records = json.loads((fix / "alpaca.json").read_text())
        train, val = benchcommon.litgpt_train_split(records, 0.05, 42)
        data.mkdir(parents=True, exist_ok=True)
        (data / "train.json").write_text(json.dumps([records[i] for i in train.indices], indent=1))
        (data / "val.json").write_text(json.dumps([records[i] for i in val.indices], indent=1))
    return fix, data


def run(cmd: list[str], log: Path, env: dict | None = None, from_log: bool = False) -> dict:
    """Run one runner to `log` (or, `from_log`, read the log an earlier run left); its BENCH_JSON result: every such
    line merged, the last one winning (peer_ours.py's summary follows finetune/lora.py's own line, which alone has
    the per-iteration losses and token counts); ok false with the last line when it printed none."""
    rc = "?"
    if not from_log:
        print(f"[bench_peers] {' '.join(cmd)}\n              -> {log}", flush=True)
        with log.open("w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    lines = log.read_text().splitlines() if log.is_file() else []
    found = [json.loads(ln[len("BENCH_JSON "):]) for ln in lines if ln.startswith("BENCH_JSON ")]
    if found:
        return {k: v for d in found for k, v in d.items()}
    return {"ok": False, "error": f"exit {rc}: " + (lines[-1] if lines else "no output")}


def fmt(x, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, required=True, help="folder for the fixture, data, logs and outputs")
    p.add_argument("--size", default="gemma3", help="the harness's SIZE: small, large, smol, gemma3, tiny")
    p.add_argument("--precision", default="32-true", choices=("32-true", "bf16-true"))
    p.add_argument("--quantize", default="nf4-dq", choices=("nf4-dq", "nf4", "none"))
    p.add_argument("--lora", default="all-linear", choices=("qkvo", "all-linear"),
                   help="LoRA on q, k, v, o; all-linear adds the MLP")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup_iters", type=int, default=2, help="iterations left out of the timings")
    p.add_argument("--bench_dir", type=Path, default=BENCH, help="the harness (peer_hf.py, peer_ours.py, ...)")
    p.add_argument("--hf_python", default=sys.executable,
                   help="Python with transformers, peft, bitsandbytes, psutil (the harness's hf venv)")
    p.add_argument("--only", choices=("hf", "ours"), default=None, help="run one side only")
    p.add_argument("--from_logs", action="store_true", help="run nothing: report from the logs in --work/logs")
    a = p.parse_args()
    a.work = a.work.resolve()
    (a.work / "logs").mkdir(parents=True, exist_ok=True)
    fix, data = (a.work / f"fixture-{a.size}", a.work / f"data-{a.size}") if a.from_logs else build_inputs(a)

    common = ["--max-iters", str(a.iters), "--warmup-iters", str(a.warmup_iters), "--micro-batch-size", "4"]
    tag = f"{a.size}-{a.quantize}-{a.precision}-{a.lora}"
    results = {}
    if a.only in (None, "hf"):
        results["hf"] = run([a.hf_python, str(a.bench_dir / "peer_hf.py"), "--model-dir", str(fix),
                             "--data", str(fix / "alpaca.json"), "--quantize", a.quantize, "--precision",
                             a.precision, "--lora-target", a.lora, "--max-seq-length", "256", "--lr", "3e-4",
                             "--lr-warmup-steps", "2", *common], a.work / "logs" / f"hf-{tag}.log",
                            from_log=a.from_logs)
    if a.only in (None, "ours"):
        extra = ["--seed", "42", "--max_seq_length", "256", "--warmup_steps", "2", "--grad_clip", "null",
                 "--learning_rate", "3e-4", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.05",
                 "--lora_query", "true", "--lora_key", "true", "--lora_value", "true", "--lora_projection", "true",
                 "--lora_mlp", str(a.lora == "all-linear").lower(), "--eval_iters", "0", "--save_interval",
                 "1000000", "--packing", "false", "--bench_json", "true"]
        env = dict(os.environ, OURS_CHECKOUT=str(ROOT), OURS_PYTHON=sys.executable, OURS_EXTRA_ARGS=" ".join(extra),
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        quantize = "none" if a.quantize == "none" else f"bnb.{a.quantize}"
        results["ours"] = run([sys.executable, str(a.bench_dir / "peer_ours.py"), "--checkpoint-dir", str(fix),
                               "--data-dir", str(data), "--out-dir", str(a.work / "out" / tag), "--quantize",
                               quantize, "--precision", a.precision, "--timeout", "7200", *common],
                              a.work / "logs" / f"ours-{tag}.log", env, a.from_logs)

    print(f"\n{a.size} | {a.quantize} | {a.precision} | LoRA {a.lora} | micro batch 4 | {a.iters} iterations "
          f"({a.warmup_iters} left out of the timings)\n")
    print("| runner | s/iter median | s/iter mean | tokens/s | peak RSS GiB | RSS after load GiB | loss first -> last |"
          " status |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {fmt(r.get('s_per_iter_median'))} | {fmt(r.get('s_per_iter_mean'))} | "
              f"{fmt(r.get('tokens_per_s'), 1)} | {fmt(r.get('peak_rss_gb'), 2)} | {fmt(r.get('rss_after_load_gb'), 2)}"
              f" | {fmt(r.get('first_loss'), 4)} -> {fmt(r.get('final_loss'), 4)} | "
              f"{'ok' if r.get('ok') else 'FAILED: ' + str(r.get('error'))[:120]} |")
    h, o = results.get("hf"), results.get("ours")
    if not (h and o and h.get("ok") and o.get("ok")):
        return
    same = h.get("iter_tokens") == o.get("iter_tokens")
    print(f"\nsame batches (per-iteration token counts equal): {'yes' if same else 'NO'}"
          + ("" if same else f"\n  hf   {h.get('iter_tokens')}\n  ours {o.get('iter_tokens')}"))
    print(f"peak RSS ours / HF: {o['peak_rss_gb'] / h['peak_rss_gb']:.2f}x")
    if h.get("tokens_per_s") and o.get("tokens_per_s"):
        print(f"tokens/s ours / HF: {o['tokens_per_s'] / h['tokens_per_s']:.2f}x")
    l_h, l_o = (r.get("first_loss", r["losses"][0]) for r in (h, o))  # (peer_hf.py rounds its list to 4 places)
    print(f"iteration-1 loss: ours {l_o:.6f}, HF {l_h:.6f}: {100 * (l_o - l_h) / l_h:+.5f}%")


if __name__ == "__main__":
    main()
