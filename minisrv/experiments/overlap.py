"""The overlap chapter's measurements: what the late stop check wastes, and what overlap gains.

Each function builds fresh engines, serves a small workload, checks the outputs (against
each request alone, or between the two loops) and returns a DataFrame; ``minisrv.viz``
only draws. ``benchmarks/bench_overlap.py`` runs the same measurements at a larger scale.

* ``waste_by_length``: tokens the overlapped loop computes and discards, against the output
  length, with and without ``skip_finishing_decode``, next to the formula (one token per
  finished request: ``1 / L`` of the useful tokens);
* ``timed_gain``: blocking vs overlapped tokens/s on a ``TimedBackend`` whose step time puts
  the CPU at a chosen share of a blocking step, next to ``throughput_ratio``'s prediction;
* ``model_gain``: the same on a real model as it is (the forward in a worker thread).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import pandas as pd

from minisrv.checks import check_int
from minisrv.engine import Engine
from minisrv.experiments.lanes import throughput_ratio
from minisrv.sampling import SamplingParams
from minisrv.sim import SimBackend
from minisrv.sim.timed import TimedBackend

__all__ = ["LOOPS", "model_gain", "timed_gain", "waste_by_length"]


def waste_by_length(
    model: Any, prompts: Sequence[Sequence[int]], lengths: Sequence[int], **options: Any
) -> pd.DataFrame:
    """Serve ``prompts`` overlapped, every request running to exactly L tokens
    (``ignore_eos``), for each L in ``lengths``; one row per L.

    Columns: the finished requests, the useful tokens, the wasted ones with
    ``skip_finishing_decode`` off and on, the waste as a share of the useful tokens, the
    formula ``1 / L``, and whether every output equals the request generated alone.
    ``options`` go to ``Engine`` (``mode="mixed"`` decodes every running request in every
    step, so every finish is followed by a step that still computes the finished request).
    """
    if not lengths:
        raise ValueError("lengths must name at least one output length")
    rows = []
    for length in lengths:
        length = check_int("output length", length, minimum=1)
        params = SamplingParams(max_new_tokens=length, ignore_eos=True)
        reference = [model.reference_generate(p, length, ignore_eos=True) for p in prompts]
        row: dict[str, Any] = {"output length": length}
        same = True
        for skip in (False, True):
            engine = Engine(model, overlap=True, skip_finishing_decode=skip, **options)
            outputs = engine.generate(prompts, sampling=params)
            same = same and outputs == reference
            stats = engine.stats
            if not skip:
                row["finished"] = stats.finished
                row["useful tokens"] = stats.generated_tokens
                row["wasted"] = stats.wasted_tokens
            else:
                row["wasted, skip_finishing_decode"] = stats.wasted_tokens
        row["waste %"] = 100 * row["wasted"] / row["useful tokens"]
        row["formula 1/L %"] = 100 / length
        row["outputs identical"] = same
        rows.append(row)
    return pd.DataFrame(rows).set_index("output length")


class _TimedRun(NamedTuple):
    wall: float  # seconds the loop ran (Scheduler.run)
    busy: float  # seconds the device's steps took (TimedBackend.busy)
    waited: float  # seconds the loop waited for the device to end a step (TimedBackend.waited)
    steps: int
    outputs: list[list[int]]

    @property
    def device(self) -> float:
        """Seconds per step on the device."""
        return self.busy / self.steps

    @property
    def outside(self) -> float:
        """Seconds per step the device was not computing: waiting for the CPU."""
        return (self.wall - self.busy) / self.steps

    @property
    def cpu(self) -> float:
        """Seconds per step the loop's thread worked (did not wait for the device)."""
        return (self.wall - self.waited) / self.steps


def _serve_timed(step_time: float, overlap: bool, prompts: list[list[int]],
                 output_len: list[int], max_running: int) -> _TimedRun:
    """One run on ``TimedBackend(SimBackend(), step_time)``.

    The wall time is the loop's alone (``Engine.run``): building and queueing the
    requests happens once per run, before any step, and is no step's CPU work.
    """
    backend = TimedBackend(SimBackend(), step_time)
    engine = Engine(backend, mode="mixed", overlap=overlap, skip_finishing_decode=True,
                    max_running=max_running, kv_capacity=100_000, record_trace=False)
    reqs = engine.make_requests(prompts, output_len)
    for req in reqs:
        engine.add_request(req)
    start = time.perf_counter()
    engine.run()
    wall = time.perf_counter() - start
    return _TimedRun(wall, backend.busy, backend.waited, engine.stats.steps,
                     [req.output for req in reqs])


def _best(step_time: float, overlap: bool, prompts: list[list[int]], output_len: list[int],
          max_running: int, repeats: int) -> _TimedRun:
    """The fastest of ``repeats`` runs (a shared machine only ever adds time)."""
    runs = [_serve_timed(step_time, overlap, prompts, output_len, max_running)
            for _ in range(repeats)]
    return min(runs, key=lambda run: run.wall)


def _best_pair(step_time: float, prompts: list[list[int]], output_len: list[int],
               max_running: int, repeats: int) -> tuple[_TimedRun, _TimedRun]:
    """The fastest blocking and the fastest overlapped of ``repeats`` runs each, taken in
    turns so that a busy moment of the machine falls on both loops alike."""
    block: list[_TimedRun] = []
    over: list[_TimedRun] = []
    for _ in range(repeats):
        block.append(_serve_timed(step_time, False, prompts, output_len, max_running))
        over.append(_serve_timed(step_time, True, prompts, output_len, max_running))
    return min(block, key=lambda run: run.wall), min(over, key=lambda run: run.wall)


def timed_gain(shares: Sequence[float] = (0.1, 0.3, 0.6), n_requests: int = 1024,
               output_len: int = 16, max_running: int = 128, repeats: int = 2) -> pd.DataFrame:
    """Blocking vs overlapped on a timed simulated device, one row per target CPU share.

    The requests want ``output_len // 2`` to ``output_len // 2 + output_len`` tokens
    (``output_len`` on average), spread evenly, so that after the first batch some
    requests finish and others join in every step: the steady state of continuous batching,
    which is what ``throughput_ratio`` describes (equal lengths would finish in waves, and
    the step after each wave can only be formed once the wave is seen to finish).

    A first blocking run with a device that takes 1 ms measures the loop's CPU time per
    step: the time the device was *not* busy. For each share s the device step is set to
    ``cpu (1 - s) / s``, and both loops serve the same requests (the fastest of
    ``repeats`` runs each, taking turns). Each run is split into its two lanes: per step,
    the time the device was busy (``TimedBackend.busy``) and the time it was idle (the rest
    of the wall time). The blocking run's lanes give the realised CPU share and
    ``throughput_ratio``'s prediction, which the measured gain (blocking wall time /
    overlapped wall time) is held against; the overlapped run's lanes show where its time
    went, and its CPU time per step (the wall time it did not spend waiting for the device)
    shows what the overlapped loop's own bookkeeping costs next to the blocking loop's
    (``device idle ms, blocking``).
    """
    n_requests = check_int("n_requests", n_requests, minimum=1)
    output_len = check_int("output_len", output_len, minimum=1)
    max_running = check_int("max_running", max_running, minimum=1)
    repeats = check_int("repeats", repeats, minimum=1)
    for share in shares:
        if not 0 < share < 1:
            raise ValueError(f"each CPU share must lie strictly between 0 and 1, got {share!r}")
    prompts = [[0, *range(2, 2 + 32 + i % 32)] for i in range(n_requests)]
    lengths = [max(1, output_len // 2 + (7 * i) % (output_len + 1)) for i in range(n_requests)]
    args = (prompts, lengths, max_running, repeats)
    cpu = _best(1e-3, False, *args).outside
    tokens = sum(lengths)
    rows = []
    for share in shares:
        block, over = _best_pair(cpu * (1 - share) / share, *args)
        rows.append({
            "target CPU %": 100 * share,
            "CPU %": 100 * block.outside / (block.outside + block.device),
            "blocking tok/s": tokens / block.wall,
            "overlapped tok/s": tokens / over.wall,
            "measured gain": block.wall / over.wall,
            "predicted gain": throughput_ratio(block.device, block.outside),
            "device busy ms, blocking": 1e3 * block.device,
            "device idle ms, blocking": 1e3 * block.outside,
            "device busy ms, overlapped": 1e3 * over.device,
            "device idle ms, overlapped": 1e3 * over.outside,
            "CPU ms, overlapped": 1e3 * over.cpu,
            "outputs identical": block.outputs == over.outputs,
        })
    return pd.DataFrame(rows).set_index("target CPU %")


LOOPS: dict[str, dict[str, bool]] = {
    "blocking": {"overlap": False},
    "overlapped": {"overlap": True},
    "overlapped, skip_finishing_decode": {"overlap": True, "skip_finishing_decode": True},
}
"""The loops ``model_gain`` compares, with the ``Engine`` options that select them."""


def model_gain(model: Any, prompts: Sequence[Sequence[int]], lengths: int | Sequence[int],
               repeats: int = 2, **options: Any) -> pd.DataFrame:
    """Each loop of ``LOOPS`` on ``model`` as it is, one row per loop (the fastest of
    ``repeats`` runs after a warm-up, the loops taking turns): tokens/s, the gain over
    blocking, steps, late-stop tokens, and whether every output equals the request
    generated alone.
    ``options`` go to ``Engine`` (the same for every loop)."""
    repeats = check_int("repeats", repeats, minimum=1)
    counts = [lengths] * len(prompts) if isinstance(lengths, int) else list(lengths)
    reference = [model.reference_generate(p, m) for p, m in zip(prompts, counts, strict=True)]
    best = dict.fromkeys(LOOPS, float("inf"))
    same = dict.fromkeys(LOOPS, True)
    engines: dict[str, Engine] = {}
    for loop in LOOPS.values():
        Engine(model, **loop, **options).generate(prompts, lengths)  # warm-up
    for _ in range(repeats):  # the loops take turns: a busy moment falls on all of them
        for name, loop in LOOPS.items():
            engines[name] = engine = Engine(model, **loop, **options)
            start = time.perf_counter()
            outputs = engine.generate(prompts, lengths)
            best[name] = min(best[name], time.perf_counter() - start)
            same[name] = same[name] and outputs == reference
    rows = {
        name: {
            "tokens/s": engine.stats.generated_tokens / best[name],
            "steps": engine.stats.steps,
            "late-stop tokens": engine.stats.late_stop_tokens,
            "outputs identical to each request alone": same[name],
        }
        for name, engine in engines.items()
    }
    frame = pd.DataFrame.from_dict(rows, orient="index")
    frame.insert(1, "gain", frame["tokens/s"] / frame.loc["blocking", "tokens/s"])
    return frame
