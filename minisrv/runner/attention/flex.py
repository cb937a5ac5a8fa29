"""The flex backend: one ragged ``flex_attention`` call for all requests (``ragged_attention``
of ``minisrv.model.flat``), its keys gathered from the request-to-token table and its block
mask from the lengths (``minisrv.model.ragged``)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from minisrv.model.flat import ragged_attention
from minisrv.model.ragged import FLEX_AVAILABLE, BlockMask, ragged_block_mask
from minisrv.runner.attention.padded import PaddedAttention
from minisrv.runner.table_batch import TableBatch

__all__ = ["FlexAttention", "FlexStep"]


class FlexStep(NamedTuple):
    """The ragged call's metadata for one step (``FlexAttention.prepare``)."""

    key_slots: torch.Tensor  # [S_total]: every request's slots end to end
    block_mask: BlockMask  # which tiles of queries x keys each request occupies
    batch: TableBatch  # for the padded call, should the compiled kernel fail


class FlexAttention:
    """One ragged ``flex_attention`` call for all requests, its block mask from lengths.

    Where the compiled kernel fails in this process (``ragged.compile_failed``), each
    layer runs the padded backend's call instead, as ``flat_attention_flex`` does.
    """

    kind = "flex"
    graphs = None  # the block mask is built from the contexts' lengths on the host

    def __init__(self, device: str | torch.device, dtype: torch.dtype, head_dim: int,
                 n_kv_heads: int) -> None:
        if not FLEX_AVAILABLE:
            raise ValueError(f"attention='flex' needs torch.nn.attention.flex_attention "
                             f"(torch >= 2.5), this is torch {torch.__version__}; use 'padded'")
        self.fallback = PaddedAttention(device, dtype, head_dim, n_kv_heads)

    def prepare(self, batch: TableBatch) -> FlexStep:
        block_mask = ragged_block_mask(batch.new_lens, batch.cached_lens, batch.device)
        return FlexStep(batch.ragged_key_slots(), block_mask, batch)

    def forward(self, q: torch.Tensor, kv: torch.Tensor, metadata: FlexStep) -> torch.Tensor:
        out = ragged_attention(q, metadata.key_slots, metadata.block_mask, kv[:, 0], kv[:, 1])
        if out is None:
            fallback = self.fallback
            return fallback.forward(q, kv, fallback.prepare(metadata.batch))
        return out
