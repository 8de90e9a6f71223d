"""What the data tests share: records, a character tokenizer stand-in, file writers, a one-line error check."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "lit_qlora" / "demo" / "demo_data.json"


RECORDS = [
    {"instruction": "Reverse the word.", "input": "cat", "output": "tac"},
    {"instruction": "Count from 1 to 3.", "input": "", "output": "1 2 3"},
    {"instruction": "Add the numbers.", "input": "12 + 7", "output": "19"},
    {"instruction": "Uppercase the text.", "output": "NO INPUT FIELD"},
]


class CharTokenizer:
    """Stand-in with the Tokenizer interface: one id per character, bos=1, eos=2."""

    bos_id, eos_id, vocab_size = 1, 2, 260

    def __init__(self, fingerprint: str = "char-a") -> None:
        self.fingerprint = fingerprint

    def encode(self, text: str, bos: bool | None = None, eos: bool = False, max_length: int = -1) -> torch.Tensor:
        ids = ([self.bos_id] if bos is not False else []) + [3 + ord(c) % 256 for c in text]
        ids += [self.eos_id] if eos else []
        return torch.tensor(ids[:max_length] if max_length > 0 else ids, dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(chr(i - 3) for i in torch.as_tensor(ids).tolist() if i > 2)


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


def assert_one_line_message(exc: pytest.ExceptionInfo, *parts: str) -> None:
    msg = str(exc.value)
    assert "\n" not in msg and ";" in msg, msg
    for p in parts:
        assert p in msg, msg
