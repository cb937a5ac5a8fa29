"""The request-to-token table: where each running request's KV slots are, on the device.

``ReqToTokenTable.tensor`` is int32 [rows, width]: row r, column p holds the pool slot of
position p of the request that owns row r (SGLang's ``req_to_token_pool``). The attention
backends find a request's KV as ``tensor[row, :length]``, gathered on the device, so a step
ships its new tokens, one row index and one length per request, never the slot lists: the
host work of a step grows with its new tokens, not with its context.

Pages of one token (a page table with ``page_size`` 1): the pool hands out single slots
(``kv/allocator.py``) and the prefix cache shares prefixes at token granularity (a radix
node may end anywhere), so a larger page would need copy-on-write at every shared page's
end; at one token per entry the table is what the allocator already hands out, and a page
table of any size is this table with its columns grouped.

``KVManager`` is the only writer: a row is taken at admission and written whenever slots
are allocated (admission, a decode, a check, a chunk) or swapped for the cache's copy;
truncation cuts its length. A row is given back when its request finishes, is retracted or
aborted, but reused only once every launched step that read it has completed: the
overlapped loop forms (and writes the table for) step i+1 while step i still reads it, so
a row given back meanwhile waits in a deferred list, drained as steps complete. Slots need
no such wait: a slot given back is next written by a step launched later, and the device
runs steps in launch order, so step i has read it by then (``kv/manager.py`` frees them at
once, as SGLang's overlapped scheduler does). The overlapped loop therefore needs up to
twice ``max_running`` rows (the running requests, plus those of the step in flight that
left since); the last row is a scratch row of padding slots, for padded decode rows.

The simulated GPU has no pool and gets no table (``KVManager(table=None)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from minisrv.request import Req

if TYPE_CHECKING:  # torch is imported where a tensor is made: the simulated GPU has no table
    import torch

__all__ = ["ReqToTokenTable", "table_rows"]


def table_rows(max_running: int, overlap: bool) -> int:
    """Rows a scheduler needs: a row per seat, twice as many when the overlapped loop may
    hold the rows of a step in flight, plus the scratch row."""
    return max_running * (2 if overlap else 1) + 1


class ReqToTokenTable:
    """int32 [rows, width] on ``device``: (row, position) -> pool slot, plus its rows' owners.

    ``scratch_slot`` fills every column nobody wrote (the pool's padding slot), so any entry
    the backends gather, used or stale, indexes the pool. The host side keeps each row's
    written length (for ``check``) and the last launched step that read it (for reuse).
    """

    def __init__(self, rows: int, width: int, scratch_slot: int,
                 device: str | torch.device = "cpu") -> None:
        if rows < 2 or width < 1:
            raise ValueError(f"a table needs >= 2 rows and >= 1 column, got {rows} x {width}")
        import torch

        self.width, self.scratch_slot = width, scratch_slot
        self.tensor = torch.full((rows, width), scratch_slot, dtype=torch.int32, device=device)
        self.scratch_row = rows - 1
        self._free = list(range(rows - 2, -1, -1))  # a stack: the lowest row first
        self._row: dict[Req, int] = {}  # each holder (by identity: Req has eq=False) -> row
        self._lens = [0] * rows  # columns written per row
        self._last_read = [-1] * rows  # the last launched step that read each row
        self._deferred: list[int] = []  # given back while a step that read them runs
        self.launched_steps = 0  # steps launched so far (the next one's index)
        self.completed_steps = 0  # steps completed (they complete in launch order)

    @property
    def rows(self) -> int:
        """Rows of the table, the scratch row included."""
        return self.tensor.shape[0]

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def place(self, device: str | torch.device) -> None:
        """Move the table to ``device`` (the backend that reads it does, before any row is
        taken: the scheduler builds it without knowing where the model is)."""
        import torch

        if torch.device(device) == self.device:
            return
        if self._row:
            raise ValueError("a table moves before any row is taken")
        self.tensor = self.tensor.to(device)

    # ------------------------------------------------------------------ rows
    def row(self, req: Req) -> int:
        """``req``'s row (KeyError if it holds none)."""
        return self._row[req]

    def holds(self, req: Req) -> bool:
        return req in self._row

    @property
    def used(self) -> int:
        """Rows held by requests (deferred ones not counted)."""
        return len(self._row)

    @property
    def free_count(self) -> int:
        """Rows a request could take now."""
        return len(self._free)

    @property
    def deferred(self) -> tuple[int, ...]:
        """Rows given back and waiting for the steps that read them."""
        return tuple(self._deferred)

    def take(self, req: Req, slots: Sequence[int]) -> int:
        """A free row for ``req``, holding ``slots`` from position 0 (its admission)."""
        if req in self._row:
            raise ValueError(f"request {req.rid} already holds row {self._row[req]}")
        if not self._free:
            raise ValueError(f"all {self.rows - 1} rows are taken or in flight: the table "
                             "is sized for max_running (twice it with overlap)")
        row = self._free.pop()
        self._row[req] = row
        self._lens[row] = 0
        self.write(req, 0, slots)
        return row

    def write(self, req: Req, start: int, slots: Sequence[int]) -> None:
        """``slots`` at positions ``start ..`` of ``req``'s row: one copy to the device."""
        row, n = self._row[req], len(slots)
        if start + n > self.width:
            raise ValueError(f"request {req.rid}: position {start + n - 1} is past the "
                             f"table's {self.width} columns")
        if n:
            import torch

            self.tensor[row, start:start + n] = torch.tensor(slots, dtype=torch.int32).to(
                self.device)
        self._lens[row] = max(self._lens[row], start + n)

    def append(self, reqs: Sequence[Req], slots: Sequence[int]) -> None:
        """One slot after each request's last position (a decode step): one copy, one
        scatter for all of them."""
        rows = [self._row[req] for req in reqs]
        cols = [self._lens[row] for row in rows]
        if cols and max(cols) >= self.width:
            raise ValueError(f"a request's position reaches past the table's {self.width} "
                             "columns")
        if rows:
            import torch

            moved = torch.tensor([rows, cols, list(slots)], dtype=torch.long).to(self.device)
            self.tensor[moved[0], moved[1]] = moved[2].to(torch.int32)
        for row, col in zip(rows, cols, strict=True):
            self._lens[row] = col + 1

    def cut(self, req: Req, length: int) -> None:
        """``req``'s row holds its first ``length`` slots only (a truncation): the columns
        past it are never read again, so nothing is written to the device."""
        row = self._row[req]
        self._lens[row] = min(self._lens[row], length)

    def give_back(self, req: Req) -> None:
        """``req`` leaves: its row is free again once no launched step may read it."""
        row = self._row.pop(req, None)
        if row is None:
            return
        self._lens[row] = 0
        if self._last_read[row] >= self.completed_steps:
            self._deferred.append(row)
        else:
            self._free.append(row)

    # ------------------------------------------------------------------ steps
    def launched(self, reqs: Sequence[Req]) -> int:
        """A step that reads the rows of ``reqs`` is launched; its index."""
        step = self.launched_steps
        for req in reqs:
            row = self._row.get(req)
            if row is not None:
                self._last_read[row] = step
        self.launched_steps += 1
        return step

    def completed(self, steps: int = 1) -> None:
        """The oldest ``steps`` launched steps have completed: rows they alone read are
        free again."""
        self.completed_steps = min(self.completed_steps + steps, self.launched_steps)
        done = self.completed_steps
        ready = [row for row in self._deferred if self._last_read[row] < done]
        if ready:
            self._deferred = [row for row in self._deferred if self._last_read[row] >= done]
            self._free.extend(ready)

    def settle(self) -> None:
        """Every launched step has ended (after a device error: no step is in flight)."""
        self.completed(self.launched_steps - self.completed_steps)

    def in_flight(self, row: int) -> bool:
        """Whether a launched, not yet completed step read ``row``."""
        return self._last_read[row] >= self.completed_steps

    # ------------------------------------------------------------------ invariants
    def check(self, running: Sequence[Req]) -> None:
        """``AssertionError`` unless every running request's row holds its ``kv_slots``
        (read back from the device: a check, not the step path), no other request holds a
        row, and every row is held, deferred or free exactly once."""
        held = set(running)
        assert set(self._row) == held, (
            f"{len(self._row)} rows held by {len(held)} running requests")
        table = self.tensor.cpu()
        for req in running:
            row = self._row[req]
            n = len(req.kv_slots)
            assert self._lens[row] == n, (
                f"request {req.rid}: row {row} holds {self._lens[row]} slots, it has {n}")
            assert table[row, :n].tolist() == req.kv_slots, (
                f"request {req.rid}: row {row} differs from its kv_slots")
        rows = [*self._row.values(), *self._deferred, *self._free]
        assert sorted(rows) == list(range(self.rows - 1)), "a row is lost or counted twice"
        assert all(self.in_flight(row) for row in self._deferred), "a deferred row is idle"
        assert all(not self.in_flight(row) for row in self._free), "a free row is in flight"
        scratch = table[self.scratch_row]
        assert bool((scratch == self.scratch_slot).all()), "the scratch row was written"
