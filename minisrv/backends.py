"""Old home of the backends, kept only until ``minisrv/server`` imports their new homes:
``ModelBackend``/``PerRequestBackend`` live in ``minisrv.runner``, ``SimBackend`` in
``minisrv.sim``. Nothing else imports this module."""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {"ModelBackend": "minisrv.runner", "PerRequestBackend": "minisrv.runner",
          "SimBackend": "minisrv.sim"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'minisrv.backends' has no attribute {name!r}")
