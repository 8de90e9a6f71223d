"""Benchmark: peak memory of checkpoint conversion against the checkpoint's size (goal: peak RSS < 1.5x its size).

    python scripts/bench/bench_convert_memory.py [--size 1.0] [--out_dir /tmp/bench] [--keep true] [--export false]

Writes a random Llama-shaped bf16 Hugging Face checkpoint of `--size` billion parameters, one tensor at a time (it
is never whole in memory), then runs scripts/convert_hf_checkpoint.py on it in a child process (then, unless --export
false, scripts/convert_lit_checkpoint.py back to an HF folder), sampling the child's resident memory. Prints figures
only.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import torch

from lit_qlora.checkpoint import write_safetensors_stream
from lit_qlora.utils import run_cli

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


def llama_like(size_b: float) -> dict:
    """A TinyLlama-shaped config (GQA 32/4 heads, 2048 wide) with as many layers as `size_b` billion parameters need."""
    embd, inter, vocab, kv_heads, heads = 2048, 5632, 32000, 4, 32
    per_layer = embd * embd * 2 + 2 * embd * (embd // heads * kv_heads) + 3 * embd * inter + 2 * embd
    n_layer = max(1, round((size_b * 1e9 - 2 * vocab * embd - embd) / per_layer))
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=embd, intermediate_size=inter,
                num_hidden_layers=n_layer, num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                torch_dtype="bfloat16", hidden_act="silu")


def hf_specs(cfg: dict) -> list[tuple[str, torch.Size, torch.dtype]]:
    e, i, v, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = e // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    specs = [("model.embed_tokens.weight", (v, e))]
    for n in range(L):
        p = f"model.layers.{n}."
        specs += [(p + "input_layernorm.weight", (e,)), (p + "self_attn.q_proj.weight", (e, e)),
                  (p + "self_attn.k_proj.weight", (kv, e)), (p + "self_attn.v_proj.weight", (kv, e)),
                  (p + "self_attn.o_proj.weight", (e, e)), (p + "post_attention_layernorm.weight", (e,)),
                  (p + "mlp.gate_proj.weight", (i, e)), (p + "mlp.up_proj.weight", (i, e)),
                  (p + "mlp.down_proj.weight", (e, i))]
    specs += [("model.norm.weight", (e,)), ("lm_head.weight", (v, e))]
    return [(k, torch.Size(s), torch.bfloat16) for k, s in specs]


def random_tensors(specs) -> Iterator[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    for name, shape, dtype in specs:
        yield name, (torch.randn(shape, generator=g) * 0.02).to(dtype)


def measure(cmd: list[str]) -> dict:
    """Run `cmd`, sampling /proc/<pid>/status every 20 ms: peak VmRSS, RssAnon, RssFile (bytes), seconds and
    the kernel's exact peak (ru_maxrss of this child, from wait4)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
        peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        status = Path(f"/proc/{child.pid}/status")
        while True:
            pid, code, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            try:
                for line in status.read_text().splitlines():
                    key, _, value = line.partition(":")
                    if key in peak:
                        peak[key] = max(peak[key], int(value.split()[0]) * 1024)
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        child.returncode = os.waitstatus_to_exitcode(code)
        seconds = time.perf_counter() - start
        if child.returncode:
            err.seek(0)
            sys.exit(f"{' '.join(cmd)} failed ({child.returncode}):\n{err.read()}")
    return dict(seconds=seconds, maxrss=usage.ru_maxrss * 1024, **peak)  # Linux: ru_maxrss in KiB


def report(label: str, size: int, m: dict) -> None:
    print(f"{label}: {m['seconds']:.1f} s, peak RSS {m['maxrss'] / GiB:.2f} GiB (ru_maxrss) = "
          f"{m['maxrss'] / size:.2f}x the "
          f"checkpoint; sampled peaks: RSS {m['VmRSS'] / GiB:.2f}, anonymous {m['RssAnon'] / GiB:.2f}, "
          f"file-backed {m['RssFile'] / GiB:.2f} GiB", flush=True)


def bench(size: float = 1.0, out_dir: Optional[Path] = None, keep: bool = False, export: bool = True) -> None:
    """Measure the peak memory of converting a random `size`-billion-parameter bf16 checkpoint.

    Args:
        size: Parameters of the generated Llama-shaped checkpoint, in billions.
        out_dir: Where to write the checkpoint (needs 3x the checkpoint size free, 2x with --export false). Default: a
            temp folder.
        keep: Keep the generated files.
        export: Also measure the way back (scripts/convert_lit_checkpoint.py).
    """
    work = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="bench_convert_"))
    ckpt = work / "hf"
    ckpt.mkdir(parents=True, exist_ok=True)
    try:
        cfg = llama_like(size)
        (ckpt / "config.json").write_text(json.dumps(cfg, indent=2))
        specs = hf_specs(cfg)
        n_params = sum(s.numel() for _, s, _ in specs)
        t0 = time.perf_counter()
        write_safetensors_stream(ckpt / "model.safetensors", specs, random_tensors(specs))
        disk = (ckpt / "model.safetensors").stat().st_size
        print(f"checkpoint: {n_params / 1e9:.2f}B parameters, {cfg['num_hidden_layers']} layers, bf16, "
              f"{disk / GiB:.2f} GiB on disk in {ckpt} (written in {time.perf_counter() - t0:.1f} s)", flush=True)

        m = measure([sys.executable, str(ROOT / "scripts/convert_hf_checkpoint.py"), "--checkpoint_dir", str(ckpt)])
        report("convert_hf_checkpoint", disk, m)
        if export:
            m = measure([sys.executable, str(ROOT / "scripts/convert_lit_checkpoint.py"), "--checkpoint_dir", str(ckpt),
                         "--out_dir", str(work / "export")])
            report("convert_lit_checkpoint", disk, m)
    finally:
        if not keep:
            shutil.rmtree(work if not out_dir else ckpt, ignore_errors=True)
            if out_dir:
                shutil.rmtree(work / "export", ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    run_cli(bench)
