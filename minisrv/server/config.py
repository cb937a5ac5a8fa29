"""The server's configuration: every default of ``minisrv serve`` declared once.

``ServerConfig`` holds what a worker needs to build its engine (the model, where it runs,
and an ``EngineConfig``) plus what the HTTP side enforces (body size, shutdown grace, API
key). The CLI's defaults are read from here, so the flags, the book's ``EngineOptions``
and the workers cannot disagree. The engine defaults of a server differ from a notebook's
``Engine`` on purpose: a server caches prefixes (``cache="radix"``), runs up to 64 requests
at once and keeps no step trace (it would grow forever).

The KV pool is sized from the model unless ``kv_capacity`` is given (``auto_kv``): room
for ``max_running`` requests at the full context, capped by a share of the memory the
device has free (SGLang's ``mem_fraction_static``). So a request without ``max_tokens``,
which may run to the end of the context as OpenAI's API allows, never throttles the
batch: 64 of them run together. (The other way, a small default ``max_tokens``, would cut
replies short that a client did not ask to cut.)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisrv.kvsize import kv_bytes_per_token
from minisrv.scheduler import EngineConfig

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "MEM_FRACTION",
    "SERVER_ENGINE",
    "EngineOptions",
    "ServerConfig",
    "auto_kv_capacity",
    "check_engine_options",
    "model_context",
    "model_name",
]

SERVER_ENGINE = EngineConfig(max_running=64, cache="radix", record_trace=False)
"""The engine options of a server (see the module's docstring)."""

MEM_FRACTION = 0.4
"""Share of the free device memory an automatically sized KV pool may take."""

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
"""The smallest default body limit: 1 MiB. The limit grows with the context (64 bytes per
token of context, ``max_request_bytes_for``): a full context of token ids as JSON is about
7 bytes per token, a text prompt 4-8, and a batch of prompts a few times that."""


@dataclass(frozen=True)
class ServerConfig:
    """One server's options; validated when built (``EngineConfig`` checks its own)."""

    model: str = "citylm"
    device: str | None = None
    threads: int | None = None  # torch CPU threads per engine (None: torch's default)
    engine: EngineConfig = SERVER_ENGINE
    auto_kv: bool = True  # size the pool from the model (ignores engine.kv_capacity)
    max_request_bytes: int | None = None  # None: from the model's context
    body_timeout: float = 10.0  # seconds a client may take to send its body
    shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    api_key: str | None = None
    restart_backoff: float = 0.5  # first wait before restarting a dead worker (doubles)
    # Builds (engine, limits) in place of loading ``model``: a module-level function, so it
    # travels to worker processes (the book's simulated H100, ``minisrv.sim.served``).
    builder: Callable[[ServerConfig], tuple[Any, dict[str, Any]]] | None = None
    worker_timeout: float = 30.0  # a busy worker this long without progress is hung (0: off)

    def __post_init__(self) -> None:
        for name in ("body_timeout", "shutdown_timeout", "restart_backoff", "worker_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        limit = self.max_request_bytes
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 1024):
            raise ValueError(f"max_request_bytes must be an int >= 1024, got {limit!r}")

    # Compatibility with the book's ``EngineOptions`` (flat engine options).
    @property
    def kv_capacity(self) -> int:
        return self.engine.kv_capacity

    @property
    def max_running(self) -> int:
        return self.engine.max_running

    def engine_args(self) -> dict[str, Any]:
        """The ``Engine`` keyword arguments of this config."""
        return {f.name: getattr(self.engine, f.name) for f in dataclasses.fields(self.engine)}

    def request_limit(self) -> int:
        """The body size limit in bytes (``max_request_bytes``, or from the context)."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return max(DEFAULT_MAX_REQUEST_BYTES, 64 * model_context(self.model))


def EngineOptions(model: str = "citylm", device: str | None = None,  # noqa: N802
                  threads: int | None = None, engine_kwargs: dict[str, Any] | None = None,
                  **engine: Any) -> ServerConfig:
    """A ``ServerConfig`` from flat engine options (``kv_capacity=2000, policy="lpm"``), as
    the book builds its layouts; ``engine_kwargs`` are more engine options. An explicit
    ``kv_capacity`` turns the automatic pool size off."""
    options = {**engine, **(engine_kwargs or {})}
    config = EngineConfig.from_options(SERVER_ENGINE, **options)
    return ServerConfig(model=model, device=device, threads=threads, engine=config,
                        auto_kv="kv_capacity" not in options)


def check_engine_options(config: ServerConfig) -> None:
    """Raise the ValueError ``Engine`` would raise for ``config``, without a model (an
    ``EngineConfig`` validates itself when built, so this re-checks a replaced one)."""
    EngineConfig.from_options(config.engine)


def model_name(model: str) -> str:
    """The id ``/v1/models`` lists: ``citylm``, or the folder's name."""
    return "citylm" if model == "citylm" else Path(model).resolve().name


def model_context(model: str) -> int:
    """The model's context in tokens, read from its config alone (no weights loaded)."""
    if model == "citylm":
        from importlib import resources

        meta = (resources.files("minisrv") / "weights" / "citylm.json").read_text("utf-8")
        return int(json.loads(meta)["config"]["max_seq_len"])
    config = json.loads((Path(model) / "config.json").read_text("utf-8"))
    return int(config.get("max_position_embeddings") or 4096)


def auto_kv_capacity(model: Any, max_running: int, free_bytes: int | None) -> int:
    """KV slots for ``max_running`` requests at the full context, capped by
    ``MEM_FRACTION`` of ``free_bytes`` (None: no cap)."""
    cfg = model.config
    per_token = kv_bytes_per_token(cfg, model.dtype.itemsize)
    want = max_running * cfg.max_seq_len
    if free_bytes is None:
        return want
    return max(cfg.max_seq_len, min(want, int(MEM_FRACTION * free_bytes) // per_token))


def free_device_bytes(device: Any) -> int | None:
    """Free memory of ``device`` (a ``torch.device``): the GPU's, or the host's."""
    import os

    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None

