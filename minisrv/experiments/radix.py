"""The RadixAttention chapter's runs: serving with and without the prefix cache, one request
at a time for the walk-through, the hit rate per chat turn and the pool-size sweep.

Each function builds fresh engines, serves a workload and returns plain results (named
tuples or DataFrames); ``minisrv.viz.radix`` only draws them. Progress bars are off unless
``progress=True``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import pandas as pd
from tqdm.auto import tqdm

from minisrv.checks import check_int
from minisrv.engine import Engine, RunResult
from minisrv.experiments.batching import alone_outputs
from minisrv.request import Req
from minisrv.scheduler import hit_rate
from minisrv.workloads import Workload, chat_sessions_workload

__all__ = [
    "ChatCapacityRun",
    "ServedRequest",
    "cache_comparison",
    "capacity_sweep",
    "chat_capacity_report",
    "chat_capacity_run",
    "chat_workload",
    "per_turn_hit_rates",
    "request_hit_rate",
    "serve_step",
    "serve_with_cache",
    "shared_header_workload",
    "simulated_cache_table",
]


# each model's runs, by what decides one: serve_with_cache's default ``served``
_SERVED: weakref.WeakKeyDictionary[Any, dict[tuple, tuple[Engine, RunResult]]] = (
    weakref.WeakKeyDictionary())


def serve_with_cache(model: Any, workload: Workload, cache: str, kv_capacity: int = 4000,
                     max_running: int = 8, served: dict | None = None,
                     **options: Any) -> tuple[Engine, RunResult]:
    """Replay ``workload`` on a fresh engine with ``cache`` ("radix" or "none").

    ``served``: the runs made so far, by everything that decides one (the cache, pool, cap,
    options and the workload's requests); a run found there is returned, not served again
    (a fresh engine serves the same workload the same way, step for step), a new one is
    added. Left out, the model's own dict is used, kept for as long as the model lives, so a
    page's tables, sweeps and explorers share their runs without passing them around (as
    ``alone_outputs`` shares its references). Callers read what they get and change nothing
    of it."""
    if served is None:
        served = _SERVED.setdefault(model, {})
    key = (cache, kv_capacity, max_running, tuple(sorted(options.items())),
           tuple(map(tuple, workload.prompts)), tuple(workload.output_lens),
           tuple(workload.arrivals))
    if key not in served:
        engine = Engine(model, kv_capacity=kv_capacity, max_running=max_running, cache=cache,
                        **options)
        served[key] = engine, engine.run_workload(workload)
    return served[key]


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
                     max_running: int = 8, served: dict | None = None) -> pd.DataFrame:
    """Each workload served twice, without and with the radix cache: prompt tokens, tokens
    prefilled each way, the hit rate (a percentage) and ``outputs as alone``, the requests
    whose output equals the request generated alone in both runs ("16/16"; ``alone_outputs``,
    each prompt generated once per model). ``served``: as ``serve_with_cache`` takes it."""
    rows = []
    for name, workload in workloads.items():
        plain_engine, plain = serve_with_cache(model, workload, "none", kv_capacity,
                                               max_running, served)
        radix_engine, radix = serve_with_cache(model, workload, "radix", kv_capacity,
                                               max_running, served)
        same = 0
        alone = alone_outputs(model, workload)
        for a, b, c in zip(plain.requests, radix.requests, alone, strict=True):
            same += list(a.output) == list(b.output) == list(c)
        rows.append({
            "workload": name,
            "requests": len(workload),
            "prompt tokens": sum(workload.prompt_lens),
            "prefilled, no cache": plain_engine.stats.prefill_tokens,
            "prefilled, radix": radix_engine.stats.prefill_tokens,
            "hit rate": f"{radix_engine.stats.hit_rate:.1%}",
            "outputs as alone": f"{same}/{len(workload)}",
        })
    return pd.DataFrame(rows).set_index("workload")


def per_turn_hit_rates(reqs: Sequence[Any], n_sessions: int) -> list[float]:
    """Hit rate of each turn of ``chat_sessions_workload`` (request ``i`` is turn
    ``i // n_sessions``)."""
    turns = [reqs[t:t + n_sessions] for t in range(0, len(reqs), n_sessions)]
    return [request_hit_rate(turn) for turn in turns]


def capacity_sweep(model: Any, workload: Workload, capacities: Sequence[int],
                   max_running: int = 8, progress: bool = False,
                   served: dict | None = None) -> pd.DataFrame:
    """Hit rate and tokens prefilled when ``workload`` runs with each KV pool size
    (``served``: as ``serve_with_cache`` takes it)."""
    rows = []
    for capacity in tqdm(capacities, desc="pool sizes", leave=False, disable=not progress):
        engine, _ = serve_with_cache(model, workload, "radix", capacity, max_running, served)
        rows.append({"kv capacity": capacity, "hit rate": round(engine.stats.hit_rate, 3),
                     "prefilled": engine.stats.prefill_tokens,
                     "retractions": engine.stats.retractions})
    return pd.DataFrame(rows).set_index("kv capacity")


class ChatCapacityRun(NamedTuple):
    """The chats served once in one pool (``chat_capacity_run``)."""

    table: pd.DataFrame  # hit rate of each turn and of all turns, as percentages
    hit_rates: list[float]  # the same numbers: turn 1, turn 2, ..., then all turns
    requests: int  # requests served
    identical: int  # of those, outputs equal to the request generated alone (-1: unchecked)


def chat_workload(model: Any, tok: Any, sessions: int, turns: int,
                  built: dict[tuple[int, int], Workload]) -> Workload:
    """``chat_sessions_workload(model, tok, sessions, turns)``, taken from a chat ``built``
    already where one covers it, else built and added to ``built``.

    Generating the answers is the slow part of a chat, and a larger chat holds every smaller
    one: session ``s``'s messages and answers depend only on ``s`` and the turn, not on how
    many sessions or turns were built, and request ``i`` of ``S`` sessions is turn
    ``i // S`` of session ``i % S``. So the requests of the first ``sessions`` sessions and
    ``turns`` turns of a built chat, in their order, are the smaller chat itself.
    """
    check_int("sessions", sessions, minimum=1)
    check_int("turns", turns, minimum=1)
    for (n_sessions, n_turns), chat in built.items():
        if n_sessions >= sessions and n_turns >= turns:
            keep = [i for i in range(len(chat))
                    if i % n_sessions < sessions and i // n_sessions < turns]
            return Workload(chat.name, [chat.prompts[i] for i in keep],
                            [chat.output_lens[i] for i in keep],
                            [chat.arrivals[i] for i in keep],
                            f"{sessions} chat sessions x {turns} turns")
    built[sessions, turns] = chat_sessions_workload(model, tok, sessions, turns)
    return built[sessions, turns]


def chat_capacity_run(model: Any, tok: Any, capacity: int = 400, sessions: int = 8,
                      turns: int = 4, built: dict | None = None, alone: dict | None = None,
                      check: bool = True, served: dict | None = None) -> ChatCapacityRun:
    """Serve ``sessions`` chats of ``turns`` turns with the radix cache in a pool of
    ``capacity`` tokens: the hit rate of each turn and overall, and (``check``) how many
    outputs equal the request generated alone.

    ``built``: chats already built, as ``chat_workload`` takes them (new ones are added).
    ``alone``: each request's output generated alone, by (prompt, max_new_tokens); missing
    ones are generated and added, so runs of the same chats in other pools check for free.
    Left out, ``alone_outputs``'s runs for the model are used (each prompt generated once
    for every caller). ``served``: as ``serve_with_cache`` takes it.
    """
    built = {} if built is None else built
    workload = chat_workload(model, tok, sessions, turns, built)
    _, run = serve_with_cache(model, workload, "radix", capacity, served=served)
    rates = per_turn_hit_rates(run.requests, sessions) + [request_hit_rate(run.requests)]
    labels = [f"turn {t + 1}" for t in range(turns)] + ["all turns"]
    table = pd.DataFrame({"hit rate": [f"{r:.1%}" for r in rates]}, index=labels).T
    identical = -1
    if check:
        if alone is None:
            reference = alone_outputs(model, workload)
        else:
            for req in run.requests:
                key = (tuple(req.prompt), req.params.max_new_tokens)
                if key not in alone:
                    alone[key] = model.reference_generate(req.prompt, req.params.max_new_tokens)
            reference = [alone[tuple(r.prompt), r.params.max_new_tokens] for r in run.requests]
        identical = sum(list(req.output) == list(ref)
                        for req, ref in zip(run.requests, reference, strict=True))
    return ChatCapacityRun(table, rates, len(run.requests), identical)


def chat_capacity_report(model: Any, tok: Any, capacity: int = 400, sessions: int = 8,
                         turns: int = 4, built: dict | None = None) -> pd.DataFrame:
    """Build ``sessions`` chats of ``turns`` turns, serve them with the radix cache in a pool
    of ``capacity`` tokens, and tabulate the hit rate of each turn and overall.

    ``built`` maps ``(sessions, turns)`` to workloads already built (generating the chats'
    answers is the slow part); new ones are added to it. ``chat_capacity_run`` also checks
    every output against the request generated alone.
    """
    return chat_capacity_run(model, tok, capacity, sessions, turns, built, check=False).table


def request_hit_rate(reqs: Sequence[Req]) -> float:
    """The hit rate of any group of requests (one turn of a chat, one worker's share):
    their cached prompt tokens at first admission over their prompt tokens."""
    return hit_rate(sum(r.cached_prompt_tokens for r in reqs), sum(r.prompt_len for r in reqs))


def shared_header_workload(header: int = 2048, n: int = 200, question: int = 64,
                           output_len: int = 128, rate: float = 20.0, seed: int = 0
                           ) -> Workload:
    """``n`` users of one ``header``-token system prompt, each with a ``question``-token
    question of its own and ``output_len`` tokens to generate, arriving ``rate`` a second
    (evenly spaced): the shared-prompt pattern at GPU scale, for the simulator."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shared = list(range(10, 10 + header))
    prompts = [shared + [int(t) for t in rng.integers(10, 100_000, question)]
               for _ in range(n)]
    return Workload("shared header", prompts, [output_len] * n,
                    [i / rate for i in range(n)],
                    f"{n} users of one {header}-token header, {rate:g} a second")


def simulated_cache_table(rate: float = 20.0, **workload_args: Any) -> pd.DataFrame:
    """``shared_header_workload`` on the simulated H100 serving LLaMA-3-8B (64 running at
    most), with ``cache="none"`` and ``cache="radix"``, one row each, from two runs: paced,
    with users arriving ``rate`` a second (the hit rate, the mean and p99 time to first
    token), and all at once, the GPU never idle (the hit rate, the output tokens per second).
    Each column names its run: the two runs' hit rates differ, since requests admitted into
    one step cannot find what the others of that step compute."""
    from minisrv.sim import simulate

    paced = shared_header_workload(rate=rate, **workload_args)
    at_once = dataclasses.replace(paced, arrivals=[0.0] * len(paced))
    rows = {}
    for cache in ("none", "radix"):
        spread = simulate(paced, cache=cache, max_running=64)
        burst = simulate(at_once, cache=cache, max_running=64)
        rows[cache] = {"hit rate, paced": request_hit_rate(spread.requests),
                       "mean TTFT (ms), paced": 1e3 * spread.metrics.mean_ttft,
                       "p99 TTFT (ms), paced": 1e3 * spread.metrics.p99_ttft,
                       "hit rate, all at once": request_hit_rate(burst.requests),
                       "output tok/s, all at once": burst.metrics.throughput}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("cache")
