"""Run metrics: the queueing delay (wait) of each request, its mean, p99 and maximum."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisrv.configs import LLAMA3_8B
from minisrv.engine import Engine
from minisrv.metrics import RunMetrics, summarize, wait_values
from minisrv.sim import SimBackend
from minisrv.workloads import Workload


def run(workload: Workload, **options):
    engine = Engine(SimBackend(LLAMA3_8B), **{"kv_capacity": 10_000, **options})
    return engine.run_workload(workload)


def test_one_at_a_time_each_request_waits_for_those_before_it() -> None:
    # max_running 1, prefill-first: request i starts when i earlier ones have finished
    work = Workload("w", [[1] * 20] * 3, [4, 4, 4], [0.0, 0.0, 0.0])
    result = run(work, max_running=1)
    starts = [result.trace[i].start for i in (0, 4, 8)]  # each request: 1 prefill + 3 decodes
    assert [r.admitted_at for r in result.requests] == starts
    waits = wait_values(result.requests)
    assert list(waits) == starts
    m = result.metrics
    assert m.mean_wait == pytest.approx(np.mean(starts))
    assert m.max_wait == starts[2]
    assert m.p99_wait == pytest.approx(np.percentile(starts, 99))
    assert m.mean_wait < m.p99_wait < m.max_wait


def test_requests_admitted_on_arrival_wait_zero() -> None:
    work = Workload("w", [[1] * 10, [2] * 10], [3, 3], [0.0, 0.0])
    m = run(work, max_running=4).metrics
    assert m.mean_wait == m.p99_wait == m.max_wait == 0.0


def test_new_fields_are_appended_after_the_old_ones() -> None:
    names = list(RunMetrics.__dataclass_fields__)
    assert names[:14] == ["requests", "output_tokens", "steps", "duration", "throughput",
                          "mean_batch", "slot_utilisation", "mean_latency", "p99_latency",
                          "mean_ttft", "p99_ttft", "mean_itl", "p99_itl", "max_itl"]
    assert names[14:] == ["mean_wait", "p99_wait", "max_wait"]


@settings(max_examples=30, deadline=None)
@given(spec=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 20)),
                     min_size=1, max_size=12),
       max_running=st.integers(1, 4), slack=st.integers(0, 40),
       policy=st.sampled_from(["fcfs", "lpm", "dfs-weight", "random"]))
def test_wait_is_first_prefill_start_minus_arrival(spec, max_running, slack, policy) -> None:
    prompts = [[5 + (p % 3)] * p for p, _, _ in spec]
    capacity = max(p + m for p, m, _ in spec) + slack
    work = Workload("w", prompts, [m for _, m, _ in spec], [a * 0.01 for *_, a in spec])
    result = run(work, max_running=max_running, kv_capacity=capacity, cache="radix",
                 policy=policy, seed=0)
    first_start: dict[int, float] = {}
    for rec in result.trace:
        for rid in rec.prefill:
            first_start.setdefault(rid, rec.start)
    expected = [first_start[r.rid] - r.arrival for r in result.requests]
    assert list(wait_values(result.requests)) == pytest.approx(expected)
    assert min(expected) >= 0
    again = summarize(result.requests, result.trace, max_running)
    assert again.max_wait == pytest.approx(max(expected))
    assert again.p99_wait <= again.max_wait + 1e-12 and again.mean_wait <= again.max_wait + 1e-12
