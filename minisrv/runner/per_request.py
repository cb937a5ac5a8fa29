"""The plainest runner: one forward per request of the batch, each with its own KV cache.

It is the scheduler chapter's first backend, trivially identical to running each request
alone, and the baseline the flat forward of ``ModelRunner`` is measured against. It stores
no KV pool, so the scheduler's slot accounting is pure bookkeeping for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minisrv.core import Batch, BatchResult, Capability
from minisrv.request import Req
from minisrv.sampling import make_generator, sample_next

if TYPE_CHECKING:
    from minisrv.model import CityLM, DenseKVCache

__all__ = ["PerRequestBackend"]


class PerRequestBackend:
    """Runs each step on a real CityLM, one forward per request of the batch.

    Keeps per request a growing ``DenseKVCache`` and, for sampled requests, the private
    random generator (``make_generator``), so a request's tokens depend only on its own
    prompt and seed: the outputs equal ``model.reference_generate`` whatever else shares the
    batch. It stores no KV pool, so the scheduler's slot accounting is pure bookkeeping.
    """

    time_unit = "step"
    cost_unit = "tokens"
    capabilities: frozenset[Capability] = frozenset()  # a prefill: one forward, whole prompt

    def __init__(self, model: CityLM) -> None:
        self.model = model
        self.eos_ids: tuple[int, ...] = tuple(model.eos_ids)
        self.max_context: int | None = model.config.max_seq_len
        self.vocab_size: int | None = model.config.vocab_size
        self._caches: dict[Req, DenseKVCache] = {}
        self._generators: dict[Req, torch.Generator | None] = {}

    def attach_kv(self, capacity: int) -> None:
        """No shared pool: each request grows its own cache, so slots are bookkeeping only."""
        return None

    def attach_table(self, table: object) -> None:
        """No shared pool, so no table: each request's own cache is in position order."""

    def run(self, batch: Batch) -> BatchResult:
        """Prefill the new requests, decode the running ones; cost = tokens computed."""
        tokens: list[int] = []
        computed = 0
        device = self.model.device
        with torch.inference_mode():
            for req in batch.prefill:
                cache = self._caches[req] = self.model.new_cache()  # fresh after a retraction
                if req not in self._generators:  # a retracted request keeps its generator
                    self._generators[req] = make_generator(req.params)
                ids = req.fill_ids
                logits = self.model(torch.tensor(ids, dtype=torch.long, device=device), cache)
                tokens.append(sample_next(logits[-1], req.params, self._generators[req]))
                computed += len(ids)
            for req in batch.decode:
                last = torch.tensor([req.output[-1]], dtype=torch.long, device=device)
                logits = self.model(last, self._caches[req])
                tokens.append(sample_next(logits[-1], req.params, self._generators[req]))
                computed += 1
        return BatchResult([[t] for t in tokens], cost=float(computed), elapsed=1.0)

    def release(self, req: Req) -> None:
        """Drop the request's KV cache and generator."""
        self._caches.pop(req, None)
        self._generators.pop(req, None)

    @property
    def live_requests(self) -> int:
        """Requests whose KV cache is held right now."""
        return len(self._caches)
