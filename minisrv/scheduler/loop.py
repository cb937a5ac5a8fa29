"""The scheduler: one loop that decides, step by step, which requests the model computes.

Every serving engine in the book is this loop::

    receive_arrivals()                   new requests join the waiting queue
    batch = get_next_batch_to_run()      admit from the queue, pick who computes this step
    result = backend.run(batch)          one forward pass (real model) or its roofline time
    process_batch_result(batch, result)  append tokens, stream them, stop, free the finished

The scheduler never looks at logits or tensors: a *backend* computes the tokens and says
how long the step took. The same code therefore drives CityLM on a laptop and a simulated
H100 serving LLaMA-3-8B. The loop delegates: memory and the prefix cache to ``KVManager``
(``memory.py``), how much may be admitted to an ``AdmissionRule`` (``admission.py``), and
the records it keeps to ``records.py``. Bookkeeping per step touches only the requests in
the batch (plus the ones admitted or arriving), so simulating thousands stays fast.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from minisrv.kv import PrefixCache, SlotAllocator
from minisrv.kv.manager import KVManager
from minisrv.request import Req, ReqState
from minisrv.scheduler.admission import make_admission
from minisrv.scheduler.config import ConfigView, EngineConfig
from minisrv.scheduler.policy import calc_priority, default_in_batch_check
from minisrv.scheduler.records import Backend, Batch, BatchResult, SchedulerStats, StepRecord

__all__ = ["Scheduler"]


class Scheduler(ConfigView):
    """The main loop of an inference server, independent of what computes the tokens.

    ``Scheduler(backend, config)`` or ``Scheduler(backend, **options)`` with the options of
    ``EngineConfig`` (``kv_capacity``, ``max_running``, ``mode``, ``admission``, ``cache``,
    ...). Every running request holds real slots of a ``SlotAllocator`` (the backend's KV
    pool when it has one), one per token whose K/V exist; with ``cache="radix"`` its first
    ``cached_len`` slots are shared prefix slots owned by the tree.
    """

    def __init__(self, backend: Backend, config: EngineConfig | None = None, **options: Any):
        self.config = config = EngineConfig.from_options(config, **options)
        self.backend = backend
        allocator = backend.attach_kv(config.kv_capacity) or SlotAllocator(config.kv_capacity)
        self.memory = KVManager(allocator, config.cache)
        self.admission = make_admission(config)
        self.clock = 0.0
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
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
        return not (self._pending or self.waiting or self.running)

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

    # ----------------------------------------------------------------- the loop
    def step(self) -> StepRecord | None:
        """Run one iteration of the loop; ``None`` once there is nothing left to do.

        When nothing can run but requests are still to arrive, the clock jumps to the next
        arrival instead of spinning through empty steps.
        """
        self.receive_arrivals()
        batch = self.get_next_batch_to_run()
        if not batch and self._pending:
            self.clock = max(self.clock, self._pending[0][0])
            self.receive_arrivals()
            batch = self.get_next_batch_to_run()
        if not batch:
            return None
        before = self._snapshot(batch)
        result = self.backend.run(batch)
        self.clock += result.elapsed
        finished = self.process_batch_result(batch, result)
        self.stats.count_step(batch, result, before["prefill_tokens"])
        record = StepRecord(index=self.stats.steps - 1, end=self.clock,
                            finished=tuple(req.rid for req in finished),
                            queued=len(self.waiting), cost=result.cost, **before)
        if self.config.record_trace:
            self.trace.append(record)
        if self.config.debug:
            self.check_integrity()
        return record

    def run(self, progress: bool = False) -> None:
        """Step until every submitted request has finished.

        ``progress`` shows a tqdm bar counting finished requests (useful for long simulations).
        """
        if not progress:
            while self.step() is not None:
                pass
            return
        from tqdm.auto import tqdm

        total = len(self._pending) + len(self.waiting) + len(self.running)
        with tqdm(total=total, unit="req", desc=f"serving ({self.mode})") as bar:
            while (record := self.step()) is not None:
                bar.update(len(record.finished))

    def receive_arrivals(self) -> list[Req]:
        """Move every request whose arrival time has come into the waiting queue (FCFS)."""
        arrived = []
        while self._pending and self._pending[0][0] <= self.clock:
            req = heapq.heappop(self._pending)[2]
            req.state = ReqState.WAITING
            self.waiting.append(req)
            arrived.append(req)
        return arrived

    def get_next_batch_to_run(self) -> Batch:
        """Choose this step's work according to ``mode``.

        * ``static``: a new batch is admitted only when nothing is running; it then decodes
          until its longest request ends (requests that finish early leave idle slots).
        * ``prefill-first``: if anyone can be admitted, the step prefills only them and the
          running requests wait; otherwise everyone running decodes.
        * ``mixed``: newly admitted requests prefill in the same step as the running ones
          decode.

        Before any step that decodes, every running request gets a slot for its next token
        (``prepare_decode``), retracting requests if the pool is short. A mixed step that
        had to retract admits nobody: the memory it just freed is already spoken for.
        """
        if self.mode == "static" and self.running:
            return Batch.of([], *self.prepare_decode())
        if self.mode == "mixed":
            decoding, retracted = self.prepare_decode() if self.running else ([], ())
            return Batch.of([] if retracted else self.admit(), decoding, retracted)
        new = self.admit()
        if new or not self.running:
            return Batch.of(new, [])
        return Batch.of([], *self.prepare_decode())

    def admit(self) -> list[Req]:
        """Admit waiting requests in queue order while a batch place and KV memory are free.

        Each request first looks up its longest cached prefix (``KVManager.match``, which
        locks it); only the rest is allocated and prefilled. The admission rule decides
        whether its memory need fits what is left this step; when the pool itself is short,
        unlocked cached prefixes are evicted (LRU) before giving up. Admission stops at the
        first request that does not fit (no overtaking), which keeps the queue order fair.
        """
        adder = self.admission.adder(self.running, self.memory, self.max_running)
        if self.waiting and adder.has_place:
            self.prioritize()
        new: list[Req] = []
        while self.waiting and adder.has_place:
            req = self.waiting[0]
            match = self.memory.match(req)
            fill = req.seq_len - match.length
            if not (adder.fits(req, fill) and self.memory.allocate(req, match)):
                self.memory.drop_match(req, match)
                break
            adder.add(req, fill)
            self.waiting.popleft()
            self._start(req, match.length)
            new.append(req)
        self.running.extend(new)
        return new

    def prioritize(self) -> None:
        """Reorder the waiting queue by the policy (``policy.calc_priority``, as SGLang sorts
        its queue each round); FCFS without the in-batch check keeps arrival order."""
        config = self.config
        check = config.in_batch_prefix_check
        if check is None:
            check = default_in_batch_check(config.policy)
        if config.policy == "fcfs" and not check:
            return
        queue = list(self.waiting)
        result = calc_priority(config.policy, self.tree, [[*r.prompt, *r.output] for r in queue],
                               in_batch_prefix_check=check, seed=self._rng,
                               max_new_tokens=[r.max_new_tokens for r in queue])
        self.waiting = deque(queue[i] for i in result.order)

    def prepare_decode(self) -> tuple[list[Req], tuple[Req, ...]]:
        """Give every running request a slot for its next token; retract if there are too few.

        Cached prefixes nobody uses are evicted first. Then retraction frees the request with
        the fewest generated tokens (the least work lost), the longest prompt breaking ties
        (the most memory won). It keeps its output and goes back to the head of the queue;
        on re-admission it prefills prompt plus output and continues exactly where it
        stopped. Returns the requests that decode this step and those retracted.
        """
        retracted: list[Req] = []
        while (short := self.decode_tokens(self.running) - self.memory.free_count) > 0:
            if self.memory.evict(short, "decode"):
                continue
            victim = self.retraction_victim(self.running)
            self.running.remove(victim)
            self.retract(victim)
            retracted.append(victim)
        self.waiting.extendleft(reversed(retracted))
        self.admission.after_decode_prepared(self.running, retracted)
        self.memory.alloc_decode(self.running)
        return list(self.running), tuple(retracted)

    @staticmethod
    def decode_tokens(running: list[Req]) -> int:
        """KV slots the running requests' decodes take this step: one token each."""
        return len(running)

    @staticmethod
    def retraction_victim(running: list[Req]) -> Req:
        """The request to retract first: fewest generated tokens, then the longest prompt."""
        return min(running, key=lambda r: (len(r.output), -r.prompt_len))

    def retract(self, req: Req) -> None:
        """Free ``req``'s KV and mark it waiting; it keeps its output (and its generator)."""
        self.stats.retractions += 1
        self.stats.wasted_tokens += self.memory.release(req)
        self.admission.released(req)
        req.retractions += 1
        req.state = ReqState.WAITING

    def process_batch_result(self, batch: Batch, result: BatchResult) -> list[Req]:
        """Append each entry's tokens, stream them, and stop and free finished requests.

        A request stops when it has ``max_new_tokens`` tokens, or when it produced one of
        the model's end-of-sequence ids and does not ignore them. A prefilled request that
        goes on gives its KV to the prefix cache at once. Returns the requests that finished.
        """
        if len(result.tokens) != len(batch):
            raise ValueError(
                f"backend returned tokens for {len(result.tokens)} entries, the batch has "
                f"{len(batch)}"
            )
        finished = [entry.req for entry, tokens in zip(batch.entries, result.tokens, strict=True)
                    if self.append_tokens(entry.req, tokens)]
        self.finish(batch.prefill, finished)
        return finished

    def append_tokens(self, req: Req, tokens: list[int]) -> bool:
        """Append ``tokens`` to ``req``'s output and stream them, up to the first that stops
        it; True when it finished. Tokens computed past the end of the request (the rest of
        a speculative check) are dropped and their KV freed (``KVManager.truncate``)."""
        now, stops, on_token = self.clock, self.backend.eos_ids, self.on_token
        for token in tokens:
            req.output.append(token)
            req.token_times.append(now)
            if on_token is not None:
                on_token(req, token)
            if token in stops and not req.params.ignore_eos:
                req.finish_reason = "eos"
            elif len(req.output) >= req.params.max_new_tokens:
                req.finish_reason = "length"
            else:
                continue
            break
        if (extra := len(req.kv_slots) - req.seq_len + 1) > 0:  # KV past the newest token
            self.memory.truncate(req, extra)
        return req.finish_reason is not None

    def finish(self, prefilled: list[Req], finished: list[Req],
               late: frozenset[int] = frozenset()) -> None:
        """The one finish path: prefilled requests that go on give their KV to the cache;
        finished ones give theirs, leave, and are counted.

        ``late`` holds the ids of finished requests found so one step late (the overlapped
        loop): the step in flight computed one more token for those, whose KV goes first.
        """
        done = {id(req) for req in finished}
        for req in prefilled:
            if id(req) not in done and req.state == ReqState.RUNNING:
                self.memory.cache_unfinished(req)
        for req in finished:
            if req.state == ReqState.WAITING:  # retracted while its last token was computed
                req.state = ReqState.FINISHED
                self.backend.release(req)
            else:
                if id(req) in late:
                    req.output.pop()
                    self.memory.truncate(req, 1)
                self.memory.cache_finished(req)
                self._leave(req, ReqState.FINISHED, release=id(req) not in late)
            self.stats.finished += 1
        if finished:
            self.running = [req for req in self.running if req.state == ReqState.RUNNING]
        self.stats.evicted_tokens = self.memory.evicted_tokens

    # ----------------------------------------------------------------- cleanup
    def abort(self, reqs: Iterable[Req]) -> None:
        """Withdraw ``reqs`` wherever they are (pending, waiting or running) and free them.

        Used when a caller gives up (for example its streaming callback raised), so the
        scheduler is left consistent and serves the next call normally.
        """
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

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if KV memory or the request queues are inconsistent.

        Slots held by requests + slots owned by the tree + free slots == capacity; the
        tree's sizes add up; every lock belongs to a running request (``KVManager``); and
        no request is in two places or lost between the queues.
        """
        self.memory.check_integrity(self.running)
        places = [*(item[2] for item in self._pending), *self.waiting, *self.running]
        assert len({id(r) for r in places}) == len(places), "a request is queued twice"
        assert all(r.state == ReqState.RUNNING for r in self.running), "non-running in batch"
        assert all(not r.kv_slots for r in self.waiting), "a waiting request holds KV slots"
        assert len(self.running) <= self.max_running, "running batch over max_running"

    # ----------------------------------------------------------------- helpers
    def _start(self, req: Req, cached: int) -> None:
        """Bookkeeping of an admitted request (its slots are already allocated)."""
        if not req.output:  # a first admission (a retracted request has output)
            req.cached_prompt_tokens = cached
            self.stats.prompt_tokens += len(req.prompt)
            self.stats.cached_prompt_tokens += cached
        self.stats.cached_tokens += cached
        req.state = ReqState.RUNNING
        if req.admitted_at is None:  # the first admission: queueing delay ends here
            req.admitted_at = self.clock

    def _leave(self, req: Req, state: ReqState, release: bool = True) -> None:
        """A running request ends (its KV already handed over or freed); ``release=False``
        keeps the backend's state of it (a step in flight still samples with it)."""
        self.admission.released(req)
        req.state = state
        if release:
            self.backend.release(req)

    def _snapshot(self, batch: Batch) -> dict[str, Any]:
        """The trace fields known before the backend runs the step."""
        computing = {id(req) for req in batch.reqs}
        return {
            "start": self.clock,
            "prefill": tuple(req.rid for req in batch.prefill),
            "decode": tuple(req.rid for req in batch.decode),
            "paused": tuple(r.rid for r in self.running if id(r) not in computing),
            "kv_reserved": self.kv_reserved,
            "kv_used": self.kv.used_count,
            "new_token_ratio": self.new_token_ratio,
            "retracted": tuple(req.rid for req in batch.retracted),
            "prefill_tokens": sum(req.seq_len - req.cached_len for req in batch.prefill),
        }
