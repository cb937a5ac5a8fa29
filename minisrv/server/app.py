"""The HTTP layer: FastAPI routes speaking OpenAI's protocol, on top of ``Frontend``.

One request's path: the body is read within its size and time limits (``middleware``) and
validated (pydantic; a bad body is a 400 in OpenAI's error format); its text is encoded
with the served model's tokenizer (off the event loop when long) and checked at the door
(``door``: ids, lengths, sampling parameters); one engine request is opened per prompt and
per ``n``; then the handler awaits the tokens the engine delivers, detokenizes them
(``TextStream``) and either streams them as server-sent events (``data: {chunk}``, a chunk
with ``finish_reason``, an optional usage chunk with ``choices: []``, then ``data:
[DONE]``) or returns one JSON body at the end. An engine's error arrives as an event: before
the first byte it is the answer's status (400, 500, or 503 with ``Retry-After`` when no
worker can serve); in a stream it is an error event followed by ``[DONE]``. A client that
goes away has its requests aborted, which frees their KV slots.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from minisrv.server.config import ServerConfig
from minisrv.server.door import (
    BadRequest,
    chat_messages,
    check_fits,
    check_supported,
    completion_prompts,
    off_loop,
    room,
    sampling_params,
)
from minisrv.server.frontend import Frontend, Reply
from minisrv.server.middleware import ApiKey, BodyGuard
from minisrv.server.protocol import ChatCompletionRequest, CompletionRequest, now
from minisrv.server.responses import Call, error_of, error_response
from minisrv.server.textstream import TextStream
from minisrv.server.worker import Unavailable

__all__ = ["BadRequest", "completion_prompts", "create_app", "sampling_params"]

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming handler checks its client


def _error(status: int, message: str, param: str | None = None,
           kind: str | None = None, retry_after: float | None = None) -> JSONResponse:
    return error_response(status, message, param, kind, retry_after)


def create_app(engines: Any, codec: Any, served_name: str,
               config: ServerConfig | None = None) -> FastAPI:
    """The ASGI app serving ``engines`` (a ``LocalEngine`` or ``DataParallelEngines``)
    with ``codec`` (the model's tokenizer); ``config`` defaults to the engines' own."""
    config = config or engines.config
    served = Served(engines, codec, served_name, Frontend(engines))
    app = FastAPI(title="minisrv", lifespan=served.lifespan)
    app.state.frontend = served.frontend
    add_error_handlers(app)
    add_status_routes(app, served)
    add_model_routes(app, served)
    add_completion_routes(app, served)
    app.add_middleware(BodyGuard, max_bytes=config.request_limit(),  # type: ignore[arg-type]
                       timeout_s=config.body_timeout)
    if config.api_key:  # added last: the outermost, so a request without the key is not read
        app.add_middleware(ApiKey, key=config.api_key)  # type: ignore[arg-type]
    return app


@dataclass(frozen=True)
class Served:
    """What the routes share: the engines, the model's tokenizer and served name, and the
    ``Frontend`` that records the replies in flight."""

    engines: Any
    codec: Any
    name: str
    frontend: Frontend

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """The frontend runs while the app does; the engines close after it."""
        self.frontend.start()
        # A streamed reply loads anyio's asyncio backend on first use: load it now, not in
        # the middle of the first replies, where it competes with the engine for the GIL.
        await anyio.sleep(0)
        yield
        await asyncio.to_thread(self.engines.close)

    def status(self) -> str:
        """``ok``, ``starting``, ``restarting``, ``draining`` or ``failed``."""
        if self.engines.failed:
            return "failed"
        if self.frontend.draining:
            return "draining"
        if self.frontend.ready:
            return "ok"
        restarting = any(w["state"] == "restarting" for w in self.engines.workers())
        return "restarting" if restarting else "starting"

    def card(self) -> dict[str, Any]:
        """The served model as ``/v1/models`` lists it."""
        return {"id": self.name, "object": "model", "created": now(), "owned_by": "minisrv",
                "max_model_len": self.engines.limits.get("max_context")}

    def refuse(self, body: CompletionRequest | ChatCompletionRequest) -> JSONResponse | None:
        """The answer to a generation request this server cannot take now (``None``: it
        can): draining, no engine ready, or another model asked for."""
        if self.frontend.draining:
            return _error(503, "the server is shutting down", retry_after=1.0)
        if not self.frontend.ready:
            return _error(503, "no engine is ready (loading the model, or restarting a worker "
                          "that died); retry when /health answers 200", retry_after=1.0)
        if body.model not in (None, "", self.name):
            return _error(400, f"unknown model {body.model!r}; this server serves "
                          f"{self.name!r}", "model")
        return None


def add_error_handlers(app: FastAPI) -> None:
    """A body that fails validation and an HTTP error answer in OpenAI's error format."""

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request body")
        if first.get("type") == "json_invalid":
            message, param = f"the body is not valid JSON: {message}", None
        elif param:
            message = f"{param}: {message}"
        return _error(400, message, param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), None,
                      "not_found_error" if exc.status_code == 404 else "invalid_request_error")


def add_status_routes(app: FastAPI, served: Served) -> None:
    """``/health``, ``/workers`` and ``/metrics``."""
    engines, frontend = served.engines, served.frontend

    @app.get("/health")
    async def health() -> Response:
        """200 while a worker serves; 503 with the reason otherwise (``starting``,
        ``restarting``: no worker is up, ``draining``: shutting down, ``failed``)."""
        status = served.status()
        body: dict[str, Any] = {"status": status}
        if engines.failed:
            body["error"] = engines.failed
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/workers")
    async def workers() -> dict[str, Any]:
        """The server's process id and each engine worker's state, pid and restarts."""
        return {"status": served.status(), "pid": os.getpid(), "workers": engines.workers()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(frontend.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")


def add_model_routes(app: FastAPI, served: Served) -> None:
    """``/v1/models`` and ``/v1/models/{id}``: the one model served."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [served.card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id != served.name:
            return _error(404, f"the model {model_id!r} does not exist; this server serves "
                          f"{served.name!r}", "model")
        return JSONResponse(served.card())


def add_completion_routes(app: FastAPI, served: Served) -> None:
    """``/v1/completions`` and ``/v1/chat/completions``."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await complete_text(served, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await complete_chat(served, body, request)


async def complete_text(served: Served, body: CompletionRequest, request: Request) -> Response:
    """A completion: every prompt (text or ids) encoded and checked, then generated."""
    if (refused := served.refuse(body)) is not None:
        return refused
    codec, limits = served.codec, served.engines.limits
    size = len(body.prompt) if isinstance(body.prompt, str) else sum(
        len(p) if isinstance(p, str) else 1 for p in body.prompt)
    try:
        check_supported(body)
        prompts, texts = await off_loop(size, completion_prompts, codec, body.prompt)
        limit = [body.max_tokens or room(limits, p) for p in prompts]
        for prompt, n in zip(prompts, limit):
            check_fits(prompt, n, limits)
    except BadRequest as exc:
        return _error(400, str(exc), exc.param)
    if body.echo:
        texts = [t or codec.decode(p) for t, p in zip(texts, prompts)]
    return await generate(served.frontend, codec, served.name, request, body, prompts, limit,
                          chat=False, echo=texts if body.echo else None)


async def complete_chat(served: Served, body: ChatCompletionRequest,
                        request: Request) -> Response:
    """A chat completion: the messages in the model's chat template, checked, generated."""
    if (refused := served.refuse(body)) is not None:
        return refused
    limits = served.engines.limits
    try:
        check_supported(body)
        messages = chat_messages(body)
        size = sum(len(m["content"]) for m in messages)
        try:
            prompt = await off_loop(size, served.codec.chat_prompt, messages)
        except ValueError as exc:
            raise BadRequest(str(exc), "messages") from exc
        limit = [body.token_limit or room(limits, prompt)]
        check_fits(prompt, limit[0], limits)
    except BadRequest as exc:
        return _error(400, str(exc), exc.param)
    return await generate(served.frontend, served.codec, served.name, request, body, [prompt],
                          limit, chat=True)


@asynccontextmanager
async def watch_disconnect(request: Request, queue: asyncio.Queue[Any]) -> AsyncIterator[None]:
    """While inside, put ``None`` in ``queue`` once the client has gone away (a streaming
    response watches by itself: Starlette cancels it when the client disconnects)."""

    async def watch() -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                queue.put_nowait(None)
                return

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()


async def generate(frontend: Frontend, codec: Any, served_name: str, request: Request,
                   body: Any, prompts: list[list[int]], limits: list[int], *, chat: bool,
                   echo: list[str] | None = None) -> Response:
    """Open every choice, wait for each one's first event (errors come before tokens), then
    answer with a stream or with one body."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    replies: list[Reply] = []
    streams: dict[int, TextStream] = {}
    stops = body.stop_strings()
    stop_ids = frozenset() if body.ignore_eos else codec.stop_ids
    try:
        for p, (prompt, limit) in enumerate(zip(prompts, limits)):
            for j in range(body.n):
                index = p * body.n + j
                params = sampling_params(body, limit, j, frontend.engines.limits.get(
                    "vocab_size"))
                if params.processed and frontend.engines.config.engine.overlap:
                    raise BadRequest("penalties, logit_bias and min_tokens need a server "
                                     "without --overlap (its next step is formed before "
                                     "this one's token is known)", "presence_penalty")
                replies.append(frontend.open(prompt, params, index, queue))
                streams[index] = TextStream(codec, stops, stop_ids)
    except (BadRequest, Unavailable) as exc:
        for reply in replies:
            frontend.abort(reply)
        if isinstance(exc, Unavailable):
            return _error(503, str(exc), retry_after=exc.retry_after)
        return _error(400, str(exc), exc.param)
    call = Call(frontend, streams, {reply.index: reply for reply in replies}, chat,
                served_name, body, sum(len(p) for p in prompts), echo)
    first: list[Any] = []
    waiting = set(streams)
    async with watch_disconnect(request, queue):
        while waiting:
            item = await queue.get()
            if item is None:
                return call.client_gone()
            first.append(item)
            waiting.discard(item[0])
            if item[1].error is not None:
                for reply in replies:
                    frontend.abort(reply)
                return error_of(item[1])
        if not body.stream:
            return await call.complete(first, queue)
    return StreamingResponse(call.sse(first, queue), media_type="text/event-stream")
