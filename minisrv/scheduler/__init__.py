"""The scheduler package: the loop, its configuration, admission, memory and records.

* ``loop.py``: ``Scheduler``, the four calls of every serving engine;
* ``config.py``: ``EngineConfig``, the one frozen set of options;
* ``admission.py``: how much memory a request must find (reserve, or SGLang's budget);
* ``memory.py``: ``KVManager``, the one owner of KV slots and prefix-cache bookkeeping;
* ``records.py``: ``Batch``, ``BatchResult``, ``StepRecord``, ``SchedulerStats``, ``Backend``;
* ``policy.py``: which waiting request goes first (FCFS, LPM, DFS-weight, LOF, random).
"""

from minisrv.kv.manager import KVManager
from minisrv.scheduler.admission import CLIP_MAX_NEW_TOKENS
from minisrv.scheduler.config import ADMISSIONS, MODES, ConfigView, EngineConfig
from minisrv.scheduler.loop import Scheduler
from minisrv.scheduler.policy import POLICIES, PriorityResult, calc_priority, optimal_hit_rate
from minisrv.scheduler.records import (
    Backend,
    Batch,
    BatchResult,
    SchedulerStats,
    StepRecord,
    hit_rate,
)

__all__ = [
    "ADMISSIONS",
    "CLIP_MAX_NEW_TOKENS",
    "MODES",
    "POLICIES",
    "Backend",
    "Batch",
    "BatchResult",
    "ConfigView",
    "EngineConfig",
    "KVManager",
    "PriorityResult",
    "Scheduler",
    "SchedulerStats",
    "StepRecord",
    "calc_priority",
    "hit_rate",
    "optimal_hit_rate",
]
