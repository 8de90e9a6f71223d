"""--precision auto: the decision under every kind of machine (capabilities faked), and the warning for a 16-bit
precision on a CPU that has no native support for it."""
from __future__ import annotations

import pytest
import torch

import lit_qlora.precision as precision
from lit_qlora.precision import resolve_precision, slow_precision_warning

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
    resolved, why = resolve_precision("auto", "cuda" if cuda else "cpu")
    assert resolved == expected and why.startswith("auto: "), (machine, resolved, why)
    assert resolve_precision("bf16-true", "cpu") == ("bf16-true", "")  # explicit values are kept


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
        assert "fp32 kernels" in warning  # bf16-true's matmuls run by fp32 kernels there (lit_qlora/cpu_half.py)
    mixed = slow_precision_warning("bf16-mixed", "cpu")
    assert (mixed is None) == native and (native or "several times slower" in mixed)  # autocast's own kernels
    assert slow_precision_warning("16-mixed", "cpu") is not None  # no CPU computes fp16 natively here
    assert slow_precision_warning("32-true", "cpu") is None and slow_precision_warning("bf16-true", "cuda") is None
