"""The asyncio side of the server: requests in flight, and tokens routed back to them.

``Frontend.open`` submits one engine request and returns its ``Reply``; the engine thread
(or a worker process's reader thread) calls ``deliver`` with each step's events, which
hops onto the event loop with ``loop.call_soon_threadsafe`` and puts every request's new
tokens in the queue its HTTP handler awaits. The front end is also where latencies are
measured for ``/metrics``: from the moment the request was received to each token's
arrival here, which is what a client sees.

At shutdown the front end drains: ``draining`` refuses new requests (503), ``fail_all``
ends what is still in flight with a 503 error event, so every handler answers (a stream
with an error event and ``[DONE]``) before the server closes its connections.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from minisrv.sampling import SamplingParams
from minisrv.server.messages import TokenEvent, error_event
from minisrv.server.metrics import ServerMetrics

__all__ = ["Frontend", "Reply"]


@dataclass
class Reply:
    """One engine request as its handler sees it: ``(index, TokenEvent)`` items arrive in
    ``queue``, which several replies of one HTTP request (``n``, prompt lists) share,
    ``index`` telling them apart (``None`` in the queue: the client went away)."""

    key: int
    index: int
    prompt_len: int
    queue: asyncio.Queue[tuple[int, TokenEvent] | None]
    received: float = field(default_factory=time.perf_counter)
    last: float | None = None
    done: bool = False


class Frontend:
    """Keeps the replies in flight and feeds them from the engine's events."""

    def __init__(self, engines: Any) -> None:
        self.engines = engines
        self.replies: dict[int, Reply] = {}
        self.latest: dict[str, float] = {}
        self.metrics = ServerMetrics(
            lambda: {**self.latest, "workers_up": float(engines.up)})
        self._keys = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.draining = False  # shutting down: no new requests

    def start(self) -> None:
        """Start the engines (non-blocking); call from the running event loop."""
        self._loop = asyncio.get_running_loop()
        self.engines.start(self.deliver)

    @property
    def ready(self) -> bool:
        return bool(self.engines.ready)

    @property
    def in_flight(self) -> int:
        """Engine requests whose handler still waits for tokens."""
        return len(self.replies)

    def fail_all(self, message: str, status: int = 503) -> None:
        """End every reply in flight with an error event (the server is shutting down)."""
        events = [error_event(key, message, status) for key in list(self.replies)]
        for reply in list(self.replies.values()):
            self.engines.abort(reply.key)
        self._dispatch(events, {})

    # ------------------------------------------------------------------ requests
    def open(self, prompt: list[int], params: SamplingParams, index: int,
             queue: asyncio.Queue[Any]) -> Reply:
        """Submit one request; ``Unavailable`` if no engine can take it now (a request the
        engine refuses comes back as an error event)."""
        key = next(self._keys)
        reply = Reply(key, index, len(prompt), queue)
        self.replies[key] = reply
        try:
            self.engines.submit(key, prompt, params)
        except Exception:
            self._forget(reply)
            raise
        self.metrics.requests.inc()
        self.metrics.prompt_tokens.inc(len(prompt))
        return reply

    def abort(self, reply: Reply, disconnected: bool = False) -> None:
        """Stop generating for ``reply`` (client gone, or a stop string ended it)."""
        if reply.done:
            return
        self.engines.abort(reply.key)
        self._forget(reply)
        if disconnected:
            self.metrics.aborted.inc()

    def _forget(self, reply: Reply) -> None:
        reply.done = True
        if self.replies.pop(reply.key, None) is not None:
            self.engines.done(reply.key)

    # ------------------------------------------------------------------ engine side
    def deliver(self, events: list[TokenEvent], snapshot: dict[str, float]) -> None:
        """Called from an engine thread: hand the events to the event loop."""
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._dispatch, events, snapshot)
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass

    def _dispatch(self, events: list[TokenEvent], snapshot: dict[str, float]) -> None:
        if snapshot:
            self.latest = snapshot
        now = time.perf_counter()
        m = self.metrics
        generated = 0
        for event in events:
            reply = self.replies.get(event.key)
            if reply is None:  # aborted meanwhile
                continue
            tokens = event.tokens
            if tokens:
                generated += len(tokens)
                if reply.last is None:
                    m.ttft.observe(now - reply.received)
                else:
                    m.itl.observe(now - reply.last)
                reply.last = now
            if event.ended:
                if event.finish is not None:
                    m.e2e.observe(now - reply.received)
                else:
                    m.failed.inc()
                self._forget(reply)
            reply.queue.put_nowait((reply.index, event))
        if generated:
            m.generation_tokens.inc(generated)
