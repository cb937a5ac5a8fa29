"""Future token ids: step i+1's inputs name step i's outputs before they exist.

The overlapped loop forms step i+1 while the device still computes step i, so a decoding
request's next input (its newest token) is not known yet. As in SGLang 0.4 to 0.5.9 (0.5.23
indexes its buffer by request slot instead), the CPU hands out a *future id*: a negative
number ``-k`` that names slot ``k`` of a buffer on the device. When step i has sampled its
tokens, the device writes them to their slots (``store``); before step i+1's forward, one
``torch.where`` replaces every negative id by its slot's value (``resolve``). Nothing waits
on the CPU, and the tokens never leave the device between the two steps.

Slots are handed out round-robin from a ring of ``capacity``, so a slot is handed out again
after ``capacity`` further reservations: the loop sizes the ring so that every future is
resolved before then (two steps' batches is ample for a loop that runs one step ahead).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["FutureMap"]


class FutureMap:
    """A ring of ``capacity`` device-side token slots, addressed by negative ids -1..-capacity.

    Slot 0 of the buffer is never handed out, so ``-0`` never names a future and every
    real token id (>= 0) passes through ``resolve`` unchanged.
    """

    def __init__(self, capacity: int, device: str | torch.device = "cpu") -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral) or (
            capacity < 1
        ):
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self.buffer = torch.zeros(self.capacity + 1, dtype=torch.long, device=self.device)
        # On the CPU the buffer is also written through a numpy view of the same memory: one
        # array assignment, where a torch index_put costs tens of microseconds per step.
        self._host = self.buffer.numpy() if self.device.type == "cpu" else None
        # Every future id twice over, so that n ids from any ring position are one slice; the
        # same ids as Python ints, for the placeholders the CPU writes (no device round trip).
        ids = -torch.arange(1, self.capacity + 1, device=self.device)
        self._ids = torch.cat([ids, ids])
        self._id_list: list[int] = [-k for k in range(1, self.capacity + 1)] * 2
        self._next = 0  # the ring position of the next future id handed out

    def reserve(self, n: int) -> torch.Tensor:
        """``n`` fresh future ids (negative, on the device), one per request of a step."""
        start = self._advance(n)
        return self._ids[start:start + n]

    def reserve_ids(self, n: int) -> tuple[torch.Tensor, list[int]]:
        """``reserve(n)``, and the same ids as Python ints for the CPU's placeholders."""
        start = self._advance(n)
        return self._ids[start:start + n], self._id_list[start:start + n]

    def _advance(self, n: int) -> int:
        """Take ``n`` ids from the ring; return the position of the first."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 0 <= n:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if n > self.capacity:
            raise ValueError(f"cannot reserve {n} futures in a ring of {self.capacity}")
        start = self._next
        self._next = (start + n) % self.capacity
        return start

    def store(self, future_ids: torch.Tensor, tokens: torch.Tensor | Sequence[int]) -> None:
        """Write the tokens a step sampled into the slots its future ids name (on device).

        ``future_ids`` are ``reserve``'s answer for this step; their values are not checked
        here, since that would make the CPU wait for the device. ``tokens``: a tensor or a
        list of ints.
        """
        if len(future_ids) != len(tokens):
            raise ValueError(f"{len(future_ids)} future ids for {len(tokens)} tokens")
        if self._host is not None:
            values = (tokens.numpy() if isinstance(tokens, torch.Tensor)
                      else np.fromiter(tokens, np.int64, len(tokens)))  # no dtype guessing
            self._host[-future_ids.numpy()] = values
        else:
            values = torch.as_tensor(tokens, device=self.device)
            self.buffer[-future_ids] = values.to(self.buffer.dtype)

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` with every future id replaced by its token: one ``torch.where``."""
        slots = (-input_ids).clamp(min=0, max=self.capacity)
        return torch.where(input_ids < 0, self.buffer[slots], input_ids)
