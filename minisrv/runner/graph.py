"""Graph-ready decode: decode steps that read only runner-owned static buffers.

A CUDA graph replays the kernels it recorded on the very tensors it recorded them on, with
the very shapes. So a decode step that is to be replayed must find its inputs (token ids,
positions, the slots its new K/V go to, and the attention's own: e.g. the padded backend's
key slots and mask, through the hooks of the backend it is given, ``AttentionBackend.graphs``) in
buffers the runner owns and never reallocates, padded to one of a few batch sizes, the *buckets*
1, 2, 4, 8, 16, 24, ... up to ``max_running`` (as nano-vllm's ``model_runner.py`` and
mini-sglang's ``engine/graph.py`` do). ``DecodeGraphs`` holds those buffers for the largest
bucket; a step uses their first ``bucket`` rows.

* ``prepare`` (the scheduler's thread) turns a decode batch into a ``PaddedDecode``: each
  request's token, row of the request-to-token table (``minisrv.kv.table``) and context,
  padded to the bucket and moved to the device in one copy. It must not touch the static
  buffers: in the overlapped loop the previous step may be reading them.
* ``run`` (the device's thread) copies the step into the static buffers, in stream order
  (the attention's hooks gather its buffers from the table on the device),
  resolves future ids there, and runs the forward over them: eagerly, or on CUDA by
  replaying the bucket's graph (``capture``, at start, largest bucket first, one memory
  pool). Prefill and mixed steps never come here; they run eagerly on the flat batch.

Padding rows compute garbage that nobody reads: their token is 0 at position 0, they write
their K/V into the pool's scratch slot (``KVPool.scratch_slot``, never handed out) and see
only that slot, so no request's slot is written or read by them, and real rows never see
the scratch slot (their mask hides every column past their own context).

The eager path here is tested on the CPU to give the flat path's tokens; the CUDA capture
and replay (``capture``) are written for a GPU and UNTESTED until ``make gpu-check`` runs
with ``cuda_graph=True`` on one.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from minisrv.checks import check_int
from minisrv.runner.attention import AttentionBackend, write_kv

if TYPE_CHECKING:
    from minisrv.kv import KVPool
    from minisrv.model import CityLM

__all__ = ["DecodeGraphs", "PaddedDecode", "batch_buckets"]


def batch_buckets(max_running: int) -> tuple[int, ...]:
    """The padded batch sizes: 1, 2, 4, 8, then multiples of 8 up to ``max_running``
    (rounded up to a multiple of 8 past 8, so the largest batch has a bucket)."""
    max_running = check_int("max_running", max_running, minimum=1)
    small = [b for b in (1, 2, 4, 8) if b < max_running]
    top = max_running if max_running <= 8 else -(-max_running // 8) * 8
    return (*small, *range(16, top, 8), top) if top > 8 else (*small, top)


class PaddedDecode(NamedTuple):
    """One decode step padded to its bucket, on the device (``DecodeGraphs.prepare``)."""

    n: int  # the live rows (requests); rows n .. bucket - 1 are padding
    bucket: int
    ids: torch.Tensor  # [bucket] long; a future id is < 0
    rows: torch.Tensor  # [bucket] long: each request's row of ``table`` (padding: scratch row)
    lens: torch.Tensor  # [bucket] long: each request's context, its new token included
    table: torch.Tensor  # int32 [rows, >= context]: (row, position) -> pool slot
    has_futures: bool


class DecodeGraphs:
    """Static decode buffers for batches up to ``max_running`` and contexts up to
    ``context`` tokens (default: the model's ``max_seq_len``), over ``pool``, attending
    with ``attention``, a backend with static decode hooks (``graphs``: the runner picks
    one, ``ModelRunner.attach_kv``; nothing is built here).

    With ``cuda_graph`` (a CUDA model only) every bucket's forward is captured now and
    replayed by ``run``; without, ``run`` runs the same forward eagerly over the same
    buffers.
    """

    def __init__(self, model: CityLM, pool: KVPool, max_running: int, *,
                 attention: AttentionBackend, context: int | None = None,
                 cuda_graph: bool = False) -> None:
        limit = model.config.max_seq_len
        self.context = limit if context is None else check_int("context", context, minimum=1)
        if self.context > limit:
            raise ValueError(f"context {self.context} exceeds the model's max_seq_len={limit}")
        if cuda_graph and model.device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs a model on a CUDA device, this one is on "
                             f"{model.device}")
        if attention.graphs is None:
            raise ValueError(f"attention {attention.kind!r} has no static decode hooks "
                             f"(graphs); give the padded backend")
        self.model, self.pool = model, pool
        self.buckets = batch_buckets(max_running)
        self.scratch = pool.scratch_slot
        rows, device = self.buckets[-1], model.device
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.write_slots = torch.full((rows,), self.scratch, dtype=torch.long, device=device)
        self.attention, self.hooks = attention, attention.graphs  # its own static buffers
        self.buffers = self.hooks.buffers(rows, self.context, self.scratch, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each graph's logits [bucket, vocab]
        if cuda_graph:
            self.capture()

    @property
    def max_batch(self) -> int:
        """The largest bucket: the most requests a padded decode step holds."""
        return self.buckets[-1]

    def bucket(self, n: int) -> int:
        """The smallest bucket holding ``n`` requests."""
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"a padded decode holds 1..{self.max_batch} requests, got {n}")
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    def fits(self, new_lens: Sequence[int], contexts: Sequence[int]) -> bool:
        """Whether a step whose requests compute ``new_lens`` tokens each, over ``contexts``
        slots each, is a decode these buffers hold (one token per request)."""
        return (0 < len(new_lens) <= self.max_batch and all(n == 1 for n in new_lens)
                and max(contexts) <= self.context)

    def prepare(self, new_ids: Sequence[int], rows: Sequence[int], lens: Sequence[int],
                table: torch.Tensor) -> PaddedDecode:
        """Request r decodes token ``new_ids[r]`` at position ``lens[r] - 1`` of its row
        ``rows[r]`` of the request-to-token ``table``: the step padded to its bucket, on
        the device, in one copy of 3 x bucket integers (padding rows read the table's
        last row, its scratch row). The static buffers are left alone (``run`` fills
        them on the device's thread, gathering the key slots from the table there)."""
        n = len(new_ids)
        if len(rows) != n or len(lens) != n:
            raise ValueError(f"{n} requests' ids, {len(rows)} rows, {len(lens)} lengths")
        b = self.bucket(n)
        ints = np.zeros((3, b), dtype=np.int64)  # ids, rows, lengths
        ints[0, :n], ints[1, :n], ints[2, :n] = new_ids, rows, lens
        ints[1, n:], ints[2, n:] = table.shape[0] - 1, 1
        if ints[2].min() < 1 or ints[2].max() > min(self.context, table.shape[1]):
            raise ValueError(f"every request needs 1..{self.context} slots, got {list(lens)}")
        moved = torch.from_numpy(ints).to(self.model.device)
        return PaddedDecode(n, b, moved[0], moved[1], moved[2], table,
                            bool((ints[0, :n] < 0).any()))

    def run(self, step: PaddedDecode,
            resolve: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The step's logits [n, vocab]: its inputs copied into the static buffers (future
        ids resolved there), then the bucket's graph replayed, or its forward run."""
        b = step.bucket
        ids = self.ids[:b]
        ids.copy_(step.ids)
        if resolve is not None and step.has_futures:
            ids.copy_(resolve(ids))
        last = step.lens - 1
        self.positions[:b].copy_(last)
        self.write_slots[:b].copy_(step.table[step.rows, last])
        self.hooks.fill(self.buffers, b, step.table, step.rows, step.lens)
        graph = self.graphs.get(b)
        if graph is None:
            return self.forward(b)[: step.n]
        graph.replay()  # UNTESTED (CUDA only)
        return self.outputs[b][: step.n]

    @torch.inference_mode()
    def forward(self, b: int) -> torch.Tensor:
        """Logits [b, vocab] of the first ``b`` rows of the static buffers: every tensor the
        forward reads is a view of a buffer, so a graph captured here replays on new data."""
        pool, write, attention = self.pool, self.write_slots[:b], self.attention
        metadata = self.hooks.metadata(self.buffers, b)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kv = pool.kv[layer]
            write_kv(kv, write, k, v)
            return attention.forward(q, kv, metadata)

        x = self.model.run_layers(self.ids[:b], self.positions[:b], attend)
        return self.model.lm_head(self.model.norm(x))

    def capture(self) -> None:
        """Record one CUDA graph per bucket, the largest first, all in one memory pool
        (smaller graphs reuse the largest one's memory). UNTESTED: written for a GPU and
        not yet run on one (``make gpu-check`` / ``make gpu-bench`` with graphs on).

        Each bucket runs once eagerly first (the rotary table, cuBLAS' workspaces and the
        kernels' lazy initialisation must not happen during capture). The buffers' padding
        (ids 0, scratch slots) is what the warm-up and the capture compute on, so neither
        writes a request's slot.
        """
        if self.model.device.type != "cuda":  # pragma: no cover - guarded in __init__
            raise ValueError("CUDA graphs need a CUDA device")
        memory = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            self.forward(b)
            torch.cuda.synchronize(self.model.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory):
                self.outputs[b] = self.forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.model.device)
