"""Several processes: data parallel on one or several machines (DDP), and the sharded base (FSDP).

Several machines: Fabric's cluster environments start and connect the processes (torchrun, SLURM, ...): every
machine runs the same command, `--num_nodes` says how many there are (tutorials/reference/distributed.md).

Sharded base (`--strategy fsdp`): torch's `fully_shard` (FSDP2), through Fabric's ModelParallelStrategy, on CPU
(gloo) and CUDA alike. Fabric's FSDPStrategy (FSDP1) is not used: Fabric refuses it on CPU and torch's FSDP1 needs
an accelerator ("FSDP needs a non-CPU accelerator device"), and FSDP1 flattens each unit into one tensor of one
dtype, so a 4-bit base would have to store its packed bytes as floats (bitsandbytes' quant_storage).

How the 4-bit base is sharded: each packed weight is a plain uint8 parameter [n/2, 1] that FSDP2 splits along
dim 0 (lit_qlora.loader.load_model_sharded builds the model on meta, shards it, then keeps only this rank's bytes of
each weight as it is quantized). FSDP2 gathers a unit whose parameters have several dtypes as raw bytes, so the packed
weights are never read as floats: the silent corruption of bitsandbytes#1945 (NaN bit patterns of bf16-stored 4-bit
weights rewritten when gathered) cannot happen to them. The block scales (QuantState) are small and stay whole on
every rank as `module.quant_state`; bitsandbytes' Linear4bit.forward rebuilds its Params4bit around the gathered
bytes from it (the Params4bit subclass does not survive FSDP, bitsandbytes#1424, accelerate#3983). LoRA weights,
their gradients and the AdamW state are sharded too. Checkpoints gather the LoRA weights and the optimizer state
(`full_lora_state_dict`, `optimizer_state_to_save`): the adapter file is the same as without sharding.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import torch
import torch.nn as nn

from lit_qlora.lora import lora_state_dict
from lit_qlora.quant.quant_mode import QuantMode
from lit_qlora.utils import UserError

STRATEGIES = ("auto", "ddp", "fsdp")
FSDP_MIN_TORCH = (2, 13)  # fully_shard of uint8 (non-float) parameters: pytorch#177948; the version tested here


# ---- launching ------------------------------------------------------------------------------------------------
def cluster_environment() -> Optional[str]:
    """The launcher Fabric will find in this process's environment (what starts and connects the processes of a
    multi-machine run), or None when the process was started by hand."""
    from lightning.fabric.plugins.environments import (
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    for name, env in (("torchrun", TorchElasticEnvironment), ("SLURM", SLURMEnvironment), ("LSF", LSFEnvironment),
                      ("MPI", MPIEnvironment)):
        try:
            if env.detect():
                return name
        except Exception:  # e.g. SLURM's check that srun was used: Fabric itself will say what is wrong
            continue
    if "NODE_RANK" in os.environ and "MASTER_ADDR" in os.environ:  # Fabric's own: the same command on every machine
        return "manual (NODE_RANK, MASTER_ADDR)"
    return None


def check_world(devices: int, num_nodes: int) -> None:
    """--num_nodes and --devices against the launcher, before anything loads (one line each)."""
    if num_nodes < 1:
        raise UserError(f"--num_nodes must be at least 1, got {num_nodes}; pass the number of machines")
    env = cluster_environment()
    if num_nodes > 1 and env is None:
        raise UserError(f"--num_nodes {num_nodes} needs a launcher that starts this command on every machine and "
                        "connects them; none was found: run it with torchrun --nnodes ... or under SLURM (srun / "
                        "sbatch), see 'Several machines' in tutorials/reference/distributed.md, or leave --num_nodes "
                        "at 1")
    if env == "torchrun":
        world, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", devices))
        if devices * num_nodes != world or per_node != devices:
            raise UserError(f"torchrun starts {world} processes, {per_node} per machine, but --devices {devices} "
                            f"--num_nodes {num_nodes} make {devices * num_nodes}; pass --devices {per_node} "
                            f"--num_nodes {max(1, world // max(per_node, 1))}")
    elif env == "SLURM":
        per_node, nodes = os.environ.get("SLURM_NTASKS_PER_NODE"), os.environ.get("SLURM_NNODES")
        if per_node is not None and per_node.isdigit() and int(per_node) != devices:
            raise UserError(f"SLURM runs {per_node} tasks per node (--ntasks-per-node) but --devices is {devices}; "
                            f"pass --devices {per_node}")
        if nodes is not None and nodes.isdigit() and int(nodes) != num_nodes:
            raise UserError(f"SLURM gave the job {nodes} nodes but --num_nodes is {num_nodes}; pass --num_nodes "
                            f"{nodes}")


def check_strategy(strategy: str, quantize: Optional[str], precision: str, optimizer: str, compile: bool) -> None:
    """What --strategy fsdp cannot do, found before anything loads (one line each)."""
    if strategy not in STRATEGIES:
        raise UserError(f"unknown --strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if strategy != "fsdp":
        return
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < FSDP_MIN_TORCH:
        raise UserError(f"--strategy fsdp needs torch >= {'.'.join(map(str, FSDP_MIN_TORCH))} (fully_shard of the "
                        f"packed 4-bit bytes), this is torch {torch.__version__}; upgrade torch or use --strategy ddp")
    if optimizer != "AdamW":
        raise UserError(f"--optimizer {optimizer} keeps its state in bitsandbytes' own buffers of whole tensors, which "
                        "FSDP cannot shard (bitsandbytes#89); use --optimizer AdamW with --strategy fsdp (its state "
                        "is sharded too), or --strategy ddp")
    if quantize is not None and not QuantMode.parse(quantize).shardable:
        raise UserError(f"--quantize {quantize} cannot be sharded (its row scales live on the weight object, which "
                        "FSDP replaces); use --quantize bnb.nf4-dq with --strategy fsdp, or --strategy ddp")
    if precision == "16-mixed":
        raise UserError("--precision 16-mixed needs a gradient scaler that sees every shard, which --strategy fsdp "
                        "does not set up; use bf16-mixed or bf16-true, or --strategy ddp")
    if compile:
        raise UserError("--compile is not supported with --strategy fsdp yet; leave --compile off, or use --strategy "
                        "ddp")


def make_strategy(strategy: str, world: int):
    """What `L.Fabric(strategy=...)` gets: DDP for several processes, FSDP2 (fully_shard) for --strategy fsdp, or
    Fabric's choice for one process."""
    if strategy == "fsdp":
        from lightning.fabric.strategies import ModelParallelStrategy

        # the model arrives sharded already (load_model_sharded), so Fabric has nothing left to parallelize
        return ModelParallelStrategy(parallelize_fn=lambda model, mesh: model, data_parallel_size=world,
                                     tensor_parallel_size=1, save_distributed_checkpoint=False)
    return "ddp" if strategy == "auto" and world > 1 else strategy


def is_sharded(fabric) -> bool:
    from lightning.fabric.strategies import ModelParallelStrategy

    return isinstance(fabric.strategy, ModelParallelStrategy)


def shard_mesh(fabric):
    """The 1-D device mesh FSDP shards over: every process of the run."""
    return fabric.strategy.device_mesh["data_parallel"]


def fully_shard_gpt(model: nn.Module, mesh) -> None:
    """FSDP2 on our GPT: one unit per transformer block (gathered for its forward and again for its backward), and
    the root unit with the embeddings, the final norm and the head."""
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def check_same_start(fabric, step: int) -> None:
    """Every process must start from the same checkpoint (on several machines: out_dir on storage they all see), or
    their collectives would silently pair different iterations. Before anything loads; every rank must call."""
    both = fabric.all_reduce(torch.tensor([float(step), -float(step)], device=fabric.device), reduce_op="max")
    if int(both[0]) != -int(both[1]):
        raise UserError(f"the processes of this run would start at different iterations ({int(-both[1])} to "
                        f"{int(both[0])}): each machine found another checkpoint in --out_dir; put --out_dir on "
                        "storage every machine sees, or pass the same --resume path everywhere")


# ---- gathering for checkpoints ------------------------------------------------------------------------------------
def full_lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA tensors, whole (sharded ones are gathered: every rank must call this)."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in lora_state_dict(model).items()}


def optimizer_state_to_save(model: nn.Module, optimizer, sharded: bool) -> Optional[dict]:
    """What a checkpoint stores of the optimizer. Sharded: the whole state, gathered to rank 0 and keyed by parameter
    name (torch's get_optimizer_state_dict; every rank must call this, ranks other than 0 get None back).
    Otherwise the optimizer's own state_dict, keyed by position, as always."""
    if not sharded:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if torch.distributed.get_rank() == 0 else None


def load_optimizer_state(model: nn.Module, optimizer, saved: dict, sharded: bool) -> None:
    """Restore what `optimizer_state_to_save` stored, into a sharded or unsharded run, whichever made the checkpoint:
    position keys are mapped to the trainable parameters' names (the optimizer's order) when needed."""
    by_name = any(isinstance(k, str) for k in saved.get("state", {})) or any(
        isinstance(p, str) for g in saved.get("param_groups", []) for p in g["params"])
    if not sharded and not by_name:
        optimizer.load_state_dict(saved)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not by_name:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        saved = {"state": {names[i]: v for i, v in saved["state"].items()},
                 "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, saved, options=StateDictOptions(full_state_dict=True))


def end_all_ranks(fabric, code: int = 0) -> None:
    """The last call of a multi-process run, on every rank once its part of the outputs is written (the end of
    training, or the checkpoint of a run stopped by a signal, `code` 128 + its number): wait for all ranks, then leave
    at once (os._exit) instead of through the interpreter's teardown of the process group.

    Why: that teardown raced with the other ranks'. In about 1 in 8 two-machine runs (tests/test_distributed.py on
    one host) a rank died at exit in "terminate called without an active exception", after the adapter had been
    written, and the other machine's torchrun then waited for it until killed. Destroying the group first
    (destroy_process_group) only moved the wait: a rank then hung in the group's destructor once its peer had
    left. Nothing remains to be done here: checkpoints, adapter and metrics are written (atomically) before the
    barrier, and what is buffered for stdout/stderr is flushed below."""
    fabric.barrier()  # rank 0 writes the adapter and metrics.json after the others are done: wait for it
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`... | head`) must not turn a finished run into a traceback
            pass
    os._exit(code)
