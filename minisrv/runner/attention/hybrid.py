"""The hybrid backend: a step of decodes only through the padded call, a step with prefills
through flex's ragged call.

The two calls lose in opposite places. Flex's compiled kernel tiles queries 128 rows at a
time, so a step of single-token decodes fills each tile with one query and walks its key
tiles one after another (the GPU appendix reads this from the recorded H200 step sweep,
where the ragged call took 1.5x the padded one's time, geometric mean over batches 1-256);
the padded call pads every request to the step's longest new-token run and longest context,
which a prefill beside short decodes turns into mostly padding. SGLang splits the same way
on request (``--prefill-attention-backend`` and ``--decode-attention-backend``, its
``HybridAttnBackend``), by the step's forward mode. A step's kind is known on the host
before layer 0, so the choice is made once, in ``prepare``, and costs no operator.

Static decode buffers (CUDA graphs) need no hooks of their own here: the runner's static
decode steps run the padded backend's, which is what this backend runs for decodes anyway.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from minisrv.runner.attention.flex import FlexAttention
from minisrv.runner.attention.padded import PaddedAttention
from minisrv.runner.table_batch import TableBatch

__all__ = ["HybridAttention", "HybridStep"]


class HybridStep(NamedTuple):
    """The step's backend, chosen by its kind, and that backend's metadata."""

    backend: PaddedAttention | FlexAttention
    metadata: Any


class HybridAttention:
    """Decode-only steps through ``PaddedAttention``, steps with prefills through
    ``FlexAttention`` (a one-token request whose prompt was cached but for its last token
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
        backend = self.decode if batch.num_tokens == len(batch) else self.prefill
        return HybridStep(backend, backend.prepare(batch))

    def forward(self, q: torch.Tensor, kv: torch.Tensor, metadata: HybridStep) -> torch.Tensor:
        return metadata.backend.forward(q, kv, metadata.metadata)
