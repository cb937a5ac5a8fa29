"""The simulated GPU: same scheduler, roofline step times, fixed output lengths."""

from __future__ import annotations

import pytest

from minisrv.configs import H100, LLAMA3_8B
from minisrv.core import Batch
from minisrv.engine import Engine
from minisrv.request import Req
from minisrv.sampling import SamplingParams
from minisrv.scheduler import MODES
from minisrv.sim import SimBackend, simulate
from minisrv.sim.roofline import batch_step_time
from minisrv.workloads import gpu_scale_workload

GPU = {"max_running": 64, "admission": "reserve"}  # the scheduler-loop chapter's setting


@pytest.fixture(scope="module")
def busy():
    """600 requests of the GPU-scale mix at 64 req/s: the server is overloaded."""
    return gpu_scale_workload(n=600, rate=64.0, seed=1)


@pytest.mark.parametrize("mode", MODES)
def test_sim_invariants(busy, mode) -> None:
    run = simulate(busy, mode=mode, **GPU)
    assert [len(r.output) for r in run.requests] == busy.output_lens
    assert all(r.finished for r in run.requests)
    starts = [s.start for s in run.trace]
    ends = [s.end for s in run.trace]
    assert all(a < b for a, b in zip(starts, ends, strict=True))  # every step takes time
    assert all(e <= s for e, s in zip(ends, starts[1:], strict=False))  # the clock never goes back
    assert max(s.batch_size for s in run.trace) <= 64
    assert all(s.duration == pytest.approx(s.cost) for s in run.trace)
    assert all(r.first_token_time >= r.arrival for r in run.requests)


def test_step_time_is_the_roofline_time_of_the_batch() -> None:
    backend = SimBackend()
    fresh = Req(0, list(range(2, 502)), SamplingParams(max_new_tokens=4))
    old = Req(1, list(range(2, 102)), SamplingParams(max_new_tokens=9))
    old.output.extend([5, 6, 7])  # 103 tokens: 102 cached, the last one is this step's input
    result = backend.run(Batch.of([fresh], [old]))
    expected = batch_step_time(LLAMA3_8B, H100, prefill=[(500, 0)], decode_contexts=[102])
    assert result.elapsed == result.cost == expected
    assert len(result.next_tokens) == 2


def test_default_kv_capacity_is_the_memory_left_after_the_weights() -> None:
    # (80 GB - 16.06 GB of weights) / 128 KiB per token
    assert SimBackend().kv_capacity() == int((80e9 - 8.03e9 * 2) // 131072)


def test_continuous_batching_beats_static_under_load(busy) -> None:
    static = simulate(busy, mode="static", **GPU).metrics
    continuous = simulate(busy, mode="prefill-first", **GPU).metrics
    assert continuous.throughput > 2 * static.throughput
    assert continuous.mean_batch > 3 * static.mean_batch
    assert continuous.mean_latency < static.mean_latency / 3
    assert continuous.slot_utilisation > static.slot_utilisation


def test_at_low_load_throughput_is_equal_but_static_is_slower() -> None:
    calm = gpu_scale_workload(n=300, rate=4.0, seed=2)
    static = simulate(calm, mode="static", **GPU).metrics
    continuous = simulate(calm, mode="prefill-first", **GPU).metrics
    assert continuous.throughput == pytest.approx(static.throughput, rel=0.05)
    assert static.mean_latency > 2 * continuous.mean_latency


def test_mixed_steps_take_longer_but_are_fewer(busy) -> None:
    first = simulate(busy, mode="prefill-first", **GPU)
    mixed = simulate(busy, mode="mixed", **GPU)
    assert mixed.metrics.steps < first.metrics.steps
    slowest_mixed = max(s.duration for s in mixed.trace if s.decode)
    slowest_decode_only = max(s.duration for s in first.trace if not s.prefill)
    assert slowest_mixed > 2 * slowest_decode_only  # decodes ride along with a long prefill


def test_simulation_is_deterministic(busy) -> None:
    a = simulate(busy, mode="mixed", **GPU).metrics
    b = simulate(busy, mode="mixed", **GPU).metrics
    assert a == b


def test_sim_engine_refuses_requests_beyond_the_context() -> None:
    engine = Engine(SimBackend(), kv_capacity=100_000, max_running=4)
    with pytest.raises(ValueError, match="exceeds the model context of 8192"):
        engine.generate([[5] * 8000], 500)
    assert engine.scheduler.idle
    assert [len(o) for o in engine.generate([[5] * 10], 3)] == [3]
