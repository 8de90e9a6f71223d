"""generate/serve.py: a real uvicorn server (a subprocess of the script, on a free 127.0.0.1 port) serving a tiny
4-bit model and three adapters, called with the official `openai` client and raw HTTP.

The model: a tiny random Llama with a Gemma-style chat tokenizer (its template refuses a system message). Adapter
"alpha" (q, v, r 4) renders with the checkpoint's template; adapter "beta" (projection and MLP, r 8) recorded a
ChatML template, which takes a system message; adapter "gamma" is a DoRA + rsLoRA adapter (q, v, MLP). The base and
each adapter must give the greedy text generate/base.py / generate/lora.py --merge false give for the same prompt
(same 4-bit kernel path, unmerged).
"""
from __future__ import annotations

import gc
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from helpers import make_tiny_hf_model  # noqa: E402
from helpers_chat import load_template, make_chat_checkpoint  # noqa: E402

from lit_qlora.adapter import Adapter  # noqa: E402
from lit_qlora.convert import convert_hf_checkpoint  # noqa: E402
from lit_qlora.loader import load_model  # noqa: E402
from lit_qlora.lora import LoRAConfig, lora_modules  # noqa: E402
from lit_qlora.tokenizer import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key"
FLAGS = ["--quantize", "bnb.nf4", "--precision", "32-true"]
PROMPT = "Tell me a joke about robots"


def _adapter(folder: Path, path: Path, lora: LoRAConfig, seed: int, train: dict, quantize=None) -> None:
    model = load_model(folder, precision="32-true", lora=lora, seed=seed, quantize=quantize)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():  # strong enough to change the greedy text
            m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) * 0.5)
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.5)
            if m.dora:  # magnitudes away from the row norms, some rows halved, some doubled
                m.lora_magnitude.mul_(torch.rand(m.lora_magnitude.shape, generator=g) * 1.5 + 0.5)
    Adapter.of_model(model, lora, train=dict(train, quantize=quantize, quantize_lm_head=False, precision="32-true")
                     ).save(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(folder: Path, adapters: dict, *extra: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    args = [sys.executable, str(ROOT / "generate" / "serve.py"), "--checkpoint_dir", str(folder), *FLAGS,
            "--port", str(port), "--model_name", "base", *extra]
    for name, path in adapters.items():
        args += ["--lora_path", f"{name}={path}"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):  # bounded: 120 s
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("the server did not answer /health in 120 s")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve") / "tiny-chat"
    make_chat_checkpoint("gemma", folder, load_template("gemma_it"))
    tok = Tokenizer(folder)
    make_tiny_hf_model("llama", folder, vocab_size=tok.vocab_size, initializer_range=0.2,
                       bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    convert_hf_checkpoint(folder)
    adapters = {n: folder.parent / f"{n}.pth" for n in ("alpha", "beta", "gamma")}
    _adapter(folder, adapters["alpha"], LoRAConfig(r=4, alpha=8, dropout=0.0, query=True, value=True), 1,
             {"template": "chat"})
    _adapter(folder, adapters["beta"], LoRAConfig(r=8, alpha=16, dropout=0.0, query=False, value=False,
                                                  projection=True, mlp=True), 2,
             {"template": "chat", "chat_template": load_template("smollm2_instruct")})
    _adapter(folder, adapters["gamma"], LoRAConfig(r=4, alpha=8, dropout=0.0, mlp=True, dora=True, rslora=True), 3,
             {"template": "chat"}, quantize="bnb.nf4")
    proc, url = _start(folder, adapters, "--api_key", KEY, "--max_tokens", "24")
    yield {"folder": folder, "adapters": adapters, "url": url, "proc": proc,
           "client": openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)}
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _script_text(capsys, script: str, **kwargs) -> str:
    """The text generate/<script>.py prints for these arguments (its main, run in this process)."""
    main = runpy.run_path(str(ROOT / "generate" / f"{script}.py"))["main"]
    capsys.readouterr()
    main(quantize="bnb.nf4", precision="32-true", temperature=0.0, **kwargs)
    return capsys.readouterr().out.removesuffix("\n")


def test_models_and_health(served):
    import psutil

    listening = [c.laddr for c in psutil.Process(served["proc"].pid).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN]
    assert listening and all(a.ip == "127.0.0.1" for a in listening)  # no --host: this machine only
    ids = [m.id for m in served["client"].models.list().data]
    assert ids == ["base", "alpha", "beta", "gamma"]
    assert httpx.get(served["url"] + "/health").json()["status"] == "ok"


def test_base_and_each_adapter_give_generate_scripts_greedy_text(served, capsys):
    client, folder, adapters = served["client"], served["folder"], served["adapters"]
    texts = {}
    for name in ("alpha", "beta", "gamma"):
        reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPT}],
                                               temperature=0, max_tokens=12)
        want = _script_text(capsys, "lora", checkpoint_dir=folder, lora_path=adapters[name], prompt=PROMPT,
                            merge=False, max_new_tokens=12)
        assert reply.choices[0].message.content == want, name
        assert reply.choices[0].message.role == "assistant"
        texts[name] = want
        u = reply.usage
        assert u.prompt_tokens > 5 and 1 <= u.completion_tokens <= 12 and u.total_tokens == u.prompt_tokens + \
            u.completion_tokens
        # the completions endpoint takes the prompt as it is: generate/lora.py's plain template
        done = client.completions.create(model=name, prompt=PROMPT + "\n", temperature=0, max_tokens=12)
        assert done.choices[0].text == _script_text(capsys, "lora", checkpoint_dir=folder, lora_path=adapters[name],
                                                    prompt=PROMPT, merge=False, max_new_tokens=12, template="plain")
    base = client.completions.create(model="base", prompt=PROMPT, temperature=0, max_tokens=12)
    texts["base"] = base.choices[0].text
    assert texts["base"] == _script_text(capsys, "base", checkpoint_dir=folder, prompt=PROMPT, max_new_tokens=12)
    assert len(set(texts.values())) == 4, texts  # each its own text: the adapters really are switched


def test_streaming_chat_and_completion_add_up_to_the_reply(served):
    client = served["client"]
    for name in ("alpha", "base"):
        msgs = [{"role": "user", "content": PROMPT}]
        full = client.chat.completions.create(model=name, messages=msgs, temperature=0, max_tokens=16)
        chunks = list(client.chat.completions.create(model=name, messages=msgs, temperature=0, max_tokens=16,
                                                     stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            full.choices[0].message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
        assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    done = client.completions.create(model="beta", prompt=PROMPT, temperature=0, max_tokens=10)
    parts = list(client.completions.create(model="beta", prompt=PROMPT, temperature=0, max_tokens=10, stream=True))
    assert "".join(p.choices[0].text for p in parts) == done.choices[0].text
    assert parts[-1].choices[0].finish_reason == done.choices[0].finish_reason
    # the wire format: data: lines, ending with [DONE]
    with httpx.stream("POST", served["url"] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "base", "prompt": PROMPT, "max_tokens": 3, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_n_seed_and_stop_sequences(served, capsys):
    client = served["client"]
    msgs = [{"role": "user", "content": PROMPT}]
    greedy = client.chat.completions.create(model="alpha", messages=msgs, temperature=0, n=3, max_tokens=10)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.message.content for c in greedy.choices}) == 1
    sampled = [client.chat.completions.create(model="alpha", messages=msgs, temperature=1.5, n=3, seed=7,
                                              max_tokens=10) for _ in range(2)]
    texts = [c.message.content for c in sampled[0].choices]
    assert texts == [c.message.content for c in sampled[1].choices]  # the seed decides
    assert len(set(texts)) > 1  # each choice its own draw
    # the same draws as generate/lora.py --num_samples with that seed
    main = runpy.run_path(str(ROOT / "generate" / "lora.py"))["main"]
    capsys.readouterr()
    main(checkpoint_dir=served["folder"], lora_path=served["adapters"]["alpha"], prompt=PROMPT, merge=False,
         quantize="bnb.nf4", precision="32-true", temperature=1.5, seed=7, num_samples=3, max_new_tokens=10)
    assert capsys.readouterr().out == "".join(t + "\n" for t in texts)  # (a text may hold a newline itself)
    # top_p: the nucleus draws of generate/lora.py --top_p with the same seed (and not the unfiltered ones)
    nucleus = client.chat.completions.create(model="alpha", messages=msgs, temperature=1.5, top_p=0.3, n=3, seed=7,
                                             max_tokens=10)
    main(checkpoint_dir=served["folder"], lora_path=served["adapters"]["alpha"], prompt=PROMPT, merge=False,
         quantize="bnb.nf4", precision="32-true", temperature=1.5, top_p=0.3, seed=7, num_samples=3,
         max_new_tokens=10)
    want = capsys.readouterr().out
    assert "".join(c.message.content + "\n" for c in nucleus.choices) == want != "".join(t + "\n" for t in texts)
    # stop sequences: the text ends before the first one, finish_reason stop, streamed the same
    full = greedy.choices[0].message.content
    assert len(full) >= 6, full
    stop = full[3:5]
    cut = client.chat.completions.create(model="alpha", messages=msgs, temperature=0, max_tokens=10,
                                         stop=[stop, "never-there"])
    assert cut.choices[0].message.content == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="alpha", messages=msgs, temperature=0, max_tokens=10, stop=stop,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[:full.index(stop)]
    long = client.chat.completions.create(model="alpha", messages=msgs, temperature=0, max_tokens=10)
    assert long.choices[0].finish_reason in ("length", "stop")


def _raw(served, path: str, body, key: str = KEY) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(served["url"] + path, content=content, timeout=30,
                      headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions", {"model": "delta", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("/v1/chat/completions", {"model": "alpha", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "base", "messages": [{"role": "system", "content": "Be brief."},
                                                            {"role": "user", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "base", "messages": [{"role": "narrator", "content": "hi"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
     400, "max_tokens"),
    ("/v1/completions", {"model": "base", "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", '{"model": "base", "prompt": ', 400, None),
    ("/v1/completions", {"model": "base", "prompt": "robots " * 200}, 400, "prompt"),
    ("/v1/completions", {"model": "base", "prompt": "hi", "max_tokens": 10_000}, 400, "max_tokens"),
    ("/v1/completions", {"model": "base", "prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": "base", "prompt": "hi", "logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"model": "base", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", [1, 2], 400, None),
])
def test_bad_requests_get_the_openai_error_json(served, path, body, status, param):
    r = _raw(served, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param
    assert httpx.get(served["url"] + "/health").status_code == 200  # alive


def test_the_template_and_the_key_through_the_client(served):
    client = served["client"]
    with pytest.raises(openai.BadRequestError, match="System role not supported"):
        client.chat.completions.create(model="base", messages=[{"role": "system", "content": "Be brief."},
                                                               {"role": "user", "content": "hi"}])
    # beta recorded a ChatML template: it renders a system message
    ok = client.chat.completions.create(model="beta", messages=[{"role": "system", "content": "Be brief."},
                                                               {"role": "user", "content": "hi"}], max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="delta", prompt="hi")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served["url"] + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(served["url"] + "/v1/models").status_code == 401  # no key at all


def test_two_clients_at_once_get_their_own_answers(served):
    client = served["client"]
    msgs = [{"role": "user", "content": PROMPT}]
    want = {m: client.chat.completions.create(model=m, messages=msgs, temperature=0, max_tokens=16)
            .choices[0].message.content for m in ("alpha", "beta")}
    got: dict[str, list[str]] = {"alpha": [], "beta": []}

    def ask(model: str) -> None:
        for _ in range(3):
            stream = client.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=16,
                                                    stream=True)
            got[model].append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))

    threads = [threading.Thread(target=ask, args=(m,)) for m in ("alpha", "beta")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == {m: [want[m]] * 3 for m in ("alpha", "beta")}


def test_concurrent_requests_of_every_adapter_run_as_one_batch(served):
    """Twelve requests at once over the base and the three adapters (one DoRA), streamed and not, with n 1 or 2:
    each gets the answer it gets alone, and the server decoded many sequences together (its peak batch)."""
    client = served["client"]
    msgs = [{"role": "user", "content": PROMPT}]
    names = ["base", "alpha", "beta", "gamma"] * 3
    want = {m: client.chat.completions.create(model=m, messages=msgs, temperature=0, max_tokens=16)
            .choices[0].message.content for m in set(names)}
    got: list = [None] * len(names)

    def ask(i: int) -> None:
        if i % 2:
            stream = client.chat.completions.create(model=names[i], messages=msgs, temperature=0, max_tokens=16,
                                                    stream=True)
            got[i] = ["".join(c.choices[0].delta.content or "" for c in stream if c.choices)]
        else:
            r = client.chat.completions.create(model=names[i], messages=msgs, temperature=0, max_tokens=16, n=2)
            got[i] = [c.message.content for c in r.choices]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(names))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == [[want[m]] * (1 if i % 2 else 2) for i, m in enumerate(names)]
    assert httpx.get(served["url"] + "/health").json()["peak_batch"] >= 6


def test_a_client_that_disconnects_stops_its_generation(served):
    """A client that hangs up mid-stream: its request is cancelled (counted), nothing of it counted as generated,
    nothing left in flight. Its own server with --max_batch 1, so that 8 choices x 90 tokens take far longer than
    noticing the hang-up (batched, the tiny model would finish them first)."""
    proc, url = _start(served["folder"], {}, "--max_batch", "1")
    try:
        body = {"model": "base", "prompt": "robots", "max_tokens": 90, "n": 8, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 2:
                    break  # leave mid-stream: the connection is closed
        for _ in range(100):  # bounded: 10 s
            h = httpx.get(url + "/health").json()
            if h["cancelled"] and h["in_flight"] == 0:
                break
            time.sleep(0.1)
        assert h["cancelled"] == 1 and h["in_flight"] == 0 and h["completed"] == 0
        assert h["generated_tokens"] == 0  # counted only for requests that finished
    finally:
        proc.kill()
        proc.wait()


def test_sigterm_finishes_what_is_in_flight(served):
    """A second server: SIGTERM while a stream runs; the stream still ends with [DONE] and the process exits cleanly."""
    proc, url = _start(served["folder"], {}, "--grace_s", "20")
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"model": "base", "prompt": "robots", "max_tokens": 60, "stream": True}) as r:
            lines = []
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 2:
                    proc.terminate()
        assert lines[-1] == "data: [DONE]" and len(lines) > 3
        # uvicorn re-raises the signal once it has shut down gracefully: the exit status says SIGTERM
        assert proc.wait(30) in (0, -signal.SIGTERM)
        assert "Traceback" not in proc.stdout.read()
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_bad_flags_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "generate" / "serve.py"), "--checkpoint_dir", str(tmp_path),
                        "--lora_path", "nopath"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "LIT_QLORA_DEBUG": ""})
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: --lora_path 'nopath'")


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_max_concurrent_429_and_timeout_504(served):
    """--max_concurrent 1: of four requests sent at once one is admitted, the others get 429 with the OpenAI error
    JSON; --timeout_s 0.05: the admitted one (100 tokens take longer) is stopped with 504, not left running."""
    proc, url = _start(served["folder"], {}, "--max_concurrent", "1", "--timeout_s", "0.05")
    try:
        body = {"model": "base", "prompt": "robots", "max_tokens": 100, "temperature": 0}
        answers: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: answers.append(_post(url, body))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        codes = sorted(r.status_code for r in answers)
        # at least one is refused while another runs, and whatever was admitted is stopped (which one arrives
        # first, and whether a late one finds the first already stopped, is the scheduler's)
        assert len(codes) == 4 and set(codes) == {429, 504}, codes
        for r in answers:
            err = r.json()["error"]
            assert err["type"] == ("rate_limit_error" if r.status_code == 429 else "timeout"), err
            assert "--max_concurrent 1" in err["message"] if r.status_code == 429 else "--timeout_s" in err["message"]
        health = httpx.get(url + "/health").json()
        assert health["in_flight"] == 0 and health["generated_tokens"] == 0, health
    finally:
        proc.kill()
        proc.wait()


def test_a_request_that_can_never_fit_the_kv_budget_is_400(served):
    """--kv_cache_gb small enough for 64 positions of this model: a request whose prompt and max_tokens need more gets
    400 naming the flag (it could never run, so it does not wait); one that fits is answered; two that fit only one
    at a time both are (the second waits for the first's blocks)."""
    cfg = load_model(served["folder"], precision="32-true").config
    per_token = 2 * cfg.n_layer * cfg.n_query_groups * cfg.head_size * 4  # fp32 keys and values
    proc, url = _start(served["folder"], {}, "--kv_cache_gb", str(64.5 * per_token / 2**30))
    try:
        big = _post(url, {"model": "base", "prompt": "robots", "max_tokens": 80, "temperature": 0})
        assert big.status_code == 400 and "--kv_cache_gb" in big.json()["error"]["message"], big.text
        bodies = [{"model": "base", "prompt": "robots", "max_tokens": 40, "temperature": 0}] * 2
        answers: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda b=b: answers.append(_post(url, b))) for b in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [r.status_code for r in answers] == [200, 200]
        assert answers[0].json()["choices"][0]["text"] == answers[1].json()["choices"][0]["text"]
    finally:
        proc.kill()
        proc.wait()


def test_sigterm_cancels_what_outlives_the_grace(served):
    """--grace_s 0.2: SIGTERM during a request that needs far longer (8 choices x 100 tokens, one at a time with
    --max_batch 1); the server stops within the grace plus start-up slack, the stream is cut short (no [DONE]) and
    nothing prints a traceback."""
    proc, url = _start(served["folder"], {}, "--grace_s", "0.2", "--max_batch", "1")
    lines: list[str] = []
    try:
        body = {"model": "base", "prompt": "robots", "max_tokens": 100, "n": 8, "stream": True, "temperature": 0.9}
        t0 = None
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json=body) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                    if len(lines) == 2:
                        proc.terminate()
                        t0 = time.monotonic()
        except httpx.TransportError:
            pass  # the connection is closed under the stream: the cut is the point
        assert proc.wait(30) in (0, -signal.SIGTERM, 1)
        assert time.monotonic() - t0 < 10
        assert "data: [DONE]" not in lines and len(lines) < 8 * 100, len(lines)
        assert "Traceback" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _live_tensor_bytes() -> int:
    """Bytes of every distinct CPU tensor storage Python can reach, each storage counted once."""
    gc.collect()
    seen: dict[int, int] = {}
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and o.device.type == "cpu":  # type(): no deprecation-warning getattr
            try:
                s = o.untyped_storage()
                ptr = s.data_ptr()
            except RuntimeError:  # a fake / functional tensor an earlier test's tracing left behind: holds no bytes
                continue
            seen[ptr] = max(seen.get(ptr, 0), s.nbytes())
    return sum(seen.values())


def test_each_adapter_holds_its_own_tensors_once(tmp_path):
    """An extra adapter costs its A and B in the precision's dtype (bf16 here), counted from the tensor storage
    after each served a request: no fp32 copy, no state dict beside the installed tensors, no decoding copies of
    an adapter that is not in place (those exist for the active adapter only)."""
    from lit_qlora.engine.adapters import AdapterBank
    from lit_qlora.generation import generate
    from lit_qlora.inference import load_for_inference
    from lit_qlora.precision import autocast_for

    folder = tmp_path / "tiny-chat"
    make_chat_checkpoint("gemma", folder, load_template("gemma_it"))
    tok = Tokenizer(folder)
    make_tiny_hf_model("llama", folder, vocab_size=tok.vocab_size, initializer_range=0.2)
    convert_hf_checkpoint(folder)
    every = LoRAConfig(r=4, alpha=8, dropout=0.05, query=True, key=True, value=True, projection=True, mlp=True)
    paths = [tmp_path / f"a{i}.pth" for i in range(3)]
    for i, path in enumerate(paths):
        _adapter(folder, path, every, i, {"template": "chat"})
    precision, device = "bf16-true", torch.device("cpu")
    model, tok, _ = load_for_inference(folder, None, "bnb.nf4", precision, device)
    bank = AdapterBank(model, precision)
    ids = tok.encode(PROMPT)

    def serve(name):
        bank.activate(name)
        with torch.no_grad(), autocast_for(precision, device):
            generate(model, ids, 4, temperature=0.0)

    sizes = {}
    for i, path in enumerate(paths):  # the file's element counts at 2 bytes each (bf16)
        sizes[f"a{i}"] = 2 * sum(t.numel() for t in Adapter.load(path, model.config).lora.values())
    bank.add("a0", Adapter.load(paths[0], model.config, mmap=True))
    serve("a0")
    serve(None)
    one = _live_tensor_bytes()
    for name, path in zip(("a1", "a2"), paths[1:]):
        bank.add(name, Adapter.load(path, model.config, mmap=True))
        serve(name)
    serve(None)
    assert _live_tensor_bytes() - one == sizes["a1"] + sizes["a2"]
    assert [bank.lora_bytes(n) for n in sizes] == list(sizes.values())
    # the adapter in place holds fp32 A and scaling * B (B spread over q/k/v's columns) for decoding, and only it
    serve("a2")
    serve("a1")
    copies = sum(4 * (w.lora_A.numel() + w.out_features * w.lora_A.shape[0]) for w in bank.wrappers["a1"].values())
    assert all("_decode_cache" in w.__dict__ for w in bank.wrappers["a1"].values())  # the decoding path ran
    assert _live_tensor_bytes() - one == sizes["a1"] + sizes["a2"] + copies


@torch.no_grad()
def test_variant_adapters_over_the_shared_base(tmp_path):
    """Adapters of each LoRA variant held together over one base compute what generate/lora.py --merge false's model
    of each computes (load_model_with_adapter, itself checked against PEFT in tests/test_lora_variants.py): DoRA
    (sharing each layer's row norms), PiSSA + rsLoRA and OLoRA + DoRA (their base gave up s*B0@A0: served as rank-2r
    LoRAs over the original base) exactly on a dense base; DoRA and one-step LoftQ over nf4 through the 4-bit
    kernel. A LoftQ adapter of several steps, or trained over another quantization, is refused in one line. Red
    with the residual adapters served as they are (their A0/B0 ignored)."""
    from lit_qlora.engine.adapters import AdapterBank
    from lit_qlora.inference import load_for_inference
    from lit_qlora.utils import UserError

    folder = tmp_path / "tiny-chat"
    make_chat_checkpoint("gemma", folder, load_template("gemma_it"))
    make_tiny_hf_model("llama", folder, vocab_size=Tokenizer(folder).vocab_size, initializer_range=0.2)
    convert_hf_checkpoint(folder)
    qv_mlp = dict(r=4, alpha=8, dropout=0.0, query=True, value=True, mlp=True)
    kinds = {"dora": (dict(dora=True), None), "pissa": (dict(init="pissa", rslora=True), None),
             "olora_dora": (dict(init="olora", dora=True, key=True), None),
             "dora_nf4": (dict(dora=True), "bnb.nf4"), "loftq_nf4": (dict(init="loftq"), "bnb.nf4"),
             "loftq2": (dict(init="loftq", loftq_iters=2), "bnb.nf4"), "loftq_fp4": (dict(init="loftq"), "bnb.fp4")}
    for i, (name, (kw, quantize)) in enumerate(kinds.items()):
        _adapter(folder, tmp_path / f"{name}.pth", LoRAConfig(**{**qv_mlp, **kw}), i, {}, quantize=quantize)
    idx = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    for quantize, names in ((None, ["dora", "pissa", "olora_dora"]), ("bnb.nf4", ["dora_nf4", "loftq_nf4"])):
        model, _, _ = load_for_inference(folder, None, quantize, "32-true", torch.device("cpu"))
        bank = AdapterBank(model, "32-true", quantize)
        for name in names:
            bank.add(name, Adapter.load(tmp_path / f"{name}.pth", model.config))
        if quantize:
            for bad in ("loftq2", "loftq_fp4"):
                with pytest.raises(UserError, match=f"adapter {bad} is a LoftQ adapter .* merge it"):
                    bank.add(bad, Adapter.load(tmp_path / f"{bad}.pth", model.config))
        logits = {}
        for name in [*names, *names]:  # twice: switching back and forth keeps each adapter's own output
            bank.activate(name)
            logits.setdefault(name, []).append(model(idx))
        for name in names:
            want, _, _ = load_for_inference(folder, tmp_path / f"{name}.pth", quantize, "32-true", torch.device("cpu"),
                                            merge=False)
            ref = want(idx)
            for got in logits[name]:
                assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item(), (quantize, name)
        assert len({float(v[0].sum()) for v in logits.values()}) == len(names)
        if quantize:
            assert all(type(w).__name__ == "DecodeLoRALinear" for w in bank.wrappers["dora_nf4"].values())
