"""Fine-tune a model with LoRA on a dense or quantized (QLoRA) base: supervised fine-tuning (SFT).

    python finetune/lora.py      # the demo: a tiny local model + bundled data, nf4-dq, a few minutes on CPU
    python finetune/lora.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-hf --data_dir data/alpaca \\
        --quantize bnb.nf4-dq --precision bf16-true

The phases, top to bottom, are the shared training loop's (lit_qlora/train/loop.py: setup -> check_inputs -> (one
process per device) main -> build_model -> restore -> fit (train_step, validate, save) -> summarize); this file gives
them SFT's `Objective`: the samples (`sft_data`), the loss of a step (`sft_accumulate`: the token cross entropy on
the target positions, plus a mixture of experts' load-balancing loss), and validation (`validate`: the loss, then one
greedy sample). One iteration = one optimizer step (gradient accumulation over
`batch_size / (micro_batch_size * devices)` micro-batches). Everything a run needs to continue is in
out_dir/checkpoints/iter-*.pth; `--resume` picks the newest intact one. The flags are in lit_qlora/args.py.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

from lit_qlora.args import FinetuneArgs, parse_finetune_args
from lit_qlora.data.batching import collate, unpad
from lit_qlora.data.chat_template import stop_ids
from lit_qlora.data.prepare import DataSettings, ensure_mixture, ensure_prepared
from lit_qlora.data.streaming import plan_stream
from lit_qlora.distributed import is_sharded
from lit_qlora.generation import generate
from lit_qlora.quant.quantize import validation_mode
from lit_qlora.tokenizer import Tokenizer
from lit_qlora.train import loop
from lit_qlora.train.loop import IGNORE_INDEX, Inputs, Objective, Session, build_model, router_aux_coef, tracks_routing
from lit_qlora.train.training import head_chunk, shard_batch, shift_labels
from lit_qlora.utils import UserError, run_main

__all__ = ["build_model", "router_aux_coef"]  # the shared phases, as tests and scripts reach them through this file


def sft_data(args: FinetuneArgs, tokenizer: Tokenizer, config, max_seq_length: int) -> tuple[list, list, dict]:
    """SFT's samples: prepared from --data_dir once, here, so DDP ranks never race on the cache."""
    d = args.data
    settings = DataSettings(max_seq_length, template=d.template, mask_inputs=d.mask_inputs, ignore_index=IGNORE_INDEX,
                            instruction_key=d.prompt_column, input_key=d.input_column, output_key=d.response_column,
                            messages_column=d.messages_column)
    if d.streaming:  # nothing tokenized here: what to read (check_inputs tokenizes the validation part)
        if args.train.max_iters is None:
            raise UserError("--streaming needs --max_iters (how many steps an epoch makes is not known without reading "
                            "the whole source); pass e.g. --max_iters 1000")
        plan, meta = plan_stream(d.data_dir if d.data_sources is None else None, d.data_sources, tokenizer, settings,
                                 args.run.seed)
        return plan, [], meta
    if d.data_sources is not None:
        return ensure_mixture(d.data_sources, tokenizer, settings, args.run.seed)
    return ensure_prepared(d.data_dir, tokenizer, settings)


def sft_accumulate(s: Session) -> tuple[float, int, dict]:
    """SFT's forwards and backwards of one step: (loss per target token, tokens, no more metrics)."""
    fabric, world, rank = s.fabric, s.fabric.world_size, s.fabric.global_rank
    micro = [shard_batch(next(s.stream), rank, world) for _ in range(s.accum)]
    # Normalize by the target tokens of the whole optimizer step on all devices, so accumulation and DDP give the
    # same update as one big batch.
    targets = [shift_labels(b["labels"], IGNORE_INDEX) for b in micro]
    n_tok = torch.tensor(float(sum(int((tg != IGNORE_INDEX).sum()) for tg in targets)), device=fabric.device)
    n_tok = fabric.all_reduce(n_tok, reduce_op="sum") if world > 1 else n_tok
    loss_sum = torch.zeros((), device=fabric.device)
    routing = tracks_routing(s)
    aux_sum, load = torch.zeros((), device=fabric.device), None
    for j, (batch, tgt) in enumerate(zip(micro, targets)):
        s.row_slots += batch["input_ids"].numel() * world
        batch, tgt = unpad(batch, tgt)  # why: see unpad(); the padding would cost as much as real tokens
        with fabric.no_backward_sync(s.model, enabled=j < s.accum - 1):
            loss = _batch_loss(s, batch, tgt, routing)
            if routing:  # the step's objective: the loss per target token + coef x the micro batches' mean aux loss
                loss, aux, batch_load = loss
                aux_sum += aux.detach()
                load = batch_load if load is None else load + batch_load
                fabric.backward(loss * world / n_tok.clamp(min=1) + aux * (s.inputs.router_aux_loss_coef / s.accum))
            else:
                fabric.backward(loss * world / n_tok.clamp(min=1))
        loss_sum += loss.detach()
        s.computed_tokens += batch["input_ids"].numel() * world
    loss_sum = fabric.all_reduce(loss_sum, reduce_op="sum") if world > 1 else loss_sum
    extra = _routing_metrics(s, aux_sum, load) if routing else {}
    return float(loss_sum / n_tok.clamp(min=1)), sum(int(b["lengths"].sum()) for b in micro) * world, extra


def _routing_metrics(s: Session, aux_sum: torch.Tensor, load: torch.Tensor) -> dict:
    """A step's aux_loss (the mean of its micro batches' on all devices) and expert_load_max (the largest share of
    a MoE layer's tokens that one expert got in this step; even routing: top_k / experts); the load is added to the
    run's (metrics.json)."""
    world = s.fabric.world_size
    both = torch.cat([aux_sum.reshape(1).double(), load.double().reshape(-1)])
    both = s.fabric.all_reduce(both, reduce_op="sum") if world > 1 else both
    aux, load = float(both[0]) / (s.accum * world), both[1:].reshape(load.shape).cpu()
    tokens = int(load[0].sum()) // s.inputs.config.moe_top_k
    s.last_expert_load = load
    s.expert_load = load if s.expert_load is None else s.expert_load + load
    s.expert_tokens += tokens
    return dict(aux_loss=aux, expert_load_max=float(load.max() / max(tokens, 1)))


def _batch_loss(s: Session, batch: dict, tgt: torch.Tensor, routing: bool = False):
    """Sum of the token losses of one (micro) batch: the output layer only at positions that have a target; packed
    rows attend within each sample. `routing`: (that sum, the routers' load-balancing loss, the expert load)."""
    dev = s.fabric.device
    tgt = tgt.to(dev)
    has_target = tgt != IGNORE_INDEX
    packed = {k: batch[k].to(dev) for k in ("positions", "segments") if k in batch}
    return s.model(batch["input_ids"].to(dev), lm_head_chunk=head_chunk(s.inputs.config), output_mask=has_target,
                   targets=tgt[has_target], router_aux=routing, **packed)


@torch.no_grad()
def validate(s: Session) -> float:
    """Token-weighted validation loss over the first `eval_iters` batches, then one greedy sample (rank 0)."""
    fabric, e, inputs = s.fabric, s.args.eval, s.inputs
    validation_mode(s.model)  # eval(), but int8 layers on CPU keep their lean training matmul
    world, rank = fabric.world_size, fabric.global_rank
    total = torch.zeros(2, device=fabric.device)  # loss sum, token count
    mb, val_data = inputs.micro_batch_size, inputs.val_data
    sharded = is_sharded(fabric)
    for i in range(min(e.eval_iters, -(-len(val_data) // (mb * world)))):
        chunk = val_data[(i * world + rank) * mb:(i * world + rank + 1) * mb]
        if not chunk and not sharded:
            continue
        counted = float(bool(chunk))  # FSDP: every rank takes part in every forward; an empty share counts nothing
        batch = collate(chunk or val_data[:1], pad_id=inputs.tokenizer.eos_id or 0, ignore_index=IGNORE_INDEX)
        tgt = shift_labels(batch["labels"], IGNORE_INDEX)
        batch, tgt = unpad(batch, tgt)  # as in training: the same losses without computing the padding
        total += torch.stack([_batch_loss(s, batch, tgt).float(),
                              (tgt != IGNORE_INDEX).sum().float().to(fabric.device)]) * counted
    total = fabric.all_reduce(total, reduce_op="sum") if world > 1 else total
    val_loss = float(total[0] / total[1].clamp(min=1))
    if val_data and (rank == 0 or sharded):  # FSDP: every rank takes part in each forward
        # One sample from the first validation prompt, so progress is visible in words too. The prompt is everything
        # before the first trained token (for a conversation: up to its first assistant turn).
        labels = val_data[0]["labels"]
        trained = (labels != IGNORE_INDEX).nonzero()
        n_prompt = int(trained[0]) if s.args.data.mask_inputs and len(trained) else 0
        n_prompt = n_prompt or max(1, len(labels) // 2)  # nothing masked: prompt with the first half
        prompt = val_data[0]["input_ids"][:n_prompt]
        tok = inputs.tokenizer
        stop = stop_ids(tok, s.train_info.get("chat_template"))  # with the chat template's end-of-turn token
        with fabric.autocast():
            # FSDP: no rank may stop on its own (the others would wait in a gather): all generate the full length
            out = generate(s.gpt, prompt,
                           max_new_tokens=min(e.eval_max_new_tokens, inputs.config.block_size - len(prompt)),
                           eos_ids=() if sharded else stop)
        new = out[len(prompt):]
        ends = [j for j, t in enumerate(new.tolist()) if t in stop] if sharded else []
        text = tok.decode(new[:ends[0] + 1] if ends else new).strip().replace("\n", " ")
        fabric.print(f"validation: loss {val_loss:.4f}, perplexity {float(torch.tensor(val_loss).exp()):.2f} | "
                     f"sample: {text[:200]!r}", file=sys.stderr)
    s.model.train()
    return val_loss


def sft_validate(s: Session) -> dict:
    return dict(val_loss=(v := validate(s)), val_ppl=float(torch.tensor(v).exp()))


SFT = Objective(lora_config=lambda args: args.lora.config(), load_data=sft_data, start=lambda s: None,
                accumulate=sft_accumulate, validate=sft_validate, routing=True)



def check_inputs(args: FinetuneArgs, objective: Optional[Objective] = None) -> Optional[Inputs]:
    """The shared loop's checks of every input (lit_qlora/train/loop.py), for SFT unless another objective is given."""
    return loop.check_inputs(args, objective or SFT)


def setup(args: FinetuneArgs, objective: Optional[Objective] = None) -> None:
    loop.setup(args, objective or SFT)


def cli() -> None:
    """`python finetune/lora.py ...` and `lit-qlora finetune ...`."""
    run_main(lambda: setup(parse_finetune_args()))


if __name__ == "__main__":
    cli()
