"""The attention backends behind one interface: ``prepare(batch) -> metadata`` once per
step, ``forward(q, kv, metadata)`` in every layer.

``kv`` is one layer of the ``KVPool`` as it is laid out, [slots, 2, kv_heads, head_dim]
(each slot's key, then its value), already holding the step's new K/V (``write_kv``: one
operator for both). The padded backend gathers the history of every request with one
``index_select`` of that layer (keys and values together); the others read ``kv[:, 0]``
and ``kv[:, 1]``, views of the keys and the values.

What differs between the strategies is what each builds from the step's batch (the
engine's ``TableBatch``, whose slots are rows of the request-to-token table, or a
hand-built ``FlatBatch`` of slot lists) before the first layer runs (the index tensors and
the mask) and which call it makes per layer; the math is that of ``minisrv.model.flat``
(``flat_attention_loop``, ``flat_attention_padded``, ``flat_attention_flex``), so every
backend gives the tokens of
``CityLM.forward_flat``. A new kernel (an in-place decode kernel, FlashInfer) is one more
class here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
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
from minisrv.runner.attention_choice import auto_attention
from minisrv.runner.table_batch import TableBatch
from minisrv.runner.triton_attention import TritonAttention

StepBatch = FlatBatch | TableBatch
"""A step's batch as the backends read it: slot lists (the teaching form) or table rows."""

__all__ = [
    "AttentionBackend",
    "FlexAttention",
    "LoopAttention",
    "PaddedAttention",
    "PaddedStep",
    "StepBatch",
    "length_cuts",
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
    ``group.bias``. A group of decodes (one query per request) hands SDPA each KV head's
    query heads as that head's rows: [B, kv_heads, heads per KV head, head_dim] against
    [B, kv_heads, S_max, head_dim], so nothing is broadcast (on the CPU 1.1x faster than
    ``enable_gqa`` at CityLM's shapes, 1.8x at 12 x 512's); a group of prefills shares each
    KV head among its query heads with ``enable_gqa``.
    """
    key_slots, bias = group.key_slots, group.bias
    n_b, s_max = key_slots.shape
    t_max, n_heads, head_dim = bias.shape[2], q.shape[1], q.shape[2]
    n_kv = kv.shape[2]
    both = kv.index_select(0, key_slots.reshape(-1)).view(n_b, s_max, 2, n_kv, head_dim)
    k, v = both[:, :, 0].transpose(1, 2), both[:, :, 1].transpose(1, 2)  # views
    if t_max == 1:  # [B, 1, 1, S_max] bias: the same for every head and row
        rows = q.reshape(n_b, n_kv, n_heads // n_kv, head_dim)
        return F.scaled_dot_product_attention(rows, k, v, attn_mask=bias).reshape(n_b, -1)
    if group.rows is not None:  # each flat token to its row of the padded [B * T_max] block
        q = q.new_zeros(n_b * t_max, n_heads, head_dim).index_copy_(0, group.rows, q)
    q_pad = q.reshape(n_b, t_max, n_heads, head_dim).transpose(1, 2)  # [B, heads, T_max, d]
    out = F.scaled_dot_product_attention(q_pad, k, v, attn_mask=bias, enable_gqa=n_heads > n_kv)
    out = out.transpose(1, 2).reshape(n_b * t_max, n_heads * head_dim)
    return out if group.rows is None else out.index_select(0, group.rows)


class AttentionBackend(Protocol):
    """One way to attend over a flat batch whose K/V sit in the pool."""

    kind: str  # "loop", "padded" or "flex"

    def prepare(self, batch: StepBatch) -> Any:
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

    def prepare(self, batch: StepBatch) -> StepBatch:
        batch.slots  # noqa: B018 - builds each request's slot tensor now, not in layer 0
        return batch

    def forward(self, q: torch.Tensor, kv: torch.Tensor, metadata: StepBatch) -> torch.Tensor:
        return flat_attention_loop(q, metadata, kv[:, 0], kv[:, 1])


class PaddedStep(NamedTuple):
    """The padded attention's plan for one step (``PaddedAttention.prepare``)."""

    groups: tuple[PaddedGroup, ...]  # each ``tokens`` a slice of the reordered rows
    order: torch.Tensor | None  # the flat rows in the groups' order; None: flat order
    restore: torch.Tensor | None  # the inverse of ``order``: outputs back to flat order


class PaddedAttention:
    """One masked SDPA call per group of requests (decodes and prefills padded apart).

    Decodes are padded to the longest context of their group. Where their contexts differ
    widely, sorting them by context and cutting the sorted run into up to four groups
    (``length_cuts``) gathers and attends over fewer padding slots, at the price of one
    more call per group and one reordering of the queries and outputs per layer.
    ``split_cost`` is what one more group costs, in padding slots (``SPLIT_ELEMENTS``
    spread over the key elements of one slot). The cost was measured on the CPU; on a GPU,
    where each call is a kernel launch the host pays for, decodes are not cut.
    """

    kind = "padded"

    def __init__(self, dtype: torch.dtype, kv_elements: int = 64,
                 device: str | torch.device = "cpu") -> None:
        self.dtype = dtype  # the queries' dtype, which the mask's bias must share
        cpu = torch.device(device).type == "cpu"
        self.split_cost = SPLIT_ELEMENTS / kv_elements if cpu else math.inf

    def prepare(self, batch: StepBatch) -> PaddedStep:
        groups = batch.padded_groups(self.dtype)
        last = groups[-1]
        few = last.bias.shape[2] != 1 or last.key_slots.shape[0] < 4  # no run of decodes
        if few or math.isinf(self.split_cost):
            return PaddedStep(groups, None, None)
        first = len(batch) - last.key_slots.shape[0]  # the first decode request
        contexts = np.asarray(_contexts(batch)[first:], dtype=np.int64)
        order = np.argsort(contexts, kind="stable")
        cuts = length_cuts(contexts[order], self.split_cost)
        if not cuts:
            return PaddedStep(groups, None, None)
        row0 = last.tokens.start
        decodes = [self._decode_group(batch, first + part, row0 + lo)
                   for lo, part in zip([0, *cuts], np.split(order, cuts))]
        rows = np.concatenate([np.arange(row0), row0 + order])
        return PaddedStep((*groups[:-1], *decodes),
                          torch.from_numpy(rows).to(batch.device),
                          torch.from_numpy(np.argsort(rows)).to(batch.device))

    def _decode_group(self, batch: StepBatch, members: np.ndarray, start: int) -> PaddedGroup:
        """The decodes ``members`` of ``batch`` as one padded group, queries from ``start``."""
        if isinstance(batch, TableBatch):
            return batch.decode_group(members, start, self.dtype)
        return decode_group([batch.slot_lists[r] for r in members.tolist()], start,
                            self.dtype, batch.device)

    def forward(self, q: torch.Tensor, kv: torch.Tensor, metadata: PaddedStep) -> torch.Tensor:
        if metadata.order is not None:
            q = q.index_select(0, metadata.order)
        outs = [padded_pool_attention(q[group.tokens], group, kv) for group in metadata.groups]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out if metadata.restore is None else out.index_select(0, metadata.restore)


SPLIT_ELEMENTS = 1 << 17
"""What one more padded call per layer costs, in key elements (slots x KV heads x head dim)
gathered and attended instead. Set on the CPU (one thread, float32), where at 12 layers x
512 cutting 64 decodes of contexts 8-96 into 2-4 groups takes their attention from about
2.7 to 1.1 ms a layer, while at CityLM's size (fewer, smaller heads, where each call's
fixed cost dominates) no cut pays and none is made."""


def length_cuts(lengths: np.ndarray, split_cost: float, depth: int = 2) -> list[int]:
    """Where to cut ascending ``lengths`` into runs, each padded to its last (longest)
    length, so that padded slots plus ``split_cost`` per extra run are fewest: the best
    single cut, then the best cut of each side, ``depth`` times (at most 2 ** depth runs).
    The first cut must also pay for reordering the queries and outputs (one more
    ``split_cost``); none is made if it does not."""
    def best(lo: int, hi: int, level: int, price: float) -> list[int]:
        if level == 0 or hi - lo < 2:
            return []
        cut = np.arange(lo + 1, hi)
        cost = (cut - lo) * lengths[cut - 1] + (hi - cut) * lengths[hi - 1]
        at = int(cost.argmin())
        if cost[at] + price >= (hi - lo) * lengths[hi - 1]:
            return []
        mid = int(cut[at])
        return [*best(lo, mid, level - 1, split_cost), mid,
                *best(mid, hi, level - 1, split_cost)]

    return best(0, len(lengths), depth, 2 * split_cost)


def decode_group(slot_lists: Sequence[Sequence[int]], start: int, dtype: torch.dtype,
                 device: torch.device) -> PaddedGroup:
    """A padded group of decodes (one new token each) whose queries are rows ``start`` on:
    every request's slots padded with slot 0 to the longest, and a bias that shows each
    query its own slots."""
    lens = np.fromiter(map(len, slot_lists), dtype=np.int64, count=len(slot_lists))
    s_max = int(lens.max())
    visible = np.arange(s_max)[None, :] < lens[:, None]
    key_slots = np.zeros((len(lens), s_max), dtype=np.int64)
    key_slots[visible] = np.fromiter(itertools.chain.from_iterable(slot_lists),
                                     dtype=np.int64, count=int(lens.sum()))
    bias = np.where(visible, np.float32(0), np.float32(-np.inf))[:, None, None, :]
    return PaddedGroup(slice(start, start + len(lens)), None,
                       torch.from_numpy(key_slots).to(device),
                       torch.from_numpy(bias).to(device, dtype))


class FlexAttention:
    """One ragged ``flex_attention`` call for all requests, its block mask from lengths."""

    kind = "flex"

    def prepare(self, batch: StepBatch) -> StepBatch:
        batch.flex_index()  # the key slots and the block mask, once per step
        return batch

    def forward(self, q: torch.Tensor, kv: torch.Tensor, metadata: StepBatch) -> torch.Tensor:
        return flat_attention_flex(q, metadata, kv[:, 0], kv[:, 1])


def _contexts(batch: StepBatch) -> list[int]:
    """Each request's context (its slots, new ones included), known on the host."""
    if isinstance(batch, TableBatch):
        return batch.contexts
    return [len(s) for s in batch.slot_lists]


def make_attention(kind: str, device: torch.device, dtype: torch.dtype,
                   head_dim: int, n_kv_heads: int = 2) -> AttentionBackend:
    """The backend for ``kind`` (``"auto"``: flex where it compiles, else padded)."""
    kv_elements = n_kv_heads * head_dim
    if kind == "triton":  # issue 39's in-place kernels (minisrv.runner.triton_attention)
        return TritonAttention(device)
    kind = auto_attention(device, dtype, head_dim) if kind == "auto" else kind  # the table
    kind = resolve_attention(kind, device, dtype, head_dim)
    if kind == "padded":
        return PaddedAttention(dtype, kv_elements, device)
    return LoopAttention() if kind == "loop" else FlexAttention()
