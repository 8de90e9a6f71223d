"""Benchmark: peak memory and time of loading a ~1.1B-parameter checkpoint with every --quantize value.

    python scripts/bench/bench_load_memory.py [--out_dir /tmp/bench_load] [--keep true] [--n_layer 22]

Writes a random TinyLlama-shaped checkpoint in our format (bf16 `lit_model.safetensors` + `model_config.json`),
one tensor at a time so the model is never whole in memory, then loads it in a fresh child process per setting
with `load_model(..., precision="bf16-true", quantize=q)`. Prints figures only (it is not a test).

Goal checked for bnb.nf4-dq: peak RSS <= 0.35 x the bf16 checkpoint size + 0.7 GB (GB = 10^9 bytes throughout).

Peak RSS is the child's ru_maxrss. Linux carries the high-water mark of the process that spawned a child into the
child's ru_maxrss (it is recorded at exec), so this parent stays small: the checkpoint is written by a child too.
VmHWM (the peak of the child's own address space) is printed beside it as a cross-check.
"""
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

GB = 1e9
SETTINGS = [None, "bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8"]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def child(ckpt: str, quantize: str) -> None:
    """Runs in the fresh process: load once and print one JSON line of figures."""
    from lit_qlora.loader import load_model
    from lit_qlora.quant.quantize import memory_report, quiet_bnb_import

    if quantize != "none":
        quiet_bnb_import()  # bitsandbytes' import cost belongs to the runtime, not to the load
    rss_start = rss_bytes()
    t0 = time.perf_counter()
    model = load_model(Path(ckpt), precision="bf16-true", quantize=None if quantize == "none" else quantize)
    seconds = time.perf_counter() - t0
    r = memory_report(model)
    print(json.dumps(dict(seconds=seconds, rss_start=rss_start, rss_end=rss_bytes(),
                          peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
                          vm_hwm=vm_hwm_bytes(),
                          model_bytes=r["quantized_bytes"] + r["dense_bytes"], bits=r["bits_per_quantized_param"])))


def write_checkpoint(folder: Path, n_layer: int) -> tuple[int, int]:
    import torch

    from lit_qlora.checkpoint import LIT_CONFIG, LIT_WEIGHTS, lit_param_shapes, write_safetensors_stream
    from lit_qlora.config import Config

    config = Config(name="bench-llama-1.1b", block_size=2048, vocab_size=32000, n_layer=n_layer, n_head=32, n_embd=2048,
                    n_query_groups=4, intermediate_size=5632)
    specs = [(k, s, torch.bfloat16) for k, s in lit_param_shapes(config).items()]
    gen = torch.Generator().manual_seed(0)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape, dtype in specs:  # one at a time: the largest is the 32000 x 2048 embedding
            if ".norm_" in name or "ln_f" in name:
                yield name, (1.0 + 0.1 * torch.randn(shape, generator=gen)).to(dtype)
            else:
                yield name, (0.02 * torch.randn(shape, generator=gen)).to(dtype)

    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors_stream(folder / LIT_WEIGHTS, specs, tensors())
    config.save(folder / LIT_CONFIG)
    return sum(s.numel() for _, s, _ in specs), (folder / LIT_WEIGHTS).stat().st_size


def bench(out_dir: Optional[Path] = None, keep: bool = False, n_layer: int = 22) -> None:
    """Load a random ~1.1B checkpoint with every --quantize value and print size, peak RSS and load time.

    Args:
        out_dir: Where to write the checkpoint (needs ~2.2 GB free). Default: a temporary folder.
        keep: Keep the generated checkpoint (and reuse it on the next run with the same --out_dir).
        n_layer: Transformer layers (22 = TinyLlama 1.1B's shape).
    """
    work = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="bench_load_"))
    ckpt = work / "ckpt"
    try:
        t0 = time.perf_counter()
        from lit_qlora.checkpoint import LIT_CONFIG, LIT_WEIGHTS
        from lit_qlora.config import Config

        if (ckpt / LIT_WEIGHTS).is_file() and Config.from_file(ckpt / LIT_CONFIG).n_layer == n_layer:
            how = "reused"
        else:
            subprocess.run([sys.executable, __file__, "_write", str(ckpt), str(n_layer)], check=True)
            how = f"written in {time.perf_counter() - t0:.0f} s"
        disk = (ckpt / LIT_WEIGHTS).stat().st_size
        with open(ckpt / LIT_WEIGHTS, "rb") as f:
            n_params = (disk - 8 - int.from_bytes(f.read(8), "little")) // 2  # all bf16
        print(f"checkpoint: {n_params / 1e9:.2f}B parameters, {n_layer} layers, bf16, {disk / GB:.2f} GB on disk "
              f"({how}) in {ckpt}", flush=True)

        rows = []
        for q in SETTINGS:
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
            proc = subprocess.run([sys.executable, __file__, "_child", str(ckpt), q or "none"], capture_output=True,
                                  text=True, env=env)
            if proc.returncode:
                sys.exit(f"loading with --quantize {q} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            m = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append((q, m))
            print(f"  loaded {q or 'none'}: {m['seconds']:.1f} s, peak RSS {m['peak'] / GB:.2f} GB "
                  f"(VmHWM {m['vm_hwm'] / GB:.2f} GB)", flush=True)

        goal = 0.35 * disk + 0.7 * GB
        print("\n| --quantize | load s | peak RSS GB (ru_maxrss) | VmHWM GB | RSS before load GB | RSS after load GB "
              "| model tensors GB | bits/param | peak / disk |")
        print("|---|---|---|---|---|---|---|---|---|")
        for q, m in rows:
            bits = f"{m['bits']:.3f}" if q else "-"
            print(f"| {q or 'none (bf16-true)'} | {m['seconds']:.1f} | {m['peak'] / GB:.2f} | {m['vm_hwm'] / GB:.2f} | "
                  f"{m['rss_start'] / GB:.2f} | {m['rss_end'] / GB:.2f} | {m['model_bytes'] / GB:.2f} | {bits} | "
                  f"{m['peak'] / disk:.2f} |")
        peak = dict(rows)["bnb.nf4-dq"]["peak"]
        ok = peak <= goal
        print(f"\ngoal (bnb.nf4-dq): peak RSS {peak / GB:.2f} GB <= 0.35 x {disk / GB:.2f} GB + 0.7 GB = "
              f"{goal / GB:.2f} GB: "
              f"{'MET' if ok else 'MISSED'}")
    finally:
        if not keep:
            shutil.rmtree(ckpt if out_dir else work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "_child":
        child(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "_write":
        write_checkpoint(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        from lit_qlora.utils import run_cli

        run_cli(bench)
