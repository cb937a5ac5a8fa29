"""The Triton attention backend: ``prepare(batch)`` once per step, ``forward(q, kv, metadata)``
in every layer, as the other backends (``minisrv.runner.attention``), reading the pool in
place through a request-to-token table (the kernels of ``triton_ops`` beside it).

``prepare`` turns the step into a ``TritonStep``: the table (int32 [requests, longest
context], row b holding request b's slots in position order) and, per request, its row,
its context, its new tokens and where they start among the step's rows. A step of decodes
only runs the split decode kernel; any other step runs the extend kernel for all of its
requests (a decode beside a prefill is an extend of one token), one call per layer either
way. The step's request-to-token table (the engine's, ``minisrv.kv.table``, or one built
from slot lists, ``slot_table``) is taken as it is and nothing per step is built but the
four small vectors.

Triton is optional: without the package, or on the CPU without its interpreter
(``TRITON_INTERPRET=1`` before triton is imported), asking for this backend is a clear
``ValueError`` (``triton_unavailable``), never an import error. The kernels' module is
imported when a backend is first built, not with this one: importing minisrv costs no
Triton import, and ``TRITON_INTERPRET`` set by then is the one the kernels see.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import NamedTuple

import torch

from minisrv.runner.attention.splits import kv_splits
from minisrv.runner.table_batch import TableBatch

TRITON_AVAILABLE: bool = importlib.util.find_spec("triton") is not None
"""Whether the triton package is installed (it comes with CUDA builds of torch)."""


def kernels() -> ModuleType:
    """``minisrv.runner.attention.triton_ops``, imported on first use (it imports triton)."""
    from minisrv.runner.attention import triton_ops

    return triton_ops

__all__ = ["TRITON_AVAILABLE", "TritonAttention", "TritonBuffers", "TritonGraphs", "TritonStep",
           "triton_unavailable"]


def triton_unavailable(device: str | torch.device) -> str | None:
    """Why the Triton backend cannot run on ``device`` here, or None when it can."""
    device = torch.device(device)
    if not TRITON_AVAILABLE:
        return ("attention='triton' needs the triton package (CUDA builds of torch bring "
                "it; on the CPU: pip install triton and set TRITON_INTERPRET=1)")
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if kernels().INTERPRETED:
            return None
        return ("attention='triton' on the CPU runs under Triton's interpreter: set "
                "TRITON_INTERPRET=1 in the environment before triton is first imported "
                "(importing minisrv.model imports it, through torch's compiler)")
    return f"attention='triton' runs on CUDA or, interpreted, on the CPU; not on {device}"


class TritonStep(NamedTuple):
    """One step as the Triton kernels read it (``TritonAttention.prepare``)."""

    table: torch.Tensor  # int32 [rows, width]: (row, position) -> pool slot
    rows: torch.Tensor  # int32 [B]: each request's row of the table
    contexts: torch.Tensor  # int32 [B]: tokens each request attends over, new ones included
    news: torch.Tensor  # int32 [B]: new tokens per request
    starts: torch.Tensor  # int32 [B]: each request's first row among the step's tokens
    splits: torch.Tensor  # int32 [B]: pieces of each decode's context (decode steps)
    max_new: int  # the most new tokens of any request (the extend grid)
    decode: bool  # every request computes one token: the split decode kernel

    @classmethod
    def of(cls, table: torch.Tensor, rows: torch.Tensor, contexts: torch.Tensor,
           news: torch.Tensor, max_new: int, max_splits: int = 8) -> TritonStep:
        """A step over an existing ``table``: ``rows``, ``contexts`` and ``news`` (int32
        [B], on the table's device) and the largest of ``news``, known on the host (read
        back from the device it would cost a sync per step); the starts and the decode
        pieces follow."""
        starts = (torch.cumsum(news, 0) - news).to(torch.int32)
        return cls(table, rows, contexts, news, starts,
                   kv_splits(contexts, max_splits), max_new, max_new == 1)


class TritonAttention:
    """Attention by the Triton kernels of ``triton_ops``, over the pool where it lies.

    ``max_splits`` caps the pieces a decode's context is cut into (the decode kernel's
    grid is requests x KV heads x ``max_splits``, whatever the contexts).
    """

    kind = "triton"

    def __init__(self, device: str | torch.device, dtype: torch.dtype, head_dim: int,
                 n_kv_heads: int, *, max_splits: int = 8) -> None:
        del dtype, head_dim, n_kv_heads  # the kernels take their shapes from each call
        reason = triton_unavailable(device)
        if reason is not None:
            raise ValueError(reason)
        if not 1 <= max_splits <= 64:
            raise ValueError(f"max_splits must be 1..64, got {max_splits}")
        self.max_splits = max_splits
        self.ops = kernels()
        self.graphs = TritonGraphs(max_splits)

    def prepare(self, batch: TableBatch) -> TritonStep:
        """The table, rows, contexts and new-token counts of the step, the table as it is."""
        return TritonStep.of(batch.table, batch.rows.int(), batch.ends.int(),
                             batch.news.int(), max(batch.new_lens), self.max_splits)

    def forward(self, q: torch.Tensor, kv: torch.Tensor, metadata: TritonStep) -> torch.Tensor:
        """Attention [T, heads * head_dim] of the step's queries ``q`` [T, heads, head_dim]
        over one pool layer ``kv`` [slots, 2, kv_heads, head_dim] holding the new K/V."""
        m = metadata
        if m.decode:
            out = self.ops.decode_attention(q, kv[:, 0], kv[:, 1], m.table, m.rows,
                                              m.contexts, m.splits, self.max_splits)
        else:
            out = self.ops.extend_attention(q, kv[:, 0], kv[:, 1], m.table, m.rows,
                                              m.contexts, m.news, m.starts, m.max_new)
        return out.reshape(q.shape[0], -1)

    def write(self, kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              metadata: TritonStep) -> None:
        """The step's new keys and values [T, kv_heads, head_dim] into their slots of the
        pool layer ``kv``, found through the step's table (what ``write_kv`` does with the
        flat batch's write slots)."""
        m = metadata
        self.ops.write_kv_table(kv[:, 0], kv[:, 1], k, v, m.table, m.rows, m.contexts,
                                  m.news, m.starts, m.max_new)


class TritonBuffers(NamedTuple):
    """The Triton decode's static buffers (``TritonGraphs.buffers``): a table of the bucket's
    own, row b holding bucket row b's slots, and the kernel's per-row vectors."""

    table: torch.Tensor  # int32 [rows, context] (padding rows: the scratch slot)
    rows: torch.Tensor  # int32 [rows]: 0 .. rows - 1
    contexts: torch.Tensor  # int32 [rows]
    news: torch.Tensor  # int32 [rows]: ones
    starts: torch.Tensor  # int32 [rows]: 0 .. rows - 1 (one query per row)
    splits: torch.Tensor  # int32 [rows]: pieces of each context (``kv_splits``)


class TritonGraphs:
    """``GraphHooks`` of the Triton backend: the decode kernel's grid depends on the batch
    and ``max_splits`` only, so one capture per bucket replays for any contexts; its table,
    rows, contexts and pieces are buffers filled before each replay. UNTESTED on a GPU
    (the eager path runs under the interpreter)."""

    def __init__(self, max_splits: int) -> None:
        self.max_splits = max_splits

    def buffers(self, rows: int, context: int, scratch: int,
                device: torch.device) -> TritonBuffers:
        def ints(values: torch.Tensor) -> torch.Tensor:
            return values.to(device, torch.int32)

        every = torch.arange(rows)
        return TritonBuffers(torch.full((rows, context), scratch, dtype=torch.int32,
                                        device=device),
                             ints(every), ints(torch.ones(rows)), ints(torch.ones(rows)),
                             ints(every), ints(torch.ones(rows)))

    def fill(self, buffers: TritonBuffers, b: int, table: torch.Tensor, rows: torch.Tensor,
             lens: torch.Tensor) -> None:
        width = min(buffers.table.shape[1], table.shape[1])  # columns past it: never read
        buffers.table[:b, :width].copy_(table[:, :width].index_select(0, rows))
        buffers.contexts[:b].copy_(lens)
        buffers.splits[:b].copy_(kv_splits(buffers.contexts[:b], self.max_splits))

    def metadata(self, buffers: TritonBuffers, b: int) -> TritonStep:
        return TritonStep(buffers.table, buffers.rows[:b], buffers.contexts[:b],
                          buffers.news[:b], buffers.starts[:b], buffers.splits[:b], 1, True)

