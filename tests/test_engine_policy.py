"""The cache-aware policies inside the engine: reordering the queue changes when tokens are
computed, never which; memory stays consistent; every request finishes; and LPM falls back
to FCFS past 128 waiting requests exactly as the policy module says."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from strategies import prefix_sharing, prompts_of

from minisrv.configs import LLAMA3_8B
from minisrv.engine import Engine
from minisrv.request import FINISHED, Req
from minisrv.sampling import SamplingParams
from minisrv.scheduler import MODES
from minisrv.scheduler.policy import (
    IN_BATCH_POLICIES,
    POLICIES,
    TREE_POLICIES,
    WAITING_QUEUE_PREFIX_MATCH_MAX,
)
from minisrv.sim import SimBackend

MODEL_SEED = 3  # the random CityLM of conftest's `model` fixture


def serve_checked(engine: Engine, reqs: list[Req]) -> None:
    """Serve ``reqs`` step by step, checking the scheduler's invariants after every step,
    then check that only the prefix cache still holds KV slots."""
    sched = engine.scheduler
    for req in reqs:
        sched.submit(req)
    while sched.step() is not None:
        sched.check_integrity()
    sched.check_integrity()
    assert not sched.queues.running and not sched.queues.waiting
    assert sched.memory.tree.protected_size() == 0
    assert sched.memory.kv.used_count == sched.memory.tree.total_size()  # 0 without the cache


def checks_for(policy: str) -> list[bool | None]:
    return [None, False, True] if policy in IN_BATCH_POLICIES else [None, False]


# Prefixes up to 40 tokens so that the in-batch check (32 shared tokens) really defers.
prefix_lists, spec = prefix_sharing(max_prefix=40, max_suffix=5, max_new=12, max_arrival=4)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefixes=prefix_lists, spec=spec, data=st.data(),
       policy=st.sampled_from(POLICIES), cache=st.sampled_from(["radix", "blocks", "none"]),
       mode=st.sampled_from(MODES), slack=st.integers(0, 40), max_running=st.integers(1, 5))
def test_every_policy_gives_each_request_its_tokens_alone(
    model, prefixes, spec, data, policy, cache, mode, slack, max_running
) -> None:
    assume(not (cache == "blocks" and policy in TREE_POLICIES))  # refused: no tree to walk
    check = data.draw(st.sampled_from(checks_for(policy)), label="in_batch_prefix_check")
    prompts = prompts_of(prefixes, spec)
    longest = max(len(p) + m for p, (_, _, m, _, _) in zip(prompts, spec))
    engine = Engine(model, kv_capacity=longest + slack, max_running=max_running, mode=mode,
                    cache=cache, policy=policy, in_batch_prefix_check=check, seed=1)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=e) for _, _, m, e, _ in spec]
    reqs = engine.make_requests(prompts, None, params, [a for *_, a in spec])
    serve_checked(engine, reqs)
    assert all(req.state == FINISHED for req in reqs)
    assert all(req.admitted_at is not None and req.admitted_at >= req.arrival for req in reqs)
    for req, prompt, (_, _, m, e, _) in zip(reqs, prompts, spec):
        assert req.output == model.reference_generate(prompt, m, ignore_eos=e)
    assert engine.backend.live_requests == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_a_tight_pool_retracts_and_every_policy_still_computes_the_same_tokens(
    model, policy
) -> None:
    heads = [[0, *range(2 + 11 * g, 36 + 11 * g)] for g in range(2)]  # 35-token prefixes
    prompts = [[*heads[i % 2], 50 + i] for i in range(6)]
    engine = Engine(model, kv_capacity=90, max_running=4, cache="radix", policy=policy,
                    new_token_ratio=0.2, min_ratio=0.05, seed=0)
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True)] * len(prompts)
    reqs = engine.make_requests(prompts, None, params)
    serve_checked(engine, reqs)
    assert engine.stats.retractions > 0
    assert [r.output for r in reqs] == [model.reference_generate(p, 20, ignore_eos=True)
                                        for p in prompts]


def test_lpm_in_the_engine_serves_the_cached_group_first(model) -> None:
    head = [0, *range(2, 40)]
    engine = Engine(model, kv_capacity=400, max_running=1, cache="radix", policy="lpm")
    engine.generate([[*head, 45]], 2)  # warms the tree with the 39-token head
    cold = [[0, 40 + i, *range(3, 10)] for i in range(3)]
    warm = [*head, 50]
    out = engine.generate([*cold, warm], 2)
    assert out == [model.reference_generate(p, 2) for p in [*cold, warm]]
    firsts = [rec.prefill for rec in engine.trace if rec.prefill][1:]
    assert firsts[0] == (4,)  # rid 4 (the warm prompt) overtakes the three cold ones


def fallback_order(waiting: int) -> list[int]:
    """Ids of the requests in the order an LPM engine (one running at a time) admits
    ``waiting`` requests submitted together, after a warm-up whose prefix only the last of
    them shares."""
    head = [1, *range(1000, 1100)]
    engine = Engine(SimBackend(LLAMA3_8B), kv_capacity=100_000, max_running=1, cache="radix",
                    policy="lpm")
    engine.generate([[*head, 7]], 1)
    cold = [[1, 2000 + i, *range(3000, 3010)] for i in range(waiting - 1)]
    engine.generate([*cold, [*head, 8]], 1)
    rids = [rid for rec in engine.trace for rid in rec.prefill][1:]
    return [rid - 1 for rid in rids]  # index in the second call's prompts


def test_lpm_becomes_fcfs_while_more_than_128_wait() -> None:
    limit = WAITING_QUEUE_PREFIX_MATCH_MAX
    # 128 waiting: LPM matches, and the prompt sharing the cached head goes first
    order = fallback_order(limit)
    assert order[0] == limit - 1 and order[1:] == list(range(limit - 1))
    # 129 waiting: the first round is FCFS (no matching); from the next round, with 128
    # left, LPM matches again and the warm prompt overtakes the rest
    order = fallback_order(limit + 1)
    assert order[:2] == [0, limit] and order[2:] == list(range(1, limit))


def cold_request_admitted(model, policy: str, n_warm: int = 40
                          ) -> tuple[int, list[Req], Engine]:
    """How many warm requests an engine (one running at a time) admits before a cold one.
    The warm ones share a cached 39-token head (each computes 1 token) and arrive one every
    2 steps, as fast as they are served; the cold one (20 tokens) arrives with the first."""
    head = [0, *range(2, 40)]
    engine = Engine(model, kv_capacity=10_000, max_running=1, cache="radix", policy=policy)
    engine.generate([[*head, 45]], 2)  # the head is cached
    start = engine.scheduler.recorder.clock
    prompts = [[*head, 40], [7] * 20, *([*head, 40 + i % 20] for i in range(1, n_warm))]
    arrivals = [start, start, *(start + 2 * i for i in range(1, n_warm))]
    params = [SamplingParams(max_new_tokens=2, ignore_eos=True)] * len(prompts)
    reqs = engine.make_requests(prompts, None, params, arrivals)
    serve_checked(engine, reqs)
    assert [r.output for r in reqs] == [model.reference_generate(p, 2, ignore_eos=True)
                                        for p in prompts]
    order = sorted(reqs, key=lambda r: (r.admitted_at, r.rid))
    return order.index(reqs[1]), reqs, engine


def test_hrrn_admits_a_cold_request_that_lpm_starves(model) -> None:
    """LPM serves every warm request first: each matches 39 tokens, the cold one none.
    HRRN ranks by prefill tokens computed since arrival over tokens left: after the first
    warm request's 1 token the cold one has waited 1 / 20, and the next warm one, just
    arrived, 0 / 1, so the cold one goes second."""
    lpm, _, _ = cold_request_admitted(model, "lpm")
    hrrn, reqs, engine = cold_request_admitted(model, "hrrn")
    assert (lpm, hrrn) == (40, 1)
    # the clock HRRN reads: every prefill token the scheduler computed, noted at arrivals
    assert engine.scheduler.queues.prefilled == engine.stats.prefill_tokens
    assert [r.arrival_prefilled for r in reqs[:3]] == [40, 40, 41]  # the warm-up's 40
