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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_qlora.batching import unpad
from lit_qlora.training import shift_labels

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
def token_logps(logits: Tensor | list[Tensor], targets: Tensor) -> Tensor:
    """log p(target) of each position: logits [N, V] (or position chunks of them, `GPT(lm_head_chunk=...)`) and
    targets [N] -> [N] in fp32."""
    chunks = [logits] if isinstance(logits, Tensor) else logits
    out, start = [], 0
    for chunk in chunks:
        chunk = chunk.reshape(-1, chunk.size(-1))
        out.append(_TokenLogps.apply(chunk, targets[start:start + chunk.size(0)]))
        start += chunk.size(0)
    return torch.cat(out)


class _TokenLogps(torch.autograd.Function):
    """logits[i, t_i] - logsumexp(logits[i]) in fp32, saving only the logits (held anyway) and one fp32 log-sum-exp
    per row: autograd's log_softmax would keep an fp32 [N, V] copy for backward. Backward: g * (one_hot - softmax)."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor) -> Tensor:
        lse = torch.logsumexp(logits.float(), dim=-1)
        picked = logits.gather(1, targets[:, None]).squeeze(1).float()
        ctx.save_for_backward(logits, targets, lse)
        return picked - lse

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, targets, lse = ctx.saved_tensors
        g = -(logits.float() - lse[:, None]).exp_().mul_(grad[:, None])
        g.scatter_add_(1, targets[:, None], grad[:, None].float())
        return g.to(logits.dtype), None


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


def batch_logps(model: torch.nn.Module, batch: dict[str, Tensor], device: torch.device | str = "cpu",
                lm_head_chunk: int = 0, ignore_index: int = -100) -> PairLogps:
    """The policy's (or, under no_grad before training, the reference's) PairLogps of a `collate_pairs` batch: its
    2B rows without their padding in one forward (`unpad`: each row attends to itself alone), the output layer only
    at the positions that have a target."""
    n_seq = batch["input_ids"].size(0)
    tgt = shift_labels(batch["labels"], ignore_index)
    flat, tgt = unpad(batch, tgt)
    tgt = tgt.to(device)
    has_target = tgt != ignore_index
    rows = flat["segments"] if "segments" in flat else torch.zeros_like(flat["input_ids"])
    width = batch["input_ids"].size(1)
    seq_ids = (rows.to(device)[has_target] // width) if "segments" in flat else rows.to(device)[has_target]
    packed = {k: flat[k].to(device) for k in ("positions", "segments") if k in flat}
    logits = model(flat["input_ids"].to(device), lm_head_chunk=lm_head_chunk, output_mask=has_target, **packed)
    sums, counts = sequence_logps(token_logps(logits, tgt[has_target]), seq_ids, n_seq)
    return split_pairs(sums, counts)
