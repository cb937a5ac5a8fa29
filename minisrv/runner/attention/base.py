"""What every attention backend is: ``prepare(batch) -> metadata`` once per step,
``forward(q, kv, metadata)`` in every layer, and, for the static decode buffers a CUDA graph
replays (``minisrv.runner.graph``), its ``graphs`` hooks.

``kv`` is one layer of the ``KVPool`` as it is laid out, [slots, 2, kv_heads, head_dim]
(each slot's key, then its value), already holding the step's new K/V (``write_kv``: one
operator for both). A step's batch is the engine's ``TableBatch`` (each request's slots a
row of the request-to-token table) or a hand-built ``FlatBatch`` of slot lists (the
teaching form); a backend reads either.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from minisrv.model.flat import FlatBatch
from minisrv.model.layers import joint_kv
from minisrv.runner.table_batch import TableBatch

__all__ = ["AttentionBackend", "GraphHooks", "StepBatch", "contexts", "write_kv"]

StepBatch = FlatBatch | TableBatch
"""A step's batch as the backends read it: slot lists (the teaching form) or table rows."""


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
    """One way to attend over a flat batch whose K/V sit in the pool."""

    kind: str  # its name in the registry (``minisrv.runner.attention.BACKENDS``)
    graphs: GraphHooks | None  # static decode buffers' hooks (None: the padded backend's)

    def prepare(self, batch: StepBatch) -> Any:
        """Everything the layers' calls share, built once per step before layer 0."""
        ...

    def forward(self, q: torch.Tensor, kv: torch.Tensor, metadata: Any) -> torch.Tensor:
        """Attention output [T, n_heads * head_dim] for queries ``q`` [T, heads, head_dim];
        ``kv`` [slots, 2, kv_heads, head_dim] is one layer of the pool, already holding the
        step's new K/V."""
        ...


def contexts(batch: StepBatch) -> list[int]:
    """Each request's context (its slots, new ones included), known on the host."""
    if isinstance(batch, TableBatch):
        return batch.contexts
    return [len(s) for s in batch.slot_lists]
