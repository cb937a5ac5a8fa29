"""The overlap chapter's measurements: what the late stop check wastes, and what overlap gains.

Each function builds fresh engines, serves a small workload, checks the outputs (against
each request alone, or between the two loops) and returns a DataFrame; ``minisrv.viz``
only draws. ``benchmarks/bench_overlap.py`` runs the same measurements at a larger scale.

* ``waste_by_length``: tokens the overlapped loop computes and discards, against the output
  length, with and without ``skip_finishing_decode``, next to the formula (one token per
  finished request: ``1 / L`` of the useful tokens);
* ``timed_gain``: blocking vs overlapped tokens/s on a ``TimedBackend`` whose steps last
  10 ms or more, with the host's scheduling work (DFS-weight over a long waiting queue, a
  full batch) at a chosen share of a blocking step, next to ``throughput_ratio``'s
  prediction (``timed_window`` times one loop's steady state);
* ``model_gain``: the same on a real model as it is (the forward in a worker thread).
"""

from __future__ import annotations

import gc
import math
import numbers
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

__all__ = ["LOOPS", "TimedWindow", "model_gain", "timed_engine", "timed_gain", "timed_window",
           "waste_by_length"]


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


class TimedWindow(NamedTuple):
    """One timed run's steady-state window, per step: wall time, device busy, host waiting."""

    wall: float  # seconds per step, the loop's wall clock
    busy: float  # seconds per step the device computed (TimedBackend.busy)
    waited: float  # seconds per step the loop slept or spun for the device (TimedBackend.waited)
    tokens: float  # tokens per step
    outputs: dict[int, list[int]]  # the finished requests' outputs, by request id

    @property
    def idle(self) -> float:
        """Seconds per step the device waited for the host: the host's lane, when blocking."""
        return self.wall - self.busy

    @property
    def host(self) -> float:
        """Seconds per step the loop's thread worked (did not wait for the device)."""
        return self.wall - self.waited


def timed_engine(waiting: int, device_s: float, overlap: bool, running: int,
                  output_len: int) -> tuple[Engine, TimedBackend]:
    """An engine over ``TimedBackend(SimBackend(), device_s)`` with ``running`` requests
    running and ``waiting`` more queued, ordered by DFS-weight over the radix tree.

    The scheduling work is real: every step DFS-weight matches each waiting prompt against
    the tree and orders the queue (it never falls back to FCFS), so the host's time per
    step grows with the queue, the same in both loops. The prompts fall into 16 groups that
    share 32 tokens. The first ``running`` requests want 1 to ``output_len`` tokens,
    evenly, as if they had been running a while; every later one ``output_len``. So from
    the first step on about ``running / output_len`` requests finish and as many join in
    every step: the steady state that ``throughput_ratio`` describes.
    """
    queued = running + waiting
    lengths = [1 + i % output_len if i < running else output_len for i in range(queued)]
    prompts = [[0, *range(2 + 100 * (i % 16), 34 + 100 * (i % 16)),
                *range(5000 + i % 97, 5008 + i % 97)] for i in range(queued)]
    backend = TimedBackend(SimBackend(), device_s, spin=math.inf)  # see timed_window
    engine = Engine(backend, mode="mixed", cache="radix", policy="dfs-weight",
                    overlap=overlap, skip_finishing_decode=True, max_running=running,
                    kv_capacity=running * (48 + output_len) + 4000, record_trace=False)
    for req in engine.make_requests(prompts, lengths):
        engine.add_request(req, checked=True)
    return engine, backend


def timed_window(waiting: int, device_s: float, overlap: bool, running: int,
                  output_len: int, warmup: int, steps: int) -> TimedWindow:
    """``steps`` steps of one loop, timed after ``warmup`` steps (the first prefills the
    whole batch at once), with the batch full and the queue long throughout.

    Python's cyclic garbage collector is off while the loop runs: a collection stops
    whichever step it falls on for tens of milliseconds (servers freeze or tune the
    collector for the same reason). And the loop waits for the device by spinning, never
    asleep (``spin=math.inf``, as CUDA's spinning synchronisation does): on a busy machine a
    sleeper can wake up milliseconds late, which would lengthen every blocking step alone.
    """
    if waiting < (warmup + steps + 2) * running // output_len:
        raise ValueError(f"{waiting} waiting requests run dry within {warmup + steps} steps")
    engine, backend = timed_engine(waiting, device_s, overlap, running, output_len)
    stats = engine.stats
    gc.collect()
    gc.disable()
    try:
        for _ in range(warmup):
            engine.step()
        start, busy, waited, tokens = (time.perf_counter(), backend.busy, backend.waited,
                                       stats.generated_tokens)
        finished: dict[int, list[int]] = {}
        for _ in range(steps):
            finished.update((req.rid, req.output) for req in engine.step().finished)
        wall = time.perf_counter() - start
    finally:
        gc.enable()
    return TimedWindow(wall / steps, (backend.busy - busy) / steps,
                   (backend.waited - waited) / steps, (stats.generated_tokens - tokens) / steps,
                   finished)


def timed_gain(shares: Sequence[float] = (0.3, 0.6), device_ms: float = 10.0,
               running: int = 256, output_len: int = 32, steps: int = 14, warmup: int = 3,
               repeats: int = 5) -> pd.DataFrame:
    """Blocking vs overlapped on a timed simulated device, one row per target host share.

    The device's step lasts ``device_ms`` at least (a memory-bound decode step costs about
    the same at any batch), long enough that timer and wake-up jitter are small next to
    it. The host's share of a blocking step is set by the scheduling work: the length of
    the waiting queue that DFS-weight orders every step (``timed_engine``). Short blocking
    runs at two queue lengths measure the host's fixed time per step and its time per
    waiting request (each the least of three runs); each share s then gets the queue whose
    host time should be ``device s / (1 - s)``, and the host time of that queue (again the
    least of three) sets the device step, so the share of the least disturbed runs lands
    near its target.

    Both loops then serve the same requests ``repeats`` times, taking turns, each run timed
    over ``steps`` steps (``timed_window``), and each loop is represented by its fastest
    run (the least of N wall times, as ``timeit`` reports). On a shared machine a run is
    only ever slowed, and unevenly: a blocking loop preempted while it waits for the device
    loses nothing, an overlapped one preempted while it forms the next step leaves the
    device idle. The fastest run of each is the one least disturbed. The fastest blocking
    run's lanes (device busy and device idle per step) give the realised host share and
    ``throughput_ratio``'s prediction, the two fastest runs' tokens/s the measured gain.
    ``outputs identical``: the requests that finished in both loops got the same tokens.
    """
    running = check_int("running", running, minimum=1)
    output_len = check_int("output_len", output_len, minimum=2)
    steps = check_int("steps", steps, minimum=1)
    warmup = check_int("warmup", warmup, minimum=1)
    repeats = check_int("repeats", repeats, minimum=1)
    if isinstance(device_ms, bool) or not (isinstance(device_ms, numbers.Real)
                                           and math.isfinite(device_ms) and device_ms > 0):
        raise ValueError(f"device_ms must be a number of milliseconds > 0, got {device_ms!r}")
    if not shares:
        raise ValueError("shares must name at least one host share")
    for share in shares:
        if not 0 < share < 1:
            raise ValueError(f"each host share must lie strictly between 0 and 1, got {share!r}")
    device = device_ms / 1e3
    probe = 5  # steps of each short run that measures the host's time
    # the queue must not run dry in a timed window nor in a probe (a loaded probe can make
    # the estimate ask for the shortest queue)
    least = (warmup + max(steps, probe) + 2) * running // output_len + 1

    def host_time(waiting: int) -> float:
        """The host's time per blocking step with ``waiting`` queued: the least of three
        short runs (a loaded moment only ever lengthens one)."""
        return min(timed_window(waiting, 1e-3, False, running, output_len, warmup, probe).idle
                   for _ in range(3))

    # the host's time per step is a fixed part (the running batch) plus a part per waiting
    # request (DFS-weight's pass over the queue): two queue lengths give both
    small, large = max(least, 500), max(least, 500) + 1000
    fixed_and_small, fixed_and_large = host_time(small), host_time(large)
    per_waiting = max((fixed_and_large - fixed_and_small) / (large - small), 1e-9)
    fixed = max(fixed_and_small - per_waiting * small, 0.0)
    rows = []
    for share in shares:
        # a queue a little longer than the estimate: the device step is then set from its
        # measured host time, and stays at least device_ms
        target = 1.1 * device * share / (1 - share)
        waiting = max(least, round((target - fixed) / per_waiting))
        step_s = max(device, host_time(waiting) * (1 - share) / share)
        blocks, overs = [], []
        for _ in range(repeats):
            blocks.append(timed_window(waiting, step_s, False, running, output_len, warmup,
                                       steps))
            overs.append(timed_window(waiting, step_s, True, running, output_len, warmup,
                                      steps))
        same = all(block.outputs[rid] == out for block in blocks for over in overs
                   for rid, out in over.outputs.items() if rid in block.outputs)
        block = min(blocks, key=lambda run: run.wall / run.tokens)
        over = min(overs, key=lambda run: run.wall / run.tokens)
        measured = (over.tokens / over.wall) / (block.tokens / block.wall)
        predicted = throughput_ratio(block.busy, block.idle)
        rows.append({
            "target host %": 100 * share,
            "waiting": waiting,
            "host %": 100 * block.idle / block.wall,
            "device ms": 1e3 * step_s,
            "host ms, blocking": 1e3 * block.idle,
            "host ms, overlapped": 1e3 * over.host,
            # wall minus busy: timer jitter can take a fully busy device a hair below 0
            "device idle ms, overlapped": max(0.0, 1e3 * over.idle),
            "blocking tok/s": block.tokens / block.wall,
            "overlapped tok/s": over.tokens / over.wall,
            "measured gain": measured,
            "predicted gain": predicted,
            "measured / predicted": measured / predicted,
            "outputs identical": same,
        })
    return pd.DataFrame(rows).set_index("target host %")


LOOPS: dict[str, dict[str, bool]] = {
    "blocking": {"overlap": False},
    "overlapped": {"overlap": True, "skip_finishing_decode": False},
    "overlapped, skip_finishing_decode": {"overlap": True, "skip_finishing_decode": True},
}
"""The loops ``model_gain`` compares, with the ``Engine`` options that select them:
"overlapped" is the late stop check in full, the other the default (SGLang's)."""


def model_gain(model: Any, prompts: Sequence[Sequence[int]], lengths: int | Sequence[int],
               repeats: int = 2, reference: Sequence[Sequence[int]] | None = None,
               warm_up: bool = True, **options: Any) -> pd.DataFrame:
    """Each loop of ``LOOPS`` on ``model`` as it is, one row per loop (the fastest of
    ``repeats`` runs, the loops taking turns): tokens/s, the gain over blocking, the lowest
    and highest gain of one run over the blocking run of its turn (the spread that noise
    alone gives), steps, late-stop tokens, and whether every output equals the request
    generated alone.

    ``reference``: the outputs of each request generated alone, where the caller has them
    already (else ``reference_generate`` here). ``warm_up``: serve the workload once with
    every loop before timing; a caller whose model has just served it may skip that (a
    run's first forwards, not the loops, pay the warm-up, and the fastest of ``repeats``
    runs counts anyway). ``options`` go to ``Engine`` (the same for every loop)."""
    repeats = check_int("repeats", repeats, minimum=1)
    counts = [lengths] * len(prompts) if isinstance(lengths, int) else list(lengths)
    if reference is None:
        reference = [model.reference_generate(p, m)
                     for p, m in zip(prompts, counts, strict=True)]
    elif len(reference) != len(prompts):
        raise ValueError(f"reference holds {len(reference)} outputs for {len(prompts)} prompts")
    reference = [list(ref) for ref in reference]
    walls: dict[str, list[float]] = {name: [] for name in LOOPS}
    same = dict.fromkeys(LOOPS, True)
    engines: dict[str, Engine] = {}
    for loop in LOOPS.values() if warm_up else ():
        Engine(model, **loop, **options).generate(prompts, lengths)  # warm-up
    for _ in range(repeats):  # the loops take turns: a busy moment falls on all of them
        for name, loop in LOOPS.items():
            engines[name] = engine = Engine(model, **loop, **options)
            start = time.perf_counter()
            outputs = engine.generate(prompts, lengths)
            walls[name].append(time.perf_counter() - start)
            same[name] = same[name] and outputs == reference
    rate = {name: [engine.stats.generated_tokens / wall for wall in walls[name]]
            for name, engine in engines.items()}
    turns = {name: [r / b for r, b in zip(rate[name], rate["blocking"], strict=True)]
             for name in engines}
    rows = {
        name: {
            "tokens/s": max(rate[name]),
            "gain, lowest run": min(turns[name]),
            "gain, highest run": max(turns[name]),
            "steps": engine.stats.steps,
            "late-stop tokens": engine.stats.late_stop_tokens,
            "outputs identical to each request alone": same[name],
        }
        for name, engine in engines.items()
    }
    frame = pd.DataFrame.from_dict(rows, orient="index")
    frame.insert(1, "gain", frame["tokens/s"] / frame.loc["blocking", "tokens/s"])
    return frame
