"""A fixed pool of KV token slots, shared by every request the engine runs.

A real server does not grow one KV tensor per request (``DenseKVCache``): it reserves one
big block of memory up front and hands out *token slots*. Slot ``s`` holds the key and the
value of one token in every layer, side by side at ``kv[layer, s]`` ([2, kv_heads, head_dim]:
the key, then the value), so a step writes its new keys and values with one operator per
layer and gathers a request's history with one more; ``k[layer, s]`` and ``v[layer, s]``
are views of the two halves. A request owns a
list of slots, in position order, that need not be contiguous; the attention gathers them.
This is SGLang's token-to-KV pool (and, with one-token pages, vLLM's paged KV cache).

The bookkeeping (``SlotAllocator``, ``allocator.py``) is separate from the tensors
(``KVPool``), so the simulated backend counts slots exactly as the real one does without
holding any memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from minisrv.configs import ModelConfig
from minisrv.kv.allocator import SlotAllocator, slot_count

if TYPE_CHECKING:  # imported where the tensor is made: ``minisrv.kv`` loads without torch
    import torch

__all__ = ["KVPool"]


class KVPool:
    """One tensor ``kv`` [layers, capacity + 1, 2, kv_heads, head_dim] plus its slot allocator.

    Build one for a model with ``KVPool.for_model(model, capacity)`` so the tensor sits on
    the model's device in its dtype. Keys are stored after RoPE, as in ``DenseKVCache``.
    ``k`` and ``v`` [layers, capacity, kv_heads, head_dim] are views of the keys and values.
    The row past the last slot, ``scratch_slot``, is never handed out: padding rows of a
    step padded to a fixed batch size (``minisrv.runner.graph``) write and read there, so
    they never touch a request's slot.
    """

    def __init__(
        self,
        config: ModelConfig,
        capacity: int,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,  # None: float32
    ) -> None:
        import torch

        self.allocator = SlotAllocator(capacity)
        self.config = config
        shape = (config.n_layers, capacity + 1, 2, config.n_kv_heads, config.head_dim)
        self.kv = torch.zeros(shape, device=device, dtype=torch.float32 if dtype is None else dtype)
        self.scratch_slot = capacity

    @property
    def k(self) -> torch.Tensor:
        """The keys [layers, capacity, kv_heads, head_dim]: a view, writes go to ``kv``."""
        return self.kv[:, : self.scratch_slot, 0]

    @property
    def v(self) -> torch.Tensor:
        """The values [layers, capacity, kv_heads, head_dim]: a view, writes go to ``kv``."""
        return self.kv[:, : self.scratch_slot, 1]

    @classmethod
    def for_model(cls, model: torch.nn.Module, capacity: int) -> KVPool:
        """A pool matching ``model`` (a ``CityLM``): its config, device and dtype."""
        return cls(model.config, capacity, device=model.device, dtype=model.dtype)

    capacity = slot_count("capacity", "Token slots in the pool.")
    free_count = slot_count("free_count", "Slots available.")
    used_count = slot_count("used_count", "Slots handed out.")

    def alloc(self, n: int) -> list[int]:
        """``n`` free slots; ValueError (pool unchanged) if fewer are free."""
        return self.allocator.alloc(n)

    def free(self, slots: Iterable[int]) -> None:
        """Give ``slots`` back (their stale K/V stay until the slot is reused)."""
        self.allocator.free(slots)

    @property
    def nbytes(self) -> int:
        """Bytes the slots' keys and values take, used or not (the scratch slot left out)."""
        return 2 * self.k.numel() * self.k.element_size()

    def __repr__(self) -> str:
        return (
            f"KVPool(capacity={self.capacity}, used={self.used_count}, "
            f"dtype={self.kv.dtype}, device={self.kv.device})"
        )
