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
        # A stack popped from the end; reversed so a fresh pool hands out 0, 1, 2, ...
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._used = np.zeros(capacity, dtype=bool)  # True where the slot is handed out

    @property
    def free_count(self) -> int:
        """Slots available to ``alloc``."""
        return len(self._free)

    @property
    def used_count(self) -> int:
        """Slots handed out and not yet freed."""
        return self.capacity - len(self._free)

    def alloc(self, n: int) -> list[int]:
        """``n`` free slots (n may be 0); ValueError, changing nothing, if fewer are free."""
        n = check_int("alloc's slot count", n, minimum=0)
        if n > len(self._free):
            raise ValueError(
                f"KV pool exhausted: asked for {n} slots, only {len(self._free)} of "
                f"{self.capacity} are free"
            )
        if n == 0:
            return []
        slots = self._free[-n:]
        del self._free[-n:]
        slots.reverse()
        self._used[slots] = True
        return slots

    def free(self, slots: Iterable[int]) -> None:
        """Give ``slots`` back. Rejects foreign slots and double frees before freeing any."""
        index = np.fromiter(slots, dtype=np.int64) if not isinstance(slots, list) \
            else np.asarray(slots, dtype=np.int64)
        if index.size == 0:
            return
        outside = (index < 0) | (index >= self.capacity)
        if outside.any():
            s = int(index[np.argmax(outside)])
            raise ValueError(f"slot {s} does not belong to this pool (0..{self.capacity - 1})")
        unused = ~self._used[index]
        if unused.any() or np.unique(index).size != index.size:
            s = int(index[np.argmax(unused)]) if unused.any() else _first_repeat(index.tolist())
            raise ValueError(f"slot {s} is not in use: double free or never allocated")
        self._used[index] = False
        self._free.extend(index[::-1].tolist())

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
