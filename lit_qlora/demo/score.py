"""What `python generate/lora.py` shows after the demo's training: the base model's and the fine-tuned model's greedy
answers to every question of the held-out set (val.json), a few of them side by side, and how many each got right.

An answer is right when it is the expected answer exactly (surrounding spaces aside): the text generated before the
first stop token.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from lit_qlora.demo import DEMO_FILES

SHOWN = 5  # questions printed side by side: the first ones of the file, right or wrong
ANSWER_TOKENS = 40  # new tokens at most per answer: more than any expected answer takes, its end token included
NEXT_COMMAND = 'python generate/lora.py --prompt "Reverse the word." --input echo'


@dataclass(frozen=True)
class Answered:
    question: str
    expected: str
    base: str
    tuned: str


def held_out(path: Path = DEMO_FILES[1]) -> list[dict]:
    """The held-out records, in file order."""
    return json.loads(Path(path).read_text())


def answer_all(records: list[dict], base: Callable[[dict], str], tuned: Callable[[dict], str]) -> list[Answered]:
    """Both models' answers to every record (`base` / `tuned`: record -> the model's answer)."""
    return [Answered(" ".join(x for x in (r["instruction"], r["input"]) if x), r["output"], base(r), tuned(r))
            for r in records]


def right(answer: str, expected: str) -> bool:
    return answer.strip() == expected.strip()


def report(rows: list[Answered], shown: int = SHOWN) -> list[str]:
    """The closing lines: the first `shown` questions with both answers, then each model's score on all of them."""
    shown = min(shown, len(rows))
    width = max(len(r.question) for r in rows[:shown])
    lines = [f"Held-out questions (words and numbers no training saw), greedy answers; the first {shown} of "
             f"{len(rows)}:"]
    for r in rows[:shown]:
        mark = "right" if right(r.tuned, r.expected) else f"wrong, expected {r.expected!r}"
        lines.append(f"  {r.question:<{width}}  base model: {_shown(r.base):<24}  fine-tuned: {_shown(r.tuned)} "
                     f"({mark})")
    n_tuned = sum(right(r.tuned, r.expected) for r in rows)
    n_base = sum(right(r.base, r.expected) for r in rows)
    lines.append(f"Fine-tuned accuracy on the {len(rows)} held-out questions: {n_tuned}/{len(rows)} "
                 f"({n_tuned / len(rows):.0%}); base model: {n_base}/{len(rows)} ({n_base / len(rows):.0%})")
    return lines


def _shown(text: str, limit: int = 24) -> str:
    text = repr(text) if text.strip() else "(nothing)"
    return text if len(text) <= limit else text[:limit - 4] + "...'"
