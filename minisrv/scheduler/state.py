"""The scheduler's state: its queues, KV memory, admission rule and clock, and the calls
that change them outside the step (submission, abort) or check them (integrity).

``SchedulerState`` is the half of ``Scheduler`` that is not the step path (``loop.py``):
requests enter through ``check``/``submit``, leave through ``abort`` or the step's finish
path, and every step ends in ``record``.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from minisrv.kv import PrefixCache, SlotAllocator
from minisrv.kv.host import make_host_pool
from minisrv.kv.manager import KVManager
from minisrv.kv.table import ReqToTokenTable, table_rows
from minisrv.request import Req, ReqState
from minisrv.scheduler.admission import make_admission
from minisrv.scheduler.capabilities import needs, require
from minisrv.scheduler.chunked import ChunkedPrefill
from minisrv.scheduler.config import ConfigView, EngineConfig
from minisrv.scheduler.records import Backend, Batch, BatchResult, SchedulerStats, StepRecord
from minisrv.scheduler.wide import WideDecode, make_wide

__all__ = ["SchedulerState"]


class SchedulerState(ConfigView):
    """Queues (pending, waiting, running), KV memory, admission, clock, trace and totals.

    ``SchedulerState(backend, config)`` or ``(backend, **options)`` with the options of
    ``EngineConfig``. Every running request holds real slots of a ``SlotAllocator`` (the
    backend's KV pool when it has one), one per token whose K/V exist; with
    ``cache="radix"`` its first ``cached_len`` slots are shared prefix slots owned by the tree.
    """

    def __init__(self, backend: Backend, config: EngineConfig | None = None, **options: Any):
        self.config = config = EngineConfig.from_options(config, **options)
        require(backend, needs(config))  # once: the step path asks the backend nothing more
        self.backend = backend
        pool = backend.attach_kv(config.kv_capacity)
        allocator = pool or SlotAllocator(config.kv_capacity)
        # A backend with a pool reads it through the request-to-token table (kv/table.py),
        # as wide as the longest context fits: the pool's padding slot (the one past its
        # last) fills what nobody wrote. Without a pool there is nothing to index.
        table = None if pool is None else ReqToTokenTable(
            table_rows(config.max_running, config.overlap),
            min(backend.max_context or config.kv_capacity, config.kv_capacity),
            scratch_slot=pool.capacity)
        backend.attach_table(table)
        self.memory = KVManager(allocator, config.cache, make_host_pool(config, backend),
                                config.host_cache_policy, table)
        self.admission = make_admission(config)
        # speculative checks or jump-forward's entries: decodes of several tokens
        self.wide: WideDecode | None = make_wide(config, backend)
        self.clock = 0.0
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        # Running requests whose last token is being computed (the overlapped loop with
        # skip_finishing_decode): they keep their KV until it arrives, but no seat.
        self.finishing: list[Req] = []
        # Chunked prefill: the one request mid-prefill (SGLang's chunked_req). It holds a seat
        # and the KV slots of its whole prompt but is not in ``running`` until its last chunk.
        self.chunks = ChunkedPrefill()
        self.trace: list[StepRecord] = []
        self.stats = SchedulerStats()
        self.on_token: Callable[[Req, int], None] | None = None  # streaming hook
        self._pending: list[tuple[float, int, Req]] = []  # heap of future arrivals
        self._order = itertools.count()  # FCFS tie-break for equal arrival times
        self._rng = random.Random(config.seed)  # the random policy's draws, round after round

    # ----------------------------------------------------------------- views
    @property
    def kv(self) -> SlotAllocator:
        """The slot allocator (the backend's KV pool when it has one)."""
        return self.memory.kv

    @property
    def tree(self) -> PrefixCache:
        """The prefix cache (``RadixCache``, or ``NoCache`` for ``cache="none"``)."""
        return self.memory.tree

    @property
    def chunked(self) -> Req | None:
        """The request mid-prefill under chunked prefill (``None``: none)."""
        return self.chunks.req

    @property
    def kv_reserved(self) -> int:
        """KV tokens promised to the running requests (prompt + ``max_new_tokens`` each)."""
        return self.admission.reserved

    @property
    def new_token_ratio(self) -> float:
        """The admission estimate in force (1.0 under ``admission="reserve"``)."""
        return self.admission.ratio

    @property
    def idle(self) -> bool:
        """True when nothing is pending, waiting or running."""
        return not (self._pending or self.waiting or self.running or self.finishing
                    or self.chunked)

    @property
    def pending(self) -> int:
        """Requests submitted whose arrival time has not come yet."""
        return len(self._pending)

    # ----------------------------------------------------------------- submission
    def check(self, req: Req) -> None:
        """Raise ValueError if ``req`` could never be served; change nothing.

        Checked at submission rather than at admission: a request that can never fit would
        otherwise sit at the head of the FCFS queue forever and block everyone behind it.
        """
        if not req.prompt:
            raise ValueError(f"request {req.rid}: the prompt is empty (it needs at least <bos>)")
        if not req.arrival >= 0:  # also rejects NaN
            raise ValueError(f"request {req.rid}: arrival must be >= 0, got {req.arrival}")
        if req.params.processed and self.config.overlap:
            raise ValueError(f"request {req.rid}: penalties, logit_bias and min_tokens read the "
                             "tokens so far, which the overlapped loop forms the next step "
                             "without; use overlap=False")
        limit = self.backend.max_context
        if limit is not None and req.kv_reservation > limit:
            raise ValueError(
                f"request {req.rid}: prompt of {req.prompt_len} tokens + max_new_tokens "
                f"{req.max_new_tokens} exceeds the model context of {limit} tokens"
            )
        vocab = self.backend.vocab_size
        if vocab is not None and not 0 <= min(req.prompt) <= max(req.prompt) < vocab:
            raise ValueError(
                f"request {req.rid}: prompt holds token ids outside the vocabulary (0..{vocab - 1})"
            )
        if req.kv_reservation > self.kv_capacity:
            raise ValueError(
                f"request {req.rid} needs {req.prompt_len} prompt + {req.max_new_tokens} new "
                f"= {req.kv_reservation} KV tokens but kv_capacity is {self.kv_capacity}: "
                "it could never be admitted"
            )

    def submit(self, req: Req) -> None:
        """Queue ``req`` to arrive at ``req.arrival`` on the scheduler's clock."""
        self.check(req)
        self.enqueue(req)

    def enqueue(self, req: Req) -> None:
        """``submit`` without ``check``, for a caller that already checked ``req`` (a cluster
        checks each request once, up front; a second scan of every prompt costs real time)."""
        req.state = ReqState.PENDING
        heapq.heappush(self._pending, (req.arrival, next(self._order), req))

    def receive_arrivals(self) -> list[Req]:
        """Move every request whose arrival time has come into the waiting queue (FCFS)."""
        arrived = []
        while self._pending and self._pending[0][0] <= self.clock:
            req = heapq.heappop(self._pending)[2]
            req.state = ReqState.WAITING
            self.waiting.append(req)
            arrived.append(req)
        return arrived

    # ----------------------------------------------------------------- records
    def record(self, batch: Batch, before: dict[str, Any], result: BatchResult,
               finished: list[Req], extra: int = 0) -> StepRecord:
        """Count a completed step, keep its trace line, check the books (``debug``).

        ``extra``: tokens computed for requests that had finished in the step before (the
        overlapped loop's late stop check), wasted.
        """
        stats = self.stats
        stats.count_step(batch, result, before["prefill_tokens"])
        if self.wide is not None:  # the checks' guesses and kept ones, into the trace too
            self.wide.count(batch, result, stats, before)
        stats.generated_tokens -= extra
        stats.wasted_tokens += extra
        stats.late_stop_tokens += extra
        record = StepRecord(index=stats.steps - 1, end=self.clock,
                            finished=tuple(req.rid for req in finished),
                            queued=len(self.waiting), cost=result.cost, jumped=result.jumped,
                            **before)
        if self.config.record_trace:
            self.trace.append(record)
        if self.config.debug:
            self.check_integrity()
        return record

    def trace_fields(self, batch: Batch) -> dict[str, Any]:
        """The trace fields known before the backend runs the step (both loops' launch)."""
        computing = {id(req) for req in batch.reqs}
        return {
            "start": self.clock,
            "prefill": tuple(req.rid for req in batch.prefill),
            "decode": tuple(req.rid for req in batch.decode),
            "paused": tuple(r.rid for r in (*self.finishing, *self.running)
                            if id(r) not in computing),
            "kv_reserved": self.kv_reserved,
            "kv_used": self.kv.used_count,
            "new_token_ratio": self.new_token_ratio,
            "retracted": tuple(req.rid for req in batch.retracted),
            "prefill_tokens": batch.prefill_tokens,
        }

    # ----------------------------------------------------------------- cleanup
    def abort(self, reqs: Iterable[Req]) -> None:
        """Withdraw ``reqs`` wherever they are (pending, waiting or running) and free them.

        Used when a caller gives up (for example its streaming callback raised), so the
        scheduler is left consistent and serves the next call normally.
        """
        self.running, self.finishing = [*self.finishing, *self.running], []
        done = (ReqState.FINISHED, ReqState.ABORTED)
        doomed = [req for req in reqs if req.state not in done]
        if not doomed:
            return
        ids = {id(req) for req in doomed}
        self._pending = [item for item in self._pending if id(item[2]) not in ids]
        heapq.heapify(self._pending)
        self.waiting = deque(req for req in self.waiting if id(req) not in ids)
        for req in doomed:
            if req.state == ReqState.RUNNING:
                self.memory.release(req)
                self._leave(req, ReqState.ABORTED)
            else:
                req.state = ReqState.ABORTED
                if req.retractions:  # retracted while running: may still hold a generator
                    self.backend.release(req)
        self.running = [req for req in self.running if req.state == ReqState.RUNNING]
        for req in doomed:
            self.chunks.drop(req)

    def requeue(self, reqs: Iterable[Req]) -> None:
        """Retract running ``reqs`` at once: their KV freed, their output and generator kept,
        back to the head of the queue in the order given (the server's recovery after a
        failed step: they re-prefill prompt and output and go on with the same tokens)."""
        back = [req for req in reqs if req.state == ReqState.RUNNING]
        if not back:
            return
        ids = {id(req) for req in back}
        self.running, self.finishing = [*self.finishing, *self.running], []
        self.running = [req for req in self.running if id(req) not in ids]
        for req in back:
            self.chunks.drop(req)
            self.retract(req)
        self.waiting.extendleft(reversed(back))

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if KV memory or the request queues are inconsistent.

        Slots held by requests + slots owned by the tree + free slots == capacity; the
        tree's sizes add up; every lock belongs to a running request (``KVManager``); and
        no request is in two places or lost between the queues.
        """
        running = [*self.finishing, *self.running, *([self.chunked] if self.chunked else [])]
        self.memory.check_integrity(running)
        places = [*(item[2] for item in self._pending), *self.waiting, *running]
        assert len({id(r) for r in places}) == len(places), "a request is queued twice"
        assert all(r.state == ReqState.RUNNING for r in running), "non-running in batch"
        assert all(not r.kv_slots for r in self.waiting), "a waiting request holds KV slots"
        assert len(running) <= self.max_running, "running batch over max_running"
        if self.chunked is not None:
            req = self.chunked
            assert len(req.kv_slots) == req.seq_len, "a chunked request lacks its prompt's KV"
            assert req.cached_len <= self.chunks.pos < req.seq_len, "chunk position off"

    def retract(self, req: Req) -> None:
        """Free ``req``'s KV and mark it waiting; it keeps its output (and its generator)."""
        self.stats.retractions += 1
        self.stats.wasted_tokens += self.memory.release(req)
        self.admission.released(req)
        if self.wide is not None:
            self.wide.release(req)
        req.retractions += 1
        req.state = ReqState.WAITING

    def _leave(self, req: Req, state: ReqState, release: bool = True) -> None:
        """A running request ends (its KV already handed over or freed); ``release=False``
        keeps the backend's state of it (a step in flight still samples with it)."""
        self.admission.released(req)
        req.state = state
        if release:
            self.backend.release(req)
        if self.wide is not None:
            self.wide.release(req)

