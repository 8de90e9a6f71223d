"""Generate the demo's data files (deterministic: re-running it rewrites identical files).

    python lit_qlora/demo/make_demo_data.py

train.json and val.json: the demo's fine-tuning questions and its held-out set (lit_qlora/demo/tasks.py), which
`python finetune/lora.py` trains and validates on and `python generate/lora.py` scores.

demo_data.json: the ~400 Alpaca-format tasks of the first demo (string reversal, upper-casing, small sums, next letter,
repetition, opposites, counting), kept as they were because tutorials/finetune_chat.md and
scripts/bench/bench_dpo.py build their data from them.
"""
from __future__ import annotations

import json
import random
import string
from pathlib import Path

from lit_qlora.demo.tasks import split

SEED = 1234
HERE = Path(__file__).parent
OUT = HERE / "demo_data.json"

WORDS = """cat dog sun moon tree bird fish star rain snow book lamp door road milk cake bread apple
lemon grape river stone cloud green blue red black white happy quick slow warm cold house mouse
horse sheep goat frog duck bear lion wolf fox owl bee ant hat shoe coat ring bell drum song word
game ball kite boat ship car bus train plane time day night food water fire wind leaf rose seed
sand hill lake sea map pen cup box key egg ice jam king queen city farm park shop""".split()

OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("old", "new"),
             ("happy", "sad"), ("open", "closed"), ("day", "night"), ("left", "right"), ("yes", "no"),
             ("in", "out"), ("on", "off"), ("full", "empty"), ("high", "low"), ("wet", "dry"),
             ("light", "dark"), ("early", "late"), ("good", "bad"), ("first", "last"), ("hard", "soft")]


def record(instruction: str, input: str, output: str) -> dict:
    return {"instruction": instruction, "input": input, "output": output}


def build(rng: random.Random) -> list[dict]:
    # Sample without replacement inside each task so records are distinct where the pool allows.
    words = rng.sample(WORDS, 75)
    recs = [record("Reverse the word.", w, w[::-1]) for w in words]
    texts = rng.sample(WORDS, 30) + [f"{w} {v}" for w,
                                     v in rng.sample([(w, v) for w in WORDS for v in WORDS if w != v], 35)]
    recs += [record("Uppercase the text.", t, t.upper()) for t in texts]
    sums = rng.sample([(a, b) for a in range(1, 21) for b in range(1, 10)], 80)
    recs += [record("Add the numbers.", f"{a} + {b}", str(a + b)) for a, b in sums]
    recs += [record("What comes after the letter?", c, chr(ord(c) + 1)) for c in string.ascii_lowercase[:-1]]
    recs += [record("Repeat the word twice.", w, f"{w} {w}") for w in rng.sample(WORDS, 55)]
    recs += [record("What is the opposite of the word?", a, b) for x, y in OPPOSITES for a, b in ((x, y), (y, x))]
    spans = rng.sample([(a, b) for a in range(1, 16) for b in range(a + 2, a + 6)], 60)
    # No input here, so the template's "without input" wording is in the data too.
    recs += [record(f"Count from {a} to {b}.", "", " ".join(map(str, range(a, b + 1)))) for a, b in spans]
    rng.shuffle(recs)
    return recs


def write(path: Path, recs: list[dict]) -> None:
    # One record per line: small, diff-friendly, still a plain JSON list.
    path.write_text("[\n" + ",\n".join(json.dumps(r) for r in recs) + "\n]\n", encoding="utf-8")
    print(f"wrote {len(recs)} records to {path} ({path.stat().st_size / 1024:.1f} KiB)")


def main() -> None:
    write(OUT, build(random.Random(SEED)))
    train, val = split(SEED)
    write(HERE / "train.json", train)
    write(HERE / "val.json", val)


if __name__ == "__main__":
    main()
