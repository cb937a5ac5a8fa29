"""The two-lane model of a serving loop: the CPU forms steps, the device computes them.

Blocking, the lanes alternate and the device waits for the CPU on every step; overlapped,
the CPU forms step i+1 while the device computes step i. ``timeline`` lays out both
loops step by step and ``throughput_ratio`` gives the steady-state gain of overlap,
``(gpu + cpu) / max(gpu, cpu)``: the CPU's time disappears as long as it is shorter than
the device's.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Interval", "Timeline", "late_stop_waste", "throughput_ratio", "timeline"]

Interval = tuple[float, float]


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


def _lane_times(gpu_step: float | Sequence[float], cpu_step: float | Sequence[float],
                n_steps: int, overlap: bool) -> tuple[list[float], list[float]]:
    """``timeline``'s arguments checked, its step times as one list per lane (kept apart so
    that ``timeline`` reads as the loop the overlap chapter shows)."""
    if isinstance(n_steps, bool) or not isinstance(n_steps, numbers.Integral) or n_steps < 1:
        raise ValueError(f"n_steps must be an int >= 1, got {n_steps!r}")
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap must be True or False, got {overlap!r}")
    return (_per_step("gpu_step", gpu_step, int(n_steps)),
            _per_step("cpu_step", cpu_step, int(n_steps)))


def _check_ratio_args(gpu_step: float, cpu_step: float, mean_output_len: float | None,
                      waste_step: float) -> None:
    """``throughput_ratio``'s arguments: finite times >= 0, not both 0, one count of waste
    (kept apart so that ``throughput_ratio`` reads as its formula)."""
    if isinstance(waste_step, bool) or not isinstance(waste_step, numbers.Real) \
            or not (math.isfinite(waste_step) and waste_step >= 0):
        raise ValueError(f"waste_step must be a finite number >= 0, got {waste_step!r}")
    if waste_step and mean_output_len is not None:
        raise ValueError("give mean_output_len (waste counted in tokens) or waste_step "
                         "(waste counted in time), not both")
    for name, value in (("gpu_step", gpu_step), ("cpu_step", cpu_step)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name} must be a number, got {value!r}")
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    if max(gpu_step, cpu_step) == 0:
        raise ValueError("gpu_step and cpu_step are both 0: a step must take some time")
    if mean_output_len is not None and (
        isinstance(mean_output_len, bool)
        or not isinstance(mean_output_len, numbers.Real)
        or not (math.isfinite(mean_output_len) and mean_output_len > 0)
    ):
        raise ValueError(f"mean_output_len must be a number > 0 or None, got {mean_output_len!r}")


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
    gpu, cpu = _lane_times(gpu_step, cpu_step, n_steps, overlap)
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
    gpu_step: float, cpu_step: float, mean_output_len: float | None = None, *,
    waste_step: float = 0.0
) -> float:
    """Overlapped over blocking throughput in steady state: ``(gpu + cpu) / max(gpu, cpu)``.

    A blocking step costs ``gpu + cpu``; an overlapped one costs the slower lane. With
    ``mean_output_len`` = L the late stop check is counted too: every request computes one
    token it discards, so useful tokens shrink by ``L / (L + 1)``. GPU 5 ms, CPU 3 ms:
    1.6x; with L = 100: 1.58x. That counts a discarded token as costing what a useful one
    does, an upper bound on its price.

    ``waste_step`` counts it in time instead: the device time the discarded rows add to each
    overlapped step (``late_stop_waste``), so the overlapped step costs
    ``max(gpu + waste_step, cpu)``. In a memory-bound decode step an extra row adds only its
    own KV read, far less than an average row's share of the step. Give one or the other.
    """
    _check_ratio_args(gpu_step, cpu_step, mean_output_len, waste_step)
    ratio = (gpu_step + cpu_step) / max(gpu_step + waste_step, cpu_step)
    if mean_output_len is None:
        return float(ratio)
    return float(ratio * mean_output_len / (mean_output_len + 1))


def late_stop_waste(cfg: Any, gpu: Any, batch_size: int, context_len: int,
                    mean_output_len: float, dtype_bytes: float = 2) -> float:
    """Seconds the late stop check adds to one overlapped decode step, on the roofline.

    In steady state ``batch_size / mean_output_len`` requests finish per step, and each is
    decoded once more for a token that is thrown away. Each such row costs what one more
    request costs the step, ``decode_step_time(batch + 1) - decode_step_time(batch)``: its
    KV read and its arithmetic, not a share of the weights, which the step reads anyway.
    LLaMA-3-8B on an H100, 64 requests at context 1024, L = 8: 8 rows of about 40 us, a
    few percent of the 7.36 ms step, where counting tokens says 1/9 of the work.
    """
    from minisrv.sim.roofline import decode_step_time

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if isinstance(mean_output_len, bool) or not isinstance(mean_output_len, numbers.Real) \
            or not (math.isfinite(mean_output_len) and mean_output_len > 0):
        raise ValueError(f"mean_output_len must be a number > 0, got {mean_output_len!r}")
    row = (decode_step_time(cfg, gpu, batch_size + 1, context_len, dtype_bytes)
           - decode_step_time(cfg, gpu, batch_size, context_len, dtype_bytes))
    return batch_size / mean_output_len * row
