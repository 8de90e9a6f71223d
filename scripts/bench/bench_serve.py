"""Benchmark generate/serve.py (prints figures; not a test): tokens/s, requests/s and time to first token for 1, 4
and 16 concurrent streaming clients, over the base alone and over two adapters (requests alternating); a load test
of 64 clients; and the server's memory with 1 and with 8 adapters.

    python scripts/bench/bench_serve.py                       # SmolLM2-135M's shape, random weights, bnb.nf4
    python scripts/bench/bench_serve.py --clients 1,4 --requests_per_level 8 --max_tokens 16
    python scripts/bench/bench_serve.py --clients "" --load_clients 0   # memory with 0 / 1 / 8 adapters only
    python scripts/bench/bench_serve.py --model gemma-3-270m --memory false

Load test (`--load_clients`, bounded by `--load_s`): that many threads, each sending in turn a streamed chat
request, a non-streamed completion with n 2, a stream it hangs up on after two chunks, and a malformed request (bad
JSON, an unknown model, n 100, max_tokens -1, or a prompt over the context), over the base and two adapters. The
server must stay up and answer no 5xx; its resident memory is sampled against what it held once loaded plus the KV
budget it printed.

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


def start_server(folder: Path, adapters: list[Path], quantize: str, precision: str,
                 extra: tuple = ()) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    args = [sys.executable, str(ROOT / "generate" / "serve.py"), "--checkpoint_dir", str(folder), "--quantize",
            quantize, "--precision", precision, "--port", str(port), "--model_name", "base", *extra]
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


def level(url: str, clients: int, requests: int, max_tokens: int, models: list[str]) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    per_client = [requests // clients + (i < requests % clients) for i in range(clients)]
    results: list[tuple[float, float, int]] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        for j in range(per_client[i]):
            r = one_request(client, models[(i + j) % len(models)], max_tokens)
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
                ttft_p95=ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))], ttft_max=ttft[-1],
                latency_median=statistics.median(r[1] for r in results))


def load_test(url: str, pid: int, clients: int, seconds: float, max_tokens: int) -> dict:
    """`clients` threads for `seconds`, each sending in turn the four kinds of request of the module docstring;
    (status counts, transport errors, peak RSS GB sampled every 0.2 s)."""
    import httpx

    bodies = {"chat": lambda m: {"model": m, "messages": [{"role": "user", "content": "Write a story."}],
                                 "max_tokens": max_tokens, "stream": True},
              "completion": lambda m: {"model": m, "prompt": "Once upon a time", "max_tokens": max_tokens, "n": 2},
              "hangup": lambda m: {"model": m, "prompt": "Tell me", "max_tokens": max_tokens * 4, "stream": True}}
    bad = [b"{not json", json.dumps({"model": "nobody", "prompt": "x"}).encode(),
           json.dumps({"model": "base", "prompt": "x", "n": 100}).encode(),
           json.dumps({"model": "base", "prompt": "x", "max_tokens": -1}).encode(),
           json.dumps({"model": "base", "prompt": "word " * 20000, "max_tokens": 8}).encode()]
    codes: dict[str, int] = {}
    errors, peak, stop = [0], [rss_gb(pid)], time.monotonic() + seconds
    lock = threading.Lock()

    def count(key: str) -> None:
        with lock:
            codes[key] = codes.get(key, 0) + 1

    def run(i: int) -> None:
        http = httpx.Client(base_url=url, timeout=300)
        k = i
        while time.monotonic() < stop:
            kind, model = ("chat", "completion", "hangup", "bad")[k % 4], ("base", "a0", "a1")[k % 3]
            k += 1
            try:
                if kind == "bad":
                    r = http.post("/v1/completions", content=bad[k % len(bad)],
                                  headers={"content-type": "application/json"})
                    count(f"{r.status_code}")
                    continue
                with http.stream("POST", "/v1/chat/completions" if kind == "chat" else "/v1/completions",
                                 json=bodies[kind](model)) as r:
                    for j, _ in enumerate(r.iter_lines()):
                        if kind == "hangup" and j >= 2:
                            break
                    count(f"{r.status_code}")
            except httpx.TransportError:
                with lock:
                    errors[0] += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak[0] = max(peak[0], rss_gb(pid))
        time.sleep(0.2)
    return dict(codes=codes, transport_errors=errors[0], peak_rss_gb=peak[0])


def main(model: str = "SmolLM2-135M", quantize: str = "bnb.nf4", precision: str = "auto", clients: str = "1,4,16",
         requests_per_level: int = 32, max_tokens: int = 64, out_dir: str = "", load_clients: int = 64,
         load_s: float = 60.0, memory: bool = True, kv_cache_gb: float = 1.0) -> None:
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
          f"of {max_tokens} new tokens (greedy), {requests_per_level} per level, over the base alone and over 2 "
          f"adapters (r 8 on every target, requests alternating)\nCPU: {cpu_description()}")
    extra = ["--kv_cache_gb", str(kv_cache_gb)]
    rows = []
    if clients or load_clients:
        proc, url = start_server(folder, adapters[:2], quantize, precision, extra)
        try:
            level(url, 1, 2, 4, ["base", "a0"])  # warm-up: the kernel, the first shapes
            for served, models in (("base", ["base"]), ("2 adapters", ["a0", "a1"])):
                for c in clients.split(",") if clients else []:
                    rows.append(dict(level(url, int(c), requests_per_level, max_tokens, models), served=served))
            loaded = rss_gb(proc.pid)
            load = load_test(url, proc.pid, load_clients, load_s, max_tokens) if load_clients else None
            health = json.loads(__import__("httpx").get(url + "/health").text)
        finally:
            log = stop_server(proc)
        kv_line = next((ln for ln in log.splitlines() if ln.startswith("KV cache:")), "")
    if rows:
        print("\n| served | clients | requests | requests/s | tokens/s | x 1 client | TTFT median s | TTFT p95 s | "
              "latency median s |")
        print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        one = next(x for x in rows if x["served"] == r["served"])["tokens_per_s"]
        print(f"| {r['served']} | {r['clients']} | {r['requests']} | {r['rps']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / one:.2f}x | {r['ttft_median']:.2f} | {r['ttft_p95']:.2f} | "
              f"{r['latency_median']:.2f} |")
    if load_clients:
        fivexx = sum(n for code, n in load["codes"].items() if code.startswith("5"))
        print(f"\nload test: {load_clients} clients for {load_s:g} s: answers {load['codes']}, {fivexx} 5xx, "
              f"{load['transport_errors']} transport errors (hang-ups are ours); server up after: "
              f"{health['status']}, in flight {health['in_flight']}; RSS loaded {loaded:.2f} GB, peak under load "
              f"{load['peak_rss_gb']:.2f} GB (+{load['peak_rss_gb'] - loaded:.2f}); {kv_line}")
    if not memory:
        return

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
