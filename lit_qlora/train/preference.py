"""Preference tuning on {prompt, chosen, rejected} pairs: the losses (DPO, IPO, ORPO, SimPO), the per-sequence
log-probabilities they are made of, and pair batches (chosen and rejected rows of a batch in one forward).

A batch of B pairs is 2B sequences, the B chosen ones first, then the B rejected ones (as TRL lays them out). Each
sequence's log-probability is the sum over its completion tokens (the prompt is masked) of log p(token | before).
DPO and IPO compare the policy with a reference policy: the model as it was before the first update (the base, or
the base with the SFT adapter training started from), so the reference needs no second copy of the weights: its
log-probabilities are computed once, with the same model, before training (`finetune/dpo.py`). ORPO and SimPO need
no reference. The losses follow TRL's trainers term for term (tests/test_preference.py runs TRL's own code):
dpo = DPOTrainer loss_type "sigmoid", ipo = DPOTrainer "ipo" (log-ratios averaged per completion token),
simpo = CPOTrainer loss_type "simpo" with cpo_alpha 0 (average log-probabilities, margin `gamma`), orpo =
ORPOTrainer (the odds-ratio term on average log-probabilities, plus the chosen completions' NLL per token; TRL
counts the prompt tokens in that NLL too, we train on the completions only, as everywhere else).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_qlora.data import chat_template as ct
from lit_qlora.data.batching import BatchStream, unpad
from lit_qlora.data.prepare import DataSettings, resolve_template
from lit_qlora.data.records import split
from lit_qlora.data.sources import Source, resolve
from lit_qlora.data.templates import CHAT, get_template
from lit_qlora.train.training import shift_labels
from lit_qlora.utils import UserError

LOSSES = ("dpo", "ipo", "orpo", "simpo")
REFERENCE_LOSSES = ("dpo", "ipo")  # the ones that compare with a reference policy


@dataclass
class PairLogps:
    """Per-sequence sums for the pairs of a batch: [B] each (chosen, rejected)."""

    chosen: Tensor  # sum of the completion tokens' log-probabilities
    rejected: Tensor
    chosen_tokens: Tensor  # completion tokens of each sequence (float)
    rejected_tokens: Tensor


def needs_reference(loss: str) -> bool:
    return loss in REFERENCE_LOSSES


def pair_losses(loss: str, policy: PairLogps, ref_chosen: Tensor | None, ref_rejected: Tensor | None, beta: float,
                gamma: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """(per-pair loss [B], chosen rewards [B], rejected rewards [B]) for `loss`. Rewards are what TRL logs:
    beta * (log-ratio to the reference) for DPO/IPO, beta * average log-probability for ORPO/SimPO. ORPO's NLL term
    is not in the per-pair loss: it is normalized by the chosen tokens of the whole step (`orpo_nll`)."""
    c, r = policy.chosen, policy.rejected
    nc, nr = policy.chosen_tokens.clamp(min=1), policy.rejected_tokens.clamp(min=1)
    if loss in REFERENCE_LOSSES:
        c_ratio, r_ratio = c - ref_chosen, r - ref_rejected
        if loss == "dpo":
            per_pair = -F.logsigmoid(beta * (c_ratio - r_ratio))
        else:  # IPO (eq. 17), the log-ratios averaged per completion token as TRL does
            per_pair = (c_ratio / nc - r_ratio / nr - 1 / (2 * beta)) ** 2
        return per_pair, beta * c_ratio.detach(), beta * r_ratio.detach()
    c_avg, r_avg = c / nc, r / nr
    if loss == "simpo":
        per_pair = -F.logsigmoid(beta * (c_avg - r_avg) - gamma)
    elif loss == "orpo":  # log odds(chosen) - log odds(rejected), odds(p) = p / (1 - p) of the average log-probability
        log_odds = (c_avg - r_avg) - (_log1mexp(c_avg) - _log1mexp(r_avg))
        per_pair = -beta * F.logsigmoid(log_odds)
    else:
        raise ValueError(f"unknown preference loss {loss!r}; one of {LOSSES}")
    return per_pair, beta * c_avg.detach(), beta * r_avg.detach()


def orpo_nll(policy: PairLogps) -> Tensor:
    """ORPO's supervised term, summed: minus the chosen completions' log-probabilities (divide by their tokens)."""
    return -policy.chosen.sum()


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, accurately on both sides of -ln 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def reward_stats(chosen_rewards: Tensor, rejected_rewards: Tensor) -> dict[str, Tensor]:
    """Sums over the pairs (divide by the pair count) of what TRL logs, under TRL's names."""
    return {"rewards/chosen": chosen_rewards.sum(), "rewards/rejected": rejected_rewards.sum(),
            "rewards/margins": (chosen_rewards - rejected_rewards).sum(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().sum()}


# ---- log-probabilities --------------------------------------------------------------------------------
def sequence_logps(tok_logps: Tensor, seq_ids: Tensor, n_seq: int) -> tuple[Tensor, Tensor]:
    """Sums of token log-probabilities per sequence and the tokens counted: (logps [n_seq], tokens [n_seq])."""
    sums = tok_logps.new_zeros(n_seq).index_add(0, seq_ids, tok_logps)
    counts = torch.zeros(n_seq, device=tok_logps.device).index_add(0, seq_ids, torch.ones_like(tok_logps))
    return sums, counts


def split_pairs(sums: Tensor, counts: Tensor) -> PairLogps:
    """Sequences [2B] laid out chosen then rejected -> PairLogps."""
    b = sums.size(0) // 2
    return PairLogps(sums[:b], sums[b:], counts[:b], counts[b:])


# ---- batches --------------------------------------------------------------------------------------
def collate_pairs(pairs: list[dict], pad_id: int = 0, ignore_index: int = -100) -> dict[str, Tensor]:
    """B pairs -> one batch of 2B right-padded rows, the chosen rows first, then the rejected ones (one forward for
    both), with `lengths` (real tokens per row) and `index` [B] (the pairs' numbers, for their reference
    log-probabilities)."""
    rows = [(p["chosen_ids"], p["chosen_labels"]) for p in pairs] + [(p["rejected_ids"], p["rejected_labels"])
                                                                     for p in pairs]
    T = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), T), ignore_index, dtype=torch.long)
    lengths = torch.zeros(len(rows), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, :len(ids)], labels[i, :len(ids)], lengths[i] = ids, lab, len(ids)
    index = torch.tensor([int(p["index"]) for p in pairs], dtype=torch.long)
    return {"input_ids": input_ids, "labels": labels, "lengths": lengths, "index": index}


def share_prefixes(batch: dict[str, Tensor], ignore_index: int = -100) -> tuple[dict[str, Tensor], Tensor, Tensor]:
    """A `collate_pairs` batch as one row of tokens in which each pair's common beginning (its prompt, and any first
    answer tokens its two answers share) appears once: [shared, chosen's rest, rejected's rest] per pair, the two
    rests continuing the shared part (GPT.forward's `prefixes`: they see all of it, their positions go on from it).
    The shared part's last token stays in each rest (its next token differs). Every position computes what it
    computes in its own sequence; a target in the shared part counts for both sequences.

    Returns (flat: input_ids, positions, segments, prefixes, targets [1, T]; pick [M] and seq_ids [M]): target k of
    the positions that have one (`targets != ignore_index`, in order) counts for sequence seq_ids[j] where
    pick[j] = k (chosen sequences 0..B-1, rejected B..2B-1)."""
    ids, labels, lengths = batch["input_ids"], batch["labels"], batch["lengths"].tolist()
    n_pairs = ids.size(0) // 2
    tgt = shift_labels(labels, ignore_index)
    parts: dict[str, list[Tensor]] = {k: [] for k in ("input_ids", "positions", "segments", "prefixes", "targets",
                                                      "first", "second")}

    def add(row: int, start: int, end: int, segment: int, prefix: int, first: int, second: int) -> None:
        n = end - start
        for k, v in (("input_ids", ids[row, start:end]), ("positions", torch.arange(start, end)),
                     ("segments", torch.full((n,), segment)), ("prefixes", torch.full((n,), prefix)),
                     ("targets", tgt[row, start:end]), ("first", torch.full((n,), first)),
                     ("second", torch.full((n,), second))):
            parts[k].append(v)

    for i in range(n_pairs):
        c, r = i, n_pairs + i
        n = min(lengths[c], lengths[r])
        same = (ids[c, :n] == ids[r, :n]) & (labels[c, :n] == labels[r, :n])
        common = n if bool(same.all()) else int((~same).nonzero()[0, 0])
        shared = max(common - 1, 0)  # token `common - 1` predicts different next tokens in the two sequences
        if shared:
            add(c, 0, shared, 3 * i, -1, c, r)
        add(c, shared, lengths[c], 3 * i + 1, 3 * i if shared else -1, c, -1)
        add(r, shared, lengths[r], 3 * i + 2, 3 * i if shared else -1, r, -1)
    flat = {k: torch.cat(v)[None] for k, v in parts.items()}
    first, second = flat.pop("first")[0], flat.pop("second")[0]
    has = flat["targets"][0] != ignore_index
    first, second = first[has], second[has]
    k = torch.arange(len(first))
    both = second >= 0
    return flat, torch.cat([k, k[both]]), torch.cat([first, second[both]])


def batch_logps(model: torch.nn.Module, batch: dict[str, Tensor], device: torch.device | str = "cpu",
                lm_head_chunk: int = 0, ignore_index: int = -100, share: bool = True) -> PairLogps:
    """The policy's (or, under no_grad before training, the reference's) PairLogps of a `collate_pairs` batch in one
    forward without padding, each pair's common prompt computed once (`share_prefixes`; `share=False`: the 2B rows
    whole, each attending to itself alone, `unpad`), the output layer only at the positions that have a target, as
    the training loss computes it (with a frozen dense head, one chunk of logits at a time and none kept for
    backward, `GPT.output_loss`)."""
    n_seq = batch["input_ids"].size(0)
    if share:
        flat, pick, seq_ids = share_prefixes(batch, ignore_index)
        tgt, pick, seq_ids = flat.pop("targets").to(device), pick.to(device), seq_ids.to(device)
    else:
        flat, tgt = unpad(batch, shift_labels(batch["labels"], ignore_index))
        tgt = tgt.to(device)
        width = batch["input_ids"].size(1)
        rows = flat["segments"] // width if "segments" in flat else torch.zeros_like(flat["input_ids"])
        seq_ids = rows.to(device)[tgt != ignore_index]
        pick = torch.arange(len(seq_ids), device=device)
    has_target = tgt != ignore_index
    packed = {k: flat[k].to(device) for k in ("positions", "segments", "prefixes") if k in flat}
    # -log p(target) of each position, by the model's output layer (losses.head_cross_entropy: no logits kept)
    nll = model(flat["input_ids"].to(device), lm_head_chunk=lm_head_chunk, output_mask=has_target,
                targets=tgt[has_target], reduction="none", **packed)
    sums, counts = sequence_logps(-nll[pick], seq_ids, n_seq)
    return split_pairs(sums, counts)


class PairStream(BatchStream):
    """BatchStream's reproducible, resumable order over pairs; a batch is the list of its pairs (each device collates
    its share of them with `collate_pairs`)."""

    def collate_batch(self, samples: list) -> list:
        return samples


# ---- data ---------------------------------------------------------------------------------------------
FIELDS = ("prompt", "chosen", "rejected")


def load_pairs(data_dir: Path | str, tokenizer: Any, s: DataSettings) -> tuple[list[dict], list[dict], dict]:
    """(train pairs, validation pairs, meta) from a --data_dir of rows {prompt, chosen, rejected}: anything the records
    reader reads (`sources.resolve`: .json, .jsonl, .parquet files, a folder of them, a datasets folder, a cached hub
    dataset), train and validation, or one set split by `s.test_split_fraction`. Each field is a string, or a list of
    messages (role/content; chosen and rejected: the assistant's turns), rendered with the model's chat template as
    the SFT path renders conversations; rows of two full conversations without a prompt take their common leading
    turns as the prompt. Strings go through the prompt template (`s.template`: alpaca, plain, or chat: one user turn).
    Every row is checked before anything is trained; a bad one is a one-line UserError naming its file and row."""
    data_dir = Path(data_dir)
    raw = resolve(data_dir)
    if raw is None:
        raise UserError(f"{data_dir} holds no .json/.jsonl/.parquet file; put the prompt/chosen/rejected rows there")
    train_src, val_src = raw
    for f in (f for src in raw if src is not None for f in src.files):
        if f.suffix.lower() == ".csv":
            raise UserError(f"{f}: preference data is read from .json, .jsonl or .parquet (a CSV cannot hold "
                            "conversations); convert the file")
    rows = _rows(train_src)
    holds_conversations = any(isinstance(v, list) for r in rows[:1] for _, v in r[2].items())
    template = resolve_template(s.template, holds_conversations, tokenizer, train_src)
    if tokenizer.eos_id is None and template != CHAT:
        raise UserError("the tokenizer has no eos token, so the model could not learn where an answer ends; set "
                        "eos_token in the checkpoint's tokenizer_config.json")
    stats = {"truncated": 0}
    train = [_pair(row, rec, f, tokenizer, template, s, stats) for f, row, rec in rows]
    if val_src is not None:
        val = [_pair(row, rec, f, tokenizer, template, s, stats) for f, row, rec in _rows(val_src)]
    else:
        train, val = split(train, s.test_split_fraction, s.seed)
    train, val = numbered(train), numbered(val)
    if stats["truncated"]:
        print(f"warning: {stats['truncated']} answer(s) cut to --max_seq_length {s.max_seq_length} tokens",
              file=sys.stderr)
    return train, val, {"template": template, "n_train": len(train), "n_val": len(val),
                        "source_files": [str(f) for src in raw if src is not None for f in src.key_files()]}


def numbered(pairs: list[dict]) -> list[dict]:
    """The pairs with `index` their place in the list (what their reference log-probabilities are looked up by); each
    a new dict, so a pair that comes twice (a mixture) has two places."""
    return [{**p, "index": i} for i, p in enumerate(pairs)]


def _rows(source: Source) -> list[tuple[Path, int, dict]]:
    """(file, row number from 1, record) of a source, read by the records reader; the fields checked."""
    rows = list(source.rows())
    if not rows:
        raise UserError(f"{source} holds no records; add some or pick another source")
    for path, row, rec in rows:
        where = f"row {row} of {path}"
        if not isinstance(rec, dict):
            raise UserError(f"{where} is a {type(rec).__name__}, not an object; write each row as "
                            "{\"prompt\": ..., \"chosen\": ..., \"rejected\": ...}")
        implicit = "prompt" not in rec and isinstance(rec.get("chosen"), list)  # two full conversations
        for key in FIELDS[1:] if implicit else FIELDS:
            v = rec.get(key)
            if not isinstance(v, (str, list)) or not v or (isinstance(v, str) and not v.strip()):
                what = "no" if v is None else "an empty" if not v or isinstance(v, str) else "a non-text"
                raise UserError(f"{where} has {what} {key!r} field (it has: {', '.join(map(str, rec))}); every row "
                                "needs prompt, chosen and rejected, as strings or lists of messages")
        if rec["chosen"] == rec["rejected"]:
            raise UserError(f"{where}: chosen and rejected are the same, so there is no preference to learn; fix or "
                            "drop the row")
    return rows


def _as_messages(value: Any, role: str, row: int, path: Path) -> list[dict]:
    """A field as messages: a string is one turn of `role`; a list is checked as a conversation's turns (a prompt's
    with a placeholder reply after it, an answer's with a placeholder question before it)."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if role == "user":
        return ct.normalize_conversation({"messages": [*value, {"role": "assistant", "content": "-"}]}, row, path)[:-1]
    return ct.normalize_conversation({"messages": [{"role": "user", "content": "-"}, *value]}, row, path)[1:]


def _pair(row: int, rec: dict, path: Path, tokenizer: Any, template: str, s: DataSettings, stats: dict) -> dict:
    where = f"row {row} of {path}"
    try:
        if template == CHAT:
            prompt, chosen, rejected = _chat_parts(rec, row, path)
            prompt_ids = ct.encode_chat(tokenizer, prompt, add_generation_prompt=True)
            sides = {k: _chat_side(tokenizer, prompt, answer, prompt_ids, where) for k, answer in
                     (("chosen", chosen), ("rejected", rejected))}
        else:
            if not all(isinstance(rec[k], str) for k in FIELDS):
                raise UserError(f"prompt, chosen and rejected must all be strings with --template {template}; "
                                "use --template chat for messages")
            text = get_template(template).format(rec["prompt"])
            prompt_ids = tokenizer.encode(text).long().tolist()
            sides = {}
            for k in ("chosen", "rejected"):
                ids = tokenizer.encode(text + rec[k], eos=True).long().tolist()
                sides[k] = (ids, [-100 if i < len(prompt_ids) else t for i, t in enumerate(ids)])
    except UserError as e:
        msg = str(e)
        raise UserError(msg if msg.startswith("row ") else f"{where}: {msg}") from None
    if len(prompt_ids) >= s.max_seq_length:
        raise UserError(f"{where}: the prompt is {len(prompt_ids)} tokens, which leaves no room for an answer within "
                        f"--max_seq_length {s.max_seq_length}; raise --max_seq_length or shorten the prompt")
    out = {}
    for k, (ids, labels) in sides.items():
        if len(ids) > s.max_seq_length:
            ids, labels = ids[:s.max_seq_length], labels[:s.max_seq_length]
            stats["truncated"] += 1
        if all(t == -100 for t in labels):
            raise UserError(f"{where}: the {k} answer renders to no tokens; fill it in or drop the row")
        out[f"{k}_ids"] = torch.tensor(ids, dtype=torch.long)
        out[f"{k}_labels"] = torch.tensor(labels, dtype=torch.long)
    if torch.equal(out["chosen_ids"], out["rejected_ids"]):  # texts that differ, the same tokens once cut / rendered
        raise UserError(f"{where}: chosen and rejected are the same {len(out['chosen_ids'])} tokens within "
                        f"--max_seq_length {s.max_seq_length}, so there is no preference to learn; raise "
                        "--max_seq_length, or fix or drop the row")
    return out


def _chat_parts(rec: dict, row: int, path: Path) -> tuple[list, list, list]:
    """(prompt, chosen, rejected) messages of a row."""
    if "prompt" not in rec:  # two full conversations: the prompt is their common leading turns
        chosen, rejected = (ct.normalize_conversation({"messages": rec[k]}, row, path) for k in ("chosen", "rejected"))
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        if n == 0 or chosen[n - 1]["role"] == "assistant":
            raise UserError("chosen and rejected share no prompt (no common leading turns ending with the user's); "
                            "give a \"prompt\" field")
        return chosen[:n], chosen[n:], rejected[n:]
    prompt = _as_messages(rec["prompt"], "user", row, path)
    answers = []
    for k in ("chosen", "rejected"):
        v = rec[k]
        if isinstance(v, list) and len(v) > len(prompt) and all(
                isinstance(m, dict) and (m.get("role"), m.get("content")) == (q["role"], q["content"])
                for m, q in zip(v, prompt)):
            v = v[len(prompt):]  # a full conversation that repeats the prompt's turns (UltraFeedback's layout)
        answers.append(_as_messages(v, "assistant", row, path))
    return prompt, answers[0], answers[1]


def _chat_side(tokenizer: Any, prompt: list, answer: list, prompt_ids: list, where: str) -> tuple[list, list]:
    """ids and labels of prompt + answer rendered by the chat template with the SFT path's assistant mask
    (`chat_template.assistant_mask`), the prompt's own turns masked too; the prompt must render as its prefix."""
    ids, labels = ct.assistant_mask(tokenizer, None, prompt + answer)
    if ids[:len(prompt_ids)] != prompt_ids:
        raise UserError("the chat template renders the prompt differently once the answer follows it (the prompt "
                        "is not a prefix of prompt + answer), so the answer's tokens cannot be told apart; check the "
                        "roles of the turns")
    return ids, [-100 if i < len(prompt_ids) else t for i, t in enumerate(labels)]
