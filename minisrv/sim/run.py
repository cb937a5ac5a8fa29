"""``simulate``: serve a workload on the simulated GPU, the way the chapters measure policies.

The same ``Engine`` and scheduler as the real model, over ``SimBackend``: each step takes the
roofline time of its batch, so a policy, cache or mode shows its effect at GPU scale.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from minisrv.configs import H100, LLAMA3_8B, GPUSpec, ModelConfig
from minisrv.engine import Engine, EngineConfig, RunResult
from minisrv.sim.backend import SimBackend
from minisrv.workloads import Workload

__all__ = ["collector_paused", "simulate"]


def simulate(
    workload: Workload,
    config: EngineConfig | None = None,
    *,
    cfg: ModelConfig = LLAMA3_8B,
    gpu: GPUSpec = H100,
    dtype_bytes: float = 2,
    progress: bool = False,
    **options: Any,
) -> RunResult:
    """Serve ``workload`` on a simulated GPU (roofline step times); arrivals in seconds.

    ``options`` are those of ``EngineConfig``, with its defaults, except ``kv_capacity``:
    left out, it is all the memory the GPU has after the weights (LLaMA-3-8B on an H100:
    about 488k tokens), which is what a real server would give its pool.
    """
    backend = SimBackend(cfg, gpu, dtype_bytes)
    if "kv_capacity" not in options and config is None:
        options["kv_capacity"] = backend.kv_capacity()
    engine = Engine(backend, config, **options)
    with collector_paused():
        return engine.run_workload(workload, progress=progress)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off meanwhile, back on after if it was on.

    A run makes hundreds of thousands of objects (requests, token lists, step records) that
    live until it ends and almost no cycles (a few thousand objects for a 2,000-request
    cluster, freed at the first collection after it): the collections during a run find next
    to nothing, yet each traverses the young objects, and the full ones the whole heap with
    the chapter's earlier runs in it (a tenth of chapter 06's explorer's CPU time).
    Refcounting still frees everything else meanwhile.
    """
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
