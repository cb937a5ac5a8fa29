"""The RadixAttention chapter's runs: serving with and without the prefix cache, one request
at a time for the walk-through, the hit rate per chat turn and the pool-size sweep.

Each function builds fresh engines, serves a workload and returns plain results (named
tuples or DataFrames); ``minisrv.viz.radix`` only draws them. Progress bars are off unless
``progress=True``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import pandas as pd
from tqdm.auto import tqdm

from minisrv.engine import Engine, RunResult
from minisrv.request import Req
from minisrv.scheduler import hit_rate
from minisrv.workloads import Workload, chat_sessions_workload

__all__ = [
    "ServedRequest",
    "cache_comparison",
    "capacity_sweep",
    "chat_capacity_report",
    "per_turn_hit_rates",
    "request_hit_rate",
    "serve_step",
    "serve_with_cache",
]


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
    built = {} if built is None else built
    if (sessions, turns) not in built:
        built[sessions, turns] = chat_sessions_workload(model, tok, sessions, turns)
    _, run = serve_with_cache(model, built[sessions, turns], "radix", capacity)
    rates = per_turn_hit_rates(run.requests, sessions) + [request_hit_rate(run.requests)]
    labels = [f"turn {t + 1}" for t in range(turns)] + ["all turns"]
    return pd.DataFrame({"hit rate": [f"{r:.1%}" for r in rates]}, index=labels).T


def request_hit_rate(reqs: Sequence[Req]) -> float:
    """The hit rate of any group of requests (one turn of a chat, one worker's share):
    their cached prompt tokens at first admission over their prompt tokens."""
    return hit_rate(sum(r.cached_prompt_tokens for r in reqs), sum(r.prompt_len for r in reqs))
