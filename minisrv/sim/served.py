"""The engine ``minisrv serve --model sim`` serves: the simulated H100, at its own pace.

``--model sim`` (or ``sim:PACE``, e.g. ``sim:4``) serves LLaMA-3-8B on an H100 as the
roofline model times it (``SimBackend``): every step lasts its simulated time in wall-clock
time (``PacedBackend``, ``PACE`` times slower), while the scheduler, the prefix cache and
the HTTP server are the real ones. The tokens are the simulator's deterministic dummies,
drawn from CityLM's characters so the server can decode them; a request always runs to its
``max_tokens``. So an HTTP benchmark shows what the policies and the cache change on the GPU,
from a machine that has none.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from minisrv.configs import H100, LLAMA3_8B
from minisrv.engine import Engine
from minisrv.server.config import ServerConfig, simulated_pace
from minisrv.sim.backend import SimBackend
from minisrv.sim.timed import PacedBackend
from minisrv.tokenizer import SPECIAL_TOKENS, Tokenizer

__all__ = ["build_sim_engine", "sim_backend"]


def sim_backend(pace: float = 1.0) -> PacedBackend:
    """LLaMA-3-8B on an H100, each step ``pace`` times its roofline time, with dummy tokens
    among CityLM's characters (never ``<bos>`` or ``<eos>``)."""
    ids = range(len(SPECIAL_TOKENS), Tokenizer().vocab_size)
    return PacedBackend(SimBackend(LLAMA3_8B, H100, token_ids=ids), pace)


def build_sim_engine(config: ServerConfig) -> tuple[Engine, dict[str, Any]]:
    """The engine and limits of a ``sim`` server (``worker.build_engine``'s for a model).

    The automatic pool holds ``max_running`` requests at the full context, capped by the
    KV that fits in the simulated H100's memory after the weights.
    """
    pace = simulated_pace(config.model)
    if pace is None:
        raise ValueError(f"{config.model!r} is not a simulated model ('sim' or 'sim:PACE')")
    backend = sim_backend(pace)
    engine_config = config.engine
    if config.auto_kv:
        context = backend.max_context or 8192
        capacity = min(engine_config.max_running * context, backend.inner.kv_capacity())
        engine_config = dataclasses.replace(engine_config, kv_capacity=capacity)
    engine = Engine(backend, engine_config)
    limits = {"max_context": backend.max_context, "kv_capacity": engine.kv_capacity,
              "vocab_size": backend.vocab_size}
    return engine, limits
