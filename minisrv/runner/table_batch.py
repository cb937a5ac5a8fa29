"""A step's flat batch read through the request-to-token table (``minisrv.kv.table``).

``TableBatch`` is ``FlatBatch`` (``minisrv.model.flat``: the new tokens of many requests end
to end) without the slot lists: per request it knows its row of the table, its context (the
tokens it attends over, new ones included) and its new tokens. The host builds three
vectors of the step's new tokens (ids, positions, and the slots their K/V go to, which the
scheduler has just allocated) and three of its requests (rows, contexts, new tokens), moved
to the device in ONE copy; what depends on the contexts' slots (each attention's key
slots) is gathered from the table on the device, and the padded attention's mask from a
vector made once (``minisrv.runner.attention.padded``). So the host work grows with the
new tokens, not with the context, whatever the attention.

It is the one batch type the runner and every backend of ``minisrv.runner.attention`` read
(each building its own metadata from it); ``FlatBatch`` remains the teaching form
(chapters build one by hand, ``CityLM.forward_flat`` runs it). Requests known only by their
slot lists (a runner driven by hand, tests) get a table of their own: ``slot_table``,
``TableBatch.of_slots``.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["TableBatch", "slot_table"]


def slot_table(slot_lists: Sequence[Sequence[int]], fill: int, device: str | torch.device,
               width: int | None = None) -> torch.Tensor:
    """A request-to-token table of requests known by their slot lists: int32 [requests + 1,
    width (default: the longest list)], row r holding request r's slots, every other entry
    ``fill`` (the pool's scratch slot), so the last row is a scratch row, as the
    scheduler's table has. Built on the host and moved in one copy: work that grows with
    the contexts, which the scheduler's table (``minisrv.kv.table``) spares each step."""
    lens = np.fromiter(map(len, slot_lists), dtype=np.int64, count=len(slot_lists))
    table = np.full((len(lens) + 1, int(lens.max()) if width is None else width), fill,
                    dtype=np.int32)
    table[:-1][np.arange(table.shape[1])[None, :] < lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(slot_lists), dtype=np.int32, count=int(lens.sum()))
    return torch.from_numpy(table).to(device)


class TableBatch:
    """``new_ids[r]`` of request r, whose KV is row ``rows[r]`` of ``table`` up to
    ``ends[r]``: its last ``len(new_ids[r])`` positions receive the new tokens' K/V, in
    slots ``new_slots[r]`` (what the table holds there: the host has them, so the step
    copies them rather than gathering them on the device)."""

    def __init__(self, new_ids: Sequence[Sequence[int]], rows: Sequence[int],
                 ends: Sequence[int], table: torch.Tensor,
                 new_slots: Sequence[Sequence[int]]) -> None:
        n_req = len(new_ids)
        if not n_req or len(rows) != n_req or len(ends) != n_req or len(new_slots) != n_req:
            raise ValueError(f"{n_req} requests' ids, {len(rows)} rows, {len(ends)} ends, "
                             f"{len(new_slots)} slot lists")
        self.table, self.device = table, table.device
        news = np.fromiter(map(len, new_ids), dtype=np.int64, count=n_req)
        ends_np = np.asarray(ends, dtype=np.int64)
        if news.min() < 1 or (ends_np < news).any() or ends_np.max() > table.shape[1]:
            raise ValueError(f"every request needs 1..end new tokens and an end within the "
                             f"table's {table.shape[1]} columns: news {news.tolist()}, "
                             f"ends {ends_np.tolist()}")
        if (np.fromiter(map(len, new_slots), dtype=np.int64, count=n_req) != news).any():
            raise ValueError("every request needs a slot for each of its new tokens")
        n_tok = int(news.sum())
        starts = np.cumsum(news) - news
        cached = ends_np - news
        packed = np.empty(3 * n_tok + 3 * n_req, dtype=np.int64)
        packed[:n_tok] = np.fromiter(itertools.chain.from_iterable(new_ids), dtype=np.int64,
                                     count=n_tok)
        packed[n_tok:2 * n_tok] = np.arange(n_tok) + np.repeat(cached - starts, news)
        packed[2 * n_tok:3 * n_tok] = np.fromiter(itertools.chain.from_iterable(new_slots),
                                                  dtype=np.int64, count=n_tok)
        per_req = packed[3 * n_tok:].reshape(3, n_req)
        per_req[0], per_req[1], per_req[2] = rows, ends_np, news
        moved = torch.from_numpy(packed).to(self.device)  # the step's one copy
        self.ids = moved[:n_tok]
        self.positions = moved[n_tok:2 * n_tok]
        self.write_slots = moved[2 * n_tok:3 * n_tok]
        self.rows, self.ends, self.news = moved[3 * n_tok:].view(3, n_req).unbind()
        # the same lengths on the host, as arrays (the backends' metadata slices them) and
        # as lists (Python reads them one by one)
        self.host_news, self.host_ends, self.host_cached = news, ends_np, cached
        self.row_list: list[int] = per_req[0].tolist()
        self.contexts: list[int] = ends_np.tolist()
        self.new_lens: list[int] = news.tolist()
        self.cached_lens: list[int] = cached.tolist()
        self.starts: list[int] = starts.tolist()
        ids = packed[:n_tok]
        self.id_range = (int(ids.min()), int(ids.max()))

    @classmethod
    def of_slots(cls, new_ids: Sequence[Sequence[int]], slots: Sequence[Sequence[int]],
                 device: str | torch.device = "cpu", fill: int = 0) -> TableBatch:
        """The batch of requests given by their slot lists (``FlatBatch``'s arguments),
        read through a table of their own (``slot_table``, padded with ``fill``)."""
        if len(slots) != len(new_ids):
            raise ValueError(f"{len(new_ids)} requests' ids but {len(slots)} slot lists")
        return cls(new_ids, range(len(slots)), [len(s) for s in slots],
                   slot_table(slots, fill, device),
                   [s[len(s) - len(i):] for s, i in zip(slots, new_ids)])

    def token_rows(self, lo: int, hi: int) -> slice:
        """The rows of the flat batch that requests ``lo .. hi - 1`` compute."""
        return slice(self.starts[lo], self.starts[hi - 1] + self.new_lens[hi - 1])

    def part(self, lo: int, hi: int) -> TableBatch:
        """Requests ``lo .. hi - 1`` as a batch of their own, its tensors views of this
        one's: nothing copied, nothing moved (the hybrid attention gives a mixed step's
        prefills and decodes to two calls). ``id_range`` stays the whole step's, which the
        forward checks once."""
        if not 0 <= lo < hi <= len(self):
            raise ValueError(f"requests {lo} to {hi - 1} are not a part of {len(self)}")
        rows = self.token_rows(lo, hi)
        part = copy.copy(self)
        part.ids, part.positions = self.ids[rows], self.positions[rows]
        part.write_slots = self.write_slots[rows]
        part.rows, part.ends, part.news = self.rows[lo:hi], self.ends[lo:hi], self.news[lo:hi]
        part.host_news, part.host_ends = self.host_news[lo:hi], self.host_ends[lo:hi]
        part.host_cached = self.host_cached[lo:hi]
        part.row_list, part.contexts = self.row_list[lo:hi], self.contexts[lo:hi]
        part.new_lens, part.cached_lens = self.new_lens[lo:hi], self.cached_lens[lo:hi]
        part.starts = [start - rows.start for start in self.starts[lo:hi]]
        return part

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

    def key_slots(self, members: slice | np.ndarray) -> torch.Tensor:
        """``members``' slots [B, S_max] (the first S_max of each member's row: past a
        member's context stale or padding slots, which a mask hides), gathered from the
        table on the device (the padded backend's groups)."""
        if isinstance(members, slice):
            s_max, index = max(self.contexts[members]), members
        else:
            s_max = max(self.contexts[i] for i in members.tolist())
            index = torch.from_numpy(np.ascontiguousarray(members)).to(self.device)
        return self.table[:, :s_max].index_select(0, self.rows[index])

    def ragged_key_slots(self) -> torch.Tensor:
        """Every request's slots end to end [S_total], gathered from the table."""
        total = sum(self.contexts)
        offsets = torch.cumsum(self.ends, 0) - self.ends
        key_rows = self.rows.repeat_interleave(self.ends, output_size=total)
        cols = (torch.arange(total, device=self.device)
                - offsets.repeat_interleave(self.ends, output_size=total))
        return self.table[key_rows, cols]

    def __repr__(self) -> str:
        return f"TableBatch(requests={len(self)}, tokens={self.num_tokens})"

