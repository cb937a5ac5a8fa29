"""``DenseKVCache``: one request's keys and values, and the attention ``CityLM.forward`` runs
over it."""

from __future__ import annotations

import torch

from minisrv.model.layers import grouped_attention


class DenseKVCache:
    """The keys and values of one request, one growing tensor per layer.

    This is the plainest possible layout: each ``update`` concatenates the new tokens'
    K/V to what is stored. Every append copies the whole history, and memory is reserved
    per request rather than pooled; the later chapters replace it with a token-slot pool.
    Keys are stored after RoPE, so they never need recomputing.
    """

    def __init__(self, n_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers

    def __len__(self) -> int:
        """Tokens stored (the number of positions already processed)."""
        first = self.keys[0]
        return 0 if first is None else first.shape[0]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``/``v`` ([T, n_kv_heads, head_dim]) to ``layer``; return all K/V stored."""
        old_k, old_v = self.keys[layer], self.values[layer]
        self.keys[layer] = k if old_k is None else torch.cat([old_k, k], dim=0)
        self.values[layer] = v if old_v is None else torch.cat([old_v, v], dim=0)
        return self.keys[layer], self.values[layer]

    @property
    def nbytes(self) -> int:
        """Bytes held by the stored K and V tensors."""
        tensors = [t for t in (*self.keys, *self.values) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def __repr__(self) -> str:
        return f"DenseKVCache(tokens={len(self)}, layers={len(self.keys)})"


def cache_attention(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cache: DenseKVCache | None,
    mask: torch.Tensor,
) -> torch.Tensor:
    """One request's attention at ``layer``: append the new K/V to ``cache``, attend to all.

    Without a cache the new tokens see only each other. ``mask`` is the request's
    ``causal_mask`` (same for every layer). This is ``CityLM.forward``'s ``LayerAttend``.
    """
    if cache is not None:
        k, v = cache.update(layer, k, v)
    return grouped_attention(q, k, v, mask)
