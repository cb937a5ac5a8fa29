"""The engine's driver API: ``add_request``, ``step``, ``abort``, ``snapshot``, in both loops,
and batch entries that compute several tokens (a speculative check) freeing rejected KV."""

from __future__ import annotations

import pytest

from minisrv.core import Batch, BatchResult, Entry
from minisrv.engine import Engine
from minisrv.request import Req, ReqState
from minisrv.sampling import SamplingParams
from minisrv.scheduler import Scheduler
from minisrv.sim import SimBackend


@pytest.mark.parametrize("overlap", [False, True])
def test_stepping_by_hand_gives_each_request_its_reference(model, overlap: bool) -> None:
    engine = Engine(model, max_running=2, cache="radix", overlap=overlap, debug=True)
    prompts = [[0, 5, 9], [0, 5, 9, 4], [0, 7]]
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=5)) for p in prompts]
    streamed: dict[int, list[int]] = {req.rid: [] for req in reqs}
    finished: list[Req] = []
    while (out := engine.step()).record is not None:
        for req, token in out.tokens:
            streamed[req.rid].append(token)
        assert all(req.finish_reason is not None for req in out.finished)
        assert [r.rid for r in out.finished] == list(out.record.finished)
        finished += out.finished
    assert engine.idle and sorted(r.rid for r in finished) == [r.rid for r in reqs]
    assert [streamed[r.rid] for r in reqs] == [r.output for r in reqs]
    assert [r.output for r in reqs] == [model.reference_generate(p, 5) for p in prompts]
    snap = engine.snapshot()
    assert (snap.running, snap.queued, snap.kv_used, snap.steps) == (0, 0, 0, engine.stats.steps)
    assert snap.hit_rate == engine.stats.hit_rate and set(snap.as_dict()) >= {"token_usage"}


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_by_hand_frees_everything_and_the_rest_goes_on(model, overlap: bool) -> None:
    engine = Engine(model, max_running=3, mode="mixed", overlap=overlap, debug=True)
    reqs = [engine.add_request([0, 3 + i, 11], SamplingParams(max_new_tokens=8))
            for i in range(4)]
    for _ in range(3):
        engine.step()
    assert engine.snapshot().running > 0 and engine.snapshot().kv_used > 0
    engine.abort(reqs[:2])
    engine.scheduler.check_integrity()
    assert all(r.state == ReqState.ABORTED for r in reqs[:2] if r.finish_reason is None)
    while engine.step().record is not None:
        pass
    assert [r.output for r in reqs[2:]] == [model.reference_generate(r.prompt, 8)
                                           for r in reqs[2:]]
    assert engine.snapshot().kv_used == 0


def test_add_request_refuses_bad_input_and_changes_nothing(model) -> None:
    engine = Engine(model, kv_capacity=50)
    with pytest.raises(ValueError, match="could never be admitted"):
        engine.add_request([0, 5], SamplingParams(max_new_tokens=60))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    req = engine.add_request([0, 5])
    with pytest.raises(ValueError, match="added already"):
        engine.add_request(req)
    assert engine.snapshot().queued == 1
    assert engine.step().record is not None


def test_an_entry_of_several_tokens_keeps_those_before_the_stop_and_frees_the_rest() -> None:
    """A speculative check: 3 tokens computed for one request, the second is <eos>; the
    request keeps two tokens and its KV for what it kept, the third slot is freed."""
    sched = Scheduler(SimBackend(), kv_capacity=40, cache="radix", debug=True)
    req = Req(rid=0, prompt=[0, 5, 6, 7], params=SamplingParams(max_new_tokens=9))
    sched.submit(req)
    sched.step()  # prefilled: one output token
    assert len(req.output) == 1 and req.kv_len == 4
    sched.memory.alloc_tokens(req, 3)  # the newest token + 2 drafts
    batch = Batch((Entry(req, 4, 3),))
    sched.backend = _Eos(sched.backend)
    finished = sched.completer.process_batch_result(batch, BatchResult([[8, 1, 9]], 1.0, 1.0))
    assert finished == [req] and req.output[1:] == [8, 1] and req.finish_reason == "eos"
    sched.check_integrity()
    memory = sched.memory
    assert memory.kv.used_count == memory.tree.total_size()  # nothing leaked, all cached
    assert memory.tree.total_size() == 6  # prompt + the two tokens whose KV exist


class _Eos:
    """A backend whose token 1 ends a request (the simulator has no <eos>)."""

    def __init__(self, inner: SimBackend) -> None:
        self.inner, self.eos_ids = inner, (1,)

    def release(self, req: Req) -> None:
        self.inner.release(req)


def test_penalties_with_the_overlapped_loop_are_refused_at_the_door(model) -> None:
    """The overlapped loop forms step i+1 before step i's token is known; a penalty reads
    the tokens so far, so the request is refused when added, not failed mid-run."""
    engine = Engine(model, kv_capacity=100, overlap=True)
    with pytest.raises(ValueError, match="overlapped loop"):
        engine.add_request([0, 5, 6], SamplingParams(repetition_penalty=1.3))
    assert engine.idle
