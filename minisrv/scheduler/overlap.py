"""The overlapped loop: the CPU forms step i+1 while the device computes step i.

The same ``form``, ``launch`` and ``complete`` as the blocking loop, in another order::

    batch = form()                 step i+1, while step i may still be computing
    inflight = launch(batch)       to the device (``DeviceWorker``): inputs copied out, a
                                   future id per entry in place of the token it will get
    complete(previous)             wait for step i: tokens replace their placeholders, stop
                                   checks, the finish path, the record, streaming

Every request of a launched step carries a *future id* (a negative placeholder,
``FutureMap``) in place of the token it is about to get, so lengths, KV slots and
admission see exactly what the blocking loop sees. The stop check is therefore one step
late: a request that finished in step i was still running when step i+1 was formed, so (if
step i+1 decodes it) it computes one extra token, which is discarded and counted in
``stats.wasted_tokens``. A request whose length limit ends it in step i is set aside
(``RequestQueues.set_aside_finishing``) and left out of step i+1, so only ``<eos>`` costs a
token: ``skip_finishing_decode``, on by default because SGLang 0.5.23's overlapped loop
always does it (``event_loop_overlap`` sets ``enable_skip_finishing_decode``); ``False``
shows the late stop check in full. The device thread, its CUDA stream and the future map
are the runner's (``minisrv.runner.device``): the engine builds that ``DeviceWorker`` and
hands it to the loop, which sees it as the contract's ``StepWorker``. The loop talks to
the scheduler's parts by their public calls (``queues``, ``recorder``, ``completer``,
``memory``), as the blocking loop does, never to its private state.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from minisrv.core import Batch, BatchResult, Pending, StepWorker
from minisrv.request import ABORTED, FINISHED, Req
from minisrv.scheduler.loop import Scheduler
from minisrv.scheduler.records import StepRecord

__all__ = ["SWITCH_INTERVAL", "FutureStep", "InFlight", "OverlapLoop", "short_switch_interval"]

SWITCH_INTERVAL = 1e-4
"""Seconds between GIL hand-overs while the overlapped loop runs (Python's default: 5 ms)."""


@contextmanager
def short_switch_interval() -> Iterator[None]:
    """Hand the GIL over every ``SWITCH_INTERVAL`` meanwhile: the device thread needs it for
    a moment to start each step, and Python's default (5 ms) is longer than a whole step."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(min(old, SWITCH_INTERVAL))
    try:
        yield
    finally:
        sys.setswitchinterval(old)


@dataclass(frozen=True)
class FutureStep:
    """How one overlapped step used the future map (kept in ``future_trace``).

    Per request of the step, prefills first: ``inputs`` is the last input id the CPU wrote
    for it when the step was formed (negative: a future id, the previous step's token not
    yet sampled), ``futures`` the placeholder its new token got, ``tokens`` what the device
    sampled. ``discarded``: requests found finished after the previous step, whose token
    here is thrown away (the late stop check).
    """

    index: int
    rids: tuple[int, ...]
    inputs: tuple[int, ...]
    futures: tuple[int, ...]
    tokens: tuple[int, ...]
    discarded: tuple[int, ...]


@dataclass
class InFlight:
    """A step handed to the device: its batch, where its tokens go, and its answer."""

    batch: Batch
    positions: list[int]  # per sampling entry: the index of its placeholder in req.output
    before: dict[str, Any]  # trace fields known when the step was formed
    result: Pending
    inputs: tuple[int, ...] = ()  # per sampling entry: its last input id when formed
    futures: tuple[int, ...] = ()  # per sampling entry: the placeholder its new token got


class OverlapLoop:
    """Drives ``scheduler`` so its CPU work for step i+1 overlaps the device's step i.

    Outputs equal the blocking loop's; ``Engine(..., overlap=True)`` builds one, with the
    runner's device thread as its ``worker`` (``minisrv.engine.overlap_loop``).
    """

    def __init__(self, scheduler: Scheduler, worker: StepWorker) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.inflight: InFlight | None = None
        self._release_later: list[Req] = []  # finished, but read by the step in flight
        self.future_trace: list[FutureStep] = []  # one per step when config.record_trace

    @property
    def idle(self) -> bool:
        """True when nothing is pending, waiting, running or in flight."""
        return self.scheduler.idle and self.inflight is None

    def run(self, progress: bool = False) -> None:
        """Step until every request has finished, with a short GIL switch interval."""
        with short_switch_interval():
            while self.step() is not None:
                pass

    def step(self) -> StepRecord | None:
        """Launch the next step, then complete the previous one; its record (``None``: done)."""
        sched = self.scheduler
        while True:
            if sched.config.skip_finishing_decode:
                sched.queues.set_aside_finishing()
            batch = sched.form(device_busy=self.inflight is not None)
            previous, self.inflight = self.inflight, self.launch(batch) if batch else None
            if previous is not None:
                return self.complete(previous, stream=True)
            if batch is None:
                return None

    def launch(self, batch: Batch) -> InFlight:
        """Copy the batch's inputs, start the device, give each request its placeholder."""
        sched = self.scheduler
        before = sched.recorder.trace_fields(batch)
        reqs = batch.sampling  # a prefill chunk's entry gets no token, so no placeholder
        inputs = tuple(req.output[-1] if req.output else req.prompt[-1]
                       for req in reqs) if sched.config.record_trace else ()
        # the host tier's copies on the device thread: after the step in flight (which may
        # still write a slot freed since) and before this one, which reads them
        sched.memory.transfer(self.worker.call)
        result, futures = self.worker.submit(batch)
        positions = [len(req.output) for req in reqs]  # where each placeholder goes
        for req, fid in zip(reqs, futures, strict=True):
            req.output.append(fid)
        return InFlight(batch, positions, before, result, inputs, tuple(futures))

    def complete(self, step: InFlight, stream: bool) -> StepRecord:
        """Wait for ``step``; put its tokens in place, finish, record, then stream."""
        sched, batch = self.scheduler, step.batch
        result = self._wait(step)
        sched.memory.completed()  # the table rows only it read may be reused
        sched.recorder.advance(step.before, result)  # the device's steps follow each other
        for req in self._release_later:  # the step that still read them is done
            sched.backend.release(req)
        self._release_later.clear()
        finished, late, streamed, extra = self._apply(step, result)
        # the backend's state of a finished request outlives finish: the step in flight
        # still samples with a late one's, and streaming reads the others' logprobs
        sched.completer.finish(batch.prefill, finished, late, release=False)
        self._release_later.extend(req for req in finished if id(req) in late)
        record = sched.recorder.record(batch, step.before, result, finished, extra)
        if sched.config.record_trace:
            self.future_trace.append(self._future_step(record.index, step, result, finished))
        on_token = sched.completer.on_token
        try:  # streaming last: a raising callback finds the state consistent
            if stream and on_token is not None:
                for req, token in streamed:
                    on_token(req, token)
        finally:
            for req in finished:
                if id(req) not in late:
                    sched.backend.release(req)
        return record

    def drain(self) -> StepRecord | None:
        """Wait for the step in flight and complete it without streaming (before an abort)."""
        previous, self.inflight = self.inflight, None
        return self.complete(previous, stream=False) if previous is not None else None

    def abort(self, reqs: Iterable[Req]) -> None:
        """Drain the step in flight first, so no request is freed while the device uses it."""
        reqs = list(reqs)
        try:
            self.drain()
        finally:
            self.scheduler.abort(reqs)

    # ----------------------------------------------------------------- helpers
    def _wait(self, step: InFlight) -> BatchResult:
        """``step``'s answer; after a device error no request keeps a placeholder."""
        try:
            result = self.worker.result(step.result)
        except BaseException:
            self._drop_placeholders(step)
            self._abandon_later_step(step)
            self.scheduler.memory.settle()  # no step runs any more
            raise
        self.scheduler.completer.check_size(step.batch, result)
        return result

    def _apply(self, step: InFlight, result: BatchResult
               ) -> tuple[list[Req], frozenset[int], list[tuple[Req, int]], int]:
        """The late stop check: (finished, ids of those the step in flight computes once
        more, (req, token) to stream, tokens of requests that had finished already)."""
        accept = self.scheduler.completer.accept
        finished: list[Req] = []
        late: set[int] = set()
        streamed: list[tuple[Req, int]] = []
        stream = streamed.append if self.scheduler.completer.on_token is not None else None
        extra = 0
        batch, sampling = step.batch, step.batch.sampling
        sampled = (result.tokens if len(sampling) == len(batch)  # no chunk in the step
                   else [t for e, t in zip(batch.entries, result.tokens) if e.sample])
        for req, pos, tokens in zip(sampling, step.positions, sampled, strict=True):
            if (state := req.state) is FINISHED or state is ABORTED:
                extra += len(tokens)  # it finished in the step before: discarded
                continue
            stop = accept(req, tokens[0], pos)  # over its placeholder
            if stream is not None:
                stream((req, tokens[0]))
            if stop is None:
                continue
            finished.append(req)
            if len(req.output) > pos + 1 and req.state is not FINISHED:
                late.add(id(req))
        return finished, frozenset(late), streamed, extra

    def _future_step(self, index: int, step: InFlight, result: BatchResult,
                     finished: list[Req]) -> FutureStep:
        """The future map's part in ``step``: inputs, placeholders, tokens, discards."""
        reqs = step.batch.sampling
        now_done = {id(req) for req in finished}
        discarded = tuple(req.rid for req in reqs if req.state in (FINISHED, ABORTED)
                          and id(req) not in now_done)
        return FutureStep(index, tuple(req.rid for req in reqs), step.inputs, step.futures,
                          tuple(result.next_tokens), discarded)

    def _abandon_later_step(self, failed: InFlight) -> None:
        """After ``failed`` raised: the step launched after it read its futures, so its
        tokens mean nothing. Wait for it to end (its error, if any, is dropped), then remove
        its placeholders too."""
        later, self.inflight = self.inflight, None
        if later is None or later is failed:
            return
        later.result.exception()  # waits for the device thread; raises nothing
        self._drop_placeholders(later)

    def _drop_placeholders(self, step: InFlight) -> None:
        """After a device error: no request keeps a placeholder for the failed step."""
        for req, pos in zip(step.batch.sampling, step.positions, strict=True):
            if pos < len(req.output) and req.output[pos] < 0:
                del req.output[pos:]
