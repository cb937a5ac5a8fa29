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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from minisrv.request import Req
from minisrv.scheduler import Batch, BatchResult

if TYPE_CHECKING:
    import torch

    from minisrv.kvpool import SlotAllocator

__all__ = ["TimedBackend"]


class TimedBackend:
    """A device whose every step takes ``step_time`` seconds, computing the real tokens.

    Each ``run`` computes the step with ``inner`` (any backend: ``ModelBackend``,
    ``SimBackend``, ...) and then sleeps out what is left of ``step_time``; a step whose
    computation takes longer simply takes that long (``overruns`` counts them). Sleeping
    releases the GIL, like a GPU kernel does, so a loop that overlaps CPU work with the
    step sees the device's time as free: the measured gain of overlap on a CPU-only machine
    can be held against ``throughput_ratio``. The answer (tokens, cost, clock) is the
    inner backend's, unchanged. ``busy`` sums the seconds the steps really took (a loaded
    machine wakes a sleeper late), so a run's device and CPU time per step can be measured.
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
        self.busy = 0.0  # seconds spent inside steps, as measured (sleep overshoot included)

    def attach_kv(self, capacity: int) -> SlotAllocator | None:
        """The inner backend's KV store (``None`` when it stores none)."""
        attach = getattr(self.inner, "attach_kv", None)
        return attach(capacity) if callable(attach) else None

    def run(self, batch: Batch) -> BatchResult:
        """The inner backend's answer, returned ``step_time`` seconds after the call."""
        return self._timed(lambda: self.inner.run(batch))

    def prepare(self, batch: Batch) -> Any:
        """The inner backend's ``prepare`` (the CPU half of a step, not timed)."""
        return self.inner.prepare(batch)

    def compute(
        self,
        step: Any,
        resolve: Callable[[torch.Tensor], torch.Tensor] | None = None,
        store: Callable[[list[int]], None] | None = None,
    ) -> BatchResult:
        """The inner backend's ``compute``, returned ``step_time`` seconds after the call
        (``store`` included: on a GPU, writing the step's tokens is part of the step)."""
        return self._timed(lambda: self.inner.compute(step, resolve, store))

    def _timed(self, work: Callable[[], BatchResult]) -> BatchResult:
        start = time.perf_counter()
        result = work()
        left = self.step_time - (time.perf_counter() - start)
        self.steps += 1
        if left > 0:
            time.sleep(left)
        else:
            self.overruns += 1
        self.busy += time.perf_counter() - start
        return result

    def release(self, req: Req) -> None:
        self.inner.release(req)

    def __repr__(self) -> str:
        return f"TimedBackend({self.inner!r}, step_time={self.step_time!r})"
