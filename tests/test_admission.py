"""SGLang-style admission and retraction over the KV pool, on the real backend and the sim.

Whatever the pool size (down to what the longest request needs alone), every request is
served exactly once, its tokens equal ``reference_generate`` of it alone, and no KV slot
is ever leaked or shared.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisrv.configs import LLAMA3_8B
from minisrv.engine import Engine
from minisrv.request import FINISHED, Req
from minisrv.runner import ModelBackend
from minisrv.sampling import SamplingParams
from minisrv.scheduler import MODES, BatchFormer, Scheduler
from minisrv.scheduler.admission import RETRACT_DECODE_STEPS, BudgetAdmission
from minisrv.sim import SimBackend

VOCAB = 61


MODEL_SEED = 1  # the random CityLM of conftest's `model` fixture


def check_pool(sched: Scheduler) -> None:
    """Accounting that must hold after every step."""
    kv = sched.memory.kv
    assert kv.free_count + kv.used_count == kv.capacity
    held = [s for req in sched.queues.running for s in sched.memory.slots(req)]
    assert len(held) == len(set(held)) == kv.used_count
    assert all(not req.kv_len for req in sched.queues.waiting)


def serve_checked(engine: Engine, reqs: list[Req]) -> None:
    """Run the loop step by step, checking the pool after each step."""
    sched = engine.scheduler
    for req in reqs:
        sched.submit(req)
    while sched.step() is not None:
        check_pool(sched)
        sched.check_integrity()
    assert sched.idle and sched.memory.kv.used_count == 0 and sched.admission.reserved == 0


workloads = st.lists(
    st.tuples(
        st.lists(st.integers(2, VOCAB - 1), min_size=0, max_size=10).map(lambda ids: [0, *ids]),
        st.integers(1, 24),  # max_new_tokens
        st.booleans(),  # ignore_eos
    ),
    min_size=1,
    max_size=7,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    spec=workloads,
    slack=st.integers(0, 40),
    mode=st.sampled_from(MODES),
    max_running=st.integers(1, 7),
    ratio=st.floats(0.05, 1.0),
    decay=st.sampled_from([0.0, 0.001, 0.05]),
)
def test_random_workloads_under_random_pools_match_each_request_alone(
    model, spec, slack, mode, max_running, ratio, decay
) -> None:
    longest = max(len(p) + m for p, m, _ in spec)
    engine = Engine(
        model, kv_capacity=longest + slack, max_running=max_running, mode=mode,
        new_token_ratio=ratio, ratio_decay=decay, min_ratio=min(ratio, 0.05),
    )
    params = [SamplingParams(max_new_tokens=m, ignore_eos=e) for _, m, e in spec]
    reqs = engine.make_requests([p for p, _, _ in spec], None, params)
    serve_checked(engine, reqs)
    assert all(req.state == FINISHED for req in reqs)
    for req, (prompt, m, e) in zip(reqs, spec):
        assert req.output == model.reference_generate(prompt, m, ignore_eos=e)
    assert engine.backend.live_requests == 0


def test_a_pool_exhausted_mid_decode_retracts_and_outputs_stay_the_same(model) -> None:
    prompts = [[0, 5, 6, 7], [0, 8, 9], [0, 10, 11, 12, 13], [0, 14]]
    engine = Engine(model, kv_capacity=40, max_running=4, new_token_ratio=0.1)
    sampling = [SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.9, seed=i)
                for i in range(4)]
    reqs = engine.make_requests(prompts, None, sampling)
    serve_checked(engine, reqs)
    stats = engine.stats
    assert stats.retractions > 0 and stats.wasted_tokens > 0
    retracted = [rid for step in engine.trace for rid in step.retracted]
    assert len(retracted) == stats.retractions
    for req, prompt, sp in zip(reqs, prompts, sampling):
        want = model.reference_generate(prompt, 30, temperature=0.9, seed=sp.seed,
                                        ignore_eos=True)
        assert req.output == want  # the sampled stream survives retraction too


def test_retraction_picks_fewest_generated_then_longest_prompt() -> None:
    def req(rid: int, prompt_len: int, generated: int) -> Req:
        return Req(rid, [0] * prompt_len, output=[3] * generated)

    running = [req(0, 2, 3), req(1, 3, 1), req(2, 5, 1), req(3, 9, 4)]
    assert BatchFormer.retraction_victim(running).rid == 2
    assert BatchFormer.retraction_victim(running[:2]).rid == 1


def test_retraction_raises_the_ratio_and_calm_steps_decay_it(model) -> None:
    engine = Engine(model, kv_capacity=40, max_running=4, new_token_ratio=0.1, min_ratio=0.1,
                    ratio_decay=0.0)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    engine.generate([[0, 5, 6, 7], [0, 8, 9], [0, 10, 11, 12, 13], [0, 14]], sampling=params)
    ratios = [step.new_token_ratio for step in engine.trace]
    first = next(i for i, step in enumerate(engine.trace) if step.retracted)
    assert ratios[first] > 0.1
    calm = Engine(model, kv_capacity=400, max_running=4, ratio_decay=0.01)
    calm.generate([[0, 5]] * 3, sampling=SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert calm.scheduler.admission.ratio == pytest.approx(0.7 - 0.01 * 9)


def test_a_request_too_big_for_the_pool_is_refused_and_the_engine_keeps_serving(model) -> None:
    engine = Engine(model, kv_capacity=30, max_running=2)
    with pytest.raises(ValueError, match="could never be admitted"):
        engine.generate([[0, 3], [0, 4, 5, 6]], max_new_tokens=[5, 40])
    assert engine.stats.steps == 0 and engine.scheduler.memory.kv.used_count == 0
    out = engine.generate([[0, 4, 5, 6]], max_new_tokens=20)
    assert out == [model.reference_generate([0, 4, 5, 6], 20)]


def test_reserve_admission_never_retracts(model) -> None:
    engine = Engine(model, kv_capacity=40, max_running=4, admission="reserve")
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    reqs = engine.make_requests([[0, 5, 6, 7], [0, 8, 9], [0, 14]], None, [params] * 3)
    serve_checked(engine, reqs)
    assert engine.stats.retractions == 0
    assert max(step.batch_size for step in engine.trace) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"admission": "greedy"}, "unknown admission"),
        ({"new_token_ratio": -0.1}, "new_token_ratio"),
        ({"new_token_ratio": 1.5}, "new_token_ratio"),
        ({"min_ratio": 0.9}, "min_ratio"),
        ({"ratio_decay": -0.1}, "ratio_decay"),
        ({"new_token_ratio": float("nan")}, "new_token_ratio"),
    ],
)
def test_bad_admission_settings_are_rejected(model, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        Engine(model, kv_capacity=100, **kwargs)


def test_the_loop_attention_backend_gives_the_same_tokens(model) -> None:
    prompts = [[0, 5, 6], [0, 7], [0, 8, 9, 10, 11]]
    engine = Engine(ModelBackend(model, attention="loop"), kv_capacity=30, max_running=3)
    out = engine.generate(prompts, max_new_tokens=15)
    assert out == [model.reference_generate(p, 15) for p in prompts]


@settings(max_examples=30, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 40)), min_size=1, max_size=12),
    slack=st.integers(0, 80),
    mode=st.sampled_from(MODES),
)
def test_the_simulator_retracts_with_the_same_accounting(lens, slack, mode) -> None:
    capacity = max(p + m for p, m in lens) + slack
    engine = Engine(SimBackend(LLAMA3_8B), kv_capacity=capacity, max_running=6, mode=mode,
                    new_token_ratio=0.2)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for _, m in lens]
    reqs = engine.make_requests([[5] * p for p, _ in lens], None, params)
    serve_checked(engine, reqs)
    assert [len(r.output) for r in reqs] == [m for _, m in lens]
    assert engine.stats.finished == len(lens)


def test_a_retraction_re_estimates_the_ratio_as_sglang_does() -> None:
    """SGLang 0.5's ``retract_decode``: (tokens decoded + 20 x survivors) / (their
    ``max_new_tokens`` + 1), at most 1; decay otherwise, down to the floor."""
    rule = BudgetAdmission(new_token_ratio=0.5, ratio_decay=0.1, min_ratio=0.35)
    survivors = [Req(0, [0, 1], SamplingParams(max_new_tokens=100), output=[3] * 7),
                 Req(1, [0, 2], SamplingParams(max_new_tokens=60), output=[3] * 2)]
    rule.after_decode_prepared(survivors, retracted=[Req(2, [0], output=[3])])
    assert rule.new_token_ratio == pytest.approx((9 + RETRACT_DECODE_STEPS * 2) / 161)
    rule.after_decode_prepared(survivors[:1], retracted=[survivors[1]])
    assert rule.new_token_ratio == pytest.approx((7 + RETRACT_DECODE_STEPS) / 101)
    rule.after_decode_prepared(survivors[:1], retracted=[])
    assert rule.new_token_ratio == pytest.approx(0.35)  # 0.267 - 0.1 is below the floor
    short = [Req(0, [0], SamplingParams(max_new_tokens=4), output=[3] * 3)]
    rule.after_decode_prepared(short, retracted=[Req(1, [0])])
    assert rule.new_token_ratio == 1.0
