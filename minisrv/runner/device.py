"""Where the overlapped loop's steps run: a device thread, its CUDA stream, the future map.

The overlapped loop hands step i+1 to the device before step i's tokens are back on the
host. ``DeviceWorker`` is the device side of that hand-over: ``submit`` copies the batch's
inputs out (``backend.prepare``, on the caller's thread), reserves a future id per token
(``FutureMap``) and starts ``backend.compute`` on the device thread, where the future ids
are resolved from the previous step's tokens and this step's tokens are stored for the next.

On the CPU the device thread is a worker thread (torch releases the GIL in its kernels). On
a GPU the same thread issues each step's kernels on its own CUDA stream, so the main
thread's work on the default stream never waits behind a step, nor a step behind it. Steps
run one after the other in that thread and on that stream, which is what makes reusing a
slot freed by step i safe in step i+1. A device that ends its steps on its own (a backend
with ``wait(result)``: ``TimedBackend``) needs no thread: each step is handed to it on the
caller's thread, and ``wait`` is called before its result is used.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import torch

from minisrv.core import Batch, BatchResult, Capability, SelfTimedBackend, SplitBackend, require
from minisrv.runner.futures import FutureMap

__all__ = ["DeviceWorker", "Handed"]


class DeviceWorker:
    """Runs ``backend``'s steps off the scheduler's thread, one after the other.

    The backend must declare ``SPLITS_STEP``: ``run`` as ``prepare(batch)`` and
    ``compute(prepared, resolve, store)``, as ``ModelRunner``, ``SimBackend`` and
    ``TimedBackend`` do; its ``device`` (``None``: no GPU) says whether steps get a CUDA
    stream of their own. One that declares ``ENDS_OWN_STEPS`` gets no thread.
    ``on_launch(batch)`` is told of each step as it goes to the device (the KV owner keeps
    the table rows it reads until it completes).
    """

    def __init__(self, backend: SplitBackend, futures: int,
                 on_launch: Callable[[Batch], None] | None = None) -> None:
        require(backend, {Capability.SPLITS_STEP}, "overlap=True")
        self.backend = backend
        self.on_launch = on_launch
        self.futures = FutureMap(futures)
        self._wait = (cast(SelfTimedBackend, backend).wait
                      if Capability.ENDS_OWN_STEPS in backend.capabilities else None)
        self._thread = None if self._wait is not None else ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="minisrv-device")
        self.stream = step_stream(backend.device)

    def submit(self, batch: Batch) -> tuple[Future[BatchResult] | Handed, list[int]]:
        """Start ``batch`` on the device; return its answer-to-be and one future id per
        sampling entry (the placeholders of the tokens it is about to sample)."""
        prepared = self.backend.prepare(batch)
        if self.on_launch is not None:  # prepared: it will run (a failed prepare will not)
            self.on_launch(batch)
        future_ids, futures = self.futures.reserve_ids(sum(e.sample for e in batch.entries))
        if self._thread is None:
            return handed(self._compute, prepared, future_ids), futures
        return self._thread.submit(self._compute, prepared, future_ids), futures

    def call(self, work: Callable[[], Any]) -> None:
        """Run ``work`` where the steps run, after the step in flight and before the next
        submitted one (the host tier's KV copies)."""
        if self._thread is None:
            work()
        else:
            self._thread.submit(work)

    def result(self, handle: Future[BatchResult] | Handed) -> BatchResult:
        """Wait for a submitted step and return its answer (or raise its error)."""
        result = handle.result()
        if self._wait is not None:  # a device that ends its steps on its own
            self._wait(result)
        return result

    def _compute(self, prepared: Any, future_ids: torch.Tensor) -> BatchResult:
        """On the device thread (and its CUDA stream on a GPU): resolve futures, compute,
        store this step's tokens for the next step's futures, all as one step of the device."""

        def store(tokens: list[int]) -> None:
            self.futures.store(future_ids, tokens)

        if self.stream is None:
            return self.backend.compute(prepared, self.futures.resolve, store)
        self.stream.wait_stream(torch.cuda.default_stream(self.stream.device))  # prepare's copies
        with torch.cuda.stream(self.stream):
            return self.backend.compute(prepared, self.futures.resolve, store)


class Handed:
    """A step the device was handed on the loop's own thread, already answered: its result,
    or the error it raised, given back where the answer is waited for (as a ``Future`` from
    the device thread would, without a ``Future``'s lock and condition)."""

    __slots__ = ("_error", "_value")

    def __init__(self, value: BatchResult | None, error: BaseException | None) -> None:
        self._value, self._error = value, error

    def result(self) -> BatchResult:
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def exception(self) -> BaseException | None:
        return self._error


def handed(compute: Any, *args: Any) -> Handed:
    """``compute(*args)`` on this thread; an error is raised where the answer is waited for."""
    try:
        return Handed(compute(*args), None)
    except Exception as exc:  # noqa: BLE001 - re-raised by result()
        return Handed(None, exc)


def step_stream(device: str | torch.device | None) -> torch.cuda.Stream | None:
    """A CUDA stream for the device thread's steps when they compute on a GPU; ``None``
    elsewhere. It first waits for everything queued so far on the default stream (the
    weights and the KV pool may still be being written there)."""
    if device is None or torch.device(device).type != "cuda":
        return None
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream
