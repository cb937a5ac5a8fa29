"""Chunked prefill: under ``chunked_prefill_size`` no step computes more new tokens than the
budget, a long prompt is computed in pieces by one request mid-prefill, every output
equals each request alone, and no KV slot is leaked (``check_integrity`` after every step)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import prefix_sharing, prompts_of

from minisrv.configs import LLAMA3_8B
from minisrv.engine import Engine
from minisrv.request import ABORTED, FINISHED, Req
from minisrv.runner import PerRequestBackend
from minisrv.sampling import SamplingParams
from minisrv.scheduler import POLICIES, Scheduler
from minisrv.sim import SimBackend

MODEL_SEED = 2  # the random CityLM of conftest's `model` fixture
CHUNK_MODES = ("prefill-first", "mixed")


def workload(n: int = 7, seed: int = 0) -> tuple[list[list[int]], list[float]]:
    """Prompts of 1..40 tokens (most longer than the budgets below) and their arrivals."""
    rng = random.Random(seed)
    prompts = [[0, *(rng.randrange(2, 61) for _ in range(rng.randrange(0, 40)))]
               for _ in range(n)]
    return prompts, [2.0 * i for i in range(n)]


@pytest.fixture(scope="module")
def alone(model):
    """``model.reference_generate``, each (prompt, arguments) computed once per module: the
    parametrized tests below check the same prompts against each request alone in every
    combination, and generating one alone gives the same tokens every time."""
    kept: dict[tuple, list[int]] = {}

    def generate(prompt: list[int], max_new_tokens: int, **options) -> list[int]:
        key = (tuple(prompt), max_new_tokens, tuple(sorted(options.items())))
        if key not in kept:
            kept[key] = model.reference_generate(prompt, max_new_tokens, **options)
        return kept[key]

    return generate


def serve_checked(engine: Engine, reqs: list[Req], budget: int) -> None:
    """Step to the end, checking the books and the budget after every step."""
    sched = engine.scheduler
    for req in reqs:
        engine.add_request(req)
    while (out := engine.step()).record is not None:
        record = out.record
        assert record.prefill_tokens + len(record.decode) <= budget
        sched.check_integrity()
    assert sched.idle and sched.queues.chunked is None and not sched.queues.chunks.ends
    assert sched.memory.kv.used_count == sched.memory.tree.total_size()  # only the tree holds slots


@pytest.mark.parametrize("budget", [2, 5, 7, 16])
@pytest.mark.parametrize("mode", CHUNK_MODES)
@pytest.mark.parametrize("cache", ["none", "radix"])
@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_outputs_equal_each_request_alone(model, alone, budget, mode, cache,
                                                  overlap) -> None:
    prompts, arrivals = workload()
    engine = Engine(model, kv_capacity=300, max_running=2, mode=mode, cache=cache,
                    overlap=overlap, chunked_prefill_size=budget)
    reqs = engine.make_requests(prompts, 10, None, arrivals)
    serve_checked(engine, reqs, budget)
    assert [r.output for r in reqs] == [alone(p, 10) for p in prompts]
    assert any(r.prefill_tokens == budget for r in engine.trace)  # prompts were cut


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", CHUNK_MODES)
def test_chunked_outputs_hold_under_every_policy(model, alone, policy, mode) -> None:
    prompts, arrivals = workload(seed=1)
    engine = Engine(model, kv_capacity=300, max_running=3, mode=mode, cache="radix",
                    policy=policy, seed=0, chunked_prefill_size=6)
    params = [SamplingParams(max_new_tokens=8, temperature=0.8, seed=i) for i in range(7)]
    reqs = engine.make_requests(prompts, None, params, arrivals)
    serve_checked(engine, reqs, 6)
    for req, prompt, p in zip(reqs, prompts, params, strict=True):
        assert req.output == alone(prompt, 8, temperature=0.8, seed=p.seed)


prefix_lists, specs = prefix_sharing(max_prefix=20, max_suffix=8, max_new=10, max_arrival=8)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefixes=prefix_lists, spec=specs, budget=st.integers(1, 24),
       slack=st.integers(0, 40), mode=st.sampled_from(CHUNK_MODES),
       cache=st.sampled_from(["none", "radix"]), max_running=st.integers(1, 4),
       policy=st.sampled_from(POLICIES), overlap=st.booleans())
def test_random_budgets_keep_the_books_and_the_tokens(
    model, prefixes, spec, budget, slack, mode, cache, max_running, policy, overlap
) -> None:
    prompts = prompts_of(prefixes, spec)
    longest = max(len(p) + m for p, (_, _, m, _, _) in zip(prompts, spec, strict=True))
    budget = max(budget, max_running)
    engine = Engine(model, kv_capacity=longest + slack, max_running=max_running, mode=mode,
                    cache=cache, policy=policy, seed=0, overlap=overlap,
                    chunked_prefill_size=budget)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=e) for _, _, m, e, _ in spec]
    reqs = engine.make_requests(prompts, None, params, [float(a) for *_, a in spec])
    serve_checked(engine, reqs, budget)
    assert all(req.state == FINISHED for req in reqs)
    for req, prompt, (_, _, m, e, _) in zip(reqs, prompts, spec, strict=True):
        assert req.output == model.reference_generate(prompt, m, ignore_eos=e)


def test_a_request_arriving_meanwhile_reuses_the_chunks_in_the_tree(model) -> None:
    long = [0, *range(2, 42)]  # 41 tokens: 5 chunks of 8, then 1
    engine = Engine(model, kv_capacity=300, max_running=2, cache="radix",
                    chunked_prefill_size=8, debug=True)
    first = engine.add_request(long, SamplingParams(max_new_tokens=4))
    engine.step()
    engine.step()  # two chunks computed, both in the tree; the lock moved to the second
    assert engine.scheduler.queues.chunked is first and first.cached_len == 16
    assert engine.tree.match_prefix(long).length == 16
    follower = engine.add_request([*long[:20], 60], SamplingParams(max_new_tokens=4))
    engine.run()
    assert follower.cached_prompt_tokens >= 16  # found the chunks (more if they were done)
    assert follower.output == model.reference_generate([*long[:20], 60], 4)
    assert first.output == model.reference_generate(long, 4)


def test_one_long_prompt_is_cut_and_decodes_go_first_in_a_mixed_step(model) -> None:
    engine = Engine(model, kv_capacity=300, max_running=3, mode="mixed",
                    chunked_prefill_size=8)
    short = engine.add_request([0, 5, 6], SamplingParams(max_new_tokens=12, ignore_eos=True))
    engine.step()
    long = engine.add_request([0, *range(2, 30)], SamplingParams(max_new_tokens=2))
    steps = [engine.step().record for _ in range(4)]
    assert [(s.decode, s.prefill, s.prefill_tokens) for s in steps] == [
        ((short.rid,), (long.rid,), 7)] * 4  # 1 decode + 7 prefill tokens each: 29 = 4 x 7 + 1
    assert len(long.output) == 0 and engine.scheduler.queues.chunked is long
    engine.run()
    assert long.output == model.reference_generate(long.prompt, 2)


def test_prefill_first_runs_the_chunks_before_the_decodes(model) -> None:
    """SGLang's default: prefill work (the chunked request first) takes the step."""
    engine = Engine(model, kv_capacity=300, max_running=3, chunked_prefill_size=8)
    short = engine.add_request([0, 5, 6], SamplingParams(max_new_tokens=12, ignore_eos=True))
    engine.step()
    long = engine.add_request([0, *range(2, 30)], SamplingParams(max_new_tokens=2))
    steps = [engine.step().record for _ in range(5)]
    assert [(s.decode, s.prefill_tokens) for s in steps[:4]] == [((), 8)] * 3 + [((), 5)]
    assert steps[4].decode == (short.rid, long.rid) and len(short.output) == 2


def test_abort_of_a_chunked_request_frees_exactly_its_slots(model) -> None:
    for overlap in (False, True):
        engine = Engine(model, kv_capacity=100, max_running=2, chunked_prefill_size=4,
                        overlap=overlap, cache="radix")
        req = engine.add_request([0, *range(2, 30)], SamplingParams(max_new_tokens=3))
        engine.step()
        engine.step()
        engine.abort([req])
        sched = engine.scheduler
        assert req.state == ABORTED and sched.queues.chunked is None and sched.idle
        sched.check_integrity()
        assert sched.memory.kv.used_count == sched.memory.tree.total_size()


def test_a_tight_pool_retracts_and_the_tokens_hold(model) -> None:
    """Only decoding requests are retraction victims; the chunked one holds its prompt's KV."""
    engine = Engine(model, kv_capacity=60, max_running=3, mode="mixed", new_token_ratio=0.05,
                    min_ratio=0.0, chunked_prefill_size=5, debug=True)
    prompts = [[0, *range(2, 26)], [0, 7, 8], [0, 9, 10, 11]]
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True)] * 3
    reqs = engine.make_requests(prompts, None, params, [2.0, 0.0, 0.0])
    serve_checked(engine, reqs, 5)
    assert engine.stats.retractions > 0
    for req, prompt in zip(reqs, prompts, strict=True):
        assert req.output == model.reference_generate(prompt, 20, ignore_eos=True)


@settings(max_examples=20, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 20), st.integers(0, 5)),
                     min_size=1, max_size=10),
       budget=st.integers(4, 40), mode=st.sampled_from(CHUNK_MODES),
       cache=st.sampled_from(["none", "radix"]), overlap=st.booleans())
def test_the_simulator_keeps_the_budget_and_the_books(lens, budget, mode, cache, overlap):
    prompts = [[7] * 5 + [3 + k] * p for k, (p, _, _) in enumerate(lens)]
    engine = Engine(SimBackend(LLAMA3_8B), kv_capacity=200, max_running=4, mode=mode,
                    cache=cache, overlap=overlap, chunked_prefill_size=budget)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for _, m, _ in lens]
    reqs = engine.make_requests(prompts, None, params, [a * 1e-3 for *_, a in lens])
    serve_checked(engine, reqs, budget)
    assert [len(r.output) for r in reqs] == [m for _, m, _ in lens]


@pytest.mark.parametrize(("options", "match"), [
    ({"chunked_prefill_size": 0}, ">= 1"),
    ({"chunked_prefill_size": 2.5}, "integer"),
    ({"chunked_prefill_size": 4, "max_running": 8}, "at least max_running"),
    ({"chunked_prefill_size": 64, "mode": "static"}, "static"),
])
def test_bad_budgets_are_rejected(options, match) -> None:
    with pytest.raises(ValueError, match=match):
        Engine(SimBackend(LLAMA3_8B), **options)


def test_the_per_request_backend_says_it_cannot_chunk(model) -> None:
    with pytest.raises(ValueError, match="chunks"):
        Scheduler(PerRequestBackend(model), chunked_prefill_size=64)


def test_a_budget_of_2048_cuts_the_worst_gap_five_fold_at_a_small_ttft_cost() -> None:
    from minisrv.experiments.chunked import spike_run

    whole, chunked = spike_run(None), spike_run(2048)
    assert chunked.max_gap * 5 <= whole.max_gap
    assert chunked.long_ttft >= whole.long_ttft  # the long prompt waits a little longer
    assert chunked.long_ttft <= 1.1 * whole.long_ttft
    budget = 2048
    assert all(r.prefill_tokens + len(r.decode) <= budget for r in chunked.result.trace)
    # prefill-first (SGLang's default) runs the chunks back to back: the decodes still stall
    assert spike_run(2048, mode="prefill-first").max_gap * 5 > whole.max_gap


def test_two_thousand_simulated_requests_run_with_chunking() -> None:
    from minisrv.sim import simulate
    from minisrv.workloads import gpu_scale_workload

    result = simulate(gpu_scale_workload(2000), max_running=64, mode="mixed",
                      chunked_prefill_size=2048)
    assert result.metrics.requests == 2000
    assert all(r.prefill_tokens + len(r.decode) <= 2048 for r in result.trace)


def test_a_timed_device_in_the_overlapped_loop_serves_chunks(model) -> None:
    from minisrv.runner import ModelRunner
    from minisrv.sim import TimedBackend

    prompts, arrivals = workload(seed=3)
    engine = Engine(TimedBackend(ModelRunner(model), 1e-4), kv_capacity=300, max_running=2,
                    mode="mixed", overlap=True, cache="radix", chunked_prefill_size=5)
    reqs = engine.make_requests(prompts, 6, None, arrivals)
    serve_checked(engine, reqs, 5)
    assert [r.output for r in reqs] == [model.reference_generate(p, 6) for p in prompts]
