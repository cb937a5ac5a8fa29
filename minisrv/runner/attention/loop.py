"""The loop backend: one attention call per request (``flat_attention_loop``)."""

from __future__ import annotations

import torch

from minisrv.model.flat import flat_attention_loop
from minisrv.runner.table_batch import TableBatch

__all__ = ["LoopAttention"]


class LoopAttention:
    """One attention call per request: the plain, obviously right version.

    It runs the teaching function itself, which reads of its batch only what a
    ``TableBatch`` answers from its table as a ``FlatBatch`` does from its lists (each
    request's first row, new and cached lengths, and ``slots``: views of its table row).
    It runs wherever torch does, so the constructor has nothing to check or keep.
    """

    kind = "loop"
    graphs = None  # one call per request and context: nothing a static buffer could hold

    def __init__(self, device: str | torch.device, dtype: torch.dtype, head_dim: int,
                 n_kv_heads: int) -> None:
        del device, dtype, head_dim, n_kv_heads  # every call is sized by its request

    def prepare(self, batch: TableBatch) -> TableBatch:
        return batch

    def forward(self, q: torch.Tensor, kv: torch.Tensor, metadata: TableBatch) -> torch.Tensor:
        return flat_attention_loop(q, metadata, kv[:, 0], kv[:, 1])  # type: ignore[arg-type]
