"""Benchmark generate/serve.py (prints figures; not a test): requests/s and time to first token for 1, 4 and 16
concurrent streaming clients over two adapters, and the server's memory with 1 and with 8 adapters.

    python scripts/bench/bench_serve.py                       # SmolLM2-135M's shape, random weights, bnb.nf4
    python scripts/bench/bench_serve.py --clients 1,4 --requests_per_level 8 --max_tokens 16
    python scripts/bench/bench_serve.py --clients ""          # memory with 0 / 1 / 8 adapters only

A random-weight checkpoint of the model's shape is written once (with a made-up byte-level tokenizer of the model's
vocabulary size and a ChatML template), and 8 random adapters on every target (r 8). Each server is a subprocess of
generate/serve.py on a free 127.0.0.1 port; clients are threads of the official `openai` client. Requests are spread
evenly over the levels' clients and alternate between the two adapters. Time to first token: from sending the
request to its first content chunk, queueing included (the server serves one request at a time). Memory: the
server's resident set (VmRSS) once loaded, and again after every adapter served a request (RSS moves with the
allocator: tests/test_serve.py checks the bytes an adapter holds exactly, from the tensor storage).
"""
from __future__ import annotations

import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lit_qlora.checkpoint import LIT_WEIGHTS  # noqa: E402
from lit_qlora.config import Config  # noqa: E402
from lit_qlora.convert import write_random_checkpoint  # noqa: E402
from lit_qlora.utils import run_cli  # noqa: E402

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def cpu_description() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
        isa = "AVX512-BF16" if "avx512_bf16" in flags else "AVX512F" if "avx512f" in flags else \
            "AVX2" if "avx2" in flags else "no AVX2"
        name += f", {isa}"
    except (OSError, StopIteration):
        pass
    return f"{name}, {torch.get_num_threads()} threads"


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of exactly `vocab_size` ids: the specials, the 256 byte symbols, then made-up
    words (never produced by encoding, which has no merges, but decoded to text when a random model samples them)."""
    import tokenizers

    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    i = 0
    while len(vocab) < vocab_size:
        vocab[f"Ġw{i}"] = len(vocab)
        i += 1
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
         "chat_template": CHATML, "model_max_length": 8192}))


def write_adapters(folder: Path, count: int) -> list[Path]:
    """`count` adapters on every target (r 8, alpha 16), A as initialized, B random."""
    from lit_qlora.adapter import Adapter
    from lit_qlora.loader import load_model
    from lit_qlora.lora import LoRAConfig, lora_modules

    paths = [folder / f"adapter{i}.pth" for i in range(count)]
    if all(p.is_file() for p in paths):
        return paths
    lora = LoRAConfig(r=8, alpha=16, dropout=0.0, query=True, key=True, value=True, projection=True, mlp=True)
    model = load_model(folder, precision="32-true", lora=lora, seed=1)
    for i, path in enumerate(paths):
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for m in lora_modules(model).values():
                m.lora_B.copy_(0.02 * torch.randn(m.lora_B.shape, generator=g))
        Adapter.of_model(model, lora, train={"template": "chat"}).save(path)
    return paths


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder: Path, adapters: list[Path], quantize: str, precision: str) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    args = [sys.executable, str(ROOT / "generate" / "serve.py"), "--checkpoint_dir", str(folder), "--quantize",
            quantize, "--precision", precision, "--port", str(port), "--model_name", "base"]
    for i, path in enumerate(adapters):
        args += ["--lora_path", f"a{i}={path}"]
    log = tempfile.TemporaryFile(mode="w+")
    # this checkout's lit_qlora in the server too (an installed one elsewhere would otherwise win there)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    proc.log = log
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"the server failed:\n{log.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start in 300 s")


def stop_server(proc: subprocess.Popen) -> str:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
    proc.log.seek(0)
    return proc.log.read()


def rss_gb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def one_request(client, model: str, max_tokens: int) -> tuple[float, float, int]:
    """(time to first content chunk, total time, completion tokens) of one streaming chat request."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Write a story."}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    total = time.perf_counter() - t0
    return (first if first is not None else total), total, tokens


def level(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    per_client = [requests // clients + (i < requests % clients) for i in range(clients)]
    results: list[tuple[float, float, int]] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        for j in range(per_client[i]):
            r = one_request(client, f"a{(i + j) % 2}", max_tokens)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = sorted(r[0] for r in results)
    return dict(clients=clients, requests=len(results), wall_s=wall, rps=len(results) / wall,
                tokens_per_s=sum(r[2] for r in results) / wall, ttft_median=statistics.median(ttft),
                ttft_max=ttft[-1], latency_median=statistics.median(r[1] for r in results))


def main(model: str = "SmolLM2-135M", quantize: str = "bnb.nf4", precision: str = "auto", clients: str = "1,4,16",
         requests_per_level: int = 16, max_tokens: int = 32, out_dir: str = "") -> None:
    """Write the model and adapters (once, in `out_dir`), then measure (see the module docstring)."""
    config = Config.from_name(model)
    folder = Path(out_dir or Path(tempfile.gettempdir()) / f"bench-serve-{model}")
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / LIT_WEIGHTS).is_file():
        write_random_checkpoint(folder, config)
    if not (folder / "tokenizer.json").is_file():
        write_tokenizer(folder, config.vocab_size)
    adapters = write_adapters(folder, 8)
    print(f"model: {config.name} shape, random weights, {quantize}, --precision {precision}; streaming chat requests "
          f"of {max_tokens} new tokens (greedy), alternating over 2 adapters (r 8 on every target), served in turn\n"
          f"CPU: {cpu_description()} (shared machine: figures are noisy)")

    rows = []
    if clients:  # --clients "": memory only (the figures that are worth taking on a busy machine)
        proc, url = start_server(folder, adapters[:2], quantize, precision)
        try:
            level(url, 1, 2, 4)  # warm-up: the kernel, the first shapes
            rows = [level(url, int(c), requests_per_level, max_tokens) for c in clients.split(",")]
        finally:
            log = stop_server(proc)
    if rows:
        print("\n| clients | requests | requests/s | tokens/s | TTFT median s | TTFT max s | latency median s |")
        print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['requests']} | {r['rps']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{r['ttft_median']:.2f} | {r['ttft_max']:.2f} | {r['latency_median']:.2f} |")

    mem = {}
    for n in (0, 1, 8):
        proc, url = start_server(folder, adapters[:n], quantize, precision)
        mem[f"loaded{n}"] = rss_gb(proc.pid)  # before any request
        try:
            import openai

            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
            for name in ["base"] + [f"a{i}" for i in range(n)]:  # every adapter's decode path used once
                one_request(client, name, 4)
            mem[n] = rss_gb(proc.pid)
        finally:
            log = stop_server(proc)
        if n:
            size = [ln for ln in log.splitlines() if ln.startswith("Adapter a0:")]
            mem["adapter_line"] = size[0] if size else "?"
            loaded = [ln for ln in log.splitlines() if ln.startswith("Loaded")]
            mem["loaded_line"] = loaded[0] if loaded else "?"
    per = (mem[8] - mem[1]) / 7 * 1024
    own = re.search(r"\(([0-9.]+) MiB", mem["adapter_line"])

    def ratio(mib: float) -> str:
        return f" = {mib / float(own.group(1)):.2f}x its tensors" if own else ""

    loaded = (mem["loaded8"] - mem["loaded1"]) / 7 * 1024
    print(f"\nserver RSS once loaded (no request yet): base only {mem['loaded0']:.3f} GB, 1 adapter "
          f"{mem['loaded1']:.3f} GB, 8 adapters {mem['loaded8']:.3f} GB: {loaded:.1f} MiB per extra adapter"
          f"{ratio(loaded)}")
    print(f"server RSS after every adapter served a request: base only {mem[0]:.3f} GB, 1 adapter {mem[1]:.3f} GB, "
          f"8 adapters {mem[8]:.3f} GB: "
          f"{per:.1f} MiB per extra adapter{ratio(per)}; {mem['adapter_line']}\nserver: {mem['loaded_line']}")


if __name__ == "__main__":
    run_cli(main)
