"""Convert a Hugging Face model folder into our checkpoint, written beside the original files.

    python scripts/convert_hf_checkpoint.py --checkpoint_dir checkpoints/TinyLlama-1.1B-Chat-v1.0 [--dtype bf16]

Writes `lit_model.safetensors` (our key names) and `model_config.json` into --checkpoint_dir. The scripts that take
--checkpoint_dir convert on first use, so running this by hand is only needed to re-convert or change the dtype.
"""
import sys
from pathlib import Path
from typing import Literal, Optional

import torch

from lit_qlora.checkpoint import LIT_CONFIG
from lit_qlora.convert import convert_hf_checkpoint
from lit_qlora.utils import UserError, run_cli

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def convert(checkpoint_dir: Path, dtype: Optional[Literal["bf16", "fp16", "fp32"]] = None) -> None:
    """Convert the Hugging Face checkpoint in a folder.

    Args:
        checkpoint_dir: Folder with config.json and *.safetensors or pytorch_model*.bin (sharded or not).
        dtype: Store the weights in this dtype. Default: keep the dtype of the original weights.
    """
    if not checkpoint_dir.is_dir():
        raise UserError(f"checkpoint folder {checkpoint_dir} does not exist; pass --checkpoint_dir with a downloaded "
                        "model folder")
    out = convert_hf_checkpoint(checkpoint_dir, dtype=DTYPES[dtype] if dtype else None)
    size_gb = out.stat().st_size / 2**30
    print(f"Wrote {out} ({size_gb:.2f} GiB) and {checkpoint_dir / LIT_CONFIG}", file=sys.stderr)


if __name__ == "__main__":
    run_cli(convert)
