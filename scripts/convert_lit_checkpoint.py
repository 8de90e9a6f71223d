"""Export our checkpoint back to a Hugging Face folder that `transformers` loads.

    python scripts/convert_lit_checkpoint.py --checkpoint_dir checkpoints/TinyLlama-1.1B-Chat-v1.0 \
        --out_dir out/hf-export

Writes config.json + model.safetensors into --out_dir and copies the tokenizer files of --checkpoint_dir.
"""
import shutil
import sys
from pathlib import Path
from typing import Optional

from lit_qlora.checkpoint import LIT_CONFIG, LIT_WEIGHTS
from lit_qlora.convert import convert_lit_checkpoint
from lit_qlora.utils import UserError, run_cli

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt")


def export(checkpoint_dir: Path, out_dir: Path, weights: Optional[Path] = None) -> None:
    """Export our checkpoint (model_config.json + lit_model.safetensors) as a Hugging Face model folder.

    Args:
        checkpoint_dir: Folder with model_config.json and lit_model.safetensors (and the tokenizer files to copy).
        out_dir: Folder to write config.json, model.safetensors and the tokenizer files into.
        weights: Our weights file to export instead of checkpoint_dir/lit_model.safetensors (e.g. merged fine-tuned
            weights).
    """
    if not checkpoint_dir.is_dir():
        raise UserError(f"checkpoint folder {checkpoint_dir} does not exist; pass --checkpoint_dir with a converted "
                        "model folder")
    weights = weights or checkpoint_dir / LIT_WEIGHTS
    for f in (checkpoint_dir / LIT_CONFIG, weights):
        if not f.is_file():
            raise UserError(f"{f} not found; convert the model first with scripts/convert_hf_checkpoint.py "
                            f"--checkpoint_dir {checkpoint_dir}")
    if out_dir.resolve() == checkpoint_dir.resolve():
        raise UserError(f"--out_dir {out_dir} is the checkpoint folder itself; pass a different --out_dir so the "
                        "original files stay intact")
    convert_lit_checkpoint(checkpoint_dir, out_dir, weights=weights)
    copied = [name for name in TOKENIZER_FILES if (checkpoint_dir / name).is_file()]
    for name in copied:
        shutil.copy2(checkpoint_dir / name, out_dir / name)
    print(f"Wrote {out_dir / 'config.json'}, {out_dir / 'model.safetensors'}"
          + (f" and copied {', '.join(copied)}" if copied else " (no tokenizer files to copy)"), file=sys.stderr)


if __name__ == "__main__":
    run_cli(export)
