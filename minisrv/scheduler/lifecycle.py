"""A request's moves between the scheduler's places, with the resources each move frees.

A request is admitted (``start``: its slots already allocated), may be retracted back to the
queue (``retract``: KV freed, output and generator kept), and leaves once (``leave``:
finished or aborted). Each move tells the parts that keep something per request (the
``KVManager``, the ``AdmissionRule``'s reservation, a ``WideDecode``'s drafts, the
backend's generator), so forming a batch, completing one and the calls from outside the
step (``abort``, ``requeue``) free the same things the same way.
"""

from __future__ import annotations

from collections.abc import Iterable

from minisrv.core import Backend
from minisrv.kv.manager import KVManager
from minisrv.request import Req, ReqState
from minisrv.scheduler.admission import AdmissionRule
from minisrv.scheduler.queues import RequestQueues
from minisrv.scheduler.recorder import StepRecorder
from minisrv.scheduler.wide import WideDecode

__all__ = ["Lifecycle"]


class Lifecycle:
    """Admission's bookkeeping, retraction, leaving; ``abort`` and ``requeue`` over them."""

    def __init__(self, queues: RequestQueues, memory: KVManager, admission: AdmissionRule,
                 wide: WideDecode | None, backend: Backend, recorder: StepRecorder) -> None:
        self.queues, self.memory, self.admission, self.wide = queues, memory, admission, wide
        self.backend, self.recorder = backend, recorder

    def start(self, req: Req) -> None:
        """Bookkeeping of an admitted request (its slots are already allocated)."""
        stats, cached = self.recorder.stats, req.cached_len  # the match + the host tier's
        if not req.output:  # a first admission (a retracted request has output)
            req.cached_prompt_tokens = cached
            stats.prompt_tokens += len(req.prompt)
            stats.cached_prompt_tokens += cached
        stats.cached_tokens += cached
        req.state = ReqState.RUNNING
        if req.admitted_at is None:  # the first admission: queueing delay ends here
            req.admitted_at = self.recorder.clock

    def retract(self, req: Req) -> None:
        """Free ``req``'s KV and mark it waiting; it keeps its output (and its generator)."""
        stats = self.recorder.stats
        stats.retractions += 1
        stats.wasted_tokens += self.memory.release(req)
        self.admission.released(req)
        if self.wide is not None:
            self.wide.release(req)
        req.retractions += 1
        req.state = ReqState.WAITING

    def leave(self, req: Req, state: ReqState, release: bool = True) -> None:
        """A running request ends (its KV already handed over or freed); ``release=False``
        keeps the backend's state of it (a step in flight still samples with it)."""
        self.admission.released(req)
        req.state = state
        if release:
            self.backend.release(req)
        if self.wide is not None:
            self.wide.release(req)

    def abort(self, reqs: Iterable[Req]) -> None:
        """Withdraw ``reqs`` wherever they are (pending, waiting or running) and free them.

        Used when a caller gives up (for example its streaming callback raised), so the
        scheduler is left consistent and serves the next call normally.
        """
        queues = self.queues
        queues.seat_finishing()
        done = (ReqState.FINISHED, ReqState.ABORTED)
        doomed = [req for req in reqs if req.state not in done]
        if not doomed:
            return
        queues.withdraw(doomed)
        for req in doomed:
            if req.state == ReqState.RUNNING:
                self.memory.release(req)
                self.leave(req, ReqState.ABORTED)
            else:
                req.state = ReqState.ABORTED
                if req.retractions:  # retracted while running: may still hold a generator
                    self.backend.release(req)
        queues.running = [req for req in queues.running if req.state == ReqState.RUNNING]
        for req in doomed:
            queues.chunks.drop(req)

    def requeue(self, reqs: Iterable[Req]) -> None:
        """Retract running ``reqs`` at once: their KV freed, their output and generator kept,
        back to the head of the queue in the order given (the server's recovery after a
        failed step: they re-prefill prompt and output and go on with the same tokens)."""
        back = [req for req in reqs if req.state == ReqState.RUNNING]
        if not back:
            return
        queues, ids = self.queues, {id(req) for req in back}
        queues.seat_finishing()
        queues.running = [req for req in queues.running if id(req) not in ids]
        for req in back:
            queues.chunks.drop(req)
            self.retract(req)
        queues.waiting.extendleft(reversed(back))
