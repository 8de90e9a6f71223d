"""The embedded default: a tiny Llama-shaped model and tokenizer built locally with fixed seeds, and the bundled
instruction data, so `python finetune/lora.py` with no arguments runs end to end without any download.

The base model is pretrained for a few seconds at build time on the training split of the demo tasks written as
plain text ("Reverse the word. happy => yppah"), never on the validation split. LoRA fine-tuning then teaches
it to answer in the instruction format, which a randomly initialized base could barely learn in minutes.
"""
from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import tokenizers
import torch

from lit_qlora.checkpoint import LIT_WEIGHTS, write_safetensors_stream
from lit_qlora.config import Config
from lit_qlora.convert import write_random_checkpoint
from lit_qlora.data.batching import collate
from lit_qlora.data.records import split
from lit_qlora.data.templates import get_template
from lit_qlora.loader import load_model
from lit_qlora.tokenizer import Tokenizer
from lit_qlora.train.training import shift_labels

DEMO_CHECKPOINT = Path("checkpoints/lit-qlora/demo")
DEMO_DATA_DIR = Path("data/demo")
DEMO_DATA_FILE = Path(__file__).parent / "demo_data.json"
PRESET = Path(__file__).parent / "finetune.yaml"  # what `python finetune/lora.py` with no --checkpoint_dir runs
DEMO_PROMPT = ("Add the numbers.", "7 + 5")

DEMO_CONFIG = dict(name="lit-qlora-demo", hf_architecture="LlamaForCausalLM", block_size=256, vocab_size=384, n_layer=4,
                   n_head=4, n_query_groups=2, n_embd=256, intermediate_size=704, norm_eps=1e-5)


def ensure_demo_checkpoint(folder: Path = DEMO_CHECKPOINT, pretrain: bool = True) -> Path:
    """Write the demo model and tokenizer into `folder` unless they are there already (`pretrain` False: the random
    weights, for benchmarks where what the model knows does not matter)."""
    folder = Path(folder)
    ready = folder / ".demo-ready"  # written last: a build killed halfway is redone
    if ready.is_file() and (folder / LIT_WEIGHTS).is_file():
        return folder
    print(f"Building the demo model and tokenizer in {folder} (fixed seeds, no download) ...", file=sys.stderr)
    folder.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(folder)
    config = Config(**DEMO_CONFIG)
    write_random_checkpoint(folder, config, seed=1234)
    if pretrain:
        _pretrain(folder, config)
    ready.write_text("")
    return folder


def ensure_demo_data(folder: Path = DEMO_DATA_DIR) -> Path:
    folder = Path(folder)
    if not (folder / DEMO_DATA_FILE.name).is_file():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(DEMO_DATA_FILE, folder / DEMO_DATA_FILE.name)
    return folder


def _pretrain(folder: Path, config: Config, steps: int = 300, batch_size: int = 16, seed: int = 1234) -> None:
    """Full-parameter language-model training of the demo base on the demo tasks' training split (fp32, ~20 s)."""
    tok = Tokenizer(folder)
    records, _ = split(json.loads(DEMO_DATA_FILE.read_text()), 0.05, 42)  # the split finetune/lora.py validates on
    texts = [" ".join(x for x in (r["instruction"], r.get("input", "")) if x) + " => " + r["output"] for r in records]
    samples = [{"input_ids": (ids := tok.encode(t, eos=True)), "labels": ids} for t in texts]
    torch.manual_seed(seed)
    model = load_model(folder, precision="32-true").train()
    for p in model.parameters():
        p.requires_grad = True
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        idx = torch.randint(len(samples), (batch_size,), generator=g).tolist()
        batch = collate([samples[i] for i in idx], pad_id=tok.eos_id, ignore_index=-100)
        logits = model(batch["input_ids"])
        targets = shift_labels(batch["labels"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = 3e-3 * 0.5 * (1 + math.cos(math.pi * step / steps))
        opt.step()
        opt.zero_grad()
    print(f"Pretrained the demo base for {steps} steps (final loss {loss.item():.2f})", file=sys.stderr)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    specs = [(k, v.shape, v.dtype) for k, v in sd.items()]
    write_safetensors_stream(folder / LIT_WEIGHTS, specs, iter(sd.items()))


def _write_tokenizer(folder: Path) -> None:
    """A byte-level BPE trained on the demo data: small pieces, so letters stay visible to the model."""
    records = json.loads(DEMO_DATA_FILE.read_text())
    template = get_template("alpaca")
    texts = [template.format(r["instruction"], r.get("input", "")) + r["output"] for r in records]
    write_bpe_tokenizer(folder, texts, DEMO_CONFIG["vocab_size"], DEMO_CONFIG["block_size"])


def write_bpe_tokenizer(folder: Path, texts: list[str], vocab_size: int, block_size: int) -> None:
    """`folder`/tokenizer.json + tokenizer_config.json: a byte-level BPE of `vocab_size` pieces trained on `texts`,
    with <unk> <s> </s> <pad> as its first ids (a BOS added, no EOS)."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True,
         "add_eos_token": False, "model_max_length": block_size}, indent=2))
