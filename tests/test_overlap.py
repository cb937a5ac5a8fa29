"""The overlap chapter's model and instruments: the two-lane timeline, the throughput
ratio, the timed device and the per-step CPU breakdown of the real engine."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisrv import sampling
from minisrv.engine import Engine
from minisrv.experiments.breakdown import CPU_PARTS, DEVICE_PARTS, PARTS, time_steps
from minisrv.experiments.lanes import late_stop_waste, throughput_ratio, timeline
from minisrv.runner import ModelBackend
from minisrv.sim import SimBackend, TimedBackend
from minisrv.tokenizer import Tokenizer

MODEL_SEED = 3
LECTURE_GPU_STEP = 7.36  # ms: LLaMA-3-8B, batch 64, context 1024 on an H100 (roofline)


# ----------------------------------------------------------------------------- timeline
def test_blocking_timeline_alternates_lanes() -> None:
    t = timeline(5, 3, 4, overlap=False)
    assert t.cpu == ((0, 3), (8, 11), (16, 19), (24, 27))
    assert t.device == ((3, 8), (11, 16), (19, 24), (27, 32))
    assert t.total == 32
    assert t.device_idle == 12
    assert t.utilisation == pytest.approx(20 / 32)
    assert t.device_gaps == [(0, 3), (8, 11), (16, 19), (24, 27)]


def test_overlapped_timeline_hides_a_shorter_cpu() -> None:
    t = timeline(5, 3, 4, overlap=True)
    assert t.cpu == ((0, 3), (3, 6), (8, 11), (13, 16))  # one step ahead, no further
    assert t.device == ((3, 8), (8, 13), (13, 18), (18, 23))
    assert t.total == 23
    assert t.device_idle == 3  # only the first step's CPU work
    assert t.device_gaps == [(0, 3)]


def test_overlapped_timeline_with_the_cpu_slower() -> None:
    t = timeline(3, 5, 4, overlap=True)
    assert t.cpu == ((0, 5), (5, 10), (10, 15), (15, 20))
    assert t.device == ((5, 8), (10, 13), (15, 18), (20, 23))
    assert t.total == 23
    assert t.device_idle == 11


def test_timeline_with_step_times_that_vary() -> None:
    over = timeline([4, 1, 4], [2, 2, 2], 3, overlap=True)
    assert over.cpu == ((0, 2), (2, 4), (6, 8))
    assert over.device == ((2, 6), (6, 7), (8, 12))
    assert over.device_gaps == [(0, 2), (7, 8)]
    assert over.device_idle == 3
    block = timeline([4, 1, 4], [2, 2, 2], 3, overlap=False)
    assert block.device == ((2, 6), (8, 9), (11, 15))
    assert block.total == 15


@pytest.mark.parametrize("cpu", [0.5, 3.0, LECTURE_GPU_STEP])
def test_lecture_gpu_step_hides_scheduling_while_cpu_is_not_longer(cpu: float) -> None:
    n = 50
    over = timeline(LECTURE_GPU_STEP, cpu, n, overlap=True)
    assert over.device_idle == pytest.approx(cpu)  # the first step's, then never again
    assert over.total == pytest.approx(cpu + n * LECTURE_GPU_STEP)
    block = timeline(LECTURE_GPU_STEP, cpu, n, overlap=False)
    assert block.device_idle == pytest.approx(n * cpu)


def test_lecture_gpu_step_cannot_hide_a_longer_cpu() -> None:
    n, cpu = 50, 9.0
    over = timeline(LECTURE_GPU_STEP, cpu, n, overlap=True)
    assert over.total == pytest.approx(LECTURE_GPU_STEP + n * cpu)
    assert over.device_idle == pytest.approx(cpu + (n - 1) * (cpu - LECTURE_GPU_STEP))


step_times = st.lists(st.floats(0, 20, allow_nan=False), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(gpu=step_times, cpu=step_times)
def test_timeline_invariants(gpu: list[float], cpu: list[float]) -> None:
    n = min(len(gpu), len(cpu))
    gpu, cpu = gpu[:n], cpu[:n]
    block = timeline(gpu, cpu, n, overlap=False)
    over = timeline(gpu, cpu, n, overlap=True)
    assert block.total == pytest.approx(sum(gpu) + sum(cpu))
    assert max(sum(gpu), sum(cpu)) - 1e-9 <= over.total <= block.total + 1e-9
    for t in (block, over):
        assert t.device_busy == pytest.approx(sum(gpu))
        assert t.device_idle == pytest.approx(sum(b - a for a, b in t.device_gaps))
        for lane in (t.cpu, t.device):  # one thing at a time on each lane, in step order
            assert all(lane[i][1] <= lane[i + 1][0] + 1e-12 for i in range(n - 1))
        for i in range(n):
            assert t.device[i][0] >= t.cpu[i][1]  # a step runs only once it is formed
            if i >= 2:  # the CPU is at most one step ahead of the device
                assert t.cpu[i][0] >= t.device[i - 2][1]
    for i in range(1, n):  # blocking: the CPU waits for the previous forward
        assert block.cpu[i][0] == block.device[i - 1][1]


@settings(max_examples=100, deadline=None)
@given(gpu=st.floats(0.01, 20), cpu=st.floats(0, 20), n=st.integers(1, 40))
def test_constant_step_totals(gpu: float, cpu: float, n: int) -> None:
    over = timeline(gpu, cpu, n, overlap=True)
    assert over.total == pytest.approx(min(gpu, cpu) + n * max(gpu, cpu))
    ratio = timeline(gpu, cpu, n, overlap=False).total / over.total
    assert ratio <= throughput_ratio(gpu, cpu) + 1e-9  # the start-up step costs a little


@pytest.mark.parametrize(
    "args, message",
    [
        ((5, 3, 0, True), "n_steps"),
        ((5, 3, 2.5, True), "n_steps"),
        ((5, 3, True, True), "n_steps"),
        ((5, 3, 2, 1), "overlap"),
        ((-1, 3, 2, True), "gpu_step"),
        ((5, math.nan, 2, True), "cpu_step"),
        (([5, 5, 5], 3, 2, True), "gpu_step has 3 entries"),
        ((5, "3", 2, True), "cpu_step"),
    ],
)
def test_timeline_rejects_bad_input(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        timeline(*args)


# ----------------------------------------------------------------------------- ratio
def test_lecture_exercise() -> None:
    assert throughput_ratio(5, 3) == pytest.approx(1.6)
    assert round(throughput_ratio(5, 3, mean_output_len=100), 2) == 1.58
    assert throughput_ratio(5, 3, mean_output_len=100) == pytest.approx(1.6 * 100 / 101)


def test_ratio_limits() -> None:
    assert throughput_ratio(5, 0) == 1.0  # nothing to hide
    assert throughput_ratio(5, 5) == 2.0  # the best case: equal lanes
    assert throughput_ratio(3, 5) == pytest.approx(1.6)  # symmetric in the two lanes


def test_ratio_is_the_long_run_timeline_ratio() -> None:
    n = 100_000
    block = timeline(5, 3, n, overlap=False).total
    over = timeline(5, 3, n, overlap=True).total
    assert block / over == pytest.approx(throughput_ratio(5, 3), rel=1e-4)


@pytest.mark.parametrize(
    "args",
    [(0, 0), (-1, 3), (5, math.inf), (True, 3), (5, 3, 0), (5, 3, -2), (5, 3, math.nan)],
)
def test_ratio_rejects_bad_input(args: tuple) -> None:
    with pytest.raises(ValueError):
        throughput_ratio(*args)


def test_wasted_rows_counted_in_time() -> None:
    from minisrv.configs import H100, LLAMA3_8B
    from minisrv.sim.roofline import decode_step_time

    step = decode_step_time(LLAMA3_8B, H100, 64, 1024)
    row = decode_step_time(LLAMA3_8B, H100, 65, 1024) - step
    # 8 of 64 requests finish per step at L = 8; each wasted row costs one marginal row
    assert late_stop_waste(LLAMA3_8B, H100, 64, 1024, 8) == pytest.approx(8 * row)
    # a memory-bound row costs less than an average row's share of the step
    assert row < step / 64
    waste = late_stop_waste(LLAMA3_8B, H100, 64, 1024, 8)
    assert throughput_ratio(step, 0.5e-3, waste_step=waste) == pytest.approx(
        (step + 0.5e-3) / (step + waste))
    # counted in time, the waste costs less than counted as whole tokens
    assert throughput_ratio(step, 0.5e-3, waste_step=waste) > throughput_ratio(step, 0.5e-3, 8)
    # a CPU lane longer than the device with its waste still sets the overlapped step
    assert throughput_ratio(1.0, 3.0, waste_step=0.5) == pytest.approx(4 / 3)


@pytest.mark.parametrize("kwargs", [{"waste_step": -1.0}, {"waste_step": math.inf},
                                    {"waste_step": True},
                                    {"waste_step": 0.1, "mean_output_len": 8}])
def test_waste_step_rejects_bad_input(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        throughput_ratio(5, 3, **kwargs)


@pytest.mark.parametrize("args", [(0, 512, 8), (64, 512, 0), (64, 512, math.nan), (True, 512, 8)])
def test_late_stop_waste_rejects_bad_input(args: tuple) -> None:
    from minisrv.configs import H100, LLAMA3_8B

    with pytest.raises(ValueError):
        late_stop_waste(LLAMA3_8B, H100, *args)


# ----------------------------------------------------------------------------- the device
@pytest.mark.parametrize("cache", ["none", "radix"])
def test_timed_backend_keeps_the_tokens(model, cache: str) -> None:
    tok = Tokenizer()
    prompts = [tok.encode(p) for p in ("FR:", "FR:Pa", "JP:", "DE:Berlin,", "FR:Ly")]
    lengths = [6, 3, 9, 4, 7]
    timed = TimedBackend(ModelBackend(model), 0.002)
    engine = Engine(timed, kv_capacity=200, max_running=3, cache=cache)
    out = engine.generate(prompts, lengths)
    assert out == [model.reference_generate(p, m) for p, m in zip(prompts, lengths)]
    assert timed.steps == engine.stats.steps
    # A step lasts at least its step time; ``busy`` is a sum of float differences, so the
    # comparison allows for rounding (0.019999999999527063 for ten steps of 2 ms).
    assert timed.busy >= 0.002 * timed.steps * (1 - 1e-9)
    assert timed.inner.pool is not None  # the scheduler's attach_kv reached the inner backend
    assert engine.backend is timed


def test_timed_backend_forwards_the_protocol(model) -> None:
    inner = ModelBackend(model)
    timed = TimedBackend(inner, 0.0)
    assert (timed.time_unit, timed.cost_unit, timed.eos_ids, timed.max_context,
            timed.vocab_size) == (inner.time_unit, inner.cost_unit, inner.eos_ids,
                                  inner.max_context, inner.vocab_size)
    allocator = timed.attach_kv(20)
    assert allocator is inner.pool.allocator and allocator.capacity == 20
    assert TimedBackend(SimBackend(), 0.001).attach_kv(20) is None  # stores no KV


def test_timed_backend_ends_steps_on_its_own_one_after_the_other() -> None:
    """``compute`` returns at once with the time the device ends the step; steps follow each
    other on the device; ``wait`` returns only once that time has passed."""
    engine = Engine(SimBackend(), max_running=4, kv_capacity=400)
    for req in engine.make_requests([[0, 5, 6], [0, 7, 8, 9]], 4):
        engine.scheduler.submit(req)
    engine.scheduler.receive_arrivals()
    batch = engine.scheduler.former.get_next_batch_to_run()
    timed = TimedBackend(SimBackend(), 0.2)
    first = timed.compute(timed.prepare(batch))
    second = timed.compute(timed.prepare(batch))
    assert time.perf_counter() < first.done_at  # handed over, not done
    # the device runs one step at a time
    assert second.done_at >= first.done_at + 0.2 - 1e-9
    assert first.next_tokens == SimBackend().run(batch).next_tokens  # the inner answer
    timed.wait(second)
    assert time.perf_counter() >= second.done_at
    assert timed.busy == pytest.approx(0.4) and timed.steps == 2 and timed.overruns == 0
    assert timed.waited > 0.2  # most of the two steps was spent waiting for the device


def test_timed_backend_counts_overruns(model) -> None:
    timed = TimedBackend(ModelBackend(model), 0.0)  # any computation overruns 0 s
    engine = Engine(timed, kv_capacity=100)
    engine.generate([Tokenizer().encode("FR:")], 3)
    assert timed.overruns == timed.steps == engine.stats.steps > 0


@pytest.mark.parametrize("step_time", [-0.001, math.nan, math.inf, "1", True])
def test_timed_backend_rejects_bad_step_time(model, step_time) -> None:
    with pytest.raises(ValueError, match="step_time"):
        TimedBackend(ModelBackend(model), step_time)


def test_timed_backend_rejects_a_non_backend() -> None:
    with pytest.raises(ValueError, match="inner"):
        TimedBackend(object(), 0.001)


# ----------------------------------------------------------------------------- measuring
def _prompts() -> tuple[list[list[int]], list[int]]:
    tok = Tokenizer()
    texts = ("FR:Paris,", "FR:Paris,Ly", "FR:Paris,Ma", "JP:", "JP:Tokyo,")
    return [tok.encode(t) for t in texts], [5, 8, 3, 6, 4]


def test_time_steps_times_every_step_and_keeps_the_tokens(model) -> None:
    prompts, lengths = _prompts()
    engine = Engine(model, kv_capacity=200, max_running=3, cache="radix")
    timings = time_steps(engine, prompts, lengths)
    assert timings.outputs == [model.reference_generate(p, m) for p, m in zip(prompts, lengths)]
    assert len(timings.steps) == engine.stats.steps == len(engine.trace)
    assert [s.batch_size for s in timings.steps] == [r.batch_size for r in engine.trace]
    assert [s.prefill_tokens for s in timings.steps] == [r.prefill_tokens for r in engine.trace]
    for s in timings.steps:
        assert set(s.seconds) == set(PARTS)
        assert all(v >= 0 for v in s.seconds.values())
        assert s.device > 0 and s.seconds["sample"] > 0 and s.seconds["schedule"] > 0
        assert s.total == pytest.approx(s.cpu + s.device)
    assert any(s.seconds["prefix match"] > 0 for s in timings.steps)
    assert any(s.seconds["cache insert"] > 0 for s in timings.steps)
    assert 0 < timings.cpu_share < 1
    assert set(CPU_PARTS) == set(PARTS) - set(DEVICE_PARTS)
    assert set(DEVICE_PARTS) == {"forward", "sample"}  # what ModelRunner.compute runs


def test_time_steps_leaves_the_engine_as_it_was(model) -> None:
    prompts, lengths = _prompts()
    engine = Engine(model, kv_capacity=200, cache="radix")
    sample_batch = sampling.sample_batch
    sched = engine.scheduler
    parts = (sched, sched.former, sched.completer, engine.backend, engine.tree)
    before = [dict(vars(obj)) for obj in parts]
    time_steps(engine, prompts, lengths)
    with pytest.raises(ValueError, match="max_new_tokens"):  # an error mid-call restores too
        time_steps(engine, prompts, 0)
    assert "forward_flat" not in vars(model)
    assert sampling.sample_batch is sample_batch
    for obj, saved in zip(parts, before, strict=True):
        assert {"step", "receive_arrivals", "get_next_batch_to_run", "process_batch_result",
                "run", "match_prefix", "insert"}.isdisjoint(set(vars(obj)) - set(saved))
    assert engine.generate(prompts, lengths) == time_steps(engine, prompts, lengths).outputs


@pytest.mark.parametrize("kind", ["sim", "timed"])
def test_time_steps_counts_any_other_backend_as_the_device(model, kind: str) -> None:
    prompts, lengths = _prompts()
    backend = SimBackend() if kind == "sim" else TimedBackend(ModelBackend(model), 0.001)
    engine = Engine(backend, kv_capacity=300, cache="radix")
    timings = time_steps(engine, prompts, lengths)
    if kind == "timed":
        assert timings.outputs == [
            model.reference_generate(p, m) for p, m in zip(prompts, lengths)
        ]
    else:
        assert [len(o) for o in timings.outputs] == lengths  # the simulator runs to the limit
    assert len(timings.steps) == engine.stats.steps
    for s in timings.steps:
        assert s.seconds["prepare inputs"] == s.seconds["sample"] == 0
        assert s.device > 0 and s.seconds["schedule"] > 0
