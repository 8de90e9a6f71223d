"""Preference-tune a LoRA adapter (DPO, IPO, ORPO, SimPO) on a dense or quantized (QLoRA) base.

    python finetune/dpo.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct --data_dir data/pairs \\
        --quantize bnb.nf4 --loss dpo --beta 0.1 --lora_path out/sft/lit_model_lora_finetuned.pth

--data_dir holds JSON / JSONL rows {prompt, chosen, rejected}, strings or messages (lit_qlora/train/preference.py);
--data_sources mixes several such sources as finetune/lora.py mixes samples. The phases are the shared training loop's
(lit_qlora/train/loop.py: setup -> check_inputs -> main -> build_model -> restore -> fit -> summarize, with its flags,
checkpoints, --resume, DDP and FSDP, NaN guard and metrics.csv); this script gives them its Objective: pairs instead of
samples, the preference loss of each step, validation on the held-out pairs, and the rewards TRL logs
(rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies) as metrics.csv columns.

The reference of dpo/ipo is the model before its first update, the base (a fresh adapter adds nothing) or the base
with the --lora_path adapter: its log-probabilities of every pair are computed once, by the same model, before
training, and kept in out_dir/reference_logps.pt for --resume. No second copy of the weights is loaded, and a step
runs one forward (chosen and rejected rows together) instead of two. The adapter saved is a plain Adapter: it loads
in generate/lora.py and exports to PEFT like any other.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from lit_qlora.adapter import Adapter
from lit_qlora.args import FinetuneArgs, parse_finetune_args
from lit_qlora.data.prepare import DataSettings, ensure_mixture
from lit_qlora.distributed import is_sharded
from lit_qlora.quant.quantize import validation_mode
from lit_qlora.readers import load_torch
from lit_qlora.train import loop
from lit_qlora.train import preference as pf
from lit_qlora.train.training import head_chunk
from lit_qlora.utils import UserError, atomic_torch_save, run_main

REFERENCE_FILE = "reference_logps.pt"
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


@dataclass
class PreferenceState:
    """What the preference objective keeps beside the Session (as `session.preference`)."""

    loss: str
    beta: float
    gamma: float
    ref_train: torch.Tensor | None  # [n_train, 2]: the reference's (chosen, rejected) log-probabilities (dpo/ipo)
    ref_val: torch.Tensor | None


def lora_config(args: FinetuneArgs):
    """The --lora_path adapter's own LoRA settings, or the --lora_* flags for a fresh adapter."""
    path = args.pref.lora_path
    if path is None:
        return args.lora.config()
    return _sft_adapter(args).config


def _sft_adapter(args: FinetuneArgs) -> Adapter:
    return loop.starting_adapter(args.run.checkpoint_dir, args.pref.lora_path)


def load_data(args: FinetuneArgs, tokenizer, config, max_seq_length: int) -> tuple[list, list, dict]:
    """The pairs (lit_qlora.train.preference.load_pairs) of --data_dir or of the --data_sources mixture, after the
    flags that do not apply to them."""
    if args.data.packing:
        raise UserError("--packing does not apply to preference pairs (a pair's two rows are unpadded into one "
                        "forward already); leave --packing out")
    if not args.data.mask_inputs:
        raise UserError("--mask_inputs false does not apply to preference pairs (the prompt is always masked: only "
                        "the answers are compared); leave it out")
    if args.data.streaming:
        raise UserError("--streaming does not apply to finetune/dpo.py: the reference log-probabilities of every pair "
                        "are computed before the first step; leave --streaming out")
    if args.pref.lora_path is not None:
        _sft_adapter(args).check_base(config, args.pref.lora_path)
    settings = DataSettings(max_seq_length, template=args.data.template)
    if args.data.data_sources is None:
        return pf.load_pairs(args.data.data_dir, tokenizer, settings)
    # a mixture: every source read as --data_dir is, then mixed as finetune/lora.py mixes samples (a pair may come
    # more than once: each place of it is numbered for its reference log-probabilities)
    train, val, meta = ensure_mixture(args.data.data_sources, tokenizer, settings, args.run.seed, load=pf.load_pairs)
    return pf.numbered(train), pf.numbered(val), meta


def start(s) -> None:
    """Before the first step: the stream of pairs (at the position restore found), the --lora_path adapter's weights
    on a new run, and the reference log-probabilities (computed now, or read back on --resume)."""
    args, inputs, fabric = s.args, s.inputs, s.fabric
    stream = pf.PairStream(inputs.train_data, batch_size=inputs.micro_batch_size * fabric.world_size,
                           seed=args.run.seed)
    stream.load_state_dict(s.stream.state_dict())
    s.stream = stream
    p = args.pref
    if p.lora_path is not None and inputs.resume_state is None:
        _sft_adapter(args).load_into(s.gpt)
    ref_train = ref_val = None
    if pf.needs_reference(p.loss):
        ref_file = Path(args.run.out_dir) / REFERENCE_FILE
        if inputs.resume_state is not None:
            ref_train, ref_val = _read_reference(ref_file, len(inputs.train_data), len(inputs.val_data))
        else:
            ref_train, ref_val = reference_logps(s, inputs.train_data), reference_logps(s, inputs.val_data)
            if fabric.global_rank == 0:
                atomic_torch_save({"train": ref_train.cpu(), "val": ref_val.cpu()}, ref_file)
    s.preference = PreferenceState(p.loss, p.beta, p.gamma, ref_train, ref_val)
    s.train_info.update(objective=p.loss, beta=p.beta, gamma=p.gamma if p.loss == "simpo" else None,
                        started_from=str(p.lora_path) if p.lora_path else None)


def _read_reference(path: Path, n_train: int, n_val: int) -> tuple[torch.Tensor, torch.Tensor]:
    fix = "start a new --out_dir (the reference is the model before its first update)"
    ref = load_torch(path, "reference log-probabilities", fix)
    ok = isinstance(ref, dict) and all(isinstance(ref.get(k), torch.Tensor) for k in ("train", "val"))
    if not ok or tuple(ref["train"].shape) != (n_train, 2) or tuple(ref["val"].shape) != (n_val, 2):
        raise UserError(f"{path} does not hold the reference log-probabilities of these {n_train} + {n_val} pairs "
                        f"(the data changed?); {fix}")
    return ref["train"], ref["val"]


def my_batches(s, pairs: list, n_batches: int):
    """(start, the pairs, counted) of this device's share of the first `n_batches` micro-batches of `pairs`: batch i
    on device i % world. Under FSDP every device takes part in every forward (the others wait in its gathers): one
    whose share has run out computes the first batch again, `counted` False (its results are dropped)."""
    world, rank, mb = s.fabric.world_size, s.fabric.global_rank, s.inputs.micro_batch_size
    sharded = is_sharded(s.fabric)
    for first in range(0, n_batches, world):
        i = first + rank
        if i < n_batches:
            yield i * mb, pairs[i * mb:(i + 1) * mb], True
        elif sharded:
            yield 0, pairs[:mb], False


@torch.no_grad()
def reference_logps(s, pairs: list) -> torch.Tensor:
    """[len(pairs), 2]: (chosen, rejected) log-probabilities of the model as it is now (the policy before its first
    update); each device computes its share of the micro-batches."""
    fabric, world = s.fabric, s.fabric.world_size
    out = torch.zeros(len(pairs), 2, device=fabric.device)
    validation_mode(s.model)
    for start_, chunk, counted in my_batches(s, pairs, -(-len(pairs) // s.inputs.micro_batch_size)):
        lp = _logps(s, pf.collate_pairs(chunk, pad_id=_pad(s)))
        if counted:
            out[start_:start_ + len(chunk)] = torch.stack([lp.chosen, lp.rejected], dim=1).float()
    s.model.train()
    return fabric.all_reduce(out, reduce_op="sum") if world > 1 else out


def _pad(s) -> int:
    return s.inputs.tokenizer.eos_id or 0


def _logps(s, batch: dict) -> pf.PairLogps:
    return pf.batch_logps(s.model, batch, s.fabric.device, head_chunk(s.inputs.config))


def _pair_terms(s, pairs: list, ref: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(sum of the per-pair losses, ORPO's NLL sum or 0, sums of the reward statistics) of some pairs."""
    p = s.preference
    batch = pf.collate_pairs(pairs, pad_id=_pad(s))
    lp = _logps(s, batch)
    ref_c = ref_r = None
    if ref is not None:
        r = ref[batch["index"].to(ref.device)]
        ref_c, ref_r = r[:, 0], r[:, 1]
    per_pair, rc, rr = pf.pair_losses(p.loss, lp, ref_c, ref_r, p.beta, p.gamma)
    nll = pf.orpo_nll(lp) if p.loss == "orpo" else per_pair.new_zeros(())
    return per_pair.sum(), nll, pf.reward_stats(rc, rr)


def _chosen_tokens(pairs: list) -> int:
    return sum(int((q["chosen_labels"][1:] != -100).sum()) for q in pairs)


def accumulate(s) -> tuple[float, int, dict]:
    """One step's forwards and backwards: the loss averaged over the step's pairs on all devices (ORPO's NLL over
    their chosen tokens), so accumulation and DDP give the update of one big batch."""
    fabric, world, rank = s.fabric, s.fabric.world_size, s.fabric.global_rank
    micro = [next(s.stream) for _ in range(s.accum)]  # every device draws the same pairs; each takes its share
    n_pairs = sum(len(m) for m in micro)
    n_chosen = max(1, sum(_chosen_tokens(m) for m in micro))
    sums = torch.zeros(1 + len(REWARDS), device=fabric.device)
    tokens = 0
    for j, m in enumerate(micro):
        mine = m[rank::world]
        counted = 1.0 if mine else 0.0  # a device without pairs still runs one (weighted 0): DDP, FSDP wait on it
        mine = mine or m[:1]
        with fabric.no_backward_sync(s.model, enabled=j < s.accum - 1):
            loss_sum, nll, stats = _pair_terms(s, mine, s.preference.ref_train)
            loss = (loss_sum / n_pairs + nll / n_chosen) * counted
            fabric.backward(loss * world)
        sums += torch.stack([loss.detach(), *(v * counted for v in stats.values())])
        n = sum(len(q["chosen_ids"]) + len(q["rejected_ids"]) for q in m[rank::world])
        tokens += n
        s.computed_tokens += n
        s.row_slots += n
    sums = fabric.all_reduce(sums, reduce_op="sum") if world > 1 else sums
    tokens = int(fabric.all_reduce(torch.tensor(float(tokens), device=fabric.device), reduce_op="sum")) \
        if world > 1 else tokens
    return float(sums[0]), tokens, {k: float(v) / n_pairs for k, v in zip(REWARDS, sums[1:])}


@torch.no_grad()
def validate(s) -> dict:
    """The loss and rewards on the first `eval_iters` micro-batches of the held-out pairs (all devices)."""
    fabric, world = s.fabric, s.fabric.world_size
    val, mb = s.inputs.val_data, s.inputs.micro_batch_size
    validation_mode(s.model)
    sums = torch.zeros(3 + len(REWARDS), device=fabric.device)  # losses, NLL, pairs, rewards
    for _, chunk, counted in my_batches(s, val, min(s.args.eval.eval_iters, -(-len(val) // mb))):
        loss_sum, nll, stats = _pair_terms(s, chunk, s.preference.ref_val)
        if counted:
            sums += torch.stack([loss_sum.float(), nll.float() / max(1, _chosen_tokens(chunk)) * len(chunk),
                                 torch.tensor(float(len(chunk)), device=fabric.device), *stats.values()])
    sums = fabric.all_reduce(sums, reduce_op="sum") if world > 1 else sums
    s.model.train()
    n = float(sums[2].clamp(min=1))
    out = {"val_loss": float(sums[0] + sums[1]) / n}
    out.update({f"val_{k}": float(v) / n for k, v in zip(REWARDS, sums[3:])})
    fabric.print(f"validation: loss {out['val_loss']:.4f}, reward accuracy {out['val_rewards/accuracies']:.3f}, "
                 f"margin {out['val_rewards/margins']:.4f} ({int(n)} pairs)", file=sys.stderr)
    return out


PREFERENCE = loop.Objective(lora_config=lora_config, load_data=load_data, start=start, accumulate=accumulate,
                            validate=validate, metric_fields=(*REWARDS, *(f"val_{k}" for k in REWARDS)),
                            script="finetune/dpo.py")


def cli() -> None:
    """`python finetune/dpo.py ...`."""
    run_main(lambda: loop.setup(parse_finetune_args(preference=True), PREFERENCE))


if __name__ == "__main__":
    cli()
