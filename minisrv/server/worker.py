"""One engine, in a thread of the server process or in a worker process of its own.

Both kinds answer the front end the same way: ``start(deliver)`` loads the model without
blocking (the HTTP server is already up and answers ``/health`` with 503 meanwhile),
``submit(key, prompt, params)`` queues a request, ``abort(key)`` withdraws it,
``done(key)`` says the front end has finished with it, and ``deliver(events, snapshot)``
is called from another thread with every step's ``TokenEvent`` list (see ``EngineLoop``).
Whatever goes wrong with a request comes back the same way, as an error event: a request
the engine refuses (400), a step that raised (500), a worker that died (503).

This module holds the engine thread (``LocalEngine``) and the body of a worker process
(``worker_main``); ``dataparallel`` supervises the processes; ``workers`` names both.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from minisrv.sampling import SamplingParams
from minisrv.server.config import ServerConfig, auto_kv_capacity, free_device_bytes
from minisrv.server.engine_loop import EngineLoop
from minisrv.server.messages import (
    Abort,
    Failed,
    Ready,
    StepEvents,
    Stop,
    Submit,
    Taken,
    TokenEvent,
    error_event,
)

__all__ = ["Deliver", "LocalEngine", "Unavailable", "beat_interval", "build_engine",
           "worker_main"]

Deliver = Callable[[list[TokenEvent], dict[str, float]], None]


class Unavailable(RuntimeError):
    """No engine can take a request now (none is up); retry after ``retry_after`` s."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def build_engine(config: ServerConfig) -> tuple[Any, dict[str, Any]]:
    """Load the model, build the engine and warm it up; return (engine, limits)."""
    if config.builder is not None:  # an engine without a model to load (a simulated GPU)
        return config.builder(config)
    import torch

    from minisrv.engine import Engine
    from minisrv.model import load_model

    if config.threads:
        torch.set_num_threads(config.threads)
    model, _ = load_model(config.model, config.device)  # the model carries its tokenizer
    # A throwaway engine pays the first forward's lazy setup, and leaves no trace (stats,
    # cached prefixes) in the engine that serves.
    Engine(model, kv_capacity=16, max_running=1).generate([[0, 2]], 1)
    engine_config = config.engine
    if config.auto_kv:
        capacity = auto_kv_capacity(model, engine_config.max_running,
                                    free_device_bytes(model.device))
        engine_config = dataclasses.replace(engine_config, kv_capacity=capacity)
    engine = Engine(model, engine_config)
    limits = {"max_context": engine.backend.max_context, "kv_capacity": engine.kv_capacity,
              "vocab_size": engine.backend.vocab_size}
    return engine, limits


def submit_to(loop: EngineLoop, message: Submit) -> TokenEvent | None:
    """Queue ``message``'s request on ``loop``; the error event if it cannot be served."""
    try:
        loop.submit(message.key, loop.make_request(message.prompt, message.params))
    except ValueError as exc:
        return error_event(message.key, str(exc), 400)
    except Exception as exc:  # a bug in building one request must not end the worker
        return error_event(message.key, f"engine error: {exc!r}", 500)
    return None


class LocalEngine:
    """One engine in a thread of this process (``--engine-thread``).

    With ``worker_timeout`` > 0 a watchdog thread reads the engine loop's heartbeat: once
    it has stood still for longer than the timeout while requests are in flight, the
    engine is hung. A thread cannot be stopped, so the hung one is abandoned (whatever it
    sends later is dropped), every request in flight ends with a 503 error event, and a
    new engine is built in a new thread, as a hung worker process is killed and restarted.
    """

    n = 1

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.ready = False
        self.failed: str | None = None
        self.limits: dict[str, Any] = {}
        self.loop: EngineLoop | None = None
        self.restarts = 0
        self._deliver: Deliver | None = None
        self._lock = threading.Lock()
        self._in_flight: set[int] = set()
        self._generation = 1  # the engine thread now serving; the watchdog bumps it
        self._beat = time.monotonic()
        self._closed = threading.Event()

    @property
    def options(self) -> ServerConfig:
        return self.config

    def start(self, deliver: Deliver) -> None:
        self._deliver = deliver
        self._spawn()
        if self.config.worker_timeout > 0:
            threading.Thread(target=self._watch, daemon=True,
                             name="minisrv-engine-watchdog").start()

    def _spawn(self) -> None:
        """Build an engine and start its loop, in a new thread tagged with the current
        generation (the watchdog has already moved past an abandoned one's)."""
        with self._lock:
            generation = self._generation
        threading.Thread(target=self._load, args=(generation,), daemon=True).start()

    def _load(self, generation: int) -> None:
        try:
            engine, self.limits = build_engine(self.config)
        except Exception as exc:  # reported by /health
            self.failed = repr(exc)
            return
        deliver = self._deliver
        assert deliver is not None

        def current() -> bool:
            return generation == self._generation

        def emit(events: list[TokenEvent], snapshot: dict[str, float]) -> None:
            if current():  # an abandoned engine's late events are nobody's now
                deliver(events, snapshot)

        def beat() -> None:
            if current():
                self._beat = time.monotonic()

        loop = EngineLoop(engine, emit, beat, beat_interval(self.config.worker_timeout))
        with self._lock:
            if not current() or self._closed.is_set():
                return
            self._beat = time.monotonic()
            self.loop = loop
            loop.start()
            self.ready = True

    def _watch(self) -> None:
        """The watchdog: abandon the engine once its heartbeat has stood still for
        ``worker_timeout`` seconds while requests are in flight, fail those requests, and
        start a new engine."""
        timeout = self.config.worker_timeout
        while not self._closed.wait(beat_interval(timeout)):
            with self._lock:
                silent = time.monotonic() - self._beat
                if not (self.ready and self._in_flight and silent > timeout):
                    continue
                keys, self._in_flight = sorted(self._in_flight), set()
                abandoned, self.ready, self.loop = self.loop, False, None
                self._generation += 1  # the hung thread's events and beats are dropped
                self.restarts += 1
            message = (f"the engine made no progress for {silent:.1f} s (worker timeout "
                       f"{timeout:g} s) and was abandoned; a new engine is starting")
            assert self._deliver is not None
            self._deliver([error_event(key, message, 503) for key in keys], {})
            if abandoned is not None:
                abandoned.stop(timeout=0)  # it ends there if it ever comes back
            self._spawn()

    @property
    def up(self) -> int:
        """Engines serving now: 1, or 0 if the engine thread has ended or was abandoned."""
        loop = self.loop
        return int(self.ready and loop is not None and loop._thread.is_alive())

    def workers(self) -> list[dict[str, Any]]:
        state = ("failed" if self.failed else "up" if self.up
                 else "restarting" if self.restarts else "starting")
        return [{"index": 0, "state": state, "pid": None, "restarts": self.restarts}]

    def submit(self, key: int, prompt: list[int], params: SamplingParams) -> None:
        """Queue a request; a request it cannot serve comes back as an error event."""
        with self._lock:  # the watchdog fails what is in flight, or the loop is gone
            loop = self.loop
            if not self.up or loop is None or self._deliver is None:
                raise Unavailable("the engine is not running")
            self._in_flight.add(key)
        refused = submit_to(loop, Submit(key, prompt, params))
        if refused is not None:
            self._deliver([refused], {})  # the gauges come with the next step

    def abort(self, key: int) -> None:
        if self.loop is not None:
            self.loop.abort(key)

    def done(self, key: int) -> None:
        """The front end has finished with ``key``: no longer in flight."""
        with self._lock:
            self._in_flight.discard(key)

    def close(self) -> None:
        self._closed.set()
        if self.loop is not None:
            self.loop.stop()


def beat_interval(timeout: float) -> float:
    """How often an idle engine loop stamps its heartbeat: a few times per ``timeout``, so
    a supervisor never mistakes a loop waiting for work for a hung one."""
    return max(0.01, min(1.0, timeout / 4)) if timeout > 0 else 1.0


def worker_main(index: int, config: ServerConfig, inbox: Any, conn: Any,
                heartbeat: Any = None) -> None:
    """A worker process: an engine loop fed by ``inbox``, reporting through ``conn`` (a
    pipe of its own, so a worker that dies mid-message corrupts no other worker's).

    ``heartbeat`` (a shared ``ctypes`` double) gets ``time.monotonic()`` between every two
    steps of the engine loop and while it waits: the supervisor's watchdog reads it, and a
    worker whose clock stops while it has requests in flight is hung (``dataparallel``).

    Each request taken from the inbox is acknowledged (``Taken``) before the engine sees it,
    so the supervisor knows which requests of a worker that died had not reached it.
    """
    lock = threading.Lock()  # the engine thread and this one both send

    def send(message: Any) -> None:
        with lock:
            conn.send(message)

    try:
        engine, limits = build_engine(config)
    except Exception as exc:
        send(Failed(index, repr(exc)))
        return
    beat = None
    if heartbeat is not None:
        def beat() -> None:
            heartbeat.value = time.monotonic()
    loop = EngineLoop(engine, lambda events, snap: send(StepEvents(index, events, snap)),
                      beat, beat_interval(config.worker_timeout))
    loop.start()
    send(Ready(index, limits))
    while True:
        message = inbox.get()
        if isinstance(message, Stop):
            loop.stop()
            return
        if isinstance(message, Abort):
            loop.abort(message.key)
        elif isinstance(message, Submit):
            send(Taken(index, message.key))
            refused = submit_to(loop, message)
            if refused is not None:
                send(StepEvents(index, [refused], loop.snapshot()))
