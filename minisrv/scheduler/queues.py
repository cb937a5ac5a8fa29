"""Where the scheduler's requests are: pending, waiting, running, finishing, mid-prefill.

A request is in exactly one place at a time (``check_integrity`` asserts it). The places
are a part of their own, with no behaviour of the step in them, because every other part
reads them: forming a batch admits from ``waiting`` into ``running``, completing it removes
the finished, the records count them, an abort searches them all. Moving a request between
places together with its resources (KV, admission, backend state) is ``lifecycle.py``'s.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable

from minisrv.kv.manager import KVManager
from minisrv.request import Req, ReqState
from minisrv.scheduler.chunked import ChunkedPrefill

__all__ = ["RequestQueues"]


class RequestQueues:
    """The places of the requests: ``pending`` (a heap of future arrivals), ``waiting``
    (arrived, FCFS or policy order), ``running`` (holding KV and a seat), ``finishing``
    (the overlapped loop's requests whose last token is being computed: KV, no seat) and
    ``chunks.req`` (the one request mid-prefill under chunked prefill: a seat and its
    prompt's KV, in ``running`` only from its last chunk)."""

    def __init__(self) -> None:
        self._pending: list[tuple[float, int, Req]] = []  # heap of future arrivals
        self._order = itertools.count()  # FCFS tie-break for equal arrival times
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.finishing: list[Req] = []
        self.chunks = ChunkedPrefill()
        # prefill tokens scheduled so far (SGLang's ``processed_tokens_counter``): each
        # arrival notes it, and HRRN counts a request's wait in tokens from there
        self.prefilled = 0

    @property
    def chunked(self) -> Req | None:
        """The request mid-prefill under chunked prefill (``None``: none)."""
        return self.chunks.req

    @property
    def pending(self) -> int:
        """Requests submitted whose arrival time has not come yet."""
        return len(self._pending)

    @property
    def next_arrival(self) -> float | None:
        """The arrival time of the next pending request (``None``: none pending)."""
        return self._pending[0][0] if self._pending else None

    @property
    def idle(self) -> bool:
        """True when nothing is pending, waiting or running."""
        return not (self._pending or self.waiting or self.running or self.finishing
                    or self.chunked)

    def held(self) -> list[Req]:
        """Every request that holds KV: finishing, running and the one mid-prefill."""
        return [*self.finishing, *self.running, *([self.chunked] if self.chunked else [])]

    def enqueue(self, req: Req) -> None:
        """``req`` is pending until its arrival time."""
        req.state = ReqState.PENDING
        heapq.heappush(self._pending, (req.arrival, next(self._order), req))

    def receive_arrivals(self, clock: float) -> list[Req]:
        """Move every request whose arrival time has come by ``clock`` into ``waiting``."""
        arrived = []
        while self._pending and self._pending[0][0] <= clock:
            req = heapq.heappop(self._pending)[2]
            req.state = ReqState.WAITING
            req.arrival_prefilled = self.prefilled
            self.waiting.append(req)
            arrived.append(req)
        return arrived

    def withdraw(self, reqs: Iterable[Req]) -> None:
        """Take ``reqs`` out of ``pending`` and ``waiting`` (an abort: the running ones
        leave through ``Lifecycle``)."""
        ids = {id(req) for req in reqs}
        self._pending = [item for item in self._pending if id(item[2]) not in ids]
        heapq.heapify(self._pending)
        self.waiting = deque(req for req in self.waiting if id(req) not in ids)

    def seat_finishing(self) -> None:
        """Give the finishing requests their seats back (before an abort or a requeue)."""
        self.running, self.finishing = [*self.finishing, *self.running], []

    def drop_left(self) -> None:
        """Forget the running and finishing requests that are no longer running."""
        self.running = [req for req in self.running if req.state == ReqState.RUNNING]
        self.finishing = [req for req in self.finishing if req.state == ReqState.RUNNING]

    def set_aside_finishing(self) -> None:
        """Move the running requests whose pending token is their last to ``finishing``: they
        decode no more and their seats are free for admission, while their KV stays counted
        until that token arrives (the overlapped loop's ``skip_finishing_decode``)."""
        finishing: list[Req] = []
        staying: list[Req] = []
        for req in (*self.finishing, *self.running):
            if req.state is ReqState.RUNNING:
                last = req.remaining_new_tokens <= 0  # the length rule, as Req keeps it
                (finishing if last else staying).append(req)
        self.finishing, self.running = finishing, staying

    def check_integrity(self, memory: KVManager, max_running: int) -> None:
        """Raise ``AssertionError`` if KV memory or the places are inconsistent: the
        ``KVManager``'s books over the requests holding KV, no request in two places or
        lost between them, no waiting request with KV, at most ``max_running`` seated."""
        held = self.held()
        memory.check_integrity(held)
        places = [*(item[2] for item in self._pending), *self.waiting, *held]
        assert len({id(r) for r in places}) == len(places), "a request is queued twice"
        assert all(r.state == ReqState.RUNNING for r in held), "non-running in batch"
        assert all(not r.kv_len for r in self.waiting), "a waiting request holds KV slots"
        assert len(held) <= max_running, "running batch over max_running"
        if (req := self.chunked) is not None:
            assert req.kv_len == req.seq_len, "a chunked request lacks its prompt's KV"
            assert req.cached_len <= self.chunks.pos < req.seq_len, "chunk position off"
