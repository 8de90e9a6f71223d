"""GRPO's reward functions: `--reward module:function` (a .py file or an importable module, as many as wanted, with
`--reward_weights`) and the built-ins `exact_answer`, `format` and `length`, all called as TRL's GRPOTrainer calls
them: `fn(prompts=[...], completions=[...], completion_ids=[...], **columns)`, one entry per completion, every other
column of each completion's data row as a keyword argument (a list in the same order), and **kwargs for what a
function does not name. A completion is a string, or for a conversation prompt (a list of messages) a one-message
list [{"role": "assistant", "content": text}], as TRL passes them. A function returns one float (or None: "not
mine to score") per completion.

A function that raises, returns the wrong count, something that is not a number, or NaN / inf stops the run in one
line naming the function and the data row (`score`); the checkpoints written before stay as they were."""
from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from lit_qlora.utils import UserError

BUILTINS = ("exact_answer", "format", "length")
DEFAULT_FORMAT = r"<think>.*?</think>\s*<answer>.*?</answer>"  # the DeepSeek-R1 layout TRL's format reward checks
MATH_EXTRA = "pip install 'lit-qlora[math]'"


@dataclass(frozen=True)
class Reward:
    """One reward function, its name (metrics: rewards/NAME/mean) and its weight in the summed reward."""

    name: str
    fn: Callable
    weight: float = 1.0


# ---- built-ins ---------------------------------------------------------------------------------------------------
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _boxed(text: str) -> Optional[str]:
    """The content of the last \\boxed{...} (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def extract_answer(text: str) -> Optional[str]:
    """What a completion answers: the last \\boxed{} span, else the last <answer>...</answer> span, else the last
    number, else (no number at all) its first non-empty line; None for an empty text."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1]
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else None


def _as_number(text: str) -> Optional[Fraction]:
    t = text.strip().rstrip(".").replace(",", "").replace("$", "").strip()
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def _normalized(text: str) -> str:
    return " ".join(text.strip().rstrip(".").lower().split())


def _math_verify():
    try:
        return importlib.import_module("math_verify")
    except ImportError:
        return None


def answers_match(predicted: Optional[str], gold: Any) -> bool:
    """Whether an extracted answer equals the gold one: a gold answer with a digit or LaTeX by math-verify when it is
    installed (the `math` extra: equivalent expressions), else as numbers when both read as numbers, else as text
    (case, spacing and a final period aside)."""
    if predicted is None or gold is None:
        return False
    gold_text = str(gold)
    gold_answer = extract_answer(gold_text) if (_boxed(gold_text) or "<answer>" in gold_text) else gold_text.strip()
    if gold_answer is None:
        return False
    mv = _math_verify() if re.search(r"[\d\\]", gold_answer) else None  # words: math-verify reads them as
    if mv is not None:  # products of symbols (koob would equal book)
        try:
            g, p = mv.parse(f"${gold_answer}$"), mv.parse(f"${predicted}$")
            if g and p:
                return bool(mv.verify(g, p))
        except Exception:  # math-verify could not read one of them: the plain comparison below decides
            pass
    a, b = _as_number(predicted), _as_number(gold_answer)
    if a is not None and b is not None:
        return a == b
    return _normalized(predicted) == _normalized(gold_answer)


def completion_text(completion: Any) -> str:
    """A completion as text: itself, or the content of a conversation completion's messages."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))


def exact_answer_reward(column: str) -> Callable:
    def exact_answer(completions: list, **columns) -> list[float]:
        gold = columns[column]
        return [1.0 if answers_match(extract_answer(completion_text(c)), g) else 0.0
                for c, g in zip(completions, gold)]

    return exact_answer


def format_reward(pattern: str) -> Callable:
    regex = re.compile(pattern, re.DOTALL)

    def format(completions: list, **_) -> list[float]:  # noqa: A001 (the metric's name)
        return [1.0 if regex.fullmatch(completion_text(c).strip()) else 0.0 for c in completions]

    return format


def length_reward(max_completion_length: int) -> Callable:
    def length(completion_ids: list, **_) -> list[float]:
        return [-len(ids) / max_completion_length for ids in completion_ids]

    return length


# ---- --reward ------------------------------------------------------------------------------------------------------
def load_rewards(specs: Sequence[str], weights: Optional[Sequence[float]], *, answer_column: str,
                 format_regex: Optional[str], max_completion_length: int) -> list[Reward]:
    """The --reward functions with their --reward_weights (default 1 each), checked: every one loads and is callable,
    no name twice, one weight per function."""
    if not specs:
        raise UserError("no --reward given; pass e.g. --reward exact_answer, or --reward my_rewards.py:function")
    if weights is not None and len(weights) != len(specs):
        raise UserError(f"--reward_weights has {len(weights)} value(s) for {len(specs)} --reward function(s); give "
                        "one weight per --reward, in the same order")
    out = []
    for i, spec in enumerate(specs):
        fn = _builtin(spec, answer_column, format_regex, max_completion_length) or _user_function(spec)
        name = getattr(fn, "__name__", spec.rpartition(":")[2]) or spec
        if any(r.name == name for r in out):
            raise UserError(f"--reward: two functions are named {name!r} (their metrics would share a column); "
                            "rename one")
        w = float(weights[i]) if weights is not None else 1.0
        if not math.isfinite(w):
            raise UserError(f"--reward_weights: {weights[i]} for {name} is not a finite number; give a number")
        out.append(Reward(name, fn, w))
    return out


def _builtin(spec: str, answer_column: str, format_regex: Optional[str], limit: int) -> Optional[Callable]:
    if spec == "exact_answer":
        return exact_answer_reward(answer_column)
    if spec == "format":
        try:
            return format_reward(format_regex or DEFAULT_FORMAT)
        except re.error as e:
            raise UserError(f"--format_regex {format_regex!r} is not a regular expression ({e}); fix it") from None
    if spec == "length":
        return length_reward(limit)
    return None


def _user_function(spec: str) -> Callable:
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise UserError(f"--reward {spec!r} is neither a built-in ({', '.join(BUILTINS)}) nor module:function; pass "
                        "e.g. --reward rewards.py:correctness or --reward my_package.rewards:correctness")
    module = _load_module(where, spec)
    fn = getattr(module, attr, None)
    if not callable(fn):
        what = "has no" if fn is None else "has a non-callable"
        raise UserError(f"--reward {spec}: {where} {what} {attr!r}; name a function defined there")
    return fn


def _load_module(where: str, spec: str):
    path = Path(where)
    try:
        if path.suffix == ".py" or path.exists():
            if not path.is_file():
                raise UserError(f"--reward {spec}: no such file {path}; give the path of a .py file")
            name = f"lit_qlora_reward_{path.stem}"
            mod_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[name] = module
            mod_spec.loader.exec_module(module)
            return module
        return importlib.import_module(where)
    except UserError:
        raise
    except ModuleNotFoundError as e:
        raise UserError(f"--reward {spec}: cannot import {e.name!r}; give a .py file path or an importable module"
                        ) from None
    except Exception as e:
        raise UserError(f"--reward {spec}: loading {where} failed ({type(e).__name__}: {e}); fix the module") from None


# ---- scoring ---------------------------------------------------------------------------------------------------------
def score(rewards: Sequence[Reward], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], where: list[str]) -> torch.Tensor:
    """[N, F] float32: each function's reward of each of the N completions (NaN where it returned None), called once
    for all of them as TRL calls it. `columns`: the rows' other columns, one entry per completion; `where[i]`: the
    data row of completion i ("row 7 of data/train.jsonl"), named in the one-line error of a bad reward."""
    out = torch.empty(len(completions), len(rewards))
    for j, r in enumerate(rewards):
        values = _call(r, prompts, completions, completion_ids, columns, where)
        out[:, j] = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float64).float()
    return out


def _call(r: Reward, prompts, completions, completion_ids, columns, where) -> list:
    n = len(completions)
    try:
        values = r.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    except Exception as e:
        i = _first_failing(r, prompts, completions, completion_ids, columns)
        row = where[i] if i is not None else f"the rows {_span(where)}"
        raise UserError(f"reward function {r.name} raised {type(e).__name__}: {_short(e)} (on {row}); fix the "
                        "function or that row") from None
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    try:
        values = list(values)
    except TypeError:
        raise UserError(f"reward function {r.name} returned {type(values).__name__}, not a list of {n} numbers "
                        f"(rows {_span(where)}); return one float (or None) per completion") from None
    if len(values) != n:
        raise UserError(f"reward function {r.name} returned {len(values)} rewards for {n} completions (rows "
                        f"{_span(where)}); return one float (or None) per completion")
    for i, v in enumerate(values):
        if v is None:
            continue
        if not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
            raise UserError(f"reward function {r.name} returned {_short(repr(v))} ({type(v).__name__}) for a "
                            f"completion of {where[i]}, not a number; return a float (or None) per completion")
        if not math.isfinite(float(v)):
            raise UserError(f"reward function {r.name} returned {float(v)} for a completion of {where[i]}; return a "
                            "finite number (or None: not scored)")
        values[i] = float(v)
    return values


def _first_failing(r: Reward, prompts, completions, completion_ids, columns) -> Optional[int]:
    """The first completion the function raises on when called on it alone (which row to name), or None."""
    for i in range(len(completions)):
        try:
            r.fn(prompts=prompts[i:i + 1], completions=completions[i:i + 1], completion_ids=completion_ids[i:i + 1],
                 **{k: v[i:i + 1] for k, v in columns.items()})
        except Exception:
            return i
    return None


def _span(where: list[str]) -> str:
    unique = list(dict.fromkeys(where))
    return ", ".join(unique[:3]) + (f" and {len(unique) - 3} more" if len(unique) > 3 else "")


def _short(x: Any) -> str:
    text = " ".join(str(x).split())
    return text if len(text) <= 120 else text[:117] + "..."
