"""What every attention backend is: built for a device, ``prepare(batch) -> metadata`` once
per step, ``forward(q, kv, metadata)`` in every layer, and, for the static decode buffers a
CUDA graph replays (``minisrv.runner.graph``), its ``graphs`` hooks.

``kv`` is one layer of the ``KVPool`` as it is laid out, [slots, 2, kv_heads, head_dim]
(each slot's key, then its value), already holding the step's new K/V (``write_kv``: one
operator for both). A step's batch is a ``TableBatch``: each request's slots are a row of a
request-to-token table (the scheduler's, or one a runner driven by hand builds from slot
lists, ``slot_table``). ``FlatBatch`` (``minisrv.model.flat``) is the teaching form the
chapters build by hand; no backend reads it.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from minisrv.model.layers import joint_kv
from minisrv.runner.table_batch import TableBatch

__all__ = ["AttentionBackend", "GraphHooks", "write_kv"]


def write_kv(kv: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The new tokens' keys and values into their ``slots`` of one pool layer ``kv``, in
    one operator: ``k`` and ``v`` [T, kv_heads, head_dim] are adjacent views of the fused
    projection's output (``joint_kv``), so [T, 2, kv_heads, head_dim] needs no copy."""
    kv.index_put_((slots,), joint_kv(k, v))


class GraphHooks(Protocol):
    """What a backend gives a decode step over static buffers (``DecodeGraphs``): buffers
    it owns for the largest bucket, allocated once (a CUDA graph replays on the very
    tensors it recorded), filled in stream order before each forward or replay, and read by
    the backend's own ``forward`` through the metadata of their first ``b`` rows."""

    def buffers(self, rows: int, context: int, scratch: int, device: torch.device) -> Any:
        """Static buffers for ``rows`` requests of up to ``context`` tokens; padding rows
        see only the pool's ``scratch`` slot."""
        ...

    def fill(self, buffers: Any, b: int, table: torch.Tensor, rows: torch.Tensor,
             lens: torch.Tensor) -> None:
        """The first ``b`` rows of ``buffers`` for requests whose slots are ``rows`` of the
        request-to-token ``table`` up to ``lens`` (on the device: no host work)."""
        ...

    def metadata(self, buffers: Any, b: int) -> Any:
        """The backend's ``forward`` metadata over the first ``b`` rows: views only, so a
        graph captured over them replays on whatever ``fill`` wrote."""
        ...


class AttentionBackend(Protocol):
    """One way to attend over a step's new tokens whose K/V sit in the pool.

    Built as ``Backend(device, dtype, head_dim, n_kv_heads)`` (the registry,
    ``minisrv.runner.attention.BACKENDS``, builds every backend so); a backend that cannot
    run there (a package missing, the wrong device) raises a ValueError naming itself and
    why, in its constructor, so a bad choice fails when the engine is built.
    """

    kind: str  # its name in the registry (``minisrv.runner.attention.BACKENDS``)
    # static decode buffers' hooks; None: this backend has none (its metadata depends on
    # the contexts' lengths), so the runner's static decode steps run the padded backend's
    graphs: GraphHooks | None

    def __init__(self, device: torch.device, dtype: torch.dtype, head_dim: int,
                 n_kv_heads: int) -> None: ...

    def prepare(self, batch: TableBatch) -> Any:
        """Everything the layers' calls share, built once per step before layer 0."""
        ...

    def forward(self, q: torch.Tensor, kv: torch.Tensor, metadata: Any) -> torch.Tensor:
        """Attention output [T, n_heads * head_dim] for queries ``q`` [T, heads, head_dim];
        ``kv`` [slots, 2, kv_heads, head_dim] is one layer of the pool, already holding the
        step's new K/V."""
        ...
