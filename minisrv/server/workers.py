"""Where the engines run: one in a thread of the server process, or N worker processes.

Both kinds answer the front end the same way: ``start(deliver)`` loads the model without
blocking (the HTTP server is already up and answers ``/health`` with 503 meanwhile),
``submit(key, prompt, params)`` queues a request, ``abort(key)`` withdraws it,
``done(key)`` says the front end has finished with it, and ``deliver(events, snapshot)``
is called from another thread with every step's tokens (see ``EngineLoop``).

``--dp N`` starts N processes, each with its own engine and its own prefix cache, and sends
every request to the one SGLang's cache-aware router picks (``minisrv.router.Router``):
the worker whose cache most likely holds the prompt's prefix, unless the loads are too
uneven. A worker validates what it receives; a request it cannot serve comes back as an
error event before any token, which the front end answers with HTTP 400.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minisrv.sampling import SamplingParams
from minisrv.server.engine_loop import EngineLoop, Event

__all__ = ["DataParallelEngines", "EngineOptions", "LocalEngine", "check_engine_options"]

Deliver = Callable[[list[Event], dict[str, float]], None]


@dataclass(frozen=True)
class EngineOptions:
    """Everything a worker needs to build its engine (picklable, for worker processes)."""

    model: str = "citylm"
    device: str | None = None
    kv_capacity: int = 4000
    max_running: int = 64
    policy: str = "fcfs"
    cache: str = "radix"
    mode: str = "prefill-first"
    overlap: bool = False
    threads: int | None = None  # torch CPU threads (None: torch's default)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def engine_args(self) -> dict[str, Any]:
        # A server keeps no trace by default (it would grow forever); ``engine_kwargs`` may
        # ask for one, as the book does to look inside a running server.
        return {"kv_capacity": self.kv_capacity, "max_running": self.max_running,
                "policy": self.policy, "cache": self.cache, "mode": self.mode,
                "overlap": self.overlap, "record_trace": False, **self.engine_kwargs}


def check_engine_options(options: EngineOptions) -> None:
    """Raise the ValueError ``Engine`` would raise for these options, without a model: an
    engine over the simulated GPU takes the same arguments and validates them the same way,
    so ``minisrv serve --policy nope`` fails at once instead of after loading."""
    from minisrv.engine import Engine
    from minisrv.sim import SimBackend

    Engine(SimBackend(), **options.engine_args())


def build_engine(options: EngineOptions) -> tuple[Any, Any, dict[str, Any]]:
    """Load the model, build the engine and warm it up; return (engine, codec, limits)."""
    import torch

    from minisrv.engine import Engine
    from minisrv.server.loading import load_served_model

    if options.threads:
        torch.set_num_threads(options.threads)
    model, codec = load_served_model(options.model, options.device)
    # A throwaway engine pays the first forward's lazy setup, and leaves no trace (stats,
    # cached prefixes) in the engine that serves.
    Engine(model, kv_capacity=16, max_running=1).generate([[0, 2]], 1)
    engine = Engine(model, **options.engine_args())
    limits = {"max_context": engine.backend.max_context, "kv_capacity": engine.kv_capacity}
    return engine, codec, limits


class LocalEngine:
    """One engine in a thread of this process (``--dp 1``)."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.ready = False
        self.failed: str | None = None
        self.limits: dict[str, Any] = {}
        self.loop: EngineLoop | None = None

    def start(self, deliver: Deliver) -> None:
        threading.Thread(target=self._load, args=(deliver,), daemon=True).start()

    def _load(self, deliver: Deliver) -> None:
        try:
            engine, _, self.limits = build_engine(self.options)
        except Exception as exc:  # reported by /health
            self.failed = repr(exc)
            return
        self.loop = EngineLoop(engine, deliver)
        self.loop.start()
        self.ready = True

    def submit(self, key: int, prompt: list[int], params: SamplingParams) -> None:
        """Queue a request; ValueError at once if it could never be served."""
        assert self.loop is not None
        self.loop.submit(key, self.loop.make_request(prompt, params))

    def abort(self, key: int) -> None:
        if self.loop is not None:
            self.loop.abort(key)

    def done(self, key: int) -> None:
        """Nothing to release: a single engine needs no routing bookkeeping."""

    def close(self) -> None:
        if self.loop is not None:
            self.loop.stop()


def _worker_main(index: int, options: EngineOptions, inbox: Any, outbox: Any) -> None:
    """A ``--dp`` worker process: an engine loop, fed by ``inbox``, reporting to ``outbox``."""
    try:
        engine, _, limits = build_engine(options)
    except Exception as exc:
        outbox.put(("failed", index, repr(exc)))
        return
    loop = EngineLoop(engine, lambda events, snap: outbox.put(("events", index, events, snap)))
    loop.start()
    outbox.put(("ready", index, limits))
    while True:
        command = inbox.get()
        if command[0] == "stop":
            loop.stop()
            return
        if command[0] == "abort":
            loop.abort(command[1])
            continue
        _, key, prompt, params = command
        try:
            req = loop.make_request(prompt, params)
        except ValueError as exc:
            outbox.put(("events", index, [(key, [], None, str(exc))], loop.snapshot()))
            continue
        loop.submit(key, req)


class DataParallelEngines:
    """``n`` worker processes, each with its own engine and cache, behind the ``Router``.

    With ``n=1`` (``minisrv serve``'s default) there is no router: the one worker gets
    everything, and the HTTP process keeps its interpreter lock to itself, which matters on
    a CPU where the engine's own Python work holds that lock most of each step.
    """

    def __init__(self, options: EngineOptions, n: int, router_kwargs: dict[str, Any]) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"--dp must be an int >= 1, got {n!r}")
        self.options = options
        self.n = n
        self.router: Any = None  # one worker needs no router
        if n > 1:
            from minisrv.router import Router  # the routing chapter's router

            self.router = Router(n, **router_kwargs)
        self.ready = False
        self._failed: str | None = None
        self.limits: dict[str, Any] = {}
        ctx = mp.get_context("spawn")  # never fork a process that already runs threads
        self._outbox: Any = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(n)]
        self._procs = [
            ctx.Process(target=_worker_main, args=(i, options, self._inboxes[i], self._outbox),
                        name=f"minisrv-dp{i}", daemon=True)
            for i in range(n)
        ]
        self._reader: threading.Thread | None = None
        self._worker_of: dict[int, int] = {}
        self._snapshots: list[dict[str, float]] = [{} for _ in range(n)]
        self._capacity = [options.kv_capacity] * n

    def start(self, deliver: Deliver) -> None:
        for proc in self._procs:
            proc.start()
        self._reader = threading.Thread(target=self._read, args=(deliver,), daemon=True)
        self._reader.start()

    def _read(self, deliver: Deliver) -> None:
        """Forward every worker's events to the front end; track readiness."""
        ready = 0
        while True:
            message = self._outbox.get()
            kind, index = message[0], message[1]
            if kind == "close":
                return
            if kind == "ready":
                self.limits = message[2]
                self._capacity[index] = message[2]["kv_capacity"]
                ready += 1
                self.ready = ready == self.n
            elif kind == "failed":
                self._failed = f"worker {index}: {message[2]}"
            else:
                self._snapshots[index] = message[3]
                deliver(message[2], self.snapshot())

    @property
    def failed(self) -> str | None:
        """Why the server cannot serve: a worker failed to load, or died since."""
        if self._failed is None:
            dead = [p.name for p in self._procs if p.exitcode is not None]
            if dead:
                self._failed = f"worker process exited: {', '.join(dead)}"
        return self._failed

    def snapshot(self) -> dict[str, float]:
        """The workers' gauges combined: counts add up, usage and hit rate are pooled."""
        snaps = [s for s in self._snapshots if s]
        if not snaps:
            return {}
        prompt = sum(s["prompt_tokens"] for s in snaps)
        return {
            "running": sum(s["running"] for s in snaps),
            "queued": sum(s["queued"] for s in snaps),
            "token_usage": sum(s["kv_used"] for s in snaps) / sum(self._capacity),
            "kv_used": sum(s["kv_used"] for s in snaps),
            "hit_rate": (sum(s["hit_rate"] * s["prompt_tokens"] for s in snaps) / prompt
                         if prompt else 0.0),
            "prompt_tokens": prompt,
        }

    def submit(self, key: int, prompt: list[int], params: SamplingParams) -> None:
        worker = self.router.route(prompt) if self.router is not None else 0
        self._worker_of[key] = worker
        self._inboxes[worker].put(("submit", key, prompt, params))

    def abort(self, key: int) -> None:
        worker = self._worker_of.get(key)
        if worker is not None:
            self._inboxes[worker].put(("abort", key))

    def done(self, key: int) -> None:
        """The request left its worker: the router's in-flight count drops."""
        worker = self._worker_of.pop(key, None)
        if worker is not None and self.router is not None:
            self.router.finish(worker)

    def close(self) -> None:
        """Stop the workers and the reader, then release the queues (their semaphores would
        otherwise be reported as leaked when the server exits). A second call does nothing."""
        if self._outbox is None:
            return
        for inbox in self._inboxes:
            inbox.put(("stop",))
        for proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(2)
        self._outbox.put(("close", -1))
        if self._reader is not None:
            self._reader.join(5)
        for queue in (*self._inboxes, self._outbox):
            queue.close()
            queue.join_thread()
        for proc in self._procs:
            if proc.exitcode is not None:
                proc.close()
        # Drop the last references, so that the queues' semaphores are released now.
        self._procs, self._inboxes, self._outbox = [], [], None
