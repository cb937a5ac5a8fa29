"""The attention backends: one registry, one file per backend.

Each backend (``base.AttentionBackend``) owns what it builds from a step's batch before
layer 0 (``prepare(batch) -> metadata``: index tensors, masks, the table rows it reads), its
per-layer call (``forward(q, kv, metadata)``) and, where it runs the static decode buffers
a CUDA graph replays, their hooks (``graphs``: static buffers for a bucket, filled before a
replay, read through its own ``forward``; ``minisrv.runner.graph`` goes through them).
Every backend gives the tokens of ``CityLM.forward_flat`` (``minisrv.model.flat``).

* ``base.py``: the interface, ``write_kv``, ``StepBatch``;
* ``padded.py``: masked SDPA per group of requests, and the static decode hooks;
* ``loop.py``: one call per request; ``flex.py``: one ragged flex_attention call;
* ``triton.py``: the Triton kernels of ``minisrv.runner.triton_ops``, over the pool in place,
  and their static decode hooks (the loop and flex backends have none: static decode runs
  the padded backend's beside them).

Adding a kernel is one file here and one line in ``BACKENDS``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minisrv.model.flat import resolve_attention
from minisrv.runner.attention.base import (
    AttentionBackend,
    GraphHooks,
    StepBatch,
    contexts,
    write_kv,
)
from minisrv.runner.attention.flex import FlexAttention
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
from minisrv.runner.attention_choice import auto_attention

__all__ = [
    "BACKENDS",
    "SPLIT_ELEMENTS",
    "AttentionBackend",
    "FlexAttention",
    "GraphHooks",
    "LoopAttention",
    "PaddedAttention",
    "PaddedGraphs",
    "PaddedStep",
    "StepBatch",
    "TritonAttention",
    "contexts",
    "decode_group",
    "length_cuts",
    "make_attention",
    "padded_pool_attention",
    "write_kv",
]

Factory = Callable[[torch.device, torch.dtype, int], AttentionBackend]

BACKENDS: dict[str, Factory] = {
    "loop": lambda device, dtype, kv_elements: LoopAttention(),
    "padded": lambda device, dtype, kv_elements: PaddedAttention(dtype, kv_elements, device),
    "flex": lambda device, dtype, kv_elements: FlexAttention(),
    "triton": lambda device, dtype, kv_elements: TritonAttention(device),
}
"""Each backend's name and how to build it for a device, the queries' dtype and the key
elements of one slot (KV heads x head dim)."""


def make_attention(kind: str, device: torch.device, dtype: torch.dtype,
                   head_dim: int, n_kv_heads: int = 2) -> AttentionBackend:
    """The backend for ``kind`` (``"auto"``: the table of ``attention_choice``; flex only
    where it compiles, else padded). ``"triton"`` (issue 39's in-place kernels) is checked
    by the backend itself: a clear ValueError where Triton cannot run."""
    if kind != "triton":
        kind = auto_attention(device, dtype, head_dim) if kind == "auto" else kind
        kind = resolve_attention(kind, device, dtype, head_dim)
    if kind not in BACKENDS:
        raise ValueError(f"unknown attention {kind!r}; choose from {tuple(BACKENDS)} or 'auto'")
    return BACKENDS[kind](torch.device(device), dtype, n_kv_heads * head_dim)
