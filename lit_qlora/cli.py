"""`lit-qlora <command> ...`: the project's scripts behind one console command.

The scripts stay where the README shows them and remain runnable as `python finetune/lora.py ...`; this entry point
runs the very same file with the same arguments, so both ways behave identically. The scripts live in the source tree
(finetune/, generate/, scripts/), so the command works from an editable install of a checkout (`pip install -e .`).
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "finetune": ("finetune/lora.py", "fine-tune with LoRA / QLoRA"),
    "generate": ("generate/lora.py", "generate with a LoRA adapter"),
    "generate-base": ("generate/base.py", "generate with the base model"),
    "chat": ("generate/chat.py", "chat in the terminal"),
    "convert": ("scripts/convert_hf_checkpoint.py", "convert a Hugging Face checkpoint"),
    "prepare": ("scripts/prepare_json.py", "prepare a JSON / JSONL / CSV data set"),
    "prepare-alpaca": ("scripts/prepare_alpaca.py", "prepare an Alpaca data set"),
    "quantize": ("scripts/quantize_checkpoint.py", "quantize a checkpoint once, for fast CPU loads with --quantize"),
    "merge": ("scripts/merge_lora.py", "merge an adapter into its base"),
    "export-hf": ("scripts/export_hf.py", "export a (merged) model as a transformers folder"),
    "export-peft": ("scripts/export_peft.py", "export an adapter as a PEFT folder"),
    "export-gguf": ("scripts/export_gguf.py", "export a model (or an adapter) as a GGUF file for llama.cpp"),
    "estimate-memory": ("scripts/estimate_memory.py", "predict the peak training memory"),
    "evaluate": ("scripts/evaluate.py", "score a model (with an adapter) on lm-evaluation-harness tasks"),
    "report": ("scripts/report.py", "one run's report (report.md + report.png), or a run_matrix.sh table"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help}  (python {path})" for name, (path, help) in COMMANDS.items()]
    return "usage: lit-qlora <command> [--help] [options]\n\ncommands:\n" + "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        sys.exit(2)
    script = ROOT / COMMANDS[command][0]
    if not script.is_file():
        print(f"error: {script} is not here: the scripts ship with the source tree; install lit-qlora from a checkout "
              "with `pip install -e .`", file=sys.stderr)
        sys.exit(2)
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
