"""A fixed pool of KV token slots, shared by every request the engine runs.

A real server does not grow one KV tensor per request (``DenseKVCache``): it reserves one
big block of memory up front and hands out *token slots*. Slot ``s`` holds the key and the
value of one token in every layer, at ``k[layer, s]`` and ``v[layer, s]``. A request owns a
list of slots, in position order, that need not be contiguous; the attention gathers them.
This is SGLang's token-to-KV pool (and, with one-token pages, vLLM's paged KV cache).

The bookkeeping (``SlotAllocator``, ``allocator.py``) is separate from the tensors
(``KVPool``), so the simulated backend counts slots exactly as the real one does without
holding any memory.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from minisrv.configs import ModelConfig
from minisrv.kv.allocator import SlotAllocator

__all__ = ["KVPool"]


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
