"""Where the real engine's step time goes, measured from outside the scheduler.

``time_steps`` serves a workload with its engine's public calls shadowed by timing
wrappers, and reports per step the exclusive time of each part (``PARTS``): receiving,
scheduling, prefix matching, preparing inputs, the forward, sampling, processing results,
cache inserts and the loop's own bookkeeping. The forward and the sampling are the device's
work (``DEVICE_PARTS``: the model runner's ``compute`` runs both, on the device's thread or
stream); the rest is CPU work an overlapped loop could hide (``CPU_PARTS``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CPU_PARTS", "DEVICE_PARTS", "PARTS", "StepTiming", "StepTimings", "time_steps"]

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
* forward: ``ModelRunner.forward``, the device's work (any other backend: all of its ``run``);
* sample: ``sample_batch`` over the step's logits (greedy: one argmax), part of the device's
  work: ``ModelRunner.compute`` samples right after the forward;
* process results: ``process_batch_result`` (append, stream, stop checks, free) without the
  cache inserts;
* loop other: the rest of ``scheduler.step()`` (trace record, statistics).
"""

DEVICE_PARTS: tuple[str, ...] = ("forward", "sample")
"""The device's work: ``ModelRunner.compute`` runs the forward and then samples, on the
overlapped loop's device thread (a CUDA stream on a GPU), so overlap cannot hide them."""

CPU_PARTS: tuple[str, ...] = tuple(p for p in PARTS if p not in DEVICE_PARTS)
"""Everything but the device's work: what an overlapped loop can hide behind the device."""


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
        return sum(self.seconds[p] for p in DEVICE_PARTS)


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


def _flat_model(backend: Any) -> Any:
    """The CityLM a ``ModelRunner`` runs (its ``forward`` and sampler are timed apart);
    None for other backends."""
    model = getattr(backend, "model", None)
    if model is not None and callable(getattr(backend, "forward", None)):
        return model
    return None


def time_steps(
    engine: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]
) -> StepTimings:
    """Serve ``prompts`` with ``engine.generate`` and time every part of every step.

    Timed from outside the scheduler: its public calls (``step``, ``receive_arrivals``,
    ``get_next_batch_to_run``, ``process_batch_result``), the prefix cache's
    ``match_prefix`` and ``insert``, ``backend.run``, the runner's ``forward`` and
    ``minisrv.sampling.sample_batch`` are shadowed by timing wrappers for the run and
    restored afterwards, so the engine is left as it was. A backend that is not a
    ``ModelBackend`` (a ``SimBackend``, a ``TimedBackend``) is the device as a whole: all
    of ``backend.run`` counts as its forward. On CUDA the forward is
    synchronised on both sides, so the forward's time is the device's and not the next
    ``.item()``'s. The wrappers cost about a microsecond per call, which lands in the parts
    that make the calls.
    """
    from minisrv import sampling

    scheduler, backend = engine.scheduler, engine.backend
    model = _flat_model(backend)
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

    tree = scheduler.memory.tree
    patches = [
        (scheduler, "step", one_step),
        (scheduler, "receive_arrivals", watch.wrap("receive", scheduler.receive_arrivals)),
        (scheduler.former, "get_next_batch_to_run",
         watch.wrap("schedule", scheduler.former.get_next_batch_to_run)),
        (scheduler.completer, "process_batch_result",
         watch.wrap("process results", scheduler.completer.process_batch_result)),
        (tree, "match_prefix", watch.wrap("prefix match", tree.match_prefix)),
        (tree, "insert", watch.wrap("cache insert", tree.insert)),
    ]
    if model is None:
        patches.append((backend, "run", watch.wrap("forward", backend.run)))
    else:
        patches += [
            (backend, "run", watch.wrap("prepare inputs", backend.run)),
            (backend, "forward", watch.wrap("forward", backend.forward, device=True)),
            (sampling, "sample_batch", watch.wrap("sample", sampling.sample_batch, device=True)),
        ]
    with ExitStack() as stack:
        for obj, name, fn in patches:
            stack.enter_context(_patched(obj, name, fn))
        outputs = engine.generate(prompts, max_new_tokens)
    return StepTimings(outputs, steps)
