"""The HTTP side of lit_qlora/server/serve.py: the FastAPI app with the OpenAI endpoints. Its own module because FastAPI
reads the endpoints' annotations at runtime (so no postponed annotations here), and so that the rest of the package
imports without the `serve` extra installed."""
import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from lit_qlora.data.chat_template import stop_ids
from lit_qlora.server.serve import APIError, Job, Server, Spec


def _chunk(kind: str, rid: str, created: int, model: str, choices: list, usage: Any = None,
           with_usage: bool = False) -> str:
    obj = {"id": rid, "object": kind, "created": created, "model": model, "system_fingerprint": None,
           "choices": choices}
    if with_usage:
        obj["usage"] = usage
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def create_app(server: Server):
    """The FastAPI app: /v1/chat/completions, /v1/completions, /v1/models, /health."""
    app = FastAPI(title="lit-qlora", docs_url=None, redoc_url=None)
    _add_error_handling(app, server)
    _add_model_routes(app, server)
    _add_completion_routes(app, server)
    return app


def _add_error_handling(app: FastAPI, server: Server) -> None:
    """Every error as the OpenAI API's JSON body, the API key checked on /v1, the engine closed at shutdown."""
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return JSONResponse(APIError(400, str(e)).body(), status_code=400)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if server.api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {server.api_key}".encode()):
                return JSONResponse(APIError(401, "missing or wrong API key; pass it as 'Authorization: Bearer KEY'",
                                             code="invalid_api_key").body(), status_code=401)
        try:
            return await call_next(request)
        except Exception as e:  # an answer, not a dropped connection
            return JSONResponse(APIError(500, f"internal error ({type(e).__name__})", "server_error").body(),
                                status_code=500)

    @app.on_event("shutdown")
    async def _shutdown():
        await asyncio.get_running_loop().run_in_executor(None, server.engine.close)


def _add_model_routes(app: FastAPI, server: Server) -> None:
    """/health, /v1/models and /v1/models/{name}."""
    @app.get("/health")
    async def health():
        return server.engine.health()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": n, "object": "model", "created": server.created,
                                            "owned_by": "lit-qlora"} for n in server.names]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        if name not in server.names:
            raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
        return {"id": name, "object": "model", "created": server.created, "owned_by": "lit-qlora"}


def _add_completion_routes(app: FastAPI, server: Server) -> None:
    """/v1/chat/completions and /v1/completions."""
    engine = server.engine

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _body_of(request)
        name = server.adapter(body)
        ids, stops = server.chat_ids(name, body.get("messages"))
        return await _run(engine, request, body, [server.spec(body, name, ids, stops)], chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body_of(request)
        name = server.adapter(body)
        stops = stop_ids(engine.tokenizer)
        specs = [server.spec(body, name, ids, stops) for ids in server.completion_prompts(body)]
        seed = specs[0].seed
        for i, s in enumerate(specs):  # each prompt its own draws, reproducible from the one seed
            s.seed = seed + i
        return await _run(engine, request, body, specs, chat=False)


async def _body_of(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON object") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


@dataclass
class _Reply:
    """One request's answer in the making: its jobs (one per prompt of a completions request, each with `n`
    choices) and what every chunk of it repeats."""
    jobs: list
    n: int
    chat: bool
    model: str
    rid: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.rid = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    @property
    def kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, choices: list, usage: Any = None, with_usage: bool = False) -> str:
        return _chunk(self.kind, self.rid, self.created, self.model, choices, usage, with_usage)

    def delta(self, i: int, text: Optional[str], finish: Optional[str], role: bool = False) -> dict:
        """A streamed choice: a chat delta (its first one with the role) or a completion's text."""
        if self.chat:
            delta = {} if text is None else ({"role": "assistant", "content": text} if role else {"content": text})
            return {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": i, "text": text or "", "logprobs": None, "finish_reason": finish}

    def cancel(self) -> None:
        for job in self.jobs:  # a client gone, an error, the end: stop generating
            job.cancel.set()


async def _run(engine, request: Request, body: dict, specs: list[Spec], chat: bool):
    """Generate for `specs` and answer: a stream of server-sent events, or one JSON body."""
    loop = asyncio.get_running_loop()
    reply = _Reply([engine.submit(s, loop) for s in specs], specs[0].n, chat, body["model"])
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_stream(reply, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    texts, finish, usage = await _collect(reply, request)
    choices = []
    for i in sorted(finish):
        text = "".join(texts.get(i, []))
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                            "finish_reason": finish[i]})
        else:
            choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": finish[i]})
    return {"id": reply.rid, "object": "chat.completion" if chat else "text_completion", "created": reply.created,
            "model": reply.model, "system_fingerprint": None, "choices": choices, "usage": _usage(*usage)}


async def _events(job: Job):
    """A job's events until its "done"; an error event raised, the deadline enforced."""
    while True:
        left = job.deadline - time.monotonic() + 5.0  # the worker enforces the deadline itself first
        try:
            ev = await asyncio.wait_for(job.events.get(), timeout=max(left, 0.1))
        except asyncio.TimeoutError:
            job.cancel.set()
            raise APIError(504, "the request ran longer than the server's --timeout_s", "timeout") from None
        if ev[0] == "error":
            raise ev[1]
        yield ev
        if ev[0] == "done":
            return


async def _stream(reply: _Reply, include_usage: bool):
    """The server-sent events of a streamed answer, an error after the 200 header as the API streams one."""
    usage = [0, 0]
    chat, n = reply.chat, reply.n
    try:
        for p, job in enumerate(reply.jobs):
            if chat:
                for i in range(n):
                    yield reply.chunk([reply.delta(i, "", None, role=True)], None, include_usage)
            async for ev in _events(job):
                if ev[0] == "delta":
                    yield reply.chunk([reply.delta(p * n + ev[1], ev[2], None)], None, include_usage)
                elif ev[0] == "end":
                    yield reply.chunk([reply.delta(p * n + ev[1], None if chat else "", ev[2])], None, include_usage)
                elif ev[0] == "done":
                    usage[0] += ev[1]
                    usage[1] += ev[2]
        if include_usage:
            yield reply.chunk([], _usage(*usage), True)
    except APIError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    finally:
        reply.cancel()  # (a client gone: the task is cancelled here)
    yield "data: [DONE]\n\n"


async def _collect(reply: _Reply, request: Request) -> tuple[dict[int, list[str]], dict[int, str], list[int]]:
    """(each choice's text pieces, each choice's finish reason, [prompt, completion] tokens) of an answer given
    whole; a client that hangs up stops its generation (499)."""
    texts: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    usage = [0, 0]
    try:
        for p, job in enumerate(reply.jobs):
            agen = _events(job)
            while True:
                task = asyncio.ensure_future(agen.__anext__())
                while not task.done():  # a client that hangs up stops its generation
                    await asyncio.wait([task], timeout=0.5)
                    if not task.done() and await request.is_disconnected():
                        job.cancel.set()
                try:
                    ev = task.result()
                except StopAsyncIteration:
                    break
                if ev[0] == "delta":
                    texts.setdefault(p * reply.n + ev[1], []).append(ev[2])
                elif ev[0] == "end":
                    finish[p * reply.n + ev[1]] = ev[2]
                elif ev[0] == "done":
                    usage[0] += ev[1]
                    usage[1] += ev[2]
            if job.cancel.is_set():
                raise APIError(499, "the client closed the request")
    finally:
        reply.cancel()
    return texts, finish, usage
