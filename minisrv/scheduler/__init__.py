"""The scheduler package: the step path, both loops, configuration, admission and records
(KV memory is ``minisrv.kv``'s). The scheduler is composed of parts, none inheriting from
another:

* ``loop.py``: ``Scheduler``, the blocking loop (form, launch, complete), which builds the
  parts and forwards the names callers use to them;
* ``overlap.py``: ``OverlapLoop``, the overlapped loop over the same parts;
* ``forming.py``: ``BatchFormer``, forming a batch (policy, admission, chunking);
* ``completing.py``: ``BatchCompleter``, completing it (tokens, stops, the finish path);
* ``queues.py``: ``RequestQueues``, where the requests are (pending ... mid-prefill);
* ``lifecycle.py``: ``Lifecycle``, a request's moves between them (admitted, retracted,
  left), abort and requeue;
* ``recorder.py``: ``StepRecorder``, the clock, the trace and the totals;
* ``chunked.py``: the request mid-prefill and its chunks (chunked prefill);
* ``wide.py``: decode entries of several tokens, ``JumpForward``'s or ``speculative.py``'s
  checks (``Speculation``);
* ``capabilities.py``: what the options ask of a backend (its ``Capability`` set, declared
  in the step's contract, ``minisrv.core``), checked once;
* ``config.py``: ``EngineConfig``, the one frozen set of options;
* ``admission.py``: how much memory a request must find (reserve, or SGLang's budget);
* ``records.py``: ``StepRecord``, ``SchedulerStats``, ``StepOutput``, ``EngineSnapshot``
  (the ``Batch`` a step hands its backend is ``minisrv.core``'s);
* ``policy.py``: which waiting request goes first (FCFS, LPM, DFS-weight, LOF, random),
  and ``QueuePolicy``, the scheduler's part that applies it each round;
* ``prompts.py``: the checks of requests and prompts at the boundary.
"""

from minisrv.kv.manager import KVManager
from minisrv.scheduler.admission import CLIP_MAX_NEW_TOKENS
from minisrv.scheduler.completing import BatchCompleter
from minisrv.scheduler.config import ADMISSIONS, MODES, ConfigView, EngineConfig
from minisrv.scheduler.forming import BatchFormer
from minisrv.scheduler.lifecycle import Lifecycle
from minisrv.scheduler.loop import Launched, Scheduler
from minisrv.scheduler.policy import (
    POLICIES,
    PriorityResult,
    QueuePolicy,
    calc_priority,
    optimal_hit_rate,
)
from minisrv.scheduler.queues import RequestQueues
from minisrv.scheduler.recorder import StepRecorder
from minisrv.scheduler.records import (
    EngineSnapshot,
    SchedulerStats,
    StepOutput,
    StepRecord,
    hit_rate,
)

__all__ = [
    "ADMISSIONS",
    "CLIP_MAX_NEW_TOKENS",
    "MODES",
    "POLICIES",
    "BatchCompleter",
    "BatchFormer",
    "ConfigView",
    "EngineConfig",
    "EngineSnapshot",
    "KVManager",
    "Launched",
    "Lifecycle",
    "PriorityResult",
    "QueuePolicy",
    "RequestQueues",
    "Scheduler",
    "SchedulerStats",
    "StepOutput",
    "StepRecord",
    "StepRecorder",
    "calc_priority",
    "hit_rate",
    "optimal_hit_rate",
]
