"""The padded backend: one masked SDPA call per group of requests, over the pool's joint
K/V layer; and its hooks for the static decode buffers of a CUDA graph.

``padded_pool_attention`` gathers keys and values with ONE ``index_select`` of the pool's
joint layer, then makes the one padded call (``minisrv.model.flat.padded_sdpa``), which
``padded_attention``, the form chapter 03 shows over separate K and V layers, makes too.

Its metadata is built here from the step's ``TableBatch``: each group's key slots gathered
from the request-to-token table, and its mask's rows picked on the device from a vector of
zeros then -inf made once, each query's window counted on the host (the teaching form
builds the same groups from a ``FlatBatch``'s host lists,
``minisrv.model.attention_metadata``; both cut them where ``group_bounds`` says).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import numpy as np
import torch

from minisrv.model.attention_metadata import PaddedGroup, group_bounds, query_limits
from minisrv.model.flat import padded_sdpa
from minisrv.runner.table_batch import TableBatch

__all__ = ["SPLIT_ELEMENTS", "PaddedAttention", "PaddedBuffers", "PaddedGraphs", "PaddedStep",
           "decode_group", "length_cuts", "padded_groups", "padded_pool_attention"]


def padded_pool_attention(q: torch.Tensor, group: PaddedGroup, kv: torch.Tensor) -> torch.Tensor:
    """``minisrv.model.flat.padded_attention`` over a joint pool layer ``kv``: the same
    call (``padded_sdpa``), with keys and values of every request gathered by ONE
    ``index_select`` of the layer instead of two. Padding slots (slot 0, or the pool's
    scratch slot in a padded decode) are hidden by ``group.bias``."""
    n_b, s_max = group.key_slots.shape
    n_kv, head_dim = kv.shape[2], kv.shape[3]
    both = kv.index_select(0, group.key_slots.reshape(-1)).view(n_b, s_max, 2, n_kv, head_dim)
    return padded_sdpa(q, group, both[:, :, 0].transpose(1, 2), both[:, :, 1].transpose(1, 2))


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

    def __init__(self, device: str | torch.device, dtype: torch.dtype, head_dim: int,
                 n_kv_heads: int) -> None:
        self.dtype = dtype  # the queries' dtype, which the mask's bias must share
        cpu = torch.device(device).type == "cpu"  # SDPA runs on every device torch has
        self.split_cost = SPLIT_ELEMENTS / (head_dim * n_kv_heads) if cpu else math.inf
        self.graphs = PaddedGraphs(dtype)

    def prepare(self, batch: TableBatch) -> PaddedStep:
        groups = padded_groups(batch, self.dtype)
        last = groups[-1]
        few = last.bias.shape[2] != 1 or last.key_slots.shape[0] < 4  # no run of decodes
        if few or math.isinf(self.split_cost):
            return PaddedStep(groups, None, None)
        first = len(batch) - last.key_slots.shape[0]  # the first decode request
        lens = batch.host_ends[first:]
        # a cut saves at most the padding itself, and the first must pay two groups' cost
        if lens.shape[0] * last.key_slots.shape[1] - int(lens.sum()) <= 2 * self.split_cost:
            return PaddedStep(groups, None, None)
        order = np.argsort(lens, kind="stable")
        cuts = length_cuts(lens[order], self.split_cost)
        if not cuts:
            return PaddedStep(groups, None, None)
        row0 = last.tokens.start
        decodes = [decode_group(batch, first + part, row0 + lo, self.dtype)
                   for lo, part in zip([0, *cuts], np.split(order, cuts))]
        rows = np.concatenate([np.arange(row0), row0 + order])
        return PaddedStep((*groups[:-1], *decodes),
                          torch.from_numpy(rows).to(batch.device),
                          torch.from_numpy(np.argsort(rows)).to(batch.device))

    def forward(self, q: torch.Tensor, kv: torch.Tensor, metadata: PaddedStep) -> torch.Tensor:
        if metadata.order is not None:
            q = q.index_select(0, metadata.order)
        outs = [padded_pool_attention(q[group.tokens], group, kv) for group in metadata.groups]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out if metadata.restore is None else out.index_select(0, metadata.restore)


def padded_groups(batch: TableBatch, dtype: torch.dtype) -> tuple[PaddedGroup, ...]:
    """The step's padded groups (cut where ``group_bounds`` says), ``dtype`` the queries'."""
    return tuple(padded_group(batch, lo, hi, dtype)
                 for lo, hi in itertools.pairwise(group_bounds(batch.new_lens)))


def padded_group(batch: TableBatch, lo: int, hi: int, dtype: torch.dtype) -> PaddedGroup:
    """Requests ``lo .. hi - 1`` padded to their longest new-token run and their longest
    context: their slots gathered from the table, and the mask that shows each query the
    keys before its limit (``_mask``): for decodes its whole context, for prefills what
    ``query_limits`` says, both counted on the host from the lengths the batch keeps there."""
    new = batch.host_news[lo:hi]
    key_slots = batch.key_slots(slice(lo, hi))
    start = batch.starts[lo]
    if hi - lo == int(new.sum()):  # decodes: each query sees its whole context
        bias, _ = _mask(batch.host_ends[lo:hi, None], key_slots.shape[1], dtype, batch.device)
        return PaddedGroup(slice(start, start + hi - lo), None, key_slots, bias)
    limit, rows = query_limits(new, batch.host_cached[lo:hi])
    bias, moved_rows = _mask(limit, key_slots.shape[1], dtype, batch.device, rows)
    return PaddedGroup(slice(start, start + int(new.sum())), moved_rows, key_slots, bias)


def decode_group(batch: TableBatch, members: np.ndarray, start: int,
                 dtype: torch.dtype) -> PaddedGroup:
    """A padded group of the decodes ``members`` (indices into ``batch``) whose queries are
    rows ``start`` on (the split of decodes by context): each member's slots padded to the
    longest, and a bias that shows each query its own context."""
    key_slots = batch.key_slots(members)
    bias, _ = _mask(batch.host_ends[members, None], key_slots.shape[1], dtype, batch.device)
    return PaddedGroup(slice(start, start + len(members)), None, key_slots, bias)


def _mask(limit: np.ndarray, s_max: int, dtype: torch.dtype, device: torch.device,
          rows: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The bias [B, 1, T_max, S_max] that shows query ``(b, t)`` the keys before
    ``limit[b, t]`` (0 there, -inf past it), and the padded ``rows`` on the device.

    Each query's row of ``_windows`` is counted on the host (one number per query, not
    per key) and moved with the rows in one copy; ONE indexing operator gathers the bias
    rows, however long the contexts.
    """
    windows, m = _windows(device, dtype, s_max)
    first = (m - limit).reshape(-1)
    moved = torch.from_numpy(first if rows is None else np.concatenate([first, rows])).to(device)
    picks = moved[: first.shape[0]]  # one index_select: cheaper than indexing on the CPU
    bias = windows.index_select(0, picks).view(*limit.shape, s_max)[:, None]
    return bias, None if rows is None else moved[first.shape[0]:]


_ZEROS_THEN_INF: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
"""Per (device, dtype), ``m`` zeros then ``m`` -inf, made once (grown when a longer context
asks): every row of a mask is a window of it (``_windows``)."""


def _windows(device: torch.device, dtype: torch.dtype, s_max: int) -> tuple[torch.Tensor, int]:
    """Every mask row of ``s_max`` keys, as windows of ``_ZEROS_THEN_INF`` (a view, nothing
    copied), and its ``m``: window ``m - L`` holds L zeros, then -inf up to ``s_max``, the
    row of a query that sees its first L keys (0 <= L <= m)."""
    key = (device, dtype)
    have = _ZEROS_THEN_INF.get(key)
    if have is None or have.shape[0] // 2 < s_max:
        m = max(s_max, 0 if have is None else have.shape[0], 512)  # at least doubled
        have = torch.full((2 * m,), float("-inf"), dtype=dtype, device=device)
        _ZEROS_THEN_INF[key] = have
        have[:m] = 0  # made where it is used: nothing copied
    return have.unfold(0, s_max, 1), have.shape[0] // 2


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


class PaddedBuffers(NamedTuple):
    """The padded attention's static decode buffers (``PaddedGraphs.buffers``)."""

    key_slots: torch.Tensor  # [rows, context] long: each row's slots (padding: scratch)
    bias: torch.Tensor  # [rows, 1, 1, context]: 0 where a row sees a key, -inf elsewhere
    columns: torch.Tensor  # [context]: 0 .. context - 1, for the mask


class PaddedGraphs:
    """``GraphHooks`` of the padded backend: key slots and mask for every bucket row."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def buffers(self, rows: int, context: int, scratch: int,
                device: torch.device) -> PaddedBuffers:
        bias = torch.from_numpy(_bias(np.zeros(0, np.int64), rows, context))
        return PaddedBuffers(
            torch.full((rows, context), scratch, dtype=torch.long, device=device),
            bias.to(device, self.dtype), torch.arange(context, device=device))

    def fill(self, buffers: PaddedBuffers, b: int, table: torch.Tensor, rows: torch.Tensor,
             lens: torch.Tensor) -> None:
        width = min(buffers.columns.shape[0], table.shape[1])  # columns past it: masked
        buffers.key_slots[:b, :width].copy_(table[:, :width].index_select(0, rows))
        visible = buffers.columns[None, :] < lens[:, None]
        buffers.bias[:b].copy_(torch.zeros_like(buffers.bias[:b, 0, 0]).masked_fill_(
            ~visible, float("-inf"))[:, None, None])

    def metadata(self, buffers: PaddedBuffers, b: int) -> PaddedStep:
        group = PaddedGroup(slice(0, b), None, buffers.key_slots[:b], buffers.bias[:b])
        return PaddedStep((group,), None, None)


def _bias(lens: np.ndarray, rows: int, context: int) -> np.ndarray:
    """The additive mask [rows, 1, 1, context] (float32): row r < len(lens) sees its first
    ``lens[r]`` key columns; a padding row sees column 0 only (its scratch slot: never an
    empty row, so softmax gives no NaN)."""
    visible = np.zeros((rows, context), dtype=bool)
    visible[: len(lens)] = np.arange(context)[None, :] < lens[:, None]
    visible[len(lens):, 0] = True
    return np.where(visible, np.float32(0), np.float32(-np.inf))[:, None, None, :]
