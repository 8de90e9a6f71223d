"""Helpers for tests/test_distributed.py: random checkpoints built from a Config, a free port, a torchrun command line,
and the worker that loads a model sharded over a CPU process group (gloo) and checks it against the unsharded load.

The worker runs in processes started by torch.multiprocessing.spawn (it must live in an importable module)."""
from __future__ import annotations

import json
import logging
import os
import random
import socket
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from lit_qlora.checkpoint import LIT_CONFIG, LIT_WEIGHTS, lit_param_shapes, write_safetensors_stream
from lit_qlora.config import Config
from lit_qlora.lora import LoRAConfig


def random_checkpoint(folder: Path, config: Config, seed: int = 0) -> Path:
    """A converted checkpoint of `config` with random bf16 weights (std 0.02), written one tensor at a time."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes = lit_param_shapes(config)
    write_safetensors_stream(folder / LIT_WEIGHTS, [(k, s, torch.bfloat16) for k, s in shapes.items()],
                             ((k, (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)) for k, s in shapes.items()))
    config.save(folder / LIT_CONFIG)
    return folder


def free_port() -> int:
    """A port nothing listens on, for a rendezvous that binds it a moment later. Not port 0's pick: that comes from the
    kernel's ephemeral range, which every outgoing connection (the other xdist worker's DDP runs, gloo's own
    sockets) also draws from, so by the time torchrun binds it another socket may hold it, and the other 'machine'
    waits for a master that never comes until the test's timeout. Below that range the kernel hands out nothing;
    each xdist worker gets its own block of it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    start = 15000 + 1000 * (int(worker) % 16 if worker.isdigit() else 0)
    candidates = list(range(start, min(start + 1000, low)))
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a system with an unusual port range: the kernel's pick after all
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_node(node_rank: int, nnodes: int, port: int, script: Path, args: list) -> list[str]:
    """One machine's command line of a multi-node run, every 'machine' on localhost (static rendezvous)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc_per_node", "1",
            "--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port), str(script),
            *map(str, args)]


# ---- the sharded-load worker ---------------------------------------------------------------------------------
class _PeakRSS:
    """The highest resident set size seen while the `with` block runs (sampled every 2 ms)."""

    def __enter__(self):
        import psutil

        self.proc, self.peak, self.stop = psutil.Process(), 0, False
        self.start = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self):
        while not self.stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.end = self.proc.memory_info().rss


def _batch(config: Config) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))


def _step(model, idx: torch.Tensor) -> torch.Tensor:
    """One training forward + backward (the loss of predicting idx shifted by one); the logits, detached."""
    model.train()
    logits = model(idx)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                                      idx[:, 1:].reshape(-1)).backward()
    return logits.detach().float()


def sharded_load_worker(rank: int, world: int, port: int, cases: list[dict], out_dir: str) -> None:
    """For each case: load the checkpoint sharded (lit_qlora.loader.load_model_sharded + distributed.fully_shard_gpt),
    record how it is sharded and what it holds, run a training step, gather every parameter and LoRA gradient; rank 0
    then loads the same checkpoint unsharded (load_model) and records the differences. One JSON file per rank."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    from lit_qlora.lora import load_lora_weights

    mesh = init_device_mesh("cpu", (world,))
    results = []
    for case in cases:
        model, r, kw = _load_sharded_case(case, mesh, rank, world)
        results.append(r)
        if case.get("compare", True):
            # B != 0 so every LoRA tensor gets a gradient; set through load_lora_weights, which a resume uses too
            g = torch.Generator().manual_seed(5)
            lora_b = {n: torch.randn(p.shape, generator=g) * 0.1 for n, p in model.named_parameters() if "lora_B" in n}
            load_lora_weights(model, lora_b)
            logits = _step(model, _batch(kw["config"]))
            r.update(_inf_check(model, rank))
            full = {n: p.full_tensor() for n, p in model.named_parameters()}
            full.update((n, b) for n, b in model.named_buffers() if "lora_" in n)  # A0, B0, DoRA's row norms: whole
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
            if rank == 0:
                _compare_with_unsharded(r, model, Path(case["folder"]), kw, lora_b, logits, full, grads)
            del full, grads
        del model
        torch.distributed.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


def _load_sharded_case(case: dict, mesh, rank: int, world: int) -> tuple[torch.nn.Module, dict, dict]:
    """(the model of `case` loaded sharded, what this rank records of its memory and sharding plan, load_model's
    keyword arguments)."""
    import bitsandbytes as bnb
    from torch.distributed.tensor import DTensor, Shard

    from lit_qlora.distributed import fully_shard_gpt
    from lit_qlora.loader import load_model_sharded
    from lit_qlora.memory import estimate_training_memory
    from lit_qlora.quant.quantize import memory_report

    folder, config = Path(case["folder"]), Config.from_file(Path(case["folder"]) / LIT_CONFIG)
    lora = LoRAConfig(**case["lora"])
    storage = getattr(torch, case.get("storage", "uint8"))
    kw = dict(precision=case["precision"], quantize=case["quantize"], lora=lora, device="cpu",
              quantize_lm_head=case["quantize_lm_head"], config=config, seed=7)
    with _PeakRSS() as rss:
        model = load_model_sharded(folder, lambda m: fully_shard_gpt(m, mesh), storage=storage, **kw)
    report = memory_report(model)
    r = dict(name=case["name"], rank=rank, rss_peak_growth=rss.peak - rss.start, rss_growth=rss.end - rss.start,
             full_bytes=report["quantized_bytes"] + report["dense_bytes"], rank_bytes=report["rank_bytes"],
             estimated_rank_bytes=estimate_training_memory(
                 config, lora, case["precision"], case["quantize"], quantize_lm_head=case["quantize_lm_head"],
                 shard_world=world).extra["rank_weight_bytes"])
    # the sharding plan: every parameter a DTensor split along dim 0 over all ranks; 4-bit weights as packed bytes
    plan = {}
    for name, p in model.named_parameters():
        plan[name] = dict(dtensor=isinstance(p, DTensor), placements=[str(x) for x in getattr(p, "placements", ())],
                          mesh_size=p.device_mesh.size() if isinstance(p, DTensor) else 0,
                          local_shape=list(p.to_local().shape) if isinstance(p, DTensor) else list(p.shape),
                          dtype=str(p.dtype), shape=list(p.shape))
    r["plan"] = plan
    r["all_shard0"] = all(v["dtensor"] and v["placements"] == [str(Shard(0))] and v["mesh_size"] == world
                          for v in plan.values())
    fourbit = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    r["fourbit_layers"] = sorted(fourbit)
    r["fourbit_have_state"] = all(m.quant_state is not None for m in fourbit.values())
    return model, r, {**kw, "storage": storage}


def _inf_check(model: torch.nn.Module, rank: int) -> dict:
    """The finite check of the training step: one rank's shard of one gradient turns inf, every rank must see it."""
    from lit_qlora.train.training import all_finite

    with_grad = [p for p in model.parameters() if p.grad is not None]
    out = dict(grads_finite=all_finite(p.grad for p in with_grad))
    shard = next(p.grad.to_local() for p in with_grad if p.grad.to_local().numel())
    kept = shard.view(-1)[0].item()
    if rank == 1:
        shard.view(-1)[0] = float("inf")
    out["inf_seen_by_all"] = not all_finite(p.grad for p in with_grad)
    shard.view(-1)[0] = kept
    return out


def _compare_with_unsharded(r: dict, model: torch.nn.Module, folder: Path, kw: dict, lora_b: dict,
                            logits: torch.Tensor, full: dict, grads: dict) -> None:
    """Rank 0: the same checkpoint loaded unsharded, the same step; the differences of parameters, 4-bit states,
    logits and gradients into `r`."""
    import bitsandbytes as bnb

    from lit_qlora.loader import load_model
    from lit_qlora.lora import load_lora_weights

    kw = dict(kw)
    storage = kw.pop("storage")
    ref = load_model(folder, **kw)
    load_lora_weights(ref, lora_b)
    ref_logits = _step(ref, _batch(kw["config"]))
    ref_params = {**dict(ref.named_buffers()), **dict(ref.named_parameters())}
    fourbit = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    diffs = {}
    for n, t in full.items():
        ref_t = ref_params[n].data
        if n.removesuffix(".weight") in fourbit and n.endswith(".weight"):  # packed bytes, any storage dtype
            a, b = (x.contiguous().view(torch.uint8).reshape(-1) for x in (t, ref_t))
            diffs[n] = int((a != b).sum()) if a.shape == b.shape else -1
            if storage.is_floating_point:
                r["nan_patterns"] = r.get("nan_patterns", 0) + int(torch.isnan(t).sum())
        else:
            diffs[n] = float((t.float() - ref_t.float()).abs().max()) if t.shape == ref_t.shape else -1.0
    r["param_diffs"] = diffs
    r["quant_states_equal"] = {n: _same_quant_state(m.quant_state, ref.get_submodule(n).weight.quant_state)
                               for n, m in fourbit.items()}
    r["logits_max_diff"] = float((logits - ref_logits).abs().max())
    r["logits_scale"] = float(ref_logits.abs().max())
    r["grad_max_rel_diff"] = max(float((g - ref_params[n].grad).abs().max()
                                       / ref_params[n].grad.abs().max().clamp(min=1e-30)) for n, g in grads.items())
    r["grads"] = sorted(grads)


def _same_quant_state(a, b) -> bool:
    """Two 4-bit states hold the same statistics (PartsQuantState: part by part)."""
    a_parts, b_parts = (getattr(s, "parts", [(None, s)]) for s in (a, b))
    same = a.shape == b.shape and len(a_parts) == len(b_parts)
    for (ra, pa), (rb, pb) in zip(a_parts, b_parts):
        same = same and ra == rb and torch.equal(pa.absmax, pb.absmax) and torch.equal(pa.code, pb.code)
        if pb.nested:
            same = same and torch.equal(pa.state2.absmax, pb.state2.absmax) and torch.equal(pa.offset, pb.offset)
    return same


def unsharded_load_worker(_: int, warm: dict, case: dict, out_file: str) -> None:
    """What every DDP rank does: load the whole checkpoint (load_model), after a warm-up load of `warm`; the growth
    of the resident set size, after loading and at its peak, into `out_file`."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from lit_qlora.loader import load_model

    def kw(c: dict) -> dict:
        return dict(precision=c["precision"], quantize=c["quantize"], lora=LoRAConfig(**c["lora"]), device="cpu",
                    quantize_lm_head=c["quantize_lm_head"], seed=7)

    _step(load_model(Path(warm["folder"]), **kw(warm)), _batch(Config.from_file(Path(warm["folder"]) / LIT_CONFIG)))
    with _PeakRSS() as rss:
        model = load_model(Path(case["folder"]), **kw(case))
    Path(out_file).write_text(json.dumps(dict(rss_peak_growth=rss.peak - rss.start, rss_growth=rss.end - rss.start)))
    del model
