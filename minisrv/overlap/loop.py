"""The overlapped loop: the CPU forms step i+1 while the device computes step i.

``OverlapScheduler`` is the ``Scheduler`` with a different ``step``. Each call

1. forms the next batch on the main thread (``get_next_batch_to_run``, unchanged), while
   the previous step may still be computing; every request of that step already carries a
   *future id* (a negative placeholder, ``FutureMap``) in place of the token it is about
   to get, so lengths, KV slots and admission see exactly what the blocking loop sees;
2. copies the batch's inputs out of the requests (``backend.prepare``) and hands the step
   to the device thread; there ``FutureMap.resolve`` swaps each future id for the token
   the previous step sampled (one ``torch.where``), and the new tokens are stored for the
   step after (``FutureMap.store``);
3. only then waits for the previous step and processes its result: tokens replace their
   placeholders, stops are checked, the finished leave, tokens are streamed.

The stop check is therefore one step late: a request that finished in step i was still
running when step i+1 was formed, so (if step i+1 decodes it) it computes one extra token,
which is discarded and counted in ``stats.wasted_tokens``. With
``skip_finishing_decode=True`` a request whose length limit ends it in step i is left out of
step i+1 (its length is known before its token), so only ``<eos>`` costs a token.

On the CPU the device thread is a worker thread (torch releases the GIL in its kernels).
On a GPU the same thread issues each step's kernels on its own CUDA stream, so the main
thread's (and any other thread's) work on the default stream never waits behind a step, nor
a step behind it. Steps run one after the other in that thread and on that stream, which is
what makes reusing a slot freed by step i safe in step i+1. A device that ends its steps on
its own (a backend with ``wait(result)``: ``TimedBackend``) needs no thread: each step is
handed to it on the main thread, and ``wait`` is called before its result is used.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from minisrv.request import ABORTED, FINISHED, RUNNING, Req, ReqState
from minisrv.runner.futures import FutureMap
from minisrv.scheduler import Backend, Batch, BatchResult, EngineConfig, Scheduler, StepRecord

__all__ = ["SWITCH_INTERVAL", "FutureStep", "OverlapScheduler"]

SWITCH_INTERVAL = 1e-4
"""Seconds between GIL hand-overs while the overlapped loop runs (Python's default: 5 ms)."""


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
class _InFlight:
    """A step handed to the device: its batch, where its tokens go, and its answer."""

    batch: Batch
    positions: list[int]  # per request: the index of its placeholder in req.output
    before: dict[str, Any]  # trace fields known when the step was formed
    result: Future[BatchResult] | _Ready
    inputs: tuple[int, ...] = ()  # per request: its last input id when formed
    futures: tuple[int, ...] = ()  # per request: the placeholder its new token got


class OverlapScheduler(Scheduler):
    """``Scheduler`` whose CPU work for step i+1 overlaps the device's step i.

    The backend must split ``run`` into ``prepare(batch)`` (main thread: copy the inputs)
    and ``compute(prepared, resolve, store)`` (device thread), as ``ModelBackend``,
    ``SimBackend`` and ``TimedBackend`` do. Outputs equal the blocking loop's.
    """

    def __init__(self, backend: Backend, config: EngineConfig | None = None, **options: Any):
        super().__init__(backend, config, **options)
        if not (callable(getattr(backend, "prepare", None))
                and callable(getattr(backend, "compute", None))):
            raise ValueError(
                f"overlap=True needs a backend with prepare() and compute() (ModelBackend, "
                f"SimBackend, TimedBackend), got {type(backend).__name__}"
            )
        # Futures are resolved one step after they are handed out: two batches suffice.
        self.futures = FutureMap(4 * self.config.max_running)
        # A device that ends its steps on its own (``TimedBackend``, as a GPU does) is only
        # handed each step and waited for; a synchronous one (torch on the CPU) gets a thread.
        self._wait = getattr(backend, "wait", None)
        self._device = None if self._wait is not None else ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="minisrv-device")
        self._stream = _step_stream(backend)
        self._inflight: _InFlight | None = None
        self._release_later: list[Req] = []  # finished, but read by the step in flight
        # Running, and the step in flight gives their last token (in front of self.running);
        # None: not sorted out yet for the step being formed.
        self._ending: list[Req] | None = None
        self.future_trace: list[FutureStep] = []  # one per step when config.record_trace

    @property
    def idle(self) -> bool:
        return super().idle and self._inflight is None

    # ----------------------------------------------------------------- the loop
    def run(self, progress: bool = False) -> None:
        """Step until every request has finished, with a short GIL switch interval.

        The device thread needs the GIL for a moment to start each step; by default Python
        hands it over only every 5 ms, longer than a whole step, which would serialise the
        two threads again. For the duration of the run the interval is ``SWITCH_INTERVAL``.
        """
        old = sys.getswitchinterval()
        sys.setswitchinterval(min(old, SWITCH_INTERVAL))
        try:
            super().run(progress)
        finally:
            sys.setswitchinterval(old)

    def step(self) -> StepRecord | None:
        """Launch the next step, then finish the previous one; its record (``None``: done)."""
        while True:
            batch = self._form()
            prev = self._inflight
            self._inflight = self._launch(batch) if batch else None
            if prev is not None:
                return self._complete(prev, stream=True)
            if not batch:
                return None

    def drain(self) -> StepRecord | None:
        """Wait for the step in flight and process it without streaming (before an abort)."""
        prev, self._inflight = self._inflight, None
        return self._complete(prev, stream=False) if prev is not None else None

    def abort(self, reqs: Any) -> None:
        """Drain the step in flight first, so no request is freed while the device uses it."""
        reqs = list(reqs)
        try:
            self.drain()
        finally:
            super().abort(reqs)
            self._ending = None  # running has changed: sort it out again

    def prepare_decode(self) -> tuple[list[Req], tuple[Req, ...]]:
        """As the blocking loop; with ``skip_finishing_decode``, requests whose pending token
        is their last sit the step out (they finish when that token arrives)."""
        with self._ending_set_aside():
            return super().prepare_decode()

    def admit(self) -> list[Req]:
        """As the blocking loop; with ``skip_finishing_decode``, the seats of requests that sit
        the step out are free for newcomers.

        Those requests finish when the step in flight returns, before the step being formed
        runs, so the batch never exceeds ``max_running``. Their KV slots stay counted as used
        until then (memory is not promised twice); only their seats are given away, which
        keeps the overlapped loop from running a step with empty seats after every finish.
        """
        with self._ending_set_aside():
            return super().admit()

    @contextmanager
    def _ending_set_aside(self) -> Iterator[None]:
        """With ``skip_finishing_decode``: for the duration, ``self.running`` holds only the
        requests whose pending token is not their last. ``_put_ending_first`` put the others
        (``_ending``) first, so they are a slice away; afterwards they are back in front,
        requests the body retracted stay out, and admitted ones join."""
        ending = self._ending
        if not ending:
            yield
            return
        self.running = self.running[len(ending):]
        try:
            yield
        finally:
            self.running = ending + self.running

    # ----------------------------------------------------------------- helpers
    def _form(self) -> Batch:
        """The next batch; the clock jumps to the next arrival only when the device is idle."""
        if self.config.skip_finishing_decode and self._ending is None:
            self._put_ending_first()  # the first step, or after an abort (else _apply did)
        try:
            self.receive_arrivals()
            batch = self.get_next_batch_to_run()
            if not batch and self._pending and self._inflight is None:
                self.clock = max(self.clock, self._pending[0][0])
                self.receive_arrivals()
                batch = self.get_next_batch_to_run()
        finally:
            self._ending = None  # the step about to launch changes whose token is the last
        return batch

    def _put_ending_first(self) -> None:
        """Keep in ``running`` only the requests still running, those whose pending token is
        their last in front (``_ending``): one pass over the batch, made where ``_apply``
        has to drop the finished anyway, so that ``_form`` does not pass over it again."""
        ending: list[Req] = []
        staying: list[Req] = []
        for req in self.running:
            if req.state is RUNNING:
                (staying if len(req.output) < req.params.max_new_tokens else ending).append(req)
        self._ending = ending
        self.running = ending + staying

    def _launch(self, batch: Batch) -> _InFlight:
        """Copy the batch's inputs, give each request a placeholder, start the device."""
        before = self._snapshot(batch)
        reqs = batch.reqs
        inputs = tuple(req.output[-1] if req.output else req.prompt[-1]
                       for req in reqs) if self.config.record_trace else ()
        prepared = self.backend.prepare(batch)  # type: ignore[attr-defined]
        future_ids, futures = self.futures.reserve_ids(len(reqs))
        positions = [len(req.output) for req in reqs]  # where each placeholder goes
        for req, fid in zip(reqs, futures, strict=True):
            req.output.append(fid)
        if self._device is None:
            result = _handed_over(self._compute, prepared, future_ids)
        else:
            result = self._device.submit(self._compute, prepared, future_ids)
        return _InFlight(batch, positions, before, result, inputs, tuple(futures))

    def _compute(self, prepared: Any, future_ids: torch.Tensor) -> BatchResult:
        """On the device thread (and its CUDA stream on a GPU): resolve futures, compute,
        store this step's tokens for the next step's futures, all as one step of the device.
        The sampled ids come back to the host, so the step's kernels are done when this
        returns."""

        def store(tokens: list[int]) -> None:
            self.futures.store(future_ids, tokens)

        stream = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        with stream:
            return self.backend.compute(prepared, self.futures.resolve, store)  # type: ignore[attr-defined]

    def _complete(self, step: _InFlight, stream: bool) -> StepRecord:
        """Wait for ``step``; put its tokens in place, stop the finished, stream, record."""
        batch = step.batch
        try:
            result = step.result.result()
            if self._wait is not None:  # a device that ends its steps on its own
                self._wait(result)
        except BaseException:
            self._drop_placeholders(step)
            self._abandon_later_step(step)
            raise
        if len(result.next_tokens) != len(batch):
            raise ValueError(
                f"backend returned {len(result.next_tokens)} tokens for a batch of {len(batch)}"
            )
        step.before["start"] = self.clock  # the device's steps follow each other
        self.clock += result.elapsed
        for req in self._release_later:  # the step that still read them is done
            self.backend.release(req)
        self._release_later.clear()
        finished, streamed, extra = self._apply(step, result.next_tokens)
        self.stats.count_step(batch, result, step.before["prefill_tokens"])
        self.stats.generated_tokens -= extra
        self.stats.wasted_tokens += extra
        self.stats.late_stop_tokens += extra
        record = StepRecord(index=self.stats.steps - 1, end=self.clock,
                            finished=tuple(req.rid for req in finished),
                            queued=len(self.waiting), cost=result.cost, **step.before)
        if self.config.record_trace:
            self.trace.append(record)
            self.future_trace.append(self._future_step(record.index, step, result, finished))
        if self.config.debug:
            self.check_integrity()
        on_token = self.on_token
        if stream and on_token is not None:  # last: a raising callback finds state consistent
            for req, token in streamed:
                on_token(req, token)
        return record

    def _apply(self, step: _InFlight, tokens: list[int]) -> tuple[list[Req], list, int]:
        """The late stop check; returns (finished, (req, token) to stream, extra tokens)."""
        now, stops = self.clock, self.backend.eos_ids
        finished: list[Req] = []
        finished_at: list[tuple[Req, int]] = []  # with the index of its token in req.output
        streamed: list[tuple[Req, int]] = []
        stream = streamed.append if self.on_token is not None else None
        extra = 0
        for req, pos, token in zip(step.batch.reqs, step.positions, tokens, strict=True):
            if (state := req.state) is FINISHED or state is ABORTED:
                extra += 1  # it finished in the step before: this token is discarded
                continue
            req.output[pos] = token
            req.token_times.append(now)
            if stream is not None:
                stream((req, token))
            if token in stops and not req.params.ignore_eos:
                req.finish_reason = "eos"
            elif pos + 1 >= req.params.max_new_tokens:
                req.finish_reason = "length"
            else:
                continue
            finished.append(req)
            finished_at.append((req, pos))
        done = {id(req) for req in finished}
        for req in step.batch.prefill:
            if id(req) not in done and req.state == ReqState.RUNNING:
                self.memory.cache_unfinished(req)
        requeued = False  # a finished request retracted meanwhile sits in the waiting queue
        for req, pos in finished_at:
            requeued |= req.state == ReqState.WAITING
            self._finish(req, in_next_step=len(req.output) > pos + 1)
            self.stats.finished += 1
        if self.config.skip_finishing_decode:  # the next _form's partition, in the same pass
            self._put_ending_first()
        elif finished:
            self.running = [req for req in self.running if req.state is RUNNING]
        if requeued:
            self.waiting = deque(req for req in self.waiting if req.state == ReqState.WAITING)
        self.stats.evicted_tokens = self.memory.evicted_tokens
        return finished, streamed, extra

    def _future_step(self, index: int, step: _InFlight, result: BatchResult,
                     finished: list[Req]) -> FutureStep:
        """The future map's part in ``step``: inputs, placeholders, tokens, discards."""
        reqs = step.batch.reqs
        now_done = {id(req) for req in finished}
        discarded = tuple(req.rid for req in reqs if req.state in (
            ReqState.FINISHED, ReqState.ABORTED) and id(req) not in now_done)
        return FutureStep(index, tuple(req.rid for req in reqs), step.inputs, step.futures,
                          tuple(result.next_tokens), discarded)

    def _finish(self, req: Req, in_next_step: bool) -> None:
        """A request found finished one step late leaves; undo what the next step gave it."""
        if req.state == ReqState.WAITING:  # retracted while its last token was computed
            req.state = ReqState.FINISHED
            self.backend.release(req)
            return
        if in_next_step:  # the step in flight computes one more token for it: drop it
            req.output.pop()
            self.memory.truncate(req, 1)
        self.memory.cache_finished(req)
        self.admission.released(req)
        req.state = ReqState.FINISHED
        if in_next_step:
            self._release_later.append(req)  # the device still samples with its generator
        else:
            self.backend.release(req)

    def _abandon_later_step(self, failed: _InFlight) -> None:
        """After ``failed`` raised: the step launched after it read its futures, so its
        tokens mean nothing. Wait for it to end (its error, if any, is dropped), then remove
        its placeholders too."""
        later, self._inflight = self._inflight, None
        if later is None or later is failed:
            return
        later.result.exception()  # waits for the device thread; raises nothing
        self._drop_placeholders(later)

    def _drop_placeholders(self, step: _InFlight) -> None:
        """After a device error: no request keeps a placeholder for the failed step."""
        for req, pos in zip(step.batch.reqs, step.positions, strict=True):
            if pos < len(req.output) and req.output[pos] < 0:
                del req.output[pos:]


class _Ready:
    """A step the device was handed on the loop's own thread, already answered: its result,
    or the error it raised, given back where the answer is waited for (as a ``Future`` from
    the device thread would, without a ``Future``'s lock and condition)."""

    __slots__ = ("_error", "_value")

    def __init__(self, value: BatchResult | None, error: BaseException | None) -> None:
        self._value, self._error = value, error

    def result(self) -> BatchResult:
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def exception(self) -> BaseException | None:
        return self._error


def _handed_over(compute: Any, *args: Any) -> _Ready:
    """``compute(*args)`` on this thread; an error is raised where the answer is waited for."""
    try:
        return _Ready(compute(*args), None)
    except Exception as exc:  # noqa: BLE001 - re-raised by result()
        return _Ready(None, exc)


def _step_stream(backend: Any) -> torch.cuda.Stream | None:
    """A CUDA stream for the device thread's steps when ``backend`` computes on a GPU.

    The stream first waits for everything queued so far on the default stream (the weights
    and the KV pool may still be being written there). ``None`` on the CPU.
    """
    inner = backend
    while getattr(inner, "inner", None) is not None:  # TimedBackend wraps another backend
        inner = inner.inner
    model = getattr(inner, "model", None)
    device = getattr(model, "device", None)
    if device is None or torch.device(device).type != "cuda":
        return None
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream
