"""The scheduler-loop chapter's runs: the GPU-scale workload at several arrival rates under
each batching mode, on the simulated GPU.

``rate_runs`` keeps every run (a figure such as the chapter's dashboard needs the trace, not
only the metrics); ``sweep_table`` reads one row of metrics from each, and ``rate_sweep`` is
the two together; ``throughput_at_latency`` reads the sweep the way ORCA states its result, as
the throughput a mode sustains at a given latency. The default grid takes a few seconds; a
reader can pass more rates, more requests or other seeds. Progress bars are off unless
``progress=True``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from minisrv.engine import RunResult
from minisrv.sim import simulate
from minisrv.workloads import GPU_SCALE_BATCH_CAP, GPU_SCALE_REQUESTS, gpu_scale_workload

if TYPE_CHECKING:  # imported where a table is made: a run needs neither pandas nor tqdm
    import pandas as pd

__all__ = ["SimSetting", "rate_runs", "rate_sweep", "sweep_table", "throughput_at_latency"]


class SimSetting(NamedTuple):
    """One GPU-scale run: everything that decides its outcome, so two equal settings give
    the same run (the simulator is deterministic) and a run can be looked up by its setting."""

    rate: float
    mode: str = "prefill-first"
    max_running: int = GPU_SCALE_BATCH_CAP
    output_cv: float = 1.0
    n: int = GPU_SCALE_REQUESTS
    seed: int = 0

    def run(self) -> RunResult:
        """Serve the GPU-scale workload of this setting on the simulated H100, reserving
        prompt plus ``max_new_tokens`` at admission as the chapter does."""
        workload = gpu_scale_workload(n=self.n, rate=self.rate, output_cv=self.output_cv,
                                      seed=self.seed)
        return simulate(workload, mode=self.mode, max_running=self.max_running,
                        admission="reserve")


def rate_runs(rates: Sequence[float] = (8, 16, 32, 64),
              modes: Sequence[str] = ("static", "prefill-first"), n: int = GPU_SCALE_REQUESTS,
              max_running: int = GPU_SCALE_BATCH_CAP, output_cv: float = 1.0, seed: int = 0,
              progress: bool = False, runs: Mapping[SimSetting, RunResult] | None = None,
              ) -> dict[SimSetting, RunResult]:
    """Every (rate, mode) of the grid simulated once, by its ``SimSetting`` (each run takes
    seconds and holds its trace: tens of MB at 2000 requests). ``runs``: runs already made,
    found by their setting and not simulated again (the simulator is deterministic)."""
    from tqdm.auto import tqdm

    known = {} if runs is None else runs
    grid = [SimSetting(float(rate), mode, max_running, output_cv, n, seed)
            for rate in rates for mode in modes]
    return {s: known[s] if s in known else s.run()
            for s in tqdm(grid, desc="simulating", disable=not progress)}


def sweep_table(runs: Mapping[SimSetting, RunResult]) -> pd.DataFrame:
    """One row per run: its rate and mode, then its metrics."""
    import pandas as pd

    return pd.DataFrame([{"rate": s.rate, "mode": s.mode, **run.metrics.as_dict()}
                         for s, run in runs.items()])


def rate_sweep(rates: Sequence[float] = (8, 16, 32, 64),
               modes: Sequence[str] = ("static", "prefill-first"), n: int = GPU_SCALE_REQUESTS,
               max_running: int = GPU_SCALE_BATCH_CAP, output_cv: float = 1.0, seed: int = 0,
               progress: bool = False) -> pd.DataFrame:
    """Simulate the GPU-scale workload at each arrival rate under each mode (reserve
    admission, as in the scheduler-loop chapter): one row per (rate, mode) with the run's
    metrics. Pass more rates, more requests or other seeds to explore."""
    return sweep_table(rate_runs(rates, modes, n, max_running, output_cv, seed, progress))


def throughput_at_latency(sweep: pd.DataFrame, mode: str, latency: float) -> float:
    """The throughput at which ``mode``'s mean latency reaches ``latency`` (seconds), read off
    ``sweep`` (``sweep_table``) between the two arrival rates whose latencies enclose it.

    Latency grows with the rate, and it grows geometrically once the queue builds, so the
    reading interpolates throughput linearly in the logarithm of the latency. A target that
    the mode's lowest rate already exceeds has no answer here (``ValueError``: sweep lower
    rates); one that its highest rate stays under gives that rate's throughput, the most the
    sweep shows (a lower bound).
    """
    import numpy as np

    rows = sweep[sweep["mode"] == mode].sort_values("rate")
    lat, tput = rows["mean_latency"].to_numpy(), rows["throughput"].to_numpy()
    if not len(lat) or lat[0] > latency:
        raise ValueError(f"{mode}'s lowest rate already waits longer than {latency} s")
    above = np.flatnonzero(lat > latency)
    if not above.size:
        return float(tput[-1])
    hi = above[0]
    lo = hi - 1
    share = (np.log(latency) - np.log(lat[lo])) / (np.log(lat[hi]) - np.log(lat[lo]))
    return float(tput[lo] + share * (tput[hi] - tput[lo]))
