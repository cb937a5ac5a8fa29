"""Training the shipped models (book side): the city language, CityLM and its draft.

* ``data.py``: the city language, one line per country with its cities by population
  (also what the workloads write their prompts in); ``python -m minisrv.train.data``
  rebuilds ``cities.json`` from GeoNames;
* ``citylm.py``: ``train``, CityLM from scratch (``python -m minisrv.train``);
* ``draft.py``: ``train_draft``, the speculative-decoding draft from the same documents
  (``python -m minisrv.train --draft``).

The serving runtime never imports this package: it loads the weights these write. Names
are imported on first use, so the city language loads without the training loop.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "IGNORE": "citylm", "TrainConfig": "citylm", "batch_logits": "citylm",
    "batch_loss": "citylm", "evaluate": "citylm", "lr_at": "citylm", "make_batch": "citylm",
    "save": "citylm", "train": "citylm",
    "DRAFT_TRAIN": "draft", "save_draft": "draft", "train_draft": "draft",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"minisrv.train.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'minisrv.train' has no attribute {name!r}")
