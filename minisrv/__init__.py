"""minisrv: a small but real LLM inference server, built chapter by chapter.

The public names are imported lazily so that ``import minisrv`` stays cheap and a
chapter only pays for the components it uses.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "load_citylm": "minisrv.model",
    "load_model": "minisrv.model",
    "CityLM": "minisrv.model",
    "Tokenizer": "minisrv.tokenizer",
    "SamplingParams": "minisrv.sampling",
    "ModelConfig": "minisrv.configs",
    "Engine": "minisrv.engine",
    "EngineConfig": "minisrv.scheduler",
    "Router": "minisrv.router",
    "RadixCache": "minisrv.kv",
    "BlockCache": "minisrv.kv",
    "calc_priority": "minisrv.scheduler",
    "optimal_hit_rate": "minisrv.scheduler",
    "simulate": "minisrv.sim",
    "simulate_cluster": "minisrv.experiments.routing",
    "timeline": "minisrv.experiments.lanes",
    "throughput_ratio": "minisrv.experiments.lanes",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'minisrv' has no attribute {name!r}")
