"""The metadata of the padded and ragged attentions, built from a flat batch by the attention
that uses it: the padded groups (``PaddedGroup``: key slots and bias mask per group of
requests) and the flex layout (every request's key slots end to end, and the block mask).

A batch holds only the batch (ids, positions, write slots, lengths) and answers one
question whose answer depends on where it keeps requests' slots: ``key_slots(members)``,
each member's slots padded to the longest [B, S_max] with its context lengths [B] (where
the batch keeps them: numpy on the host, a tensor on the device), and
``ragged_key_slots()``, all of them end to end. ``FlatBatch`` (``minisrv.model.flat``)
answers from its host lists, ``TableBatch`` (``minisrv.runner.table_batch``) by a gather
from the request-to-token table on the device. Everything else (the masks, the padded rows
of prefills) is built here the same for both, each mask where the lengths are: so the
table's host work grows with the new tokens, not with the context. The teaching functions of
``minisrv.model.flat`` and the runner's backends (``minisrv.runner.attention``) build
their metadata with these same functions.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from minisrv.model.ragged import BlockMask, ragged_block_mask

__all__ = ["KeySlotBatch", "PaddedGroup", "decode_group", "flex_index", "padded_group",
           "padded_groups"]


class PaddedGroup(NamedTuple):
    """Consecutive requests of a flat batch that one padded attention call serves."""

    tokens: slice  # their rows of the flat [T] batch
    rows: torch.Tensor | None  # each token's row in the padded [B * T_max] block; None: no padding
    key_slots: torch.Tensor  # [B, S_max]: every request's slots (padding: any slot, masked)
    bias: torch.Tensor  # [B, 1, T_max, S_max]: 0 where a query may see a key, -inf elsewhere


class KeySlotBatch(Protocol):
    """What the builders ask of a flat batch (``FlatBatch`` or ``TableBatch``)."""

    device: torch.device
    new_lens: list[int]
    cached_lens: list[int]
    starts: list[int]

    def key_slots(self, members: slice | np.ndarray
                  ) -> tuple[torch.Tensor, torch.Tensor | np.ndarray]: ...

    def ragged_key_slots(self) -> torch.Tensor: ...


_BUILT: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
"""Each live batch's metadata by what it is (kind, dtype): built once per step, shared by
every layer (the teaching functions ask at each layer), dropped with the batch."""


def _once(batch: KeySlotBatch, key: Any, build: Callable[[], Any]) -> Any:
    """``build()`` for ``batch`` and ``key``, made on the first ask only."""
    built = _BUILT.setdefault(batch, {})
    if key not in built:
        built[key] = build()
    return built[key]


def padded_groups(batch: KeySlotBatch, dtype: torch.dtype = torch.float32
                  ) -> tuple[PaddedGroup, ...]:
    """The padded attention's groups of requests of ``batch``, built on first use.

    Decodes (one new token) and prefills (more) are padded apart, so that one long
    prefill does not pad every decode of a mixed step to its length: a group per run of
    consecutive requests of one kind. A mixed step lists its prefills first, which makes
    two groups; a batch whose kinds alternate more than once is padded as one group
    (correct, only slower). ``dtype`` is the queries' type, which the bias must share.
    """
    def build() -> tuple[PaddedGroup, ...]:
        decode = np.asarray(batch.new_lens) == 1
        cuts = (np.flatnonzero(decode[1:] != decode[:-1]) + 1).tolist()  # kind changes
        bounds = [0, *cuts, len(decode)] if len(cuts) <= 1 else [0, len(decode)]
        return tuple(padded_group(batch, lo, hi, dtype) for lo, hi in itertools.pairwise(bounds))

    return _once(batch, ("padded", dtype), build)


def padded_group(batch: KeySlotBatch, lo: int, hi: int, dtype: torch.dtype) -> PaddedGroup:
    """Requests ``lo .. hi - 1`` padded to their longest new-token run (T_max) and their
    longest context (S_max).

    Request b's tokens take rows ``b * T_max`` on of the padded block. The bias lets
    query t of request b see keys at positions <= its own; SDPA adds it to the scores
    (a boolean mask would be turned into exactly this inside every layer's call, so it
    is made once per step). Padding rows see the request's last real position (never an
    empty row, so softmax gives no NaN); their outputs are dropped. The prefills' padded
    rows and query positions (of the new tokens) are made on the host; the mask where the
    batch keeps its lengths (``_below``).
    """
    new = np.asarray(batch.new_lens[lo:hi], dtype=np.int64)
    key_slots, ends = batch.key_slots(slice(lo, hi))
    n_b, t_max, s_max = len(new), int(new.max()), key_slots.shape[1]
    start = batch.starts[lo]
    if t_max == 1:  # decodes: each query sees its whole context
        return PaddedGroup(slice(start, start + n_b), None, key_slots,
                           _below(ends[:, None], s_max, dtype, batch.device)[:, None])
    cached = np.asarray(batch.cached_lens[lo:hi], dtype=np.int64)[:, None]
    limit = cached + np.minimum(np.arange(t_max)[None, :], new[:, None] - 1) + 1  # [B, T_max]
    rows = None
    if (new < t_max).any():  # some requests are padded: each token's padded row
        rows = np.arange(int(new.sum())) + np.repeat(np.arange(n_b) * t_max - np.cumsum(new)
                                                     + new, new)
    if isinstance(ends, np.ndarray):  # lengths on the host: so is the mask
        rows = None if rows is None else torch.from_numpy(rows).to(batch.device)
    else:  # on the device: the query positions (and rows) go there in one copy
        packed = limit.reshape(-1) if rows is None else np.concatenate([limit.reshape(-1), rows])
        moved = torch.from_numpy(packed).to(batch.device)
        limit, rows = moved[: n_b * t_max].view(n_b, t_max), (None if rows is None
                                                                else moved[n_b * t_max:])
    return PaddedGroup(slice(start, start + int(new.sum())), rows, key_slots,
                       _below(limit, s_max, dtype, batch.device)[:, None])


def decode_group(batch: KeySlotBatch, members: np.ndarray, start: int,
                 dtype: torch.dtype) -> PaddedGroup:
    """A padded group of the decodes ``members`` (indices into ``batch``) whose queries are
    rows ``start`` on (the padded backend's split of decodes by context): each member's
    slots padded to the longest, and a bias that shows each query its own context."""
    key_slots, ends = batch.key_slots(members)
    return PaddedGroup(slice(start, start + len(members)), None, key_slots,
                       _below(ends[:, None], key_slots.shape[1], dtype, batch.device)[:, None])


def flex_index(batch: KeySlotBatch) -> tuple[torch.Tensor, BlockMask]:
    """``(key_slots, block_mask)`` of the ragged attention, built on first use.

    ``key_slots`` [S_total] are every request's slots end to end (no padding); the block
    mask (``ragged.ragged_block_mask``) says which tiles of queries x keys each request
    occupies. Built once per step and shared by every layer.
    """
    def build() -> tuple[torch.Tensor, BlockMask]:
        block_mask = ragged_block_mask(batch.new_lens, batch.cached_lens, batch.device)
        return batch.ragged_key_slots(), block_mask

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


def _below(limit: torch.Tensor | np.ndarray, s_max: int, dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    """The bias [..., S_max] that shows query ``i`` the keys before ``limit[i]``: 0 there,
    -inf past it. Lengths on the host make it with numpy, moved in one copy (no operator
    on the device); lengths on the device make it there (two operators, nothing copied)."""
    if isinstance(limit, np.ndarray):
        visible = np.arange(s_max) < limit[..., None]
        bias = np.where(visible, np.float32(0), np.float32(-np.inf))
        return torch.from_numpy(bias).to(device, dtype)
    return _bias(_columns(device, s_max) < limit[..., None], dtype)


_COLUMNS: dict[torch.device, torch.Tensor] = {}
"""0, 1, 2, ... per device, made once (grown when a longer context asks): the masks compare
lengths with it, so no step makes its own ``arange``."""


def _columns(device: torch.device, n: int) -> torch.Tensor:
    """0 .. n - 1 on ``device`` (a view of the cached ``_COLUMNS``)."""
    have = _COLUMNS.get(device)
    if have is None or have.shape[0] < n:
        have = _COLUMNS[device] = torch.arange(max(n, 2 * (0 if have is None else len(have)),
                                                   512), device=device)
    return have[:n]


_LIMITS: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
"""0 and -inf as 0-d tensors per (device, dtype), made once: ``torch.where`` over them is one
operator (over Python numbers it would make both first, every step)."""


def _bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``visible``, -inf elsewhere, in the queries' ``dtype``."""
    key = (visible.device, dtype)
    if key not in _LIMITS:
        _LIMITS[key] = (torch.zeros((), dtype=dtype, device=visible.device),
                        torch.full((), float("-inf"), dtype=dtype, device=visible.device))
    zero, minus_inf = _LIMITS[key]
    return torch.where(visible, zero, minus_inf)
