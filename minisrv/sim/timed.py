"""A timed device: real tokens, and a step time chosen by the experiment.

On a CPU-only machine the "device" is the same CPU that schedules, so overlap has nothing
to hide behind. ``TimedBackend`` makes every step last a set wall-clock time that passes
without the host, as a GPU's kernels do: the host only sleeps when it needs a step's answer
before the device is done (sleeping frees the GIL). The measured gain of an overlapped loop
can then be held against ``throughput_ratio``'s prediction.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from minisrv.core import Backend, Batch, BatchResult, Capability
from minisrv.request import Req

if TYPE_CHECKING:
    import torch

    from minisrv.kv import SlotAllocator
    from minisrv.kv.table import ReqToTokenTable

__all__ = ["SPIN", "PacedBackend", "TimedBackend", "TimedResult"]

SPIN = 2e-4
"""Seconds at the end of a wait spent spinning instead of asleep (``TimedBackend.wait``'s
default)."""

PASSED_ON = frozenset({Capability.COMPUTES_CHUNKS, Capability.LENDS_KV_POOL,
                       Capability.TIMES_HOST_COPIES})
"""The inner backend's capabilities a ``TimedBackend`` declares too (it forwards them)."""


@dataclass(frozen=True, slots=True)
class TimedResult(BatchResult):
    """A step's answer from a ``TimedBackend``: the tokens, and when the device is done."""

    done_at: float = 0.0  # time.perf_counter() at which the step ends on the device


class TimedBackend:
    """A device whose every step takes ``step_time`` seconds, computing the real tokens.

    The device works through its steps in order and on its own, like a CUDA stream: a step
    starts when it is handed over or when the previous step ends, whichever is later, and
    ends ``step_time`` later (or when its computation ends, if that takes longer:
    ``overruns`` counts those). ``compute`` (the overlapped loop's device half) computes the
    tokens with ``inner`` (any backend: ``ModelBackend``, ``SimBackend``, ...) and returns
    at once with the time the step ends (``TimedResult.done_at``); ``wait`` sleeps until
    then, which frees the GIL. ``run`` (the blocking loop) is the two in a row. So no thread
    has to wake up for a step to end, just as no host thread ends a GPU kernel. The answer
    (tokens, cost, clock) is the inner backend's, unchanged. ``busy`` sums the steps' device
    time, so a run's device and host time per step can be measured.
    """

    def __init__(self, inner: Any, step_time: float, spin: float = SPIN) -> None:
        if not isinstance(inner, Backend) or Capability.SPLITS_STEP not in inner.capabilities:
            raise ValueError(f"inner must be a backend that splits its steps into prepare() "
                             f"and compute(), got {inner!r}")
        if (
            isinstance(step_time, bool)
            or not isinstance(step_time, numbers.Real)
            or not (math.isfinite(step_time) and step_time >= 0)
        ):
            raise ValueError(f"step_time must be a number of seconds >= 0, got {step_time!r}")
        if isinstance(spin, bool) or not isinstance(spin, numbers.Real) or not spin >= 0:
            raise ValueError(f"spin must be a number of seconds >= 0, got {spin!r}")
        self.inner = inner
        self.step_time = float(step_time)
        self.spin = float(spin)
        self.time_unit: str = inner.time_unit
        self.cost_unit: str = inner.cost_unit
        self.eos_ids: tuple[int, ...] = inner.eos_ids
        self.max_context: int | None = inner.max_context
        self.vocab_size: int | None = inner.vocab_size
        # it times the inner backend's halves and ends each step itself; of the rest, only
        # what it passes on: chunks, and the inner backend's part in the host tier
        self.capabilities = frozenset({Capability.SPLITS_STEP, Capability.ENDS_OWN_STEPS,
                                       *inner.capabilities & PASSED_ON})
        self.steps = 0
        self.overruns = 0
        self.busy = 0.0  # seconds the device spent on steps
        self.waited = 0.0  # seconds the host spent in wait(), for the device to end a step
        self._free_at = 0.0  # time.perf_counter() at which the device ends its last step

    @property
    def device(self) -> Any:
        """Where the inner backend computes (``None``: no device of its own)."""
        return self.inner.device

    def attach_kv(self, capacity: int) -> SlotAllocator | None:
        """The inner backend's KV store (``None`` when it stores none)."""
        return self.inner.attach_kv(capacity)

    @property
    def pool(self) -> Any:
        """The inner backend's KV pool (``LENDS_KV_POOL``: the host tier copies it)."""
        return self.inner.pool

    def charge_host_copies(self, loaded: int, backed_up: int) -> None:
        """The inner backend times the host tier's copies (``TIMES_HOST_COPIES``)."""
        self.inner.charge_host_copies(loaded, backed_up)

    def attach_table(self, table: ReqToTokenTable | None) -> None:
        """The request-to-token table, for the inner backend."""
        self.inner.attach_table(table)

    def run(self, batch: Batch) -> BatchResult:
        """The inner backend's answer, once the device has spent ``step_time`` on it."""
        result = self.compute(self.prepare(batch))
        self.wait(result)
        return result

    def prepare(self, batch: Batch) -> Any:
        """The inner backend's ``prepare`` (the CPU half of a step, not timed)."""
        return self.inner.prepare(batch)

    def compute(
        self,
        step: Any,
        resolve: Callable[[torch.Tensor], torch.Tensor] | None = None,
        store: Callable[[list[int]], None] | None = None,
    ) -> TimedResult:
        """The inner backend's ``compute`` (``store`` included: on a GPU, writing the step's
        tokens is part of the step), stamped with the time the device ends the step."""
        handed = time.perf_counter()
        result = self.inner.compute(step, resolve, store)
        computed = time.perf_counter()
        start = max(handed, self._free_at)
        # Summed as durations, not as differences of clock readings (``start + t - start``
        # loses the low bits of t), so busy is never below steps x step_time.
        wanted = self.step_seconds(result)
        took = max(wanted, computed - start)
        if took > wanted:
            self.overruns += 1
        done_at = start + took
        self.steps += 1
        self.busy += took
        self._free_at = done_at
        return TimedResult(result.tokens, result.cost, result.elapsed, done_at)

    def step_seconds(self, result: BatchResult) -> float:
        """How long the device spends on the step that gave ``result``: ``step_time``."""
        return self.step_time

    def wait(self, result: BatchResult) -> None:
        """Return once the device has ended the step that gave ``result``.

        It sleeps until ``spin`` seconds before the end and spins the rest (CUDA can
        synchronise by spinning too): a sleeper wakes up a tenth of a millisecond late, on a
        busy machine far later, which would add to every step it waits for. Sleeping frees
        Python's lock for other threads (a server's); ``spin=math.inf`` never sleeps.
        ``waited`` adds up the time spent here.
        """
        start = time.perf_counter()
        done_at = result.done_at if isinstance(result, TimedResult) else 0.0
        if done_at - start > self.spin:
            time.sleep(done_at - start - self.spin)
        while (now := time.perf_counter()) < done_at:
            pass
        self.waited += now - start

    def release(self, req: Req) -> None:
        self.inner.release(req)

    def __repr__(self) -> str:
        return f"TimedBackend({self.inner!r}, step_time={self.step_time!r}, spin={self.spin!r})"


class PacedBackend(TimedBackend):
    """A device whose every step lasts ``pace`` times the inner backend's own time for it.

    Over a ``SimBackend`` that is the roofline time of the batch on the simulated GPU, so a
    server (``minisrv serve --model sim``) answers at the simulated H100's pace: a prefill
    of a long uncached prompt takes as long as it would there, a cached one far less, and
    the policies and the prefix cache change latency and throughput as they would on the
    GPU. ``pace`` > 1 slows every step alike (the host's own work per step then weighs
    less next to it).
    """

    def __init__(self, inner: Any, pace: float = 1.0) -> None:
        if (isinstance(pace, bool) or not isinstance(pace, numbers.Real)
                or not (math.isfinite(pace) and pace > 0)):
            raise ValueError(f"pace must be a number > 0, got {pace!r}")
        super().__init__(inner, 0.0)
        self.pace = float(pace)

    def step_seconds(self, result: BatchResult) -> float:
        """``pace`` times the step's time as the inner backend reports it (``elapsed``)."""
        return self.pace * result.elapsed

    def __repr__(self) -> str:
        return f"PacedBackend({self.inner!r}, pace={self.pace!r})"
