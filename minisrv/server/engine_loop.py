"""The engine loop of a server: one thread that owns the scheduler and steps it forever.

HTTP handlers never touch the scheduler. They put commands (submit a request, abort one)
into a queue; the loop drains the queue *between* steps, so a request that arrives while
a step runs joins the batch at the next step (continuous batching), and a request whose
client went away is aborted before the next step and its KV freed. After each step the
loop hands every new token to ``emit`` in one call, so the cost of crossing from this
thread to the asyncio event loop (or to another process, for ``--dp``) is paid once per
step, not once per token.

When nothing is queued or running, the loop blocks on the queue and uses no CPU (given a
``beat``, it wakes every ``beat_every`` seconds to call it, so that a supervisor can tell an
idle loop from a hung one: ``beat`` is called between every two steps and every wait).

The loop drives the engine through its public calls only (``add_request``, ``step``,
``abort``, ``snapshot``): a request the engine refuses comes back as a 400 error event,
and a step that raises fails the requests that likely caused it (``_recover``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from minisrv.request import Req, ReqState
from minisrv.sampling import SamplingParams
from minisrv.server.messages import TokenEvent, error_event

__all__ = ["EngineLoop", "engine_snapshot"]

FINISHED_KEPT = 64  # finished requests an ``EngineLoop`` remembers

Emit = Callable[[list[TokenEvent], dict[str, float]], None]


def engine_snapshot(engine: Any) -> dict[str, float]:
    """The gauges of ``/metrics`` for one engine (``Engine.snapshot``): requests running and
    queued, the share of KV slots held by requests (cached prefixes nobody uses do not count:
    they can be evicted at any time, as in SGLang's ``token_usage``), the prefix-cache hit
    rate."""
    return engine.snapshot().as_dict()


class EngineLoop:
    """Runs ``engine`` in a daemon thread; ``emit(events, snapshot)`` gets each step's tokens.

    ``emit`` is called from the loop's thread: it must only hand the events over (e.g.
    ``loop.call_soon_threadsafe``), never block. ``beat``, if given, is called from the
    loop's thread between steps and at least every ``beat_every`` seconds while idle (a
    worker process stamps a clock in shared memory with it: its watchdog).
    """

    def __init__(self, engine: Any, emit: Emit, beat: Callable[[], None] | None = None,
                 beat_every: float = 1.0) -> None:
        if not beat_every > 0:
            raise ValueError(f"beat_every must be > 0 seconds, got {beat_every!r}")
        self.engine = engine
        self.emit = emit
        self._beat = beat
        self._wait: float | None = beat_every if beat is not None else None
        self._inbox: queue.SimpleQueue[tuple[str, int, Req | None]] = queue.SimpleQueue()
        self._by_key: dict[int, Req] = {}
        self._key_of: dict[int, int] = {}  # rid -> key
        self._new_tokens: dict[int, list[int]] = {}  # rid -> tokens of the current step
        self._new_logprobs: dict[int, list[Any]] = {}  # rid -> their logprobs, if asked
        self._make_lock = threading.Lock()
        # The last requests that finished, kept for inspection (the book reads the
        # scheduler's own record of one request); bounded, so a server never grows.
        self.finished: deque[Req] = deque(maxlen=FINISHED_KEPT)
        self._thread = threading.Thread(target=self._run, name="minisrv-engine", daemon=True)

    # ------------------------------------------------------------------ any thread
    def make_request(self, prompt: list[int], params: SamplingParams) -> Req:
        """A request for ``prompt``; ValueError for a malformed prompt or grammar. Limits
        (context, vocabulary, pool) are checked by ``Engine.add_request`` in the loop's
        thread: a request over them comes back as a 400 error event. The first constrained
        request builds the engine's grammar vocabulary (from the tokenizer the model carries)
        here, off the engine's steps, as every grammar is compiled here."""
        with self._make_lock:
            req = self.engine.make_requests([prompt], None, params)[0]
            grammars = self.engine.grammars() if params.grammar is not None else None
        if grammars is not None:  # compiled here, off the engine's steps (cached by text)
            grammars.prepare(params)
        return req

    def submit(self, key: int, req: Req) -> None:
        """Queue ``req``; its tokens come back through ``emit`` under ``key``."""
        self._inbox.put(("submit", key, req))

    def abort(self, key: int) -> None:
        """Withdraw the request ``key`` (finished or unknown keys are ignored)."""
        self._inbox.put(("abort", key, None))

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the loop to end after its current step and wait for it."""
        self._inbox.put(("stop", -1, None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def snapshot(self) -> dict[str, float]:
        return engine_snapshot(self.engine)

    # ------------------------------------------------------------------ loop thread
    def _run(self) -> None:
        engine = self.engine
        while self._drain(block=engine.idle):
            if engine.idle:
                continue
            try:
                out = engine.step()  # the blocking or the overlapped loop, as configured
            except Exception as exc:  # one request's error must not end the others
                self._recover(f"engine error: {exc!r}")
                continue
            for req, token in out.tokens:
                self._new_tokens.setdefault(req.rid, []).append(token)
            for req, entries in out.logprobs.items():
                self._new_logprobs.setdefault(req.rid, []).extend(entries)
            self._flush({req.rid for req in out.finished})

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; wait for one first if ``block``. False once told to stop."""
        if self._beat is not None:
            self._beat()
        try:
            command = self._inbox.get(timeout=self._wait) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        changed = False
        refused: list[TokenEvent] = []
        while True:
            kind, key, req = command
            if kind == "stop":
                return False
            if kind == "submit" and req is not None:
                if (event := self._add(key, req)) is not None:
                    refused.append(event)
            elif kind == "abort":
                changed |= self._abort(key)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
        if changed or refused:  # let /metrics see freed memory even if nothing else runs
            self.emit(refused, self.snapshot())
        return True

    def _add(self, key: int, req: Req) -> TokenEvent | None:
        """Queue ``req`` in the engine; the 400 error event if the engine refuses it. The
        request is stamped with the time the loop took it (``Req.taken_at``): what came
        before was its way to the engine, what follows, until its prefill step, its queue."""
        req.taken_at = time.perf_counter()
        try:
            self.engine.add_request(req)
        except ValueError as exc:
            return error_event(key, str(exc), 400)
        except Exception as exc:  # a bug in one request must not end the loop
            return error_event(key, f"engine error: {exc!r}", 500)
        self._by_key[key] = req
        self._key_of[req.rid] = key
        return None

    def _abort(self, key: int) -> bool:
        req = self._by_key.pop(key, None)
        if req is None:
            return False
        self._key_of.pop(req.rid, None)
        self._new_tokens.pop(req.rid, None)
        self._new_logprobs.pop(req.rid, None)
        self.engine.abort([req])
        return True

    def _flush(self, finished: set[int]) -> None:
        events: list[TokenEvent] = []
        for rid, tokens in self._new_tokens.items():
            key = self._key_of.get(rid)
            if key is None:
                continue
            req = self._by_key[key]
            reason = req.finish_reason if rid in finished else None
            events.append(TokenEvent(key, tokens, reason,
                                     logprobs=self._new_logprobs.pop(rid, None)))
            if reason is not None:
                self.finished.append(req)
                del self._by_key[key], self._key_of[rid]
        self._new_tokens = {}
        self._new_logprobs = {}
        if events:
            self.emit(events, self.snapshot())

    def _recover(self, message: str) -> None:
        """A step raised: fail the requests that likely caused it, keep serving the rest.

        The requests in the step that had produced no token yet are the suspects (a new
        prompt, a new sampler): they fail with ``message``. The others already ran steps
        without error; they go back to the head of the queue (``Engine.retract`` frees their
        KV and keeps their output and random generator), so they prefill prompt and output
        at a next step and go on with exactly the tokens they would have had. When no
        request was new, nothing tells the cause apart and every request fails. The
        overlapped loop has a step in flight that cannot be taken back: there every request
        fails.
        """
        live = list(self._by_key.values())
        stepped = [req for req in live if req.state == ReqState.RUNNING]
        fresh = [req for req in stepped if not req.output]
        if self.engine.config.overlap or not fresh:
            self._fail(live, message)
            return
        self._fail(fresh, message)
        self.engine.retract([req for req in stepped if req.state == ReqState.RUNNING])

    def _fail(self, reqs: list[Req], message: str) -> None:
        """End ``reqs`` with an error event each (HTTP 500 if nothing was streamed yet)."""
        self.engine.abort(reqs)
        events = []
        for req in reqs:
            key = self._key_of.pop(req.rid, None)
            self._new_tokens.pop(req.rid, None)
            self._new_logprobs.pop(req.rid, None)
            if key is not None:
                del self._by_key[key]
                events.append(error_event(key, message, 500))
        self.emit(events, self.snapshot())
