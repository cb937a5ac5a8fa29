"""A step's flat batch read through the request-to-token table (``minisrv.kv.table``).

``TableBatch`` is ``FlatBatch`` (``minisrv.model.flat``: the new tokens of many requests end
to end) without the slot lists: per request it knows its row of the table, its context (the
tokens it attends over, new ones included) and its new tokens. The host builds three
vectors of the step's new tokens (ids, positions, table rows) and three of its requests
(rows, contexts, new tokens), moved to the device in ONE copy; everything that depends on
the contexts' slots (the write slots, each attention's key slots and masks) is gathered
from the table on the device. So the host work grows with the new tokens, not with the
context, whatever the attention.

It answers what the attention functions of ``minisrv.model.flat`` ask of a ``FlatBatch``
(``padded_groups``, ``flex_index``, ``slots``, ``starts``, ``new_lens``, ``cached_lens``),
so the same functions, and every backend of ``minisrv.runner.attention``, run over either.
A ``FlatBatch`` remains the teaching form (chapters build one by hand).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from minisrv.model.flat import PaddedGroup
from minisrv.model.ragged import BlockMask, ragged_block_mask

__all__ = ["TableBatch"]


class TableBatch:
    """``new_ids[r]`` of request r, whose KV is row ``rows[r]`` of ``table`` up to
    ``ends[r]`` (its last ``len(new_ids[r])`` positions receive the new tokens' K/V)."""

    def __init__(self, new_ids: Sequence[Sequence[int]], rows: Sequence[int],
                 ends: Sequence[int], table: torch.Tensor,
                 columns: torch.Tensor | None = None) -> None:
        n_req = len(new_ids)
        if not n_req or len(rows) != n_req or len(ends) != n_req:
            raise ValueError(f"{n_req} requests' ids, {len(rows)} rows, {len(ends)} ends")
        self.table, self.device = table, table.device
        # 0 .. width - 1 on the device, for the masks (the engine's table keeps one)
        self.columns = (torch.arange(table.shape[1], device=table.device) if columns is None
                        else columns)
        news = np.fromiter(map(len, new_ids), dtype=np.int64, count=n_req)
        ends_np = np.asarray(ends, dtype=np.int64)
        if news.min() < 1 or (ends_np < news).any() or ends_np.max() > table.shape[1]:
            raise ValueError(f"every request needs 1..end new tokens and an end within the "
                             f"table's {table.shape[1]} columns: news {news.tolist()}, "
                             f"ends {ends_np.tolist()}")
        n_tok = int(news.sum())
        starts = np.cumsum(news) - news
        cached = ends_np - news
        packed = np.empty(3 * n_tok + 3 * n_req, dtype=np.int64)
        packed[:n_tok] = np.fromiter(itertools.chain.from_iterable(new_ids), dtype=np.int64,
                                     count=n_tok)
        packed[n_tok:2 * n_tok] = np.arange(n_tok) + np.repeat(cached - starts, news)
        packed[2 * n_tok:3 * n_tok] = np.repeat(np.asarray(rows, dtype=np.int64), news)
        packed[3 * n_tok:] = np.concatenate([rows, ends_np, news])
        moved = torch.from_numpy(packed).to(self.device)  # the step's one copy
        self.ids = moved[:n_tok]
        self.positions = moved[n_tok:2 * n_tok]
        # int32 as the table holds them: indexing takes int32 as it takes int64
        self.write_slots = table[moved[2 * n_tok:3 * n_tok], self.positions]
        self.rows, self.ends, self.news = moved[3 * n_tok:].view(3, n_req).unbind()
        self.row_list = [int(r) for r in rows]
        self.contexts: list[int] = ends_np.tolist()
        self.new_lens: list[int] = news.tolist()
        self.cached_lens: list[int] = cached.tolist()
        self.starts: list[int] = starts.tolist()
        self.id_range = (int(packed[:n_tok].min()), int(packed[:n_tok].max()))
        self._padded: tuple[PaddedGroup, ...] | None = None
        self._flex: tuple[torch.Tensor, BlockMask] | None = None

    def __len__(self) -> int:
        """Requests in the batch."""
        return len(self.new_lens)

    @property
    def num_tokens(self) -> int:
        """New tokens in all (the rows of the flat matrix)."""
        return int(self.ids.shape[0])

    @property
    def slots(self) -> list[torch.Tensor]:
        """Each request's KV slots: views of its row of the table (the loop attention)."""
        return [self.table[row, :end] for row, end in zip(self.row_list, self.contexts)]

    def key_slots(self, members: slice | torch.Tensor, s_max: int) -> torch.Tensor:
        """[len(members), s_max]: the first ``s_max`` slots of each member's row (past a
        member's context: stale or padding slots, which a mask hides)."""
        return self.table[:, :s_max].index_select(0, self.rows[members])

    def padded_groups(self, dtype: torch.dtype = torch.float32) -> tuple[PaddedGroup, ...]:
        """``FlatBatch.padded_groups``, its key slots and masks built on the device."""
        if self._padded is None or self._padded[0].bias.dtype != dtype:
            decode = np.asarray(self.new_lens) == 1
            cuts = (np.flatnonzero(decode[1:] != decode[:-1]) + 1).tolist()
            bounds = [0, *cuts, len(decode)] if len(cuts) <= 1 else [0, len(decode)]
            self._padded = tuple(self._padded_group(lo, hi, dtype)
                                 for lo, hi in itertools.pairwise(bounds))
        return self._padded

    def _padded_group(self, lo: int, hi: int, dtype: torch.dtype) -> PaddedGroup:
        """Requests ``lo .. hi - 1`` padded to their longest new-token run and context:
        query t of request b sees positions <= its own (``FlatBatch._padded_group``)."""
        new = np.asarray(self.new_lens[lo:hi], dtype=np.int64)
        n_b, t_max, s_max = len(new), int(new.max()), max(self.contexts[lo:hi])
        news, ends, keys = self.news[lo:hi], self.ends[lo:hi], self.columns[:s_max]
        if t_max == 1:  # decodes: each query sees its whole context
            visible = (keys[None, :] < ends[:, None])[:, None]
        else:
            steps = self.columns[:t_max]
            query_pos = (ends - news)[:, None] + torch.minimum(steps[None, :], news[:, None] - 1)
            visible = keys[None, None, :] <= query_pos[:, :, None]  # [B, T_max, S_max]
        bias = _bias(visible, dtype)[:, None]
        rows = None
        if (new < t_max).any():  # some requests are padded: each token's padded row
            starts = np.arange(n_b) * t_max - np.cumsum(new) + new
            rows = torch.from_numpy(np.arange(int(new.sum())) + np.repeat(starts, new))
            rows = rows.to(self.device)
        start = self.starts[lo]
        return PaddedGroup(slice(start, start + int(new.sum())), rows,
                           self.key_slots(slice(lo, hi), s_max), bias)

    def decode_group(self, members: np.ndarray, start: int, dtype: torch.dtype) -> PaddedGroup:
        """A padded group of the decodes ``members`` (indices into the batch) whose queries
        are rows ``start`` on (``runner.attention``'s split of decodes by context)."""
        index = torch.from_numpy(np.ascontiguousarray(members)).to(self.device)
        s_max = max(self.contexts[i] for i in members.tolist())
        visible = self.columns[None, :s_max] < self.ends[index][:, None]
        return PaddedGroup(slice(start, start + len(members)), None,
                           self.key_slots(index, s_max), _bias(visible, dtype)[:, None, None])

    def flex_index(self) -> tuple[torch.Tensor, BlockMask]:
        """``(key_slots, block_mask)`` of the ragged attention: every request's slots end to
        end, gathered from the table on the device; the block mask from the lengths."""
        if self._flex is None:
            block_mask = ragged_block_mask(self.new_lens, self.cached_lens, self.device)
            total = sum(self.contexts)
            offsets = torch.cumsum(self.ends, 0) - self.ends
            key_rows = self.rows.repeat_interleave(self.ends, output_size=total)
            cols = (torch.arange(total, device=self.device)
                    - offsets.repeat_interleave(self.ends, output_size=total))
            self._flex = (self.table[key_rows, cols], block_mask)
        return self._flex

    def __repr__(self) -> str:
        return f"TableBatch(requests={len(self)}, tokens={self.num_tokens})"


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
