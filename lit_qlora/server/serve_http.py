"""The HTTP side of lit_qlora/server/serve.py: the FastAPI app with the OpenAI endpoints. Its own module because FastAPI
reads the endpoints' annotations at runtime (so no postponed annotations here), and so that the rest of the package
imports without the `serve` extra installed."""
import asyncio
import hmac
import json
import time
import uuid
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
    engine = server.engine

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
        await asyncio.get_running_loop().run_in_executor(None, engine.close)

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON object") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    @app.get("/health")
    async def health():
        return engine.health()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": n, "object": "model", "created": server.created,
                                            "owned_by": "lit-qlora"} for n in server.names]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        if name not in server.names:
            raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
        return {"id": name, "object": "model", "created": server.created, "owned_by": "lit-qlora"}

    async def run(request: Request, body: dict, specs: list[Spec], chat: bool):
        model_name = body["model"]
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        loop = asyncio.get_running_loop()
        jobs = [engine.submit(s, loop) for s in specs]  # (one per prompt of a completions request)
        n = specs[0].n

        async def events(job: Job):
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

        kind = "chat.completion.chunk" if chat else "text_completion"
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

            def choice(i: int, text: Optional[str], finish: Optional[str], role: bool = False) -> dict:
                if chat:
                    delta = {} if text is None else ({"role": "assistant", "content": text} if role
                                                     else {"content": text})
                    return {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
                return {"index": i, "text": text or "", "logprobs": None, "finish_reason": finish}

            async def stream():
                usage = [0, 0]
                try:
                    for p, job in enumerate(jobs):
                        if chat:
                            for i in range(n):
                                yield _chunk(kind, rid, created, model_name, [choice(i, "", None, role=True)],
                                             None, include_usage)
                        async for ev in events(job):
                            if ev[0] == "delta":
                                yield _chunk(kind, rid, created, model_name, [choice(p * n + ev[1], ev[2], None)],
                                             None, include_usage)
                            elif ev[0] == "end":
                                yield _chunk(kind, rid, created, model_name,
                                             [choice(p * n + ev[1], None if chat else "", ev[2])], None,
                                             include_usage)
                            elif ev[0] == "done":
                                usage[0] += ev[1]
                                usage[1] += ev[2]
                    if include_usage:
                        yield _chunk(kind, rid, created, model_name, [], _usage(*usage), True)
                except APIError as e:  # after the 200 header: the error as the API streams one
                    yield f"data: {json.dumps(e.body())}\n\n"
                finally:
                    for job in jobs:  # a client gone (the task is cancelled here), an error: stop generating
                        job.cancel.set()
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        texts: dict[int, list[str]] = {}
        finish: dict[int, str] = {}
        usage = [0, 0]
        try:
            for p, job in enumerate(jobs):
                agen = events(job)
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
                        texts.setdefault(p * n + ev[1], []).append(ev[2])
                    elif ev[0] == "end":
                        finish[p * n + ev[1]] = ev[2]
                    elif ev[0] == "done":
                        usage[0] += ev[1]
                        usage[1] += ev[2]
                if job.cancel.is_set():
                    raise APIError(499, "the client closed the request")
        finally:
            for job in jobs:
                job.cancel.set()
        choices = []
        for i in sorted(finish):
            text = "".join(texts.get(i, []))
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                "finish_reason": finish[i]})
            else:
                choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": finish[i]})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name, "system_fingerprint": None, "choices": choices, "usage": _usage(*usage)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request)
        name = server.adapter(body)
        ids, stops = server.chat_ids(name, body.get("messages"))
        return await run(request, body, [server.spec(body, name, ids, stops)], chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        name = server.adapter(body)
        stops = stop_ids(engine.tokenizer)
        specs = [server.spec(body, name, ids, stops) for ids in server.completion_prompts(body)]
        seed = specs[0].seed
        for i, s in enumerate(specs):  # each prompt its own draws, reproducible from the one seed
            s.seed = seed + i
        return await run(request, body, specs, chat=False)

    return app
