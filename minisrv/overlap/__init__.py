"""Zero-overhead scheduling: how much of a step is CPU work, and how much overlap can hide.

A serving loop alternates two kinds of work. The *CPU* receives requests, admits them,
matches prefixes, prepares the inputs and, once the step is done, appends tokens, checks
stops and streams. The *device* runs the forward. Run one after the other (the blocking
loop) the device waits for the CPU on every step; overlapped, the CPU forms step i+1 while
the device computes step i.

* ``lanes``: ``timeline`` and ``throughput_ratio``, the two-lane model of both loops and
  the speed-up it predicts;
* ``TimedBackend`` (``minisrv.sim.timed``), a device whose step takes a set wall-clock
  time while computing the real tokens;
* ``breakdown``: ``time_steps``, where the real engine's time goes in each step;
* ``FutureMap`` (``minisrv.runner.futures``), the device-side placeholders through which step i+1's
  inputs name step i's not-yet-sampled tokens;
* ``OverlapLoop`` (``minisrv.scheduler.overlap``), the loop behind
  ``Engine(..., overlap=True)``, and ``FutureStep``, its record of the future map's work;
* ``measure`` (imported on its own): the chapter's measurements of waste and gain.
"""

from minisrv.overlap.breakdown import CPU_PARTS, PARTS, StepTiming, StepTimings, time_steps
from minisrv.overlap.lanes import Interval, Timeline, throughput_ratio, timeline
from minisrv.runner.futures import FutureMap
from minisrv.scheduler.overlap import FutureStep, OverlapLoop
from minisrv.sim.timed import TimedBackend

__all__ = [
    "CPU_PARTS",
    "PARTS",
    "FutureMap",
    "FutureStep",
    "Interval",
    "OverlapLoop",
    "StepTiming",
    "StepTimings",
    "TimedBackend",
    "Timeline",
    "throughput_ratio",
    "time_steps",
    "timeline",
]
