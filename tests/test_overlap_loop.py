"""The overlapped loop (``Engine(..., overlap=True)``): same tokens, one late stop, no leak."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from minisrv.engine import Engine, overlap_loop
from minisrv.kv import CACHES
from minisrv.request import ReqState
from minisrv.runner import ModelBackend, PerRequestBackend
from minisrv.sampling import SamplingParams
from minisrv.scheduler import MODES, Scheduler, StepRecord
from minisrv.scheduler.overlap import OverlapLoop
from minisrv.sim import SimBackend, TimedBackend
from minisrv.tokenizer import Tokenizer

MODEL_SEED = 0  # the random CityLM of conftest's `model` fixture
VOCAB = Tokenizer().vocab_size

prompts_st = st.lists(
    st.lists(st.integers(2, VOCAB - 1), min_size=0, max_size=6).map(lambda ids: [0, *ids]),
    min_size=1,
    max_size=6,
)


def late_stops(trace: list[StepRecord]) -> int:
    """Requests that finished in a step and still computed in the next one."""
    return sum(len(set(a.finished) & set(b.decode)) for a, b in zip(trace, trace[1:]))


def assert_drained(engine: Engine) -> None:
    """Nothing left running or in flight, every slot free or cached, no generator kept."""
    scheduler = engine.scheduler
    scheduler.check_integrity()
    assert engine.idle and scheduler.admission.reserved == 0
    memory = scheduler.memory
    assert memory.kv.used_count == memory.tree.size_info().total  # no slot leaked
    if isinstance(engine.backend, ModelBackend):
        assert engine.backend.live_requests == 0


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prompts=prompts_st,
    data=st.data(),
    mode=st.sampled_from(MODES),
    cache=st.sampled_from(CACHES),
    max_running=st.integers(1, 4),
    kv_capacity=st.sampled_from([20, 22, 200]),  # 20 and 22 may retract
    skip=st.booleans(),
    timed=st.booleans(),  # a device thread (the model), or steps handed over (a timed device)
)
def test_overlap_equals_blocking_and_each_request_alone(
    model, prompts, data, mode, cache, max_running, kv_capacity, skip, timed
) -> None:
    n = len(prompts)
    prompts = [*prompts, *(p + [5] for p in prompts[: data.draw(st.integers(0, n))])]
    n = len(prompts)  # some prompts share prefixes, for the radix cache
    lengths = data.draw(st.lists(st.integers(1, 12), min_size=n, max_size=n))
    arrivals = data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    ratio = data.draw(st.sampled_from([0.7, 0.1]))  # a low estimate admits more: retractions
    options = dict(mode=mode, cache=cache, max_running=max_running, kv_capacity=kv_capacity,
                   new_token_ratio=ratio, min_ratio=0.05)
    blocking = Engine(model, **options)
    device = TimedBackend(ModelBackend(model), 0.0) if timed else model
    overlapped = Engine(device, overlap=True, skip_finishing_decode=skip, debug=True, **options)
    expected = blocking.generate(prompts, lengths, arrival_steps=arrivals)
    assert expected == [model.reference_generate(p, m) for p, m in zip(prompts, lengths)]
    assert overlapped.generate(prompts, lengths, arrival_steps=arrivals) == expected
    stats = overlapped.stats
    assert stats.finished == n
    assert stats.late_stop_tokens == late_stops(overlapped.trace)
    assert stats.generated_tokens == sum(len(out) for out in expected)
    event(f"retractions: {stats.retractions > 0}")
    assert_drained(overlapped)


@pytest.mark.parametrize("skip", [False, True, None])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_each_finished_request_wastes_exactly_one_token(model, skip, ignore_eos) -> None:
    """Mixed steps decode everyone running, so every late stop costs one token; with
    ``skip_finishing_decode`` (``None``: the default, on as in SGLang) only an ``<eos>``
    before the length limit does."""
    prompts = [[0, 3 + i, 7, 2 * i + 4] for i in range(8)]
    params = [SamplingParams(max_new_tokens=m, ignore_eos=ignore_eos) for m in range(3, 11)]
    options = {} if skip is None else {"skip_finishing_decode": skip}
    engine = Engine(model, mode="mixed", max_running=8, kv_capacity=400, overlap=True,
                    **options)
    outputs = engine.generate(prompts, sampling=params)
    reqs_ended_on_eos = sum(len(out) < p.max_new_tokens for out, p in zip(outputs, params))
    expected = len(prompts) if skip is False else reqs_ended_on_eos
    assert engine.stats.late_stop_tokens == engine.stats.wasted_tokens == expected
    if ignore_eos:
        assert reqs_ended_on_eos == 0
    assert_drained(engine)


@pytest.mark.parametrize("skip", [False, True])
def test_every_streamed_token_keeps_its_logprobs(model, skip) -> None:
    """The overlapped loop streams a step's tokens after finishing its requests: a request
    that finished, late or skipped for its length, keeps its logprobs until they are read,
    and the logprobs equal the blocking loop's."""
    prompts = [[0, 4, 9], [0, 5], [0, 6, 7, 8]]
    params = [SamplingParams(4 + i, logprobs=1, ignore_eos=True) for i in range(3)]
    got = []
    for overlap in (False, True):
        engine = Engine(model, max_running=2, overlap=overlap, skip_finishing_decode=skip)
        reqs = engine.make_requests(prompts, sampling=params)
        for req in reqs:
            engine.add_request(req, checked=True)
        logprobs: dict[int, list[float]] = {req.rid: [] for req in reqs}
        while (out := engine.step()).record is not None:
            for req, entries in out.logprobs.items():
                logprobs[req.rid].extend(value for value, _ in entries)
        got.append(logprobs)
        assert [len(logprobs[req.rid]) for req in reqs] == [p.max_new_tokens for p in params]
        assert_drained(engine)
    blocking, overlapped = got
    for rid, values in blocking.items():
        assert overlapped[rid] == pytest.approx(values, abs=1e-6)  # no NaN: none was lost


def test_sampled_outputs_equal_the_reference(model) -> None:
    params = [SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=s)
              for s in range(5)]
    prompts = [[0, 4 + s, 9] for s in range(5)]
    engine = Engine(model, mode="mixed", max_running=3, overlap=True)
    outputs = engine.generate(prompts, sampling=params)
    assert outputs == [
        model.reference_generate(p, 9, temperature=0.8, top_p=0.9, seed=q.seed)
        for p, q in zip(prompts, params)
    ]


@pytest.mark.parametrize("timed", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_simulated_device_runs_the_same_steps(mode, timed) -> None:
    """Through ``SimBackend`` (and a timed one) the requests get the same tokens, the same
    number of computed tokens (plus the late stops) and the same total busy time."""
    prompts = [[0, *range(2, 2 + k)] for k in (30, 5, 200, 17, 64, 9)]
    lengths = [12, 40, 3, 25, 8, 16]

    def backend() -> SimBackend | TimedBackend:
        return TimedBackend(SimBackend(), 0.0005) if timed else SimBackend()

    blocking = Engine(backend(), mode=mode, max_running=3, kv_capacity=600)
    overlapped = Engine(backend(), mode=mode, max_running=3, kv_capacity=600, overlap=True,
                        skip_finishing_decode=True)
    expected = blocking.generate(prompts, lengths)
    assert overlapped.generate(prompts, lengths) == expected
    assert [len(out) for out in expected] == lengths
    assert overlapped.stats.late_stop_tokens == 0  # no <eos>: every finish is known early
    assert overlapped.stats.generated_tokens == blocking.stats.generated_tokens
    assert_drained(overlapped)


def test_failing_stream_callback_drains_and_leaves_the_engine_usable(model) -> None:
    engine = Engine(model, max_running=2, cache="radix", overlap=True)
    seen: list[tuple[int, int]] = []

    def explode(i: int, token: int) -> None:
        seen.append((i, token))
        if len(seen) == 4:
            raise RuntimeError("client went away")

    with pytest.raises(RuntimeError, match="client went away"):
        engine.generate([[0, 5], [0, 6], [0, 7]], 6, on_token=explode)
    assert engine.loop.inflight is None
    assert all(t >= 0 for _, t in seen)  # streamed tokens are real, never future ids
    assert_drained(engine)
    assert engine.generate([[0, 8], [0, 5]], 4) == [
        model.reference_generate([0, 8], 4), model.reference_generate([0, 5], 4)
    ]
    assert_drained(engine)


def test_abort_mid_run_drains_the_step_in_flight(model) -> None:
    engine = Engine(model, max_running=4, mode="mixed", overlap=True)
    scheduler = engine.scheduler
    prompts = [[0, 3 + i, 11] for i in range(6)]
    reqs = engine.make_requests(prompts, 10)
    for req in reqs:
        engine.add_request(req)
    for _ in range(3):
        engine.step()
    assert engine.loop.inflight is not None
    doomed, kept = reqs[::2], reqs[1::2]
    engine.abort(doomed)
    assert engine.loop.inflight is None
    scheduler.check_integrity()
    assert all(req.state == ReqState.ABORTED for req in doomed if req.finish_reason is None)
    assert all(t >= 0 for req in reqs for t in req.output)  # no placeholder left behind
    while engine.step().record is not None:
        pass
    assert [req.output for req in kept] == [
        model.reference_generate(req.prompt, 10) for req in kept
    ]
    assert_drained(engine)


def test_a_timed_device_needs_no_thread(model) -> None:
    """A device that ends its steps on its own is handed each step on the loop's thread."""
    before = {t.name for t in threading.enumerate()}
    timed = TimedBackend(ModelBackend(model), 0.02)  # longer than a step's CPU work
    engine = Engine(timed, max_running=2, overlap=True)
    prompts = [[0, 5, 6], [0, 7], [0, 8, 9]]
    assert engine.generate(prompts, 5) == [model.reference_generate(p, 5) for p in prompts]
    started = {t.name for t in threading.enumerate()} - before
    assert not any(name.startswith("minisrv-device") for name in started)
    assert timed.overruns < timed.steps and timed.waited > 0.02  # it waited for the device
    assert_drained(engine)


@pytest.mark.parametrize("timed", [False, True])
def test_a_failing_step_is_raised_and_the_engine_stays_usable(model, timed) -> None:
    """A step that fails on the device (thread or handed over) raises from the loop; the
    step launched after it is abandoned too, and the next call is served normally."""
    engine = Engine(TimedBackend(ModelBackend(model), 0.0) if timed else model,
                    max_running=2, overlap=True)
    device = engine.backend.inner if timed else engine.backend
    real_compute, calls = device.compute, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device fault")
        return real_compute(*args)

    prompts = [[0, 5, 6], [0, 7], [0, 8, 9]]
    device.compute = failing
    reqs = engine.make_requests(prompts, 5)
    with pytest.raises(RuntimeError, match="device fault"):
        engine.serve(reqs)
    device.compute = real_compute
    assert all(req.state == ReqState.ABORTED for req in reqs)  # withdrawn, memory freed
    assert all(t >= 0 for req in reqs for t in req.output)  # no placeholder left behind
    assert_drained(engine)
    assert engine.generate(prompts, 5) == [model.reference_generate(p, 5) for p in prompts]
    assert_drained(engine)


def test_a_backend_without_prepare_and_compute_is_refused(model) -> None:
    with pytest.raises(ValueError, match="prepare\\(\\) and compute\\(\\)"):
        Engine(PerRequestBackend(model), overlap=True)
    assert type(Engine(model, overlap=True).loop) is OverlapLoop
    assert type(Engine(model).loop) is Scheduler


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bad_overlap_options_are_refused(model, value) -> None:
    for name in ("overlap", "skip_finishing_decode"):
        with pytest.raises(ValueError, match=f"{name} must be True or False"):
            Engine(model, **{name: value})


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("mode", ["prefill-first", "mixed"])
def test_retraction_while_a_step_is_in_flight(model, mode, cache) -> None:
    """A tight pool retracts requests whose token is still being computed; they keep it."""
    prompts = [[0, *range(3, 3 + k)] for k in (6, 7, 5, 8, 6, 7)]
    params = [SamplingParams(max_new_tokens=14, ignore_eos=True)] * len(prompts)
    options = dict(mode=mode, cache=cache, max_running=4, kv_capacity=40,
                   new_token_ratio=0.1, min_ratio=0.05)
    blocking = Engine(model, **options)
    overlapped = Engine(model, overlap=True, debug=True, **options)
    expected = blocking.generate(prompts, sampling=params)
    assert expected == [model.reference_generate(p, 14, ignore_eos=True) for p in prompts]
    assert overlapped.generate(prompts, sampling=params) == expected
    assert overlapped.stats.retractions > 0
    assert overlapped.stats.late_stop_tokens == late_stops(overlapped.trace)
    assert_drained(overlapped)


def test_steps_run_on_their_own_cuda_stream_only_on_a_gpu(model) -> None:
    """On a GPU the device thread issues every step on a stream of its own (one per
    scheduler, waiting for the default stream's work first); the CPU needs none."""
    loop = overlap_loop(Scheduler(TimedBackend(ModelBackend(model), 0.0), kv_capacity=200))
    stream = loop.worker.stream
    if model.device.type == "cuda":
        assert stream is not None and stream != torch.cuda.current_stream(model.device)
    else:
        assert stream is None
    assert overlap_loop(Scheduler(SimBackend())).worker.stream is None
