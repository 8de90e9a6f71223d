"""Quantize a checkpoint's Linear weights once, so that later CPU loads with --quantize read them instead.

    python scripts/quantize_checkpoint.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --quantize bnb.nf4 --precision bf16-true

On a CPU, bitsandbytes' quantizer costs far more than reading the weights (SmolLM2-135M to nf4: 4.0 s against 0.2 s
for a dense load; minutes for a 7B model), and generate/*.py, chat and finetune/lora.py paid it at every start. This
writes `<checkpoint_dir>/lit_model.<quantize>.<dtype>.safetensors` (lit_qlora/quant/prequantized.py says what is in it);
every later CPU load of that folder with the same --quantize and a --precision computing in the same dtype reads it
(the "Loaded" line names it). The output layer is stored too, for generation's 4-bit head. Run it again after
converting or merging into the folder again: a stale file is noticed and ignored (one line says so); while the file
matches, running it again does nothing.
"""
import os
import sys
import time
from pathlib import Path

from lit_qlora.checkpoint import LIT_WEIGHTS
from lit_qlora.convert import ensure_converted
from lit_qlora.loader import load_model
from lit_qlora.precision import parse_precision, resolve_precision
from lit_qlora.quant.prequantized import stored_mismatch, stored_path, write_stored
from lit_qlora.quant.quant_mode import QuantMode
from lit_qlora.quant.quantize import check_quantize
from lit_qlora.utils import UserError, run_cli


def quantize_checkpoint(checkpoint_dir: Path, quantize: str = "bnb.nf4", precision: str = "auto") -> Path:
    """Quantize a checkpoint once and store the result next to it.

    Args:
        checkpoint_dir: A converted checkpoint folder (an HF folder is converted first).
        quantize: bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq or bnb.int8: the --quantize of the later loads.
        precision: The --precision of the later loads (auto: what they would pick on this CPU). Weights are quantized
            from its compute dtype (bf16-true and bf16-mixed share one file; 32-true, 16-true/16-mixed have their own).
    """
    if QuantMode.parse(quantize) is None:
        raise UserError("--quantize none stores nothing; pass the mode the later loads use, e.g. --quantize bnb.nf4")
    precision, _ = resolve_precision(precision, "cpu")
    quantize = check_quantize(quantize, precision, "cpu")
    ensure_converted(checkpoint_dir)
    weights, dtype = Path(checkpoint_dir) / LIT_WEIGHTS, parse_precision(precision).dtype
    if stored_mismatch(weights, quantize, dtype) is None:  # nothing to do (a benchmark or a setup script rerun)
        path = stored_path(weights, quantize, dtype)
        print(f"{path} is up to date: made from this {LIT_WEIGHTS} with this bitsandbytes", file=sys.stderr)
        return path
    if not os.access(checkpoint_dir, os.W_OK):  # found before quantizing, which can take minutes
        raise UserError(f"{checkpoint_dir} is not writable, and the quantized weights are stored in it; copy the "
                        "checkpoint folder somewhere writable (or ask its owner to run this)")
    t0 = time.perf_counter()
    model = load_model(checkpoint_dir, precision=precision, quantize=quantize, quantize_lm_head=True,
                       use_stored=False)
    took = time.perf_counter() - t0
    try:
        path, layers = write_stored(model, weights, quantize, dtype)
    except OSError as e:  # written atomically: nothing half-written is left behind
        raise UserError(f"could not write the quantized weights into {checkpoint_dir}: {e.strerror or e}; free some "
                        "disk space and run this again") from None
    print(f"Quantized {layers} layers in {took:.1f}s; wrote {path} ({path.stat().st_size / 2**20:.1f} MiB). CPU loads "
          f"with --quantize {quantize} --precision {precision} now read it", file=sys.stderr)
    return path


if __name__ == "__main__":
    run_cli(quantize_checkpoint)
