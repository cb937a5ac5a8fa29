"""The book's experiments: runs and sweeps whose results the chapters tabulate and draw.

Each function builds fresh engines, serves a workload, checks the outputs where a
reference is given, and returns plain results (named tuples or DataFrames); ``minisrv.viz``
only draws them. The defaults are the chapters' small settings, so each call takes seconds;
a reader can pass larger grids. Progress bars are off unless ``progress=True``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import pandas as pd
import torch
from tqdm.auto import tqdm

from minisrv.engine import Engine, RunResult, simulate
from minisrv.kv import KVPool
from minisrv.metrics import request_hit_rate
from minisrv.model import CityLM, FlatBatch
from minisrv.workloads import GPU_SCALE_BATCH_CAP, Workload, gpu_scale_workload

__all__ = [
    "EngineVsAlone",
    "FlatCheck",
    "PoolRun",
    "ServedRequest",
    "cache_comparison",
    "capacity_sweep",
    "chat_capacity_report",
    "engine_vs_alone",
    "flat_equivalence",
    "per_turn_hit_rates",
    "pool_sweep",
    "rate_sweep",
    "run_pool",
    "serve_step",
    "serve_with_cache",
]


# ------------------------------------------------------------------ selective batching
class FlatCheck(NamedTuple):
    """One flat forward over prefills and decodes against running each request alone."""

    n_requests: int  # requests in the step
    n_tokens: int  # new tokens the step computes (rows of every linear layer)
    max_diff: dict[str, float]  # per attention kind: largest |flat - separate| logit


def flat_equivalence(model: CityLM, prompts: Sequence[Sequence[int]], n_decodes: int) -> FlatCheck:
    """Run ``prompts`` as one flat step, the last ``n_decodes`` of them as decodes (their
    earlier tokens already in the pool), and compare each attention kind's logits with a
    separate forward per request. Use a float64 model to see only rounding differences."""
    seqs = [list(p) for p in prompts]
    n_prefill = len(seqs) - n_decodes
    n_new = [len(s) for s in seqs[:n_prefill]] + [1] * n_decodes
    pool = KVPool.for_model(model, sum(map(len, seqs)))
    slots = [pool.alloc(len(s)) for s in seqs]
    with torch.no_grad():
        if n_decodes:
            earlier = FlatBatch([s[:-1] for s in seqs[n_prefill:]],
                                [sl[:-1] for sl in slots[n_prefill:]], model.device)
            model.forward_flat(earlier, pool)
        step = FlatBatch([s[len(s) - n:] for s, n in zip(seqs, n_new)], slots, model.device)
        ids = [torch.tensor(s, device=model.device) for s in seqs]
        separate = torch.cat([model(t)[len(t) - n:] for t, n in zip(ids, n_new)])
        diffs = {attention: (model.forward_flat(step, pool, attention=attention) - separate)
                 .abs().max().item() for attention in ("loop", "padded")}
    return FlatCheck(len(step), step.num_tokens, diffs)


class EngineVsAlone(NamedTuple):
    """The engine against generating every request alone, on the same prompts."""

    tokens: int  # output tokens generated (the same both ways)
    seconds_alone: float  # reference_generate, one request after another
    seconds_engine: float  # Engine.generate, all requests together
    steps: int  # engine steps
    identical: int  # requests whose outputs are equal both ways
    total: int

    @property
    def speedup(self) -> float:
        """How many times faster the engine served the same tokens."""
        return self.seconds_alone / self.seconds_engine


def engine_vs_alone(model: CityLM, workload: Workload, **options: Any) -> EngineVsAlone:
    """Time ``reference_generate`` request by request against one ``Engine(**options)``
    serving them all (default: mixed steps, every request in one batch)."""
    options = {"kv_capacity": 8000, "max_running": len(workload), "mode": "mixed", **options}
    start = time.perf_counter()
    alone = [model.reference_generate(p, m) for p, m in zip(workload.prompts, workload.output_lens)]
    t_alone = time.perf_counter() - start
    engine = Engine(model, **options)
    start = time.perf_counter()
    served = engine.generate(workload.prompts, workload.output_lens)
    t_engine = time.perf_counter() - start
    same = sum(a == b for a, b in zip(served, alone))
    return EngineVsAlone(sum(map(len, served)), t_alone, t_engine, engine.stats.steps, same,
                         len(alone))


class PoolRun(NamedTuple):
    """One pool experiment: the engine after the run and whether outputs matched."""

    engine: Engine
    outputs: list[list[int]]
    identical: int  # requests whose tokens equal the reference
    total: int

    @property
    def check(self) -> str:
        """The sentence every experiment prints."""
        return f"outputs identical to each request alone: {self.identical} of {self.total}"


def run_pool(model: CityLM, workload: Workload, reference: Sequence[Sequence[int]], *,
             capacity: int = 120, ratio: float = 0.7, decay: float = 0.01, max_running: int = 8,
             admission: str = "budget", mode: str = "prefill-first") -> PoolRun:
    """Serve ``workload`` with a pool of ``capacity`` slots and compare with ``reference``."""
    engine = Engine(model, kv_capacity=capacity, max_running=max_running, mode=mode,
                    admission=admission, new_token_ratio=ratio, ratio_decay=decay,
                    min_ratio=min(ratio, 0.1))
    outputs = engine.generate(workload.prompts, workload.output_lens)
    same = sum(list(a) == list(b) for a, b in zip(outputs, reference))
    return PoolRun(engine, outputs, same, len(reference))


def pool_sweep(model: CityLM, workload: Workload, reference: Sequence[Sequence[int]],
               capacities: Sequence[int], ratios: Sequence[float | None], *,
               decay: float = 0.001, max_running: int = 8,
               progress: bool = False) -> tuple[pd.DataFrame, int, int]:
    """Serve ``workload`` for every capacity and initial ratio (``None``: reserve admission).

    Returns one row per run (steps, mean decode batch, retractions, recomputed tokens) and
    the count of runs whose outputs all matched, out of all runs.
    """
    rows, all_same = [], 0
    jobs = [(c, r) for c in capacities for r in ratios]
    for capacity, ratio in tqdm(jobs, desc="pool sweep", leave=False, disable=not progress):
        run = run_pool(model, workload, reference, capacity=capacity,
                       ratio=1.0 if ratio is None else ratio, decay=decay,
                       max_running=max_running,
                       admission="reserve" if ratio is None else "budget")
        decodes = [len(s.decode) for s in run.engine.trace if s.decode]
        stats = run.engine.stats
        rows.append({
            "capacity": capacity,
            "initial ratio": "reserve" if ratio is None else f"{ratio:g}",
            "steps": stats.steps,
            "mean decode batch": round(sum(decodes) / len(decodes), 2),
            "retractions": stats.retractions,
            "recomputed tokens": stats.wasted_tokens,
        })
        all_same += run.identical == run.total
    return pd.DataFrame(rows), all_same, len(jobs)


# ------------------------------------------------------------------ the scheduler loop
def rate_sweep(rates: Sequence[float] = (8, 16, 32, 64),
               modes: Sequence[str] = ("static", "prefill-first"), n: int = 2000,
               max_running: int = GPU_SCALE_BATCH_CAP, output_cv: float = 1.0, seed: int = 0,
               progress: bool = False) -> pd.DataFrame:
    """Simulate the GPU-scale workload at each arrival rate under each mode (reserve
    admission, as in the scheduler-loop chapter).

    One row per (rate, mode) with the run's metrics. The default grid takes a few seconds;
    pass more rates, more requests or other seeds to explore (each run is about a second).
    """
    rows = []
    grid = [(rate, mode) for rate in rates for mode in modes]
    for rate, mode in tqdm(grid, desc="simulating", disable=not progress):
        workload = gpu_scale_workload(n=n, rate=rate, output_cv=output_cv, seed=seed)
        metrics = simulate(workload, mode=mode, max_running=max_running,
                           admission="reserve").metrics
        rows.append({"rate": rate, "mode": mode, **metrics.as_dict()})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------ the prefix cache
def serve_with_cache(model: Any, workload: Workload, cache: str, kv_capacity: int = 4000,
                     max_running: int = 8, **options: Any) -> tuple[Engine, RunResult]:
    """Replay ``workload`` on a fresh engine with ``cache`` ("radix" or "none")."""
    engine = Engine(model, kv_capacity=kv_capacity, max_running=max_running, cache=cache,
                    **options)
    return engine, engine.run_workload(workload)


class ServedRequest(NamedTuple):
    """What serving one request did to the cache (for the walk-through's captions)."""

    prompt_len: int  # tokens in its prompt
    cached: int  # of those, found in the cache
    evicted: int  # tokens evicted to make room for it
    output: list[int]  # the generated ids


def serve_step(engine: Engine, prompt: Sequence[int], max_new_tokens: int) -> ServedRequest:
    """Serve one request alone on ``engine`` and report how much of its prompt hit and how
    much the cache evicted for it."""
    cached, evicted = engine.stats.cached_tokens, engine.stats.evicted_tokens
    output = engine.generate([list(prompt)], max_new_tokens)[0]
    return ServedRequest(len(prompt), engine.stats.cached_tokens - cached,
                         engine.stats.evicted_tokens - evicted, output)


def cache_comparison(model: Any, workloads: Mapping[str, Workload], kv_capacity: int = 4000,
                     max_running: int = 8) -> pd.DataFrame:
    """Each workload served twice, without and with the radix cache: prompt tokens, tokens
    prefilled each way, the hit rate, and whether every output is the same both ways."""
    rows = []
    for name, workload in workloads.items():
        plain_engine, plain = serve_with_cache(model, workload, "none", kv_capacity,
                                               max_running)
        radix_engine, radix = serve_with_cache(model, workload, "radix", kv_capacity,
                                               max_running)
        same = all(a.output == b.output for a, b in zip(plain.requests, radix.requests))
        rows.append({
            "workload": name,
            "requests": len(workload),
            "prompt tokens": sum(workload.prompt_lens),
            "prefilled, no cache": plain_engine.stats.prefill_tokens,
            "prefilled, radix": radix_engine.stats.prefill_tokens,
            "hit rate": round(radix_engine.stats.hit_rate, 3),
            "outputs identical": same,
        })
    return pd.DataFrame(rows).set_index("workload")


def per_turn_hit_rates(reqs: Sequence[Any], n_sessions: int) -> list[float]:
    """Hit rate of each turn of ``chat_sessions_workload`` (request ``i`` is turn
    ``i // n_sessions``)."""
    turns = [reqs[t:t + n_sessions] for t in range(0, len(reqs), n_sessions)]
    return [request_hit_rate(turn) for turn in turns]


def capacity_sweep(model: Any, workload: Workload, capacities: Sequence[int],
                   max_running: int = 8, progress: bool = False) -> pd.DataFrame:
    """Hit rate and tokens prefilled when ``workload`` runs with each KV pool size."""
    rows = []
    for capacity in tqdm(capacities, desc="pool sizes", leave=False, disable=not progress):
        engine, _ = serve_with_cache(model, workload, "radix", capacity, max_running)
        rows.append({"kv capacity": capacity, "hit rate": round(engine.stats.hit_rate, 3),
                     "prefilled": engine.stats.prefill_tokens,
                     "retractions": engine.stats.retractions})
    return pd.DataFrame(rows).set_index("kv capacity")


def chat_capacity_report(model: Any, tok: Any, capacity: int = 400, sessions: int = 8,
                         turns: int = 4, built: dict | None = None) -> pd.DataFrame:
    """Build ``sessions`` chats of ``turns`` turns, serve them with the radix cache in a pool
    of ``capacity`` tokens, and tabulate the hit rate of each turn and overall.

    ``built`` maps ``(sessions, turns)`` to workloads already built (generating the chats'
    answers is the slow part); new ones are added to it.
    """
    from minisrv.prefix_workloads import chat_sessions_workload

    built = {} if built is None else built
    if (sessions, turns) not in built:
        built[sessions, turns] = chat_sessions_workload(model, tok, sessions, turns)
    _, run = serve_with_cache(model, built[sessions, turns], "radix", capacity)
    rates = per_turn_hit_rates(run.requests, sessions) + [request_hit_rate(run.requests)]
    labels = [f"turn {t + 1}" for t in range(turns)] + ["all turns"]
    return pd.DataFrame({"hit rate": [f"{r:.1%}" for r in rates]}, index=labels).T
