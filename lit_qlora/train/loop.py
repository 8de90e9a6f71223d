"""The training loop every objective shares: finetune/lora.py (SFT), finetune/dpo.py (preference pairs) and
finetune/grpo.py (online RL) each give it an `Objective` and call `setup`.

The phases, top to bottom: setup -> check_inputs (every flag, file and the data, before anything heavy starts) ->
(one process per device) main -> build_model -> restore -> objective.start -> fit (train_step: objective.accumulate,
the NaN guard, clipping, the optimizer; objective.validate; save) -> summarize. One iteration = one optimizer step
(gradient accumulation over `batch_size / (micro_batch_size * devices)` micro-batches). Everything a run needs to
continue is in out_dir/checkpoints/iter-*.pth; `--resume` picks the newest intact one. The flags are in
lit_qlora/args.py. A new objective is one `Objective` (ARCHITECTURE.md, "Where to add").
"""
from __future__ import annotations

import json
import math
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import lightning as L
import psutil
import torch
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.plugins.precision import Precision as FabricPrecision

from lit_qlora import demo
from lit_qlora.adapter import Adapter
from lit_qlora.args import FinetuneArgs
from lit_qlora.convert import ensure_converted
from lit_qlora.data.batching import BatchStream, count_packed_batches
from lit_qlora.data.streaming import StreamBatches, StreamPlan
from lit_qlora.data.templates import CHAT
from lit_qlora.distributed import (
    check_same_start,
    check_strategy,
    check_world,
    end_all_ranks,
    full_lora_state_dict,
    fully_shard_gpt,
    is_sharded,
    load_optimizer_state,
    make_strategy,
    optimizer_state_to_save,
    shard_mesh,
)
from lit_qlora.loader import load_model, load_model_sharded
from lit_qlora.lora import LoRAConfig, load_lora_weights, lora_state_dict, meta_model
from lit_qlora.memory import plan_micro_batch_size
from lit_qlora.precision import (
    bound_cpu_matmul_caches,
    parse_precision,
    resolve_accelerator,
    resolve_precision,
    slow_precision_warning,
)
from lit_qlora.quant.prequantized import load_note
from lit_qlora.quant.quant_mode import QuantMode
from lit_qlora.quant.quantize import assert_trainable_4bit, check_quantize, format_memory_report, memory_report
from lit_qlora.tokenizer import Tokenizer
from lit_qlora.train.tracking import RunWatch
from lit_qlora.train.training import (
    FINAL_ADAPTER,
    MetricsLog,
    StopRequest,
    TrainingDiverged,
    all_finite,
    check_disk_space,
    check_out_dir,
    check_ranks_agree,
    check_resume_compatible,
    checkpoint_bytes,
    checkpoint_path,
    find_resume,
    list_checkpoints,
    lock_out_dir,
    loraplus_groups,
    lr_at,
    make_optimizer,
    rng_state,
    save_checkpoint,
    set_rng_state,
    show_progress,
    unlock_out_dir,
)
from lit_qlora.utils import UserError, atomic_write, memory_used_gb, peak_rss_gb, tune_cpu_allocator

IGNORE_INDEX = -100


@dataclass
class Inputs:
    """What `check_inputs` found and prepared, handed to every process."""

    given: dict  # the arguments as given (hyperparameters.json)
    precision_why: str  # how --precision auto was resolved ("" when given explicitly)
    device_type: str  # --accelerator resolved: cpu or cuda
    config: object  # the model's lit_qlora.config.Config
    tokenizer: Tokenizer
    lora: LoRAConfig
    quantize: Optional[str]  # None for a dense base
    micro_batch_size: int  # resolved (`auto` becomes a number)
    batch_size: int
    max_seq_length: int
    train_data: list | StreamPlan  # the samples, or what --streaming reads them from
    val_data: list
    data_meta: dict
    resume_path: Optional[Path]
    resume_state: Optional[dict]
    objective: Optional["Objective"] = None  # what is trained for
    router_aux_loss_coef: float = 0.0  # resolved --router_aux_loss_coef (a mixture of experts; 0 otherwise)


@dataclass
class Objective:
    """What a script trains for around the phases here (finetune/lora.py: SFT; finetune/dpo.py; finetune/grpo.py)."""

    lora_config: Callable  # (args) -> the LoRAConfig of the adapter to train
    load_data: Callable  # (args, tokenizer, model config, max_seq_length) -> (train, val, meta), checked
    start: Callable  # (session): after restore, before the first step (the batch stream of other samples, ...)
    accumulate: Callable  # (session) -> (step loss, tokens, more metrics): the forwards and backwards of one step
    validate: Callable  # (session) -> metrics, val_loss among them (lower is better: early stopping watches it)
    metric_fields: tuple = ()  # metrics.csv columns beyond MetricsLog.FIELDS
    routing: bool = False  # its steps add the routers' load-balancing loss of a mixture of experts (ROUTING_FIELDS)
    script: str = "finetune/lora.py"  # named in its one-line refusals
    check: Optional[Callable] = None  # (args): its own flag checks, before anything is planned or read
    settings: Optional[Callable] = None  # (args) -> settings a resumed run must share with its checkpoint
    batches: Optional[Callable] = None  # (args, inputs, world) -> (stream, max_steps); default: `train_stream`
    state: Optional[Callable] = None  # (session) -> what a checkpoint keeps of it (resume["objective"]), for start
    after_step: Optional[Callable] = None  # (session): after each optimizer step (caches made stale by the update)


ROUTING_FIELDS = ("aux_loss", "expert_load_max")  # metrics.csv columns of a mixture of experts (sft_accumulate)


@dataclass
class Session:
    """What the phases share once the model is built; `state` is what changes (and what a checkpoint restores)."""

    fabric: L.Fabric
    model: torch.nn.Module  # set up by Fabric (DDP-wrapped with several devices): used for training forwards
    gpt: torch.nn.Module  # the plain GPT: generation, saving
    optimizer: torch.optim.Optimizer
    stream: BatchStream | StreamBatches
    args: FinetuneArgs
    inputs: Inputs
    max_steps: int
    accum: int
    train_info: dict  # recorded in every adapter file: how it was trained
    report: dict  # the loaded model's memory report (lit_qlora.quant.quantize.memory_report)
    rss_after_load: float  # GiB
    rss_before_load: float = 0.0  # GiB
    load_peak_rss: float = 0.0  # GiB, the process's peak RSS once the model is loaded (loading included)
    step: int = 0
    train_time: float = 0.0
    losses: list = field(default_factory=list)
    iter_times: list = field(default_factory=list)
    iter_tokens: list = field(default_factory=list)
    computed_tokens: int = 0  # tokens the model ran on (all devices): the real ones, padding is dropped (unpad)
    row_slots: int = 0  # rows x row length of the batches as collated, padding included (all devices)
    skipped: int = 0  # steps skipped for a non-finite loss (--nan_policy skip)
    overflow_skips: int = 0  # updates the fp16 GradScaler skipped
    overflows_in_a_row: int = 0
    val_loss: Optional[float] = None
    watch: Optional[RunWatch] = None  # trackers and early stopping (lit_qlora/train/tracking.py), set by fit
    # a mixture of experts: the tokens routed to each expert of each MoE layer [layers, E] (all devices), summed
    # over the run's steps (kept in checkpoints) and of the last step, and the tokens they were counted over
    expert_load: Optional[torch.Tensor] = None
    expert_tokens: int = 0
    last_expert_load: Optional[torch.Tensor] = None


def setup(args: FinetuneArgs, objective: Objective) -> None:
    """Check every input up front, then start one process per device (Fabric) running `main`."""
    bound_cpu_matmul_caches()  # why: on CPU each batch's new shape would keep 1-2 MB of prepared 16-bit matmuls
    try:
        _setup(args, objective)
    finally:  # the lock check_inputs took on --out_dir (the kernel drops it anyway when the process ends)
        unlock_out_dir(Path(args.run.out_dir))


def _setup(args: FinetuneArgs, objective: Objective) -> None:
    inputs = check_inputs(args, objective)
    if inputs is None:  # --estimate_only printed the estimate
        return
    run, acc = args.run, inputs.device_type
    prec = parse_precision(run.precision)
    # *-true: we place weights in the right dtype ourselves (Fabric's half-precision plugin would cast the packed
    # 4-bit weights too). *-mixed: Fabric's autocast, with a grad scaler for fp16.
    plugin = MixedPrecision(run.precision, device=acc) if prec.mixed else FabricPrecision()
    strategy = make_strategy(run.strategy, run.devices * run.num_nodes)
    fabric = L.Fabric(accelerator=acc, devices=run.devices, num_nodes=run.num_nodes, strategy=strategy,
                      plugins=[plugin])
    fabric.launch(main, args, inputs)


def check_inputs(args: FinetuneArgs, objective: Objective) -> Optional[Inputs]:
    """Everything that can be wrong with the inputs is found here, before Lightning, the model or the DDP processes
    start: the flags, the checkpoint folder, the tokenizer, the data (prepared once, here, so DDP ranks never race on
    the cache), the resume state and the disk space for checkpoints. None after --estimate_only."""
    run, data, t = args.run, args.data, args.train
    given = args.as_flat_dict()
    # resolved once for the run: the accelerator (Inputs.device_type, what every later step runs on) and --precision
    # auto (what this machine computes fastest in; from here on run.precision is resolved)
    device_type = resolve_accelerator(run.accelerator)
    run.precision, precision_why = resolve_precision(run.precision, device_type)
    quantize = QuantMode.parse(run.quantize)
    quantize = quantize and quantize.value  # the canonical flag value: what checkpoints and adapters record
    lora = objective.lora_config(args)
    if objective.check is not None:
        objective.check(args)
    ensure_demo_files(args)
    check_flags(args, quantize, lora, device_type)
    micro = plan_micro_batch(args, quantize, lora, device_type)
    if micro is None:  # --estimate_only printed the estimate
        return None
    world = run.devices * run.num_nodes
    batch_size = t.batch_size or micro * world
    if batch_size % (micro * world):
        n, nodes = micro * world, f" x nodes {run.num_nodes}" if run.num_nodes > 1 else ""
        raise UserError(f"--batch_size {batch_size} is not a multiple of --micro_batch_size {micro} x devices "
                        f"{run.devices}{nodes}; use e.g. --batch_size {n * max(1, batch_size // n)}")
    out_dir = Path(run.out_dir)
    check_out_dir(out_dir, run.resume)
    lock_out_dir(out_dir)  # one run per folder, for the life of this process (released by the kernel at its end)
    config = ensure_converted(run.checkpoint_dir, verify=True)
    tokenizer = Tokenizer(run.checkpoint_dir)
    if tokenizer.vocab_size > config.vocab_size:
        raise UserError(f"the tokenizer in {run.checkpoint_dir} has {tokenizer.vocab_size} tokens but the model only "
                        f"{config.vocab_size}; the tokenizer files belong to another model: copy the model's own "
                        "tokenizer files there")
    if lora.r > config.n_embd:  # what Adapter.load refuses: generate, merge and export would not take the adapter
        raise UserError(f"--lora_r {lora.r} is larger than the layers it adapts ({config.name or 'the model'}: n_embd "
                        f"{config.n_embd}); use --lora_r {config.n_embd} or less (8 to 64 is usual)")
    aux_coef = router_aux_coef(t.router_aux_loss_coef, config)
    if not objective.routing:
        if t.router_aux_loss_coef:
            raise UserError(f"--router_aux_loss_coef: this objective ({objective.script}) does not add the routers' "
                            "load-balancing loss; leave the flag out")
        aux_coef = 0.0
    resume_path, resume_state = find_resume(out_dir, run.resume)
    if resume_state is not None:
        check_resume_compatible(resume_state, resume_settings(args, quantize, micro, batch_size, aux_coef,
                                                              objective))
    n_lora = sum(p.numel() for p in meta_model(config, lora).parameters() if p.requires_grad)
    check_disk_space(out_dir, checkpoint_bytes(n_lora))
    max_seq_length = min(data.max_seq_length or config.block_size, config.block_size)
    train_data, val_data, data_meta = objective.load_data(args, tokenizer, config, max_seq_length)
    if isinstance(train_data, StreamPlan):  # the held-out samples validation reads: only these are tokenized up front
        val_data = train_data.validation(tokenizer, args.eval.eval_iters * micro * world)
    return Inputs(given, precision_why, device_type, config, tokenizer, lora, quantize, micro, batch_size,
                  max_seq_length, train_data, val_data, data_meta, resume_path, resume_state, objective, aux_coef)


def router_aux_coef(flag: Optional[float], config) -> float:
    """--router_aux_loss_coef resolved: the flag, else what transformers' training adds: the config's
    router_aux_loss_coef (0.001 where config.json has none) when its output_router_logits is true, otherwise 0 (the
    published Qwen3-MoE, Mixtral and gpt-oss configs: gpt-oss's 0.9 would otherwise weigh in); 0 for a dense model,
    which refuses the flag."""
    if not config.moe_n_expert:
        if flag:
            raise UserError(f"--router_aux_loss_coef weights the routers' loss of a mixture of experts, which "
                            f"{config.name or config.hf_architecture} is not; leave it out")
        return 0.0
    if flag is not None:
        return float(flag)
    if not config.hf_extra.get("output_router_logits", False):
        return 0.0
    return float(config.hf_extra.get("router_aux_loss_coef", 0.001))


def starting_adapter(checkpoint_dir: Path, path: Path) -> Adapter:
    """The adapter a run starts from (--lora_path: an adapter file of finetune/lora.py, or a PEFT folder)."""
    path = Path(path)
    base = ensure_converted(checkpoint_dir, verify=True) if path.is_dir() else None  # a PEFT folder
    return Adapter.load(path, base)


def ensure_demo_files(args: FinetuneArgs) -> None:
    """The demo preset's model and data are built locally on first use."""
    if args.run.checkpoint_dir == demo.DEMO_CHECKPOINT:
        demo.ensure_demo_checkpoint(args.run.checkpoint_dir)
    if args.data.data_dir == demo.DEMO_DATA_DIR:
        demo.ensure_demo_data(args.data.data_dir)


def check_flags(args: FinetuneArgs, quantize: Optional[str], lora: LoRAConfig, device_type: str) -> None:
    """The flags that only mean something together, on this machine and launcher. Each group's own fields were
    checked when it was built (lit_qlora/args.py)."""
    run, t = args.run, args.train
    if args.data.data_dir is None and args.data.data_sources is None:
        raise UserError("--data_dir is required with --checkpoint_dir; pass a prepared data folder or one holding "
                        "train.json/alpaca.json (or --data_sources, a mixture of several)")
    check_quantize(quantize, run.precision, device_type)
    if device_type == "cuda" and not torch.cuda.is_available() and not run.estimate_only:
        raise UserError("--accelerator cuda but no GPU is visible; use --accelerator cpu (or --estimate_only true to "
                        "plan for a GPU elsewhere)")
    if run.compile and device_type == "cpu" and not (shutil.which("g++") or shutil.which("clang++")):
        raise UserError("--compile on CPU needs a C++ compiler (torch.compile builds its kernels with g++ or clang++); "
                        "install one, or leave --compile off")
    check_world(run.devices, run.num_nodes)
    check_strategy(run.strategy, quantize, run.precision, t.optimizer, run.compile)
    if lora.experts and run.strategy == "fsdp":
        raise UserError("--lora_experts true with --strategy fsdp is not implemented (the quantized experts cannot be "
                        "sharded either); use --strategy ddp")
    if lora.init == "loftq" and not (quantize and QuantMode.parse(quantize).is_4bit):
        raise UserError("--lora_init loftq needs a 4-bit --quantize (bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq): it "
                        "starts from their quantization error; or use --lora_init pissa")
    if lora.init == "loftq" and lora.head and not run.quantize_lm_head:
        raise UserError("--lora_init loftq with --lora_head true needs --quantize_lm_head true: LoftQ starts from the "
                        "quantization error, and the output layer is not quantized without it; or leave --lora_head "
                        "off")


def plan_micro_batch(args: FinetuneArgs, quantize: Optional[str], lora: LoRAConfig, device_type: str) -> Optional[int]:
    """--micro_batch_size (auto: the largest whose estimated peak memory fits), or None once --estimate_only has
    printed the estimate; before anything is loaded."""
    run, t = args.run, args.train
    if not (run.estimate_only or t.micro_batch_size == "auto"):
        return t.micro_batch_size
    world = run.devices * run.num_nodes
    micro = plan_micro_batch_size(
        run.checkpoint_dir, t.micro_batch_size, run.memory_budget, run.estimate_only, device_type, world, lora,
        shard_world=world if run.strategy == "fsdp" else 1, precision=run.precision, quantize=quantize,
        optimizer=t.optimizer, seq_length=args.data.max_seq_length,
        activation_checkpointing=run.activation_checkpointing, quantize_lm_head=run.quantize_lm_head,
        validation=args.eval.eval_iters > 0)
    return None if run.estimate_only else micro


def resume_settings(args: FinetuneArgs, quantize: Optional[str], micro: int, batch_size: int,
                    router_aux_loss_coef: float = 0.0, objective: Optional[Objective] = None) -> dict:
    """The settings a resumed run must share with its checkpoint (the objective's own among them)."""
    run = args.run
    own = objective.settings(args) if objective is not None and objective.settings is not None else {}
    return dict(lora=asdict(args.lora.config()), precision=run.precision, quantize=quantize, micro_batch_size=micro,
                batch_size=batch_size, optimizer=args.train.optimizer, seed=run.seed, packing=args.data.packing,
                streaming=args.data.streaming, checkpoint_dir=str(run.checkpoint_dir),
                router_aux_loss_coef=router_aux_loss_coef, **own)


def main(fabric: L.Fabric, args: FinetuneArgs, inputs: Inputs) -> None:
    """One process: build the model, restore a checkpoint if resuming, train, write the results."""
    fabric.seed_everything(args.run.seed)
    if fabric.world_size > 1:  # several machines: each read out_dir on its own
        check_same_start(fabric, inputs.resume_state["resume"]["step"] if inputs.resume_state else 0)
    if fabric.device.type == "cpu":
        tune_cpu_allocator()  # step temporaries reuse heap pages instead of page-faulting fresh ones each step
    s = build_model(fabric, args, inputs)
    restore(s)
    inputs.objective.start(s)
    if fabric.global_rank == 0:
        resolved = dict(precision=args.run.precision, micro_batch_size=inputs.micro_batch_size,
                        batch_size=inputs.batch_size, quantize_lm_head=s.train_info["quantize_lm_head"],
                        max_seq_length=inputs.max_seq_length, max_steps=s.max_steps, accumulation=s.accum,
                        router_aux_loss_coef=inputs.router_aux_loss_coef)
        hparams = {**inputs.given, "lora": asdict(inputs.lora), "resolved": resolved}
        atomic_write(Path(args.run.out_dir) / "hyperparameters.json",
                     lambda p: p.write_text(json.dumps(hparams, indent=2, default=str)))
    fit(s)
    summarize(s)
    if fabric.world_size > 1:
        end_all_ranks(fabric)  # not through the interpreter's teardown (see there)


def build_model(fabric: L.Fabric, args: FinetuneArgs, inputs: Inputs) -> Session:
    """Load the (quantized) base with fresh LoRA layers, the optimizer and the batch stream."""
    run, t = args.run, args.train
    warning = slow_precision_warning(run.precision, fabric.device.type)
    if warning:
        fabric.print(warning, file=sys.stderr)
    t0 = time.perf_counter()
    rss_before_load = psutil.Process().memory_info().rss / 2**30
    kw = dict(precision=run.precision, quantize=inputs.quantize, lora=inputs.lora, device=fabric.device,
              quantize_lm_head=run.quantize_lm_head, config=inputs.config, seed=run.seed)
    if is_sharded(fabric):  # FSDP: this process keeps only its shard of every weight (lit_qlora/distributed.py)
        gpt = load_model_sharded(run.checkpoint_dir, lambda m: fully_shard_gpt(m, shard_mesh(fabric)), **kw)
    else:
        gpt = load_model(run.checkpoint_dir, **kw)
    load_peak_rss = peak_rss_gb()
    gpt.activation_checkpointing = run.activation_checkpointing
    if run.compile:
        gpt.compile_blocks()
    report = memory_report(gpt)
    rss_after_load = psutil.Process().memory_info().rss / 2**30
    seconds = time.perf_counter() - t0
    fabric.print(f"Loaded {inputs.config.name} in {seconds:.1f}s | {inputs.quantize or 'no quantization'}, "
                 f"{run.precision}{f' ({inputs.precision_why})' if inputs.precision_why else ''} | "
                 f"{format_memory_report(report)}{load_note(gpt, inputs.quantize, fabric.device, seconds)}",
                 file=sys.stderr)
    trainable = [(n, p) for n, p in gpt.named_parameters() if p.requires_grad]
    groups = loraplus_groups(trainable, t.learning_rate, inputs.lora.loraplus_lr_ratio)
    optimizer = make_optimizer(t.optimizer, groups, t.learning_rate, t.weight_decay, fabric.device.type)
    model = fabric.setup_module(gpt, move_to_device=False)
    optimizer = fabric.setup_optimizers(optimizer)
    world = fabric.world_size
    stream, max_steps = (inputs.objective.batches or train_stream)(args, inputs, world)
    head_quantized = inputs.quantize is not None and bool(run.quantize_lm_head)
    template = inputs.data_meta.get("template", args.data.template)
    train_info = dict(precision=run.precision, quantize=inputs.quantize, quantize_lm_head=head_quantized,
                      template=template, max_seq_length=inputs.max_seq_length, mask_inputs=args.data.mask_inputs,
                      checkpoint_dir=str(run.checkpoint_dir), data_dir=str(args.data.data_dir),
                      **({"router_aux_loss_coef": inputs.router_aux_loss_coef} if inputs.config.moe_n_expert else {}),
                      # the text the data was rendered with, so inference renders exactly the same (generate/*.py)
                      chat_template=inputs.tokenizer.chat_template if template == CHAT else None)
    return Session(fabric, model, gpt, optimizer, stream, args, inputs, max_steps,
                   inputs.batch_size // (inputs.micro_batch_size * world), train_info, report,
                   rss_after_load, rss_before_load, load_peak_rss)


def train_stream(args: FinetuneArgs, inputs: Inputs, world: int) -> tuple[BatchStream | StreamBatches, int]:
    """The stream of global micro-batches (every device's rows) and the number of optimizer steps."""
    t, kw = args.train, dict(pad_id=inputs.tokenizer.eos_id or 0, ignore_index=IGNORE_INDEX,
                             packing=args.data.packing, max_seq_length=inputs.max_seq_length)
    if isinstance(inputs.train_data, StreamPlan):  # --streaming: read and tokenized as it trains; --max_iters steps
        return inputs.train_data.batches(inputs.tokenizer, inputs.micro_batch_size * world, **kw), t.max_iters
    stream = BatchStream(inputs.train_data, batch_size=inputs.micro_batch_size * world, seed=args.run.seed, **kw)
    # optimizer steps per epoch: samples per batch, or packed micro-batches (on all devices) per step
    if args.data.packing:
        per_step = inputs.batch_size // (inputs.micro_batch_size * world)
        units = count_packed_batches(inputs.train_data, inputs.micro_batch_size * world, inputs.max_seq_length)
    else:
        per_step, units = inputs.batch_size, len(inputs.train_data)
    steps_per_epoch = max(1, -(-units // per_step))
    return stream, t.max_iters if t.max_iters is not None else t.epochs * steps_per_epoch


def restore(s: Session) -> None:
    """Continue a run from its checkpoint: LoRA weights, optimizer (and fp16 scaler), data position, RNG, clock."""
    state = s.inputs.resume_state
    if state is None:
        return
    load_lora_weights(s.gpt, state["lora"])  # a sharded model takes its shard of each tensor
    load_optimizer_state(s.gpt, getattr(s.optimizer, "optimizer", s.optimizer), state["resume"]["optimizer"],
                         is_sharded(s.fabric))
    scaler = getattr(s.fabric.strategy.precision, "scaler", None)
    if scaler is not None and state["resume"].get("scaler"):
        scaler.load_state_dict(state["resume"]["scaler"])
    s.stream.load_state_dict(state["resume"]["data"])
    if state["resume"].get("expert_load") is not None:
        s.expert_load, s.expert_tokens = state["resume"]["expert_load"].double(), state["resume"]["expert_tokens"]
    set_rng_state(state["resume"]["rng"])
    s.step, s.train_time = state["resume"]["step"], state["resume"]["train_time"]
    s.fabric.print(f"Resuming from {s.inputs.resume_path} at iteration {s.step}", file=sys.stderr)


def fit(s: Session) -> None:
    """The training loop: steps, logging, periodic validation and checkpoints, a clean stop on SIGINT/SIGTERM."""
    fabric, args, world = s.fabric, s.args, s.fabric.world_size
    objective = s.inputs.objective
    routing = ROUTING_FIELDS if tracks_routing(s) else ()
    metrics = MetricsLog(args.run.out_dir, resume_iter=s.step, enabled=fabric.global_rank == 0,
                         extra_fields=objective.metric_fields + routing)
    e = args.eval
    s.watch = watch = RunWatch(args.run.out_dir, args.run.logger, args.run.logger_dir, e.early_stopping_patience,
                               e.early_stopping_min_delta, e.save_best, s.step, enabled=fabric.global_rank == 0)
    stop = StopRequest()
    rows = f" rows of {s.inputs.max_seq_length} packed tokens" if args.data.packing else ""
    data = s.inputs.train_data
    fabric.print(f"Training {s.max_steps} iterations: "
                 f"{data.describe() if isinstance(data, StreamPlan) else f'{len(data)} samples'}, batch "
                 f"{s.inputs.batch_size}{rows} (micro {s.inputs.micro_batch_size} x {world} devices x {s.accum} "
                 f"accumulation), lr {args.train.learning_rate}", file=sys.stderr)
    if s.step == 0 and args.eval.eval_iters > 0:  # the starting point, so the curve shows what training changed
        metrics.log(row := dict(iter=0, step=0, **objective.validate(s)))
        watch.log(row)
        watch.validated(0, row["val_loss"], lambda path: write_adapter(s, path))
    s.model.train()
    while s.step < s.max_steps:
        t0 = time.perf_counter()
        result = train_step(s)
        s.step += 1
        if result is None:  # a skipped step (--nan_policy skip)
            continue
        loss, tokens, extra = result
        dt = time.perf_counter() - t0
        s.train_time += dt
        s.losses.append(loss)
        s.iter_times.append(dt)
        s.iter_tokens.append(tokens)
        row = dict(iter=s.step, step=s.step, loss=loss, lr=s.optimizer.param_groups[0]["lr"], iter_time_ms=dt * 1000,
                   tokens=tokens, tokens_per_sec=tokens / dt, **extra)
        if args.eval.eval_iters > 0 and (s.step % args.eval.eval_interval == 0 or s.step == s.max_steps):
            row.update(objective.validate(s))
            s.val_loss = row["val_loss"]
        metrics.log(row)
        watch.log(row)
        if fabric.global_rank == 0 and (s.step % args.train.log_interval == 0 or s.step == s.max_steps):
            show_progress(s.step, s.max_steps, loss, dt, tokens, s.train_time)
        if "val_loss" in row and watch.validated(s.step, row["val_loss"], lambda path: write_adapter(s, path)):
            break  # early stopping: summarize writes the last adapter and says which is the best
        saved = s.step % args.train.save_interval == 0 and s.step < s.max_steps
        if saved:
            save(s, f"every {args.train.save_interval} iterations")
        # DDP: every rank stops at the same iteration, whichever got the signal (a mismatch would hang the collectives)
        stop_now = stop.requested
        if world > 1:
            stop_now = bool(fabric.all_reduce(torch.tensor(float(stop_now), device=fabric.device), reduce_op="sum") > 0)
        if stop_now and s.step < s.max_steps:
            path = checkpoint_path(args.run.out_dir, s.step) if saved else save(s, "interrupted")
            fabric.print(f"Stopped at iteration {s.step}; continue with --resume (checkpoint {path})", file=sys.stderr)
            metrics.close()
            code = 128 + (stop.signum or signal.SIGTERM)
            if world > 1:
                end_all_ranks(fabric, code)  # every rank, with the code of the signal (see there)
            sys.exit(code)
    metrics.close()


def train_step(s: Session) -> Optional[tuple[float, int, dict]]:
    """One optimizer step over `accum` micro-batches: (loss, tokens, more metrics), or None if it was skipped."""
    fabric, t = s.fabric, s.args.train
    step_loss, tokens, extra = s.inputs.objective.accumulate(s)
    trainable = [p for p in s.gpt.parameters() if p.requires_grad]
    # Under 16-mixed, Fabric's GradScaler multiplies the loss by its scale (2^16 at first), so the gradients of a
    # healthy step can overflow: the scaler finds that, skips the update and halves its scale. Only a non-finite
    # *loss* (the forward itself overflowed) is ours to handle; without a scaler, non-finite gradients are too.
    scaler = getattr(fabric.strategy.precision, "scaler", None)
    if not math.isfinite(step_loss) or (scaler is None and not all_finite(p.grad for p in trainable)):
        s.optimizer.zero_grad(set_to_none=True)
        if t.nan_policy == "stop":
            raise TrainingDiverged(f"loss became {step_loss} at iteration {s.step + 1} ({last_good(s)}); try "
                                   f"--precision bf16-true or bf16-mixed, or a lower --learning_rate than "
                                   f"{t.learning_rate}")
        s.skipped += 1
        fabric.print(f"warning: non-finite loss at iteration {s.step + 1}; step skipped ({s.skipped} so far)",
                     file=sys.stderr)
        if s.skipped >= 10:
            raise TrainingDiverged(f"{s.skipped} non-finite losses, the last at iteration {s.step + 1}; use "
                                   "--precision bf16-true or a lower --learning_rate")
        return None
    if t.grad_clip:  # with a scaler, Fabric unscales first; overflowed gradients are left for the scaler to skip
        fabric.clip_gradients(s.model, s.optimizer, max_norm=t.grad_clip, error_if_nonfinite=scaler is None)
    for g in s.optimizer.param_groups:
        g["lr"] = lr_at(s.step, s.max_steps, t.learning_rate, t.min_lr, t.warmup_steps) * g.get("lr_ratio", 1.0)
    scale = scaler.get_scale() if scaler is not None else None
    s.optimizer.step()  # with a scaler: scaler.step (skipped if the gradients overflowed) and scaler.update
    s.optimizer.zero_grad(set_to_none=True)
    if s.inputs.objective.after_step is not None:
        s.inputs.objective.after_step(s)
    if scaler is not None and scaler.get_scale() < scale:
        _note_overflow(s, scale, scaler.get_scale())
    else:
        s.overflows_in_a_row = 0
    if not all_finite(trainable):
        # finite loss and gradients can still overflow the weights (e.g. fp16 with a huge learning rate): stop before
        # such weights reach a checkpoint, so the last checkpoint stays a good one
        raise TrainingDiverged(f"weights became non-finite at iteration {s.step + 1} ({last_good(s)}); try "
                               f"--precision bf16-true or bf16-mixed, or a lower --learning_rate than "
                               f"{t.learning_rate}")
    return step_loss, tokens, extra


def tracks_routing(s: Session) -> bool:
    """Whether the steps compute the routers' load-balancing loss and the expert load (a mixture of experts)."""
    return s.inputs.objective.routing and bool(s.inputs.config.moe_n_expert)


def expert_load_summary(s: Session) -> Optional[dict]:
    """metrics.json's expert_load: per MoE layer, the share of the tokens routed to each expert, over every training
    step of the run (a resumed run's included) and in the last step. A collapsing router shows as one expert near
    1.0 while the others fall towards 0; even routing gives each top_k / experts."""
    if s.expert_load is None:
        return None
    c = s.inputs.config
    last_tokens = int(s.last_expert_load[0].sum()) // c.moe_top_k

    def shares(load: torch.Tensor, tokens: int) -> list:
        return [[round(float(v) / max(tokens, 1), 6) for v in row] for row in load]

    return dict(layers=[i for i in range(c.n_layer) if c.is_moe_layer(i)], even_share=c.moe_top_k / c.moe_n_expert,
                tokens=s.expert_tokens, all_steps=shares(s.expert_load, s.expert_tokens),
                last_step=shares(s.last_expert_load, last_tokens),
                max_share=float(s.expert_load.max() / max(s.expert_tokens, 1)))


def _note_overflow(s: Session, before: float, after: float) -> None:
    """The GradScaler skipped this update (fp16 gradients overflowed at its scale). Normal in the first steps of a
    16-mixed run while the scale settles; said once, counted in metrics.json; endless skipping is a divergence."""
    s.overflow_skips += 1
    s.overflows_in_a_row += 1
    if s.overflow_skips == 1:
        s.fabric.print(f"note: fp16 gradients overflowed at iteration {s.step + 1}; the gradient scaler skipped the "
                       f"update and lowered its scale from {before:g} to {after:g} (usual in the first steps of "
                       "16-mixed)", file=sys.stderr)
    if s.overflows_in_a_row >= 30:
        raise TrainingDiverged(f"the fp16 gradients overflowed {s.overflows_in_a_row} steps in a row (loss scale now "
                               f"{after:g}) up to iteration {s.step + 1}; use --precision bf16-mixed or bf16-true, or "
                               "a lower --learning_rate")


def last_good(s: Session) -> str:
    last = list_checkpoints(s.args.run.out_dir)
    return f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was written yet"


def save(s: Session, reason: str) -> Path:
    """A resumable checkpoint of this iteration (also a valid adapter file), written atomically by rank 0."""
    out_dir, path = Path(s.args.run.out_dir), checkpoint_path(s.args.run.out_dir, s.step)
    objective = s.inputs.objective
    # FSDP: the LoRA weights and the optimizer state are gathered from every rank's shards first (all ranks call)
    sharded = is_sharded(s.fabric)
    lora = full_lora_state_dict(s.gpt) if sharded else None
    optimizer_state = optimizer_state_to_save(s.gpt, getattr(s.optimizer, "optimizer", s.optimizer), sharded)
    if s.fabric.global_rank == 0:
        adapter = Adapter.of_model(s.gpt, s.inputs.lora, train={**s.train_info, "iter": s.step}, tensors=lora)
        scaler = getattr(s.fabric.strategy.precision, "scaler", None)
        resume = {"step": s.step, "optimizer": optimizer_state, "data": s.stream.state_dict(),
                  "rng": rng_state(), "train_time": s.train_time,
                  "scaler": scaler.state_dict() if scaler is not None else None,
                  "settings": resume_settings(s.args, s.inputs.quantize, s.inputs.micro_batch_size,
                                              s.inputs.batch_size, s.inputs.router_aux_loss_coef, objective),
                  "expert_load": s.expert_load, "expert_tokens": s.expert_tokens,
                  **({"objective": objective.state(s)} if objective.state is not None else {})}
        check_disk_space(out_dir, checkpoint_bytes(sum(v.numel() for v in adapter.lora.values())))
        save_checkpoint(path, adapter.payload() | {"resume": resume}, keep=s.args.train.keep_checkpoints)
        s.fabric.print(f"Saved checkpoint {path} ({reason})", file=sys.stderr)
    s.fabric.barrier()
    return path


def summarize(s: Session) -> None:
    """The final checkpoint and adapter, metrics.json, and the figures users compare (time, tokens/s, memory)."""
    fabric, run, out_dir = s.fabric, s.args.run, Path(s.args.run.out_dir)
    if s.inputs.quantize:
        assert_trainable_4bit(s.gpt)
    sharded = is_sharded(fabric)
    if fabric.world_size > 1 and not sharded:  # FSDP ranks hold different shards of one model
        check_ranks_agree(fabric, s.gpt)
    save(s, "end of training")
    lora = full_lora_state_dict(s.gpt) if sharded else lora_state_dict(s.gpt)  # every rank, before rank 0 goes on
    per_rank = rank_figures(s)
    mem = memory_used_gb(fabric.device)
    r = s.report
    summary = dict(model=s.inputs.config.name, precision=run.precision, quantize=s.inputs.quantize or "none",
                   optimizer=s.args.train.optimizer, micro_batch_size=s.inputs.micro_batch_size,
                   batch_size=s.inputs.batch_size, devices=fabric.world_size, num_nodes=run.num_nodes,
                   strategy="fsdp" if sharded else "ddp" if fabric.world_size > 1 else "single", iterations=s.step,
                   max_seq_length=s.inputs.max_seq_length, lora=asdict(s.inputs.lora),
                   activation_checkpointing=run.activation_checkpointing, compile=run.compile,
                   training_time_s=s.train_time,
                   tokens_per_sec=sum(s.iter_tokens) / max(sum(s.iter_times), 1e-9) if s.iter_times else None,
                   peak_memory_gb=mem, memory_kind="cuda max allocated" if fabric.device.type == "cuda" else "peak RSS",
                   final_train_loss=s.losses[-1] if s.losses else None, final_val_loss=s.val_loss,
                   skipped_steps=s.skipped, fp16_overflow_skips=s.overflow_skips, packing=s.args.data.packing,
                   real_token_share=sum(s.iter_tokens) / s.computed_tokens if s.computed_tokens else None,
                   row_fill=sum(s.iter_tokens) / s.row_slots if s.row_slots else None,
                   first_train_loss=s.losses[0] if s.losses else None, rss_after_load_gb=s.rss_after_load,
                   trainable_params=r["trainable_params"], quantized_params=r["quantized_params"],
                   quantized_bytes=r["quantized_bytes"],
                   data_mixture=s.stream.mixture() if isinstance(s.stream, StreamBatches) else
                   s.inputs.data_meta.get("mixture"),
                   bits_per_quantized_param=r["bits_per_quantized_param"], dense_bytes=r["dense_bytes"],
                   ranks=per_rank, **({"expert_load": expert_load_summary(s)} if tracks_routing(s) else {}))
    summary.update(s.watch.summary() if s.watch else {})
    if fabric.global_rank != 0:
        return
    Adapter.of_model(s.gpt, s.inputs.lora, train={**s.train_info, "iter": s.step}, tensors=lora).save(
        out_dir / FINAL_ADAPTER)
    atomic_write(out_dir / "metrics.json", lambda p: p.write_text(json.dumps(summary, indent=2)))
    if run.bench_json:
        b_moved = all(bool(v.abs().sum() > 0) for k, v in lora.items() if "lora_B" in k)
        qkv = s.gpt.transformer.h[0].attn.qkv
        print("BENCH_JSON " + json.dumps(dict(iter_times=s.iter_times, iter_tokens=s.iter_tokens, losses=s.losses,
                                              rss_after_load_gb=s.rss_after_load, lora_grads_flowed=b_moved,
                                              q_proj_base_layer=type(getattr(qkv, "base", qkv)).__name__)))
    print(f"Saved the adapter to {out_dir / FINAL_ADAPTER}", file=sys.stderr)
    print(f"Training time: {s.train_time:.2f}s", file=sys.stderr)
    print(f"Memory used: {mem:.2f} GB", file=sys.stderr)
    if summary.get("expert_load"):
        load = summary["expert_load"]
        print(f"Expert load: the busiest expert got {load['max_share']:.0%} of its layer's tokens (even routing: "
              f"{load['even_share']:.0%}); per layer and expert in metrics.json", file=sys.stderr)
    if s.watch:
        s.watch.finish(summary, out_dir / FINAL_ADAPTER)
        if s.args.eval.early_stopping_patience or s.args.eval.save_best:
            print(s.watch.closing_line(out_dir / FINAL_ADAPTER), file=sys.stderr)


def write_adapter(s: Session, path: Path) -> None:
    """The adapter as it is now (every rank calls: FSDP gathers the shards), written by rank 0."""
    lora = full_lora_state_dict(s.gpt) if is_sharded(s.fabric) else lora_state_dict(s.gpt)
    if s.fabric.global_rank == 0:
        Adapter.of_model(s.gpt, s.inputs.lora, train={**s.train_info, "iter": s.step}, tensors=lora).save(path)


def rank_figures(s: Session) -> list[dict]:
    """Every rank's memory figures (all ranks call): RSS before and after loading, the peak RSS once loaded (loading
    included), and the bytes of weights it holds (its shards under FSDP)."""
    fabric = s.fabric
    rows = torch.zeros(fabric.world_size, 4, dtype=torch.float64, device=fabric.device)
    rows[fabric.global_rank] = torch.tensor([s.rss_before_load, s.load_peak_rss, s.rss_after_load,
                                             float(s.report["rank_bytes"])], dtype=torch.float64)
    rows = fabric.all_reduce(rows, reduce_op="sum") if fabric.world_size > 1 else rows
    return [dict(rank=i, rss_before_load_gb=float(a), load_peak_rss_gb=float(b), rss_after_load_gb=float(c),
                 weight_bytes=int(d)) for i, (a, b, c, d) in enumerate(rows.tolist())]


