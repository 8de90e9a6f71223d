"""A small *trained* checkpoint built locally, for measurements a random-weight model cannot make: a random model's
loss is ~ln(vocab) whatever its weights, so it cannot tell whether a quantization-aware start (PiSSA, LoftQ) lands
nearer the unquantized model than plain 4 bits does. No download: the text is this Python's own standard library.

    python scripts/bench/make_trained_fixture.py [--out checkpoints/lit-qlora/stdlib-fixture]
        [--data data/stdlib-fixture]

Writes `--out`: a byte-level BPE tokenizer trained on the text (tokenizer.json, tokenizer_config.json) and a
Llama-shaped model (4 layers, width 256 by default) pretrained with full-parameter AdamW for --steps steps on random
windows of the training files (bf16 on disk, as released checkpoints are), loadable by finetune/lora.py
--checkpoint_dir. Writes `--data`: held-out files (never trained on) cut into instruction / output records (the first
lines of a chunk, the lines after them) for finetune/lora.py --data_dir. Prints the loss before and after, and
ln(vocab) beside them. Fixed seeds: the same folders on every run of the same Python.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lit_qlora.checkpoint import LIT_WEIGHTS, write_safetensors_stream  # noqa: E402
from lit_qlora.config import Config  # noqa: E402
from lit_qlora.convert import write_random_checkpoint  # noqa: E402
from lit_qlora.demo import write_bpe_tokenizer  # noqa: E402
from lit_qlora.loader import load_model  # noqa: E402
from lit_qlora.tokenizer import Tokenizer  # noqa: E402


def stdlib_files(limit_bytes: int) -> tuple[list[str], list[str]]:
    """The standard library's top-level modules (sorted, tests left out), as text: about 1 in 8 files held out (by
    a hash of the name) for the fine-tuning records, the rest for pretraining, up to `limit_bytes` each side."""
    train, held = [], []
    sizes = [0, 0]
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        side = 1 if zlib.crc32(path.name.encode()) % 8 == 0 else 0
        if sizes[side] < limit_bytes:
            (held if side else train).append(text)
            sizes[side] += len(text)
    return train, held


def write_records(folder: Path, texts: list[str], n: int, lines: int = 24) -> None:
    """`n` records from the held-out files: a chunk of `lines` lines, its first quarter the instruction, the rest the
    output (what the model is trained and measured on)."""
    records = []
    for text in texts:
        rows = text.splitlines()
        for start in range(0, len(rows) - lines, lines):
            chunk = rows[start:start + lines]
            if sum(len(r) for r in chunk) < 200:
                continue
            k = lines // 4
            records.append({"instruction": "\n".join(chunk[:k]), "input": "", "output": "\n".join(chunk[k:])})
            if len(records) == n:
                break
        if len(records) == n:
            break
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "stdlib.json").write_text(json.dumps(records, indent=1))


def pretrain(folder: Path, texts: list[str], steps: int, batch_size: int, seq_len: int, lr: float,
             seed: int) -> tuple[float, float]:
    """Full-parameter next-token training on random windows of the concatenated training files, fp32, AdamW, linear
    warm-up then cosine decay. Returns the mean loss of the first and of the last 20 steps."""
    tok = Tokenizer(folder)
    ids = torch.tensor([i for t in texts for i in tok.encode(t, eos=True)], dtype=torch.long)
    torch.manual_seed(seed)
    model = load_model(folder, precision="32-true").train()
    for p in model.parameters():
        p.requires_grad = True
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(seed)
    losses = []
    warmup = max(1, steps // 20)
    for step in range(steps):
        starts = torch.randint(len(ids) - seq_len - 1, (batch_size,), generator=g)
        window = torch.stack([ids[s:s + seq_len + 1] for s in starts.tolist()])
        logits = model(window[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        done = (step - warmup) / (steps - warmup)
        scale = (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * done))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:5d} loss {loss.item():.3f}", file=sys.stderr, flush=True)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    write_safetensors_stream(folder / LIT_WEIGHTS, [(k, v.shape, v.dtype) for k, v in sd.items()], iter(sd.items()))
    return sum(losses[:20]) / len(losses[:20]), sum(losses[-20:]) / len(losses[-20:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "checkpoints/lit-qlora/stdlib-fixture")
    p.add_argument("--data", type=Path, default=ROOT / "data/stdlib-fixture")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--vocab_size", type=int, default=2048)
    p.add_argument("--corpus_mb", type=float, default=4.0,
                   help="text read for pretraining (and at most as much held out)")
    p.add_argument("--records", type=int, default=256)
    p.add_argument("--seed", type=int, default=1234)
    a = p.parse_args()
    train, held = stdlib_files(int(a.corpus_mb * 2**20))
    a.out.mkdir(parents=True, exist_ok=True)
    block_size = 256
    write_bpe_tokenizer(a.out, train, a.vocab_size, block_size)
    heads = a.n_embd // 64
    config = Config(name="stdlib-fixture", hf_architecture="LlamaForCausalLM", block_size=block_size,
                    vocab_size=a.vocab_size, n_layer=a.n_layer, n_head=heads, n_query_groups=heads // 2,
                    n_embd=a.n_embd, intermediate_size=int(a.n_embd * 8 / 3 + 63) // 64 * 64, norm_eps=1e-5)
    write_random_checkpoint(a.out, config, seed=a.seed)
    first, last = pretrain(a.out, train, a.steps, a.batch_size, min(a.seq_len, block_size), a.lr, a.seed)
    write_records(a.data, held, a.records)
    print(f"pretrained {a.steps} steps: loss {first:.3f} -> {last:.3f} (ln(vocab) = {math.log(a.vocab_size):.3f}); "
          f"wrote {a.out} and {a.data}")


if __name__ == "__main__":
    main()
