"""Merge a LoRA adapter into the full-precision base weights and write a new checkpoint folder.

    python scripts/merge_lora.py --checkpoint_dir checkpoints/TinyLlama-1.1B-Chat-v1.0 \\
        --lora_path out/lora/lit_model_lora_finetuned.pth --out_dir out/merged

The base weights are read from --checkpoint_dir/lit_model.safetensors as stored (never dequantized), so an
adapter trained on a quantized base merges without rounding. --out_dir gets lit_model.safetensors,
model_config.json and the tokenizer files: use it as --checkpoint_dir of generate/finetune (with or without
--quantize) or export it with scripts/export_hf.py.
"""
import sys
from pathlib import Path

from lit_qlora.export.merge import merge_checkpoint
from lit_qlora.utils import run_cli


def merge(checkpoint_dir: Path, lora_path: Path, out_dir: Path) -> None:
    """Merge a LoRA adapter into its base model.

    Args:
        checkpoint_dir: The base model folder the adapter was trained on.
        lora_path: The adapter: a lit_model_lora_finetuned.pth file (or a step checkpoint) or a PEFT adapter folder.
        out_dir: Folder for the merged checkpoint (must differ from checkpoint_dir).
    """
    merge_checkpoint(checkpoint_dir, lora_path, out_dir)
    print(f"Wrote the merged checkpoint to {out_dir}", file=sys.stderr)


if __name__ == "__main__":
    run_cli(merge)
