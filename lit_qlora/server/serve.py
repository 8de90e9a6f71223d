"""An OpenAI-compatible HTTP server over one loaded model and several LoRA adapters (generate/serve.py).

One base model is loaded once (4-bit or not, as generate/lora.py loads it). Each adapter is held as its own LoRA
wrappers around the base model's very layers (`AdapterBank`): a request for adapter X puts X's wrappers in place
(a few hundred attribute assignments), a request for the base puts the bare layers back. Nothing is merged and the
base weights exist once; an adapter costs its LoRA tensors in the precision's dtype, once. Over 4-bit layers on CPU
the wrappers decode through the 4-bit kernel with the update added inside it (`decode4bit.DecodeLoRALinear`), from
fp32 copies of A and the scaled B that only the adapter in place holds (dropped when another is put in place).

Requests are served in turn by one worker thread (`Engine`): a request waits in a queue (at most `max_concurrent`
admitted, the rest get 429), then generates all its choices. Tokens are handed to the HTTP side as they are made
(server-sent events for `stream`); a client that goes away, a request past `timeout_s` or a shutdown stops its
generation at the next token.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from lit_qlora.data.chat_template import encode_chat, stop_ids, template_of
from lit_qlora.data.templates import CHAT
from lit_qlora.engine.adapters import AdapterBank
from lit_qlora.engine.text import TextStream
from lit_qlora.generation import KVSession, generate
from lit_qlora.inference import autocast_for, chat_template_text, format_prompt, prompt_template
from lit_qlora.utils import UserError

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 16
MAX_STOPS = 4
# request fields that would change the output in ways this server does not implement: refused, never ignored
UNSUPPORTED = ("logprobs", "top_logprobs", "tools", "tool_choice", "functions", "function_call", "response_format",
               "logit_bias", "echo", "suffix", "best_of")


class APIError(Exception):
    """A request answered with the OpenAI error JSON and `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_lora_paths(items: list[str]) -> dict[str, Path]:
    """`NAME=PATH` items (--lora_path given several times) -> {name: path}."""
    out: dict[str, Path] = {}
    for item in items:
        name, sep, path = str(item).partition("=")
        name = name.strip()
        if not sep or not name or not path:
            raise UserError(f"--lora_path {item!r} is not NAME=PATH; pass e.g. --lora_path support=out/lora/x.pth")
        if name in out:
            raise UserError(f"--lora_path names {name!r} twice; give each adapter its own name")
        out[name] = Path(path)
    return out


# ----------------------------------------------------------------------------------------------
# The worker


@dataclass
class Spec:
    """One request, ready to generate."""
    model: Optional[str]  # adapter name, None: the base
    ids: torch.Tensor
    stops: list[int]
    stop_strings: list[str]
    max_tokens: int
    temperature: float
    top_p: Optional[float]
    seed: int
    n: int


class _Stop(Exception):
    """Raised from the token callback to end a generation early (a stop string, a cancel, a timeout)."""

    def __init__(self, why: str) -> None:
        self.why = why


@dataclass
class Job:
    spec: Spec
    loop: asyncio.AbstractEventLoop
    deadline: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def emit(self, *event: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody listens any more
            pass


class Engine:
    """Runs jobs one at a time in a worker thread on the one model. Events per job: ("delta", choice, text),
    ("end", choice, finish_reason, tokens), ("done", prompt_tokens, completion_tokens), ("error", APIError)."""

    def __init__(self, bank: AdapterBank, tokenizer, device: torch.device, precision: str, max_concurrent: int = 32,
                 timeout_s: float = 600.0) -> None:
        self.bank, self.tokenizer, self.device, self.precision = bank, tokenizer, device, precision
        self.max_concurrent, self.timeout_s = max_concurrent, timeout_s
        self.jobs: queue.Queue = queue.Queue()
        self.admitted = 0
        self.lock = threading.Lock()
        self.stats = {"completed": 0, "cancelled": 0, "timed_out": 0, "failed": 0, "generated_tokens": 0}
        self.closing = False
        self.thread = threading.Thread(target=self._work, name="lit-qlora-serve", daemon=True)
        self.thread.start()

    # ---- the HTTP side
    def submit(self, spec: Spec, loop: asyncio.AbstractEventLoop) -> Job:
        with self.lock:
            if self.closing:
                raise APIError(503, "the server is shutting down; retry on another instance", "server_error")
            if self.admitted >= self.max_concurrent:
                raise APIError(429, f"{self.admitted} requests are already queued or running (--max_concurrent "
                               f"{self.max_concurrent}); retry later", "rate_limit_error", code="rate_limit_exceeded")
            self.admitted += 1
        job = Job(spec, loop, time.monotonic() + self.timeout_s)
        self.jobs.put(job)
        return job

    def close(self, timeout: float = 30.0) -> None:
        """Cancel what is queued or running and stop the worker."""
        with self.lock:
            self.closing = True
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
                self._finish(job, APIError(503, "the server shut down before this request ran", "server_error"))
        running = getattr(self, "running", None)
        if running is not None:
            running.cancel.set()
        self.jobs.put(None)
        self.thread.join(timeout)

    def health(self) -> dict:
        return {"status": "ok" if not self.closing else "shutting_down", "in_flight": self.admitted,
                "queued": self.jobs.qsize(), **self.stats}

    # ---- the worker thread
    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self.running = job
            error = None
            try:
                if job.cancel.is_set():
                    self.stats["cancelled"] += 1
                elif time.monotonic() > job.deadline:
                    self.stats["timed_out"] += 1
                    error = APIError(504, "the request waited longer than the server's --timeout_s", "timeout")
                else:
                    error = self._run(job)
            except Exception as e:  # never kill the worker: the request gets a 500, the server lives on
                self.stats["failed"] += 1
                error = APIError(500, f"generation failed ({type(e).__name__}: {e})", "server_error")
            finally:
                self.running = None
                self._finish(job, error)

    def _finish(self, job: Job, error: Optional[APIError]) -> None:
        with self.lock:
            self.admitted -= 1
        if error is not None:
            job.emit("error", error)

    def _run(self, job: Job) -> Optional[APIError]:
        spec, tok = job.spec, self.tokenizer
        self.bank.activate(spec.model)
        gen = torch.Generator(device=self.device).manual_seed(spec.seed)
        session = KVSession()  # the prompt computed once for all choices
        stops, total = set(spec.stops), 0
        for choice in range(spec.n):
            text = TextStream(tok, stops, spec.stop_strings)
            count = 0

            def on_token(token_id: int) -> None:
                nonlocal count
                count += 1
                if job.cancel.is_set():
                    raise _Stop("cancelled")
                if time.monotonic() > job.deadline:
                    raise _Stop("timeout")
                piece, stopped = text.feed(token_id)
                if piece:
                    job.emit("delta", choice, piece)
                if stopped:
                    raise _Stop("stop")

            finish = "length"
            try:
                with autocast_for(self.precision, self.device):
                    out = generate(self.bank.model, spec.ids, spec.max_tokens, temperature=spec.temperature,
                                   top_p=spec.top_p, eos_ids=spec.stops, generator=gen, on_token=on_token,
                                   session=session)
                if int(out[-1]) in stops and len(out) > len(spec.ids):
                    finish = "stop"
            except _Stop as s:
                if s.why == "cancelled":
                    self.stats["cancelled"] += 1
                    return None
                if s.why == "timeout":
                    self.stats["timed_out"] += 1
                    return APIError(504, f"the request ran longer than the server's --timeout_s {self.timeout_s:g}",
                                    "timeout")
                finish = "stop"
            tail = text.finish() if finish != "stop" or not spec.stop_strings else ""
            if tail:
                job.emit("delta", choice, tail)
            job.emit("end", choice, finish, count)
            total += count
        self.stats["completed"] += 1
        self.stats["generated_tokens"] += total
        job.emit("done", len(spec.ids), total)
        return None


# ----------------------------------------------------------------------------------------------
# Requests


def _field(body: dict, name: str, kinds: tuple, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
        raise APIError(400, f"'{name}' has the wrong type ({type(value).__name__}); see the OpenAI API reference",
                       param=name)
    return value


class Server:
    """What the endpoints need: the engine, the served names, the tokenizer and the prompt rendering."""

    def __init__(self, engine: Engine, base_name: str, api_key: Optional[str] = None,
                 default_max_tokens: int = 256) -> None:
        self.engine, self.base_name, self.api_key = engine, base_name, api_key
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())

    @property
    def names(self) -> list[str]:
        return [self.base_name, *self.engine.bank.adapters]

    def adapter(self, body: dict) -> Optional[str]:
        name = _field(body, "model", (str,))
        if not name:
            raise APIError(400, "'model' is required; pass one of: " + ", ".join(self.names), param="model")
        if name == self.base_name:
            return None
        if name not in self.engine.bank.adapters:
            raise APIError(404, f"the model {name!r} does not exist; this server has: " + ", ".join(self.names),
                           param="model", code="model_not_found")
        return name

    # ---- prompts
    def chat_ids(self, name: Optional[str], messages: Any) -> tuple[torch.Tensor, list[int]]:
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, f"messages[{i}] must be an object with a role and a content",
                               param=f"messages[{i}]")
            if m["role"] not in ROLES:
                raise APIError(400, f"messages[{i}] has the unknown role {m['role']!r}; use one of: "
                               + ", ".join(ROLES), param=f"messages[{i}].role")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise APIError(400, f"messages[{i}] has a content part other than text, which this server "
                                   "cannot take", param=f"messages[{i}].content")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise APIError(400, f"messages[{i}] needs a text content", param=f"messages[{i}].content")
            clean.append({"role": m["role"], "content": content})
        tok = self.engine.tokenizer
        adapter = self.engine.bank.adapters.get(name) if name else None
        template = prompt_template(adapter, None)
        try:
            if template == CHAT or (template is None and tok.chat_template):
                chat = chat_template_text(tok, adapter) if adapter is not None else template_of(tok)
                ids = encode_chat(tok, clean, add_generation_prompt=True, template=chat)
                return torch.tensor(ids, dtype=torch.long), stop_ids(tok, chat)
            # an adapter trained with a prompt template: the conversation before, then the last message in it
            history = "".join(f"{m['role']}: {m['content']}\n" for m in clean[:-1])
            return tok.encode(history + format_prompt(clean[-1]["content"], "", adapter, None)), stop_ids(tok)
        except UserError as e:
            raise APIError(400, str(e), param="messages") from None

    def completion_prompts(self, body: dict) -> list[torch.Tensor]:
        prompt = body.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise APIError(400, "'prompt' must be a string or a non-empty list of strings", param="prompt")
        return [self.engine.tokenizer.encode(p) for p in prompts]

    def spec(self, body: dict, name: Optional[str], ids: torch.Tensor, stops: list[int]) -> Spec:
        for key in UNSUPPORTED:
            if body.get(key) not in (None, False, 0, [], {}) and not (key == "response_format"
                                                                   and body[key] == {"type": "text"}):
                raise APIError(400, f"'{key}' is not supported by this server; leave it out", param=key)
        for key in ("presence_penalty", "frequency_penalty"):
            if _field(body, key, (int, float), 0):
                raise APIError(400, f"'{key}' is not supported by this server; leave it out or use 0", param=key)
        temperature = float(_field(body, "temperature", (int, float), 1.0))
        if not 0 <= temperature <= 2:
            raise APIError(400, f"'temperature' must be between 0 and 2, got {temperature}", param="temperature")
        top_p = float(_field(body, "top_p", (int, float), 1.0))
        if not 0 < top_p <= 1:
            raise APIError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
        n = _field(body, "n", (int,), 1)
        if not 1 <= n <= MAX_N:
            raise APIError(400, f"'n' must be between 1 and {MAX_N}, got {n}", param="n")
        stop = body.get("stop")
        stop_strings = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stop_strings, list) or len(stop_strings) > MAX_STOPS or not all(
                isinstance(s, str) for s in stop_strings):
            raise APIError(400, f"'stop' must be a string or a list of at most {MAX_STOPS} strings", param="stop")
        seed = _field(body, "seed", (int,))
        limit = self.engine.bank.model.config.block_size
        room = limit - len(ids)
        if room <= 0:
            raise APIError(400, f"the prompt has {len(ids)} tokens and this model's maximum context length is "
                           f"{limit} tokens; shorten the prompt", param="messages" if "messages" in body else "prompt",
                           code="context_length_exceeded")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _field(body, key, (int,))
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, room)
        elif max_tokens <= 0:
            raise APIError(400, f"'{key}' must be at least 1, got {max_tokens}", param=key)
        elif max_tokens > room:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has {len(ids)} "
                           f"and {key} asks for {max_tokens}: lower {key} or shorten the prompt", param=key,
                           code="context_length_exceeded")
        return Spec(name, ids, stops, stop_strings, max_tokens, temperature, top_p if top_p < 1 else None,
                    seed if seed is not None else secrets.randbits(63), n)


class _CancelledOnShutdown(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" traceback for a request it cancelled itself because it outlived
    --grace_s: that cancellation is the shutdown working (uvicorn says so in its own line before)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


def serve(app, host: str, port: int, grace_s: float = 10.0) -> None:
    """Run `app` with uvicorn until SIGINT/SIGTERM: then no new connections, up to `grace_s` for the requests in
    flight to finish, the rest cancelled (their generation stops), and the worker stopped."""
    import uvicorn

    logging.getLogger("uvicorn.error").addFilter(_CancelledOnShutdown())
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace_s,
                            access_log=False)
    uvicorn.Server(config).run()
