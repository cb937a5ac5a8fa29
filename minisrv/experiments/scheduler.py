"""The scheduler-loop chapter's sweep: the GPU-scale workload at several arrival rates under
each batching mode, on the simulated GPU.

The default grid takes a few seconds; a reader can pass more rates, more requests or other
seeds. Progress bars are off unless ``progress=True``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
from tqdm.auto import tqdm

from minisrv.sim import simulate
from minisrv.workloads import GPU_SCALE_BATCH_CAP, gpu_scale_workload

__all__ = ["rate_sweep"]


def rate_sweep(rates: Sequence[float] = (8, 16, 32, 64),
               modes: Sequence[str] = ("static", "prefill-first"), n: int = 2000,
               max_running: int = GPU_SCALE_BATCH_CAP, output_cv: float = 1.0, seed: int = 0,
               progress: bool = False) -> pd.DataFrame:
    """Simulate the GPU-scale workload at each arrival rate under each mode (reserve
    admission, as in the scheduler-loop chapter).

    One row per (rate, mode) with the run's metrics. The default grid takes a few seconds;
    pass more rates, more requests or other seeds to explore (each run is about a second).
    """
    rows = []
    grid = [(rate, mode) for rate in rates for mode in modes]
    for rate, mode in tqdm(grid, desc="simulating", disable=not progress):
        workload = gpu_scale_workload(n=n, rate=rate, output_cv=output_cv, seed=seed)
        metrics = simulate(workload, mode=mode, max_running=max_running,
                           admission="reserve").metrics
        rows.append({"rate": rate, "mode": mode, **metrics.as_dict()})
    return pd.DataFrame(rows)
