"""The scheduler loop on a scripted backend: traces, admission, stops, invariants.

A scripted backend needs no model, so these tests pin the scheduling decisions themselves
(who prefills, who decodes, who waits) exactly and quickly.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisrv.core import Batch, BatchResult
from minisrv.request import ABORTED, FINISHED, Req
from minisrv.sampling import SamplingParams
from minisrv.scheduler import MODES, Scheduler

EOS = 1


class ScriptedBackend:
    """Emits token 7 for every request, except ``<eos>`` at the positions in ``eos_at``.

    Checks on every step that the scheduler keeps its promises (batch cap, KV capacity).
    """

    time_unit = "step"
    cost_unit = "tokens"
    eos_ids = (EOS,)
    max_context = 64
    vocab_size = 10
    capabilities: frozenset = frozenset()  # whole steps only

    def __init__(self, eos_at: dict[int, int] | None = None) -> None:
        self.eos_at = eos_at or {}
        self.scheduler: Scheduler | None = None
        self.released: list[int] = []
        self.batches: list[Batch] = []

    def run(self, batch: Batch) -> BatchResult:
        sched = self.scheduler
        if sched is not None:
            assert len(sched.queues.running) <= sched.config.max_running
            assert sched.admission.reserved <= sched.config.kv_capacity
        self.batches.append(batch)
        tokens = [EOS if self.eos_at.get(r.rid) == len(r.output) else 7 for r in batch.reqs]
        return BatchResult([[t] for t in tokens], cost=float(len(batch)), elapsed=1.0)

    def attach_kv(self, capacity: int) -> None:
        return None

    def attach_table(self, table: object) -> None:
        pass

    def release(self, req: Req) -> None:
        self.released.append(req.rid)


def make_scheduler(mode: str = "prefill-first", max_running: int = 2, kv_capacity: int = 1000,
                   eos_at: dict[int, int] | None = None, page_size: int = 1
                   ) -> tuple[Scheduler, ScriptedBackend]:
    backend = ScriptedBackend(eos_at)
    sched = Scheduler(backend, kv_capacity=kv_capacity, max_running=max_running, mode=mode,
                      admission="reserve", debug=True, page_size=page_size)
    backend.scheduler = sched
    return sched, backend


def req(rid: int, max_new: int, arrival: float = 0.0, prompt_len: int = 3,
        ignore_eos: bool = False) -> Req:
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos)
    return Req(rid=rid, prompt=[0] + [5] * (prompt_len - 1), params=params, arrival=arrival)


def notes_requests() -> list[Req]:
    return [req(0, 3), req(1, 5), req(2, 3, arrival=2)]


def run_trace(mode: str, reqs: list[Req], max_running: int = 2) -> list[tuple]:
    sched, _ = make_scheduler(mode, max_running)
    for r in reqs:
        sched.submit(r)
    sched.run()
    return [(s.prefill, s.decode, s.paused, s.finished) for s in sched.recorder.trace]


def test_notes_three_request_trace_prefill_first() -> None:
    """Step 0 prefills r0, r1; r0 ends at step 2; step 3 prefills r2 while r1 waits."""
    assert run_trace("prefill-first", notes_requests()) == [
        ((0, 1), (), (), ()),
        ((), (0, 1), (), ()),
        ((), (0, 1), (), (0,)),
        ((2,), (), (1,), ()),
        ((), (1, 2), (), ()),
        ((), (1, 2), (), (1, 2)),
    ]


def test_static_batch_waits_for_its_longest_request() -> None:
    assert run_trace("static", notes_requests()) == [
        ((0, 1), (), (), ()),
        ((), (0, 1), (), ()),
        ((), (0, 1), (), (0,)),
        ((), (1,), (), ()),  # r2 has arrived and a slot is free, but the batch is not done
        ((), (1,), (), (1,)),
        ((2,), (), (), ()),
        ((), (2,), (), ()),
        ((), (2,), (), (2,)),
    ]


def test_mixed_step_prefills_and_decodes_together() -> None:
    assert run_trace("mixed", notes_requests()) == [
        ((0, 1), (), (), ()),
        ((), (0, 1), (), ()),
        ((), (0, 1), (), (0,)),
        ((2,), (1,), (), ()),
        ((), (1, 2), (), (1,)),
        ((), (2,), (), (2,)),
    ]


def test_trace_records_queue_clock_and_token_times() -> None:
    sched, _ = make_scheduler()
    reqs = notes_requests()
    for r in reqs:
        sched.submit(r)
    sched.run()
    assert [s.queued for s in sched.recorder.trace] == [0, 0, 1, 0, 0, 0]  # r2 queued at step 2
    assert [(s.start, s.end) for s in sched.recorder.trace] == [(i, i + 1) for i in range(6)]
    assert reqs[1].token_times == [1, 2, 3, 5, 6]  # the pause at step 3 shows as a gap
    assert reqs[2].ttft == 2 and reqs[2].latency == 4
    assert sched.recorder.stats.steps == 6 and sched.recorder.stats.generated_tokens == 11
    assert sched.recorder.stats.prefill_steps == 2 and sched.recorder.stats.decode_tokens == 8


def test_idle_clock_jumps_to_the_next_arrival() -> None:
    sched, _ = make_scheduler()
    sched.submit(req(0, 2, arrival=10.0))
    sched.run()
    assert sched.recorder.trace[0].start == 10.0
    assert len(sched.recorder.trace) == 2


def test_admission_is_fcfs_and_never_overtakes() -> None:
    # r0 holds 3 + 40 = 43 of 50 KV tokens; r1 (43) must wait for it, and the small r2
    # (3 + 2 = 5 tokens, which would fit) may not jump the queue.
    sched, _ = make_scheduler(max_running=4, kv_capacity=50)
    big0, big1, small = req(0, 40), req(1, 40), req(2, 2)
    for r in (big0, big1, small):
        sched.submit(r)
    sched.run()
    assert big0.admitted_at == 0
    assert small.admitted_at == big1.admitted_at == big0.finish_time == 40


def test_eos_stops_a_request_unless_ignored() -> None:
    sched, backend = make_scheduler(eos_at={0: 2, 1: 2})
    stop = req(0, 10)
    keep = req(1, 4, ignore_eos=True)
    sched.submit(stop)
    sched.submit(keep)
    sched.run()
    assert stop.output == [7, 7, EOS] and stop.finish_reason == "eos"
    assert keep.output == [7, 7, EOS, 7] and keep.finish_reason == "length"
    assert sorted(backend.released) == [0, 1]
    assert sched.admission.reserved == 0


def test_streaming_callback_sees_every_token_in_order() -> None:
    sched, _ = make_scheduler()
    seen: dict[int, list[int]] = {}
    sched.completer.on_token = lambda r, tok: seen.setdefault(r.rid, []).append(tok)
    reqs = notes_requests()
    for r in reqs:
        sched.submit(r)
    sched.run()
    assert seen == {r.rid: r.output for r in reqs}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "greedy"}, "unknown mode 'greedy'"),
        ({"max_running": 0}, "max_running must be >= 1"),
        ({"kv_capacity": 0}, "kv_capacity must be >= 1"),
        ({"max_running": 2.5}, "max_running must be an int"),
    ],
)
def test_bad_configuration_is_refused(kwargs: dict, message: str) -> None:
    args = {"kv_capacity": 100, "max_running": 2, "mode": "mixed", **kwargs}
    with pytest.raises(ValueError, match=message):
        Scheduler(ScriptedBackend(), **args)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (Req(0, [], SamplingParams(max_new_tokens=2)), "prompt is empty"),
        (req(0, 999, prompt_len=3), "exceeds the model context of 64"),
        (req(0, 50, prompt_len=60), "60 tokens"),
        (Req(0, [0, 99], SamplingParams()), "outside the vocabulary"),
        (req(0, 2, arrival=-1.0), "arrival must be >= 0"),
    ],
)
def test_unservable_request_is_refused_and_changes_nothing(bad: Req, message: str) -> None:
    sched, _ = make_scheduler()
    with pytest.raises(ValueError, match=message):
        sched.submit(bad)
    assert sched.idle and sched.recorder.stats.steps == 0
    sched.submit(req(1, 2))
    sched.run()
    assert sched.recorder.stats.finished == 1


def test_request_larger_than_kv_capacity_names_the_numbers() -> None:
    sched, _ = make_scheduler(kv_capacity=20)
    message = r"3 prompt \+ 30 new = 33 KV tokens but kv_capacity is 20"
    with pytest.raises(ValueError, match=message):
        sched.submit(req(0, 30))
    assert sched.idle


def test_abort_frees_everything_and_the_scheduler_keeps_serving() -> None:
    sched, backend = make_scheduler()
    reqs = [req(0, 5), req(1, 5), req(2, 5), req(3, 5, arrival=50)]
    for r in reqs:
        sched.submit(r)
    sched.step()  # r0, r1 running; r2 waiting; r3 pending
    sched.abort(reqs)
    assert sched.idle and sched.admission.reserved == 0
    assert all(r.state == ABORTED for r in reqs)
    assert sorted(backend.released) == [0, 1]
    fresh = req(4, 2)
    sched.submit(fresh)
    sched.run()
    assert fresh.state == FINISHED and fresh.output == [7, 7]


def test_static_can_beat_prefill_first_but_never_mixed() -> None:
    """Prefill-first pauses the long request for every short newcomer's prefill, so with
    one long and many one-token requests request-level batching needs fewer steps."""
    lengths = [1, 10, 1, 1, 1, 1]

    def steps(mode: str) -> int:
        return len(run_trace(mode, [req(i, n) for i, n in enumerate(lengths)]))

    assert steps("static") == 12
    assert steps("prefill-first") == 14
    assert steps("mixed") == 10


workloads = st.lists(
    st.tuples(
        st.integers(1, 8),  # prompt length
        st.integers(1, 12),  # max_new_tokens
        st.integers(0, 15),  # arrival step
        st.one_of(st.none(), st.integers(0, 11)),  # position of a scripted <eos>
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(workloads, st.sampled_from(MODES), st.integers(1, 5), st.integers(20, 60),
       st.sampled_from([1, 4]))
def test_every_request_is_served_exactly_once(spec, mode, max_running, kv_capacity,
                                              page_size) -> None:
    """In pages of 4 too: reserve admission counts whole pages, so a request of 20 tokens
    (5 pages) still fits the smallest pool."""
    sched, backend = make_scheduler(
        mode, max_running, kv_capacity, {i: e for i, (*_, e) in enumerate(spec) if e is not None},
        page_size)
    reqs = [req(i, n, float(a), p) for i, (p, n, a, _) in enumerate(spec)]
    for r in reqs:
        sched.submit(r)
    sched.run()
    assert sched.idle and sched.admission.reserved == 0 and not backend.scheduler.queues.running
    prefills = [rid for s in sched.recorder.trace for rid in s.prefill]
    assert sorted(prefills) == list(range(len(reqs)))  # nobody lost, nobody twice
    for r in reqs:
        eos = backend.eos_at.get(r.rid)
        expected = min(r.max_new_tokens, eos + 1) if eos is not None else r.max_new_tokens
        assert len(r.output) == expected and r.state == FINISHED
        assert r.admitted_at >= r.arrival
        decodes = sum(r.rid in s.decode for s in sched.recorder.trace)
        assert decodes == len(r.output) - 1
    ends = [s.end for s in sched.recorder.trace]
    assert all(s.end > s.start for s in sched.recorder.trace) and ends == sorted(ends)
    assert all(s.batch_size <= max_running for s in sched.recorder.trace)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=12), st.integers(1, 5))
def test_static_never_beats_mixed_on_slot_utilisation(lengths, max_running) -> None:
    def steps(mode: str) -> int:
        return len(run_trace(mode, [req(i, n) for i, n in enumerate(lengths)], max_running))

    # Both produce the same tokens, so utilisation compares as the inverse of step counts.
    assert steps("mixed") <= steps("static")
