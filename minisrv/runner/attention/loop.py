"""The loop backend: one attention call per request (``flat_attention_loop``)."""

from __future__ import annotations

import torch

from minisrv.model.flat import flat_attention_loop
from minisrv.runner.attention.base import StepBatch

__all__ = ["LoopAttention"]


class LoopAttention:
    """One attention call per request: the plain, obviously right version."""

    kind = "loop"
    graphs = None  # static decode runs the padded backend's hooks

    def prepare(self, batch: StepBatch) -> StepBatch:
        batch.slots  # noqa: B018 - builds each request's slot tensor now, not in layer 0
        return batch

    def forward(self, q: torch.Tensor, kv: torch.Tensor, metadata: StepBatch) -> torch.Tensor:
        return flat_attention_loop(q, metadata, kv[:, 0], kv[:, 1])
