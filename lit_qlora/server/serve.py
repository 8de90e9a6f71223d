"""An OpenAI-compatible HTTP server over one loaded model and several LoRA adapters (generate/serve.py).

One base model is loaded once (4-bit or not, as generate/lora.py loads it), and each adapter is held unmerged over
it (`engine.adapters.AdapterBank`): the base weights exist once, an adapter costs its LoRA tensors once (plus fp32
copies for decoding while it serves).

Every request runs in the batched engine (`lit_qlora.engine`), stepped by one worker thread (`Worker`): its choices
(`n`) are sequences decoded together with every other request's, rows of different adapters in the same forward (a
4-bit base through the decode kernel once for all of them, each row's update added per run of rows), a prompt
computed once for all its choices. At most `max_concurrent` requests are admitted (the rest get 429). Tokens are
handed to the HTTP side as they are made (server-sent events for `stream`); a client that goes away, a request past
`timeout_s` or a shutdown stops its sequences at the next step.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from lit_qlora.data.chat_template import encode_chat, stop_ids, template_of
from lit_qlora.data.templates import CHAT
from lit_qlora.engine import Engine, Sampling, choice_seed
from lit_qlora.engine.adapters import AdapterBank
from lit_qlora.inference import chat_template_text, format_prompt, prompt_template
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

    def sampling(self, choice: int) -> Sampling:
        """Choice 0 draws with `seed`, each other choice with its own seed made from it (`choice_seed`)."""
        return Sampling(max_new_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                        seed=choice_seed(self.seed, choice),
                        stop_ids=tuple(self.stops), stop_strings=tuple(self.stop_strings))


@dataclass(eq=False)
class Job:
    """A request's choices, each a sequence of the engine, and what the HTTP side reads: ("delta", choice, text),
    ("end", choice, finish_reason, tokens), ("done", prompt_tokens, completion_tokens), ("error", APIError)."""
    spec: Spec
    loop: asyncio.AbstractEventLoop
    deadline: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    sequences: list = field(default_factory=list)
    left: int = 0  # choices still running
    tokens: int = 0
    failed: bool = False

    def emit(self, *event: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody listens any more
            pass


class Worker:
    """The batched engine (lit_qlora.engine) over the model and its adapters, stepped by one worker thread: every
    request's choices are sequences decoded together with every other request's, rows of different adapters in one
    forward. At most `max_concurrent` requests are admitted (queued or running; the rest get 429); a request whose
    prompt and max_tokens can never fit in the KV budget gets 400; one still unfinished `timeout_s` after it arrived
    gets 504; a cancelled one (its client went away) stops at the next step."""

    def __init__(self, bank: AdapterBank, tokenizer, device: torch.device, precision: str, max_concurrent: int = 32,
                 timeout_s: float = 600.0, kv_cache_gb: Optional[float] = None, max_batch: int = 32) -> None:
        self.bank, self.tokenizer, self.device, self.precision = bank, tokenizer, device, precision
        self.engine = Engine(bank.model, tokenizer=tokenizer, bank=bank, kv_cache_gb=kv_cache_gb, max_batch=max_batch,
                             precision=precision)
        self.max_concurrent, self.timeout_s = max_concurrent, timeout_s
        self.active: set[Job] = set()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stats = {"completed": 0, "cancelled": 0, "timed_out": 0, "failed": 0, "generated_tokens": 0}
        self.closing = False
        self.thread = threading.Thread(target=self._work, name="lit-qlora-serve", daemon=True)
        self.thread.start()

    # ---- the HTTP side
    def submit(self, spec: Spec, loop: asyncio.AbstractEventLoop) -> Job:
        try:
            self.engine.check(len(spec.ids), spec.sampling(0), spec.model)
        except UserError as e:
            raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
        with self.lock:
            if self.closing:
                raise APIError(503, "the server is shutting down; retry on another instance", "server_error")
            if len(self.active) >= self.max_concurrent:
                raise APIError(429, f"{len(self.active)} requests are already queued or running (--max_concurrent "
                               f"{self.max_concurrent}); retry later", "rate_limit_error", code="rate_limit_exceeded")
            job = Job(spec, loop, time.monotonic() + self.timeout_s, left=spec.n)
            self.active.add(job)
        ids = spec.ids.tolist()
        for choice in range(spec.n):
            job.sequences.append(self.engine.submit(ids, spec.sampling(choice), spec.model, deadline=job.deadline,
                                                    on_event=functools.partial(self._on_event, job, choice)))
        self.wake.set()
        return job

    def close(self, timeout: float = 30.0) -> None:
        """Cancel what is queued or running and stop the worker."""
        with self.lock:
            self.closing = True
            jobs = list(self.active)
        for job in jobs:
            job.cancel.set()
        self.wake.set()
        self.thread.join(timeout)

    def health(self) -> dict:
        e = self.engine
        return {"status": "ok" if not self.closing else "shutting_down", "in_flight": len(self.active),
                "queued": len(e.waiting) + e.inbox.qsize(), "running": len(e.running) + len(e.prefilling),
                "kv_cache_tokens": e.pool.blocks * e.pool.block_size,
                "kv_cache_free_tokens": e.pool.available() * e.pool.block_size,
                "peak_batch": e.stats["peak_batch"], **self.stats}

    # ---- the worker thread
    def _work(self) -> None:
        while True:
            with self.lock:
                jobs, closing = list(self.active), self.closing
            for job in jobs:  # a client gone, a shutdown: its sequences stop at this step
                if job.cancel.is_set() or closing:
                    for seq in job.sequences:
                        self.engine.cancel(seq)
            if self.engine.busy:
                try:
                    self.engine.step()
                except Exception as e:  # never kill the worker: the requests get a 500, the server lives on
                    self.engine.abort()
                    for job in jobs:
                        self._fail(job, APIError(500, f"generation failed ({type(e).__name__}: {e})",
                                                 "server_error"), "failed")
            elif closing:
                return
            else:
                self.wake.wait(0.5)
                self.wake.clear()

    def _on_event(self, job: Job, choice: int, seq, kind: str, value) -> None:
        if kind == "text":
            job.emit("delta", choice, value)
        if kind != "end":
            return
        if value == "timeout":
            self._fail(job, APIError(504, f"the request ran longer than the server's --timeout_s {self.timeout_s:g}",
                                     "timeout"), "timed_out")
        elif value == "cancelled":
            self._fail(job, None, "cancelled")
        elif value == "error":
            self._fail(job, APIError(500, "generation failed", "server_error"), "failed")
        else:
            job.emit("end", choice, value, len(seq.new_ids))
            job.tokens += len(seq.new_ids)
        job.left -= 1
        if job.left == 0:
            self._done(job)

    def _fail(self, job: Job, error: Optional[APIError], stat: str) -> None:
        """The request ends without an answer (its other choices are stopped); counted and said once."""
        if job.failed:
            return
        job.failed = True
        self.stats[stat] += 1
        for seq in job.sequences:
            self.engine.cancel(seq)
        if error is not None:
            job.emit("error", error)
        self._done(job)

    def _done(self, job: Job) -> None:
        with self.lock:
            if job not in self.active:
                return
            self.active.discard(job)
        if not job.failed:
            self.stats["completed"] += 1
            self.stats["generated_tokens"] += job.tokens
            job.emit("done", len(job.spec.ids), job.tokens)


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

    def __init__(self, engine: Worker, base_name: str, api_key: Optional[str] = None,
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
