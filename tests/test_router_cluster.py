"""Clusters behind the router: simulated ones conserve requests and are deterministic; a
real CityLM cluster generates exactly what each request generates alone."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisrv.engine import Engine
from minisrv.experiments.routing import (
    groups_started,
    hot_group_latency,
    run_cluster,
    serve_cluster,
    simulate_cluster,
)
from minisrv.router import MATCH_SOURCES, POLICIES, Router
from minisrv.sim import SimBackend
from minisrv.tokenizer import Tokenizer
from minisrv.workloads import Workload, prefix_groups_workload

MODEL_SEED = 3  # the random CityLM of conftest's `model` fixture


def small_workload(n: int, groups: int, prefix: int, hot: float | None, rate: float,
                   seed: int) -> Workload:
    return prefix_groups_workload(n=n, n_groups=groups, prefix_len=prefix,
                                  question_range=(1, 8), mean_output=6, max_output=20,
                                  rate=rate, hot_share=hot, vocab_size=500, seed=seed)


def check_conserved(result, workload: Workload) -> None:
    n, k = len(workload), result.n_workers
    assert len(result.requests) == n == sum(result.worker_requests)
    assert [r.rid for r in result.requests] == list(range(n))  # each request once, in order
    for req, prompt, m, w in zip(result.requests, workload.prompts, workload.output_lens,
                                 result.workers, strict=True):
        assert req.finished and req.prompt == prompt and len(req.output) == m
        assert 0 <= w < k
        assert req.token_times[0] >= req.arrival
    assert result.worker_requests == [result.workers.count(w) for w in range(k)]
    assert sum(result.worker_output_tokens) == workload.total_output_tokens
    trace = result.load_trace
    assert trace.shape == (2 * n, k) and trace.min() >= 0 and not trace[-1].any()
    assert np.all(np.diff(result.load_times) >= 0)  # events in time order
    # in flight on a worker = routed there and not finished: recompute the maximum
    assert trace.max() <= max(result.worker_requests)
    assert sum(result.decisions.values()) == n
    assert Counter(result.branches) == Counter(result.decisions)  # one branch per request
    assert result.request_ratio == pytest.approx(max(result.worker_requests) / (n / k))
    assert result.widest_gap == max((row.max() - row.min() for row in trace), default=0)
    assert len(result.worker_steps) == len(result.worker_decode_tokens) == k
    assert 0 <= result.decodes_per_step <= 4  # the runs' max_running


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 40), st.integers(1, 5), st.integers(0, 60),
       st.sampled_from([None, 0.6]), st.sampled_from([5.0, 50.0, 1e4]),
       st.integers(1, 4), st.sampled_from(POLICIES), st.integers(0, 3),
       st.sampled_from(MATCH_SOURCES))
def test_simulated_cluster_conserves_requests(n, groups, prefix, hot, rate, k, policy, seed,
                                              source):
    workload = small_workload(n, groups, prefix, hot if groups > 1 else None, rate, seed)
    result = simulate_cluster(workload, n_workers=k, policy=policy, kv_capacity=200,
                              max_running=4, balance_abs_threshold=2, match_source=source)
    check_conserved(result, workload)
    if result.decisions.get("balance"):  # balanced only past the absolute threshold, 2
        assert result.widest_gap > 2
    again = simulate_cluster(workload, n_workers=k, policy=policy, kv_capacity=200,
                             max_running=4, balance_abs_threshold=2, match_source=source)
    assert again.workers == result.workers  # deterministic for a seed
    assert [r.token_times for r in again.requests] == [r.token_times for r in result.requests]
    assert again.summary() == result.summary()


def test_router_sees_loads_at_arrival_time() -> None:
    """Each route happened with exactly the requests in flight at that moment: routed
    earlier, finished later (a completion at the arrival instant counts as done)."""
    workload = small_workload(60, 3, 40, None, 40.0, seed=1)
    result = simulate_cluster(workload, n_workers=3, kv_capacity=200, max_running=3,
                              balance_abs_threshold=1, balance_rel_threshold=1.0)
    reqs, workers = result.requests, result.workers
    order = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival, i))
    before = np.zeros(3, dtype=int)
    routed = 0
    for t, loads in zip(result.load_times, result.load_trace, strict=True):
        change = loads - before
        before = loads
        assert sorted(change.tolist()) in ([0, 0, 1], [-1, 0, 0])
        if change.max() < 1:
            continue  # a completion
        j = order[routed]
        routed += 1
        assert reqs[j].arrival == t and change[workers[j]] == 1
        expected = [0, 0, 0]
        for i in order[:routed]:
            if reqs[i].finish_time > t:
                expected[workers[i]] += 1
        assert loads.tolist() == expected
    assert routed == len(reqs)
    assert result.decisions.get("balance", 0) > 0  # the tight thresholds were exercised


def test_cache_aware_keeps_groups_together() -> None:
    """Two groups on two workers, arriving slowly: each group goes to one worker and hits."""
    workload = prefix_groups_workload(n=40, n_groups=2, prefix_len=100, question_range=(2, 4),
                                      mean_output=4, output_cv=0.0, rate=1.0, vocab_size=500)
    aware = simulate_cluster(workload, n_workers=2, kv_capacity=150, max_running=4)
    rr = simulate_cluster(workload, n_workers=2, policy="round-robin", kv_capacity=150,
                          max_running=4)
    groups = [tuple(p[:100]) for p in workload.prompts]
    placement = {(g, w) for g, w in zip(groups, aware.workers, strict=True)}
    assert len(placement) == 2  # one worker per group
    assert aware.hit_rate > 0.9 > 0.5 > rr.hit_rate  # rr: the 150-token caches thrash
    assert aware.decisions == {"miss": 2, "cache": 38}
    firsts = {groups.index(g) for g in groups}  # each group's first request
    assert {i for i, b in enumerate(aware.branches) if b == "miss"} == firsts
    # only those first requests compute their prefix; round robin's thrashing caches, many more
    assert aware.prefixes_computed(100) == len(firsts) < rr.prefixes_computed(100)


def test_a_tree_trimmed_to_the_cache_forgets_groups_the_cache_cannot_hold() -> None:
    """Three groups on one worker whose cache holds two prefixes: the untrimmed tree remembers
    all three (so every request is sent by the cache branch, and many find their prefix gone);
    trimmed to the cache's size it forgets the least recently sent one, whose next request is
    a miss again. The tree never holds more than ``max_tree_size`` tokens per worker."""
    workload = prefix_groups_workload(n=60, n_groups=3, prefix_len=60, question_range=(2, 4),
                                      mean_output=4, output_cv=0.0, rate=1.0, vocab_size=500)
    whole = simulate_cluster(workload, n_workers=1, kv_capacity=150, max_running=2)
    trimmed = simulate_cluster(workload, n_workers=1, kv_capacity=150, max_running=2,
                               max_tree_size=150)
    assert whole.decisions["miss"] == 3 and whole.tree_sizes[0] > 180  # every prefix, kept
    assert trimmed.decisions["miss"] > 3 and trimmed.tree_sizes[0] <= 150
    gone = [r.cached_prompt_tokens < 60 for r, b in zip(whole.requests, whole.branches,
                                                       strict=True) if b == "cache"]
    assert sum(gone) > 0  # sent by the tree's belief to a cache that had lost the prefix
    assert whole.lost_prefix_share(60) == pytest.approx(sum(gone) / len(gone))
    assert whole.lost_prefix_share(60) > trimmed.lost_prefix_share(60)


def test_a_router_reading_the_caches_misses_what_is_still_queued() -> None:
    """Two requests of one group arrive together: the tree sends the second after the first,
    but no cache holds their prefix yet, so a router reading the caches calls it a miss and
    sends it to the other worker. A third, arriving once the prefix is cached, follows it."""
    prefix = [7] * 50
    workload = Workload("burst", [prefix + [1], prefix + [2], prefix + [3]], [4, 4, 4],
                        [0.0, 0.0, 10.0])
    sent = simulate_cluster(workload, 2, kv_capacity=200, max_running=4)
    read = simulate_cluster(workload, 2, kv_capacity=200, max_running=4, match_source="caches")
    assert sent.workers == [0, 0, 0] and sent.branches == ["miss", "cache", "cache"]
    assert read.workers[:2] == [0, 1] and read.branches == ["miss", "miss", "cache"]
    assert read.requests[2].cached_prompt_tokens == 50  # its worker held the prefix


def test_hot_group_latency_splits_the_requests_by_the_most_common_prefix() -> None:
    workload = small_workload(30, 3, 20, 0.6, 20.0, seed=2)
    run = simulate_cluster(workload, n_workers=2, kv_capacity=200, max_running=4)
    keys = [tuple(p[:20]) for p in workload.prompts]
    hot_key = Counter(keys).most_common(1)[0][0]
    hot, others = hot_group_latency(run, workload, key_len=20)
    in_hot = [r.latency for r, k in zip(run.requests, keys, strict=True) if k == hot_key]
    rest = [r.latency for r, k in zip(run.requests, keys, strict=True) if k != hot_key]
    assert hot == pytest.approx(np.mean(in_hot)) and others == pytest.approx(np.mean(rest))
    one = small_workload(5, 1, 20, None, 20.0, seed=0)
    with pytest.raises(ValueError, match="no others"):
        hot_group_latency(simulate_cluster(one, n_workers=1), one, key_len=20)


def test_run_cluster_rejects_mismatched_engines() -> None:
    engines = [Engine(SimBackend(), kv_capacity=100, max_running=2, cache="radix")]
    with pytest.raises(ValueError, match="1 engines for a router of 2 workers"):
        run_cluster(engines, Router(2), small_workload(3, 1, 5, None, 1.0, 0))
    with pytest.raises(ValueError, match="unknown policy"):
        simulate_cluster(small_workload(3, 1, 5, None, 1.0, 0), policy="nearest")
    big = Workload("big", [[5] * 10, [6] * 90], [5, 20], [0.0, 1.0])
    engines = [Engine(SimBackend(), kv_capacity=100, max_running=2, cache="radix")
               for _ in range(2)]
    router = Router(2)
    with pytest.raises(ValueError, match="kv_capacity is 100"):
        run_cluster(engines, router, big)  # request 1 needs 110 tokens: refused up front
    assert router.loads == [0, 0] and router.tree.nodes() == 0
    assert all(e.scheduler.idle and e.stats.steps == 0 for e in engines)


@pytest.mark.parametrize("policy, source", [("cache-aware", "sent"), ("round-robin", "sent"),
                                            ("cache-aware", "caches")])
def test_real_cluster_equals_each_request_alone(model, policy: str, source: str) -> None:
    tok = Tokenizer()
    heads = ["FR: Paris, Lyon\nDE: Berlin\n", "JP: Tokyo\nIT: Rome, Milan\n"]
    asks = ["US:", "GB:", "ES:", "CN:", "BR:"]
    prompts = [tok.encode(heads[i % 2] + asks[i % 5]) for i in range(10)]
    lens = [3 + i % 4 for i in range(10)]
    workload = Workload("real", prompts, lens, [float(i // 2) for i in range(10)])
    result = serve_cluster(model, workload, n_workers=2, policy=policy, kv_capacity=200,
                           max_running=3, match_source=source)
    for req, prompt, m in zip(result.requests, prompts, lens, strict=True):
        assert req.output == model.reference_generate(prompt, m)
    assert sum(result.worker_requests) == 10
    if policy == "cache-aware":
        assert len({(p[:20] == prompts[0][:20], w)
                    for p, w in zip(prompts, result.workers, strict=True)}) == 2
        assert result.hit_rate > 0.5


def test_a_run_pauses_the_collector_and_gives_it_back_as_it_found_it() -> None:
    """``collector_paused`` (around every simulated and cluster run): off meanwhile, on again
    after, also after an error, and left off by a run when something else had turned it off."""
    import gc

    from minisrv.sim.run import collector_paused

    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="mid-run"), collector_paused():
        raise RuntimeError("mid-run")
    assert gc.isenabled()
    gc.disable()
    try:
        simulate_cluster(small_workload(8, 2, 10, None, 50.0, 0), 2)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_groups_started_counts_where_each_groups_first_request_went() -> None:
    workload = small_workload(40, 4, 20, None, 20.0, seed=3)
    run = simulate_cluster(workload, n_workers=3, kv_capacity=200, max_running=4)
    firsts: dict[tuple[int, ...], int] = {}
    for prompt, worker in zip(workload.prompts, run.workers, strict=True):
        firsts.setdefault(tuple(prompt[:20]), worker)
    started = groups_started(run, workload, key_len=20)
    assert started == [list(firsts.values()).count(w) for w in range(3)]
    assert sum(started) == len(firsts) == 4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_one_worker_cluster_steps_as_its_engine_alone(seed: int) -> None:
    """The cluster loop drives an engine as ``run_workload`` does: with one worker, the same
    steps, decodes and token times, and ``decodes_per_step`` is the engine's decode batch."""
    workload = small_workload(40, 3, 50, None, 50.0, seed)
    result = simulate_cluster(workload, n_workers=1, kv_capacity=300, max_running=4)
    engine = Engine(SimBackend(), kv_capacity=300, max_running=4, cache="radix")
    alone = engine.run_workload(workload)
    assert result.worker_steps == [engine.stats.steps]
    assert result.worker_decode_tokens == [engine.stats.decode_tokens]
    assert result.decodes_per_step == pytest.approx(engine.stats.decode_tokens / engine.stats.steps)
    assert [r.token_times for r in result.requests] == [r.token_times for r in alone.requests]
