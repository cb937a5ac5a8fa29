"""Zero-overhead scheduling: how much of a step is CPU work, and how much overlap can hide.

A serving loop alternates two kinds of work. The *CPU* receives requests, admits them,
matches prefixes, prepares the inputs and, once the step is done, appends tokens, checks
stops and streams. The *device* runs the forward. Run one after the other (the blocking
loop) the device waits for the CPU on every step; overlapped, the CPU forms step i+1 while
the device computes step i, and the CPU's time disappears as long as it is shorter than
the device's.

This module holds what can be known before the overlapped loop exists:

* ``timeline`` and ``throughput_ratio``: the two-lane model of both loops and the speed-up
  it predicts, ``(gpu + cpu) / max(gpu, cpu)``;
* ``TimedBackend``: a device whose step takes a set wall-clock time while computing the
  real tokens, so a measured gain can be held against that prediction on a CPU-only
  machine;
* ``time_steps``: where the real engine's time goes in each step, measured from outside
  the scheduler by timing its public calls.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from minisrv.request import Req
from minisrv.scheduler import Batch, BatchResult

__all__ = [
    "CPU_PARTS",
    "PARTS",
    "StepTiming",
    "StepTimings",
    "TimedBackend",
    "Timeline",
    "throughput_ratio",
    "time_steps",
    "timeline",
]

Interval = tuple[float, float]


# ----------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class Timeline:
    """Both lanes of a loop that ran ``n_steps`` steps: when each step used CPU and device.

    ``cpu[i]`` is the interval in which the CPU formed step i (scheduling, preparing its
    inputs, and processing the previous step's results); ``device[i]`` is step i's forward.
    Times are in the unit of the step times given to ``timeline`` (ms in the book).
    """

    overlap: bool
    cpu: tuple[Interval, ...]
    device: tuple[Interval, ...]

    @property
    def n_steps(self) -> int:
        return len(self.device)

    @property
    def total(self) -> float:
        """Time from the first CPU work to the end of the last forward."""
        return self.device[-1][1] if self.device else 0.0

    @property
    def device_busy(self) -> float:
        return sum(end - start for start, end in self.device)

    @property
    def device_idle(self) -> float:
        """Time the device waited for the CPU: what overlap exists to remove."""
        return self.total - self.device_busy

    @property
    def utilisation(self) -> float:
        """Share of the total time the device computed, in [0, 1]."""
        return self.device_busy / self.total if self.total > 0 else 0.0

    @property
    def device_gaps(self) -> list[Interval]:
        """The device lane's idle intervals (of positive length), for shading."""
        gaps, free = [], 0.0
        for start, end in self.device:
            if start > free:
                gaps.append((free, start))
            free = end
        return gaps


def _per_step(name: str, value: float | Sequence[float], n_steps: int) -> list[float]:
    """``value`` for each of ``n_steps`` steps, checked to be finite and >= 0."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        values = [float(value)] * n_steps
    elif isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n_steps:
            raise ValueError(f"{name} has {len(value)} entries for n_steps={n_steps}")
        values = [float(v) for v in value]
    else:
        raise ValueError(f"{name} must be a number or one number per step, got {value!r}")
    for v in values:
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must hold finite times >= 0, got {v!r}")
    return values


def timeline(
    gpu_step: float | Sequence[float],
    cpu_step: float | Sequence[float],
    n_steps: int,
    overlap: bool,
) -> Timeline:
    """The two-lane timeline of ``n_steps`` steps of the blocking or the overlapped loop.

    ``gpu_step`` / ``cpu_step``: the device's and the CPU's time per step (one number for
    all steps, or one per step). Blocking: the CPU forms step i, then the device runs it,
    then the CPU forms step i+1, so per step the device idles for the CPU's whole time.
    Overlapped: step i's CPU work starts as soon as the CPU is free and step i-2 has left
    the device (its results are what step i's CPU work processes, so the CPU runs at most
    one step ahead); step i's forward starts once its inputs are formed *and* the device
    is free. The device then idles only while the CPU is the slower lane, plus once at the
    start. With constant times the totals are ``n (gpu + cpu)`` and
    ``min(gpu, cpu) + n max(gpu, cpu)``.
    """
    if isinstance(n_steps, bool) or not isinstance(n_steps, numbers.Integral) or n_steps < 1:
        raise ValueError(f"n_steps must be an int >= 1, got {n_steps!r}")
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap must be True or False, got {overlap!r}")
    gpu = _per_step("gpu_step", gpu_step, int(n_steps))
    cpu = _per_step("cpu_step", cpu_step, int(n_steps))
    cpu_lane: list[Interval] = []
    dev_lane: list[Interval] = []
    for i, (g, c) in enumerate(zip(gpu, cpu)):
        prev_dev_end = dev_lane[-1][1] if dev_lane else 0.0
        if overlap:
            cpu_free = cpu_lane[-1][1] if cpu_lane else 0.0
            two_back = dev_lane[i - 2][1] if i >= 2 else 0.0
            cpu_start = max(cpu_free, two_back)
        else:
            cpu_start = prev_dev_end
        cpu_end = cpu_start + c
        dev_start = max(cpu_end, prev_dev_end)
        cpu_lane.append((cpu_start, cpu_end))
        dev_lane.append((dev_start, dev_start + g))
    return Timeline(overlap, tuple(cpu_lane), tuple(dev_lane))


def throughput_ratio(
    gpu_step: float, cpu_step: float, mean_output_len: float | None = None
) -> float:
    """Overlapped over blocking throughput in steady state: ``(gpu + cpu) / max(gpu, cpu)``.

    A blocking step costs ``gpu + cpu``; an overlapped one costs the slower lane. With
    ``mean_output_len`` = L the late stop check is counted too: every request computes one
    token it discards, so useful tokens shrink by ``L / (L + 1)``. GPU 5 ms, CPU 3 ms:
    1.6x; with L = 100: 1.58x.
    """
    for name, value in (("gpu_step", gpu_step), ("cpu_step", cpu_step)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name} must be a number, got {value!r}")
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    slower = max(gpu_step, cpu_step)
    if slower == 0:
        raise ValueError("gpu_step and cpu_step are both 0: a step must take some time")
    ratio = (gpu_step + cpu_step) / slower
    if mean_output_len is None:
        return float(ratio)
    if (
        isinstance(mean_output_len, bool)
        or not isinstance(mean_output_len, numbers.Real)
        or not (math.isfinite(mean_output_len) and mean_output_len > 0)
    ):
        raise ValueError(f"mean_output_len must be a number > 0 or None, got {mean_output_len!r}")
    return float(ratio * mean_output_len / (mean_output_len + 1))


# ----------------------------------------------------------------------------- the device
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
        self.eos_id: int | None = inner.eos_id
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


# ----------------------------------------------------------------------------- measuring
PARTS: tuple[str, ...] = (
    "receive",
    "schedule",
    "prefix match",
    "prepare inputs",
    "forward",
    "sample",
    "process results",
    "cache insert",
    "loop other",
)
"""Where a step's time goes, in loop order. Each part is exclusive (no double counting):

* receive: ``scheduler.receive_arrivals()``;
* schedule: ``get_next_batch_to_run()`` (policy, admission, KV slots, retraction) without
  the prefix matching it does;
* prefix match / cache insert: every ``tree.match_prefix`` / ``tree.insert`` call;
* prepare inputs: ``backend.run`` without the forward and the sampling (building the flat
  batch of ids and KV slots);
* forward: ``model.forward_flat``, the device's work;
* sample: ``sample_next`` for every request (greedy: argmax, read back to the CPU);
* process results: ``process_batch_result`` (append, stream, stop checks, free) without the
  cache inserts;
* loop other: the rest of ``scheduler.step()`` (trace record, statistics).
"""

CPU_PARTS: tuple[str, ...] = tuple(p for p in PARTS if p != "forward")
"""Everything but the forward: the work an overlapped loop can hide behind the device."""


@dataclass(frozen=True)
class StepTiming:
    """Seconds spent in each of ``PARTS`` during one step, and what the step computed."""

    seconds: dict[str, float]
    batch_size: int
    prefill_tokens: int

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    @property
    def cpu(self) -> float:
        return sum(self.seconds[p] for p in CPU_PARTS)

    @property
    def device(self) -> float:
        return self.seconds["forward"]


@dataclass(frozen=True)
class StepTimings:
    """A measured run: the tokens it generated (to check) and one ``StepTiming`` per step."""

    outputs: list[list[int]]
    steps: list[StepTiming] = field(default_factory=list)

    @property
    def cpu_share(self) -> float:
        """CPU time over the whole loop's time, in [0, 1]."""
        total = sum(s.total for s in self.steps)
        return sum(s.cpu for s in self.steps) / total if total > 0 else 0.0


class _Stopwatch:
    """Exclusive time per part: a call's time minus the time of timed calls nested in it."""

    def __init__(self, sync: Callable[[], None] | None) -> None:
        self.sync = sync
        self.current: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self._stack: list[float] = []  # per open call: time spent in calls nested inside it

    def time_step(self, step: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
        """Run one ``step()``; return its result and its seconds per part (fresh per step)."""
        self.current = seconds = dict.fromkeys(PARTS, 0.0)
        record = self.wrap("loop other", step)()
        return record, seconds

    def wrap(self, part: str, fn: Callable[..., Any], device: bool = False) -> Callable[..., Any]:
        """``fn`` timed: its exclusive seconds are added to ``part`` of the current step."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            if device and self.sync is not None:
                self.sync()  # queued CPU-launched work belongs to whoever queued it
            self._stack.append(0.0)
            start = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                if device and self.sync is not None:
                    self.sync()  # the forward ends when the device is done, not when queued
                return out
            finally:
                elapsed = time.perf_counter() - start
                nested = self._stack.pop()
                self.current[part] += elapsed - nested
                if self._stack:
                    self._stack[-1] += elapsed

        return timed


@contextmanager
def _patched(obj: Any, name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """Shadow ``obj.name`` with an instance attribute for the duration, then restore it."""
    had_own = name in vars(obj)
    own = vars(obj).get(name)
    setattr(obj, name, replacement)
    try:
        yield
    finally:
        if had_own:
            setattr(obj, name, own)
        else:
            delattr(obj, name)


def _find_model(backend: Any) -> Any:
    """The CityLM whose ``forward_flat`` the backend calls (a ``ModelBackend``'s model)."""
    model = getattr(backend, "model", None)
    if model is None or not callable(getattr(model, "forward_flat", None)):
        raise ValueError(
            "time_steps needs a backend that runs CityLM.forward_flat (a ModelBackend), "
            f"got {backend!r}"
        )
    return model


def time_steps(
    engine: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]
) -> StepTimings:
    """Serve ``prompts`` with ``engine.generate`` and time every part of every step.

    Timed from outside the scheduler: its public calls (``step``, ``receive_arrivals``,
    ``get_next_batch_to_run``, ``process_batch_result``), the prefix cache's
    ``match_prefix`` and ``insert``, ``backend.run``, the model's ``forward_flat`` and
    ``minisrv.backends.sample_next`` are shadowed by timing wrappers for the run and
    restored afterwards, so the engine is left as it was. On CUDA the forward is
    synchronised on both sides, so the forward's time is the device's and not the next
    ``.item()``'s. The wrappers cost about a microsecond per call, which lands in the parts
    that make the calls.
    """
    from minisrv import backends

    scheduler, backend = engine.scheduler, engine.backend
    model = _find_model(backend)
    sync = None
    if getattr(getattr(model, "device", None), "type", "cpu") == "cuda":
        import torch

        sync = torch.cuda.synchronize
    watch = _Stopwatch(sync)
    steps: list[StepTiming] = []
    step = scheduler.step

    def one_step() -> Any:
        record, seconds = watch.time_step(step)
        if record is not None:  # the last call finds nothing to do: not a step
            steps.append(StepTiming(seconds, record.batch_size, record.prefill_tokens))
        return record

    patches = [
        (scheduler, "step", one_step),
        (scheduler, "receive_arrivals", watch.wrap("receive", scheduler.receive_arrivals)),
        (scheduler, "get_next_batch_to_run",
         watch.wrap("schedule", scheduler.get_next_batch_to_run)),
        (scheduler, "process_batch_result",
         watch.wrap("process results", scheduler.process_batch_result)),
        (scheduler.tree, "match_prefix", watch.wrap("prefix match", scheduler.tree.match_prefix)),
        (scheduler.tree, "insert", watch.wrap("cache insert", scheduler.tree.insert)),
        (backend, "run", watch.wrap("prepare inputs", backend.run)),
        (model, "forward_flat", watch.wrap("forward", model.forward_flat, device=True)),
        (backends, "sample_next", watch.wrap("sample", backends.sample_next)),
    ]
    with ExitStack() as stack:
        for obj, name, fn in patches:
            stack.enter_context(_patched(obj, name, fn))
        outputs = engine.generate(prompts, max_new_tokens)
    return StepTimings(outputs, steps)
