"""Worker processes under supervision: ``minisrv serve`` (``--dp N``, N >= 1).

Each worker process has its own engine and prefix cache; with ``--dp 2`` and more, every
request goes to the worker SGLang's cache-aware router picks (``minisrv.router.Router``).
A worker reports through a pipe of its own and the reader thread waits on every pipe and
every process sentinel at once, so a worker that dies is seen at once, even mid-message.

A worker acknowledges each request it takes from its inbox (``Taken``, sent through its pipe
before any of the request's tokens). When a worker dies, the requests it had taken fail at
once with a 503 error event (streams end with an error event and ``[DONE]``): some of their
tokens may have reached the client. The requests it had not taken produced nothing, so they
go to another worker that is up (``Router.reroute``): a request routed to a worker between
its death and the moment the reader sees the process gone is served all the same. Only
when no other worker is up do they fail with the 503 too. The dead worker is taken out of
the router and restarted (after ``restart_backoff`` seconds, doubling to 10 s while it keeps
dying) and rejoins when its engine is loaded.

A worker that is alive but hung (a step that never returns, a stopped process) is found by
a watchdog: each worker's engine loop stamps a clock in shared memory between steps and
while it waits (``worker_main``), and a worker with requests in flight whose clock has not
moved for ``worker_timeout`` seconds is killed, which sends it down the same path as a
worker that died. An idle worker's loop keeps stamping while it waits, so idleness is never
taken for a hang. While no worker is up, ``submit`` raises ``Unavailable`` and the front
end answers 503 with ``Retry-After``. A worker that fails to load at the first start fails
the server (``failed``, which ``/health`` reports): a bad model path must not restart
forever.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import threading
import time
from multiprocessing.connection import wait
from typing import Any

from minisrv.sampling import SamplingParams
from minisrv.server.config import ServerConfig
from minisrv.server.messages import (
    Abort,
    Failed,
    Ready,
    StepEvents,
    Stop,
    Submit,
    Taken,
    error_event,
)
from minisrv.server.worker import Deliver, Unavailable, worker_main

__all__ = ["DataParallelEngines"]

MAX_BACKOFF_S = 10.0
POLL_S = 0.1  # how often the reader looks at its restart schedule when nothing arrives


def worker_context(config: ServerConfig) -> Any:
    """Where worker processes come from: a fork server, never a fork of this process.

    This process already runs threads (the HTTP loop, the reader), and forking it could
    copy a lock some thread holds. A fork server is a fresh interpreter that imports torch
    and the engine once and forks each worker from that single-threaded state, so a worker
    starts (and restarts) without paying torch's import again. Those imports touch no
    CUDA (a CUDA context does not survive a fork): each worker opens its own. A simulated
    engine (``config.builder``) needs no torch: its builder's module is imported instead (a
    process's fork server keeps its first start's imports). Only on Linux: macOS's system
    libraries are not safe in a forked child and Windows has no fork, so there each worker
    is a fresh interpreter."""
    if sys.platform != "linux":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    builds = "minisrv.model" if config.builder is None else config.builder.__module__
    ctx.set_forkserver_preload(["minisrv.server.worker", "minisrv.engine", builds])
    return ctx


class DataParallelEngines:
    """``n`` supervised worker processes, each with its own engine, behind the ``Router``.

    With ``n=1`` (``minisrv serve``'s default) there is no router: the one worker gets
    everything, and the HTTP process keeps its interpreter lock to itself, which matters on
    a CPU where the engine's own Python work holds that lock most of each step.
    """

    def __init__(self, config: ServerConfig, n: int, router_kwargs: dict[str, Any]) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"--dp must be an int >= 1, got {n!r}")
        self.config = config
        self.n = n
        self.router: Any = None  # one worker needs no router
        if n > 1:
            from minisrv.router import Router  # the routing chapter's router

            self.router = Router(n, **router_kwargs)
        self.limits: dict[str, Any] = {}
        self.states = ["starting"] * n  # starting, up, restarting
        self.restarts = [0] * n
        self._failed: str | None = None
        self._started = False  # every worker was up once: the server is open
        self._ctx = worker_context(config)
        self._procs: list[Any] = [None] * n
        self._inboxes: list[Any] = [None] * n
        self._conns: list[Any] = [None] * n
        self._restart_at: dict[int, float] = {}
        self._backoff = [config.restart_backoff] * n
        self._worker_of: dict[int, int] = {}
        self._unacked: dict[int, Submit] = {}  # sent, not yet taken by its worker
        self._snapshots: list[dict[str, float]] = [{} for _ in range(n)]
        self._capacity = [config.engine.kv_capacity] * n
        self._lock = threading.Lock()
        self._closing = False
        self._reader: threading.Thread | None = None
        # Each worker's heartbeat: time.monotonic() of its engine loop's last beat.
        self._beats = [self._ctx.RawValue("d", 0.0) for _ in range(n)]
        self._hung: dict[int, float] = {}  # worker -> seconds without progress, when killed
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def options(self) -> ServerConfig:
        return self.config

    # ------------------------------------------------------------------ state
    @property
    def ready(self) -> bool:
        """Open for requests: every worker was up once, and one is up now."""
        return self._started and self.up > 0

    @property
    def up(self) -> int:
        return self.states.count("up")

    @property
    def failed(self) -> str | None:
        """Why the server cannot serve at all: a worker failed to load at the first start."""
        return self._failed

    def workers(self) -> list[dict[str, Any]]:
        """Each worker's index, state, process id, restarts, requests in flight (the
        router's load) and, once up, the seconds since its engine loop last showed progress
        (``/workers`` shows them)."""
        now = time.monotonic()
        with self._lock:
            in_flight = (list(self.router.loads) if self.router is not None
                         else [len(self._worker_of)])
        return [{"index": i, "state": self.states[i], "restarts": self.restarts[i],
                 "pid": self._procs[i].pid if self._procs[i] is not None else None,
                 "in_flight": in_flight[i],
                 "since_progress_s": (round(now - self._beats[i].value, 3)
                                      if self.states[i] == "up" else None)}
                for i in range(self.n)]

    def snapshot(self) -> dict[str, float]:
        """The gauges of the workers up, combined: counts add up, usage and hit rate pool."""
        live = [i for i in range(self.n) if self.states[i] == "up" and self._snapshots[i]]
        snaps = [self._snapshots[i] for i in live]
        out = {"workers_up": float(self.up)}
        if not snaps:
            return out
        prompt = sum(s["prompt_tokens"] for s in snaps)
        out.update({
            "running": sum(s["running"] for s in snaps),
            "queued": sum(s["queued"] for s in snaps),
            "token_usage": sum(s["kv_used"] for s in snaps) / sum(self._capacity[i]
                                                                  for i in live),
            "kv_used": sum(s["kv_used"] for s in snaps),
            "hit_rate": (sum(s["hit_rate"] * s["prompt_tokens"] for s in snaps) / prompt
                         if prompt else 0.0),
            "prompt_tokens": prompt,
            **{key: sum(s.get(key, 0.0) for s in snaps)  # each worker's own host tier
               for key in ("host_tokens", "host_used", "host_hit_tokens")},
        })
        return out

    # ------------------------------------------------------------------ processes
    def start(self, deliver: Deliver) -> None:
        for i in range(self.n):
            self._spawn(i)
        self._reader = threading.Thread(target=self._read, args=(deliver,), daemon=True,
                                        name="minisrv-dp-reader")
        self._reader.start()
        if self.config.worker_timeout > 0:
            self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                              name="minisrv-dp-watchdog")
            self._watchdog.start()

    def _spawn(self, i: int) -> None:
        """Start worker ``i`` with a fresh inbox and pipe (the old ones died with it)."""
        inbox = self._ctx.Queue()
        receive, send = self._ctx.Pipe(duplex=False)
        self._beats[i].value = time.monotonic()
        proc = self._ctx.Process(target=worker_main,
                                 args=(i, self.config, inbox, send, self._beats[i]),
                                 name=f"minisrv-dp{i}", daemon=True)
        proc.start()
        send.close()  # the worker holds the sending end: EOF here once it is gone
        with self._lock:
            self._procs[i], self._inboxes[i], self._conns[i] = proc, inbox, receive

    def _read(self, deliver: Deliver) -> None:
        """Forward every worker's events; notice deaths; restart on schedule."""
        while not self._closing:
            conns = [c for c in self._conns if c is not None]
            sentinels = [p.sentinel for p in self._procs if p is not None]
            for ready in wait(conns + sentinels, timeout=POLL_S):
                i = self._index_of(ready)
                if i is None:
                    continue
                if ready is self._conns[i]:
                    try:
                        self._handle(ready.recv(), deliver)
                        while ready.poll():
                            self._handle(ready.recv(), deliver)
                    except (EOFError, OSError):  # died, maybe mid-message
                        self._died(i, deliver)
                elif self._procs[i].exitcode is not None:
                    self._drain(i, deliver)
                    self._died(i, deliver)
            now = time.monotonic()
            for i, when in list(self._restart_at.items()):
                if now >= when and not self._closing:
                    del self._restart_at[i]
                    self.restarts[i] += 1
                    self._spawn(i)

    def _watch(self) -> None:
        """The watchdog: kill every worker that is up, has requests in flight and has not
        beaten for ``worker_timeout`` seconds. It runs in a thread of its own because the
        reader may be the one stuck (on the half-sent message of a worker stopped mid-send);
        the kill ends that too, and the reader then fails the worker's requests."""
        timeout = self.config.worker_timeout
        while not self._stopping.wait(min(POLL_S, timeout / 10)):
            now = time.monotonic()
            with self._lock:
                busy = set(self._worker_of.values())
                for i in busy:
                    silent = now - self._beats[i].value
                    if self.states[i] != "up" or i in self._hung or silent <= timeout:
                        continue
                    self._hung[i] = silent
                    self._procs[i].kill()  # SIGKILL ends a stopped process too

    def _index_of(self, ready: Any) -> int | None:
        for i in range(self.n):
            if ready is self._conns[i] or (self._procs[i] is not None
                                           and ready == self._procs[i].sentinel):
                return i
        return None

    def _drain(self, i: int, deliver: Deliver) -> None:
        """Deliver what a dead worker sent before it died (finished replies stay finished)."""
        conn = self._conns[i]
        try:
            while conn is not None and conn.poll():
                self._handle(conn.recv(), deliver)
        except (EOFError, OSError):
            pass

    def _handle(self, message: Any, deliver: Deliver) -> None:
        i = message.worker
        if isinstance(message, StepEvents):
            self._snapshots[i] = message.snapshot
            deliver(message.events, self.snapshot())
        elif isinstance(message, Taken):
            with self._lock:
                self._unacked.pop(message.key, None)
        elif isinstance(message, Ready):
            self.limits = message.limits
            self._capacity[i] = message.limits["kv_capacity"]
            with self._lock:
                self.states[i] = "up"
                if self.router is not None:
                    self.router.mark_up(i)
            self._backoff[i] = self.config.restart_backoff
            self._started = self._started or self.up == self.n
            deliver([], self.snapshot())
        elif isinstance(message, Failed):
            if not self._started:
                self._failed = f"worker {i}: {message.message}"
            # After the start, the process exits next: ``_died`` restarts it.

    def _died(self, i: int, deliver: Deliver) -> None:
        """Worker ``i`` is gone: take it out, fail the requests it had taken, send those it
        had not to another worker (``_reroute``), schedule its restart. Everything it sent
        has been read by now, acknowledgements included."""
        if self._closing or self._conns[i] is None:
            return
        proc = self._procs[i]
        proc.join(1)
        code = proc.exitcode
        with self._lock:
            self._conns[i].close()
            self._conns[i] = None
            self._inboxes[i].cancel_join_thread()
            self._inboxes[i].close()
            self.states[i] = "restarting"
            self._snapshots[i] = {}
            if self.router is not None:
                self.router.mark_down(i)
            keys = [key for key, w in self._worker_of.items() if w == i]
            failed = [key for key in keys if key not in self._unacked]
            failed += self._reroute([key for key in keys if key in self._unacked], i)
            silent = self._hung.pop(i, None)
        if self._failed is not None:  # it never loaded: restarting would fail again
            return
        self._restart_at[i] = time.monotonic() + self._backoff[i]
        self._backoff[i] = min(MAX_BACKOFF_S, 2 * self._backoff[i] or MAX_BACKOFF_S / 20)
        if silent is not None:
            message = (f"engine worker {i} made no progress for {silent:.1f} s (worker "
                       f"timeout {self.config.worker_timeout:g} s) and was killed; it is "
                       "being restarted: retry")
        else:
            message = f"engine worker {i} died (exit code {code}); it is being restarted: retry"
        deliver([error_event(key, message, 503) for key in failed], self.snapshot())

    def _reroute(self, keys: list[int], dead: int) -> list[int]:
        """Send requests that worker ``dead`` never took to workers that are up, and tell
        the router; return those that no worker can take now. Called with the lock held."""
        if self.up == 0:
            return keys
        for key in keys:
            submit = self._unacked[key]
            worker = self.router.reroute(submit.prompt, dead)
            self._worker_of[key] = worker
            self._inboxes[worker].put(submit)
        return []

    # ------------------------------------------------------------------ requests
    def submit(self, key: int, prompt: list[int], params: SamplingParams) -> None:
        """Send a request to a worker that is up; ``Unavailable`` if none is. It is put in
        the inbox under the lock, so a death is handled either before (another worker is
        chosen) or after (the request is in the dead worker's inbox, and is re-routed)."""
        with self._lock:
            if self.up == 0:
                raise Unavailable("no engine worker is up; one is being restarted",
                                  retry_after=max(1.0, self._backoff[0]))
            if self.router is not None:
                worker = self.router.route(prompt)
            else:
                worker = 0
            self._worker_of[key] = worker
            self._unacked[key] = message = Submit(key, prompt, params)
            self._inboxes[worker].put(message)

    def abort(self, key: int) -> None:
        with self._lock:
            worker = self._worker_of.get(key)
            if worker is not None and self.states[worker] == "up":
                self._inboxes[worker].put(Abort(key))

    def done(self, key: int) -> None:
        """The request left its worker: the router's in-flight count drops."""
        with self._lock:
            self._unacked.pop(key, None)
            worker = self._worker_of.pop(key, None)
            if worker is not None and self.router is not None:
                self.router.finish(worker)

    def close(self) -> None:
        """Stop the workers and the reader, then release the queues (their semaphores would
        otherwise be reported as leaked when the server exits). A second call does nothing."""
        if self._closing:
            return
        self._closing = True
        self._stopping.set()
        if self._watchdog is not None:
            self._watchdog.join(5)
        if self._reader is not None:
            self._reader.join(5)
        for i, inbox in enumerate(self._inboxes):
            if inbox is not None and self._procs[i].exitcode is None:
                inbox.put(Stop())
        for proc in self._procs:
            if proc is None:
                continue
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(2)
        for inbox in self._inboxes:
            if inbox is not None:
                inbox.close()
                inbox.join_thread()
        for conn in self._conns:
            if conn is not None:
                conn.close()
        for proc in self._procs:
            if proc is not None and proc.exitcode is not None:
                proc.close()
        self._procs, self._inboxes, self._conns = [None] * self.n, [None] * self.n, [None] * self.n
