"""The scheduler package: the step path, both loops, configuration, admission and records
(KV memory is ``minisrv.kv``'s).

* ``loop.py``: ``Scheduler``, the step path (form, launch, complete, one finish path) and
  the blocking loop;
* ``overlap.py``: ``OverlapLoop``, the overlapped loop over the same step path;
* ``state.py``: ``SchedulerState``, the queues, submission, abort, retraction, integrity,
  records;
* ``chunked.py``: forming a step under a token budget (chunked prefill);
* ``wide.py``: decode entries of several tokens, ``JumpForward``'s or ``speculative.py``'s
  checks (``Speculation``);
* ``capabilities.py``: what a backend declares it can do, checked once;
* ``config.py``: ``EngineConfig``, the one frozen set of options;
* ``admission.py``: how much memory a request must find (reserve, or SGLang's budget);
* ``records.py``: ``Batch`` (of ``Entry``), ``BatchResult``, ``StepRecord``,
  ``SchedulerStats``, ``Backend``, ``StepOutput``, ``EngineSnapshot``;
* ``policy.py``: which waiting request goes first (FCFS, LPM, DFS-weight, LOF, random).
"""

from minisrv.kv.manager import KVManager
from minisrv.scheduler.admission import CLIP_MAX_NEW_TOKENS
from minisrv.scheduler.config import ADMISSIONS, ATTENTIONS, MODES, ConfigView, EngineConfig
from minisrv.scheduler.loop import Launched, Scheduler
from minisrv.scheduler.policy import POLICIES, PriorityResult, calc_priority, optimal_hit_rate
from minisrv.scheduler.records import (
    Backend,
    Batch,
    BatchResult,
    EngineSnapshot,
    Entry,
    SchedulerStats,
    StepOutput,
    StepRecord,
    hit_rate,
)
from minisrv.scheduler.state import SchedulerState

__all__ = [
    "ADMISSIONS",
    "ATTENTIONS",
    "CLIP_MAX_NEW_TOKENS",
    "MODES",
    "POLICIES",
    "Backend",
    "Batch",
    "BatchResult",
    "ConfigView",
    "EngineConfig",
    "EngineSnapshot",
    "Entry",
    "KVManager",
    "Launched",
    "PriorityResult",
    "Scheduler",
    "SchedulerState",
    "SchedulerStats",
    "StepOutput",
    "StepRecord",
    "calc_priority",
    "hit_rate",
    "optimal_hit_rate",
]
