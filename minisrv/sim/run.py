"""``simulate``: serve a workload on the simulated GPU, the way the chapters measure policies.

The same ``Engine`` and scheduler as the real model, over ``SimBackend``: each step takes the
roofline time of its batch, so a policy, cache or mode shows its effect at GPU scale.
"""

from __future__ import annotations

from typing import Any

from minisrv.configs import H100, LLAMA3_8B, GPUSpec, ModelConfig
from minisrv.engine import Engine, EngineConfig, RunResult
from minisrv.sim.backend import SimBackend
from minisrv.workloads import Workload

__all__ = ["simulate"]


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
    return engine.run_workload(workload, progress=progress)
