"""The attention backends: one registry, one module per backend.

Each backend (``base.AttentionBackend``) is built for a device, the queries' dtype and the
model's head size and KV heads, and says in its constructor whether it can run there (a
ValueError naming it and why); it owns what it builds from a step's ``TableBatch`` before
layer 0 (``prepare(batch) -> metadata``: index tensors, masks, the table rows it reads),
its per-layer call (``forward(q, kv, metadata)``) and, where it runs the static decode
buffers a CUDA graph replays, their hooks (``graphs``: static buffers for a bucket, filled
before a replay, read through its own ``forward``; ``minisrv.runner.graph`` goes through
them). Every backend gives the tokens of ``CityLM.forward_flat`` (``minisrv.model.flat``).

* ``base.py``: the interface and ``write_kv``;
* ``padded.py``: masked SDPA per group of requests, and the static decode hooks;
* ``loop.py``: one call per request; ``flex.py``: one ragged flex_attention call (these two
  have no static decode hooks: their metadata depends on the contexts' lengths);
* ``hybrid.py``: decodes through the padded call, prefills through flex's, a mixed step
  split between them (after SGLang's prefill and decode backends, which split by step);
* ``triton.py``: the Triton kernels of ``triton_ops.py``, over the pool in place, and
  their static decode hooks;
* ``choice.py``: the table ``"auto"`` reads, from what the device declares.

``BACKENDS`` is the one table of attention names: ``Engine(attention=...)`` takes one of
its keys or ``"auto"`` (checked here, when the runner is built: ``scheduler/`` imports
neither ``runner/`` nor torch, so the configuration cannot hold the list), the choice
table names backends by their ``kind``, and ``minisrv.model.flat``'s teaching functions are
the oracles of the backends of the same names. Adding a kernel is one module here and one
line in ``BACKENDS``.
"""

from __future__ import annotations

import torch

from minisrv.runner.attention.base import AttentionBackend, GraphHooks, write_kv
from minisrv.runner.attention.choice import auto_attention
from minisrv.runner.attention.flex import FlexAttention
from minisrv.runner.attention.hybrid import HybridAttention
from minisrv.runner.attention.loop import LoopAttention
from minisrv.runner.attention.padded import (
    SPLIT_ELEMENTS,
    PaddedAttention,
    PaddedGraphs,
    PaddedStep,
    decode_group,
    length_cuts,
    padded_pool_attention,
)
from minisrv.runner.attention.triton import TritonAttention

__all__ = [
    "BACKENDS",
    "SPLIT_ELEMENTS",
    "AttentionBackend",
    "FlexAttention",
    "GraphHooks",
    "HybridAttention",
    "LoopAttention",
    "PaddedAttention",
    "PaddedGraphs",
    "PaddedStep",
    "TritonAttention",
    "decode_group",
    "length_cuts",
    "make_attention",
    "padded_pool_attention",
    "write_kv",
]

BACKENDS: dict[str, type[AttentionBackend]] = {
    backend.kind: backend
    for backend in (LoopAttention, PaddedAttention, FlexAttention, HybridAttention,
                    TritonAttention)
}
"""Each backend by its name (its ``kind``), built as ``Backend(device, dtype, head_dim,
n_kv_heads)``."""


def make_attention(kind: str, device: str | torch.device, dtype: torch.dtype,
                   head_dim: int, n_kv_heads: int = 2) -> AttentionBackend:
    """The backend named ``kind`` for a model on ``device`` with heads of ``head_dim`` and
    ``n_kv_heads`` KV heads (``"auto"``: the table of ``choice.py``). An unknown name is a
    ValueError naming the registry's; a backend that cannot run here raises its own."""
    if kind == "auto":
        kind = auto_attention(device, dtype, head_dim)
    if kind not in BACKENDS:
        raise ValueError(f"unknown attention {kind!r}; choose from {tuple(BACKENDS)} or 'auto'")
    return BACKENDS[kind](torch.device(device), dtype, head_dim, n_kv_heads)
