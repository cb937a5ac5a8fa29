"""OpenAI's answers for one HTTP call: a stream of chunks, or one body at the end.

A call holds one or more choices (``n``, or a list of prompts), each fed by its own engine
request. Streaming sends, per choice, chunks with the new text (for chat, a first chunk
with ``delta.role``), a chunk with ``finish_reason``, then, when
``stream_options.include_usage`` is set, one chunk with ``choices: []`` and the usage, and
``data: [DONE]``, as OpenAI, SGLang and vLLM do.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi.responses import JSONResponse, Response

from minisrv.server.frontend import Frontend, Reply
from minisrv.server.logprobs import Entries, chat_logprobs, completion_logprobs
from minisrv.server.messages import TokenEvent
from minisrv.server.protocol import error_body, new_id, now, usage
from minisrv.server.textstream import TextStream

__all__ = ["ERROR_KINDS", "Call", "error_of", "error_response"]


ERROR_KINDS = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 408: "timeout_error", 413: "invalid_request_error",
               500: "internal_error", 503: "service_unavailable"}


def error_response(status: int, message: str, param: str | None = None,
                   kind: str | None = None, retry_after: float | None = None) -> JSONResponse:
    """An HTTP error with OpenAI's JSON error object (``Retry-After`` when given)."""
    kind = kind or ERROR_KINDS.get(status, "invalid_request_error")
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after else None
    return JSONResponse(error_body(message, param, status, kind), status_code=status,
                        headers=headers)


def error_of(event: TokenEvent) -> JSONResponse:
    """The answer to a request whose event failed before anything was sent."""
    param = "prompt" if event.status == 400 else None
    retry = 1.0 if event.status == 503 else None
    return error_response(event.status, event.error or "", param, retry_after=retry)


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
        self.taken: Entries = []  # the logprobs of the tokens the last ``take`` consumed
        self.kept: dict[int, Entries] = {i: [] for i in streams}  # every choice's, so far
        self.offsets: dict[int, int] = dict.fromkeys(streams, 0)  # text_offset, streaming
        self._open = sum(s.finish is None for s in streams.values())  # choices not ended

    @property
    def finished(self) -> bool:
        """Every choice has ended (counted down in ``take``: it is asked once per event)."""
        return self._open == 0

    def take(self, item: tuple[int, TokenEvent]) -> tuple[int, str, str | None,
                                                          TokenEvent | None]:
        """Apply one event: (index, new text, finish reason once it ends, the event if it
        is an error)."""
        index, event = item
        stream = self.streams[index]
        self.taken = []
        if stream.finish is not None:  # already ended by a stop string
            return index, "", None, None
        if event.error is not None:
            stream.finish = "error"
            self._open -= 1
            return index, "", "error", event
        before = stream.n_tokens
        text = stream.add(event.tokens)
        if event.logprobs is not None:
            consumed = stream.n_tokens - before
            self.taken = list(zip(event.tokens[:consumed], event.logprobs[:consumed]))
            self.kept[index].extend(self.taken)
        if stream.finish is not None:  # a stop string or stop id: the engine may go on
            self.frontend.abort(self.replies[index])
        elif event.finish is not None:
            text += stream.close(event.finish)
        if stream.finish is not None:
            self._open -= 1
        return index, text, stream.finish, None

    def usage(self) -> dict[str, int]:
        completion = sum(s.n_tokens for s in self.streams.values())
        return usage(self.prompt_tokens, completion)

    # ------------------------------------------------------------------ streaming
    def logprobs(self, index: int, entries: Entries, offset: int = 0) -> dict[str, Any] | None:
        """The ``logprobs`` of a choice for ``entries`` (None when they were not asked)."""
        if self.body.top_logprobs_wanted is None:
            return None
        codec = self.streams[index].codec
        if self.chat:
            return chat_logprobs(codec, entries)
        return completion_logprobs(codec, entries, offset)

    def chunk(self, index: int, text: str | None, finish: str | None,
              role: bool = False, logprobs: dict[str, Any] | None = None) -> str:
        """One ``data:`` event with one choice; the fields every chunk of this call shares
        are serialised once (``_head``), the choice each time: a token's chunk (no role, no
        logprobs) by hand around ``json.dumps`` of its text alone, which takes the encoder's
        C path (a dict with ``separators`` builds a new encoder per call); the same bytes."""
        if not role and logprobs is None:
            end = "null" if finish is None else json.dumps(finish)
            if not self.chat:
                return (f'{self._head}{{"index":{index},"text":{json.dumps(text or "")},'
                        f'"logprobs":null,"finish_reason":{end}}}]}}\n\n')
            content = "" if text is None else f'"content":{json.dumps(text)}'
            return (f'{self._head}{{"index":{index},"delta":{{{content}}},'
                    f'"logprobs":null,"finish_reason":{end}}}]}}\n\n')
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice.update(logprobs=logprobs, finish_reason=finish)
        return f"{self._head}{json.dumps(choice, separators=(',', ':'))}]}}\n\n"

    @functools.cached_property
    def _head(self) -> str:
        """``data: {"id":...,"object":...,"created":...,"model":...,"choices":[``."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        shared = json.dumps({"id": self.id, "object": kind, "created": self.created,
                             "model": self.model}, separators=(",", ":"))
        return f'data: {shared[:-1]},"choices":['

    @staticmethod
    def event(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

    async def sse(self, first: list[Any], queue: asyncio.Queue[Any]) -> AsyncIterator[str]:
        """The call's events. Whatever has arrived when the handler runs goes out in one
        write: a server that falls behind its engine sends several tokens' events at once
        instead of paying for one write per token."""
        try:
            opening = []
            for index in sorted(self.streams):
                if self.chat:
                    opening.append(self.chunk(index, "", None, role=True))
                elif self.echo:
                    opening.append(self.chunk(index, self.echo[index // self.body.n], None))
            if opening:
                yield "".join(opening)
            pending = deque(first)
            while not self.finished:
                if not pending:
                    pending.append(await queue.get())
                    while not queue.empty():
                        pending.append(queue.get_nowait())
                yield "".join(self._events(pending))
        finally:  # the client went away (or the stream ended): free what still runs
            for reply in self.replies.values():
                self.frontend.abort(reply, disconnected=True)

    def _events(self, pending: deque[Any]) -> Iterator[str]:
        """The events for the items in ``pending`` (taken from it), and the closing ones
        (usage, ``[DONE]``) once every choice has finished."""
        while pending and not self.finished:
            index, text, finish, error = self.take(pending.popleft())
            if error is not None:
                yield self.event(error_body(error.error or "", None, error.status,
                                            ERROR_KINDS.get(error.status, "internal_error")))
            if self.taken:
                offset = self.offsets[index]
                self.offsets[index] += sum(len(self.streams[index].codec.id_to_str(t))
                                           for t, _ in self.taken)
                yield self.chunk(index, text, None,
                                 logprobs=self.logprobs(index, self.taken, offset))
            elif text:
                yield self.chunk(index, text, None)
            if finish is not None:
                yield self.chunk(index, None if self.chat else "", finish)
        if self.finished:
            if self.body.include_usage:
                yield self.event({"id": self.id, "object": "chat.completion.chunk" if self.chat
                                  else "text_completion", "created": self.created,
                                  "model": self.model, "choices": [], "usage": self.usage()})
            yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ one body
    def client_gone(self) -> Response:
        """Abort every choice still running; the status is nginx's "client closed" 499,
        which nobody receives."""
        for reply in self.replies.values():
            self.frontend.abort(reply, disconnected=True)
        return Response(status_code=499)

    async def complete(self, first: list[Any], queue: asyncio.Queue[Any]) -> Response:
        """Collect every choice to its end; one JSON body (``None`` in ``queue``: the client
        went away)."""
        pending = list(first)
        errors = []
        while not self.finished:
            item = pending.pop(0) if pending else await queue.get()
            if item is None:
                return self.client_gone()
            index, text, _, error = self.take(item)
            self.texts[index].append(text)
            if error is not None:
                errors.append(error)
        if errors:
            return error_of(errors[0])
        choices = []
        for index in sorted(self.streams):
            text = "".join(self.texts[index])
            finish = self.streams[index].finish
            if self.chat:
                choices.append({"index": index, "logprobs": self.logprobs(index, self.kept[index]),
                                "finish_reason": finish,
                                "message": {"role": "assistant", "content": text}})
            else:
                if self.echo:
                    text = self.echo[index // self.body.n] + text
                choices.append({"index": index, "text": text,
                                "logprobs": self.logprobs(index, self.kept[index]),
                                "finish_reason": finish})
        return JSONResponse({"id": self.id, "object": "chat.completion" if self.chat
                             else "text_completion", "created": self.created,
                             "model": self.model, "choices": choices, "usage": self.usage()})
