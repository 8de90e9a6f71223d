"""--precision auto: the decision under every kind of machine (capabilities faked), and the warning for a 16-bit
precision on a CPU that has no native support for it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lit_qlora.precision as precision
from lit_qlora.precision import resolve_precision, slow_precision_warning
from lit_qlora.utils import UserError

AVX2 = {"fpu", "sse2", "avx", "avx2", "fma"}
AVX512_NO_BF16 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


@pytest.mark.parametrize("machine,flags,cuda,cuda_bf16,expected", [
    ("AVX2 CPU", AVX2, False, False, "32-true"),
    ("AVX512 CPU without BF16", AVX512_NO_BF16, False, False, "32-true"),
    ("AVX512-BF16 CPU", AVX512_NO_BF16 | {"avx512_bf16"}, False, False, "bf16-true"),
    ("AMX CPU", AVX512_NO_BF16 | {"amx_bf16", "amx_tile"}, False, False, "bf16-true"),
    ("no /proc/cpuinfo", set(), False, False, "32-true"),
    ("GPU with bf16", AVX2, True, True, "bf16-true"),
    ("GPU without bf16", AVX2, True, False, "16-mixed"),
])
def test_auto_precision_under_faked_capabilities(monkeypatch, machine, flags, cuda, cuda_bf16, expected):
    monkeypatch.setattr(precision, "cpu_flags", lambda: set(flags))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: cuda_bf16)
    device_type = precision.resolve_accelerator("auto")  # what finetune and generate resolve once per run
    resolved, why = resolve_precision("auto", device_type)
    assert device_type == ("cuda" if cuda else "cpu")
    assert resolved == expected and why.startswith("auto: "), (machine, resolved, why)
    assert resolve_precision("bf16-true", "cpu") == ("bf16-true", "")  # explicit values are kept
    assert [precision.resolve_accelerator(a) for a in ("cpu", "cuda")] == ["cpu", "cuda"]  # cuda: planned for
    with pytest.raises(UserError, match="unknown --accelerator 'gpu'; choose one of auto, cpu, cuda"):
        precision.resolve_accelerator("gpu")


def test_cpu_flags_are_read_from_cpuinfo():
    flags = precision.cpu_flags()
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        assert flags == set()
        return
    line = next(ln for ln in text.splitlines() if ln.startswith("flags"))
    assert flags == set(line.split(":", 1)[1].split()) and flags


@pytest.mark.parametrize("native", [False, True])
def test_a_16_bit_precision_without_native_support_is_warned_about(monkeypatch, native):
    monkeypatch.setattr(precision, "cpu_flags", lambda: AVX2 | ({"avx512_bf16"} if native else set()))
    warning = slow_precision_warning("bf16-true", "cpu")
    assert (warning is None) == native
    if warning:
        assert warning.startswith("warning: --precision bf16-true") and "32-true" in warning and "\n" not in warning
        assert "fp32 kernels" in warning  # bf16-true's matmuls run by fp32 kernels there (kernels/cpu_half.py)
    mixed = slow_precision_warning("bf16-mixed", "cpu")
    assert (mixed is None) == native and (native or "several times slower" in mixed)  # autocast's own kernels
    assert slow_precision_warning("16-mixed", "cpu") is not None  # no CPU computes fp16 natively here
    assert slow_precision_warning("32-true", "cpu") is None and slow_precision_warning("bf16-true", "cuda") is None


CAPS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
GROWTH = """
import sys, torch
if sys.argv[1] == "bounded":
    from lit_qlora.precision import bound_cpu_matmul_caches
    bound_cpu_matmul_caches()
torch.set_num_threads(1)
w = torch.randn(1536, 576, dtype=torch.bfloat16, requires_grad=True)
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
x = torch.randn(100, 576, dtype=torch.bfloat16, requires_grad=True)
(x @ w.t()).sum().backward()
start = rss()
for rows in range(101, 301):  # a training run's batches: a new number of rows each time
    x = torch.randn(rows, 576, dtype=torch.bfloat16, requires_grad=True)
    (x @ w.t()).sum().backward()
print(rss() - start)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_bf16_matmuls_of_new_shapes_stop_accumulating_memory():
    """200 bf16 matmul shapes (forward and backward): where oneDNN prepares them (AVX512 CPUs) torch keeps every one
    (~2 MB each, 1024 kept); after `bound_cpu_matmul_caches` (what finetune and generate call first) only the last
    64. Each side in a fresh process without the two variables, as a user's run starts."""
    env = {k: v for k, v in os.environ.items() if k not in CAPS}
    growth = {}
    for side in ("default", "bounded"):
        r = subprocess.run([sys.executable, "-c", GROWTH, side], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        growth[side] = float(r.stdout.split()[-1])
    if growth["default"] < 150:
        pytest.skip(f"this CPU's bf16 matmuls keep no per-shape state ({growth['default']:.0f} MiB over 200 shapes)")
    assert growth["bounded"] < growth["default"] / 2, growth


def test_a_cache_capacity_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    precision.bound_cpu_matmul_caches()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"
    assert os.environ["LRU_CACHE_CAPACITY"] == str(precision.CPU_MATMUL_CACHE)


@pytest.mark.parametrize("script", ["finetune/lora.py", "generate/base.py", "generate/lora.py", "generate/chat.py"])
def test_every_cli_bounds_the_caches_before_its_first_matmul(script, tmp_path):
    """Each script, as a user runs it (here on a missing checkpoint, so it stops at its first check with exit 2), has
    set both capacities by then: nothing before that point runs a matmul."""
    env = {k: v for k, v in os.environ.items() if k not in CAPS}
    root = Path(__file__).resolve().parents[1]
    argv = [script, "--checkpoint_dir", str(tmp_path / "missing")]
    if script == "generate/lora.py":  # it checks for an adapter first
        argv += ["--lora_path", str(tmp_path / "missing.pth")]
    code = ("import os, runpy, sys\n"
            f"sys.argv = {argv!r}\n"
            "try:\n"
            f"    runpy.run_path({str(root / script)!r}, run_name='__main__')\n"
            "finally:\n"
            f"    print('CAPS', *(os.environ.get(k) for k in {CAPS!r}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    cap = str(precision.CPU_MATMUL_CACHE)
    assert f"CAPS {cap} {cap}" in r.stdout, (r.stdout, r.stderr[-2000:])
