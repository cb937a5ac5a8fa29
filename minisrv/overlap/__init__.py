"""Zero-overhead scheduling: how much of a step is CPU work, and how much overlap can hide.

A serving loop alternates two kinds of work. The *CPU* receives requests, admits them,
matches prefixes, prepares the inputs and, once the step is done, appends tokens, checks
stops and streams. The *device* runs the forward. Run one after the other (the blocking
loop) the device waits for the CPU on every step; overlapped, the CPU forms step i+1 while
the device computes step i.

This package gathers the names the overlap chapter uses, wherever they live:

* ``OverlapLoop`` (``minisrv.scheduler.overlap``), the loop behind
  ``Engine(..., overlap=True)``, and ``FutureStep``, its record of the future map's work;
* ``FutureMap`` (``minisrv.runner.futures``), the device-side placeholders through which
  step i+1's inputs name step i's not-yet-sampled tokens;
* ``TimedBackend`` (``minisrv.sim.timed``), a device whose step takes a set wall-clock
  time while computing the real tokens;
* the chapter's model and measurements, on the book side in ``minisrv.experiments``
  (``lanes``: ``timeline``, ``throughput_ratio``, ``late_stop_waste``; ``breakdown``:
  ``time_steps``).

Every name is imported on first use, so importing this package loads neither the loop nor
the book side.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "FutureMap": "minisrv.runner.futures",
    "FutureStep": "minisrv.scheduler.overlap",
    "OverlapLoop": "minisrv.scheduler.overlap",
    "TimedBackend": "minisrv.sim.timed",
    "CPU_PARTS": "minisrv.experiments.breakdown",
    "PARTS": "minisrv.experiments.breakdown",
    "StepTiming": "minisrv.experiments.breakdown",
    "StepTimings": "minisrv.experiments.breakdown",
    "time_steps": "minisrv.experiments.breakdown",
    "Interval": "minisrv.experiments.lanes",
    "Timeline": "minisrv.experiments.lanes",
    "late_stop_waste": "minisrv.experiments.lanes",
    "throughput_ratio": "minisrv.experiments.lanes",
    "timeline": "minisrv.experiments.lanes",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'minisrv.overlap' has no attribute {name!r}")
