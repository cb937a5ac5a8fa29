"""The simulated H100 behind the real server: ``python -m minisrv.sim.served [serve flags]``.

``python -m minisrv.sim.served --model sim:4 --port 30000`` is ``minisrv serve`` with
LLaMA-3-8B on an H100 as the roofline model times it (``SimBackend``) in place of a model:
every step lasts its simulated time in wall-clock time (``PacedBackend``; ``sim:PACE``
makes it PACE times slower, plain ``sim`` is real time), while the HTTP server, the
scheduler and the prefix cache are the real ones. The tokens are the simulator's
deterministic dummies, drawn from CityLM's characters so the server can decode them; a
request always runs to its ``max_tokens``. So an HTTP benchmark shows what the policies and
the cache change on the GPU, from a machine that has none.

The server (the runtime) imports nothing of the book: this module hands it
``build_sim_engine`` as ``ServerConfig.builder`` and CityLM's tokenizer as the codec.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from typing import Any

from minisrv.configs import H100, LLAMA3_8B
from minisrv.engine import Engine
from minisrv.server.config import DEFAULT_MAX_REQUEST_BYTES, ServerConfig
from minisrv.sim.backend import SimBackend
from minisrv.sim.timed import PacedBackend
from minisrv.tokenizer import SPECIAL_TOKENS, Tokenizer

__all__ = ["SIM_CONTEXT", "build_sim_engine", "main", "sim_backend", "sim_config",
           "simulated_pace"]

SIM_CONTEXT = LLAMA3_8B.max_seq_len
"""The simulated model's context in tokens (LLaMA-3-8B's)."""


def simulated_pace(model: str) -> float | None:
    """The pace a model name asks for (``"sim"``: 1, ``"sim:4"``: 4); ``None`` for any
    other name. ValueError for a pace that is not a finite number > 0."""
    name, _, pace = str(model).partition(":")
    if name != "sim":
        return None
    try:
        value = float(pace) if pace else 1.0
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"a simulated model is 'sim' or 'sim:PACE' with PACE > 0, got {model!r}")
    return value


def sim_backend(pace: float = 1.0) -> PacedBackend:
    """LLaMA-3-8B on an H100, each step ``pace`` times its roofline time, with dummy tokens
    among CityLM's characters (never ``<bos>`` or ``<eos>``)."""
    ids = range(len(SPECIAL_TOKENS), Tokenizer().vocab_size)
    return PacedBackend(SimBackend(LLAMA3_8B, H100, token_ids=ids), pace)


def build_sim_engine(config: ServerConfig) -> tuple[Engine, dict[str, Any]]:
    """The engine and limits of a ``sim`` server (``ServerConfig.builder``).

    The automatic pool holds ``max_running`` requests at the full context, capped by the
    KV that fits in the simulated H100's memory after the weights.
    """
    pace = simulated_pace(config.model)
    if pace is None:
        raise ValueError(f"{config.model!r} is not a simulated model ('sim' or 'sim:PACE')")
    backend = sim_backend(pace)
    engine_config = config.engine
    if config.auto_kv:
        capacity = min(engine_config.max_running * SIM_CONTEXT, backend.inner.kv_capacity())
        engine_config = dataclasses.replace(engine_config, kv_capacity=capacity)
    engine = Engine(backend, engine_config)
    limits = {"max_context": backend.max_context, "kv_capacity": engine.kv_capacity,
              "vocab_size": backend.vocab_size}
    return engine, limits


def sim_config(config: ServerConfig) -> ServerConfig:
    """``config`` (whose model is ``sim`` or ``sim:PACE``) served by ``build_sim_engine``;
    the body limit from the simulated context unless one is set."""
    if simulated_pace(config.model) is None:
        raise ValueError(f"{config.model!r} is not a simulated model ('sim' or 'sim:PACE')")
    limit = config.max_request_bytes or max(DEFAULT_MAX_REQUEST_BYTES, 64 * SIM_CONTEXT)
    return dataclasses.replace(config, builder=build_sim_engine, max_request_bytes=limit)


def main(argv: Sequence[str] | None = None) -> None:
    """``minisrv serve`` over the simulated H100 (``--model sim`` unless another pace)."""
    from minisrv.server import cli

    parser = cli.build_parser()
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    if args.model == "citylm":  # the flag's default: the simulator at real time
        args.model = "sim"
    try:
        simulated_pace(args.model) or parser.error("--model must be 'sim' or 'sim:PACE'")
    except ValueError as exc:
        parser.error(str(exc))
    if args.max_request_bytes is None:
        args.max_request_bytes = max(DEFAULT_MAX_REQUEST_BYTES, 64 * SIM_CONTEXT)
    cli.serve(args, parser, builder=build_sim_engine, codec=Tokenizer())


if __name__ == "__main__":
    main()
