"""A fixed pool of KV token slots, shared by every request the engine runs.

A real server does not grow one KV tensor per request (``DenseKVCache``): it reserves one
big block of memory up front and hands out *token slots*. Slot ``s`` holds the key and the
value of one token in every layer, at ``k[layer, s]`` and ``v[layer, s]``. A request owns a
list of slots, in position order, that need not be contiguous; the attention gathers them.
This is SGLang's token-to-KV pool (and, with one-token pages, vLLM's paged KV cache).

The bookkeeping (``SlotAllocator``) is separate from the tensors (``KVPool``), so the
simulated backend can count slots exactly as the real one does without holding any memory.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from minisrv.checks import check_int
from minisrv.configs import ModelConfig

__all__ = ["SlotAllocator", "KVPool"]


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
        """Give ``slots`` back. Rejects foreign slots and double frees before freeing any."""
        values = slots if isinstance(slots, list) else list(slots)
        if not values:
            return
        index = np.asarray(values, dtype=np.int64)
        if index.min() < 0 or index.max() >= self.capacity:
            s = int(index[np.argmax((index < 0) | (index >= self.capacity))])
            raise ValueError(f"slot {s} does not belong to this pool (0..{self.capacity - 1})")
        used = self._used[index]
        if not used.all():
            s = int(index[np.argmin(used)])
            raise ValueError(f"slot {s} is not in use: double free or never allocated")
        # A set of the slots costs what freeing them costs; a pass over the pool's flags
        # would cost its whole capacity on every free.
        if len(set(values)) != len(values):
            s = _first_repeat(values)
            raise ValueError(f"slot {s} is not in use: double free or never allocated")
        self._used[index] = False
        top = self._n_free
        self._stack[top:top + index.size] = index[::-1]  # pushed in order, the last on top
        self._n_free = top + index.size

    def is_used(self, slot: int) -> bool:
        """True while ``slot`` is handed out."""
        return 0 <= slot < self.capacity and bool(self._used[slot])

    def __repr__(self) -> str:
        return f"SlotAllocator(capacity={self.capacity}, used={self.used_count})"


def _first_repeat(values: list[int]) -> int:
    seen: set[int] = set()
    for v in values:
        if v in seen:
            return v
        seen.add(v)
    raise ValueError("no repeated value")


class KVPool:
    """K and V tensors ``[layers, capacity, kv_heads, head_dim]`` plus their slot allocator.

    Build one for a model with ``KVPool.for_model(model, capacity)`` so the tensors sit on
    the model's device in its dtype. Keys are stored after RoPE, as in ``DenseKVCache``.
    """

    def __init__(
        self,
        config: ModelConfig,
        capacity: int,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.allocator = SlotAllocator(capacity)
        self.config = config
        shape = (config.n_layers, capacity, config.n_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @classmethod
    def for_model(cls, model: torch.nn.Module, capacity: int) -> KVPool:
        """A pool matching ``model`` (a ``CityLM``): its config, device and dtype."""
        return cls(model.config, capacity, device=model.device, dtype=model.dtype)

    @property
    def capacity(self) -> int:
        """Token slots in the pool."""
        return self.allocator.capacity

    @property
    def free_count(self) -> int:
        """Slots available."""
        return self.allocator.free_count

    @property
    def used_count(self) -> int:
        """Slots handed out."""
        return self.allocator.used_count

    def alloc(self, n: int) -> list[int]:
        """``n`` free slots; ValueError (pool unchanged) if fewer are free."""
        return self.allocator.alloc(n)

    def free(self, slots: Iterable[int]) -> None:
        """Give ``slots`` back (their stale K/V stay until the slot is reused)."""
        self.allocator.free(slots)

    @property
    def nbytes(self) -> int:
        """Bytes reserved by the K and V tensors, used or not."""
        return 2 * self.k.numel() * self.k.element_size()

    def __repr__(self) -> str:
        return (
            f"KVPool(capacity={self.capacity}, used={self.used_count}, "
            f"dtype={self.k.dtype}, device={self.k.device})"
        )
