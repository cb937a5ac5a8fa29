"""The attention backends behind one interface: ``prepare(batch) -> metadata`` once per
step, ``forward(q, k, v, metadata)`` in every layer.

What differs between the strategies is what each builds from the step's ``FlatBatch``
before the first layer runs (the index tensors and the mask) and which call it makes per
layer; the math is that of ``minisrv.model.flat`` (``flat_attention_loop``,
``flat_attention_padded``, ``flat_attention_flex``), so every backend gives the tokens of
``CityLM.forward_flat``. A new kernel (an in-place decode kernel, FlashInfer) is one more
class here.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from minisrv.model.flat import (
    FlatBatch,
    flat_attention_flex,
    flat_attention_loop,
    padded_attention,
    resolve_attention,
)

__all__ = [
    "AttentionBackend",
    "FlexAttention",
    "LoopAttention",
    "PaddedAttention",
    "make_attention",
]


class AttentionBackend(Protocol):
    """One way to attend over a flat batch whose K/V sit in the pool."""

    kind: str  # "loop", "padded" or "flex"

    def prepare(self, batch: FlatBatch) -> Any:
        """Everything the layers' calls share, built once per step before layer 0."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: Any) -> torch.Tensor:
        """Attention output [T, n_heads * head_dim] for queries ``q`` [T, heads, head_dim];
        ``k``/``v`` are one layer of the pool, already holding the step's new K/V."""
        ...


class LoopAttention:
    """One attention call per request: the plain, obviously right version."""

    kind = "loop"

    def prepare(self, batch: FlatBatch) -> FlatBatch:
        batch.slots  # noqa: B018 - builds each request's slot tensor now, not in layer 0
        return batch

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: FlatBatch) -> torch.Tensor:
        return flat_attention_loop(q, metadata, k, v)


class PaddedAttention:
    """One masked SDPA call per group of requests (decodes and prefills padded apart)."""

    kind = "padded"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype  # the queries' dtype, which the mask's bias must share

    def prepare(self, batch: FlatBatch) -> tuple:
        return batch.padded_groups(self.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: tuple) -> torch.Tensor:
        outs = [padded_attention(q[group.tokens], group, k, v) for group in metadata]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class FlexAttention:
    """One ragged ``flex_attention`` call for all requests, its block mask from lengths."""

    kind = "flex"

    def prepare(self, batch: FlatBatch) -> FlatBatch:
        batch.flex_index()  # the key slots and the block mask, once per step
        return batch

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: FlatBatch) -> torch.Tensor:
        return flat_attention_flex(q, metadata, k, v)


def make_attention(kind: str, device: torch.device, dtype: torch.dtype,
                   head_dim: int) -> AttentionBackend:
    """The backend for ``kind`` (``"auto"``: flex where it compiles, else padded)."""
    kind = resolve_attention(kind, device, dtype, head_dim)
    if kind == "padded":
        return PaddedAttention(dtype)
    return LoopAttention() if kind == "loop" else FlexAttention()
