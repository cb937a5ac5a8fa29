"""The flex backend: one ragged ``flex_attention`` call for all requests
(``flat_attention_flex``, its block mask from ``minisrv.model.ragged``)."""

from __future__ import annotations

import torch

from minisrv.model.attention_metadata import flex_index
from minisrv.model.flat import flat_attention_flex
from minisrv.runner.attention.base import StepBatch

__all__ = ["FlexAttention"]


class FlexAttention:
    """One ragged ``flex_attention`` call for all requests, its block mask from lengths."""

    kind = "flex"
    graphs = None  # static decode runs the padded backend's hooks

    def prepare(self, batch: StepBatch) -> StepBatch:
        flex_index(batch)  # the key slots and the block mask, once per step
        return batch

    def forward(self, q: torch.Tensor, kv: torch.Tensor, metadata: StepBatch) -> torch.Tensor:
        return flat_attention_flex(q, metadata, kv[:, 0], kv[:, 1])
