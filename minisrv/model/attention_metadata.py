"""The metadata of the teaching attentions of ``minisrv.model.flat``, built from a
``FlatBatch``'s host lists: the padded groups (``PaddedGroup``: key slots and bias mask per
group of requests) and the flex layout (every request's key slots end to end, and the
block mask).

The runner's backends (``minisrv.runner.attention``) build their own metadata from the
engine's ``TableBatch``, whose slots are gathered from the request-to-token table on the
device; they share with this module only what does not depend on where the slots are: the
``PaddedGroup`` record, where the groups are cut (``group_bounds``) and each padded query's
key limit (``query_limits``), all computed on the host from the new and cached lengths.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from minisrv.model.ragged import BlockMask, ragged_block_mask

if TYPE_CHECKING:
    from minisrv.model.flat import FlatBatch

__all__ = ["PaddedGroup", "flex_index", "group_bounds", "padded_groups", "query_limits"]


class PaddedGroup(NamedTuple):
    """Consecutive requests of a flat batch that one padded attention call serves."""

    tokens: slice  # their rows of the flat [T] batch
    rows: torch.Tensor | None  # each token's row in the padded [B * T_max] block; None: no padding
    key_slots: torch.Tensor  # [B, S_max]: every request's slots (padding: any slot, masked)
    bias: torch.Tensor  # [B, 1, T_max, S_max]: 0 where a query may see a key, -inf elsewhere


_BUILT: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
"""Each live batch's metadata by what it is (kind, dtype): built once per step, shared by
every layer (the teaching functions ask at each layer), dropped with the batch."""


def _once(batch: FlatBatch, key: Any, build: Callable[[], Any]) -> Any:
    """``build()`` for ``batch`` and ``key``, made on the first ask only."""
    built = _BUILT.setdefault(batch, {})
    if key not in built:
        built[key] = build()
    return built[key]


def group_bounds(new_lens: Sequence[int]) -> list[int]:
    """Where the padded groups of a step start and end: decodes (one new token) and
    prefills (more) are padded apart, so that one long prefill does not pad every decode of
    a mixed step to its length; a group per run of consecutive requests of one kind. A
    mixed step lists its prefills first, which makes two groups; a batch whose kinds
    alternate more than once is padded as one group (correct, only slower)."""
    decode = np.asarray(new_lens) == 1
    cuts = (np.flatnonzero(decode[1:] != decode[:-1]) + 1).tolist()  # kind changes
    return [0, *cuts, len(decode)] if len(cuts) <= 1 else [0, len(decode)]


def query_limits(new: np.ndarray, cached: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """For requests computing ``new`` tokens after ``cached`` ones, padded to the longest
    new-token run (T_max): the keys each padded query sees (those before ``limit[b, t]``,
    [B, T_max]) and each real token's row of the padded [B * T_max] block (None when no
    request is padded).

    Request b's tokens take rows ``b * T_max`` on. Query t of request b sees keys at
    positions <= its own; a padding row sees the request's last real position (never an
    empty row, so softmax gives no NaN); its output is dropped.
    """
    t_max = int(new.max())
    limit = cached[:, None] + np.minimum(np.arange(t_max)[None, :], new[:, None] - 1) + 1
    if not (new < t_max).any():
        return limit, None
    starts = np.arange(len(new)) * t_max - np.cumsum(new) + new
    return limit, np.arange(int(new.sum())) + np.repeat(starts, new)


def padded_groups(batch: FlatBatch, dtype: torch.dtype = torch.float32
                  ) -> tuple[PaddedGroup, ...]:
    """The padded attention's groups of requests of ``batch`` (``group_bounds``), built on
    first use. ``dtype`` is the queries' type, which the bias must share."""
    def build() -> tuple[PaddedGroup, ...]:
        bounds = group_bounds(batch.new_lens)
        return tuple(padded_group(batch, lo, hi, dtype) for lo, hi in itertools.pairwise(bounds))

    return _once(batch, ("padded", dtype), build)


def padded_group(batch: FlatBatch, lo: int, hi: int, dtype: torch.dtype) -> PaddedGroup:
    """Requests ``lo .. hi - 1`` padded to their longest new-token run (T_max) and their
    longest context (S_max): their slots from the host lists and the bias that
    ``query_limits`` says, made with numpy and moved in one copy each. SDPA adds the bias
    to the scores (a boolean mask would be turned into exactly this inside every layer's
    call, so it is made once per step)."""
    new = np.asarray(batch.new_lens[lo:hi], dtype=np.int64)
    key_slots, ends = host_key_slots(batch.slot_lists[lo:hi], batch.device)
    n_b, s_max, start = len(new), key_slots.shape[1], batch.starts[lo]
    if new.max() == 1:  # decodes: each query sees its whole context
        return PaddedGroup(slice(start, start + n_b), None, key_slots,
                           host_bias(ends[:, None], s_max, dtype, batch.device)[:, None])
    cached = np.asarray(batch.cached_lens[lo:hi], dtype=np.int64)
    limit, rows = query_limits(new, cached)
    return PaddedGroup(slice(start, start + int(new.sum())),
                       None if rows is None else torch.from_numpy(rows).to(batch.device),
                       key_slots, host_bias(limit, s_max, dtype, batch.device)[:, None])


def flex_index(batch: FlatBatch) -> tuple[torch.Tensor, BlockMask]:
    """``(key_slots, block_mask)`` of the ragged attention, built on first use.

    ``key_slots`` [S_total] are every request's slots end to end (no padding); the block
    mask (``ragged.ragged_block_mask``) says which tiles of queries x keys each request
    occupies. Built once per step and shared by every layer.
    """
    def build() -> tuple[torch.Tensor, BlockMask]:
        block_mask = ragged_block_mask(batch.new_lens, batch.cached_lens, batch.device)
        key_slots = torch.tensor(list(itertools.chain.from_iterable(batch.slot_lists)),
                                 dtype=torch.long, device=batch.device)
        return key_slots, block_mask

    return _once(batch, "flex", build)


def host_key_slots(slot_lists: Sequence[Sequence[int]], device: torch.device
                   ) -> tuple[torch.Tensor, np.ndarray]:
    """``key_slots`` of requests whose slots are host lists: padded with slot 0 to the
    longest, built with numpy and moved in one copy, and their lengths (on the host)."""
    lens = np.fromiter(map(len, slot_lists), dtype=np.int64, count=len(slot_lists))
    s_max = int(lens.max())
    keys = np.zeros((len(lens), s_max), dtype=np.int64)
    keys[np.arange(s_max)[None, :] < lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(slot_lists), dtype=np.int64, count=int(lens.sum()))
    return torch.from_numpy(keys).to(device), lens


def host_bias(limit: np.ndarray, s_max: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """The bias [..., S_max] that shows query ``i`` the keys before ``limit[i]``: 0 there,
    -inf past it, made with numpy and moved in one copy (no operator on the device)."""
    visible = np.arange(s_max) < limit[..., None]
    bias = np.where(visible, np.float32(0), np.float32(-np.inf))
    return torch.from_numpy(bias).to(device, dtype)
