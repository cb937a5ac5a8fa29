"""Two guards in front of the routes, as plain ASGI middleware (no body is parsed first).

``BodyGuard`` reads a request's body before any route sees it, within ``max_bytes`` and
``timeout_s``: a ``Content-Length`` over the limit is a 413 before one byte of the body is
read, a body that grows past it is a 413 as soon as it does, and a client that sends its
body too slowly is a 408, so a slow client cannot hold a connection for ever. ``ApiKey``
answers 401 to any ``/v1/`` request without ``Authorization: Bearer <key>`` (vLLM's
``--api-key``); ``/health`` and ``/metrics`` stay open, for probes and scrapers.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from minisrv.server.protocol import error_body
from minisrv.server.responses import ERROR_KINDS

__all__ = ["ApiKey", "BodyGuard"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, status: int, message: str,
                     headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """An OpenAI error body; ``connection: close``, since the body may be left unread."""
    body = json.dumps(error_body(message, None, status, ERROR_KINDS.get(status,
                                                                       "invalid_request_error")))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body.encode()})


class BodyGuard:
    """Bounded, timed body reads (see the module's docstring)."""

    def __init__(self, app: App, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_big = f"the request body is larger than the server's limit of {self.max_bytes} bytes"
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await send_error(send, 413, too_big)
            return
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                await send_error(send, 408, f"the request body did not arrive within "
                                 f"{self.timeout_s:g} s")
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await send_error(send, 413, too_big)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class ApiKey:
    """401 for ``/v1/`` requests without the key (compared in constant time)."""

    def __init__(self, app: App, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope.get("headers", ())).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await send_error(send, 401, "missing or wrong API key: send "
                                 "'Authorization: Bearer <key>'",
                                 ((b"www-authenticate", b"Bearer"),))
                return
        await self.app(scope, receive, send)
