"""Fine-tune a model with LoRA on a dense or quantized (QLoRA) base.

    python finetune/lora.py                       # the demo: tiny local model + bundled data, nf4-dq, a few minutes on CPU
    python finetune/lora.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-hf --data_dir data/alpaca \
        --quantize bnb.nf4-dq --precision bf16-true

One iteration = one optimizer step (gradient accumulation over `batch_size / (micro_batch_size * devices)`
micro-batches). Everything a run needs to continue is in out_dir/checkpoints/iter-*.pth; `--resume` picks the
newest intact one.
"""
from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Literal, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lit_qlora import demo  # noqa: E402
from lit_qlora.data import BatchStream, ensure_prepared  # noqa: E402
from lit_qlora.generation import generate  # noqa: E402
from lit_qlora.lora import ADAPTER_FORMAT, LoRAConfig, load_lora_weights, lora_state_dict, save_adapter  # noqa: E402
from lit_qlora.quantize import (  # noqa: E402
    assert_trainable_4bit, check_quantize, format_memory_report, memory_report, parse_precision, validation_mode)
from lit_qlora.training import (  # noqa: E402
    FINAL_ADAPTER, OPTIMIZERS, MetricsLog, StopRequest, TrainingDiverged, check_checkpoint_dir, check_disk_space,
    checkpoint_bytes, checkpoint_path, chunked_cross_entropy, fmt_eta, head_chunk, is_tty, list_checkpoints,
    load_latest_checkpoint, lr_at, make_optimizer, rng_state, save_checkpoint, set_rng_state, shift_labels)
from lit_qlora.utils import UserError, atomic_write, memory_used_gb, run_cli, tune_cpu_allocator  # noqa: E402

IGNORE_INDEX = -100


def setup(
    checkpoint_dir: Optional[Path] = None,
    data_dir: Optional[Path] = None,
    out_dir: Path = Path("out/lora/demo"),
    precision: str = "bf16-true",
    quantize: Optional[str] = None,
    devices: int = 1,
    accelerator: str = "auto",
    strategy: str = "auto",
    seed: int = 1337,
    micro_batch_size: int | Literal["auto"] = 4,
    batch_size: Optional[int] = None,
    max_iters: Optional[int] = None,
    epochs: int = 1,
    learning_rate: float = 3e-4,
    min_lr: float = 0.0,
    weight_decay: float = 0.0,
    warmup_steps: int = 10,
    grad_clip: Optional[float] = 1.0,
    lora_r: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.05,
    lora_query: bool = True,
    lora_key: bool = False,
    lora_value: bool = True,
    lora_projection: bool = False,
    lora_mlp: bool = False,
    lora_head: bool = False,
    optimizer: str = "AdamW",
    activation_checkpointing: bool = False,
    compile: bool = False,
    max_seq_length: Optional[int] = None,
    template: str = "alpaca",
    mask_inputs: bool = True,
    quantize_lm_head: bool = True,
    eval_interval: int = 100,
    eval_iters: int = 100,
    eval_max_new_tokens: int = 32,
    save_interval: int = 100,
    log_interval: int = 1,
    keep_checkpoints: int = 3,
    nan_policy: str = "stop",
    resume: Optional[str] = None,
    bench_json: bool = False,
    estimate_only: bool = False,
    memory_budget: Optional[float] = None,
) -> None:
    """Fine-tune with LoRA.

    Args:
        checkpoint_dir: model folder (Hugging Face format is converted on first use). Left out: the demo model,
            bundled data and demo settings (bnb.nf4-dq, all LoRA targets, lr 3e-3, 3 epochs).
        data_dir: prepared data (scripts/prepare_alpaca.py) or a folder with train.json + val.json or one .json/.jsonl.
        out_dir: where checkpoints, metrics.csv, metrics.json and the final adapter go.
        precision: one of 32-true, 16-true, bf16-true, 16-mixed, bf16-mixed (see the README's precision table).
        quantize: frozen base weights as bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq or bnb.int8; "none" or left out for dense.
        devices: processes (DDP; CPU uses gloo). accelerator: auto, cpu or cuda. strategy: auto, ddp or fsdp (GPUs).
        micro_batch_size: samples per forward/backward per device, or "auto": the largest whose estimated peak
            memory (lit_qlora/memory.py) fits `memory_budget`. batch_size: samples per optimizer step over all
            devices (default micro_batch_size * devices: no accumulation).
        max_iters: optimizer steps; default: `epochs` passes over the training set.
        warmup_steps: linear warm-up steps before the cosine decay to `min_lr`.
        grad_clip: max gradient norm (none to disable).
        optimizer: AdamW, AdamW8bit, PagedAdamW, PagedAdamW8bit or PagedAdamW32bit (bitsandbytes).
        activation_checkpointing: recompute each block in backward (less memory, more time).
        compile: torch.compile each transformer block for the training steps (validation and generation stay eager).
            Costs a one-time compilation (about 40 s for a 221M model on 2 CPU cores), then saves time every step
            (tutorials/performance.md).
        max_seq_length: longest sample in tokens (longer ones are truncated); default: the model's context.
        template: prompt template used when raw data is prepared on the fly (stored with the adapter).
        quantize_lm_head: quantize the output layer too (with --quantize).
        eval_interval: steps between validations (loss, perplexity, one sample). eval_iters: validation batches.
        save_interval: steps between resumable checkpoints. keep_checkpoints: how many to keep (0 = all).
        nan_policy: "stop" (default) ends the run at a NaN/inf loss keeping the last good checkpoint; "skip" skips the step.
        resume: "auto" continues from the newest checkpoint in out_dir if any; "true" requires one; or a checkpoint path.
        bench_json: print a machine-readable `BENCH_JSON {...}` line with per-iteration figures at the end.
        estimate_only: print the estimated peak memory (per component) and exit before loading anything.
        memory_budget: GB per device for `--micro_batch_size auto` (default: the memory free now).
    """
    is_demo = checkpoint_dir is None
    if is_demo:
        checkpoint_dir = demo.ensure_demo_checkpoint()
        data_dir = data_dir or demo.ensure_demo_data()
        quantize = quantize or "bnb.nf4-dq"
        if "--learning_rate" not in sys.argv:
            learning_rate = 3e-3
        if not any(a.startswith("--lora_") for a in sys.argv):
            lora_r, lora_alpha, lora_key, lora_projection, lora_mlp, lora_head = 16, 32, True, True, True, True
        if "--max_iters" not in sys.argv and "--epochs" not in sys.argv:
            epochs = 3
        if "--eval_interval" not in sys.argv:
            eval_interval = save_interval = 50
        eval_iters = min(eval_iters, 10)
        template = "plain" if "--template" not in sys.argv else template
    if data_dir is None:
        raise UserError("--data_dir is required with --checkpoint_dir; pass a prepared data folder or one holding train.json/alpaca.json")
    quantize = None if quantize in (None, "none", "None") else quantize
    check_quantize(quantize, precision, "cuda" if accelerator == "cuda" else "cpu")
    if optimizer not in OPTIMIZERS:
        raise UserError(f"unknown --optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    on_cpu = accelerator == "cpu" or not torch.cuda.is_available()
    if compile and on_cpu and not (shutil.which("g++") or shutil.which("clang++")):
        raise UserError("--compile on CPU needs a C++ compiler (torch.compile builds its kernels with g++ or clang++); "
                        "install one, or leave --compile off")
    if nan_policy not in ("stop", "skip"):
        raise UserError(f"unknown --nan_policy {nan_policy!r}; choose stop or skip")
    lora = LoRAConfig(r=lora_r, alpha=lora_alpha, dropout=lora_dropout, query=lora_query, key=lora_key, value=lora_value,
                      projection=lora_projection, mlp=lora_mlp, head=lora_head)
    if estimate_only or micro_batch_size == "auto":  # before anything is loaded
        from lit_qlora.memory import plan_micro_batch_size

        micro_batch_size = plan_micro_batch_size(
            checkpoint_dir, micro_batch_size, memory_budget, estimate_only, accelerator, devices, lora,
            precision=precision, quantize=quantize, optimizer=optimizer, seq_length=max_seq_length,
            activation_checkpointing=activation_checkpointing, quantize_lm_head=quantize_lm_head,
            validation=eval_iters > 0)
        if estimate_only:
            return
    for name, value in (("devices", devices), ("micro_batch_size", micro_batch_size), ("epochs", epochs),
                        ("eval_interval", eval_interval), ("save_interval", save_interval), ("log_interval", log_interval)):
        if value < 1:  # 0 would divide by zero (or train nothing) after the model is loaded
            raise UserError(f"--{name} must be at least 1, got {value}; pass a positive number")
    if max_iters is not None and max_iters < 1:
        raise UserError(f"--max_iters must be at least 1, got {max_iters}; pass a positive number or leave it out")
    world = devices
    batch_size = batch_size or micro_batch_size * world
    if micro_batch_size < 1 or batch_size % (micro_batch_size * world):
        raise UserError(f"--batch_size {batch_size} is not a multiple of --micro_batch_size {micro_batch_size} x devices {world}; "
                        f"use e.g. --batch_size {micro_batch_size * world * max(1, batch_size // (micro_batch_size * world))}")
    out_dir = Path(out_dir)
    _check_out_dir(out_dir, resume)

    # Everything that can be wrong with the inputs is found here, before Lightning, the model or the DDP
    # processes start: the checkpoint folder, the tokenizer, the data (prepared once, here, so DDP ranks never
    # race on the cache), the resume state and the disk space for checkpoints.
    from lit_qlora.tokenizer import Tokenizer

    config = check_checkpoint_dir(checkpoint_dir)
    tokenizer = Tokenizer(checkpoint_dir)
    if tokenizer.vocab_size > config.vocab_size:
        raise UserError(f"the tokenizer in {checkpoint_dir} has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}; "
                        "the tokenizer files belong to another model: copy the model's own tokenizer files there")
    n_lora = _count_lora_params(config, lora)
    resume_path, resume_state = _find_resume(out_dir, resume)
    if resume_state is not None:
        _check_resume_compatible(resume_state, _resume_settings_of(lora, precision, quantize, micro_batch_size, batch_size,
                                                                   optimizer, seed, checkpoint_dir))
    check_disk_space(out_dir, checkpoint_bytes(n_lora))
    max_seq_length = min(max_seq_length or config.block_size, config.block_size)
    train_data, val_data, data_meta = ensure_prepared(data_dir, tokenizer, max_seq_length, template=template,
                                                      mask_inputs=mask_inputs, seed=42)

    import lightning as L
    from lightning.fabric.plugins.precision import MixedPrecision, Precision

    prec = parse_precision(precision)
    acc = accelerator if accelerator != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    # *-true: we place weights in the right dtype ourselves (Fabric's half-precision plugin would cast the
    # packed 4-bit weights too). *-mixed: Fabric's autocast, with a grad scaler for fp16.
    plugin = MixedPrecision(precision, device=acc) if prec.mixed else Precision()
    if strategy == "auto":
        strategy = "ddp" if devices > 1 else "auto"
    fabric = L.Fabric(accelerator=acc, devices=devices, strategy=strategy, plugins=[plugin])
    fabric.launch(main, dict(locals()))


def _check_out_dir(out_dir: Path, resume: Optional[str]) -> None:
    """Refuse to start over a previous run (it would be overwritten) unless resuming it."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write to --out_dir {out_dir} ({e.strerror}); choose a writable folder")
    if resume in (None, "false", "no") and list_checkpoints(out_dir):
        raise UserError(f"{out_dir} already holds checkpoints of a run; pass --resume to continue it or choose another --out_dir")


def main(fabric, args: dict) -> None:
    a = _Args(args)
    fabric.seed_everything(a.seed)
    if fabric.device.type == "cpu":
        tune_cpu_allocator()  # freed step temporaries go back to the OS instead of fragmenting the heap
    from lit_qlora.loader import load_model
    import psutil

    # checked and prepared up front by `setup`
    tokenizer, config, lora, max_seq_length = a.tokenizer, a.config, a.lora, a.max_seq_length
    train_data, val_data, data_meta = a.train_data, a.val_data, a.data_meta

    t0 = time.perf_counter()
    model = load_model(a.checkpoint_dir, precision=a.precision, quantize=a.quantize, lora=lora, device=fabric.device,
                       quantize_lm_head=a.quantize_lm_head, config=config, seed=a.seed)
    model.activation_checkpointing = a.activation_checkpointing
    if a.compile:
        model.compile_blocks()
    report = memory_report(model)
    rss_after_load = psutil.Process().memory_info().rss / 2**30
    fabric.print(f"Loaded {config.name} in {time.perf_counter() - t0:.1f}s | {a.quantize or 'no quantization'}, {a.precision} | "
                 f"{format_memory_report(report)}", file=sys.stderr)

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(a.optimizer, trainable, a.learning_rate, a.weight_decay, fabric.device.type)
    gpt = model  # the plain module, for generation and saving
    model = fabric.setup_module(model, move_to_device=False)
    optimizer = fabric.setup_optimizers(optimizer)

    world, rank = fabric.world_size, fabric.global_rank
    accum = a.batch_size // (a.micro_batch_size * world)
    stream = BatchStream(train_data, batch_size=a.micro_batch_size * world, seed=a.seed, pad_id=tokenizer.eos_id or 0,
                         ignore_index=IGNORE_INDEX)
    steps_per_epoch = max(1, -(-len(train_data) // a.batch_size))
    max_steps = a.max_iters if a.max_iters is not None else a.epochs * steps_per_epoch

    step, train_time = 0, 0.0
    resume_path, state = a.resume_path, a.resume_state
    if state is not None:
        load_lora_weights(gpt, state["lora"])
        optimizer.load_state_dict(state["resume"]["optimizer"])
        scaler = getattr(fabric.strategy.precision, "scaler", None)
        if scaler is not None and state["resume"].get("scaler"):
            scaler.load_state_dict(state["resume"]["scaler"])
        stream.load_state_dict(state["resume"]["data"])
        set_rng_state(state["resume"]["rng"])
        step, train_time = state["resume"]["step"], state["resume"]["train_time"]
        fabric.print(f"Resuming from {resume_path} at iteration {step}", file=sys.stderr)
    metrics = MetricsLog(a.out_dir, resume_iter=step, enabled=rank == 0)
    train_info = dict(precision=a.precision, quantize=a.quantize, template=data_meta.get("template", a.template),
                      max_seq_length=max_seq_length, mask_inputs=a.mask_inputs, checkpoint_dir=str(a.checkpoint_dir),
                      data_dir=str(a.data_dir))
    if rank == 0:
        hparams = json.dumps({**a.as_dict(), "lora": asdict(lora), "max_steps": max_steps, "accumulation": accum}, indent=2,
                             default=str)
        atomic_write(a.out_dir / "hyperparameters.json", lambda p: p.write_text(hparams))

    def save(reason: str) -> Path:
        path = checkpoint_path(a.out_dir, step)
        if rank == 0:
            scaler = getattr(fabric.strategy.precision, "scaler", None)
            payload = {"format": ADAPTER_FORMAT, "lora": {k: v.float().cpu().clone() for k, v in lora_state_dict(gpt).items()},
                       "lora_config": asdict(lora), "model_config": config.to_dict(), "train": {**train_info, "iter": step},
                       "resume": {"step": step, "optimizer": optimizer.state_dict(), "data": stream.state_dict(),
                                  "rng": rng_state(), "train_time": train_time,
                                  "scaler": scaler.state_dict() if scaler is not None else None,
                                  "settings": _resume_settings_of(lora, a.precision, a.quantize, a.micro_batch_size,
                                                                  a.batch_size, a.optimizer, a.seed, a.checkpoint_dir)}}
            check_disk_space(a.out_dir, checkpoint_bytes(sum(v.numel() for v in payload["lora"].values())))
            save_checkpoint(path, payload, keep=a.keep_checkpoints)
            fabric.print(f"Saved checkpoint {path} ({reason})", file=sys.stderr)
        fabric.barrier()
        return path

    stop = StopRequest()
    losses, iter_times, iter_tokens, val_loss = [], [], [], None
    skipped = 0
    fabric.print(f"Training {max_steps} iterations: {len(train_data)} samples, batch {a.batch_size} "
                 f"(micro {a.micro_batch_size} x {world} devices x {accum} accumulation), lr {a.learning_rate}", file=sys.stderr)
    if step == 0 and a.eval_iters > 0:  # the starting point, so the validation curve shows what training changed
        val0 = validate(fabric, model, gpt, val_data, a, tokenizer, data_meta, config)
        metrics.log(dict(iter=0, step=0, val_loss=val0, val_ppl=float(torch.tensor(val0).exp())))
    model.train()
    while step < max_steps:
        t_iter = time.perf_counter()
        micro = [_local(next(stream), rank, world) for _ in range(accum)]
        # Normalize by the target tokens of the whole optimizer step on all devices, so accumulation and DDP
        # give the same update as one big batch.
        targets = [shift_labels(b["labels"], IGNORE_INDEX) for b in micro]
        n_tok = torch.tensor(float(sum(int((t != IGNORE_INDEX).sum()) for t in targets)), device=fabric.device)
        n_tok = fabric.all_reduce(n_tok, reduce_op="sum") if world > 1 else n_tok
        loss_sum = torch.zeros((), device=fabric.device)
        for j, (batch, tgt) in enumerate(zip(micro, targets)):
            with fabric.no_backward_sync(model, enabled=j < accum - 1):
                logits = model(batch["input_ids"].to(fabric.device), lm_head_chunk=head_chunk(config))
                loss = chunked_cross_entropy(logits, tgt.to(fabric.device), IGNORE_INDEX)
                fabric.backward(loss * world / n_tok.clamp(min=1))
            loss_sum += loss.detach()
        loss_sum = fabric.all_reduce(loss_sum, reduce_op="sum") if world > 1 else loss_sum
        step_loss = float(loss_sum / n_tok.clamp(min=1))
        if not torch.isfinite(torch.tensor(step_loss)) or not _all_finite(p.grad for p in trainable):
            optimizer.zero_grad(set_to_none=True)
            if a.nan_policy == "stop":
                last = list_checkpoints(a.out_dir)
                keep = f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was written yet"
                raise TrainingDiverged(f"loss became {step_loss} at iteration {step + 1} ({keep}); try --precision bf16-true "
                                       f"or bf16-mixed, or a lower --learning_rate than {a.learning_rate}")
            skipped += 1
            fabric.print(f"warning: non-finite loss at iteration {step + 1}; step skipped ({skipped} so far)", file=sys.stderr)
            if skipped >= 10:
                raise TrainingDiverged(f"{skipped} non-finite losses, the last at iteration {step + 1}; use --precision bf16-true "
                                       "or a lower --learning_rate")
            step += 1
            continue
        if a.grad_clip:
            fabric.clip_gradients(model, optimizer, max_norm=a.grad_clip)
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, max_steps, a.learning_rate, a.min_lr, a.warmup_steps)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not _all_finite(trainable):
            # finite loss and gradients can still overflow the weights (e.g. fp16 with a huge learning rate);
            # stop before such weights reach a checkpoint, so the last checkpoint stays a good one
            last = list_checkpoints(a.out_dir)
            keep = f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was written yet"
            raise TrainingDiverged(f"weights became non-finite at iteration {step + 1} ({keep}); try --precision bf16-true "
                                   f"or bf16-mixed, or a lower --learning_rate than {a.learning_rate}")
        step += 1
        dt = time.perf_counter() - t_iter
        train_time += dt
        tokens = sum(int(b["lengths"].sum()) for b in micro) * world
        losses.append(step_loss)
        iter_times.append(dt)
        iter_tokens.append(tokens)
        row = dict(iter=step, step=step, loss=step_loss, lr=optimizer.param_groups[0]["lr"], iter_time_ms=dt * 1000,
                   tokens=tokens, tokens_per_sec=tokens / dt)

        if a.eval_iters > 0 and (step % a.eval_interval == 0 or step == max_steps):
            val_loss = validate(fabric, model, gpt, val_data, a, tokenizer, data_meta, config)
            row.update(val_loss=val_loss, val_ppl=float(torch.tensor(val_loss).exp()))
        metrics.log(row)
        if rank == 0 and (step % a.log_interval == 0 or step == max_steps):
            _show_progress(step, max_steps, step_loss, dt, tokens, train_time)
        saved = step % a.save_interval == 0 and step < max_steps
        if saved:
            save(f"every {a.save_interval} iterations")
        # DDP: every rank stops at the same iteration, whichever got the signal (a mismatch would hang the collectives)
        stop_now = stop.requested
        if world > 1:
            stop_now = bool(fabric.all_reduce(torch.tensor(float(stop_now), device=fabric.device), reduce_op="sum") > 0)
        if stop_now and step < max_steps:
            path = checkpoint_path(a.out_dir, step) if saved else save("interrupted")
            fabric.print(f"Stopped at iteration {step}; continue with --resume (checkpoint {path})", file=sys.stderr)
            sys.exit(128 + (stop.signum or signal.SIGTERM))

    if a.quantize:
        assert_trainable_4bit(gpt)
    if world > 1:
        _check_ranks_agree(fabric, gpt)
    save("end of training")
    if rank == 0:
        save_adapter(a.out_dir / FINAL_ADAPTER, gpt, lora, train_info={**train_info, "iter": step})
    mem = memory_used_gb(fabric.device)
    n_tokens = sum(iter_tokens)
    summary = dict(model=config.name, precision=a.precision, quantize=a.quantize or "none", optimizer=a.optimizer,
                   micro_batch_size=a.micro_batch_size, batch_size=a.batch_size, devices=world, iterations=step,
                   max_seq_length=max_seq_length, lora=asdict(lora), activation_checkpointing=a.activation_checkpointing,
                   compile=a.compile,
                   training_time_s=train_time, tokens_per_sec=n_tokens / max(sum(iter_times), 1e-9) if iter_times else None,
                   peak_memory_gb=mem, memory_kind="cuda max allocated" if fabric.device.type == "cuda" else "peak RSS",
                   final_train_loss=losses[-1] if losses else None, final_val_loss=val_loss,
                   first_train_loss=losses[0] if losses else None, rss_after_load_gb=rss_after_load,
                   trainable_params=report["trainable_params"], quantized_bytes=report["quantized_bytes"],
                   bits_per_quantized_param=report["bits_per_quantized_param"], dense_bytes=report["dense_bytes"])
    if rank == 0:
        atomic_write(a.out_dir / "metrics.json", lambda p: p.write_text(json.dumps(summary, indent=2)))
    if rank == 0 and a.bench_json:
        b_moved = all(bool(v.abs().sum() > 0) for k, v in lora_state_dict(gpt).items() if "lora_B" in k)
        print("BENCH_JSON " + json.dumps(dict(iter_times=iter_times, iter_tokens=iter_tokens, losses=losses,
                                              rss_after_load_gb=rss_after_load, lora_grads_flowed=b_moved,
                                              q_proj_base_layer=type(gpt.transformer.h[0].attn.qkv.base).__name__
                                              if hasattr(gpt.transformer.h[0].attn.qkv, "base") else "Linear")))
    if rank == 0:
        print(f"Saved the adapter to {a.out_dir / FINAL_ADAPTER}", file=sys.stderr)
        print(f"Training time: {train_time:.2f}s", file=sys.stderr)
        print(f"Memory used: {mem:.2f} GB", file=sys.stderr)


@torch.no_grad()
def validate(fabric, model, gpt, val_data: list, a: "_Args", tokenizer, data_meta: dict, config) -> float:
    """Token-weighted validation loss over the first `eval_iters` batches, then one greedy sample (rank 0)."""
    from lit_qlora.data import collate, get_template

    validation_mode(model)  # eval(), but int8 layers on CPU keep their lean training matmul
    world, rank = fabric.world_size, fabric.global_rank
    total = torch.zeros(2, device=fabric.device)  # loss sum, token count
    mb = a.micro_batch_size
    for i in range(min(a.eval_iters, -(-len(val_data) // (mb * world)))):
        chunk = val_data[(i * world + rank) * mb:(i * world + rank + 1) * mb]
        if not chunk:
            continue
        batch = collate(chunk, pad_id=tokenizer.eos_id or 0, ignore_index=IGNORE_INDEX)
        tgt = shift_labels(batch["labels"], IGNORE_INDEX).to(fabric.device)
        logits = model(batch["input_ids"].to(fabric.device), lm_head_chunk=head_chunk(config))
        total += torch.stack([chunked_cross_entropy(logits, tgt, IGNORE_INDEX).float(), (tgt != IGNORE_INDEX).sum().float()])
    total = fabric.all_reduce(total, reduce_op="sum") if world > 1 else total
    val_loss = float(total[0] / total[1].clamp(min=1))
    if rank == 0 and val_data:
        # One sample from the first validation prompt, so progress is visible in words too
        labels = val_data[0]["labels"]
        n_prompt = int((labels == IGNORE_INDEX).sum()) if a.mask_inputs else 0
        n_prompt = n_prompt or max(1, len(labels) // 2)  # nothing masked: prompt with the first half
        prompt = val_data[0]["input_ids"][:n_prompt]
        with fabric.autocast():
            out = generate(gpt, prompt, max_new_tokens=min(a.eval_max_new_tokens, config.block_size - len(prompt)),
                           eos_ids=tokenizer.stop_ids or [tokenizer.eos_id])
        text = tokenizer.decode(out[len(prompt):]).strip().replace("\n", " ")
        print(f"validation: loss {val_loss:.4f}, perplexity {float(torch.tensor(val_loss).exp()):.2f} | sample: {text[:200]!r}",
              file=sys.stderr)
    model.train()
    return val_loss


def _local(batch: dict, rank: int, world: int) -> dict:
    """This device's rows of a global micro-batch, trimmed to their own longest sample."""
    if world == 1:
        return batch
    rows = slice(rank, None, world)
    part = {k: v[rows] for k, v in batch.items()}
    T = int(part["lengths"].max()) if len(part["lengths"]) else 1
    return {"input_ids": part["input_ids"][:, :T], "labels": part["labels"][:, :T], "lengths": part["lengths"]}


def _all_finite(tensors) -> bool:
    """True when no element of the tensors (None entries skipped) is NaN or inf; one device sync in all."""
    peaks = [t.detach().abs().amax().float() for t in tensors if t is not None and t.numel()]
    return not peaks or bool(torch.isfinite(torch.stack(peaks)).all())


def _check_ranks_agree(fabric, gpt) -> float:
    """DDP keeps one model: compare every LoRA tensor with rank 0's and say how far apart the ranks are."""
    diff = torch.zeros((), device=fabric.device)
    for v in lora_state_dict(gpt).values():
        ref = fabric.broadcast(v.detach().clone(), src=0)
        diff = torch.maximum(diff, (v.float() - ref.to(v.device).float()).abs().max())
    diff = float(fabric.all_reduce(diff, reduce_op="max"))
    if diff <= 1e-6:
        fabric.print(f"ranks agree: max diff {diff:.3g}", file=sys.stderr)
    else:
        fabric.print(f"warning: DDP ranks disagree: max diff {diff:.3g} between LoRA weights", file=sys.stderr)
    return diff


def _show_progress(step: int, max_steps: int, loss: float, dt: float, tokens: int, elapsed: float) -> None:
    eta = elapsed / step * (max_steps - step)
    if is_tty():
        bar = "#" * int(30 * step / max_steps)
        print(f"\r[{bar:<30}] iter {step}/{max_steps} | loss {loss:.4f} | {tokens / dt:.0f} tok/s | ETA {fmt_eta(eta)}  ",
              end="" if step < max_steps else "\n", file=sys.stderr, flush=True)
    else:
        print(f"iter {step} | loss {loss:.4f} | iter time: {dt * 1000:.1f} ms | tokens {tokens} | ETA {fmt_eta(eta)}", flush=True)


def _find_resume(out_dir: Path, resume: Optional[str]) -> tuple[Optional[Path], Optional[dict]]:
    if resume in (None, "false", "no"):
        return None, None
    if resume in ("auto", "true", "yes"):
        path, state = load_latest_checkpoint(out_dir)
        if state is None and resume != "auto":
            raise UserError(f"--resume: no intact checkpoint in {out_dir / 'checkpoints'}; use --resume auto to start fresh")
        return path, state
    path = Path(resume)
    if not path.is_file():
        raise UserError(f"--resume {path}: no such checkpoint; pass --resume auto or an iter-*.pth file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise UserError(f"--resume {path}: the checkpoint is damaged ({type(e).__name__}); pass an earlier one or --resume auto")
    if not (isinstance(state, dict) and state.get("format") == ADAPTER_FORMAT and "resume" in state):
        raise UserError(f"--resume {path} is not a resumable checkpoint of finetune/lora.py; pass an iter-*.pth file")
    return path, state


def _resume_settings_of(lora: LoRAConfig, precision: str, quantize: Optional[str], micro_batch_size: int, batch_size: int,
                        optimizer: str, seed: int, checkpoint_dir) -> dict:
    return dict(lora=asdict(lora), precision=precision, quantize=quantize, micro_batch_size=micro_batch_size,
                batch_size=batch_size, optimizer=optimizer, seed=seed, checkpoint_dir=str(checkpoint_dir))


def _check_resume_compatible(state: dict, now: dict) -> None:
    saved = state["resume"].get("settings", {})
    for k, v in now.items():
        if k in saved and saved[k] != v and k != "checkpoint_dir":
            raise UserError(f"the checkpoint was made with {k}={saved[k]} but this run uses {k}={v}; resume with the same "
                            "settings or start a new --out_dir")


def _count_lora_params(config, lora: LoRAConfig) -> int:
    """Trainable parameters of this LoRA on this model, counted on the meta device (allocates nothing)."""
    from lit_qlora.lora import apply_lora
    from lit_qlora.model import GPT

    with torch.device("meta"):
        model = GPT(config)
        apply_lora(model, lora)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class _Args:
    """The CLI values as attributes (the launcher passes them as one dict so DDP processes get the same)."""

    def __init__(self, d: dict) -> None:
        self._d = {k: v for k, v in d.items() if not k.startswith("_") and k not in ("L", "MixedPrecision", "Precision",
                                                                                     "plugin", "fabric", "prec", "acc")}
        self.__dict__.update(self._d)
        self.out_dir = Path(self.out_dir)

    def as_dict(self) -> dict:
        return {k: v for k, v in self._d.items() if isinstance(v, (str, int, float, bool, type(None), Path))}


if __name__ == "__main__":
    # a bare `--resume` means `--resume true`
    if sys.argv[-1] == "--resume" or any(a == "--resume" and b.startswith("--") for a, b in zip(sys.argv, sys.argv[1:])):
        i = sys.argv.index("--resume")
        sys.argv.insert(i + 1, "true")
    run_cli(setup)
