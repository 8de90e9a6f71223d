"""The arguments of finetune/lora.py, in groups, one docstring per field (shown by `--help`).

The flags stay flat (`--learning_rate`, not `--train.learning_rate`): the groups organize the code and the help, and
a `--config` YAML is one flat mapping, as `--print_config` writes it. `python finetune/lora.py` with no
`--checkpoint_dir` runs the demo: the preset `lit_qlora/demo/finetune.yaml` is applied under the flags given.
"""
from __future__ import annotations

import json
import math
import sys
from argparse import ArgumentError
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal, Optional, Union, get_args, get_origin, get_type_hints

from jsonargparse import ArgumentParser, set_parsing_settings

from lit_qlora import demo
from lit_qlora.distributed import STRATEGIES
from lit_qlora.lora import LORA_INITS, LoRAConfig
from lit_qlora.precision import ACCELERATORS, PRECISION_CHOICES
from lit_qlora.quant.quant_mode import QuantMode
from lit_qlora.readers import check_path, read_yaml
from lit_qlora.train.grpo import LOSS_TYPES as GRPO_LOSSES
from lit_qlora.train.grpo import SCALE_REWARDS
from lit_qlora.train.preference import LOSSES
from lit_qlora.train.tracking import parse_loggers
from lit_qlora.train.training import OPTIMIZERS
from lit_qlora.utils import UserError


@dataclass(frozen=True)
class _Range:
    """The values a float flag may take: finite, from `low` to `high` (each end excluded where `*_open`)."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    example: str = ""

    def holds(self, v) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
        above = v > self.low if self.low_open else v >= self.low
        return above and (v < self.high if self.high_open else v <= self.high)

    def text(self) -> str:
        """What the flag must be, in words."""
        if math.isfinite(self.low) and math.isfinite(self.high):
            text = (f"from {self.low:g}{' (excluded)' if self.low_open else ''} to {self.high:g}"
                    f"{' (excluded)' if self.high_open else ''}")
        elif math.isfinite(self.low):
            text = f"a number above {self.low:g}" if self.low_open else f"{self.low:g} or more"
        else:
            text = "a finite number"
        return text + (f", e.g. {self.example}" if self.example else "")


# Every float flag's range, checked when its group is built (`_check_floats`): a value outside it (a typo, a
# hand-edited or damaged --config: 18446744073709551617 as lora_dropout) is refused in one line naming the flag
# before anything runs, as integer flags are (`_refuse_huge_counts`). tests/test_args.py checks that every float
# flag has one.
FLOAT_RANGES: dict[str, _Range] = {
    "memory_budget": _Range(0, low_open=True),  # GB
    "lora_alpha": _Range(0, low_open=True, example="16"),
    "lora_dropout": _Range(0, 1, high_open=True, example="0.05"),  # 1 would drop every input
    "loraplus_lr_ratio": _Range(0, low_open=True, example="16"),
    "learning_rate": _Range(0, low_open=True, example="3e-4"),
    "min_lr": _Range(0),  # and at most --learning_rate (TrainArgs)
    "weight_decay": _Range(0),
    "grad_clip": _Range(0, low_open=True),
    "router_aux_loss_coef": _Range(0),
    "early_stopping_min_delta": _Range(0),
    "beta": _Range(0, low_open=True, example="0.1"),
    "gamma": _Range(),
}


def _check_floats(group) -> None:
    """A flag group's float flags in their FLOAT_RANGES (None: left out, where the flag allows it)."""
    for f in fields(group):
        value = getattr(group, f.name)
        if f.name in FLOAT_RANGES and value is not None and not FLOAT_RANGES[f.name].holds(value):
            raise UserError(f"--{f.name} is {value!r}; it must be {FLOAT_RANGES[f.name].text()}")


@dataclass
class RunArgs:
    """Model, output and devices"""

    checkpoint_dir: Optional[Path] = None
    """Model folder (a Hugging Face folder is converted on first use). Left out: the demo model, bundled data and the
    demo preset (lit_qlora/demo/finetune.yaml)."""
    out_dir: Path = Path("out/lora/demo")
    """Where checkpoints, metrics.csv, metrics.json, hyperparameters.json and the final adapter go."""
    precision: str = "auto"
    """auto, 32-true, 16-true, bf16-true, 16-mixed or bf16-mixed (the table in
    tutorials/reference/precision-and-quantization.md). auto: bf16-true on a GPU with bf16 (16-mixed without) and on a
    CPU with native bf16 (AVX512-BF16/AMX), 32-true on other CPUs (where bf16-true computes by fp32 kernels: a little
    slower, less memory)."""
    quantize: Optional[str] = None
    """Frozen base weights as bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq or bnb.int8; none (or left out) for dense."""
    quantize_lm_head: Optional[bool] = None
    """With --quantize, quantize the output layer too. Default: no. A tied head stays shared with the dense embedding;
    a 4-bit head is dequantized whole in every step, so it saves nothing at the peak (tutorials/performance.md)."""
    devices: int = 1
    """Processes per machine (DDP; gloo on CPU)."""
    num_nodes: int = 1
    """Machines. Above 1, a launcher starts this command on every machine (torchrun --nnodes, SLURM's srun/sbatch;
    tutorials/reference/distributed.md); every process trains on its share of each batch."""
    accelerator: str = "auto"
    """auto, cpu or cuda."""
    strategy: str = "auto"
    """auto (ddp with several processes), ddp, or fsdp: every process holds only its shard of the (4-bit) base, of
    the LoRA weights and of the AdamW state (torch's fully_shard; CPU and CUDA)."""
    seed: int = 1337
    """Seed of the LoRA initialization, dropout and the data order: 0 to 4294967295 (Fabric's seed_everything would
    replace any other by 0)."""
    compile: bool = False
    """torch.compile each transformer block for the training steps (validation and generation stay eager): a
    one-time compilation, then faster steps (tutorials/performance.md)."""
    activation_checkpointing: bool = False
    """Recompute each block in backward (less memory, more time)."""
    resume: Optional[str] = None
    """auto: continue from the newest checkpoint in out_dir if any; true: require one; or a checkpoint path."""
    estimate_only: bool = False
    """Print the estimated peak memory (per component) and exit before loading anything."""
    memory_budget: Optional[float] = None
    """GB per device for --micro_batch_size auto (default: the memory free now)."""
    bench_json: bool = False
    """Print a machine-readable `BENCH_JSON {...}` line with per-iteration figures at the end."""
    logger: Optional[str] = None
    """Experiment trackers besides metrics.csv, comma-separated: csv, tensorboard, wandb (offline unless W&B is
    configured), mlflow (train/tracking.py). Each logs the hyperparameters, the resolved precision, every row of
    metrics.csv, the memory report and the adapter paths."""
    logger_dir: Optional[Path] = None
    """Where the trackers write (logs/csv, logs/tensorboard, wandb/, mlflow.db); default: --out_dir."""

    def __post_init__(self) -> None:
        for flag in ("checkpoint_dir", "out_dir", "logger_dir"):
            check_path(getattr(self, flag), f"--{flag}")
        QuantMode.parse(self.quantize)  # an unknown name: one line, when the flags are read (as a --config file's)
        if self.precision not in PRECISION_CHOICES:
            raise UserError(f"unknown --precision {self.precision!r}; choose one of {', '.join(PRECISION_CHOICES)}")
        if self.accelerator not in ACCELERATORS:
            raise UserError(f"unknown --accelerator {self.accelerator!r}; choose one of {', '.join(ACCELERATORS)}")
        if self.strategy not in STRATEGIES:
            raise UserError(f"unknown --strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if self.devices < 1:
            raise UserError(f"--devices must be at least 1, got {self.devices}; pass a positive number")
        if self.num_nodes < 1:
            raise UserError(f"--num_nodes must be at least 1, got {self.num_nodes}; pass the number of machines")
        if not 0 <= self.seed <= 2**32 - 1:
            raise UserError(f"--seed {self.seed} is out of range; give a number from 0 to {2**32 - 1}")
        parse_loggers(self.logger)  # an unknown name or a missing package: one line, before anything runs
        _check_floats(self)


@dataclass
class DataArgs:
    """Data"""

    data_dir: Optional[Path] = None
    """Prepared data (scripts/prepare_alpaca.py); a .json/.jsonl/.csv/.parquet file; a folder of them (train* and
    val* / validation* files or folders, else the shards of one set, split for validation); a datasets save_to_disk
    folder; or owner/name of a dataset already in the local Hugging Face cache (nothing is downloaded)."""
    max_seq_length: Optional[int] = None
    """Longest sample in tokens (longer ones are truncated); default: the model's context."""
    template: str = "auto"
    """How raw data is rendered (stored with the adapter): alpaca or plain (prompt templates for instruction records),
    chat (the model's own chat template, for conversations or instruction records), or auto: chat when the data
    holds conversations, alpaca otherwise."""
    mask_inputs: bool = True
    """Train on the responses only (prompt tokens get no loss; with chat, the assistant turns only, each with its
    end-of-turn token)."""
    packing: bool = False
    """Pack several samples into each row of --max_seq_length tokens (attention stays inside each sample, positions
    restart per sample), so almost no computed token is padding; a micro batch is then micro_batch_size such rows."""
    prompt_column: str = "instruction"
    """The column (field) of instruction records that holds the instruction."""
    input_column: str = "input"
    """The column of instruction records that holds the optional input shown with the instruction."""
    response_column: str = "output"
    """The column of instruction records that holds the response to learn."""
    messages_column: Optional[str] = None
    """The column that holds a conversation's turns (role/content, or ShareGPT from/value); default: messages or
    conversations."""
    data_sources: Optional[Path] = None
    """Instead of --data_dir: a JSON or YAML list of {path, weight} or {path, epochs} entries, each path anything
    --data_dir accepts, each prepared as --data_dir would be. The weighted sources share as many samples as they hold
    together, in proportion to the weights; epochs: that many passes over it. Sampled by --seed; the realized mixture
    is in metrics.json; validation: every source's."""
    streaming: bool = False
    """Train on the data as it is read instead of tokenizing all of it first (a source larger than memory): samples
    tokenized ahead in a bounded buffer, in the source's own order (no shuffling: shuffle it beforehand), padded or
    packed; needs --max_iters. Validation: the source's validation file, else the ~5% of its records a hash of
    (--seed, file name, row) holds out. --resume enters a JSONL file at its byte offset, a parquet file at its row
    group. With --data_sources, each sample is drawn from a source by weight (weights only)."""

    def __post_init__(self) -> None:
        for flag in ("data_dir", "data_sources"):
            check_path(getattr(self, flag), f"--{flag}")
        if self.data_sources is not None and self.data_dir not in (None, demo.DEMO_DATA_DIR):  # (the demo's lies under)
            raise UserError("--data_dir and --data_sources both name the data; pass one (list the folder in the "
                            "--data_sources file to mix it in)")


@dataclass
class LoRAArgs:
    """LoRA"""

    lora_r: int = 8
    """Rank of the LoRA matrices."""
    lora_alpha: float = 16
    """Scale: the update is alpha / r * B @ A."""
    lora_dropout: float = 0.05
    """Dropout on the LoRA input."""
    lora_query: bool = True
    """Adapt the query projection."""
    lora_key: bool = False
    """Adapt the key projection."""
    lora_value: bool = True
    """Adapt the value projection."""
    lora_projection: bool = False
    """Adapt the attention output projection."""
    lora_mlp: bool = False
    """Adapt the MLP layers."""
    lora_head: bool = False
    """Adapt the output layer."""
    lora_experts: bool = False
    """Adapt the experts of a mixture of experts (Qwen3-MoE, Mixtral): one low-rank pair per expert on each of its
    three projections, computed on the tokens routed to it (why per expert: tutorials/finetune_lora.md)."""
    lora_router: bool = False
    """Adapt the router of a mixture of experts (the layer that scores the experts for each token)."""
    lora_rslora: bool = False
    """rsLoRA: scale the update by alpha / sqrt(r) instead of alpha / r (PEFT's use_rslora)."""
    loraplus_lr_ratio: Optional[float] = None
    """LoRA+: B's learning rate is this times --learning_rate (A's), as PEFT's create_loraplus_optimizer groups them
    (e.g. 16); left out: one learning rate."""
    lora_dora: bool = False
    """DoRA: each adapted output row of W + alpha/r * B @ A is scaled to a trained magnitude (PEFT's use_dora; the
    row norms on a 4-bit base come from the base layer itself, no dequantized copy of it is kept)."""
    lora_init: str = "default"
    """How A and B start: default (A kaiming-uniform, B = 0), gaussian (A ~ N(0, 1/r^2)), pissa (the principal
    singular vectors of each adapted weight; the base keeps the residual, quantized under --quantize: QPiSSA), olora
    (a QR of the weight, same residual), loftq (alternate --loftq_iters quantize / low-rank steps: base + adapter
    start closer to the full-precision weight than the 4-bit base alone; needs a 4-bit --quantize)."""
    loftq_iters: int = 1
    """LoftQ's alternating steps (PEFT's loftq_iter)."""

    def __post_init__(self) -> None:
        if self.lora_init not in LORA_INITS:
            raise UserError(f"unknown --lora_init {self.lora_init!r}; choose one of {', '.join(LORA_INITS)}")
        if self.loftq_iters < 1:
            raise UserError(f"--loftq_iters must be at least 1, got {self.loftq_iters}")
        _check_floats(self)

    def config(self) -> LoRAConfig:
        return LoRAConfig(r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout, query=self.lora_query,
                          key=self.lora_key, value=self.lora_value, projection=self.lora_projection, mlp=self.lora_mlp,
                          head=self.lora_head, experts=self.lora_experts, router=self.lora_router,
                          rslora=self.lora_rslora, loraplus_lr_ratio=self.loraplus_lr_ratio,
                          dora=self.lora_dora, init=self.lora_init, loftq_iters=self.loftq_iters)


@dataclass
class TrainArgs:
    """Training"""

    micro_batch_size: Union[int, Literal["auto"]] = 4
    """Samples per forward/backward per device, or auto: the largest whose estimated peak memory
    (lit_qlora/memory.py) fits --memory_budget."""
    batch_size: Optional[int] = None
    """Samples per optimizer step over all devices (default micro_batch_size x devices: no accumulation)."""
    max_iters: Optional[int] = None
    """Optimizer steps; default: --epochs passes over the training set."""
    epochs: int = 1
    """Passes over the training set when --max_iters is not given."""
    learning_rate: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 10
    """Linear warm-up steps before the cosine decay."""
    grad_clip: Optional[float] = 1.0
    """Max gradient norm (null to disable)."""
    optimizer: str = "AdamW"
    """AdamW, AdamW8bit, PagedAdamW, PagedAdamW8bit or PagedAdamW32bit (bitsandbytes)."""
    save_interval: int = 100
    """Steps between resumable checkpoints."""
    log_interval: int = 1
    """Steps between progress lines."""
    keep_checkpoints: int = 3
    """How many resumable checkpoints to keep (0: all)."""
    nan_policy: str = "stop"
    """stop: end the run at a NaN/inf loss, keeping the last good checkpoint; skip: skip the step."""
    router_aux_loss_coef: Optional[float] = None
    """A mixture of experts: the weight of the routers' load-balancing loss in the training loss (transformers'
    aux_loss, per micro batch), logged as aux_loss in metrics.csv. Default: as transformers trains, the model config's
    router_aux_loss_coef where its output_router_logits is true, else 0; 0: not added (still logged)."""

    def __post_init__(self) -> None:
        # values of the right type that cannot mean anything (a hand-edited --config, a typo): refused here, before
        # any file is read, rather than training with them
        def bad(flag: str, value, expected: str) -> UserError:
            return UserError(f"--{flag} is {value!r}; it must be {expected}")

        _check_floats(self)
        if self.min_lr > self.learning_rate:
            raise bad("min_lr", self.min_lr, f"from 0 to --learning_rate {self.learning_rate}")
        for flag, value, least in (("warmup_steps", self.warmup_steps, 0), ("epochs", self.epochs, 1),
                                   ("save_interval", self.save_interval, 1), ("log_interval", self.log_interval, 1),
                                   ("keep_checkpoints", self.keep_checkpoints, 0)):
            if value < least:
                raise bad(flag, value, f"at least {least}")
        if self.micro_batch_size != "auto" and self.micro_batch_size < 1:
            raise UserError(f"--micro_batch_size must be at least 1, got {self.micro_batch_size}; pass a positive "
                            "number or auto")
        if self.max_iters is not None and self.max_iters < 1:
            raise UserError(f"--max_iters must be at least 1, got {self.max_iters}; pass a positive number or leave it "
                            "out")
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"unknown --optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        if self.nan_policy not in ("stop", "skip"):
            raise UserError(f"unknown --nan_policy {self.nan_policy!r}; choose stop or skip")


@dataclass
class EvalArgs:
    """Validation"""

    eval_interval: int = 100
    """Steps between validations (loss, perplexity, one sample)."""
    eval_iters: int = 100
    """Validation batches (0: no validation)."""
    eval_max_new_tokens: int = 32
    """Tokens of the validation sample."""
    early_stopping_patience: Optional[int] = None
    """Stop after this many validations in a row without a lower val_loss (the last adapter is written as usual)."""
    early_stopping_min_delta: float = 0.0
    """An improvement is a val_loss below the best so far by more than this."""
    save_best: bool = False
    """Also keep the adapter of the best validation as out_dir/lit_model_lora_best.pth."""

    def __post_init__(self) -> None:
        if self.eval_interval < 1:  # 0 would divide by zero after the model is loaded
            raise UserError(f"--eval_interval must be at least 1, got {self.eval_interval}; pass a positive number")
        if self.early_stopping_patience is not None and self.early_stopping_patience < 1:
            raise UserError(f"--early_stopping_patience must be at least 1, got {self.early_stopping_patience}")
        _check_floats(self)
        if (self.early_stopping_patience or self.save_best) and self.eval_iters < 1:
            raise UserError("--early_stopping_patience and --save_best need validations; set --eval_iters above 0")


@dataclass
class PreferenceArgs:
    """Preference tuning (finetune/dpo.py)"""

    loss: str = "dpo"
    """dpo, ipo, orpo or simpo (train/preference.py; as TRL's DPOTrainer sigmoid / ipo, ORPOTrainer, CPOTrainer
    simpo)."""
    beta: float = 0.1
    """dpo/ipo: how far the policy may move from the reference (IPO's tau); orpo: the odds-ratio term's weight
    (ORPO's lambda); simpo: the reward scale."""
    gamma: float = 0.5
    """simpo: the target reward margin (SimPO's gamma, TRL's simpo_gamma)."""
    lora_path: Optional[Path] = None
    """An SFT adapter (lit_model_lora_finetuned.pth of finetune/lora.py) to start from: it is trained further and,
    as it was, is the reference of dpo/ipo. Left out: a fresh adapter, the base model is the reference. Its LoRA
    settings replace the --lora_* flags."""

    def __post_init__(self) -> None:
        check_path(self.lora_path, "--lora_path")
        if self.loss not in LOSSES:
            raise UserError(f"unknown --loss {self.loss!r}; choose one of {', '.join(LOSSES)}")
        _check_floats(self)


@dataclass
class GRPOArgs:
    """Online RL (finetune/grpo.py): GRPO's sampling, rewards and loss, as TRL's GRPOConfig names them"""

    num_generations: int = 8
    """Completions sampled for each prompt (G): a group, whose rewards are compared with each other."""
    max_completion_length: int = 256
    """Longest completion in tokens; a completion still going there is cut (completions/clipped_ratio; a warning
    when most are)."""
    temperature: float = 1.0
    """Sampling temperature; the log-probabilities of the loss are of the same distribution (logits / temperature)."""
    top_p: Optional[float] = None
    """Nucleus sampling: draw from the most likely tokens that reach this probability (left out: all)."""
    top_k: Optional[int] = None
    """Draw from the k most likely tokens only (left out: all)."""
    loss_type: str = "dapo"
    """grpo (each completion's token mean, averaged), bnpo (token mean of each micro batch), dr_grpo (token sum over
    completions x --max_completion_length) or dapo (token mean of the step), as TRL's loss_type."""
    epsilon: float = 0.2
    """Clip of the importance ratio pi / pi_sampling from below: 1 - epsilon (and from above unless
    --epsilon_high)."""
    epsilon_high: Optional[float] = None
    """Upper clip 1 + epsilon_high (DAPO's clip-higher, e.g. 0.28); default: --epsilon."""
    beta: float = 0.0
    """Weight of the KL term to the reference: the model with the adapter as it started (the base for a fresh
    adapter, the --lora_path adapter as it was), the same weights with the adapter tensors swapped (no second
    copy); 0: no reference forward at all."""
    num_iterations: int = 1
    """Optimizer steps on each batch of samples (GRPO's mu): above 1, the sampling policy's log-probabilities are kept
    and the ratios are clipped."""
    scale_rewards: str = "group"
    """Advantages = (reward - group mean) / std: group (each group's std), batch (the whole step's), none (no
    division: Dr. GRPO)."""
    mask_truncated_completions: bool = False
    """Leave completions cut at --max_completion_length out of the loss (DAPO's overlong filtering)."""
    reward: list[str] = field(default_factory=lambda: ["exact_answer"])
    """Reward functions, repeatable (--reward a --reward b): a built-in (exact_answer: the completion's \\boxed{},
    <answer> or last number against the --answer_column column, by math-verify when installed; format: 1 when the
    completion matches --format_regex; length: -tokens / --max_completion_length), or module:function (a .py file
    or an importable module), called as TRL calls it (prompts, completions, completion_ids, the row's other
    columns as keyword arguments) and returning a float or None per completion."""
    reward_weights: Optional[list[float]] = None
    """One weight per --reward, in order (repeatable); default: 1 each. The reward is their weighted sum."""
    answer_column: str = "answer"
    """The column the built-in exact_answer compares with."""
    format_regex: Optional[str] = None
    """The built-in format reward's pattern (whole completion, dot matches newlines); default:
    <think>.*?</think>\\s*<answer>.*?</answer>."""
    lora_path: Optional[Path] = None
    """An SFT adapter (lit_model_lora_finetuned.pth of finetune/lora.py, or a PEFT folder) to start from: trained
    further and, as it was, the reference of --beta. Its LoRA settings replace the --lora_* flags."""

    def __post_init__(self) -> None:
        check_path(self.lora_path, "--lora_path")
        for flag, value in (("num_generations", self.num_generations), ("num_iterations", self.num_iterations),
                            ("max_completion_length", self.max_completion_length)):
            if value < 1:
                raise UserError(f"--{flag} must be at least 1, got {value}")
        if self.num_generations < 2:
            raise UserError(f"--num_generations {self.num_generations}: GRPO compares the completions of a prompt "
                            "with each other, so it needs at least 2; use e.g. 8")
        if self.loss_type not in GRPO_LOSSES:
            raise UserError(f"unknown --loss_type {self.loss_type!r}; choose one of {', '.join(GRPO_LOSSES)}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise UserError(f"unknown --scale_rewards {self.scale_rewards!r}; choose one of {', '.join(SCALE_REWARDS)}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise UserError(f"--temperature must be above 0, got {self.temperature} (GRPO learns from sampled "
                            "completions); use e.g. 1.0")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UserError(f"--top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"--top_k must be at least 1, got {self.top_k}; or leave it out")
        for flag, value in (("epsilon", self.epsilon), ("epsilon_high", self.epsilon_high), ("beta", self.beta)):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise UserError(f"--{flag} must be 0 or more, got {value}")
        if not self.epsilon < 1:
            raise UserError(f"--epsilon must be below 1 (the lower clip is 1 - epsilon), got {self.epsilon}")


GROUPS = (RunArgs, DataArgs, LoRAArgs, TrainArgs, EvalArgs)


@dataclass
class FinetuneArgs:
    """All the arguments of finetune/lora.py, by group."""

    run: RunArgs
    data: DataArgs
    lora: LoRAArgs
    train: TrainArgs
    eval: EvalArgs
    pref: Optional[PreferenceArgs] = None  # finetune/dpo.py only
    grpo: Optional[GRPOArgs] = None  # finetune/grpo.py only

    def as_flat_dict(self) -> dict:
        """The flags and their values, as a `--config` file holds them (what hyperparameters.json records)."""
        out = {}
        for group in (self.run, self.data, self.lora, self.train, self.eval,
                      *(g for g in (self.pref, self.grpo) if g is not None)):
            out.update({k: str(v) if isinstance(v, Path) else v for k, v in asdict(group).items()})
        return out


def finetune_parser(preference: bool = False, grpo: bool = False) -> ArgumentParser:
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    prog, description = ("finetune/grpo.py", "Train a LoRA adapter by online RL (GRPO) on reward functions") if grpo \
        else ("finetune/dpo.py", "Preference-tune (DPO, IPO, ORPO, SimPO) a LoRA adapter") if preference \
        else ("finetune/lora.py", "Fine-tune a model with LoRA on a dense or quantized (QLoRA) base.")
    parser = ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", action="config", help="A YAML file of flags (as --print_config writes it).")
    for group in _groups(preference, grpo):
        parser.add_class_arguments(group, None)
    if grpo:  # what the shared flags mean here
        parser.set_defaults(prompt_column="prompt")
        for flag, text in GRPO_HELP.items():
            parser._option_string_actions[f"--{flag}"].help = text
    return parser


GRPO_HELP = {  # finetune/grpo.py's help of shared flags whose meaning differs there
    "micro_batch_size": "Prompts per forward/backward per device, each with its --num_generations completions (G x "
                        "this many sequences).",
    "batch_size": "Prompts per optimizer step over all devices, each with its --num_generations completions; all "
                  "of a step's completions are sampled together, a prompt's group on one device (default "
                  "micro_batch_size x devices).",
    "prompt_column": "The column that holds the prompt: text, or a list of messages (chat template). Rows of "
                     "`messages` alone: the turns before the last answer.",
    "max_iters": "Optimizer steps; default: --epochs passes over the prompts x --num_iterations.",
    "eval_iters": "Validation micro batches of held-out prompts (one greedy completion each; val_reward is their "
                  "mean reward, val_loss minus it, which early stopping watches; 0: no validation).",
    "template": "How text prompts are rendered: auto (as they are, as TRL passes them; conversations with the chat "
                "template), alpaca, plain, or chat (one user turn).",
}


def add_lora_flags(parser: ArgumentParser) -> None:
    """finetune/lora.py's --lora_* flags (LoRAArgs: the same names, defaults and help) on another script's parser
    (scripts/estimate_memory.py); `pop_lora_args` reads them back."""
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser.add_class_arguments(LoRAArgs, None)


def pop_lora_args(values: dict) -> LoRAArgs:
    """The LoRAArgs of parsed `values` (checked as finetune/lora.py checks them), taken out of `values`."""
    return LoRAArgs(**{f.name: values.pop(f.name) for f in fields(LoRAArgs)})


def _groups(preference: bool, grpo: bool = False) -> tuple:
    return (*GROUPS, PreferenceArgs) if preference else (*GROUPS, GRPOArgs) if grpo else GROUPS


def parse_finetune_args(argv: Optional[list[str]] = None, preference: bool = False,
                        grpo: bool = False) -> FinetuneArgs:
    """Parse the command line; without --checkpoint_dir, the demo preset lies under the flags given (finetune/lora.py;
    finetune/dpo.py and finetune/grpo.py need --checkpoint_dir). `preference`: finetune/dpo.py's flags too; `grpo`:
    finetune/grpo.py's (--reward and --reward_weights repeatable)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if grpo:
        argv = _joined_repeats(argv, ("reward", "reward_weights"))
    if argv and argv[-1] == "--resume" or any(a == "--resume" and b.startswith("--") for a, b in zip(argv, argv[1:])):
        argv.insert(argv.index("--resume") + 1, "true")  # a bare `--resume` means `--resume true`
    argv, sources = _checked_configs(argv, preference, grpo)
    parser = finetune_parser(preference, grpo)
    parser.exit_on_error = False  # a wrong value is one line naming the flag (and the --config file), not a usage text
    try:
        ns = parser.parse_args(argv)
        if ns.checkpoint_dir is None and preference:
            raise UserError("--checkpoint_dir is required (finetune/dpo.py has no demo); pass the model folder, and "
                            "--data_dir a folder of prompt/chosen/rejected rows")
        if ns.checkpoint_dir is None and grpo:
            raise UserError("--checkpoint_dir is required (finetune/grpo.py has no demo); pass the model folder, and "
                            "--data_dir a folder of prompt rows (tutorials/finetune_grpo.md)")
        if ns.checkpoint_dir is None and sources:  # a damaged or emptied file must not turn the run into the demo
            raise UserError(f"--config {', '.join(sources)} sets no checkpoint_dir (and no --checkpoint_dir flag "
                            "does); add `checkpoint_dir: <model folder>` to the file, or drop --config to run the demo")
        if ns.checkpoint_dir is None:
            ns = parser.parse_args(["--config", str(demo.PRESET), *argv])
    except ArgumentError as e:
        where = f" (flags from --config {', '.join(sources)})" if sources else ""
        raise UserError(f"{' '.join(str(e).split())}{where}; fix the value (--help lists every flag)") from None
    _refuse_nulls(ns, preference, sources, grpo)
    _refuse_huge_counts(ns, preference, sources, grpo)
    try:
        groups = [group(**{f.name: ns[f.name] for f in fields(group)}) for group in _groups(preference, grpo)]
        return FinetuneArgs(*groups[:5], pref=groups[5] if preference else None, grpo=groups[5] if grpo else None)
    except UserError as e:
        if not sources:
            raise
        raise UserError(f"{e} (flags from --config {', '.join(sources)})") from None


def _refuse_nulls(ns, preference: bool, sources: list[str], grpo: bool = False) -> None:
    """A null in a --config file (YAML `~`, JSON null) reaches a flag as None without jsonargparse's type check (on the
    command line `--lora_r null` is refused): a flag that has no "left out" meaning (its type is not Optional) is
    refused in one line naming it, never run with None (a null --lora_key trained without the key adapter)."""
    for group in _groups(preference, grpo):
        for name, hint in get_type_hints(group).items():
            if ns[name] is None and type(None) not in get_args(hint):
                where = f" in --config {', '.join(sources)}" if sources else ""
                raise UserError(f"--{name} is null{where}; give it a value or leave it out for its default "
                                "(--help lists every flag)")


# No count, size or interval this tool takes is larger than this (2**31 - 1); a larger one is a damaged file or a typo,
# never a setting: 10**18 --eval_iters would run forever, a 10**18 --max_seq_length would be clamped without a word
MAX_COUNT = 2**31 - 1


def _refuse_huge_counts(ns, preference: bool, sources: list[str], grpo: bool = False) -> None:
    """Every integer flag but --seed (RunArgs checks its range) at most MAX_COUNT in size, or a one-line refusal."""
    for group in _groups(preference, grpo):
        for name, hint in get_type_hints(group).items():
            v = ns[name]
            if name != "seed" and isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_COUNT:
                where = f" in --config {', '.join(sources)}" if sources else ""
                raise UserError(f"--{name} is {v}{where}, larger than any count this tool takes (at most {MAX_COUNT})"
                                "; give the value you meant, or leave it out for its default")


# what hyperparameters.json records beside the flags: the LoRA settings as one object (also there as lora_* flags) and
# the values the run resolved; --config accepts the file as it is and ignores them
_RECORD_ONLY = ("lora", "resolved")


def _checked_configs(argv: list[str], preference: bool = False, grpo: bool = False) -> tuple[list[str], list[str]]:
    """argv with each `--config FILE` read through lit_qlora.readers (a UserError naming the file and the line or
    the key for undecodable text, bad YAML / JSON, a top level that is not a mapping, a key that is no flag) and
    replaced by its checked content; and the files' names."""
    hints = {name: hint for group in _groups(preference, grpo) for name, hint in get_type_hints(group).items()}
    flags = set(hints)
    out, sources, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--config" and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        elif a.startswith("--config="):
            value, i = a.split("=", 1)[1], i + 1
        else:
            out.append(a)
            i += 1
            continue
        if value.lstrip().startswith("{"):  # content given inline, as jsonargparse allows
            out += ["--config", value]
            continue
        path = Path(value)
        data = read_yaml(path, "--config file", "fix the file (--print_config writes a valid one)")
        if data is None and path.read_text(errors="replace").strip():  # an explicit null, not an empty file
            raise UserError(f"--config file {path} holds null, not a mapping of flags; write one flag per line "
                            "(--print_config writes a valid file)")
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise UserError(f"--config file {path} holds a {type(data).__name__}, not a mapping of flags; write one "
                            "flag per line (--print_config writes a valid file)")
        data = {k: v for k, v in data.items() if not (k in _RECORD_ONLY and (isinstance(v, dict) or v is None))}
        unknown = [k for k in data if k not in flags]
        if unknown:
            raise UserError(f"--config file {path}: {unknown[0]!r} is not a flag of finetune/lora.py; remove it "
                            "(--help lists every flag)")
        for key, v in data.items():  # what jsonargparse would turn into text or a number without a word
            if isinstance(v, float) and not math.isfinite(v):
                raise UserError(f"--{key} is {v} in --config {path}, not a finite value; give a number or text as "
                                "--help says, or leave it out for its default")
            hint = hints[key]
            textual = get_origin(hint) is not list and {t for t in get_args(hint) or (hint,)
                                                         if t is not type(None)} <= {str, Path}
            if textual and not isinstance(v, (str, type(None))):
                raise UserError(f"--{key} is {v!r} in --config {path}, not text; write it in quotes, or leave it out "
                                "for its default (--help lists the values)")
        out += ["--config", json.dumps(data, default=str)]
        sources.append(str(path))
    return out, sources


def _joined_repeats(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv with each of `flags` given several times (`--reward a --reward b`, or `--reward=a`) as one list value
    (`--reward '["a", "b"]'`); a value already written as a list is kept as it is."""
    out, found = [], {f: [] for f in flags}
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a[2:].partition("=") if a.startswith("--") else ("", "", "")
        if name in found and (eq or i + 1 < len(argv)):
            if not eq:
                value, i = argv[i + 1], i + 1
            found[name].append(value)
            if len(found[name]) == 1:
                out.append(name)  # its place, filled below
        else:
            out.append(a)
        i += 1
    result = []
    for a in out:
        if a in found and found[a]:
            values = found[a]
            listed = len(values) == 1 and values[0].lstrip().startswith("[")
            result += [f"--{a}", values[0] if listed else json.dumps([_number_or_text(v) for v in values])]
        else:
            result.append(a)
    return result


def _number_or_text(v: str):
    try:
        return float(v)
    except ValueError:
        return v
