"""The experiments of the cache-aware scheduling chapter, as plain functions and DataFrames.

Each runner serves a workload with the real engine (CityLM, or the simulated GPU) under one
or more policies and returns numbers; nothing here draws (``minisrv.viz.policy`` does). Runs
with the real model compare every request's tokens with ``reference_outputs`` (each request
generated alone), because a policy may change when tokens are computed, never which.

A reader can re-run any experiment larger than the chapter does (more requests, finer
capacity sweeps) by calling these functions with other arguments.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from minisrv.configs import LLAMA3_8B
from minisrv.engine import Engine, RunResult
from minisrv.experiments.batching import alone_outputs
from minisrv.kv import RadixCache
from minisrv.scheduler import SchedulerStats, calc_priority, optimal_hit_rate
from minisrv.sim import SimBackend, simulate
from minisrv.sim.run import collector_paused
from minisrv.workloads import Workload, arrival_times, check_workload_args, few_shot_groups_workload

__all__ = [
    "PolicyRun",
    "policy_row",
    "reference_outputs",
    "run_policy",
    "policy_table",
    "capacity_table",
    "admission_rounds",
    "request_table",
    "forest_sweep",
    "scheduling_cost",
    "prefix_stream_workload",
    "gpu_policy_table",
    "few_shot_experiment",
    "interleaved_groups",
    "group_table",
]


class PolicyRun(NamedTuple):
    """One workload served under one policy."""

    result: RunResult  # requests, step trace and metrics
    stats: SchedulerStats  # hit rate, prefill tokens, retractions, ...
    identical: int  # requests whose tokens equal the request generated alone (-1: unchecked)


def reference_outputs(model: Any, workload: Workload) -> list[list[int]]:
    """Each request of ``workload`` generated alone, every one to its full length (eos
    ignored, as this chapter's runs do): the tokens every run must reproduce."""
    return alone_outputs(model, workload, ignore_eos=True)


def run_policy(model: Any, workload: Workload, policy: str = "fcfs", *,
               reference: Sequence[Sequence[int]] | None = None, **options: Any) -> PolicyRun:
    """Serve ``workload`` with the radix cache under ``policy``; ``options`` are
    ``EngineConfig``'s (``kv_capacity``, ``max_running``, ``in_batch_prefix_check``, ...)."""
    engine = Engine(model, **{"cache": "radix", "seed": 0, **options}, policy=policy)
    with collector_paused():  # as a simulation's, a run's objects hold no cycles to find
        result = engine.run_workload(workload)
    identical = -1
    if reference is not None:
        identical = sum(list(r.output) == list(ref) for r, ref in zip(result.requests, reference))
    return PolicyRun(result, engine.stats, identical)


def _row(run: PolicyRun) -> dict[str, Any]:
    m, s = run.result.metrics, run.stats
    row = {"hit rate": s.hit_rate, "prefill tokens": s.prefill_tokens,
           "retractions": s.retractions, "steps": m.steps,
           "mean wait (steps)": round(m.mean_wait, 1),
           "p99 wait (steps)": round(m.p99_wait, 1), "max wait (steps)": m.max_wait}
    if run.identical >= 0:
        row["outputs identical"] = f"{run.identical}/{len(run.result.requests)}"
    return row


def policy_table(model: Any, workload: Workload, runs: Mapping[str, Mapping[str, Any]],
                 reference: Sequence[Sequence[int]] | None = None, **options: Any
                 ) -> pd.DataFrame:
    """One row per named run: ``runs[label]`` holds that run's ``policy`` and any options
    (e.g. ``in_batch_prefix_check``) on top of the shared ``options``. Waits are in steps
    (mean and 99th percentile to a tenth of one)."""
    rows = {}
    for label, spec in runs.items():
        spec = dict(spec)
        policy = spec.pop("policy", "fcfs")
        rows[label] = _row(run_policy(model, workload, policy, reference=reference,
                                      **{**options, **spec}))
    return pd.DataFrame.from_dict(rows, orient="index")


def capacity_table(model: Any, workload: Workload, capacities: Sequence[int],
                   policies: Sequence[str] = ("fcfs", "lpm"),
                   reference: Sequence[Sequence[int]] | None = None,
                   runs: dict[tuple[str, int], PolicyRun] | None = None, **options: Any
                   ) -> pd.DataFrame:
    """Hit rate, prefill tokens and longest wait per (capacity, policy): one row per
    capacity, columns ``(quantity, policy)``. ``runs``: a dict that keeps every run by
    ``(policy, capacity)``, for a figure or explorer that draws them again (a CityLM run
    takes a fraction of a second; a sweep of them, tens). A run already in ``runs`` is taken,
    not served again: give one dict per workload and options (a run is deterministic)."""
    rows = {}
    for capacity in capacities:
        row = {}
        for policy in policies:
            run = None if runs is None else runs.get((policy, capacity))
            if run is None:
                run = run_policy(model, workload, policy, reference=reference,
                                 kv_capacity=capacity, **options)
            if reference is not None and run.identical != len(workload):
                raise AssertionError(f"{policy} at {capacity}: outputs differ from the reference")
            if runs is not None:
                runs[policy, capacity] = run
            row |= {("hit rate", policy): run.stats.hit_rate,
                    ("prefill tokens", policy): run.stats.prefill_tokens,
                    ("max wait (steps)", policy): run.result.metrics.max_wait}
        rows[capacity] = row
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "KV capacity"
    return table


def policy_row(run: PolicyRun, label: str) -> pd.DataFrame:
    """``policy_table``'s row of one run, labelled ``label``: what a table of kept runs
    (``capacity_table``'s ``runs``) shows without serving them again."""
    return pd.DataFrame.from_dict({label: _row(run)}, orient="index")


def admission_rounds(prompts: Sequence[Sequence[int]], labels: Sequence[str], policy: str, *,
                     in_batch_prefix_check: bool | None = None, batch: int = 8,
                     rounds: int | None = None) -> pd.DataFrame:
    """The scheduler's decision round by round, for requests that all wait from the start
    and a batch of ``batch`` places that empties between rounds (equal output lengths).

    Each round calls ``calc_priority`` on the waiting prompts and the tree, admits the first
    ``batch`` of its order (deferred requests too, if places remain, as SGLang does), counts
    their cached tokens and then inserts their prompts, as the engine does after a prefill.
    ``labels`` name the requests (e.g. ``"g1.3"``: group 1, member 3). A deferred request that
    a spare place admitted is starred in ``admitted``; ``deferred, left waiting`` counts only
    the deferred requests the round did not admit.
    """
    tree = RadixCache()
    waiting = list(range(len(prompts)))
    rows = []
    while waiting and (rounds is None or len(rows) < rounds):
        queue = [prompts[i] for i in waiting]
        result = calc_priority(policy, tree, queue, in_batch_prefix_check=in_batch_prefix_check)
        picked = [waiting[k] for k in result.order[:batch]]
        deferred = {waiting[k] for k in result.deprioritized}
        cached = [min(tree.match_prefix(prompts[i]).length, len(prompts[i]) - 1)
                  for i in picked]
        for i in picked:  # the engine inserts each prompt right after its prefill
            tree.insert(prompts[i])
        rows.append({
            "admitted": " ".join(labels[i] + ("*" if i in deferred else "") for i in picked),
            "deferred, left waiting": len(deferred - set(picked)),
            "cached tokens": sum(cached),
            "prompt tokens": sum(len(prompts[i]) for i in picked),
        })
        waiting = [i for i in waiting if i not in set(picked)]
    table = pd.DataFrame(rows)
    table.index = pd.RangeIndex(1, len(rows) + 1, name="round")
    return table


def request_table(result: RunResult, labels: Sequence[str] | None = None) -> pd.DataFrame:
    """One row per request: its label, arrival, first admission, wait, cached prompt tokens
    and prompt length, in request order (times in the backend's clock unit)."""
    rows = []
    for i, req in enumerate(result.requests):
        rows.append({"request": labels[i] if labels is not None else str(req.rid),
                     "arrival": req.arrival, "admitted": req.admitted_at,
                     "wait": req.admitted_at - req.arrival, "cached": req.cached_prompt_tokens,
                     "prompt": req.prompt_len, "retractions": req.retractions})
    return pd.DataFrame(rows).set_index("request")


def forest_sweep(prompts: Sequence[Sequence[int]], capacities: Sequence[int],
                 policies: Sequence[str] = ("fcfs", "random", "lpm", "dfs-weight"),
                 seed: int = 0) -> pd.DataFrame:
    """Hit rate per (capacity, policy) for ``prompts`` all waiting at once, served one at a
    time (``max_running=1``, one output token) on the simulated GPU: the setting of the DFS
    theorem. Columns are policies plus ``"optimal"`` (``optimal_hit_rate``)."""
    best = optimal_hit_rate(prompts)
    work = Workload("forest", [list(p) for p in prompts], [1] * len(prompts),
                    [0.0] * len(prompts))
    rows = {}
    for capacity in capacities:
        row = {}
        for policy in policies:
            engine = Engine(SimBackend(LLAMA3_8B), kv_capacity=capacity, max_running=1,
                            cache="radix", policy=policy, seed=seed)
            engine.run_workload(work)
            row[policy] = engine.stats.hit_rate
        row["optimal"] = best
        rows[capacity] = row
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "KV capacity"
    return table


def scheduling_cost(prompts: Sequence[Sequence[int]], queue_lengths: Sequence[int],
                    policies: Sequence[str] = ("fcfs", "lpm", "dfs-weight"), cached: int = 0,
                    repeats: int = 3) -> pd.DataFrame:
    """CPU milliseconds of one scheduling round (``calc_priority``) against the number of
    waiting requests, fastest of ``repeats``; the tree holds the first ``cached`` prompts and
    the queue is the next ones. Timings vary by machine; compare the columns, not the cells.
    """
    if cached + max(queue_lengths) > len(prompts):
        raise ValueError(f"{cached} cached + {max(queue_lengths)} waiting needs that many "
                         f"prompts; got {len(prompts)}")
    tree = RadixCache()
    for prompt in prompts[:cached]:
        tree.insert(prompt)
    rows = {}
    for n in queue_lengths:
        queue = list(prompts[cached:cached + n])
        row = {}
        for policy in policies:
            calc_priority(policy, tree, queue)  # warm-up: the splits a first round makes
            best = float("inf")
            for _ in range(repeats):
                start = time.process_time()
                calc_priority(policy, tree, queue)
                best = min(best, time.process_time() - start)
            row[policy] = 1e3 * best
        rows[n] = row
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "waiting requests"
    return table


def prefix_stream_workload(n: int = 600, n_groups: int = 8, prefix_len: int = 2000,
                           question_len: int = 100, output_len: int = 100, rate: float = 20.0,
                           hot_share: float | None = None, vocab_size: int = 128256,
                           seed: int = 0) -> Workload:
    """A Poisson stream (``rate`` requests/s) of prompts from ``n_groups`` prefix groups:
    each prompt is its group's ``prefix_len``-token prefix plus a ``question_len``-token
    question of random ids. Groups are drawn uniformly, or, with ``hot_share``, group 0
    with that probability and the others uniformly (one hot group)."""
    check_workload_args(n, output_len)
    if n_groups < 1 or prefix_len < 1 or question_len < 1:
        raise ValueError(f"need n_groups, prefix_len and question_len >= 1; got {n_groups}, "
                         f"{prefix_len}, {question_len}")
    if hot_share is not None and not 0 <= hot_share <= 1:
        raise ValueError(f"hot_share must be in [0, 1] or None, got {hot_share}")
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(2, vocab_size, size=(n_groups, prefix_len))
    prefixes[:, 0] = rng.choice(np.arange(2, vocab_size), n_groups, replace=False)
    if hot_share is None or n_groups == 1:
        groups = rng.integers(0, n_groups, size=n)
    else:
        hot = rng.random(n) < hot_share
        groups = np.where(hot, 0, rng.integers(1, n_groups, size=n))
    prompts = [[*map(int, prefixes[g]), *map(int, rng.integers(2, vocab_size, question_len))]
               for g in groups]
    arrivals = [float(t) for t in arrival_times(n, rate, rng=rng)]
    skew = "uniform" if hot_share is None else f"group 0 drawn {hot_share:.0%} of the time"
    return Workload("prefix-stream", prompts, [output_len] * n, arrivals,
                    f"{n} requests at {rate:g}/s from {n_groups} groups of {prefix_len}-token "
                    f"prefixes, {skew}")


def gpu_policy_table(workload: Workload, policies: Sequence[str] = ("fcfs", "lpm"),
                     **options: Any) -> pd.DataFrame:
    """``simulate`` (LLaMA-3-8B on an H100 by default) under each policy with the radix
    cache: throughput (whole output tokens/s), hit rate, latency and wait in seconds (three
    decimals)."""
    rows = {}
    for policy in policies:
        engine_options = {"cache": "radix", "seed": 0, **options}
        run = simulate(workload, policy=policy, **engine_options)
        m = run.metrics
        cached = sum(r.cached_prompt_tokens for r in run.requests)
        total = sum(r.prompt_len for r in run.requests)
        rows[policy] = {"throughput (tok/s)": round(m.throughput),
                        "hit rate": round(cached / total, 3),
                        "mean latency (s)": round(m.mean_latency, 3),
                        "p99 latency (s)": round(m.p99_latency, 3),
                        "mean wait (s)": round(m.mean_wait, 3),
                        "max wait (s)": round(m.max_wait, 3)}
    return pd.DataFrame.from_dict(rows, orient="index")


def interleaved_groups(tok: Any, n_groups: int = 4, per_group: int = 8,
                       arrival_every: float = 1.0) -> Workload:
    """The workload ``few_shot_experiment`` serves: ``n_groups`` interleaved few-shot groups
    whose headers hold ``41 * n_groups`` tokens in all (164 for the lecture's four)."""
    return few_shot_groups_workload(tok, n_groups=n_groups, per_group=per_group,
                                    prefix_tokens=41 * n_groups, arrival_every=arrival_every)


def few_shot_experiment(model: Any, tok: Any, policies: Sequence[str] = ("fcfs", "lpm"),
                        kv_capacity: int = 180, arrival_every: float = 1.0, n_groups: int = 4,
                        per_group: int = 8, check: bool = True,
                        reference: Sequence[Sequence[int]] | None = None, **options: Any
                        ) -> pd.DataFrame:
    """Interleaved few-shot groups (``interleaved_groups``) served with the radix cache under
    each policy: one row per policy with hit rate, prefill tokens and waits; ``check``
    compares tokens with the reference, ``reference`` (``reference_outputs`` of the same
    workload) when several runs share it, else it is generated here."""
    work = interleaved_groups(tok, n_groups, per_group, arrival_every)
    if reference is not None and len(reference) != len(work):
        raise ValueError(f"reference holds {len(reference)} outputs for {len(work)} requests")
    if check and reference is None:
        reference = reference_outputs(model, work)
    runs = {p: {"policy": p} for p in policies}
    return policy_table(model, work, runs, reference if check else None,
                        kv_capacity=kv_capacity, **options)


def group_table(result: RunResult, groups: Sequence[int]) -> pd.DataFrame:
    """Per prefix group of a run: its requests, how many found no more than ``<bos>``
    cached (they recomputed the group's header), its hit rate, and its mean (to a tenth of a
    step) and max wait."""
    table = request_table(result)
    table["group"] = list(groups)
    rows = {}
    for group, part in table.groupby("group"):
        rows[group] = {"requests": len(part), "cold starts": int((part["cached"] <= 1).sum()),
                       "hit rate": part["cached"].sum() / part["prompt"].sum(),
                       "mean wait (steps)": round(float(part["wait"].mean()), 1),
                       "max wait (steps)": part["wait"].max()}
    out = pd.DataFrame.from_dict(rows, orient="index")
    out.index.name = "group"
    return out
