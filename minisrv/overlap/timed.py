"""A timed device: real tokens, and a step time chosen by the experiment.

On a CPU-only machine the "device" is the same CPU that schedules, so overlap has nothing
to hide behind. ``TimedBackend`` makes every step last a set wall-clock time, most of it
asleep (which frees the GIL, as a GPU kernel does), so the measured gain of an overlapped
loop can be held against ``throughput_ratio``'s prediction.
"""

from __future__ import annotations

import math
import numbers
import time
from typing import Any

from minisrv.request import Req
from minisrv.scheduler import Batch, BatchResult

__all__ = ["TimedBackend"]


class TimedBackend:
    """A device whose every step takes ``step_time`` seconds, computing the real tokens.

    Each ``run`` computes the step with ``inner`` (any backend: ``ModelBackend``,
    ``SimBackend``, ...) and then sleeps out what is left of ``step_time``; a step whose
    computation takes longer simply takes that long (``overruns`` counts them). Sleeping
    releases the GIL, like a GPU kernel does, so a loop that overlaps CPU work with the
    step sees the device's time as free: the measured gain of overlap on a CPU-only machine
    can be held against ``throughput_ratio``. The answer (tokens, cost, clock) is the
    inner backend's, unchanged.
    """

    def __init__(self, inner: Any, step_time: float) -> None:
        if not callable(getattr(inner, "run", None)) or not callable(
            getattr(inner, "release", None)
        ):
            raise ValueError(f"inner must be a backend with run() and release(), got {inner!r}")
        if (
            isinstance(step_time, bool)
            or not isinstance(step_time, numbers.Real)
            or not (math.isfinite(step_time) and step_time >= 0)
        ):
            raise ValueError(f"step_time must be a number of seconds >= 0, got {step_time!r}")
        self.inner = inner
        self.step_time = float(step_time)
        self.time_unit: str = inner.time_unit
        self.cost_unit: str = inner.cost_unit
        self.eos_ids: tuple[int, ...] = inner.eos_ids
        self.max_context: int | None = inner.max_context
        self.vocab_size: int | None = getattr(inner, "vocab_size", None)
        self.steps = 0
        self.overruns = 0
        if callable(getattr(inner, "attach_kv", None)):
            # Only a backend that stores KV has attach_kv (the scheduler looks it up).
            self.attach_kv = inner.attach_kv

    def run(self, batch: Batch) -> BatchResult:
        """The inner backend's answer, returned ``step_time`` seconds after the call."""
        start = time.perf_counter()
        result = self.inner.run(batch)
        left = self.step_time - (time.perf_counter() - start)
        self.steps += 1
        if left > 0:
            time.sleep(left)
        else:
            self.overruns += 1
        return result

    def release(self, req: Req) -> None:
        self.inner.release(req)

    def __repr__(self) -> str:
        return f"TimedBackend({self.inner!r}, step_time={self.step_time!r})"
