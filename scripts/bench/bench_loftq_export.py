"""What a LoftQ adapter's PEFT export gives up, measured: the trained model (the adapter over its 4-bit residual, as it
trained) against the exported one (`Adapter.as_plain_lora`, a plain LoRA over the original full-precision weights, as
scripts/export_peft.py writes it), the original base, and the merge; and how much closer the export would come with a
rank-k SVD of each adapted layer's quantization error folded into it (not offered as an option: see the figures).

    python scripts/bench/bench_loftq_export.py --checkpoint_dir DIR --data_dir DIR --lora_path ADAPTER.pth \\
        [--batches 8] [--fold_ranks 8,32,64]

Figures: KL(trained || model) and the loss on the target tokens of the first --batches of finetune's batches (the
data prepared as finetune prepares it, plain template), and export_peft.py's per-layer weight gap.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lit_qlora.adapter import Adapter  # noqa: E402
from lit_qlora.checkpoint import LIT_WEIGHTS, read_safetensors  # noqa: E402
from lit_qlora.convert import ensure_converted  # noqa: E402
from lit_qlora.data.batching import BatchStream  # noqa: E402
from lit_qlora.data.prepare import DataSettings, ensure_prepared  # noqa: E402
from lit_qlora.loader import load_model, load_model_with_adapter  # noqa: E402
from lit_qlora.lora import lora_modules  # noqa: E402
from lit_qlora.quant.quantize import dequantize_weight  # noqa: E402
from lit_qlora.tokenizer import Tokenizer  # noqa: E402
from lit_qlora.train.training import shift_labels  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint_dir", type=Path, required=True)
    p.add_argument("--data_dir", type=Path, required=True)
    p.add_argument("--lora_path", type=Path, required=True)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--micro_batch_size", type=int, default=2)
    p.add_argument("--max_seq_length", type=int, default=256)
    p.add_argument("--fold_ranks", default="8,32,64")
    a = p.parse_args()
    ckpt = a.checkpoint_dir
    config = ensure_converted(ckpt)
    adapter = Adapter.load(a.lora_path, config)
    mode = adapter.train.get("quantize")
    if adapter.config.init != "loftq" or not mode:
        raise SystemExit("--lora_path must be a LoftQ adapter that records its --quantize")
    tokenizer = Tokenizer(ckpt)
    train, _, _ = ensure_prepared(a.data_dir, tokenizer,
                                  DataSettings(min(a.max_seq_length, config.block_size), template="plain"))
    stream = BatchStream(train, batch_size=a.micro_batch_size, seed=1337, pad_id=tokenizer.eos_id or 0)
    batches = [next(stream) for _ in range(a.batches)]

    @torch.no_grad()
    def measure(model) -> tuple[torch.Tensor, float]:
        logps, nll, n = [], 0.0, 0
        for batch in batches:
            keep = torch.arange(batch["input_ids"].shape[1])[None] < batch["lengths"][:, None]
            logits = model.eval()(batch["input_ids"])
            y = shift_labels(batch["labels"])
            nll += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
            n += int((y != -100).sum())
            logps.append(logits[keep].log_softmax(-1))
        return torch.cat(logps), nll / n

    trained_model = load_model_with_adapter(ckpt, adapter, precision="32-true", quantize=mode)
    trained, trained_loss = measure(trained_model)
    errors = {}  # module -> dequantized residual - residual: what the export gives up in that layer
    stored = dict(read_safetensors(ckpt / LIT_WEIGHTS, {m + ".weight" for m in adapter.targets()}))
    for name, m in lora_modules(trained_model).items():
        w = stored[name + ".weight"].float()
        residual = w + adapter.delta(name, tuple(w.shape), initial_only=True)
        errors[name] = dequantize_weight(m.base).float() - residual
    del trained_model
    gaps = adapter.export_gap(stored.items())

    def row(name: str, lp: torch.Tensor, loss: float) -> None:
        kl = float((trained.exp() * (trained - lp)).sum(-1).mean())
        print(f"{name:34s} {kl:12.3e} {loss:8.4f} {loss - trained_loss:+8.4f}")

    print(f"{'model':34s} {'KL(trained||)':>12s} {'loss':>8s} {'-trained':>8s}")
    row("trained (adapter over its residual)", trained, trained_loss)
    row("original base", *measure(load_model(ckpt, precision="32-true")))
    row("merged (scripts/merge_lora.py)", *measure(load_model(ckpt, precision="32-true", merge_adapter=adapter)))
    exported = load_model_with_adapter(ckpt, adapter.as_plain_lora(), precision="32-true")
    row("exported (plain LoRA over W)", *measure(exported))
    for k in (int(x) for x in a.fold_ranks.split(",") if x):
        energy = []
        with torch.no_grad():
            for name, m in lora_modules(exported).items():
                U, S, Vh = torch.linalg.svd(errors[name], full_matrices=False)
                fold = (U[:, :k] * S[:k]) @ Vh[:k]
                energy.append(float(S[:k].square().sum() / S.square().sum()))
                m.base.weight += fold
            lp, loss = measure(exported)
            for name, m in lora_modules(exported).items():  # back to the plain export
                U, S, Vh = torch.linalg.svd(errors[name], full_matrices=False)
                m.base.weight -= (U[:, :k] * S[:k]) @ Vh[:k]
        row(f"exported + rank-{k} error ({sum(energy) / len(energy):.0%})", lp, loss)
    print(f"weight gap ||trained - exported|| / ||trained|| per adapted layer ({mode}): mean "
          f"{sum(gaps.values()) / len(gaps):.2%}, largest {max(gaps.values()):.2%}; rank-k rows: the export with each "
          "layer's best rank-k approximation of its quantization error added (the share of the error's energy it "
          "holds), i.e. a LoRA of rank 2r + k")


if __name__ == "__main__":
    main()
