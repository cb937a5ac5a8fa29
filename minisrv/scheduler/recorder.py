"""The scheduler's clock and books: the time, one ``StepRecord`` per step, the totals.

Both loops end every step here (``record``), and both take the trace fields known before
the backend runs (``trace_fields``) when they launch, so the records of the blocking and
the overlapped loop are the same records. The clock counts steps for a real model and
simulated seconds for a simulated GPU: it is a backend's ``elapsed`` summed, never a wall
clock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from minisrv.core import Batch, BatchResult
from minisrv.kv.manager import KVManager
from minisrv.request import Req
from minisrv.scheduler.admission import AdmissionRule
from minisrv.scheduler.config import EngineConfig
from minisrv.scheduler.queues import RequestQueues
from minisrv.scheduler.records import SchedulerStats, StepRecord
from minisrv.scheduler.wide import WideDecode

__all__ = ["StepRecorder"]


class StepRecorder:
    """``clock``, ``trace`` (when ``config.record_trace``) and ``stats`` of a scheduler; with
    ``config.debug`` every recorded step ends in ``check_integrity`` (the scheduler's)."""

    def __init__(self, config: EngineConfig, queues: RequestQueues, memory: KVManager,
                 admission: AdmissionRule, wide: WideDecode | None,
                 check_integrity: Callable[[], None]) -> None:
        self.config, self.queues, self.memory = config, queues, memory
        self.admission, self.wide, self.check_integrity = admission, wide, check_integrity
        self.clock = 0.0
        self.trace: list[StepRecord] = []
        self.stats = SchedulerStats()

    def trace_fields(self, batch: Batch) -> dict[str, Any]:
        """The trace fields known before the backend runs the step (both loops' launch)."""
        queues, reqs, k = self.queues, batch.reqs, batch.n_prefill
        computing = set(reqs)  # by identity: Req has eq=False
        rids = [req.rid for req in reqs]
        return {
            "start": self.clock,
            "prefill": tuple(rids[:k]),
            "decode": tuple(rids[k:]),
            "paused": tuple([r.rid for r in (*queues.finishing, *queues.running)
                             if r not in computing]),
            "kv_reserved": self.admission.reserved,
            "kv_used": self.memory.kv.used_count,
            "new_token_ratio": self.admission.ratio,
            "retracted": tuple(req.rid for req in batch.retracted),
            "prefill_tokens": batch.prefill_tokens,
        }

    def advance(self, before: dict[str, Any], result: BatchResult) -> None:
        """The step ends ``result.elapsed`` after the one before it (a device's steps follow
        each other), whenever it was formed."""
        before["start"] = self.clock
        self.clock += result.elapsed

    def count_memory(self) -> None:
        """The KV manager's running totals (evicted, host hits, loaded) into ``stats``."""
        stats, memory = self.stats, self.memory
        stats.evicted_tokens = memory.evicted_tokens
        stats.host_hit_tokens = memory.host_hit_tokens
        stats.loaded_tokens = memory.loaded_tokens

    def record(self, batch: Batch, before: dict[str, Any], result: BatchResult,
               finished: list[Req], extra: int = 0) -> StepRecord:
        """Count a completed step, keep its trace line, check the books (``debug``).

        ``extra``: tokens computed for requests that had finished in the step before (the
        overlapped loop's late stop check), wasted.
        """
        stats, config = self.stats, self.config
        stats.count_step(batch, result, before["prefill_tokens"])
        if self.wide is not None:  # the checks' guesses and kept ones, into the trace too
            self.wide.count(batch, result, stats, before)
        stats.generated_tokens -= extra
        stats.wasted_tokens += extra
        stats.late_stop_tokens += extra
        record = StepRecord(index=stats.steps - 1, end=self.clock,
                            finished=tuple(req.rid for req in finished),
                            queued=len(self.queues.waiting), cost=result.cost,
                            jumped=result.jumped, **before)
        if config.record_trace:
            self.trace.append(record)
        if config.debug:
            self.check_integrity()
        return record
