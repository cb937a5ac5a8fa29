"""The request-to-token table: where each running request's KV slots are, on the device.

``ReqToTokenTable.tensor`` is int32 [rows, width]: row r, column p holds the pool slot of
position p of the request that owns row r (SGLang's ``req_to_token_pool``). The attention
backends find a request's KV as ``tensor[row, :length]``, gathered on the device, so a step
ships its new tokens, one row index and one length per request, never the slot lists: the
host work of a step grows with its new tokens, not with its context.

Every token has its own entry, whatever the page size (``EngineConfig.page_size``): the
allocator hands out pages of consecutive slots (``kv/allocator.py``), position ``i`` of a
request sits at offset ``i % page_size`` of its page, and the table lists the slot of each
position, as SGLang's ``req_to_token_pool`` does with any page size, so the attention
backends read it the same way at every page size. A page table proper would be this
table's columns grouped ``page_size`` at a time.

The table is the only record of where a request's tokens live: each row keeps its slots on
the host too (``slots``: what the manager frees and the runner ships as a step's new
slots), the device tensor mirroring them for the kernels; a request holds only lengths
(``Req.kv_len``). A table built with ``device=None`` keeps the host record alone and grows
its rows on demand: the simulated GPU's, and a ``KVManager`` driven without a pool.

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
    slots (``slots``: the record the manager reads) and the last launched step that read
    it (for reuse). ``device=None``: the host record alone, no tensor, rows added as
    requests need them (no torch imported).
    """

    def __init__(self, rows: int, width: int, scratch_slot: int,
                 device: str | torch.device | None = "cpu") -> None:
        if rows < 2 or width < 1:
            raise ValueError(f"a table needs >= 2 rows and >= 1 column, got {rows} x {width}")
        self.width, self.scratch_slot = width, scratch_slot
        self.tensor: torch.Tensor | None = None
        if device is not None:
            import torch

            self.tensor = torch.full((rows, width), scratch_slot, dtype=torch.int32,
                                     device=device)
        self._rows = rows
        self.scratch_row = rows - 1
        self._free = list(range(rows - 2, -1, -1))  # a stack: the lowest row first
        self._row: dict[Req, int] = {}  # each holder (by identity: Req has eq=False) -> row
        self._slots: list[list[int]] = [[] for _ in range(rows)]  # each row's slots (host)
        self._last_read = [-1] * rows  # the last launched step that read each row
        self._deferred: list[int] = []  # given back while a step that read them runs
        self.launched_steps = 0  # steps launched so far (the next one's index)
        self.completed_steps = 0  # steps completed (they complete in launch order)

    @classmethod
    def host_only(cls, scratch_slot: int = -1) -> ReqToTokenTable:
        """The host record alone: no tensor, rows added on demand, any width."""
        return cls(2, 1 << 62, scratch_slot, device=None)

    @property
    def rows(self) -> int:
        """Rows of the table, the scratch row included."""
        return self._rows

    @property
    def device(self) -> torch.device:
        assert self.tensor is not None, "a host-only table has no device"
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

    # ------------------------------------------------------------------ the record
    def slots(self, req: Req, start: int = 0, end: int | None = None) -> list[int]:
        """The slots of ``req``'s positions ``start .. end - 1`` (all of them by default),
        read from the host record (empty for a request holding no row)."""
        row = self._row.get(req)
        return [] if row is None else self._slots[row][start:end]

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
        if not self._free and self.tensor is None:  # a host record grows on demand
            self._slots.append([])
            self._last_read.append(-1)
            self._free.append(self._rows - 1)
            self._rows += 1
            self.scratch_row = self._rows - 1
        if not self._free:
            raise ValueError(f"all {self.rows - 1} rows are taken or in flight: the table "
                             "is sized for max_running (twice it with overlap)")
        row = self._free.pop()
        self._row[req] = row
        self._slots[row] = []
        self.write(req, 0, slots)
        return row

    def write(self, req: Req, start: int, slots: Sequence[int]) -> None:
        """``slots`` at positions ``start ..`` of ``req``'s row: one copy to the device."""
        row, n = self._row[req], len(slots)
        host = self._slots[row]
        if start + n > self.width:
            raise ValueError(f"request {req.rid}: position {start + n - 1} is past the "
                             f"table's {self.width} columns")
        if start > len(host):
            raise ValueError(f"request {req.rid}: a write at position {start} leaves a gap "
                             f"after its {len(host)} slots")
        if n and self.tensor is not None:
            import torch

            self.tensor[row, start:start + n] = torch.tensor(slots, dtype=torch.int32).to(
                self.device)
        host[start:start + n] = slots

    def append(self, reqs: Sequence[Req], slots: Sequence[int]) -> None:
        """One slot after each request's last position (a decode step): one copy, one
        scatter for all of them."""
        held = self._slots
        rows = [held[self._row[req]] for req in reqs]  # each row's host record
        if rows and self.tensor is not None:
            import torch

            cols = list(map(len, rows))
            if max(cols) >= self.width:
                raise ValueError(f"a request's position reaches past the table's "
                                 f"{self.width} columns")
            index = [self._row[req] for req in reqs]
            moved = torch.tensor([index, cols, list(slots)], dtype=torch.long).to(self.device)
            self.tensor[moved[0], moved[1]] = moved[2].to(torch.int32)
        for row, slot in zip(rows, slots, strict=True):
            row.append(slot)

    def cut(self, req: Req, length: int) -> None:
        """``req``'s row holds its first ``length`` slots only (a truncation): the columns
        past it are never read again, so nothing is written to the device."""
        del self._slots[self._row[req]][length:]

    def give_back(self, req: Req) -> None:
        """``req`` leaves: its row is free again once no launched step may read it."""
        row = self._row.pop(req, None)
        if row is None:
            return
        self._slots[row] = []
        if self._last_read[row] >= self.completed_steps:
            self._deferred.append(row)
        else:
            self._free.append(row)

    # ------------------------------------------------------------------ steps
    def launched(self, reqs: Sequence[Req]) -> int:
        """A step that reads the rows of ``reqs`` is launched; its index. A host record
        alone is read by no device, so its rows are free again as soon as given back."""
        step = self.launched_steps
        if self.tensor is not None:
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
        if not self._deferred:  # the host record alone never defers a row
            return
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
        """``AssertionError`` unless every running request's row holds ``kv_len`` slots, the
        device row equals the host record (read back: a check, not the step path), no other
        request holds a row, and every row is held, deferred or free exactly once."""
        held = set(running)
        assert set(self._row) == held, (
            f"{len(self._row)} rows held by {len(held)} running requests")
        table = None if self.tensor is None else self.tensor.cpu()
        for req in running:
            row = self._row[req]
            host = self._slots[row]
            assert len(host) == req.kv_len, (
                f"request {req.rid}: row {row} holds {len(host)} slots, it has {req.kv_len}")
            assert table is None or table[row, :len(host)].tolist() == host, (
                f"request {req.rid}: row {row} on the device differs from the host record")
        rows = [*self._row.values(), *self._deferred, *self._free]
        assert sorted(rows) == list(range(self.rows - 1)), "a row is lost or counted twice"
        assert all(self.in_flight(row) for row in self._deferred), "a deferred row is idle"
        assert all(not self.in_flight(row) for row in self._free), "a free row is in flight"
        assert not self._slots[self.scratch_row], "the scratch row was written"
        assert table is None or bool((table[self.scratch_row] == self.scratch_slot).all()), (
            "the scratch row was written")
