"""Export a model as a Hugging Face transformers folder, optionally with a LoRA adapter merged in.

    python scripts/export_hf.py --checkpoint_dir checkpoints/TinyLlama-1.1B-Chat-v1.0 \\
        --lora_path out/lora/lit_model_lora_finetuned.pth --out_dir out/hf-merged

--out_dir gets config.json, model.safetensors and the tokenizer files; it loads with
`AutoModelForCausalLM.from_pretrained(out_dir)`.
"""
import sys
from pathlib import Path
from typing import Optional

from lit_qlora.export.merge import export_hf
from lit_qlora.utils import run_cli


def export(checkpoint_dir: Path, out_dir: Path, lora_path: Optional[Path] = None) -> None:
    """Write a transformers model folder.

    Args:
        checkpoint_dir: The (base) model folder.
        out_dir: Folder for config.json, model.safetensors and the tokenizer files (must differ from checkpoint_dir).
        lora_path: An adapter to merge first (a .pth adapter file or a PEFT folder); without it the base model is
            exported.
    """
    export_hf(checkpoint_dir, out_dir, adapter=lora_path)
    print(f"Wrote {out_dir / 'config.json'} and {out_dir / 'model.safetensors'}", file=sys.stderr)


if __name__ == "__main__":
    run_cli(export)
