"""Token slots ``0 .. capacity - 1`` handed out and taken back a page at a time: the KV
pool's bookkeeping.

A page is ``page_size`` consecutive slots (page p holds slots ``p * page_size ..``); the
allocator hands out and takes back whole pages, and speaks in slots, so the
request-to-token table still maps every token to its slot and the attention backends read
the pool as before (SGLang's ``PagedTokenToKVPoolAllocator``,
``mem_cache/allocator/paged.py``: ``alloc`` takes a page-aligned size, ``free`` returns
the pages of the slots it is given). With ``page_size`` 1 a page is a slot.

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
    """Hands out and takes back token slots ``0 .. capacity - 1``, ``page_size`` at a time.

    ``capacity`` counts slots: ``capacity // page_size`` whole pages (a remainder is left
    unused). ``free_count`` and ``used_count`` count slots of free and handed-out pages.
    Every error (asking for more than is free or for part of a page, freeing a page twice
    or one that was never handed out) is raised before anything changes, so a caller that
    catches the ValueError still holds a consistent allocator: ``free_count + used_count
    == capacity`` always.
    """

    def __init__(self, capacity: int, page_size: int = 1) -> None:
        self.size = check_int("capacity", capacity, minimum=1)  # as asked, whole pages or not
        self._used = np.zeros(0, dtype=bool)  # no page handed out yet
        self.set_page_size(page_size)

    def set_page_size(self, page_size: int) -> None:
        """Hand out ``page_size`` slots at a time from now on (the scheduler sets its
        config's on the backend's pool); ValueError unless every page is free."""
        check_int("page_size", page_size, minimum=1)
        capacity = self.size
        if capacity < page_size:
            raise ValueError(f"capacity {capacity} holds no page of {page_size} slots")
        if self._used.any():
            raise ValueError("the page size changes only while no page is handed out")
        self.page_size = page_size
        self.n_pages = capacity // page_size
        self.capacity = self.n_pages * page_size
        # A stack of free pages, its top at ``_stack[_n_free - 1]``; reversed so a fresh pool
        # hands out 0, 1, 2, ... A numpy array, so a prefill's thousands of slots move in one
        # slice instead of being converted between Python ints and array indices one by one.
        self._stack = np.arange(self.n_pages - 1, -1, -1, dtype=np.int64)
        self._n_free = self.n_pages
        self._used = np.zeros(self.n_pages, dtype=bool)  # True where the page is handed out
        self._offsets = np.arange(page_size, dtype=np.int64)

    @property
    def free_count(self) -> int:
        """Slots available to ``alloc`` (free pages times ``page_size``)."""
        return self._n_free * self.page_size

    @property
    def used_count(self) -> int:
        """Slots of the pages handed out and not yet freed."""
        return self.capacity - self.free_count

    @property
    def free_pages(self) -> int:
        """Pages available to ``alloc``."""
        return self._n_free

    def alloc(self, n: int) -> list[int]:
        """The slots of ``n / page_size`` free pages (n may be 0), each page's in order;
        ValueError, changing nothing, if fewer are free or ``n`` is not whole pages."""
        n = check_int("alloc's slot count", n, minimum=0)
        ps = self.page_size
        if n % ps:
            raise ValueError(f"alloc of {n} slots: pages hold {ps}, ask for whole pages")
        top, k = self._n_free, n // ps
        if k > top:
            raise ValueError(
                f"KV pool exhausted: asked for {n} slots, only {top * ps} of "
                f"{self.capacity} are free"
            )
        pages = self._stack[top - k:top][::-1]  # popped from the top, the top first
        self._used[pages] = True
        self._n_free = top - k
        if ps == 1:
            return pages.tolist()
        return (pages[:, None] * ps + self._offsets).reshape(-1).tolist()

    def free(self, slots: Iterable[int]) -> None:
        """Give back the pages of ``slots`` (any slot of a page names it; a request's last
        page may be partly filled); ``check_free`` rejects foreign slots and double frees
        first."""
        pages = check_free(self, slots)
        self._used[pages] = False
        top = self._n_free
        self._stack[top:top + pages.size] = pages[::-1]  # pushed in order, the last on top
        self._n_free = top + pages.size

    def is_used(self, slot: int) -> bool:
        """True while ``slot``'s page is handed out."""
        return 0 <= slot < self.capacity and bool(self._used[slot // self.page_size])

    def __repr__(self) -> str:
        page = "" if self.page_size == 1 else f", page_size={self.page_size}"
        return f"SlotAllocator(capacity={self.capacity}, used={self.used_count}{page})"


def slot_count(name: str, doc: str) -> property:
    """A read-only property for ``self.allocator.<name>``: a pool counts its slots through the
    allocator it holds, so the device pool and the host pool answer alike."""
    return property(operator.attrgetter(f"allocator.{name}"), doc=doc)


def check_free(allocator: SlotAllocator, slots: Iterable[int]) -> np.ndarray:
    """The pages of ``slots`` as an index array (each once, in the order first named), or
    ValueError (nothing changed) if any of them is not handed out by ``allocator``: outside
    the pool, free already, or a slot named twice."""
    values = slots if isinstance(slots, list) else list(slots)
    index = np.asarray(values, dtype=np.int64)
    if not values:
        return index
    capacity, ps = allocator.capacity, allocator.page_size
    if index.min() < 0 or index.max() >= capacity:
        s = int(index[np.argmax((index < 0) | (index >= capacity))])
        raise ValueError(f"slot {s} does not belong to this pool (0..{capacity - 1})")
    pages = index if ps == 1 else index // ps
    used = allocator._used[pages]
    if not used.all():
        s = int(index[np.argmin(used)])
        raise ValueError(f"slot {s} is not in use: double free or never allocated")
    # A set of the slots costs what freeing them costs; a pass over the pool's flags
    # would cost its whole capacity on every free.
    if len(set(values)) != len(values):
        s = _first_repeat(values)
        raise ValueError(f"slot {s} is not in use: double free or never allocated")
    if ps == 1:
        return index
    _, first = np.unique(pages, return_index=True)
    return pages[np.sort(first)]


def _first_repeat(values: list[int]) -> int:
    seen: set[int] = set()
    for v in values:
        if v in seen:
            return v
        seen.add(v)
    raise ValueError("no repeated value")
