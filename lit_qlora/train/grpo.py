"""GRPO (group relative policy optimization, online RL): the prompts, sampling G completions of each from the current
adapter, the advantages of their rewards within each group, and the clipped policy loss of TRL's GRPOTrainer.

The policy is the (4-bit) base with the LoRA adapter, unmerged: it samples as it trains, so there is no second copy
of the model and nothing to keep in sync. The reference of the KL term (--beta) is the same model with the adapter's
starting tensors swapped in (`swapped_adapter`): the base itself for a fresh adapter (B = 0), the --lora_path adapter
as it was. Log-probabilities go through the output layer's chunked cross entropy (`GPT.forward(targets=...,
reduction="none", temperature=...)`): no [completions x length x vocabulary] logits are ever held; a group's prompt
is computed once for its G completions (`group_rows`, the preference path's shared prefixes).

The formulas are TRL 1.16's, term for term (tests/test_grpo.py runs TRL's own `_generate_and_score_completions` and
`_compute_loss` on the same completions): `advantages` (multi_objective_aggregation "sum_then_normalize", nanstd
with Bessel's correction, 1e-4 in the denominator, unscorable completions at 0), `token_losses` (the two-sided
clip of importance ratios exp(logp - logp_old) at [1 - epsilon, 1 + epsilon_high], the k3 KL estimator
exp(ref - logp) - (ref - logp) - 1) and `aggregate` (grpo: mean over sequences of their token means; bnpo: token
mean of each micro batch; dr_grpo: token sum over sequences x max_completion_length; dapo: token mean of the whole
step).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from lit_qlora.data import chat_template as ct
from lit_qlora.data.batching import BatchStream
from lit_qlora.data.prepare import DataSettings, read_rows
from lit_qlora.data.records import normalize_conversation, split, what_value
from lit_qlora.data.sources import resolve
from lit_qlora.data.templates import AUTO, CHAT, check_template_name, get_template
from lit_qlora.engine import Completion, Sampling, generate_batch
from lit_qlora.lora import lora_modules
from lit_qlora.train.rewards import score
from lit_qlora.utils import UserError

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)
# metrics.csv columns (TRL's names), besides each reward function's rewards/NAME/mean and /std
SAMPLE_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/min_length",
                  "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length")
LOSS_METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
TIMES = ("time/sampling_ms", "time/rewards_ms", "time/old_ref_logps_ms", "time/forward_ms", "time/backward_ms")


# ---- sampling --------------------------------------------------------------------------------------------------------
def completion_seed(seed: int, step: int, prompt_index: int, generation: int) -> int:
    """The seed of one completion: a function of --seed, the step that samples, the prompt's place in the data and
    the completion's number in its group, so a completion does not depend on what else is sampled with it (DDP
    ranks, resuming, batch composition)."""
    h = 0x9E3779B97F4A7C15
    for v in (seed, step, prompt_index, generation):
        h = ((h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def group_sampling(prompts: list, G: int, seed: int, step: int, max_new_tokens: int, temperature: float,
                   top_k: Optional[int], top_p: Optional[float], stops: tuple) -> tuple[list, list[Sampling]]:
    """The prompt ids and the Sampling of each of G completions of each prompt (prompt-major), each seeded by
    `completion_seed`."""
    ids = [p.ids for p in prompts for _ in range(G)]
    return ids, [Sampling(max_new_tokens, temperature, top_k, top_p, completion_seed(seed, step, p.index, i), stops)
                 for p in prompts for i in range(G)]


def sample_completions(model, prompts: list[list[int]], sampling: list[Sampling],
                       precision: Optional[str] = None) -> list[Completion]:
    """Every completion of a step: prompt i continued as `sampling[i]` says (its own seeded generator: a completion
    does not depend on what is sampled beside it), all of them as one continuous batch of the engine
    (`engine.generate_batch`), by the model as it is: the 4-bit base with the adapter unmerged, each decoding step's
    layers through the 4-bit kernel with the update inside the call (`engine.decoding`), no copy of the weights.
    A completion is cut at the model's context."""
    limit = model.config.block_size
    sampling = [replace(s, max_new_tokens=max(1, min(s.max_new_tokens, limit - len(p))))
                for p, s in zip(prompts, sampling)]
    return generate_batch(model, prompts, sampling, precision=precision)


# ---- prompts ---------------------------------------------------------------------------------------------------------
@dataclass
class Prompt:
    """One prompt of the data: its place (`index`), as the reward functions get it (`prompt`: text or messages), its
    tokens, the row's other columns, and where it came from (named in errors)."""

    index: int
    prompt: Any
    ids: list[int]
    columns: dict
    where: str


class PromptStream(BatchStream):
    """BatchStream's reproducible, resumable order over prompts, every batch full (an epoch's last one is completed
    from the next epoch), so every device gets the same number of prompts in every step."""

    def __next__(self) -> list:
        rows: list = []
        while len(rows) < self.batch_size:
            if self._order is None:
                self._order = self._epoch_order()
            take = self._order[self.position:self.position + self.batch_size - len(rows)]
            self.position += len(take)
            rows += [self.samples[i] for i in take]
            if self.position >= len(self._order):
                self.epoch, self.position, self._order, self._window = self.epoch + 1, 0, None, None
        return rows


def load_prompts(data_dir: Path, tokenizer: Any, s: DataSettings, prompt_column: str, block_size: int,
                 needed: Optional[dict] = None) -> tuple[list[Prompt], list[Prompt], dict]:
    """(train prompts, validation prompts, meta) from a --data_dir of rows read by the one records reader: the
    `prompt_column` (a string, or a list of messages), or a conversation (`messages` / `conversations`, or
    --messages_column; a final assistant turn is left out). Strings go through --template when one is given (alpaca,
    plain, chat: one user turn), as they are with auto (as TRL passes them); messages through the chat template with
    the generation prompt. Every other column of the row is kept for the reward functions; `needed` names columns
    every row must have ({column: what needs it})."""
    raw = resolve(Path(data_dir))
    if raw is None:
        raise UserError(f"{data_dir} holds no .json/.jsonl/.csv/.parquet file; put the prompt rows there")
    train_src, val_src = raw
    rows = read_rows(train_src, s)
    template = check_template_name(s.template, allow_auto=True)
    if template == CHAT and not getattr(tokenizer, "chat_template", None):
        raise UserError(f"--template chat, but the tokenizer in {getattr(tokenizer, 'checkpoint_dir', '?')} has no "
                        "chat template; use an instruct model's folder, or leave --template out")
    train = [_prompt(rec, f, row, tokenizer, template, prompt_column, block_size) for f, row, rec in rows]
    if val_src is not None:
        val = [_prompt(rec, f, row, tokenizer, template, prompt_column, block_size)
               for f, row, rec in read_rows(val_src, s)]
    else:
        train, val = split(train, s.test_split_fraction, s.seed)
    for i, p in enumerate([*train, *val]):
        p.index = i
        for column, why in (needed or {}).items():
            if column not in p.columns:
                raise UserError(f"{p.where} has no {column!r} column, which {why} (it has: "
                                f"{', '.join(p.columns) or 'only the prompt'})")
    files = [str(f) for src in raw if src is not None for f in src.key_files()]
    return train, val, {"template": template, "n_train": len(train), "n_val": len(val), "source_files": files}


def _prompt(rec: Any, path: Path, row: int, tokenizer: Any, template: str, column: str, block_size: int) -> Prompt:
    where = f"row {row} of {path}"
    if not isinstance(rec, dict):
        raise UserError(f"{where} is {what_value(rec)}, not an object; write each row as {{\"{column}\": ...}}")
    if column in rec:
        value, rest = rec[column], {k: v for k, v in rec.items() if k != column}
    elif "messages" in rec or "conversations" in rec:
        key = "messages" if "messages" in rec else "conversations"
        value, rest = rec[key], {k: v for k, v in rec.items() if k != key}
    else:
        raise UserError(f"{where} has no {column!r} column and no messages (it has: {', '.join(map(str, rec))}); "
                        "name the prompt's column with --prompt_column")
    if isinstance(value, list):
        answered = bool(value) and isinstance(value[-1], dict) and value[-1].get("role", value[-1].get("from")) in (
            "assistant", "gpt")
        placeholder = [] if answered else [{"role": "assistant", "content": "-"}]  # checked as a whole conversation
        messages = normalize_conversation({"messages": [*value, *placeholder]}, row, path)[:-1]
        if not messages:
            raise UserError(f"{where}: the conversation has no turn before its answer; give the prompt's turns")
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{where} is a conversation, but the tokenizer has no chat template to render it; use an "
                            "instruct model's folder, or give the prompts as text")
        ids, prompt = ct.encode_chat(tokenizer, messages, add_generation_prompt=True), messages
    elif isinstance(value, str) and value.strip():
        ids, prompt = _text_ids(tokenizer, value, template), value
    else:
        raise UserError(f"{where}: {column!r} is {what_value(value)}; give the prompt as text or a list of messages")
    if len(ids) >= block_size:
        raise UserError(f"{where}: the prompt is {len(ids)} tokens, which leaves no room for a completion in the "
                        f"model's context of {block_size}; shorten the prompt")
    return Prompt(0, prompt, list(ids), rest, where)


def _text_ids(tokenizer: Any, text: str, template: str) -> list[int]:
    if template == CHAT:
        return ct.encode_chat(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True)
    if template not in (None, AUTO):
        text = get_template(template).format(text)
    return tokenizer.encode(text).tolist()


# ---- log-probabilities -----------------------------------------------------------------------------------------------
def group_rows(prompts: list[list[int]], completions: list[list[int]], G: int) -> tuple[dict, Tensor, Tensor]:
    """The completions of some prompts (G each, completion k of prompt k // G) as one packed row in which each prompt
    appears once: its tokens but the last as a shared prefix, then per completion [the prompt's last token,
    completion[:-1]] continuing it (`GPT.forward`'s `prefixes`). Returns (input_ids, positions, segments, prefixes,
    targets [1, T]; then for each target position in order its completion `seq` and token `col`)."""
    parts: dict[str, list] = {k: [] for k in ("input_ids", "positions", "segments", "prefixes", "targets")}
    seq, col, segment = [], [], 0

    def add(ids: list, start: int, prefix: int, targets: list) -> None:
        n = len(ids)
        for k, v in (("input_ids", ids), ("positions", range(start, start + n)), ("segments", [segment] * n),
                     ("prefixes", [prefix] * n), ("targets", targets)):
            parts[k].extend(v)

    for i, prompt in enumerate(prompts):
        shared, prefix = len(prompt) - 1, -1
        if shared:
            add(prompt[:-1], 0, -1, [-100] * shared)
            prefix, segment = segment, segment + 1
        for g in range(G):
            c = completions[i * G + g]
            add([prompt[-1], *c[:-1]], shared, prefix, list(c))
            seq += [i * G + g] * len(c)
            col += range(len(c))
            segment += 1
    flat = {k: torch.tensor(v, dtype=torch.long)[None] for k, v in parts.items()}
    return flat, torch.tensor(seq, dtype=torch.long), torch.tensor(col, dtype=torch.long)


def token_logps(model, prompts: list[list[int]], completions: list[list[int]], G: int, *, temperature: float,
                lm_head_chunk: int, device) -> Tensor:
    """[N, L] log p(token | before) of every completion token at `temperature` (0 past a completion's end), N =
    len(completions), L the longest; by the output layer's chunked cross entropy, no logits kept."""
    flat, seq, col = group_rows(prompts, completions, G)
    tgt = flat.pop("targets").to(device)
    has = tgt != -100
    nll = model(flat["input_ids"].to(device), lm_head_chunk=lm_head_chunk, output_mask=has, targets=tgt[has],
                reduction="none", temperature=temperature, **{k: v.to(device) for k, v in flat.items()
                                                               if k != "input_ids"})
    L = max(len(c) for c in completions)
    out = torch.zeros(len(completions), L, device=device, dtype=torch.float32)
    return out.index_put((seq.to(device), col.to(device)), -nll.float())


class swapped_adapter:
    """`with swapped_adapter(model, tensors):` the model runs with these LoRA tensors (name -> tensor, as
    `adapter_tensors` gave them) in place of its own, which come back after: the reference policy (the adapter as it
    started) without a second copy of the base."""

    def __init__(self, model: torch.nn.Module, tensors: dict[str, Tensor]) -> None:
        self.params = dict(model.named_parameters())
        self.tensors, self.saved = tensors, {}

    def __enter__(self) -> None:
        for name, t in self.tensors.items():
            p = self.params[name]
            self.saved[name], p.data = p.data, t.to(p.device, p.dtype)

    def __exit__(self, *exc) -> None:
        for name, data in self.saved.items():
            self.params[name].data = data
        self.saved = {}


def adapter_tensors(model: torch.nn.Module) -> dict[str, Tensor]:
    """A copy of the trainable (LoRA) tensors as they are now."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def drop_decode_weights(model: torch.nn.Module) -> None:
    """Drop the fp32 decoding copies the LoRA layers keep (stale once an optimizer step has changed A and B)."""
    for m in lora_modules(model).values():
        m.drop_decode_weights()


# ---- rewards -> advantages -------------------------------------------------------------------------------------------
def nanstd(x: Tensor, dim: Optional[int] = None) -> Tensor:
    """The standard deviation ignoring NaNs, with Bessel's correction (TRL's nanstd)."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim)
    var = torch.nanmean((x - mean) ** 2, dim=dim) * count / (count - 1)
    return var.sqrt()


def advantages(per_func: Tensor, weights: Tensor, G: int, scale: str) -> tuple[Tensor, dict]:
    """The advantage of each completion ([N], groups of G consecutive) from each reward function's rewards [N, F]
    (NaN: not scored) and the functions' weights [F]; and the metrics TRL logs of them (reward, reward_std,
    frac_reward_zero_std). A completion no function scored gets advantage 0 and is left out of its group's mean."""
    unscorable = torch.isnan(per_func).all(dim=1)
    rewards = (per_func * weights[None]).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:  # group (and none: the group's std only tells which groups had equal rewards)
        std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G) if G > 1 else torch.zeros_like(rewards)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + STD_EPS)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    metrics = {"reward": float(torch.nanmean(rewards)), "reward_std": float(nanstd(rewards)),
               "frac_reward_zero_std": float(zero_std.float().mean())}
    return torch.nan_to_num(adv, nan=0.0), metrics


def reward_metrics(per_func: Tensor, names: list[str], prefix: str = "") -> dict:
    """rewards/NAME/mean and rewards/NAME/std of each function over the completions it scored (TRL's names)."""
    out = {}
    for j, name in enumerate(names):
        out[f"{prefix}rewards/{name}/mean"] = float(torch.nanmean(per_func[:, j]))
        out[f"{prefix}rewards/{name}/std"] = float(nanstd(per_func[:, j]))
    return out


def length_metrics(lengths: Tensor, truncated: Tensor) -> dict:
    """completions/* of TRL: lengths of all completions, the share cut at --max_completion_length, and the lengths
    of those that ended by themselves."""
    lengths = lengths.float()
    done = lengths[~truncated] if bool((~truncated).any()) else torch.zeros(1)
    return {"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(truncated.float().mean()),
            "completions/mean_terminated_length": float(done.mean())}


def score_completions(rewards: list, tokenizer: Any, prompts: list[Prompt], completions: list[Completion],
                      G: int) -> Tensor:
    """[n, F] each reward function's reward of the completions (G per prompt, prompt-major), passed as TRL passes them:
    the prompts as the data holds them, the completions as text (for a conversation prompt as an assistant message),
    their token ids, and each other column of the rows."""
    if not completions:
        return torch.zeros(0, len(rewards))
    rows = [p for p in prompts for _ in range(G)]
    texts = [tokenizer.decode(c.ids) for c in completions]
    shown = [[{"role": "assistant", "content": t}] if isinstance(p.prompt, list) else t for p, t in zip(rows, texts)]
    columns = {k: [p.columns.get(k) for p in rows] for k in dict.fromkeys(k for p in prompts for k in p.columns)}
    return score(rewards, [p.prompt for p in rows], shown, [c.ids for c in completions], columns,
                 [p.where for p in rows])


def validation_sums(per_func: Tensor, weights: Tensor) -> Tensor:
    """What validation adds up over devices: [the scored completions' summed rewards, their count, each function's
    reward sum, each function's scored count]."""
    scored = ~torch.isnan(per_func)
    summed = (per_func * weights).nansum(1)[scored.any(1)]
    return torch.cat([torch.stack([summed.sum(), torch.tensor(float(len(summed)))]),
                      torch.nan_to_num(per_func).sum(0), scored.sum(0).float()])


def validation_metrics(sums: Tensor, names: list[str]) -> dict:
    """val_reward (the mean reward), val_loss (minus it: what early stopping lowers), val_rewards/NAME/mean."""
    reward, F = float(sums[0] / sums[1].clamp(min=1)), len(names)
    out = {"val_reward": reward, "val_loss": -reward}
    out.update({f"val_rewards/{n}/mean": float(sums[2 + j] / sums[2 + F + j].clamp(min=1))
                for j, n in enumerate(names)})
    return out


# ---- the loss --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LossSettings:
    loss_type: str = "dapo"
    epsilon: float = 0.2  # the ratio's lower clip: 1 - epsilon
    epsilon_high: Optional[float] = None  # its upper clip: 1 + epsilon_high (default: epsilon)
    beta: float = 0.0  # the KL term's weight
    max_completion_length: int = 256  # dr_grpo's constant normalizer


@dataclass
class StepCounts:
    """What the aggregations divide by: the step's completions, their counted tokens and its micro batches, over
    every micro batch on every device."""

    sequences: int
    tokens: int
    micro_batches: int


def token_losses(logps: Tensor, old: Optional[Tensor], ref: Optional[Tensor], adv: Tensor,
                 s: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """Each completion token's loss [N, L] (before masking) and its per-token statistics (kl, the clipped ones).
    `old`: the sampling policy's log-probabilities (None: this is the update right after sampling, ratio 1);
    `ref`: the reference's (with beta > 0)."""
    old = logps.detach() if old is None else old
    coef_1 = torch.exp(logps - old)
    high = s.epsilon if s.epsilon_high is None else s.epsilon_high
    coef_2 = torch.clamp(coef_1, 1 - s.epsilon, 1 + high)
    a = adv[:, None]
    loss = -torch.min(coef_1 * a, coef_2 * a)
    stats = {"clip_ratio/low_mean": ((coef_1 < 1 - s.epsilon) & (a < 0)).float(),
             "clip_ratio/high_mean": ((coef_1 > 1 + high) & (a > 0)).float()}
    stats["clip_ratio/region_mean"] = torch.maximum(stats["clip_ratio/low_mean"], stats["clip_ratio/high_mean"])
    if s.beta != 0.0:
        d = ref - logps
        kl = torch.exp(d) - d - 1
        loss = loss + s.beta * kl
        stats["kl"] = kl.detach()
    return loss, {k: v.detach() for k, v in stats.items()}


def aggregate(loss: Tensor, mask: Tensor, loss_type: str, counts: StepCounts, max_completion_length: int) -> Tensor:
    """This micro batch's share of the step's loss: summed over micro batches and devices it is the loss of one big
    batch, as TRL aggregates each --loss_type (its micro batch = ours with G completions per prompt)."""
    masked = loss * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / counts.sequences
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / counts.micro_batches
    if loss_type == "dr_grpo":
        return masked.sum() / (counts.sequences * max_completion_length)
    if loss_type == "dapo":
        return masked.sum() / max(counts.tokens, 1)
    raise ValueError(f"unknown loss_type {loss_type!r}; one of {LOSS_TYPES}")


# ---- a step's samples ------------------------------------------------------------------------------------------------
@dataclass
class MicroBatch:
    """One micro batch of this device's samples: its prompts' tokens, their completions (G each), the loss mask, the
    advantages, and the sampling policy's and the reference's log-probabilities (None when not needed)."""

    prompts: list
    completions: list
    mask: Tensor  # [n, L] 1 for a counted completion token
    adv: Tensor  # [n]
    old: Optional[Tensor] = None
    ref: Optional[Tensor] = None


@dataclass
class Samples:
    """What one sampling produced for this device (kept for --num_iterations updates, and in checkpoints)."""

    step: int  # the step that sampled
    micro: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)  # the sampling's metrics (all devices)
    counts: Optional[StepCounts] = None

    def state_dict(self) -> dict:
        return {"step": self.step, "metrics": self.metrics, "counts": vars(self.counts),
                "micro": [vars(m) for m in self.micro]}

    @classmethod
    def from_state(cls, d: dict, where: object) -> "Samples":
        try:
            return cls(d["step"], [MicroBatch(**m) for m in d["micro"]], d["metrics"], StepCounts(**d["counts"]))
        except (KeyError, TypeError) as e:
            raise UserError(f"{where}: its GRPO samples are damaged ({type(e).__name__}: {e}); use an earlier "
                            "checkpoint") from None


def completion_mask(completions: list[Completion], mask_truncated: bool) -> Tensor:
    """[n, L]: 1 at each completion token, a completion cut at the length limit all 0 with mask_truncated."""
    L = max(len(c.ids) for c in completions)
    m = torch.zeros(len(completions), L)
    for i, c in enumerate(completions):
        if not (mask_truncated and c.finish_reason == "length"):
            m[i, :len(c.ids)] = 1.0
    return m


def warn_truncation(ratio: float, limit: int, warned: list) -> None:
    """Said once a run: most completions hit --max_completion_length, so most rewards judge cut-off text."""
    if ratio > 0.5 and not warned:
        warned.append(True)
        print(f"warning: {ratio:.0%} of the completions reached --max_completion_length {limit} before ending; their "
              "rewards judge cut-off text (raise --max_completion_length, or --mask_truncated_completions true)",
              file=sys.stderr)
