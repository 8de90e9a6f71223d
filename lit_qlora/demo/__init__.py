"""The embedded default: a tiny Llama-shaped model and tokenizer built locally with fixed seeds, and the bundled
instruction data, so `python finetune/lora.py` with no arguments runs end to end without any download.

The tokenizer gives each demo instruction one token and every other character its own (lit_qlora/demo/tasks.py). The
base model is pretrained at build time (two minutes on 2 cores) on the demo tasks written as plain text over random
letter strings and number ranges ("Reverse the word. qbxe=exbq"), never on a held-out word or range, so it learns
the tasks rather than the words. LoRA fine-tuning on train.json then teaches it to answer in the instruction format,
and `python generate/lora.py` scores the base model and the fine-tuned one on every question of val.json (score.py).
"""
from __future__ import annotations

import json
import math
import random
import shutil
import sys
from pathlib import Path

import tokenizers
import torch

from lit_qlora.checkpoint import LIT_WEIGHTS, write_safetensors_stream
from lit_qlora.config import Config
from lit_qlora.convert import write_random_checkpoint
from lit_qlora.data.batching import collate
from lit_qlora.demo.tasks import INSTRUCTIONS, as_plain_text, count_range, random_question
from lit_qlora.loader import load_model
from lit_qlora.tokenizer import Tokenizer
from lit_qlora.train.training import shift_labels

DEMO_CHECKPOINT = Path("checkpoints/lit-qlora/demo")
DEMO_DATA_DIR = Path("data/demo")
HERE = Path(__file__).parent
DEMO_FILES = (HERE / "train.json", HERE / "val.json")  # the demo's fine-tuning data and its held-out set
DEMO_DATA_FILE = HERE / "demo_data.json"  # the first demo's tasks (tutorials/finetune_chat.md, bench_dpo.py)
PRESET = HERE / "finetune.yaml"  # what `python finetune/lora.py` with no --checkpoint_dir runs
DEMO_ADAPTER = Path("out/lora/demo/lit_model_lora_finetuned.pth")  # where the preset's run writes its adapter
# What the model in checkpoints/lit-qlora/demo was built by: a folder built by another version is built again.
BUILD = "3: char tokenizer, random-string pretraining, one-token separators, 1600 steps"

DEMO_CONFIG = dict(name="lit-qlora-demo", hf_architecture="LlamaForCausalLM", block_size=256, vocab_size=384, n_layer=4,
                   n_head=4, n_query_groups=2, n_embd=256, intermediate_size=704, norm_eps=1e-5)


def ensure_demo_checkpoint(folder: Path = DEMO_CHECKPOINT, pretrain: bool = True) -> Path:
    """Write the demo model and tokenizer into `folder` unless they are there already (`pretrain` False: the random
    weights, for benchmarks where what the model knows does not matter)."""
    folder = Path(folder)
    ready = folder / ".demo-ready"  # written last: a build killed halfway is redone
    built = f"{BUILD}, pretrained: {pretrain}"
    if ready.is_file() and ready.read_text() == built and (folder / LIT_WEIGHTS).is_file():
        return folder
    print(f"Building the demo model and tokenizer in {folder} (fixed seeds, no download) ...", file=sys.stderr)
    folder.mkdir(parents=True, exist_ok=True)
    write_bpe_tokenizer(folder, [], 0, DEMO_CONFIG["block_size"], added=INSTRUCTIONS)  # no merges: characters
    config = Config(**DEMO_CONFIG)
    write_random_checkpoint(folder, config, seed=1234)
    if pretrain:
        _pretrain(folder, config)
    ready.write_text(built)
    return folder


def ensure_demo_data(folder: Path = DEMO_DATA_DIR) -> Path:
    """`folder` holding the bundled train.json and val.json as they are (the copy of an earlier demo's
    demo_data.json there is removed: the folder would hold data of two splits and of none)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for src in DEMO_FILES:
        dst = folder / src.name
        if not dst.is_file() or dst.read_bytes() != src.read_bytes():
            shutil.copy(src, dst)
    stale = folder / DEMO_DATA_FILE.name
    if stale.is_file() and stale.read_bytes() == DEMO_DATA_FILE.read_bytes():
        stale.unlink()
    return folder


def _pretrain(folder: Path, config: Config, steps: int = 1600, batch_size: int = 16, lr: float = 1e-3,
              seed: int = 1234) -> None:
    """Full-parameter training of the demo base on random questions of the demo tasks written as plain text, the
    loss on the answers (fp32, about two minutes on 2 cores). No held-out word or number range is ever asked."""
    tok = Tokenizer(folder)
    held_out = json.loads(DEMO_FILES[1].read_text())
    words, ranges = {r["input"] for r in held_out}, {count_range(r) for r in held_out} - {None}
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = load_model(folder, precision="32-true").train()
    for p in model.parameters():
        p.requires_grad = True
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    for step in range(steps):
        batch = collate([_answer_sample(tok, random_question(rng, words, ranges)) for _ in range(batch_size)],
                        pad_id=tok.eos_id, ignore_index=-100)
        logits = model(batch["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shift_labels(batch["labels"]).flatten(),
                                                 ignore_index=-100)
        loss.backward()
        for group in opt.param_groups:  # warm-up, then a cosine to 0
            group["lr"] = lr * min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * step / steps))
        opt.step()
        opt.zero_grad()
    print(f"Pretrained the demo base for {steps} steps (final loss {loss.item():.3f})", file=sys.stderr)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    specs = [(k, v.shape, v.dtype) for k, v in sd.items()]
    write_safetensors_stream(folder / LIT_WEIGHTS, specs, iter(sd.items()))


def _answer_sample(tok: Tokenizer, r: dict) -> dict:
    """A pretraining sample: the question and answer as plain text, the loss on the answer and its end only."""
    question, answer = as_plain_text(r)
    ids = tok.encode(question + answer, eos=True)
    labels = ids.clone()
    labels[:len(tok.encode(question, bos=True))] = -100
    return {"input_ids": ids, "labels": labels}


def write_bpe_tokenizer(folder: Path, texts: list[str], vocab_size: int, block_size: int,
                        added: tuple[str, ...] = ()) -> None:
    """`folder`/tokenizer.json + tokenizer_config.json: a byte-level BPE of `vocab_size` pieces trained on `texts`
    (none: the 256 bytes alone), with <unk> <s> </s> <pad> as its first ids (a BOS added, no EOS) and each string of
    `added` one token of its own."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([tokenizers.AddedToken(t, normalized=False) for t in added])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True,
         "add_eos_token": False, "model_max_length": block_size}, indent=2))
