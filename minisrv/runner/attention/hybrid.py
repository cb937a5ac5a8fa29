"""The hybrid backend: a step's decodes through the padded call, its prefills through flex's
ragged call; a mixed step is split between the two.

The two calls lose in opposite places. Flex's compiled kernel tiles the queries of all
requests end to end, 128 rows a tile, so single-token decodes share a query tile and the
tile walks every one of their key tiles one after another (the GPU appendix reads this from
the recorded H200 step sweep, where the ragged call took 1.5x the padded one's time,
geometric mean over batches 1-256); the padded call pads every request to the step's longest
new-token run and longest context, which a prefill beside short decodes turns into mostly
padding. So decodes go to the padded call and prefills to the ragged one, and a step that
holds both (``mode="mixed"``, chunked prefill) makes one call of each, each over its own
requests, outputs concatenated in the step's row order.

SGLang splits on request too (``--prefill-attention-backend``, ``--decode-attention-backend``,
its ``HybridAttnBackend``) but by the step's forward mode alone: a mixed step goes whole to
the prefill backend, whose kernels cut query tiles within each request (the Triton extend
kernel's grid is requests x heads x query blocks), so a decode's one query never shares a
tile with another request's. Flex's ragged layout has no such cut, hence the split here.
A step's requests and their kinds are known on the host before layer 0, so the split is
made once, in ``prepare``, and costs no operator but the concatenation.

Static decode buffers (CUDA graphs) need no hooks of their own here: the runner's static
decode steps run the padded backend's, which is what this backend runs for decodes anyway.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from minisrv.model.attention_metadata import group_bounds
from minisrv.runner.attention.flex import FlexAttention, FlexStep
from minisrv.runner.attention.padded import PaddedAttention, PaddedStep
from minisrv.runner.table_batch import TableBatch

__all__ = ["HybridAttention", "HybridPart", "HybridStep"]


class HybridPart(NamedTuple):
    """One call of a step: its backend, that backend's metadata, and the step's query rows
    it takes."""

    backend: PaddedAttention | FlexAttention
    metadata: PaddedStep | FlexStep
    rows: slice


class HybridStep(NamedTuple):
    """A step's calls, in row order: one, or a mixed step's prefills then its decodes."""

    parts: tuple[HybridPart, ...]

    @property
    def calls(self) -> tuple[str, ...]:
        """Each call's backend kind, in row order (``("flex", "padded")`` for a mixed step)."""
        return tuple(part.backend.kind for part in self.parts)


class HybridAttention:
    """Decodes through ``PaddedAttention``, prefills through ``FlexAttention``, a mixed step
    split between them (a one-token request whose prompt was cached but for its last token
    counts as a decode: it is one query over its context, as a decode is)."""

    kind = "hybrid"
    graphs = None  # the runner's static decode steps run the padded backend's hooks
    # declared, so the choice table's test reads each half against the record that timed it
    decode_backend, prefill_backend = PaddedAttention, FlexAttention

    def __init__(self, device: str | torch.device, dtype: torch.dtype, head_dim: int,
                 n_kv_heads: int) -> None:
        self.decode = self.decode_backend(device, dtype, head_dim, n_kv_heads)
        self.prefill = self.prefill_backend(device, dtype, head_dim, n_kv_heads)  # needs flex

    def prepare(self, batch: TableBatch) -> HybridStep:
        """The step's runs of one kind (``group_bounds``: a mixed step lists its prefills
        first, so two runs; kinds that alternate more than once make one run, which the
        ragged call takes whole), each given to its call."""
        bounds = group_bounds(batch.new_lens)
        if len(bounds) == 2:
            return HybridStep((self._part(batch, slice(0, batch.num_tokens)),))
        return HybridStep(tuple(self._part(batch.part(lo, hi), batch.token_rows(lo, hi))
                                for lo, hi in itertools.pairwise(bounds)))

    def _part(self, batch: TableBatch, rows: slice) -> HybridPart:
        backend = self.decode if batch.num_tokens == len(batch) else self.prefill
        return HybridPart(backend, backend.prepare(batch), rows)

    def forward(self, q: torch.Tensor, kv: torch.Tensor, metadata: HybridStep) -> torch.Tensor:
        outs = [part.backend.forward(q[part.rows], kv, part.metadata) for part in metadata.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs)
