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

from minisrv.request import ABORTED, FINISHED, PENDING, RUNNING, WAITING, Req

__all__ = [
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
        """Forget everything kept for ``req`` (its KV cache, its random generator)."""
        ...


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

    ``cached_tokens``, ``retractions`` and ``wasted_tokens`` stay 0 here; they belong to the
    prefix cache and the retraction of later chapters, and are kept so every engine reports
    the same fields.
    """

    steps: int = 0
    prefill_steps: int = 0  # steps that prefilled at least one request
    prefill_tokens: int = 0  # prompt tokens computed
    decode_tokens: int = 0  # tokens produced by decode steps
    cached_tokens: int = 0  # prompt tokens served from a prefix cache instead of computed
    retractions: int = 0
    wasted_tokens: int = 0  # tokens computed and then thrown away
    finished: int = 0  # requests completed
    generated_tokens: int = 0  # output tokens, the first (from prefill) included
    busy_time: float = 0.0  # clock time spent in steps (idle gaps excluded)
    cost: float = 0.0  # sum of the backend's step costs

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens that came from the cache rather than being computed."""
        total = self.cached_tokens + self.prefill_tokens
        return self.cached_tokens / total if total else 0.0

    def as_dict(self) -> dict[str, float]:
        """Every field plus ``hit_rate``, e.g. for a table in a chapter."""
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return {**fields, "hit_rate": self.hit_rate}


class Scheduler:
    """The main loop of an inference server, independent of what computes the tokens.

    ``kv_capacity`` is the number of KV tokens the backend can hold; each running request
    reserves its prompt plus ``max_new_tokens`` of them. ``max_running`` caps the running
    batch. ``mode`` is one of ``MODES``. ``record_trace`` keeps one ``StepRecord`` per step.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        kv_capacity: int,
        max_running: int,
        mode: str = "prefill-first",
        record_trace: bool = True,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; supported modes: {', '.join(MODES)}")
        _check_positive_int("max_running", max_running)
        _check_positive_int("kv_capacity", kv_capacity)
        self.backend = backend
        self.kv_capacity = kv_capacity
        self.max_running = max_running
        self.mode = mode
        self.record_trace = record_trace
        self.clock = 0.0
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.kv_reserved = 0  # KV tokens promised to running requests
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
        kv_reserved = self.kv_reserved
        prefill_tokens = sum(req.seq_len for req in batch.prefill)
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
        """
        decoding = list(self.running)  # prefilled in an earlier step
        if self.mode == "static" and decoding:
            return Batch([], decoding)
        new = self.admit()
        if new and self.mode != "mixed":
            return Batch(new, [])
        return Batch(new, decoding)

    def admit(self) -> list[Req]:
        """Admit waiting requests in FCFS order while a slot and KV memory are free.

        Each admitted request reserves its prompt plus ``max_new_tokens`` KV tokens, so a
        running request can never run out of memory mid-generation. Admission stops at the
        first request that does not fit (no overtaking), which keeps FCFS fair. A later
        chapter replaces this method with SGLang's budgeted admission and retraction.
        """
        new: list[Req] = []
        free_slots = self.max_running - len(self.running)
        while self.waiting and len(new) < free_slots:
            req = self.waiting[0]
            if self.kv_reserved + req.kv_reservation > self.kv_capacity:
                break
            self.waiting.popleft()
            self.kv_reserved += req.kv_reservation
            req.state = RUNNING
            req.admitted_at = self.clock
            new.append(req)
        self.running.extend(new)
        return new

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
        self.running = [req for req in self.running if req.state == RUNNING]

    def _free(self, req: Req, state: str) -> None:
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


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
