"""Benchmark: peak memory of converting and loading a gpt-oss checkpoint whose experts are MXFP4, as published.

    python scripts/bench/bench_gptoss_load.py [--out_dir /tmp/bench_gptoss] [--keep true] [--n_layer 8] [--n_expert 32]
                                        [--hidden 1024]

Writes a random gpt-oss folder in the published layout (config.json with quantization_config mxfp4;
model.safetensors with `mlp.experts.gate_up_proj_blocks` / `_scales`, `down_proj_*`, everything else bf16), one
tensor at a time. Then, each in a fresh child process: the conversion to our checkpoint (which keeps the MXFP4
bytes), and `load_model(..., precision="bf16-true", quantize=q)` for q in none (dense bf16 experts, dequantized an
expert at a time), bnb.nf4, bnb.nf4-dq, bnb.int8. Prints figures only (not a test).

What it shows: the experts are never whole in full precision while loading (peak RSS of a quantized load ~ the
model it ends with + one expert's bf16 [out, in], not + the bf16 size of the experts), and the converted file is as
small as the published one. Peak RSS is the child's ru_maxrss (see scripts/bench/bench_load_memory.py for why children).
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
from typing import Optional

GB = 1e9
SETTINGS = ["none", "bnb.nf4", "bnb.nf4-dq", "bnb.int8"]
UNCONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def hf_config(n_layer: int, n_expert: int, hidden: int, vocab: int) -> dict:
    """gpt-oss-20b's config.json fields, at another size."""
    return dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", attention_bias=True, head_dim=64,
                hidden_size=hidden, intermediate_size=hidden, num_attention_heads=hidden // 64,
                num_key_value_heads=min(8, hidden // 64),
                num_hidden_layers=n_layer, num_local_experts=n_expert, num_experts_per_tok=4, vocab_size=vocab,
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)],
                sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5, swiglu_limit=7.0,
                rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                  original_max_position_embeddings=4096), rope_theta=150000,
                tie_word_embeddings=False, router_aux_loss_coef=0.9,
                quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": UNCONVERTED})


def write_folder(folder: Path, n_layer: int, n_expert: int, hidden: int) -> None:
    """The published layout with random weights, tensor by tensor (child process)."""
    import torch

    from lit_qlora.checkpoint import write_safetensors_stream

    cfg = hf_config(n_layer, n_expert, hidden, vocab=32000)
    H, G, hs, E, C = cfg["num_attention_heads"], cfg["num_key_value_heads"], 64, n_expert, hidden
    specs = [("model.embed_tokens.weight", (32000, C), torch.bfloat16)]
    for i in range(n_layer):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (C,), torch.bfloat16),
                  (p + "post_attention_layernorm.weight", (C,), torch.bfloat16)]
        for name, rows in (("q_proj", H * hs), ("k_proj", G * hs), ("v_proj", G * hs)):
            specs += [(p + f"self_attn.{name}.weight", (rows, C), torch.bfloat16),
                      (p + f"self_attn.{name}.bias", (rows,), torch.bfloat16)]
        specs += [(p + "self_attn.o_proj.weight", (C, H * hs), torch.bfloat16),
                  (p + "self_attn.o_proj.bias", (C,), torch.bfloat16), (p + "self_attn.sinks", (H,), torch.bfloat16),
                  (p + "mlp.router.weight", (E, C), torch.bfloat16), (p + "mlp.router.bias", (E,), torch.bfloat16)]
        for name, rows, cols in (("gate_up_proj", 2 * C, C), ("down_proj", C, C)):
            specs += [(p + f"mlp.experts.{name}_blocks", (E, rows, cols // 32, 16), torch.uint8),
                      (p + f"mlp.experts.{name}_scales", (E, rows, cols // 32), torch.uint8),
                      (p + f"mlp.experts.{name}_bias", (E, rows), torch.bfloat16)]
    specs += [("model.norm.weight", (C,), torch.bfloat16), ("lm_head.weight", (32000, C), torch.bfloat16)]
    gen = torch.Generator().manual_seed(0)

    def tensors():
        for name, shape, dtype in specs:
            if name.endswith("_blocks"):
                yield name, torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
            elif name.endswith("_scales"):
                yield name, torch.randint(118, 122, shape, generator=gen, dtype=torch.uint8)
            elif "norm" in name:
                yield name, torch.ones(shape, dtype=dtype)
            else:
                yield name, (0.02 * torch.randn(shape, generator=gen)).to(dtype)

    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors_stream(folder / "model.safetensors", [(n, torch.Size(s), d) for n, s, d in specs], tensors())
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def child(folder: str, what: str) -> None:
    """Fresh process: convert, or load with --quantize `what`; one JSON line of figures."""
    from lit_qlora.quant.quantize import memory_report, quiet_bnb_import

    if what == "convert":
        from lit_qlora.convert import convert_hf_checkpoint

        t0 = time.perf_counter()
        convert_hf_checkpoint(Path(folder))
        print(json.dumps(dict(seconds=time.perf_counter() - t0, peak=peak())))
        return
    from lit_qlora.loader import load_model

    if what != "none":
        quiet_bnb_import()
    t0 = time.perf_counter()
    model = load_model(Path(folder), precision="bf16-true", quantize=None if what == "none" else what)
    r = memory_report(model)
    print(json.dumps(dict(seconds=time.perf_counter() - t0, peak=peak(),
                          model_bytes=r["quantized_bytes"] + r["dense_bytes"])))


def run_child(folder: Path, what: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    proc = subprocess.run([sys.executable, __file__, "_child", str(folder), what], capture_output=True, text=True,
                          env=env)
    if proc.returncode:
        sys.exit(f"{what} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench(out_dir: Optional[Path] = None, keep: bool = False, n_layer: int = 8, n_expert: int = 32,
          hidden: int = 1024) -> None:
    """Convert and load a random MXFP4 gpt-oss; print sizes and peak RSS.

    Args:
        out_dir: Where to write the folder. Default: a temporary folder.
        keep: Keep the folder (and reuse it on the next run with the same --out_dir).
        n_layer: Layers (gpt-oss-20b: 24).
        n_expert: Experts per layer, 4 active (gpt-oss-20b: 32).
        hidden: Hidden size = expert width, a multiple of 64 (gpt-oss-20b: 2880).
    """
    work = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="bench_gptoss_"))
    folder = work / f"gpt-oss-{n_layer}x{n_expert}x{hidden}"
    try:
        if not (folder / "model.safetensors").is_file():
            subprocess.run([sys.executable, __file__, "_write", str(folder), str(n_layer), str(n_expert),
                            str(hidden)], check=True)
        expert_params = n_layer * n_expert * 3 * hidden * hidden
        src = (folder / "model.safetensors").stat().st_size
        print(f"{folder.name}: {expert_params / 1e9:.2f}B expert parameters (MXFP4 in the file: "
              f"{src / GB:.2f} GB in all; the experts alone would be {2 * expert_params / GB:.2f} GB in bf16)")
        for f in ("lit_model.safetensors", "model_config.json"):
            (folder / f).unlink(missing_ok=True)
        conv = run_child(folder, "convert")
        ours = (folder / "lit_model.safetensors").stat().st_size
        print(f"| step | s | peak RSS GB | model tensors GB |\n|---|---|---|---|\n"
              f"| convert (ours {ours / GB:.2f} GB on disk) | {conv['seconds']:.1f} | {conv['peak'] / GB:.2f} | - |")
        for q in SETTINGS:
            m = run_child(folder, q)
            print(f"| load --quantize {q} (bf16-true) | {m['seconds']:.1f} | {m['peak'] / GB:.2f} | "
                  f"{m['model_bytes'] / GB:.2f} |", flush=True)
    finally:
        if not keep:
            shutil.rmtree(folder if out_dir else work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "_child":
        child(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 6 and sys.argv[1] == "_write":
        write_folder(Path(sys.argv[2]), *map(int, sys.argv[3:]))
    else:
        from lit_qlora.utils import run_cli

        run_cli(bench)
