"""The simulated GPU (book side): step times without a model, or a model at a set pace.

* ``backend.py``: ``SimBackend``, each step the roofline time of its batch, dummy tokens;
* ``timed.py``: ``TimedBackend``, real tokens from any backend, each step a set wall-clock
  time that passes without the host (as a GPU's kernels do); ``PacedBackend``, each step
  the inner backend's own time for it (a ``SimBackend``'s roofline time) in wall-clock time;
* ``served.py``: the simulated H100 behind the real server (``python -m minisrv.sim.served``);
* ``steptime.py``: ``decode_step_seconds``, one real decode step timed;
* ``run.py``: ``simulate``, a workload served by an ``Engine`` over ``SimBackend``;
* ``roofline.py``: the roofline time of a step on a GPU (``batch_step_cost``, ...);
* ``speedup.py``: what speculative decoding buys on the roofline (expected tokens per
  check, the speed-up against k and batch, where it stops paying);
* ``sizing.py``: a request's KV, the weights, how many requests a GPU holds (built on the
  runtime's ``minisrv.kvsize.kv_bytes_per_token``).

``simulate`` is imported on first use, so the backends load without the engine.
"""

from minisrv.sim.backend import SimBackend, SimStep
from minisrv.sim.timed import SPIN, PacedBackend, TimedBackend, TimedResult

__all__ = ["SPIN", "PacedBackend", "SimBackend", "SimStep", "TimedBackend", "TimedResult",
           "simulate"]


def __getattr__(name: str) -> object:
    if name == "simulate":
        from minisrv.sim.run import simulate

        return simulate
    raise AttributeError(f"module 'minisrv.sim' has no attribute {name!r}")
