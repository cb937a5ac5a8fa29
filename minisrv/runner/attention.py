"""The attention backends behind one interface: ``prepare(batch) -> metadata`` once per
step, ``forward(q, kv, metadata)`` in every layer.

``kv`` is one layer of the ``KVPool`` as it is laid out, [slots, 2, kv_heads, head_dim]
(each slot's key, then its value), already holding the step's new K/V (``write_kv``: one
operator for both). The padded backend gathers the history of every request with one
``index_select`` of that layer (keys and values together); the others read ``kv[:, 0]``
and ``kv[:, 1]``, views of the keys and the values.

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
import torch.nn.functional as F

from minisrv.model.flat import (
    FlatBatch,
    PaddedGroup,
    flat_attention_flex,
    flat_attention_loop,
    resolve_attention,
)
from minisrv.model.layers import joint_kv

__all__ = [
    "AttentionBackend",
    "FlexAttention",
    "LoopAttention",
    "PaddedAttention",
    "make_attention",
    "padded_pool_attention",
    "write_kv",
]


def write_kv(kv: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The new tokens' keys and values into their ``slots`` of one pool layer ``kv``, in
    one operator: ``k`` and ``v`` [T, kv_heads, head_dim] are adjacent views of the fused
    projection's output (``joint_kv``), so [T, 2, kv_heads, head_dim] needs no copy."""
    kv.index_put_((slots,), joint_kv(k, v))


def padded_pool_attention(q: torch.Tensor, group: PaddedGroup, kv: torch.Tensor) -> torch.Tensor:
    """``minisrv.model.flat.padded_attention`` over a joint pool layer ``kv``: the same
    numbers, with keys and values of every request gathered by ONE ``index_select``.

    Padding slots (slot 0, or the pool's scratch slot in a padded decode) are hidden by
    ``group.bias``; SDPA shares each KV head among its query heads (``enable_gqa``).
    """
    key_slots, bias = group.key_slots, group.bias
    n_b, s_max = key_slots.shape
    t_max, n_heads, head_dim = bias.shape[2], q.shape[1], q.shape[2]
    n_kv = kv.shape[2]
    if group.rows is not None:  # each flat token to its row of the padded [B * T_max] block
        q = q.new_zeros(n_b * t_max, n_heads, head_dim).index_copy_(0, group.rows, q)
    q_pad = q.reshape(n_b, t_max, n_heads, head_dim).transpose(1, 2)  # [B, heads, T_max, d]
    both = kv.index_select(0, key_slots.reshape(-1)).view(n_b, s_max, 2, n_kv, head_dim)
    k, v = both[:, :, 0].transpose(1, 2), both[:, :, 1].transpose(1, 2)  # views
    out = F.scaled_dot_product_attention(q_pad, k, v, attn_mask=bias, enable_gqa=n_heads > n_kv)
    out = out.transpose(1, 2).reshape(n_b * t_max, n_heads * head_dim)
    return out if group.rows is None else out.index_select(0, group.rows)


class AttentionBackend(Protocol):
    """One way to attend over a flat batch whose K/V sit in the pool."""

    kind: str  # "loop", "padded" or "flex"

    def prepare(self, batch: FlatBatch) -> Any:
        """Everything the layers' calls share, built once per step before layer 0."""
        ...

    def forward(self, q: torch.Tensor, kv: torch.Tensor, metadata: Any) -> torch.Tensor:
        """Attention output [T, n_heads * head_dim] for queries ``q`` [T, heads, head_dim];
        ``kv`` [slots, 2, kv_heads, head_dim] is one layer of the pool, already holding the
        step's new K/V."""
        ...


class LoopAttention:
    """One attention call per request: the plain, obviously right version."""

    kind = "loop"

    def prepare(self, batch: FlatBatch) -> FlatBatch:
        batch.slots  # noqa: B018 - builds each request's slot tensor now, not in layer 0
        return batch

    def forward(self, q: torch.Tensor, kv: torch.Tensor, metadata: FlatBatch) -> torch.Tensor:
        return flat_attention_loop(q, metadata, kv[:, 0], kv[:, 1])


class PaddedAttention:
    """One masked SDPA call per group of requests (decodes and prefills padded apart)."""

    kind = "padded"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype  # the queries' dtype, which the mask's bias must share

    def prepare(self, batch: FlatBatch) -> tuple:
        return batch.padded_groups(self.dtype)

    def forward(self, q: torch.Tensor, kv: torch.Tensor, metadata: tuple) -> torch.Tensor:
        outs = [padded_pool_attention(q[group.tokens], group, kv) for group in metadata]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class FlexAttention:
    """One ragged ``flex_attention`` call for all requests, its block mask from lengths."""

    kind = "flex"

    def prepare(self, batch: FlatBatch) -> FlatBatch:
        batch.flex_index()  # the key slots and the block mask, once per step
        return batch

    def forward(self, q: torch.Tensor, kv: torch.Tensor, metadata: FlatBatch) -> torch.Tensor:
        return flat_attention_flex(q, metadata, kv[:, 0], kv[:, 1])


def make_attention(kind: str, device: torch.device, dtype: torch.dtype,
                   head_dim: int) -> AttentionBackend:
    """The backend for ``kind`` (``"auto"``: flex where it compiles, else padded)."""
    kind = resolve_attention(kind, device, dtype, head_dim)
    if kind == "padded":
        return PaddedAttention(dtype)
    return LoopAttention() if kind == "loop" else FlexAttention()
