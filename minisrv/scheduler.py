"""The scheduler: one loop that decides, step by step, which requests the model computes.

Every serving engine in the book is this loop::

    receive_arrivals()                   new requests join the waiting queue
    batch = get_next_batch_to_run()      admit from the queue, pick who computes this step
    result = backend.run(batch)          one forward pass (real model) or its roofline time
    process_batch_result(batch, result)  append tokens, stream them, stop, free the finished

The scheduler never looks at logits or tensors: a *backend* computes the tokens and says
how long the step took. The same code therefore drives CityLM on a laptop and a simulated
H100 serving LLaMA-3-8B, and a policy learned at toy scale is the policy measured at GPU
scale. Bookkeeping per step touches only the requests in the batch (plus the ones admitted
or arriving), never the whole workload, so simulating thousands of requests stays fast.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from minisrv.kvpool import SlotAllocator
from minisrv.radix import CACHES, MatchResult, make_cache
from minisrv.request import ABORTED, FINISHED, PENDING, RUNNING, WAITING, Req

__all__ = [
    "ADMISSIONS",
    "CLIP_MAX_NEW_TOKENS",
    "MODES",
    "Backend",
    "Batch",
    "BatchResult",
    "Scheduler",
    "SchedulerStats",
    "StepRecord",
]

MODES: tuple[str, ...] = ("static", "prefill-first", "mixed")
"""How steps are formed: request-level batching, SGLang's default, and ORCA's mixed steps."""

ADMISSIONS: tuple[str, ...] = ("reserve", "budget")
"""How requests are admitted: reserve the worst case up front, or SGLang's estimated budget."""

CLIP_MAX_NEW_TOKENS = 4096
"""SGLang's cap on how many future tokens one request is assumed to still need."""

RETRACT_DECODE_STEPS = 20
"""After a retraction the ratio is re-estimated as if each survivor decodes this many more."""


@dataclass(frozen=True, slots=True)
class Batch:
    """The requests one step computes: new ones to prefill, running ones to decode.

    The backend returns one next token per request, prefills first, then decodes.
    """

    prefill: list[Req]
    decode: list[Req]

    @property
    def reqs(self) -> list[Req]:
        """All requests of the step in the order the backend answers them."""
        return [*self.prefill, *self.decode]

    def __len__(self) -> int:
        return len(self.prefill) + len(self.decode)


@dataclass(frozen=True, slots=True)
class BatchResult:
    """What a backend reports for one step.

    ``cost`` is what the step computed in the backend's own unit (tokens for the real model,
    seconds for the simulator); ``elapsed`` is how far the clock advances: one step for the
    real model, the roofline time for the simulator.
    """

    next_tokens: list[int]
    cost: float
    elapsed: float


@runtime_checkable
class Backend(Protocol):
    """What the scheduler needs from whatever computes the tokens."""

    time_unit: str  # unit of the clock, e.g. "step" or "s"
    cost_unit: str  # unit of BatchResult.cost, e.g. "tokens" or "s"
    eos_id: int | None  # token that ends a request (None: outputs have fixed lengths)
    max_context: int | None  # longest sequence (prompt + output) the model takes (None: any)

    def run(self, batch: Batch) -> BatchResult:
        """Compute one step: one next token for every request of ``batch``."""
        ...

    def release(self, req: Req) -> None:
        """Forget everything kept for ``req`` (its random generator, any private state)."""
        ...

    # Optional: ``attach_kv(capacity) -> SlotAllocator``. A backend that stores KV (the real
    # model's pool) builds its pool there and returns the pool's allocator, so the slots the
    # scheduler hands out index its tensors. Without it the scheduler counts slots alone.


class StepRecord(NamedTuple):
    """One line of the trace: who did what in one step, and what the step cost."""

    index: int
    start: float  # clock when the step began
    end: float  # clock when its tokens existed
    prefill: tuple[int, ...]  # request ids prefilled (each produced its first token)
    decode: tuple[int, ...]  # request ids that decoded one token
    paused: tuple[int, ...]  # running requests that sat this step out
    finished: tuple[int, ...]  # request ids that stopped at the end of this step
    queued: int  # requests left waiting in the queue after admission
    kv_reserved: int  # KV tokens promised to the requests running in this step
    prefill_tokens: int  # tokens the prefills computed
    cost: float  # backend cost of the step (tokens, or seconds)
    kv_used: int = 0  # KV slots held while the step ran (its new tokens included)
    new_token_ratio: float = 0.0  # the admission estimate in force during the step
    retracted: tuple[int, ...] = ()  # request ids pushed back to the queue before the step

    @property
    def duration(self) -> float:
        """How long the step took on the clock."""
        return self.end - self.start

    @property
    def batch_size(self) -> int:
        """Requests that computed a token in this step."""
        return len(self.prefill) + len(self.decode)


@dataclass
class SchedulerStats:
    """Running totals over everything the scheduler has executed.

    ``cached_tokens`` counts tokens whose KV came from the prefix cache instead of a prefill,
    re-admissions after a retraction included (always 0 with ``cache="none"``); ``hit_rate``
    uses first admissions only: cached prompt tokens / all prompt tokens, the lecture's
    definition. ``retractions`` counts requests
    pushed back to the queue to free memory, ``wasted_tokens`` the KV they threw away (and
    must compute again when they are re-admitted).
    """

    steps: int = 0
    prefill_steps: int = 0  # steps that prefilled at least one request
    prefill_tokens: int = 0  # prompt tokens computed
    decode_tokens: int = 0  # tokens produced by decode steps
    cached_tokens: int = 0  # tokens served from a prefix cache instead of computed
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission only)
    cached_prompt_tokens: int = 0  # of those, found in the prefix cache at admission
    retractions: int = 0
    wasted_tokens: int = 0  # tokens computed and then thrown away
    finished: int = 0  # requests completed
    generated_tokens: int = 0  # output tokens, the first (from prefill) included
    busy_time: float = 0.0  # clock time spent in steps (idle gaps excluded)
    cost: float = 0.0  # sum of the backend's step costs

    @property
    def hit_rate(self) -> float:
        """Share of admitted requests' prompt tokens that were found in the prefix cache."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        """Every field plus ``hit_rate``, e.g. for a table in a chapter."""
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return {**fields, "hit_rate": self.hit_rate}


class Scheduler:
    """The main loop of an inference server, independent of what computes the tokens.

    ``kv_capacity`` is the number of KV token slots; ``max_running`` caps the running batch;
    ``mode`` is one of ``MODES``. ``record_trace`` keeps one ``StepRecord`` per step.

    ``admission`` chooses how memory is promised (``ADMISSIONS``):

    * ``"reserve"``: a request is admitted only if its prompt plus ``max_new_tokens`` fit
      beside everyone else's worst case. Nothing ever runs out, but memory sits idle for
      outputs that end early.
    * ``"budget"`` (SGLang): running requests are assumed to need only ``new_token_ratio``
      of their remaining tokens. The ratio starts at ``new_token_ratio``, falls by
      ``ratio_decay`` each decode step down to ``min_ratio``, and is re-estimated upwards
      whenever memory runs out and requests must be retracted.

    Either way every running request holds real slots of a ``SlotAllocator`` (the backend's
    KV pool when it has one), one per token whose K/V exist.

    ``cache`` is ``"none"`` or ``"radix"`` (``minisrv.radix``): with the radix cache a request's
    first ``cached_len`` slots are shared prefix slots owned by the tree, and only the rest are
    its own; ``record_tree`` keeps the tree's event log for drawings.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        kv_capacity: int,
        max_running: int,
        mode: str = "prefill-first",
        record_trace: bool = True,
        admission: str = "reserve",
        new_token_ratio: float = 0.7,
        ratio_decay: float = 0.001,
        min_ratio: float = 0.1,
        cache: str = "none",
        record_tree: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; supported modes: {', '.join(MODES)}")
        if admission not in ADMISSIONS:
            raise ValueError(f"unknown admission {admission!r}; supported: {', '.join(ADMISSIONS)}")
        if cache not in CACHES:
            raise ValueError(f"unknown cache {cache!r}; supported: {', '.join(CACHES)}")
        _check_positive_int("max_running", max_running)
        _check_positive_int("kv_capacity", kv_capacity)
        _check_ratios(new_token_ratio, ratio_decay, min_ratio)
        self.backend = backend
        self.kv_capacity = kv_capacity
        self.max_running = max_running
        self.mode = mode
        self.record_trace = record_trace
        self.clock = 0.0
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.kv_reserved = 0  # KV tokens promised to running requests (worst case)
        self.admission = admission
        self.init_ratio, self.ratio_decay, self.min_ratio = new_token_ratio, ratio_decay, min_ratio
        self.new_token_ratio = new_token_ratio
        attach = getattr(backend, "attach_kv", None)
        self.kv: SlotAllocator = attach(kv_capacity) if attach else SlotAllocator(kv_capacity)
        # The prefix cache owns the slots of the prefixes it keeps; evicting one frees them.
        self.tree = make_cache(cache, on_evict=self.kv.free, record=record_tree)
        self._retracted_now: list[Req] = []  # retracted while forming the current step
        self.trace: list[StepRecord] = []
        self.stats = SchedulerStats()
        self.on_token: Callable[[Req, int], None] | None = None  # streaming hook
        self._pending: list[tuple[float, int, Req]] = []  # heap of future arrivals
        self._order = itertools.count()  # FCFS tie-break for equal arrival times

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
        vocab = getattr(self.backend, "vocab_size", None)
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
        req.state = PENDING
        heapq.heappush(self._pending, (req.arrival, next(self._order), req))

    @property
    def idle(self) -> bool:
        """True when nothing is pending, waiting or running."""
        return not (self._pending or self.waiting or self.running)

    @property
    def pending(self) -> int:
        """Requests submitted whose arrival time has not come yet."""
        return len(self._pending)

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
        paused = self._paused(batch)
        kv_reserved, kv_used, ratio = self.kv_reserved, self.kv.used_count, self.new_token_ratio
        retracted = tuple(req.rid for req in self._retracted_now)
        prefill_tokens = sum(len(req.fill_ids) for req in batch.prefill)
        start = self.clock
        result = self.backend.run(batch)
        self.clock = start + result.elapsed
        finished = self.process_batch_result(batch, result)
        self._count(batch, result, prefill_tokens)
        record = StepRecord(
            index=self.stats.steps - 1,
            start=start,
            end=self.clock,
            prefill=tuple(req.rid for req in batch.prefill),
            decode=tuple(req.rid for req in batch.decode),
            paused=paused,
            finished=tuple(req.rid for req in finished),
            queued=len(self.waiting),
            kv_reserved=kv_reserved,
            prefill_tokens=prefill_tokens,
            cost=result.cost,
            kv_used=kv_used,
            new_token_ratio=ratio,
            retracted=retracted,
        )
        if self.record_trace:
            self.trace.append(record)
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
            req.state = WAITING
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
        self._retracted_now = []
        if self.mode == "static" and self.running:
            return Batch([], self.prepare_decode())
        if self.mode == "mixed":
            decoding = self.prepare_decode() if self.running else []
            new = [] if self._retracted_now else self.admit()
            return Batch(new, decoding)
        new = self.admit()
        if new:
            return Batch(new, [])
        return Batch([], self.prepare_decode() if self.running else [])

    def admit(self) -> list[Req]:
        """Admit waiting requests in FCFS order while a batch place and KV memory are free.

        With ``admission="reserve"`` each request reserves its prompt plus
        ``max_new_tokens``, so no running request can ever run out of memory. With
        ``"budget"`` the test is ``admission_budget()``: a request needs its prompt (plus
        any output kept from before a retraction) and its remaining ``max_new_tokens``,
        clipped. Either way its prefill's slots are allocated here, and admission stops at
        the first request that does not fit (no overtaking), which keeps FCFS fair.

        With a prefix cache the request first looks up its longest cached prefix
        (``match_prefix_of``) and locks it; only the rest is allocated and prefilled. When the
        pool is short, unlocked cached prefixes are evicted (LRU) before giving up.
        """
        new: list[Req] = []
        free_places = self.max_running - len(self.running)
        budget = self.admission_budget() if self.admission == "budget" else 0.0
        while self.waiting and len(new) < free_places:
            req = self.waiting[0]
            match = self.match_prefix_of(req)
            fill = req.seq_len - match.length
            if self.admission == "reserve":
                fits = self.kv_reserved + req.kv_reservation <= self.kv_capacity
            else:
                need = fill + min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS)
                fits = need <= budget
                budget -= need
            if fits and fill > self.kv.free_count:
                self.tree.evict(fill - self.kv.free_count)
            if not fits or fill > self.kv.free_count:
                self.tree.unlock(match.node)
                break
            self.waiting.popleft()
            req.kv_slots = [*match.values, *self.kv.alloc(fill)]
            req.cached_len, req.cache_node = match.length, match.node
            if not req.output:  # a first admission (a retracted request has output)
                req.cached_prompt_tokens = match.length
                self.stats.prompt_tokens += len(req.prompt)
                self.stats.cached_prompt_tokens += match.length
            self.stats.cached_tokens += match.length
            self.kv_reserved += req.kv_reservation
            req.state = RUNNING
            req.admitted_at = self.clock
            new.append(req)
        self.running.extend(new)
        return new

    def match_prefix_of(self, req: Req) -> MatchResult:
        """Find and lock ``req``'s longest cached prefix, leaving at least its last token to
        compute (the forward over that token yields the logits of the next one)."""
        self.tree.event_label = f"r{req.rid}"
        match = self.tree.match_prefix([*req.prompt, *req.output][: req.seq_len - 1])
        self.tree.lock(match.node)
        return match

    def cache_prefill(self, req: Req) -> None:
        """Right after ``req``'s prefill, put its KV in the cache so that requests arriving
        from the next step on can reuse it, and switch ``req`` to the cache's copy.

        Where the tree already held some of these tokens (another request prefilled the same
        text meanwhile), ``req``'s duplicate slots are freed and the tree's used instead;
        then ``req`` locks the longer prefix and releases the old lock.
        """
        tree = self.tree
        tree.event_label = f"r{req.rid}"
        tokens = [*req.prompt, *req.output][: len(req.kv_slots)]
        already = tree.insert(tokens, req.kv_slots)
        match = tree.match_prefix(tokens)
        if match.length <= req.cached_len:  # the cache keeps nothing (NoCache)
            return
        self.kv.free(req.kv_slots[req.cached_len:already])
        req.kv_slots[: match.length] = match.values
        tree.lock(match.node)
        tree.unlock(req.cache_node)
        req.cached_len, req.cache_node = match.length, match.node

    def cache_finished(self, req: Req) -> None:
        """Give a finished request's KV (prompt + output) to the cache, then unlock.

        Its KV is not freed but kept for the next turn of a chat or any request with the same
        prefix; it becomes evictable. Slots duplicating what the tree already held are freed
        (with ``NoCache`` that is all of them).
        """
        self.tree.event_label = f"r{req.rid}"
        tokens = [*req.prompt, *req.output][: len(req.kv_slots)]
        already = self.tree.insert(tokens, req.kv_slots)
        self.kv.free(req.kv_slots[req.cached_len:already])
        self._unlock(req)

    def release_kv(self, req: Req) -> None:
        """Free the slots ``req`` owns and unlock its cached prefix (retraction, abort)."""
        self.kv.free(req.kv_slots[req.cached_len:])
        self._unlock(req)

    def _unlock(self, req: Req) -> None:
        if req.cache_node is not None:
            self.tree.event_label = f"r{req.rid}"
            self.tree.unlock(req.cache_node)
        req.kv_slots, req.cached_len, req.cache_node = [], 0, None

    def admission_budget(self) -> float:
        """SGLang's estimate of the KV tokens a new request may still claim.

        Free slots, plus cached prefixes that could be evicted, minus what the running
        requests are expected to need before they end: each one's remaining
        ``max_new_tokens`` (clipped) times ``new_token_ratio``. A low
        ratio is a bet that most requests stop well before their limit; when the bet fails,
        ``prepare_decode`` retracts.
        """
        expected = sum(
            min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) for req in self.running
        )
        available = self.kv.free_count + self.tree.evictable_size()
        return available - expected * self.new_token_ratio

    def prepare_decode(self) -> list[Req]:
        """Give every running request a slot for its next token; retract if there are too few.

        Retraction frees the request with the fewest generated tokens first (the least work
        lost), the longest prompt breaking ties (the most memory won). It keeps its output
        and goes back to the head of the queue; on re-admission it prefills prompt plus
        output and continues exactly where it stopped. After a retraction the ratio is
        re-estimated from what the survivors have actually decoded; otherwise it decays.
        Returns the requests that decode this step.
        """
        retracted = []
        while self.kv.free_count < len(self.running):
            self.tree.event_label = "decode"
            if self.tree.evict(len(self.running) - self.kv.free_count):
                continue  # cached prefixes nobody uses go before running requests
            victim = self.retraction_victim(self.running)
            self.running.remove(victim)
            self.retract(victim)
            retracted.append(victim)
        if retracted:
            self._retracted_now.extend(retracted)
            self.waiting.extendleft(reversed(retracted))
            self.new_token_ratio = self._reestimated_ratio()
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
        slots = self.kv.alloc(len(self.running))
        for req, slot in zip(self.running, slots):
            req.kv_slots.append(slot)
        return list(self.running)

    @staticmethod
    def retraction_victim(running: list[Req]) -> Req:
        """The request to retract first: fewest generated tokens, then the longest prompt."""
        return min(running, key=lambda r: (len(r.output), -r.prompt_len))

    def retract(self, req: Req) -> None:
        """Free ``req``'s KV and mark it waiting; it keeps its output (and its generator)."""
        self.stats.retractions += 1
        self.stats.wasted_tokens += len(req.kv_slots) - req.cached_len
        self.release_kv(req)
        self.kv_reserved -= req.kv_reservation
        req.retractions += 1
        req.state = WAITING

    def _reestimated_ratio(self) -> float:
        """SGLang's reset: decoded so far plus a few more steps each, over what they may need."""
        if not self.running:
            return self.init_ratio
        decoded = sum(len(req.output) for req in self.running)
        limit = sum(req.max_new_tokens for req in self.running)
        return min(1.0, (decoded + RETRACT_DECODE_STEPS * len(self.running)) / limit)

    def process_batch_result(self, batch: Batch, result: BatchResult) -> list[Req]:
        """Append each request's new token, stream it, and stop and free finished requests.

        A request stops when it has ``max_new_tokens`` tokens, or when it produced
        ``<eos>`` and does not ignore it. Returns the requests that finished this step.
        """
        reqs = batch.reqs
        if len(result.next_tokens) != len(reqs):
            raise ValueError(
                f"backend returned {len(result.next_tokens)} tokens for a batch of {len(reqs)}"
            )
        now, eos, on_token = self.clock, self.backend.eos_id, self.on_token
        finished = []
        for req, token in zip(reqs, result.next_tokens, strict=True):
            req.output.append(token)
            req.token_times.append(now)
            if on_token is not None:
                on_token(req, token)
            if token == eos and not req.params.ignore_eos:
                req.finish_reason = "eos"
            elif len(req.output) >= req.params.max_new_tokens:
                req.finish_reason = "length"
            else:
                continue
            finished.append(req)
        done = {id(req) for req in finished}
        for req in batch.prefill:
            if id(req) not in done:
                self.cache_prefill(req)
        for req in finished:
            self._free(req, FINISHED)
        if finished:
            self.running = [req for req in self.running if req.state == RUNNING]
        return finished

    # ----------------------------------------------------------------- cleanup
    def abort(self, reqs: Iterable[Req]) -> None:
        """Withdraw ``reqs`` wherever they are (pending, waiting or running) and free them.

        Used when a caller gives up (for example its streaming callback raised), so the
        scheduler is left consistent and serves the next call normally.
        """
        doomed = [req for req in reqs if req.state not in (FINISHED, ABORTED)]
        if not doomed:
            return
        ids = {id(req) for req in doomed}
        self._pending = [item for item in self._pending if id(item[2]) not in ids]
        heapq.heapify(self._pending)
        self.waiting = deque(req for req in self.waiting if id(req) not in ids)
        for req in doomed:
            if req.state == RUNNING:
                self._free(req, ABORTED)
            else:
                req.state = ABORTED
                if req.retractions:  # retracted while running: may still hold a generator
                    self.backend.release(req)
        self.running = [req for req in self.running if req.state == RUNNING]

    def _free(self, req: Req, state: str) -> None:
        if state == FINISHED:
            self.cache_finished(req)
        else:
            self.release_kv(req)
        self.kv_reserved -= req.kv_reservation
        req.state = state
        self.backend.release(req)
        if state == FINISHED:
            self.stats.finished += 1

    def _paused(self, batch: Batch) -> tuple[int, ...]:
        """Running requests (prefilled before this step) that compute nothing in it."""
        working = len(batch)
        if working == len(self.running):
            return ()
        computing = {id(req) for req in batch.prefill} | {id(req) for req in batch.decode}
        return tuple(req.rid for req in self.running if id(req) not in computing)

    def _count(self, batch: Batch, result: BatchResult, prefill_tokens: int) -> None:
        stats = self.stats
        stats.steps += 1
        stats.prefill_steps += bool(batch.prefill)
        stats.prefill_tokens += prefill_tokens
        stats.decode_tokens += len(batch.decode)
        stats.generated_tokens += len(batch)
        stats.busy_time += result.elapsed
        stats.cost += result.cost


def _check_ratios(init: float, decay: float, floor: float) -> None:
    for name, value in (("new_token_ratio", init), ("ratio_decay", decay), ("min_ratio", floor)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ValueError(f"{name} must be a number, got {value!r}")
    if not 0 <= init <= 1:
        raise ValueError(f"new_token_ratio must be in [0, 1], got {init}")
    if not 0 <= floor <= init:
        raise ValueError(f"min_ratio must be in [0, new_token_ratio={init}], got {floor}")
    if decay < 0:
        raise ValueError(f"ratio_decay must be >= 0, got {decay}")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
