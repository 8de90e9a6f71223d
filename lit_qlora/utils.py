"""Small helpers shared by the scripts: the user-error path, atomic writes, memory figures."""
from __future__ import annotations

import errno
import functools
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch


class UserError(Exception):
    """A problem with the user's input. The CLI prints it as one line and exits with code 2.

    Message convention: "<what is wrong>; <how to fix it>".
    """


def debug_enabled() -> bool:
    return os.environ.get("LIT_QLORA_DEBUG", "") not in ("", "0") or "--debug" in sys.argv


def run_main(main: Callable[[], Any]) -> Any:
    """Run a script's `main()`: user errors become one line `error: ...` and exit code 2.

    `--debug` (or LIT_QLORA_DEBUG=1) shows the traceback of user errors too. Unexpected errors always keep their
    traceback: they are our bugs, not the user's.
    """
    if "--debug" in sys.argv:
        sys.argv.remove("--debug")
        os.environ["LIT_QLORA_DEBUG"] = "1"
    try:
        return main()
    except UserError as e:
        if debug_enabled():
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        if e.errno != errno.ENAMETOOLONG:  # a path too long to look up is always one a user gave (a flag, a file)
            raise
        if debug_enabled():
            traceback.print_exc()
        name = str(e.filename)
        print(f"error: {name[:60] + '...' if len(name) > 60 else name} is too long a path for the file system "
              f"({len(name)} characters); fix the path (a damaged --config file?)", file=sys.stderr)
        sys.exit(2)


def run_cli(fn: Callable, **kwargs: Any) -> Any:
    """Run `fn` as a jsonargparse CLI built from its typed signature (`--help`, `--config`, `--print_config`), with
    `run_main`'s handling of user errors."""
    from jsonargparse import CLI  # here, not at the top: the package's library users never need it

    return run_main(lambda: CLI(fn, as_positional=False, **kwargs))


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write `path` via a temp file in the same folder, fsync, then rename.

    A process killed at any moment leaves either the old file or the new one, never a torn one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        write(tmp)
        # mkstemp's file is private (0600); the final one gets what any new file gets (0644 under the usual umask),
        # so a checkpoint folder shared by a team, or a model file read by another program, stays readable
        tmp.chmod(0o666 & ~_umask())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if tmp.exists():
            tmp.unlink()


def _umask() -> int:
    """This process's umask, read where Linux shows it (setting it to read it back races with other threads creating
    files); elsewhere set and restored."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0o022)
        os.umask(umask)
        return umask


def atomic_torch_save(obj: Any, path: Path) -> None:
    atomic_write(path, lambda p: torch.save(obj, p))


def peak_rss_gb() -> float:
    """Peak resident set size of this process in GiB (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def memory_used_gb(device: torch.device | str = "cpu") -> float:
    """What the scripts report as `Memory used`: CUDA max allocated, or peak RSS on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return peak_rss_gb()


@functools.lru_cache(maxsize=None)
def _libc():
    """glibc through ctypes (loaded once), or None where there is none (not Linux, or another C library)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def tune_cpu_allocator(mmap_threshold: int = 32 << 20) -> bool:
    """Serve allocations below `mmap_threshold` bytes from the heap, and keep up to twice that free at its top
    (glibc only).

    A freshly mmapped block costs a page fault per 4 KiB page on first touch, and a training step allocates its
    large temporaries (dequantized weights, MLP intermediates, gradients) anew every time: with a 4 MiB threshold,
    an fp32 elementwise op on a [1000, 2816] tensor took 4.7 ms instead of 1.2, and a 1000-token step of the
    221M harness model ran at 145-155 instead of 163 tokens/s (tutorials/performance.md, round 6). 32 MiB is the
    ceiling glibc's own adaptive threshold climbs to; fixing it (and the matching trim threshold) from the first
    step makes the behaviour the same from run to run. Only larger blocks (the logits of a long micro batch) are
    mmapped. Returns whether the settings were applied.
    """
    libc = _libc()
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)) and
                libc.mallopt(M_TRIM_THRESHOLD, 2 * int(mmap_threshold)))


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim, ~1 ms; a no-op elsewhere).

    Quantizing layer after layer leaves freed read buffers and temporaries (a few to tens of MB each: under glibc's
    adaptive mmap threshold, so on the heap) in holes between the long-lived quantized tensors, and glibc keeps such
    holes resident (a 1.1B nf4-dq model ended at about 3x its tensors' size before this: tutorials/quantize.md)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def repeatable(argv: list[str], option: str) -> list[str]:
    """`--lora_path A --lora_path B` as jsonargparse appends to a list (`--lora_path+ A --lora_path+ B`)."""
    out = []
    for arg in argv:
        if arg == option:
            arg = option + "+"
        elif arg.startswith(option + "="):
            arg = option + "+=" + arg[len(option) + 1:]
        out.append(arg)
    return out
