"""Score a model (quantized or not, with or without a LoRA adapter) on lm-evaluation-harness tasks.

    python scripts/evaluate.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-hf \
        --lora_path out/lora/alpaca/lit_model_lora_finetuned.pth --quantize bnb.nf4 --tasks hellaswag,arc_easy \
        --limit 200 --out_dir out/eval/alpaca
    python scripts/evaluate.py --tasks my_task --include_path my_tasks/ --log_samples true   # a folder of task YAMLs

Writes out_dir/results.json (lm-eval's results) and out_dir/results.md (its table, also printed); with
--log_samples lm-eval's per-sample files (each choice's log-likelihood) under out_dir/lit-qlora/. Needs lm-eval
(`pip install 'lit-qlora[eval]'`); its tasks download their data sets unless they are local.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from lit_qlora import demo
from lit_qlora.inference import load_for_inference, pick_device, resolve_generation_precision
from lit_qlora.utils import UserError, run_cli


def main(
    checkpoint_dir: Optional[Path] = None,
    lora_path: Optional[Path] = None,
    quantize: Optional[str] = None,
    precision: str = "auto",
    tasks: str = "",
    include_path: Optional[Path] = None,
    num_fewshot: Optional[int] = None,
    limit: Optional[float] = None,
    batch_size: int = 8,
    max_gen_toks: int = 256,
    merge: bool = True,
    accelerator: str = "auto",
    seed: int = 1234,
    out_dir: Path = Path("out/eval"),
    log_samples: bool = False,
) -> None:
    """Evaluate with lm-evaluation-harness.

    Args:
        checkpoint_dir: the base model (left out: the demo model).
        lora_path: an adapter file written by finetune/lora.py or a PEFT folder; left out: the base model alone.
        quantize: bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq or bnb.int8 (as the adapter was trained, to score what
            generate/lora.py runs).
        precision: auto (bf16 where the device computes it natively, else fp32), 32-true, 16-true, bf16-true,
            16-mixed or bf16-mixed.
        tasks: comma-separated lm-eval task (or group) names.
        include_path: a folder of task YAMLs lm-eval reads besides its own (its --include_path).
        num_fewshot: examples in each prompt (default: the task's).
        limit: at most this many documents per task (a fraction below 1: that share of them).
        batch_size: sequences per forward pass when scoring.
        max_gen_toks: the most tokens a generation task generates when it sets no max_gen_toks of its own.
        merge: add the adapter to the weights before quantizing (what generate/lora.py runs); false keeps LoRA layers.
        seed: lm-eval's seeds (few-shot sampling).
        out_dir: where results.json, results.md and the per-sample files go.
        log_samples: also write each document's requests and responses (lm-eval's samples_<task>_<date>.jsonl).
    """
    from lit_qlora.train.evaluate import LitLM, run_tasks  # needs lm-eval: a one-line error without it

    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise UserError("--tasks is empty; give lm-eval task names, e.g. --tasks arc_easy,hellaswag")
    if checkpoint_dir is None:
        checkpoint_dir = demo.ensure_demo_checkpoint()
    device = pick_device(accelerator)
    precision, why = resolve_generation_precision(precision, device)
    model, tokenizer, _ = load_for_inference(Path(checkpoint_dir), Path(lora_path) if lora_path else None, quantize,
                                             precision, device, merge, precision_why=why)
    lm = LitLM(model, tokenizer, device, precision, batch_size=batch_size, max_gen_toks=max_gen_toks)
    run_tasks(lm, names, include_path, num_fewshot, limit, log_samples, Path(out_dir), seed)
    print((Path(out_dir) / "results.md").read_text())
    print(f"Results in {Path(out_dir) / 'results.json'}"
          + (f", per-sample files in {Path(out_dir) / 'lit-qlora'}" if log_samples else ""), file=sys.stderr)


if __name__ == "__main__":
    run_cli(main)
