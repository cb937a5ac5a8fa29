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
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from minisrv.sampling import SamplingParams
from minisrv.server.frontend import Frontend, Reply
from minisrv.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    new_id,
    now,
    usage,
)
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
    return JSONResponse(error_body(message, param, status, kind), status_code=status)


def create_app(engines: Any, codec: Any, served_name: str) -> FastAPI:
    """The ASGI app serving ``engines`` (a ``LocalEngine`` or ``DataParallelEngines``)."""
    frontend = Frontend(engines)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        frontend.start()
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


async def next_or_disconnect(queue: asyncio.Queue[Any], request: Request) -> Any:
    """The next item of ``queue``, or None once the client has gone away."""
    while True:
        try:
            return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                return None


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
    first: list[Any] = []
    waiting = set(streams)
    while waiting:
        item = await next_or_disconnect(queue, request)
        if item is None:
            for reply in replies:
                frontend.abort(reply, disconnected=True)
            return Response(status_code=499)
        first.append(item)
        waiting.discard(item[0])
        if item[3] is not None:
            for reply in replies:
                frontend.abort(reply)
            internal = item[3].startswith("engine error")
            return _error(500 if internal else 400, item[3], None if internal else "prompt",
                          "internal_error" if internal else "invalid_request_error")
    reply_of = {reply.index: reply for reply in replies}
    call = Call(frontend, streams, reply_of, chat, served_name, body,
                sum(len(p) for p in prompts), echo)
    if body.stream:
        return StreamingResponse(call.sse(first, queue), media_type="text/event-stream")
    return await call.complete(first, queue, request)


class Call:
    """One HTTP request's choices, turned into OpenAI chunks or one OpenAI body."""

    def __init__(self, frontend: Frontend, streams: dict[int, TextStream],
                 replies: dict[int, Reply], chat: bool, served_name: str, body: Any,
                 prompt_tokens: int, echo: list[str] | None) -> None:
        self.frontend, self.streams, self.replies = frontend, streams, replies
        self.chat, self.model, self.body = chat, served_name, body
        self.prompt_tokens, self.echo = prompt_tokens, echo
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = now()
        self.texts: dict[int, list[str]] = {i: [] for i in streams}

    @property
    def finished(self) -> bool:
        return all(s.finish is not None for s in self.streams.values())

    def take(self, item: Any) -> tuple[int, str, str | None, str | None]:
        """Apply one event: (index, new text, finish reason once it ends, error)."""
        index, tokens, engine_finish, error = item
        stream = self.streams[index]
        if stream.finish is not None:  # already ended by a stop string
            return index, "", None, None
        if error is not None:
            stream.finish = "error"
            return index, "", "error", error
        text = stream.add(tokens)
        if stream.finish is not None:  # a stop string or stop id: the engine may go on
            self.frontend.abort(self.replies[index])
        elif engine_finish is not None:
            text += stream.close(engine_finish)
        return index, text, stream.finish, None

    def usage(self) -> dict[str, int]:
        completion = sum(s.n_tokens for s in self.streams.values())
        return usage(self.prompt_tokens, completion)

    # ------------------------------------------------------------------ streaming
    def chunk(self, index: int, text: str | None, finish: str | None,
              role: bool = False) -> str:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or ""}
            kind = "text_completion"
        choice.update(logprobs=None, finish_reason=finish)
        return self.event({"id": self.id, "object": kind, "created": self.created,
                           "model": self.model, "choices": [choice]})

    @staticmethod
    def event(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

    async def sse(self, first: list[Any], queue: asyncio.Queue[Any]) -> AsyncIterator[str]:
        try:
            for index in sorted(self.streams):
                if self.chat:
                    yield self.chunk(index, "", None, role=True)
                elif self.echo:
                    yield self.chunk(index, self.echo[index // self.body.n], None)
            pending = list(first)
            while not self.finished:
                item = pending.pop(0) if pending else await queue.get()
                index, text, finish, error = self.take(item)
                if error is not None:
                    yield self.event(error_body(error, None, 500, "internal_error"))
                if text:
                    yield self.chunk(index, text, None)
                if finish is not None:
                    yield self.chunk(index, None if self.chat else "", finish)
            if self.body.include_usage:
                yield self.event({"id": self.id, "object": "chat.completion.chunk" if self.chat
                                  else "text_completion", "created": self.created,
                                  "model": self.model, "choices": [], "usage": self.usage()})
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the stream ended): free what still runs
            for reply in self.replies.values():
                self.frontend.abort(reply, disconnected=True)

    # ------------------------------------------------------------------ one body
    async def complete(self, first: list[Any], queue: asyncio.Queue[Any],
                       request: Request) -> Response:
        pending = list(first)
        errors = []
        while not self.finished:
            item = pending.pop(0) if pending else await next_or_disconnect(queue, request)
            if item is None:
                for reply in self.replies.values():
                    self.frontend.abort(reply, disconnected=True)
                return Response(status_code=499)
            index, text, _, error = self.take(item)
            self.texts[index].append(text)
            if error is not None:
                errors.append(error)
        if errors:
            return _error(500, errors[0], None, "internal_error")
        choices = []
        for index in sorted(self.streams):
            text = "".join(self.texts[index])
            finish = self.streams[index].finish
            if self.chat:
                choices.append({"index": index, "logprobs": None, "finish_reason": finish,
                                "message": {"role": "assistant", "content": text}})
            else:
                if self.echo:
                    text = self.echo[index // self.body.n] + text
                choices.append({"index": index, "text": text, "logprobs": None,
                                "finish_reason": finish})
        return JSONResponse({"id": self.id, "object": "chat.completion" if self.chat
                             else "text_completion", "created": self.created,
                             "model": self.model, "choices": choices, "usage": self.usage()})
