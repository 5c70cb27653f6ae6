"""``megaloop serve``: the OpenAI HTTP API in front of an ``Engine`` (FastAPI and uvicorn, the ``serve``
extra: ``pip install megaloop[serve]``).

    POST /v1/completions, /v1/chat/completions  (stream: true: server-sent events, then [DONE])
    GET  /v1/models, /v1/models/{id}, /health

A malformed request is a 400 in OpenAI's error shape with ``param`` naming the field; a request that
finds ``max_queue`` requests waiting is a 429; one that comes while the server stops is a 503. A client
that disconnects cancels its requests (their slots are free before the next step). SIGINT or SIGTERM:
no new connections, the running requests finish (up to ``drain_timeout`` seconds, then they are
cancelled), the engine stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from megaloop.errors import MegaloopError
from megaloop.serving import openai_api as api
from megaloop.serving.engine import Engine
from megaloop.serving.requests import EngineClosed, QueueFull, Request, RequestError

POLL_S = 0.25  # how often a request with nothing to send checks that its client is still there
_TYPE_NAME = re.compile(r"^(str|int|float|bool|none|[\w-]+\[.*\])$")


def make_app(engine: Engine, model_name: str, *, drain_timeout: float = 30.0) -> Any:
    """The FastAPI application serving ``engine`` as the model ``model_name``; its shutdown drains and
    closes the engine."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(engine.close, True, drain_timeout)

    app = FastAPI(title="megaloop", lifespan=lifespan)
    created = int(time.time())

    def error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> Any:
        return JSONResponse(api.error_body(message, kind, param, code), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Any, exc: RequestValidationError) -> Any:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
        # (a union's member names its type in the path: "stop", not "stop.str")
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _TYPE_NAME.match(str(p))]
        param = ".".join(loc) or None
        return error(400, f"{param or 'the body'}: {first.get('msg', 'invalid')}", "invalid_request_error", param)

    @app.exception_handler(RequestError)
    async def refused(_: Any, exc: RequestError) -> Any:
        return error(400, str(exc), "invalid_request_error", exc.field)

    @app.exception_handler(QueueFull)
    async def full(_: Any, exc: QueueFull) -> Any:
        return error(429, str(exc), "rate_limit_error", code="queue_full")

    @app.exception_handler(EngineClosed)
    async def closed(_: Any, exc: EngineClosed) -> Any:
        return error(503, str(exc), "service_unavailable", code="stopping")

    @app.exception_handler(MegaloopError)
    async def failed(_: Any, exc: MegaloopError) -> Any:  # (the engine's step failed: every request hears it)
        return error(500, f"the engine failed: {type(exc).__name__}: {exc}", "server_error")

    @app.get("/health")
    async def health() -> Any:
        body = {"status": "ok", "model": model_name, "device": engine.description, **engine.stats()}
        if engine.failure is not None:
            return JSONResponse({**body, "status": "failed", "error": str(engine.failure)}, status_code=503)
        return body

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "megaloop",
                "max_model_len": engine.shape.max_seq}  # fmt: skip

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Any:
        if model_id != model_name:
            return error(404, f"the model {model_id!r} does not exist; this server serves {model_name!r}",
                         "invalid_request_error", "model", "model_not_found")  # fmt: skip
        return model_card()

    def check_model(name: str) -> Any:
        if name != model_name:
            return error(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                         "invalid_request_error", "model", "model_not_found")  # fmt: skip
        return None

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, http: HttpRequest) -> Any:
        if (wrong := check_model(body.model)) is not None:
            return wrong
        body.refuse_unsupported()
        prompts = [engine.encode(p) for p in body.prompts()]
        jobs = [(p, body.settings(body.max_tokens or 16, i)) for p in prompts for i in range(body.n)]
        requests = _submit_all(engine, jobs)
        echo = [engine.decode(p) if body.echo else "" for p in prompts for _ in range(body.n)]
        used = sum(len(p) for p in prompts) * body.n
        if body.stream:
            rid = api.new_id("cmpl")
            usage_wanted = bool(body.stream_options and body.stream_options.include_usage)
            events = _stream(requests, http, "text_completion", rid, model_name, echo, usage_wanted, used)
            return StreamingResponse(events, media_type="text/event-stream")
        done = await _wait_all(requests, http)
        if done is None:
            return error(499, "the client disconnected", "client_closed")
        return api.completion_body(api.new_id("cmpl"), model_name, [(e + c.text, c) for e, c in zip(echo, done)],
                                   used)  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat(body: api.ChatRequest, http: HttpRequest) -> Any:
        if (wrong := check_model(body.model)) is not None:
            return wrong
        body.refuse_unsupported()
        prompt = engine.encode(body.conversation(), chat=True)
        max_new = body.max_new() or max(1, engine.max_tokens_left(len(prompt)))
        requests = _submit_all(engine, [(prompt, body.settings(max_new, i)) for i in range(body.n)])
        used = len(prompt) * body.n
        if body.stream:
            rid = api.new_id("chatcmpl")
            usage_wanted = bool(body.stream_options and body.stream_options.include_usage)
            events = _stream(requests, http, "chat.completion.chunk", rid, model_name, None, usage_wanted, used)
            return StreamingResponse(events, media_type="text/event-stream")
        done = await _wait_all(requests, http)
        if done is None:
            return error(499, "the client disconnected", "client_closed")
        return api.chat_body(api.new_id("chatcmpl"), model_name, done, used)

    return app


def _submit_all(engine: Engine, jobs: list[tuple[list[int], dict]]) -> list[Request]:
    """Every choice's request, or none: one refused (the queue full) cancels those already in."""
    requests: list[Request] = []
    try:
        for prompt, settings in jobs:
            requests.append(engine.submit(prompt, **settings))
    except BaseException:
        for r in requests:
            r.cancel()
        raise
    return requests


async def _disconnected(http: Any) -> bool:
    try:
        return await http.is_disconnected()
    except Exception:  # (the connection is already gone)
        return True


async def _wait_all(requests: list[Request], http: Any) -> list[Any] | None:
    """The completions, or None (every request cancelled) once the client has gone."""
    tasks = [asyncio.ensure_future(r.aresult()) for r in requests]
    try:
        while True:
            _, pending = await asyncio.wait(tasks, timeout=POLL_S)
            if not pending:
                return [t.result() for t in tasks]
            if await _disconnected(http):
                return None
    finally:
        for t in tasks:
            t.cancel()
        for r in requests:
            r.cancel()


def _sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


async def _stream(requests: list[Request], http: Any, kind: str, rid: str, model: str, echo: list[str] | None,
                  usage_wanted: bool, prompt_tokens: int) -> AsyncIterator[str]:  # fmt: skip
    """Server-sent events of every choice's deltas as they come (a chat's first chunk of a choice names
    its role), its last chunk with the finish reason, the usage chunk where asked for, then [DONE]."""
    created = int(time.time())
    queue: asyncio.Queue = asyncio.Queue()
    chat = kind == "chat.completion.chunk"

    def choice(i: int, text: str | None, finish: str | None = None, role: bool = False) -> dict:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            return {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": i, "text": text or "", "logprobs": None, "finish_reason": finish}

    async def pump(i: int, r: Request) -> None:
        try:
            async for delta in r:
                await queue.put((i, delta))
            await queue.put((i, None))
        except Exception as e:  # the engine failed: say so in the stream
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
    try:
        for i in range(len(requests)):
            if chat:
                yield _sse(api.chunk(kind, rid, model, created, choice(i, None, role=True)))
            elif echo and echo[i]:
                yield _sse(api.chunk(kind, rid, model, created, choice(i, echo[i])))
        left = len(requests)
        while left:
            try:
                i, item = await asyncio.wait_for(queue.get(), POLL_S)
            except asyncio.TimeoutError:
                if await _disconnected(http):
                    return
                continue
            if isinstance(item, Exception):
                yield _sse(api.error_body(f"the engine failed: {item}", "server_error"))
                return
            if item is None:
                left -= 1
                finish = api.FINISH[requests[i].finish_reason or "cancelled"]
                yield _sse(api.chunk(kind, rid, model, created, choice(i, None, finish)))
                continue
            if item.text:
                yield _sse(api.chunk(kind, rid, model, created, choice(i, item.text)))
        if usage_wanted:
            made = sum(len(r.result().tokens) for r in requests)
            yield _sse(api.chunk(kind, rid, model, created, None, api.usage(prompt_tokens, made)))
        yield _sse("[DONE]")
    finally:
        for t in tasks:
            t.cancel()
        for r in requests:
            r.cancel()


# ---- running it ----------------------------------------------------------------------------------------


def config(app: Any, host: str, port: int, drain_timeout: float, log_level: str = "info") -> Any:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout,
                          lifespan="on")  # fmt: skip


class _Server(uvicorn.Server):
    """uvicorn's server, its signal handling made a server's: the first SIGINT or SIGTERM drains and
    stops (the process then exits 0), a second one stops at once. (uvicorn raises the signal again
    after its graceful shutdown, which ends the process as if killed by it.)"""

    signalled: int | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.signalled = self.signalled or sig
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


def serve(engine: Engine, model_name: str, host: str, port: int, drain_timeout: float = 30.0,
          say: Callable[[str], None] | None = None) -> int | None:  # fmt: skip
    """Serve until SIGINT or SIGTERM: no new connections, the running requests finish (at most
    ``drain_timeout`` s), then the app's shutdown drains and closes the engine. The signal that
    stopped it, if one did."""
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    app = make_app(engine, model_name, drain_timeout=drain_timeout)
    server = _Server(config(app, host, port, drain_timeout))
    say(f"megaloop serve: {model_name!r} on http://{host}:{port}/v1; Ctrl-C or SIGTERM drains and stops")
    server.run()
    return server.signalled


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (port 0: a free one), for servers started in-process."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock
