"""Zero-overhead scheduling: the overlapped loop and the device it is measured on.

A serving loop alternates two kinds of work. The *CPU* receives requests, admits them,
matches prefixes, prepares the inputs and, once the step is done, appends tokens, checks
stops and streams. The *device* runs the forward. Run one after the other (the blocking
loop) the device waits for the CPU on every step; overlapped, the CPU forms step i+1 while
the device computes step i.

* ``futures``: ``FutureMap``, the device-side placeholders through which step i+1's
  inputs name step i's not-yet-sampled tokens;
* ``loop``: ``OverlapScheduler``, the loop behind ``Engine(..., overlap=True)``, and
  ``FutureStep``, its record of what the future map did in each step;
* ``timed``: ``TimedBackend``, a device whose step takes a set wall-clock time while
  computing the real tokens.

The chapter's model and measurements live on the book side, in ``minisrv.experiments``
(``lanes``: ``timeline``, ``throughput_ratio``; ``breakdown``: ``time_steps``;
``overlap``: waste and gain). Their names are still importable from here, lazily, so that
loading the loop never loads them.
"""

from __future__ import annotations

import importlib
from typing import Any

from minisrv.overlap.futures import FutureMap
from minisrv.overlap.loop import FutureStep, OverlapScheduler
from minisrv.overlap.timed import TimedBackend

_BOOK_SIDE = {
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

__all__ = [
    "CPU_PARTS",
    "PARTS",
    "FutureMap",
    "FutureStep",
    "Interval",
    "OverlapScheduler",
    "StepTiming",
    "StepTimings",
    "TimedBackend",
    "Timeline",
    "late_stop_waste",
    "throughput_ratio",
    "time_steps",
    "timeline",
]


def __getattr__(name: str) -> Any:
    if name in _BOOK_SIDE:
        return getattr(importlib.import_module(_BOOK_SIDE[name]), name)
    raise AttributeError(f"module 'minisrv.overlap' has no attribute {name!r}")
