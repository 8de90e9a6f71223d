"""Export a lit-qlora LoRA adapter as a Hugging Face PEFT adapter folder.

    python scripts/export_peft.py --checkpoint_dir checkpoints/TinyLlama-1.1B-Chat-v1.0 \\
        --lora_path out/lora/lit_model_lora_finetuned.pth --out_dir out/peft-adapter

--out_dir gets adapter_model.safetensors + adapter_config.json; load them with
`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint_dir), out_dir)`.
"""
import sys
from pathlib import Path

from lit_qlora.adapter import Adapter
from lit_qlora.convert import ensure_converted
from lit_qlora.utils import run_cli


def export(lora_path: Path, checkpoint_dir: Path, out_dir: Path) -> None:
    """Write a PEFT LoRA folder equivalent to a lit-qlora adapter.

    Args:
        lora_path: The adapter file (lit_model_lora_finetuned.pth or a step checkpoint).
        checkpoint_dir: The base model folder the adapter was trained on.
        out_dir: Folder for adapter_model.safetensors and adapter_config.json.
    """
    config = ensure_converted(checkpoint_dir)
    adapter = Adapter.load(lora_path, config)
    adapter.export_peft(config, out_dir, base_model_name_or_path=str(checkpoint_dir))
    print(f"Wrote {out_dir / 'adapter_model.safetensors'} and {out_dir / 'adapter_config.json'}", file=sys.stderr)


if __name__ == "__main__":
    run_cli(export)
