"""Many workers behind one router, on one event clock: simulated GPUs or real CityLMs.

Each worker is an ordinary ``Engine`` with its own radix cache. The cluster loop advances
whichever happens first: the next arrival (routed with the loads of that moment) or the
next step of the worker whose clock is furthest behind. Completions are handed back to the
router at the time their step ends, not when the loop happens to run that step, so the
router sees exactly the requests in flight at each arrival, as a real router would.

With ``SimBackend`` workers (``simulate_cluster``) the clock is in simulated seconds and a
step lasts its roofline time; with CityLM workers (``serve_cluster``) every step lasts one
unit, i.e. the workers step in lockstep, as N machines running side by side would.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from minisrv.configs import H100, LLAMA3_8B, GPUSpec, ModelConfig
from minisrv.engine import Engine
from minisrv.request import Req
from minisrv.router.policy import Router
from minisrv.sampling import SamplingParams
from minisrv.sim import SimBackend
from minisrv.sim.run import collector_paused
from minisrv.workloads import Workload

__all__ = ["ClusterResult", "groups_started", "hot_group_latency", "run_cluster",
           "simulate_cluster", "serve_cluster"]

@dataclass(frozen=True)
class ClusterResult:
    """One workload served by a cluster.

    ``requests[i]`` is workload request ``i`` (its output, token times, cached prefix) and
    ``workers[i]`` the worker that served it. ``hit_rate``: cached prompt tokens over all
    prompt tokens, over every worker; ``throughput``: output tokens per clock unit from the
    first arrival to the last token; ``request_ratio``: the most requests any worker served
    over the mean per worker (1.0 is perfectly even). ``load_times``/``load_trace`` hold the
    requests in flight per worker after every arrival and completion. ``branches[i]`` is the
    router's reason for request ``i``'s worker (``BRANCHES``), and ``tree_sizes`` the tokens
    of the router's tree each worker held at the end: with them a run shows how often the
    tree's belief sent a request to a cache that had lost its prefix. ``worker_steps`` and
    ``worker_decode_tokens`` count each worker's steps and the decodes they computed: a policy
    that finds prefixes cached also fits more requests in the same pool, and
    ``decodes_per_step`` shows it.
    """

    policy: str
    time_unit: str
    requests: list[Req]
    workers: list[int]
    hit_rate: float
    throughput: float
    mean_latency: float
    makespan: float
    worker_requests: list[int]
    worker_output_tokens: list[int]
    worker_prefill_tokens: list[int]
    worker_hit_rates: list[float]
    worker_busy: list[float]
    worker_steps: list[int]
    worker_decode_tokens: list[int]
    request_ratio: float
    load_times: np.ndarray
    load_trace: np.ndarray
    decisions: dict[str, int]
    branches: list[str]
    tree_sizes: list[int]

    @property
    def n_workers(self) -> int:
        return len(self.worker_requests)

    @property
    def widest_gap(self) -> int:
        """The largest difference in requests in flight between the busiest and the idlest
        worker at any arrival or completion: the quantity ``balance_abs_threshold`` is compared
        with, so a run whose widest gap stays below a threshold would never have balanced."""
        if not len(self.load_trace):
            return 0
        return int((self.load_trace.max(axis=1) - self.load_trace.min(axis=1)).max())

    @property
    def decodes_per_step(self) -> float:
        """Decodes computed per step, over every worker: the mean decode batch."""
        steps = sum(self.worker_steps)
        return sum(self.worker_decode_tokens) / steps if steps else 0.0

    def lost_prefix_share(self, prefix_len: int) -> float:
        """Share of the requests the cache branch routed that found fewer than ``prefix_len``
        tokens cached when they started: how often the router's tree named a worker whose
        cache had already evicted the prefix, the cost of a tree larger than the caches."""
        sent = [r for r, b in zip(self.requests, self.branches, strict=True) if b == "cache"]
        if not sent:
            return 0.0
        return sum(r.cached_prompt_tokens < prefix_len for r in sent) / len(sent)

    def prefixes_computed(self, prefix_len: int) -> int:
        """Requests that found fewer than ``prefix_len`` tokens cached when they started, so
        computed (part of) their prefix again. Two routers can find the same share of tokens
        cached through as many such misses on different workers; this count tells that apart
        from one router copying the other."""
        return sum(r.cached_prompt_tokens < prefix_len for r in self.requests)

    def summary(self) -> dict[str, float]:
        """The headline numbers, e.g. for one row of a comparison table."""
        return {"policy": self.policy, "hit_rate": self.hit_rate, "throughput": self.throughput,
                "mean_latency": self.mean_latency, "request_ratio": self.request_ratio,
                "makespan": self.makespan}

def run_cluster(engines: Sequence[Engine], router: Router, workload: Workload) -> ClusterResult:
    """Serve ``workload`` (arrivals on the engines' clock) on ``engines`` behind ``router``.

    Request ``i`` asks for ``workload.output_lens[i]`` tokens, greedy; it stops early only at
    the model's ``<eos>`` (a ``SimBackend`` has none). Engines and router must be fresh, and
    the engines alike: every request is checked against the first one before anything runs.
    """
    if len(engines) != router.n_workers:
        raise ValueError(f"{len(engines)} engines for a router of {router.n_workers} workers")
    if any(not e.idle or e.clock != 0 for e in engines) or any(router.loads):
        raise ValueError("run_cluster needs fresh engines (clock 0, nothing queued) and router")
    loop = _ClusterLoop(engines, router, workload)
    for req in loop.pending:  # a request no worker could serve fails here, before any runs;
        engines[0].scheduler.check(req)  # so routing later adds it without a second check
    with collector_paused():  # see there: a cluster's run makes almost no cycles
        loop.run()
    return loop.result()

def simulate_cluster(
    workload: Workload,
    n_workers: int = 4,
    policy: str = "cache-aware",
    kv_capacity: int = 10_000,
    max_running: int = 64,
    *,
    cfg: ModelConfig = LLAMA3_8B,
    gpu: GPUSpec = H100,
    dtype_bytes: float = 2,
    admission: str = "budget",
    **router_options: Any,
) -> ClusterResult:
    """``n_workers`` simulated GPUs (``SimBackend``, radix cache of ``kv_capacity`` tokens
    each, at most ``max_running`` requests each) behind a ``Router(n_workers, policy,
    **router_options)``; ``workload`` arrivals in seconds."""
    router = Router(n_workers, policy, **router_options)
    # No step traces: nobody can read these engines' (the result keeps only the requests),
    # and tens of thousands of records would only cost time and memory.
    engines = [
        Engine(SimBackend(cfg, gpu, dtype_bytes), kv_capacity=kv_capacity,
               max_running=max_running, cache="radix", admission=admission, record_trace=False)
        for _ in range(n_workers)
    ]
    return run_cluster(engines, router, workload)

def serve_cluster(
    model: Any,
    workload: Workload,
    n_workers: int = 2,
    policy: str = "cache-aware",
    kv_capacity: int = 2000,
    max_running: int = 8,
    **router_options: Any,
) -> ClusterResult:
    """``n_workers`` engines of the real ``model`` (one CityLM shared read-only, a KV pool
    and radix cache each) behind one router; arrivals in steps. Outputs are the model's
    greedy tokens, identical to ``model.reference_generate`` of each request alone."""
    router = Router(n_workers, policy, **router_options)
    engines = [Engine(model, kv_capacity=kv_capacity, max_running=max_running, cache="radix")
               for _ in range(n_workers)]
    return run_cluster(engines, router, workload)

class _ClusterLoop:
    """The event loop of ``run_cluster``; its state lives here between events."""

    def __init__(self, engines: Sequence[Engine], router: Router, workload: Workload) -> None:
        self.engines, self.router, self.workload = list(engines), router, workload
        n = len(workload)
        # Python floats whatever the workload holds (numpy scalars compare slowly)
        self.arrivals = [float(t) for t in workload.arrivals]
        self.order = sorted(range(n), key=lambda i: (self.arrivals[i], i))
        # rid = workload index, unique over the cluster; the latency counts from the arrival.
        # A prompt that is a list already is shared, not copied: nothing writes to a prompt, and
        # thousands of long copies would only double what the garbage collector traverses.
        self.pending = [
            Req(rid=i, prompt=_as_list(workload.prompts[i]), arrival=self.arrivals[i],
                params=SamplingParams(max_new_tokens=workload.output_lens[i]))
            for i in range(n)
        ]
        self.requests: list[Req | None] = [None] * n
        self.workers = [-1] * n
        self.branches = [""] * n
        self.wake = [math.inf] * len(engines)  # earliest arrival not yet seen by each worker
        self.finishes: list[tuple[float, int, int]] = []  # heap: (time, worker, request)
        self.times: list[float] = []
        self.trace: list[tuple[int, ...]] = []

    def run(self) -> None:
        arrivals, order = self.arrivals, self.order
        nxt = 0
        while True:
            worker, ready = self._next_worker()
            t = arrivals[order[nxt]] if nxt < len(order) else math.inf
            if t == math.inf and worker < 0:
                break
            if t <= ready:
                self._complete_until(t)
                self._route(order[nxt], t)
                nxt += 1
            else:
                self._step(worker)
        self._complete_until(math.inf)

    def _next_worker(self) -> tuple[int, float]:
        """The worker whose next step starts first, and when (-1, inf if all are idle)."""
        best, best_t = -1, math.inf
        for w, engine in enumerate(self.engines):
            if engine.has_work_now:
                t = engine.clock
            elif not engine.idle:  # only requests that arrive later
                t = max(engine.clock, self.wake[w])
            else:
                continue
            if t < best_t:
                best, best_t = w, t
        return best, best_t

    def _route(self, i: int, t: float) -> None:
        req = self.pending[i]
        cached = ([e.tree.cached_length(req.prompt) for e in self.engines]
                  if self.router.match_source == "caches" else None)  # the caches, as events tell
        w = self.router.route(req.prompt, cached)
        # The engine's clock may be past ``t`` (it is mid-step): the request then joins at its
        # next step, and its latency still counts from ``t``.
        self.engines[w].add_request(req, checked=True)  # checked in run_cluster
        self.requests[i], self.workers[i] = req, w
        self.branches[i] = self.router.last_branch or ""
        self.wake[w] = min(self.wake[w], t)
        self._record(t)

    def _step(self, w: int) -> None:
        record = self.engines[w].step(tokens=False).record
        self.wake[w] = math.inf
        if record is None:
            raise RuntimeError(f"worker {w} has requests but could not step")
        for rid in record.finished:
            heapq.heappush(self.finishes, (record.end, w, rid))

    def _complete_until(self, t: float) -> None:
        """Tell the router about every completion that happened at or before ``t``."""
        while self.finishes and self.finishes[0][0] <= t:
            end, w, _ = heapq.heappop(self.finishes)
            self.router.finish(w)
            self._record(end)

    def _record(self, t: float) -> None:
        self.times.append(t)
        self.trace.append(tuple(self.router.loads))

    def result(self) -> ClusterResult:
        reqs: list[Req] = [r for r in self.requests if r is not None]
        engines, n_workers = self.engines, len(self.engines)
        stats = [e.stats for e in engines]
        prompt = sum(s.prompt_tokens for s in stats)
        cached = sum(s.cached_prompt_tokens for s in stats)
        outputs = [0] * n_workers
        for req, w in zip(reqs, self.workers, strict=True):
            outputs[w] += len(req.output)
        start = min((r.arrival for r in reqs), default=0.0)
        end = max((r.finish_time for r in reqs), default=0.0)
        makespan = end - start
        counts = [self.workers.count(w) for w in range(n_workers)]
        mean = len(reqs) / n_workers
        return ClusterResult(
            policy=self.router.policy,
            time_unit=engines[0].backend.time_unit,
            requests=reqs,
            workers=list(self.workers),
            hit_rate=cached / prompt if prompt else 0.0,
            throughput=sum(outputs) / makespan if makespan > 0 else 0.0,
            mean_latency=float(np.mean([r.latency for r in reqs])) if reqs else 0.0,
            makespan=makespan,
            worker_requests=counts,
            worker_output_tokens=outputs,
            worker_prefill_tokens=[s.prefill_tokens for s in stats],
            worker_hit_rates=[s.hit_rate for s in stats],
            worker_busy=[s.busy_time for s in stats],
            worker_steps=[s.steps for s in stats],
            worker_decode_tokens=[s.decode_tokens for s in stats],
            request_ratio=max(counts) / mean if mean else 0.0,
            load_times=np.asarray(self.times, dtype=float),
            load_trace=np.asarray(self.trace, dtype=int).reshape(len(self.times), n_workers),
            decisions=dict(self.router.decisions),
            branches=list(self.branches),
            tree_sizes=self.router.tree.sizes,
        )


def hot_group_latency(run: ClusterResult, workload: Workload,
                      key_len: int = 64) -> tuple[float, float]:
    """Mean latency of the hot group's requests and of all the others', in ``run``'s clock
    unit. The hot group is the prompt start (its first ``key_len`` tokens) that most of
    ``workload``'s requests share: balancing moves wait from the one to the others, which a
    mean over all requests hides."""
    keys = [tuple(p[:key_len]) for p in workload.prompts]
    hot = Counter(keys).most_common(1)[0][0]
    split: dict[bool, list[float]] = {True: [], False: []}
    for key, req in zip(keys, run.requests, strict=True):
        split[key == hot].append(req.latency)
    if not split[False]:
        raise ValueError("every request is in the hot group: there are no others to compare")
    return float(np.mean(split[True])), float(np.mean(split[False]))


def groups_started(run: ClusterResult, workload: Workload, key_len: int = 64) -> list[int]:
    """How many of ``workload``'s groups (prompts alike in their first ``key_len`` tokens)
    began on each worker of ``run``: where each group's first request, its miss, was sent.
    The miss rule decides it, and the rest of a group mostly follows its prefix there."""
    first: dict[tuple[int, ...], int] = {}
    for prompt, worker in zip(workload.prompts, run.workers, strict=True):
        first.setdefault(tuple(prompt[:key_len]), worker)
    counts = Counter(first.values())
    return [counts[w] for w in range(run.n_workers)]


def _as_list(tokens: Sequence[int]) -> list[int]:
    return tokens if isinstance(tokens, list) else list(tokens)
