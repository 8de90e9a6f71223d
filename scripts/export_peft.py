"""Export a lit-qlora LoRA adapter as a Hugging Face PEFT adapter folder.

    python scripts/export_peft.py --checkpoint_dir checkpoints/TinyLlama-1.1B-Chat-v1.0 \\
        --lora_path out/lora/lit_model_lora_finetuned.pth --out_dir out/peft-adapter

--out_dir gets adapter_model.safetensors + adapter_config.json; load them with
`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint_dir), out_dir)`.

A PiSSA / OLoRA / LoftQ adapter is exported as a plain LoRA over the original base (rank 2r: `Adapter.as_plain_lora`).
For LoftQ that reproduces the trained model up to the quantization error of the residual it trained over (what LoftQ
minimizes, not zero): one line says so, with that error measured on the base's weights, relative, per adapted layer.
"""
import sys
from pathlib import Path

from lit_qlora.adapter import Adapter
from lit_qlora.checkpoint import LIT_WEIGHTS, read_safetensors
from lit_qlora.config import Config
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
    if adapter.config.init == "loftq":
        print(loftq_note(adapter, checkpoint_dir, config), file=sys.stderr)


def loftq_note(adapter: Adapter, checkpoint_dir: Path, config: Config) -> str:
    """One line: what the exported LoftQ adapter gives up, measured on the base checkpoint's weights."""
    mode = adapter.train.get("quantize")
    what = ("LoftQ adapter exported as a plain LoRA over the original weights: it reproduces the trained model up to "
            "the quantization error of the residual it trained over")
    if not mode:
        return f"{what} (not measured: the adapter does not record its --quantize)"
    keys = {m + ".weight" for m in adapter.targets()}
    tied = config.tie_embeddings and "lm_head.weight" in keys  # a tied head is the embedding's tensor
    if tied:
        keys.add("transformer.wte.weight")
    tensors = ((("lm_head.weight" if tied and k == "transformer.wte.weight" else k), t)
               for k, t in read_safetensors(Path(checkpoint_dir) / LIT_WEIGHTS, keys))
    gaps = adapter.export_gap(tensors)
    worst = max(gaps, key=gaps.get)
    mean = sum(gaps.values()) / len(gaps)
    return (f"{what} ({mode}): ||trained - exported|| / ||trained weight|| mean {mean:.2%} over {len(gaps)} layers, "
            f"largest {gaps[worst]:.2%} ({worst})")


if __name__ == "__main__":
    run_cli(export)
