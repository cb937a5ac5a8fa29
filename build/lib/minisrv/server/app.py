"""The HTTP layer: FastAPI routes speaking OpenAI's protocol, on top of ``Frontend``.

One request's path: the body is validated (pydantic; a bad body is a 400 in OpenAI's
error format), its text encoded with the served model's tokenizer, one engine request
opened per prompt and per ``n``; then the handler awaits the tokens the engine thread
delivers, detokenizes them (``TextStream``) and either streams them as server-sent
events (``data: {chunk}``, a chunk with ``finish_reason``, an optional usage chunk with
``choices: []``, then ``data: [DONE]``) or returns one JSON body at the end. Errors that
can only be found by the engine (a prompt too long for the context or the KV pool) arrive
before the first token, so they too are answered with a 400 before any byte is streamed.
A client that goes away has its requests aborted, which frees their KV slots.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from minisrv.sampling import SamplingParams
from minisrv.server.frontend import Frontend, Reply
from minisrv.server.protocol import ChatCompletionRequest, CompletionRequest, now
from minisrv.server.responses import Call, error_response
from minisrv.server.textstream import TextStream

__all__ = ["create_app"]

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming handler checks its client


class BadRequest(ValueError):
    """A request the server refuses; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _error(status: int, message: str, param: str | None = None,
           kind: str = "invalid_request_error") -> JSONResponse:
    return error_response(status, message, param, kind)


def create_app(engines: Any, codec: Any, served_name: str) -> FastAPI:
    """The ASGI app serving ``engines`` (a ``LocalEngine`` or ``DataParallelEngines``)."""
    frontend = Frontend(engines)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        frontend.start()
        # A streamed reply loads anyio's asyncio backend on first use: load it now, not in
        # the middle of the first replies, where it competes with the engine for the GIL.
        await anyio.sleep(0)
        yield
        await asyncio.to_thread(engines.close)

    app = FastAPI(title="minisrv", lifespan=lifespan)
    app.state.frontend = frontend

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

    @app.get("/health")
    async def health() -> Response:
        if engines.failed:
            return JSONResponse({"status": "failed", "error": engines.failed}, status_code=503)
        if not frontend.ready:
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(frontend.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": served_name, "object": "model", "created": now(), "owned_by": "minisrv",
                "max_model_len": engines.limits.get("max_context")}
        return {"object": "list", "data": [card]}

    def refuse(body: CompletionRequest | ChatCompletionRequest) -> JSONResponse | None:
        if not frontend.ready:
            return _error(503, "the server is still loading the model; retry when /health "
                          "answers 200", None, "service_unavailable")
        if body.model not in (None, "", served_name):
            return _error(400, f"unknown model {body.model!r}; this server serves "
                          f"{served_name!r}", "model")
        if body.logprobs not in (None, False, 0):
            return _error(400, "logprobs are not supported by minisrv yet", "logprobs")
        return None

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if (refused := refuse(body)) is not None:
            return refused
        try:
            prompts, texts = completion_prompts(codec, body.prompt)
            limit = [body.max_tokens or room(engines, p) for p in prompts]
        except BadRequest as exc:
            return _error(400, str(exc), exc.param)
        return await generate(frontend, codec, served_name, request, body, prompts, limit,
                              chat=False, echo=texts if body.echo else None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        if (refused := refuse(body)) is not None:
            return refused
        if not any(m.content for m in body.messages):
            return _error(400, "the messages hold no text", "messages")
        try:
            prompt = codec.chat_prompt(body.messages)
        except ValueError as exc:
            return _error(400, str(exc), "messages")
        limit = [body.token_limit or room(engines, prompt)]
        return await generate(frontend, codec, served_name, request, body, [prompt], limit,
                              chat=True)

    return app


def room(engines: Any, prompt: list[int]) -> int:
    """The default reply length where none is given: what the context and pool leave."""
    limits = engines.limits
    bound = min(limits.get("max_context") or 1 << 30, limits.get("kv_capacity") or 1 << 30)
    return max(1, bound - len(prompt))  # a prompt that fills it all fails the engine's check


def completion_prompts(codec: Any, prompt: Any) -> tuple[list[list[int]], list[str]]:
    """Token prompts (and their texts, for ``echo``) from any form ``prompt`` may take."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise BadRequest("prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    out, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise BadRequest("prompt is empty", "prompt")
            try:
                out.append(codec.encode(p))
            except ValueError as exc:
                raise BadRequest(str(exc), "prompt") from exc
            texts.append(p)
        else:
            if not p:
                raise BadRequest("prompt is an empty list of token ids", "prompt")
            out.append(list(p))
            texts.append(codec.decode(list(p)))
    return out, texts


def sampling_params(body: Any, max_tokens: int, j: int) -> SamplingParams:
    """The engine's ``SamplingParams`` for choice ``j`` of a request (seed + j, so that the
    ``n`` samples of one seeded request differ from each other and still repeat)."""
    temperature = body.temperature
    if body.top_k not in (None, -1, 0):
        if body.top_k != 1:
            raise BadRequest(f"top_k={body.top_k} is not supported: minisrv samples with "
                             "temperature and top_p; use top_k -1 or 0 (off) or 1 (greedy)",
                             "top_k")
        temperature = 0.0  # the single most likely token: greedy
    seed = None if body.seed is None else body.seed + j
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=temperature,
                              top_p=body.top_p, seed=seed, ignore_eos=body.ignore_eos)
    except ValueError as exc:
        raise BadRequest(str(exc), None) from exc


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
    try:
        for p, (prompt, limit) in enumerate(zip(prompts, limits)):
            for j in range(body.n):
                index = p * body.n + j
                params = sampling_params(body, limit, j)
                replies.append(frontend.open(prompt, params, index, queue))
                streams[index] = TextStream(codec, stops, codec.stop_ids)
    except ValueError as exc:
        for reply in replies:
            frontend.abort(reply)
        return _error(400, str(exc), getattr(exc, "param", "prompt"))
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
            if item[3] is not None:
                for reply in replies:
                    frontend.abort(reply)
                internal = item[3].startswith("engine error")
                return _error(500 if internal else 400, item[3],
                              None if internal else "prompt",
                              "internal_error" if internal else "invalid_request_error")
        if not body.stream:
            return await call.complete(first, queue)
    return StreamingResponse(call.sse(first, queue), media_type="text/event-stream")
