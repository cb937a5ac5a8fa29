"""The server chapter's experiments: a running server looked at from both sides.

``open_server`` (in ``server_walk``, whose repeated walk opens its own) builds the same app
``minisrv serve`` runs, in this process, so the caller can read its engine while it serves
(its trace, its radix tree, the requests it finished); ``server_walk`` sends one streamed
request, timestamps every server-sent event and tabulates them, and the radix tree's side
of the same request;
``bench_layouts`` serves each of several layouts in turn and replays the same requests
against each with ``run_bench``; ``bench_frame`` lays their results out as one table.
``sim_server_runs`` serves a prefix-heavy workload (``prefix_heavy_requests``) over the
simulated H100 (``minisrv.sim.served``) with each policy and cache several times, and ``spread`` /
``beyond_spread`` say whether their TTFT and throughput differ beyond the run-to-run spread.
``policy_rate_sweep`` feeds the same engines the workload as a Poisson process at several request
rates, in simulated time: latency against throughput, the curve a load test is run to find
(``server_sweep`` reads its table: goodput, completion rate, the share that met a target).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import random
import string
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import pandas as pd

from minisrv.checks import check_int
from minisrv.experiments.server_walk import open_server
from minisrv.server.bench import BenchRequest, BenchResult, run_bench
from minisrv.server.config import EngineOptions

__all__ = ["SIM_CONFIGS", "Layout", "LayoutRun", "bench_frame", "bench_layouts", "beyond_spread",
           "policy_rate_sweep", "prefix_heavy_requests", "read_metrics",
           "request_timelines", "run_sync", "sim_server_runs", "spread", "spread_summary"]

T = TypeVar("T")


@dataclass(frozen=True)
class Layout:
    """One way to serve: the engine's options and the number of data-parallel workers
    (``--dp``). With one worker the engine runs in a thread of the server (``minisrv serve
    --engine-thread``), where the book can look inside it, unless ``engine_process`` puts it
    in a process of its own, as ``minisrv serve`` does by default and as every worker of
    ``--dp 2`` is."""

    options: EngineOptions = field(default_factory=EngineOptions)
    dp: int = 1
    engine_process: bool = False


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to the end from synchronous code, even where an event loop already runs
    (a notebook's): in a fresh loop on a helper thread."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


WARM_UP = BenchRequest("US:", 2)
"""Sent before a measured run: pays the first connection and step, and shares no prefix
with the book's workloads, so it lends no run a cache hit."""


@dataclass(frozen=True)
class LayoutRun:
    """One layout's bench result, its server's own gauges and counters afterwards and, for an
    engine in this process over a timed device (the simulated H100), the seconds that device
    spent on the bench's steps: the rest of the bench's duration it sat idle. For an engine in
    this process that records its trace (``record_trace``), ``steps`` holds the bench's steps
    (``server_walk.step_frame``: what each computed, its wall-clock time)."""

    result: BenchResult
    metrics: dict[str, float]
    device_busy_s: float | None = None
    steps: pd.DataFrame | None = None


def _device_busy(engines: Any) -> float | None:
    """Seconds the timed device (``TimedBackend``, the simulated H100's ``PacedBackend``) of
    an engine in this process has spent on steps so far; ``None`` for a model's backend or
    an engine in a worker process, whose device time this process cannot read."""
    from minisrv.sim.timed import TimedBackend

    loop = getattr(engines, "loop", None)
    backend = getattr(getattr(loop, "engine", None), "backend", None)
    return backend.busy if isinstance(backend, TimedBackend) else None


def read_metrics(url: str) -> dict[str, float]:
    """``/metrics`` parsed with prometheus_client's parser: sample name -> value."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


def bench_layouts(layouts: Mapping[str, Layout], requests: Sequence[BenchRequest],
                  **bench: Any) -> dict[str, LayoutRun]:
    """Serve each layout in turn and replay ``requests`` against it (``bench`` goes to
    ``run_bench``: ``max_concurrency``, ``request_rate``, ``ignore_eos`` ...), after one
    ``WARM_UP`` request; read the server's ``/metrics`` before stopping it. The steps of an
    engine in this process that records its trace (in the blocking loop) are stamped meanwhile
    (``timed_steps``)."""
    from minisrv.experiments.server_walk import step_frame, timed_steps

    bench.setdefault("progress", False)
    out: dict[str, LayoutRun] = {}
    for name, layout in layouts.items():
        with open_server(layout) as (url, engines):
            run_sync(run_bench(url, [WARM_UP], progress=False))
            engine = getattr(getattr(engines, "loop", None), "engine", None)
            traced = (engine is not None and engine.config.record_trace
                      and not engine.config.overlap)  # one trace record per step
            first = len(engine.trace) if traced else 0
            before = _device_busy(engines)
            with timed_steps(engine) if traced else nullcontext({}) as stamps:
                result = run_sync(run_bench(url, requests, **bench))
            after = _device_busy(engines)
            busy = None if before is None or after is None else after - before
            steps = step_frame(engine.trace[first:], stamps) if traced else None
            out[name] = LayoutRun(result, read_metrics(url), busy, steps)
    return out


def bench_frame(runs: Mapping[str, LayoutRun]) -> pd.DataFrame:
    """One row per run: throughput, the server's cache hit rate, the latency statistics
    ``minisrv bench`` prints, the bench's duration and the seconds of it that a timed device
    was busy (NaN where it is not known: ``LayoutRun.device_busy_s``)."""
    rows = []
    for name, run in runs.items():
        r = run.result
        busy = math.nan if run.device_busy_s is None else run.device_busy_s
        row: dict[str, Any] = {"run": name, "completed": r.completed, "failed": r.failed,
                               "req/s": r.request_throughput, "out tok/s": r.output_throughput,
                               "hit rate": run.metrics.get("minisrv:cache_hit_rate", 0.0),
                               "duration (s)": r.duration_s, "device busy (s)": busy}
        for key in ("ttft", "itl", "e2e"):
            for stat in ("median", "p99"):
                row[f"{key} {stat} (ms)"] = r.latency_ms[key][stat]
        rows.append(row)
    return pd.DataFrame(rows).set_index("run")


def prefix_heavy_requests(groups: int = 8, prefix_len: int = 800, n: int = 64,
                          output_len: int = 16, seed: int = 0) -> list[BenchRequest]:
    """``n`` requests in ``groups`` interleaved groups (request i in group ``i % groups``):
    each prompt is its group's ``prefix_len`` characters, ``":"`` and 20 of its own; every
    reply is ``output_len`` tokens long. Letters only, so CityLM's tokenizer takes them."""
    groups = check_int("groups", groups, minimum=1)
    prefix_len = check_int("prefix_len", prefix_len, minimum=1)
    n = check_int("n", n, minimum=1)
    output_len = check_int("output_len", output_len, minimum=1)
    rng = random.Random(seed)
    letters = string.ascii_lowercase
    heads = ["".join(rng.choices(letters, k=prefix_len)) for _ in range(groups)]
    return [BenchRequest(f"{heads[i % groups]}:{''.join(rng.choices(letters, k=20))}",
                         output_len) for i in range(n)]


SIM_CONFIGS: dict[str, dict[str, str]] = {
    "LPM": {"policy": "lpm", "cache": "radix"},
    "FCFS allocate-each": {"policy": "fcfs", "cache": "radix"},
    "FCFS lock-first (SGLang)": {"policy": "fcfs", "cache": "radix",
                                 "admission_order": "lock-round-first"},
    "FCFS no-cache": {"policy": "fcfs", "cache": "none"},
}
"""The engine options ``sim_server_runs`` compares, named as the page, its tables and its
figures name them: all but ``"FCFS no-cache"`` use the radix cache (LPM without one would be
FCFS). ``"FCFS allocate-each"`` is minisrv's default order, which allocates KV for (and evicts
for) each request as it admits it; SGLang's order (lock-first) locks a round's prefixes before
it allocates for any (``admission_order``)."""

_SHOWN_ORDER: tuple[str, ...] = ("FCFS no-cache", "FCFS allocate-each",
                                 "FCFS lock-first (SGLang)", "LPM")
"""The rows of ``sim_server_runs``, from no cache to LPM: the runs take turns in
``SIM_CONFIGS``'s order, the table reads best from the plainest server up."""


def sim_server_runs(requests: Sequence[BenchRequest], runs: int = 3, pace: float = 1.0,
                    kv_capacity: int = 6000, max_running: int = 16) -> pd.DataFrame:
    """Each of ``SIM_CONFIGS`` served over HTTP on the simulated H100 (``python -m
    minisrv.sim.served --model sim:PACE``, in this process), ``runs`` times, the
    configurations taking turns; one row per run with
    its TTFT, throughput and the server's hit rate (``bench_frame``), indexed by
    (configuration, run), the configurations from no cache to LPM. A small pool
    (``kv_capacity``) puts it under pressure: what the
    cache keeps, and in which order the policy admits, decide what is recomputed."""
    runs = check_int("runs", runs, minimum=1)
    layouts = {name: Layout(EngineOptions(model=f"sim:{pace:g}", kv_capacity=kv_capacity,
                                          max_running=max_running, **options))
               for name, options in SIM_CONFIGS.items()}
    frames = []
    for run in range(runs):
        frame = bench_frame(bench_layouts(layouts, requests, ignore_eos=True))
        frames.append(frame.assign(repeat=run).set_index("repeat", append=True))
    return (pd.concat(frames).sort_index().reindex(list(_SHOWN_ORDER), level=0)
            .rename_axis(["configuration", "repeat"]))


def spread(runs: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    """Per configuration: the median, min and max over its runs of each of ``columns``."""
    grouped = runs.groupby(level=0, sort=False)[list(columns)]
    out = pd.concat({"median": grouped.median(), "min": grouped.min(), "max": grouped.max()},
                    axis=1).swaplevel(axis=1)
    return out[[(c, s) for c in columns for s in ("median", "min", "max")]]


def beyond_spread(runs: pd.DataFrame, column: str, a: str, b: str) -> bool:
    """Whether every run of ``a`` and every run of ``b`` differ in ``column`` the same way:
    their ranges (min..max over the runs) do not overlap."""
    x, y = runs.xs(a, level=0)[column], runs.xs(b, level=0)[column]
    return bool(x.max() < y.min() or y.max() < x.min())


def spread_summary(runs: pd.DataFrame, columns: Mapping[str, str]) -> pd.DataFrame:
    """Per configuration, one cell per column: its median over the runs and, in brackets,
    its min and max, formatted with ``columns[column]`` (``"{:,.0f}"``); the value alone where
    min and max read the same (``"0.00 [0.00, 0.00]"`` only widened the table). No-break
    spaces keep a cell on one line: a page's narrow column wrapped ``[min, max]`` onto two.

    One header row and one column per metric, so the table fits the page where ``spread``'s
    three sub-columns per metric did not; a metric's abbreviation is capitalised in its
    header (``"TTFT median (ms)"``)."""
    stats = spread(runs, list(columns))
    cells = {}
    for column, fmt in columns.items():
        median, low, high = (stats[(column, s)] for s in ("median", "min", "max"))
        cells[column] = [fmt.format(m) if fmt.format(a) == fmt.format(b)
                         else f"{fmt.format(m)}\u00a0[{fmt.format(a)},\u00a0{fmt.format(b)}]"
                         for m, a, b in zip(median, low, high, strict=True)]
    out = pd.DataFrame(cells, index=stats.index)
    out.columns = [_headline(column) for column in out.columns]
    out.columns.name, out.index.name = out.index.name, None  # one header row
    return out


def _headline(column: str) -> str:
    """A column name as a header: the latency metrics' abbreviations in capitals, as the text
    writes them (``"ttft median (ms)"`` -> ``"TTFT median (ms)"``)."""
    words = column.split(" ")
    return " ".join(w.upper() if w in ("ttft", "itl", "e2e") else w for w in words)


def _poisson_arrivals(n: int, seed: int) -> np.ndarray:
    """``n`` arrival times of a Poisson process of rate 1, rescaled so that the mean gap is
    exactly 1: divided by a rate, they span exactly ``n / rate`` seconds."""
    gaps = np.random.default_rng(seed).exponential(1.0, n)
    return np.cumsum(gaps) * n / gaps.sum()


def _sim_run(prompts: Sequence[Sequence[int]], output_len: int, arrivals: Sequence[float],
             options: Mapping[str, str], kv_capacity: int, max_running: int) -> Any:
    """One run of the simulated H100 server's engine (no pacing, no HTTP) on ``prompts``
    arriving at ``arrivals`` (simulated seconds): the engine and its ``RunResult``."""
    from minisrv.engine import Engine
    from minisrv.sim.served import sim_backend
    from minisrv.workloads.mixes import Workload

    engine = Engine(sim_backend().inner, kv_capacity=kv_capacity, max_running=max_running,
                    **options)
    workload = Workload(f"{len(prompts)} requests", [list(p) for p in prompts],
                        [output_len] * len(prompts), list(arrivals))
    return engine, engine.run_workload(workload)


def policy_rate_sweep(prompts: Sequence[Sequence[int]], output_len: int, rates: Sequence[float],
                      configs: Mapping[str, Mapping[str, str]] = SIM_CONFIGS,
                      kv_capacity: int = 6000, max_running: int = 16,
                      seed: int = 0) -> pd.DataFrame:
    """Serve ``prompts`` (``output_len`` tokens each) with each of ``configs`` on the engine of
    the simulated H100 server (``minisrv.sim.served``'s backend without the pacing, so the
    clock is simulated seconds and no HTTP is involved), the requests arriving as a Poisson
    process at each of ``rates`` requests per second.

    One row per (configuration, rate): output tokens per second, TTFT median and p99 (ms),
    the hit rate, the run's duration (s), every request's TTFT (ms, a tuple, for
    ``goodput``) and the rounds of admission (the requests prefilled in one step): their mean
    and largest size, and the most prompt tokens that a request prefilled alone in its step
    found in the cache (what a round's size does to the hit rate). Every rate and
    configuration replays the same exponential gaps (common random numbers), scaled so that
    the requests arrive over exactly ``len(prompts) / rate`` seconds: two points differ by their
    rate and configuration, not by their draw of arrivals, and a server that keeps up serves
    the rate it is offered."""
    output_len = check_int("output_len", output_len, minimum=1)
    if not prompts or not rates or min(rates) <= 0:
        raise ValueError(f"need prompts and rates > 0, got {len(prompts)} prompts, "
                         f"rates {list(rates)}")
    times = _poisson_arrivals(len(prompts), seed)
    rows = []
    for name, options in configs.items():
        for rate in rates:
            engine, run = _sim_run(prompts, output_len, times / rate, options, kv_capacity,
                                   max_running)
            ttft = np.array([r.ttft for r in run.requests]) * 1e3
            rounds = [step.prefill for step in run.trace if step.prefill]
            alone = {ids[0] for ids in rounds if len(ids) == 1}
            rows.append({"configuration": name, "rate": float(rate),
                         "out tok/s": run.metrics.throughput,
                         "ttft median (ms)": float(np.median(ttft)),
                         "ttft p99 (ms)": float(np.percentile(ttft, 99)),
                         "hit rate": engine.stats.cached_prompt_tokens
                         / engine.stats.prompt_tokens,
                         "duration (s)": run.metrics.duration, "ttfts (ms)": tuple(ttft),
                         "mean round": float(np.mean([len(ids) for ids in rounds])),
                         "largest round": max(len(ids) for ids in rounds),
                         "cached alone (max)": max((r.cached_prompt_tokens for r in run.requests
                                                    if r.rid in alone), default=0)})
    return pd.DataFrame(rows).set_index(["configuration", "rate"])


def request_timelines(prompts: Sequence[Sequence[int]], output_len: int, rate: float,
                      configs: Mapping[str, Mapping[str, str]] = SIM_CONFIGS,
                      kv_capacity: int = 6000, max_running: int = 16,
                      seed: int = 0) -> pd.DataFrame:
    """The point ``rate`` of ``policy_rate_sweep`` (same arrivals, same engines) request by
    request: one row per (configuration, request id) with, in ms of the simulated clock, its
    arrival, the start of its prefill step (``admitted``), its first token, its last token
    and the time of every token; the prompt tokens it found in the cache; and for each gap
    between two of its tokens, the prefill steps (of other requests) that ran in it.

    Queued is ``admitted - arrival``, prefill ``first token - admitted``, decode
    ``finish - first token``: together the request's end-to-end latency, TTFT the first
    two."""
    output_len = check_int("output_len", output_len, minimum=1)
    if not prompts or rate <= 0:
        raise ValueError(f"need prompts and a rate > 0, got {len(prompts)} prompts, rate {rate}")
    times = _poisson_arrivals(len(prompts), seed) / rate
    rows = []
    for name, options in configs.items():
        _, run = _sim_run(prompts, output_len, times, options, kv_capacity, max_running)
        prefill_ends = sorted(step.end for step in run.trace if step.prefill)
        rows += [{"configuration": name, "rid": r.rid, "arrival (ms)": r.arrival * 1e3,
                  "admitted (ms)": r.admitted_at * 1e3,
                  "first token (ms)": r.first_token_time * 1e3,
                  "finish (ms)": r.finish_time * 1e3,
                  "token times (ms)": tuple(t * 1e3 for t in r.token_times),
                  "cached tokens": r.cached_prompt_tokens,
                  "prefill steps per gap": tuple(
                      bisect.bisect_right(prefill_ends, b) - bisect.bisect_right(prefill_ends, a)
                      for a, b in itertools.pairwise(r.token_times))} for r in run.requests]
    return pd.DataFrame(rows).set_index(["configuration", "rid"])

