"""Export a model as one GGUF file for llama.cpp, Ollama or LM Studio, optionally with a LoRA adapter merged in, or
the adapter alone as a GGUF LoRA file (llama.cpp's --lora).

    python scripts/export_gguf.py --checkpoint_dir checkpoints/TinyLlama-1.1B-Chat-v1.0 \\
        --lora_path out/lora/lit_model_lora_finetuned.pth --out_file out/tinyllama-alpaca.gguf --dtype q8_0
    llama-cli -m out/tinyllama-alpaca.gguf -p "Recommend a movie for tonight"

Supported: Llama 2/3/3.x, TinyLlama, SmolLM2, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, Mixtral, gpt-oss (MXFP4 experts
kept MXFP4), Phi-3/Phi-4, Gemma 2 and Gemma 3 text (tutorials/export_gguf.md). The adapter is merged into the
full-precision weights of --checkpoint_dir (never into quantized ones).
"""
import sys
from pathlib import Path
from typing import Optional

from lit_qlora.export.gguf_export import export_gguf
from lit_qlora.utils import run_cli


def export(checkpoint_dir: Path, out_file: Path, lora_path: Optional[Path] = None, dtype: str = "f16",
           lora_only: bool = False, overwrite: bool = False) -> None:
    """Write a GGUF file.

    Args:
        checkpoint_dir: The (base) model folder, with its tokenizer files.
        out_file: The GGUF file to write (e.g. model.gguf); it is written under a temporary name, then renamed.
        lora_path: An adapter to merge first (a .pth adapter file or a PEFT folder); without it the base model is
            exported.
        dtype: Weights in the file: f16, bf16, f32 or q8_0 (8-bit blocks, about half of f16). Norms stay f32.
        lora_only: Write the adapter of --lora_path alone as a GGUF LoRA file, for llama.cpp's --lora on top of the
            base model exported without an adapter (--dtype f16, bf16 or f32).
        overwrite: Replace --out_file if it exists.
    """
    export_gguf(checkpoint_dir, out_file, adapter=lora_path, dtype=dtype, lora_only=lora_only, overwrite=overwrite)
    kind = "LoRA adapter" if lora_only else f"{dtype} model"
    size = out_file.stat().st_size
    size_text = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"
    print(f"Wrote the {kind} {out_file} ({size_text})", file=sys.stderr)


if __name__ == "__main__":
    run_cli(export)
