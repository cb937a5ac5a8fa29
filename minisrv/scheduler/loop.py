"""The scheduler: one step path that decides, step by step, which requests the model computes.

Every serving engine in the book runs these three calls::

    batch = form()           new arrivals join the queue; admit from it, pick who computes
    step = launch(batch)     the backend computes the batch: one forward pass (real model)
                             or its roofline time (simulated GPU)
    complete(step)           append each entry's tokens, stream them, stop and free the
                             finished (``finish``), record the step

The blocking loop (``step``) runs them one after the other; the overlapped loop
(``minisrv.scheduler.overlap``) forms and launches step i+1 before completing step i. The
scheduler never looks at logits or tensors: a *backend* computes the tokens and says how
long the step took, so the same code drives CityLM on a laptop and a simulated H100 serving
LLaMA-3-8B.

``Scheduler`` holds the loop and builds its parts, each an object of its own with no
inheritance among them, so each can be read, tested and replaced alone (mini-sglang splits
its scheduler the same way): the places of the requests (``RequestQueues``, ``queues.py``),
their moves between them (``Lifecycle``, ``lifecycle.py``), forming a batch
(``BatchFormer``, ``forming.py``: policy, admission, chunking, wide decodes), completing it
(``BatchCompleter``, ``completing.py``: stops, finish, cache), the clock and the books
(``StepRecorder``, ``recorder.py``), and KV memory (``KVManager``, ``minisrv.kv``). A
caller reaches a value through the part that owns it (``sched.queues.waiting``,
``sched.recorder.clock``). Bookkeeping per step touches only the requests in the batch
(plus the ones admitted or arriving), so simulating thousands stays fast.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from minisrv.core import Backend, Batch, BatchResult, require
from minisrv.kv import SlotAllocator
from minisrv.kv.host import make_host_pool
from minisrv.kv.manager import KVManager
from minisrv.kv.table import ReqToTokenTable, table_rows
from minisrv.request import Req
from minisrv.scheduler.admission import make_admission
from minisrv.scheduler.capabilities import needs
from minisrv.scheduler.completing import BatchCompleter
from minisrv.scheduler.config import EngineConfig
from minisrv.scheduler.forming import BatchFormer
from minisrv.scheduler.lifecycle import Lifecycle
from minisrv.scheduler.prompts import check_request
from minisrv.scheduler.queues import RequestQueues
from minisrv.scheduler.recorder import StepRecorder
from minisrv.scheduler.records import StepRecord
from minisrv.scheduler.wide import make_wide

__all__ = ["Launched", "Scheduler"]


class Launched(NamedTuple):
    """A step handed to the backend: its batch, the trace fields known before, its answer."""

    batch: Batch
    before: dict[str, Any]
    result: BatchResult


class Scheduler:
    """The main loop of an inference server, independent of what computes the tokens.

    ``Scheduler(backend, config)`` or ``Scheduler(backend, **options)`` with the options of
    ``EngineConfig`` (``kv_capacity``, ``max_running``, ``mode``, ``admission``, ``cache``,
    ...). ``step`` is the blocking loop's iteration: ``form``, ``launch``, ``complete``,
    over the parts it builds: ``queues`` (``RequestQueues``), ``lifecycle``, ``former``
    (``BatchFormer``), ``completer`` (``BatchCompleter``), ``recorder`` (``StepRecorder``:
    clock, trace, stats), ``memory`` (``KVManager``), ``admission`` and ``wide``. Every
    running request holds real slots of a ``SlotAllocator`` (the backend's KV pool when it
    has one), one per token whose K/V exist; with ``cache="radix"`` its first
    ``cached_len`` slots are shared prefix slots owned by the tree.
    """

    def __init__(self, backend: Backend, config: EngineConfig | None = None, **options: Any):
        self.config = config = EngineConfig.from_options(config, **options)
        require(backend, needs(config))  # once: the step path asks the backend nothing more
        self.memory = memory = make_memory(config, backend)
        self.admission = admission = make_admission(config)
        # speculative checks or jump-forward's entries: decodes of several tokens
        self.wide = wide = make_wide(config, backend)
        self.queues = queues = RequestQueues()
        # the debug check looked up at each step, so a wrapped check_integrity is the one run
        self.recorder = recorder = StepRecorder(config, queues, memory, admission, wide,
                                                lambda: self.check_integrity())
        self.lifecycle = Lifecycle(queues, memory, admission, wide, backend, recorder)
        self.former = BatchFormer(config, queues, memory, admission, wide, self.lifecycle)
        self.completer = BatchCompleter(queues, memory, self.lifecycle, recorder, backend)
        self._backend = backend

    # ----------------------------------------------------------------- the loop
    def step(self) -> StepRecord | None:
        """Run one iteration of the blocking loop; ``None`` once there is nothing left to do."""
        batch = self.form()
        if batch is None:
            return None
        return self.complete(self.launch(batch))

    def run(self, progress: bool = False) -> None:
        """Step until every submitted request has finished.

        ``progress`` shows a tqdm bar counting finished requests (useful for long simulations).
        """
        if not progress:
            while self.step() is not None:
                pass
            return
        from tqdm.auto import tqdm

        queues = self.queues
        total = queues.pending + len(queues.waiting) + len(queues.running)
        with tqdm(total=total, unit="req", desc=f"serving ({self.config.mode})") as bar:
            while (record := self.step()) is not None:
                bar.update(len(record.finished))

    def form(self, device_busy: bool = False) -> Batch | None:
        """The next batch, or ``None`` when nothing can run now.

        When nothing can run but requests are still to arrive, the clock jumps to the next
        arrival instead of spinning through empty steps (unless the device is still busy
        with a step: its end moves the clock).
        """
        self.receive_arrivals()
        batch = self.former.next_batch()
        if not batch and (arrival := self.queues.next_arrival) is not None and not device_busy:
            self.recorder.clock = max(self.recorder.clock, arrival)
            self.receive_arrivals()
            batch = self.former.next_batch()
        return batch if batch else None

    def launch(self, batch: Batch) -> Launched:
        """Hand ``batch`` to the backend; the blocking loop waits for its answer here."""
        before = self.recorder.trace_fields(batch)
        self.memory.transfer()  # the host tier's copies, before the step that reads them
        self.memory.launched(batch.reqs)  # the table's rows it reads stay theirs until done
        try:
            return Launched(batch, before, self.backend.run(batch))
        finally:
            self.memory.completed()

    def complete(self, step: Launched) -> StepRecord:
        """The step's tokens into the requests (``process_batch_result``), then its record."""
        batch, before, result = step
        self.recorder.advance(before, result)  # the clock: the step ends after the last
        finished = self.completer.process_batch_result(batch, result)
        return self.recorder.record(batch, before, result, finished)

    # ----------------------------------------------------------------- outside the step
    def check(self, req: Req) -> None:
        """Raise ValueError if ``req`` could never be served; change nothing
        (``prompts.check_request``)."""
        check_request(req, self.config, self.backend)

    def submit(self, req: Req) -> None:
        """Queue ``req`` to arrive at ``req.arrival`` on the scheduler's clock."""
        self.check(req)
        self.enqueue(req)

    def enqueue(self, req: Req) -> None:
        """``submit`` without ``check``, for a caller that already checked ``req`` (a cluster
        checks each request once, up front; a second scan of every prompt costs real time)."""
        self.queues.enqueue(req)

    def receive_arrivals(self) -> list[Req]:
        """Move every request whose arrival time has come into the waiting queue (FCFS)."""
        return self.queues.receive_arrivals(self.recorder.clock)

    def abort(self, reqs: Iterable[Req]) -> None:
        """Withdraw ``reqs`` wherever they are and free them (``Lifecycle.abort``)."""
        self.lifecycle.abort(reqs)

    def requeue(self, reqs: Iterable[Req]) -> None:
        """Retract running ``reqs`` to the head of the queue (``Lifecycle.requeue``)."""
        self.lifecycle.requeue(reqs)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if KV memory or the request queues are inconsistent.

        Slots held by requests + slots owned by the tree + free slots == capacity; the
        tree's sizes add up; every lock belongs to a running request (``KVManager``); and
        no request is in two places or lost between the queues (``RequestQueues``).
        """
        self.queues.check_integrity(self.memory, self.config.max_running)

    # ----------------------------------------------------------------- its own state
    @property
    def backend(self) -> Backend:
        """What computes the steps (replacing it tells every part that calls it)."""
        return self._backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        self._backend = self.lifecycle.backend = self.completer.backend = backend

    @property
    def idle(self) -> bool:
        """True when nothing is pending, waiting or running (the overlapped loop's ``idle``
        adds its step in flight)."""
        return self.queues.idle


def make_memory(config: EngineConfig, backend: Backend) -> KVManager:
    """The ``KVManager`` over the backend's KV pool (or a plain ``SlotAllocator``).

    A backend with a pool reads it through the request-to-token table (kv/table.py), as
    wide as the longest context fits: the pool's padding slot (the one past its last)
    fills what nobody wrote. Without a pool there is nothing to index.
    """
    pool = backend.attach_kv(config.kv_capacity)
    allocator = pool or SlotAllocator(config.kv_capacity)
    allocator.set_page_size(config.page_size)
    table = None if pool is None else ReqToTokenTable(
        table_rows(config.max_running, config.overlap),
        min(backend.max_context or config.kv_capacity, config.kv_capacity),
        scratch_slot=pool.size)
    backend.attach_table(table)
    return KVManager(allocator, config.cache, make_host_pool(config, backend),
                     config.host_cache_policy, table)
