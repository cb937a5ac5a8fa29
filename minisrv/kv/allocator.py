"""Token slots ``0 .. capacity - 1`` handed out and taken back: the KV pool's bookkeeping.

The bookkeeping is separate from the tensors (``KVPool``), so the simulated backend counts
slots exactly as the real one does without holding any memory.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import numpy as np

from minisrv.checks import check_int

__all__ = ["SlotAllocator", "check_free", "slot_count"]


class SlotAllocator:
    """Hands out and takes back token slots ``0 .. capacity - 1``.

    Every error (asking for more than is free, freeing a slot twice or one that was never
    handed out) is raised before anything changes, so a caller that catches the ValueError
    still holds a consistent allocator: ``free_count + used_count == capacity`` always.
    """

    def __init__(self, capacity: int) -> None:
        check_int("capacity", capacity, minimum=1)
        self.capacity = capacity
        # A stack of free slots, its top at ``_stack[_n_free - 1]``; reversed so a fresh pool
        # hands out 0, 1, 2, ... A numpy array, so a prefill's thousands of slots move in one
        # slice instead of being converted between Python ints and array indices one by one.
        self._stack = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self._n_free = capacity
        self._used = np.zeros(capacity, dtype=bool)  # True where the slot is handed out

    @property
    def free_count(self) -> int:
        """Slots available to ``alloc``."""
        return self._n_free

    @property
    def used_count(self) -> int:
        """Slots handed out and not yet freed."""
        return self.capacity - self._n_free

    def alloc(self, n: int) -> list[int]:
        """``n`` free slots (n may be 0); ValueError, changing nothing, if fewer are free."""
        n = check_int("alloc's slot count", n, minimum=0)
        top = self._n_free
        if n > top:
            raise ValueError(
                f"KV pool exhausted: asked for {n} slots, only {top} of "
                f"{self.capacity} are free"
            )
        slots = self._stack[top - n:top][::-1]  # popped from the top, the top first
        self._used[slots] = True
        self._n_free = top - n
        return slots.tolist()

    def free(self, slots: Iterable[int]) -> None:
        """Give ``slots`` back; ``check_free`` rejects foreign slots and double frees first."""
        index = check_free(self, slots)
        self._used[index] = False
        top = self._n_free
        self._stack[top:top + index.size] = index[::-1]  # pushed in order, the last on top
        self._n_free = top + index.size

    def is_used(self, slot: int) -> bool:
        """True while ``slot`` is handed out."""
        return 0 <= slot < self.capacity and bool(self._used[slot])

    def __repr__(self) -> str:
        return f"SlotAllocator(capacity={self.capacity}, used={self.used_count})"


def slot_count(name: str, doc: str) -> property:
    """A read-only property for ``self.allocator.<name>``: a pool counts its slots through the
    allocator it holds, so the device pool and the host pool answer alike."""
    return property(operator.attrgetter(f"allocator.{name}"), doc=doc)


def check_free(allocator: SlotAllocator, slots: Iterable[int]) -> np.ndarray:
    """``slots`` as an index array, or ValueError (nothing changed) if any of them is not
    handed out by ``allocator``: outside the pool, free already, or named twice."""
    values = slots if isinstance(slots, list) else list(slots)
    index = np.asarray(values, dtype=np.int64)
    if not values:
        return index
    capacity = allocator.capacity
    if index.min() < 0 or index.max() >= capacity:
        s = int(index[np.argmax((index < 0) | (index >= capacity))])
        raise ValueError(f"slot {s} does not belong to this pool (0..{capacity - 1})")
    used = allocator._used[index]
    if not used.all():
        s = int(index[np.argmin(used)])
        raise ValueError(f"slot {s} is not in use: double free or never allocated")
    # A set of the slots costs what freeing them costs; a pass over the pool's flags
    # would cost its whole capacity on every free.
    if len(set(values)) != len(values):
        s = _first_repeat(values)
        raise ValueError(f"slot {s} is not in use: double free or never allocated")
    return index


def _first_repeat(values: list[int]) -> int:
    seen: set[int] = set()
    for v in values:
        if v in seen:
            return v
        seen.add(v)
    raise ValueError("no repeated value")
