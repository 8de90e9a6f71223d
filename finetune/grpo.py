"""Train a LoRA adapter by online reinforcement learning (GRPO) on a dense or quantized (QLoRA) base.

    python finetune/grpo.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct --data_dir data/math \\
        --quantize bnb.nf4-dq --reward exact_answer --reward format --reward_weights 1 --reward_weights 0.2 \\
        --num_generations 8 --max_completion_length 256 --micro_batch_size 2 --batch_size 8

--data_dir holds rows with a prompt (the --prompt_column: text or messages; or a `messages` conversation) and any
other columns, which the reward functions get (lit_qlora/train/rewards.py: --reward module:function or a built-in).
The phases are the shared training loop's (lit_qlora/train/loop.py: setup -> check_inputs -> main -> build_model ->
restore -> fit -> summarize, with its flags, checkpoints, --resume, DDP, NaN guard, loggers and metrics.csv); this
file gives them GRPO's Objective. A step, top to bottom (`accumulate`):
  sample   every --num_generations completions of the step's prompts on this device, as one batch, by the model
           as it trains (the 4-bit base and the unmerged adapter; no copy, no weight sync) -> `sample_step`
  score    the reward functions on them, the rewards of all devices gathered, the advantages of each group
  logps    with --num_iterations > 1 the sampling policy's log-probabilities, with --beta the reference's (the
           adapter's starting tensors swapped in), both without gradient
  update   the clipped policy loss of each micro batch, forward and backward (`policy_micro_batch`)
Samples are kept (and checkpointed) for --num_iterations steps; a prompt's group stays on one device. `validate`:
one greedy completion per held-out prompt. Metrics under TRL's names; tutorials/finetune_grpo.md.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch

from lit_qlora.args import FinetuneArgs, parse_finetune_args
from lit_qlora.data.chat_template import stop_ids
from lit_qlora.data.prepare import DataSettings
from lit_qlora.quant.quantize import validation_mode
from lit_qlora.readers import load_torch
from lit_qlora.train import grpo as gr
from lit_qlora.train import loop
from lit_qlora.train.rewards import Reward, load_rewards
from lit_qlora.train.training import head_chunk
from lit_qlora.utils import UserError, atomic_torch_save, run_main

REFERENCE_FILE = "reference_adapter.pth"
LOSS_METRICS, TIMES = gr.LOSS_METRICS, gr.TIMES


@dataclass
class GRPOState:
    """What GRPO keeps beside the Session (as `session.grpo`)."""

    rewards: list[Reward]
    loss: gr.LossSettings
    stops: tuple  # token ids that end a completion
    reference: Optional[dict]  # the adapter's starting tensors (--beta > 0)
    samples: Optional[gr.Samples] = None
    warned: list = field(default_factory=list)  # what was warned about once


# ---- before training --------------------------------------------------------------------------------------------
def lora_config(args: FinetuneArgs):
    """The --lora_path adapter's own LoRA settings, or the --lora_* flags for a fresh adapter."""
    if args.grpo.lora_path is None:
        return args.lora.config()
    return loop.starting_adapter(args.run.checkpoint_dir, args.grpo.lora_path).config


def check(args: FinetuneArgs) -> None:
    """What finetune/grpo.py does not take, in one line each, before anything is planned or read."""
    run, d, t = args.run, args.data, args.train
    refused = [(t.micro_batch_size == "auto", "--micro_batch_size auto (the memory planner does not model sampling); "
                "give a number of prompts"), (run.estimate_only, "--estimate_only (the memory planner does not model "
                "sampling); leave it out"), (d.packing, "--packing (a group's completions share their prompt "
                "already); leave it out"), (d.streaming, "--streaming; pass a --data_dir of prompts"),
               (d.data_sources is not None, "--data_sources; pass one --data_dir of prompts"),
               (run.strategy == "fsdp", "--strategy fsdp (the sampling would gather every shard per token); use "
                "--strategy ddp")]
    for bad, what in refused:
        if bad:
            raise UserError(f"finetune/grpo.py does not take {what}")


def load_data(args: FinetuneArgs, tokenizer, config, max_seq_length: int) -> tuple[list, list, dict]:
    """The prompts (lit_qlora.train.grpo.load_prompts), every row holding the column exact_answer compares with."""
    d, g = args.data, args.grpo
    if g.lora_path is not None:
        loop.starting_adapter(args.run.checkpoint_dir, g.lora_path).check_base(config, g.lora_path)
    settings = DataSettings(max_seq_length, template=d.template, messages_column=d.messages_column)
    needed = {g.answer_column: "the exact_answer reward compares with; name it with --answer_column"} \
        if "exact_answer" in g.reward else {}
    return gr.load_prompts(d.data_dir, tokenizer, settings, d.prompt_column, config.block_size, needed)


def batches(args: FinetuneArgs, inputs, world: int) -> tuple[gr.PromptStream, int]:
    """The stream of global micro batches of prompts; steps: --max_iters, or --epochs x --num_iterations per batch."""
    n, per_step = len(inputs.train_data), inputs.batch_size
    stream = gr.PromptStream(inputs.train_data, batch_size=inputs.micro_batch_size * world, seed=args.run.seed)
    steps = args.train.max_iters or args.train.epochs * -(-n // per_step) * args.grpo.num_iterations
    return stream, steps


def start(s, rewards: list[Reward]) -> None:
    """The --lora_path adapter on a new run, the reference (the adapter's starting tensors, kept in out_dir for
    --resume) with --beta, and the samples a checkpoint kept."""
    args, g, inputs = s.args, s.args.grpo, s.inputs
    resumed = inputs.resume_state is not None
    if g.lora_path is not None and not resumed:
        loop.starting_adapter(args.run.checkpoint_dir, g.lora_path).load_into(s.gpt)
    reference, ref_file = None, Path(args.run.out_dir) / REFERENCE_FILE
    if g.beta and resumed:
        reference = load_torch(ref_file, "reference adapter", "start a new --out_dir (the reference is the adapter "
                               "before its first update)")
    elif g.beta:
        reference = gr.adapter_tensors(s.gpt)
        if s.fabric.global_rank == 0:
            atomic_torch_save(reference, ref_file)
    saved = (inputs.resume_state or {}).get("resume", {}).get("objective") or {}
    samples = gr.Samples.from_state(saved["samples"], inputs.resume_path) if saved.get("samples") else None
    template = inputs.data_meta.get("template")
    chat = inputs.tokenizer.chat_template if template == "chat" or any(
        isinstance(p.prompt, list) for p in inputs.train_data[:1]) else None
    loss = gr.LossSettings(g.loss_type, g.epsilon, g.epsilon_high, g.beta, g.max_completion_length)
    s.grpo = GRPOState(rewards, loss, tuple(stop_ids(inputs.tokenizer, chat)), reference, samples, [])
    s.train_info.update(objective="grpo", loss_type=g.loss_type, beta=g.beta, num_generations=g.num_generations,
                        rewards=[r.name for r in rewards], chat_template=chat,
                        started_from=str(g.lora_path) if g.lora_path else None)


# ---- a step ---------------------------------------------------------------------------------------------------------
def accumulate(s) -> tuple[float, int, dict]:
    """One optimizer step: new samples every --num_iterations steps, then each micro batch's loss and backward."""
    st, g, fabric, world = s.grpo, s.args.grpo, s.fabric, s.fabric.world_size
    times = dict.fromkeys(TIMES, 0.0)
    if st.samples is None or s.step - st.samples.step >= g.num_iterations:
        st.samples = sample_step(s, times)
    samples = st.samples
    sums = torch.zeros(2 + len(LOSS_METRICS), device=fabric.device)  # loss, counted tokens, statistics
    for j, mb in enumerate(samples.micro):
        with fabric.no_backward_sync(s.model, enabled=j < len(samples.micro) - 1):
            sums += policy_micro_batch(s, mb, samples.counts, times)
    sums = fabric.all_reduce(sums, reduce_op="sum") if world > 1 else sums
    tokens = float(sums[1])
    extra = {k: float(v) / max(tokens, 1.0) for k, v in zip(LOSS_METRICS, sums[2:]) if k != "kl" or g.beta}
    return float(sums[0]), int(tokens), {**samples.metrics, **extra, **{k: v * 1000 for k, v in times.items()}}


def policy_micro_batch(s, mb: gr.MicroBatch, counts: gr.StepCounts, times: dict) -> torch.Tensor:
    """The policy's log-probabilities, loss and backward for one micro batch: [its loss share, its counted tokens,
    the sums of the per-token statistics]."""
    st, dev = s.grpo, s.fabric.device
    t0 = time.perf_counter()
    with s.fabric.autocast():
        logps = gr.token_logps(s.model, mb.prompts, mb.completions, s.args.grpo.num_generations,
                               temperature=s.args.grpo.temperature, lm_head_chunk=head_chunk(s.inputs.config),
                               device=dev)
    mask = mb.mask.to(dev)
    loss, stats = gr.token_losses(logps, _on(mb.old, dev), _on(mb.ref, dev), mb.adv.to(dev), st.loss)
    share = gr.aggregate(loss, mask, st.loss.loss_type, counts, st.loss.max_completion_length)
    t1 = time.perf_counter()
    s.fabric.backward(share * s.fabric.world_size)
    times["time/forward_ms"] += t1 - t0
    times["time/backward_ms"] += time.perf_counter() - t1
    zero = torch.zeros((), device=dev)
    return torch.stack([share.detach(), mask.sum(), *((stats[k] * mask).sum() if k in stats else zero
                                                      for k in LOSS_METRICS)])


def _on(t: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    return None if t is None else t.to(device)


def sample_step(s, times: dict) -> gr.Samples:
    """This device's prompts of the step (its share of each global micro batch), G completions of each sampled as one
    batch, scored, their advantages from every device's rewards, and (no gradient) the log-probabilities the loss
    compares with."""
    g, fabric, world, rank = s.args.grpo, s.fabric, s.fabric.world_size, s.fabric.global_rank
    micro = [next(s.stream)[rank::world] for _ in range(s.accum)]
    prompts = [p for m in micro for p in m]
    t0 = time.perf_counter()
    completions = sample(s, prompts, g.num_generations, g.temperature, s.step)
    t1 = time.perf_counter()
    per_func = scored(s, prompts, completions, g.num_generations)
    lengths = torch.tensor([len(c.ids) for c in completions], dtype=torch.float32)
    truncated = torch.tensor([c.finish_reason == "length" for c in completions], dtype=torch.float32)
    mine = torch.cat([per_func, lengths[:, None], truncated[:, None]], 1).to(fabric.device)
    every = (fabric.all_gather(mine).reshape(-1, mine.size(1)) if world > 1 else mine).cpu()
    weights = torch.tensor([r.weight for r in s.grpo.rewards])
    adv, metrics = gr.advantages(every[:, :-2], weights, g.num_generations, g.scale_rewards)
    metrics.update(gr.reward_metrics(every[:, :-2], [r.name for r in s.grpo.rewards]))
    metrics.update(gr.length_metrics(every[:, -2], every[:, -1].bool()))
    gr.warn_truncation(metrics["completions/clipped_ratio"], g.max_completion_length, s.grpo.warned)
    adv = adv[rank * len(completions):(rank + 1) * len(completions)]
    t2 = time.perf_counter()
    batches = micro_batches(s, micro, completions, adv)
    times.update({"time/sampling_ms": t1 - t0, "time/rewards_ms": t2 - t1,
                  "time/old_ref_logps_ms": time.perf_counter() - t2})
    tokens = sum(float(b.mask.sum()) for b in batches)
    tokens = float(fabric.all_reduce(torch.tensor(tokens, device=fabric.device), reduce_op="sum")) if world > 1 \
        else tokens
    counts = gr.StepCounts(len(completions) * world, int(tokens), len(batches) * world)
    return gr.Samples(s.step, batches, metrics, counts)


def micro_batches(s, micro: list, completions: list, adv: torch.Tensor) -> list[gr.MicroBatch]:
    """The samples cut into this device's micro batches, with the sampling policy's log-probabilities (for
    --num_iterations > 1) and the reference's (--beta), computed without gradient, dropout off."""
    g, st, G = s.args.grpo, s.grpo, s.args.grpo.num_generations
    out, k = [], 0
    validation_mode(s.model)
    for m in micro:
        part = completions[k:k + len(m) * G]
        mb = gr.MicroBatch([p.ids for p in m], [c.ids for c in part],
                           gr.completion_mask(part, g.mask_truncated_completions), adv[k:k + len(part)])
        kw = dict(temperature=g.temperature, lm_head_chunk=head_chunk(s.inputs.config), device=s.fabric.device)
        with torch.no_grad(), s.fabric.autocast():
            if g.num_iterations > 1:
                mb.old = gr.token_logps(s.model, mb.prompts, mb.completions, G, **kw).cpu()
            if g.beta:
                with gr.swapped_adapter(s.gpt, st.reference):
                    mb.ref = gr.token_logps(s.model, mb.prompts, mb.completions, G, **kw).cpu()
        out.append(mb)
        k += len(part)
    s.model.train()
    return out


def sample(s, prompts: list, G: int, temperature: float, step: int) -> list[gr.Completion]:
    """G completions of each prompt (prompt-major), by the model as it is, as one batch of the engine (through the
    4-bit decoding kernel where it applies, for the sampling only)."""
    g = s.args.grpo
    ids, sampling = gr.group_sampling(prompts, G, s.args.run.seed, step, g.max_completion_length, temperature, g.top_k,
                                      g.top_p, s.grpo.stops)
    validation_mode(s.gpt)
    try:
        with s.fabric.autocast():
            return gr.sample_completions(s.gpt, ids, sampling)
    finally:
        s.model.train()


def scored(s, prompts: list, completions: list, G: int) -> torch.Tensor:
    """[n, F] rewards of this device's completions; a bad reward function stops every device (its message on the
    device where it failed)."""
    error, out = None, torch.zeros(len(completions), len(s.grpo.rewards))
    try:
        out = gr.score_completions(s.grpo.rewards, s.inputs.tokenizer, prompts, completions, G)
    except UserError as e:
        error = e
    if s.fabric.world_size > 1:
        failed = s.fabric.all_reduce(torch.tensor(float(error is not None), device=s.fabric.device), reduce_op="sum")
        if error is None and float(failed) > 0:
            error = UserError("a reward function failed on another device (its message is above); fix it and resume")
    if error is not None:
        raise error
    return out


# ---- validation -------------------------------------------------------------------------------------------------
@torch.no_grad()
def validate(s) -> dict:
    """One greedy completion of each of the first eval_iters x micro_batch_size x devices held-out prompts: the mean
    reward (val_reward; val_loss is minus it) and each function's (val_rewards/NAME/mean); one sample printed."""
    fabric, world, names = s.fabric, s.fabric.world_size, [r.name for r in s.grpo.rewards]
    val = s.inputs.val_data[:s.args.eval.eval_iters * s.inputs.micro_batch_size * world]
    mine = val[fabric.global_rank::world]
    completions = sample(s, mine, 1, 0.0, 0) if mine else []
    per_func = scored(s, mine, completions, 1)
    sums = gr.validation_sums(per_func, torch.tensor([r.weight for r in s.grpo.rewards])).to(fabric.device)
    sums = (fabric.all_reduce(sums, reduce_op="sum") if world > 1 else sums).cpu()
    out = gr.validation_metrics(sums, names)
    if completions and fabric.global_rank == 0:
        text = s.inputs.tokenizer.decode(completions[0].ids).strip().replace("\n", " ")
        fabric.print(f"validation: reward {out['val_reward']:.4f} ({int(sums[1])} prompts) | sample: {text[:200]!r}",
                     file=sys.stderr)
    return out


# ---- the objective ------------------------------------------------------------------------------------------------
GRPO = loop.Objective(lora_config=lora_config, load_data=load_data, start=lambda s: None, accumulate=accumulate,
                      validate=validate, script="finetune/grpo.py", check=check, batches=batches,
                      settings=lambda args: {"grpo": {k: v for k, v in vars(args.grpo).items() if k != "lora_path"}},
                      state=lambda s: {"samples": s.grpo.samples.state_dict() if s.grpo.samples else None},
                      after_step=lambda s: gr.drop_decode_weights(s.gpt))


def objective(args: FinetuneArgs) -> loop.Objective:
    """GRPO's Objective for these flags: the reward functions loaded (a bad one refused before anything else), and
    the metrics.csv columns they make."""
    g = args.grpo
    rewards = load_rewards(g.reward, g.reward_weights, answer_column=g.answer_column, format_regex=g.format_regex,
                           max_completion_length=g.max_completion_length)
    per_func = tuple(f"rewards/{r.name}/{k}" for r in rewards for k in ("mean", "std"))
    val = ("val_reward", *(f"val_rewards/{r.name}/mean" for r in rewards))
    return replace(GRPO, start=lambda s: start(s, rewards),
                   metric_fields=(*gr.SAMPLE_METRICS, *per_func, *LOSS_METRICS, *TIMES, *val))


def cli() -> None:
    """`python finetune/grpo.py ...`."""
    def run() -> None:
        args = parse_finetune_args(grpo=True)
        loop.setup(args, objective(args))

    run_main(run)


if __name__ == "__main__":
    cli()
