"""The scheduler package: the loop, its configuration, admission, memory and records.

* ``loop.py``: ``Scheduler``, the four calls of every serving engine;
* ``config.py``: ``EngineConfig``, the one frozen set of options;
* ``admission.py``: how much memory a request must find (reserve, or SGLang's budget);
* ``memory.py``: ``KVManager``, the one owner of KV slots and prefix-cache bookkeeping;
* ``records.py``: ``Batch``, ``BatchResult``, ``StepRecord``, ``SchedulerStats``, ``Backend``.
"""

from minisrv.scheduler.admission import CLIP_MAX_NEW_TOKENS
from minisrv.scheduler.config import ADMISSIONS, MODES, POLICIES, EngineConfig
from minisrv.scheduler.loop import Scheduler
from minisrv.scheduler.memory import KVManager
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
    "EngineConfig",
    "KVManager",
    "Scheduler",
    "SchedulerStats",
    "StepRecord",
    "hit_rate",
]
