"""What computes a step: the real CityLM, or a GPU simulated with the roofline model.

Both answer the scheduler the same way (one next token per request and the step's cost),
so every scheduling decision is made by the same ``Scheduler`` code at both scales.

* ``ModelBackend`` runs CityLM. For now it loops over the batch, one forward per request,
  each request with its own ``DenseKVCache``: simple, and trivially identical to running
  the request alone. The selective-batching chapter replaces the loop with one forward
  over all new tokens of the step.
* ``SimBackend`` runs nothing. Each step takes the time the roofline model gives for that
  batch (LLaMA-3-8B on an H100 by default) and every request emits dummy tokens until its
  ``max_new_tokens``, so output lengths are fixed in advance by the workload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minisrv.configs import H100, LLAMA3_8B, GPUSpec, ModelConfig
from minisrv.kvsize import kv_budget_bytes, kv_bytes_per_token
from minisrv.request import Req
from minisrv.roofline import step_cost_from_totals
from minisrv.sampling import make_generator, sample_next
from minisrv.scheduler import Batch, BatchResult

if TYPE_CHECKING:
    from minisrv.model import CityLM, DenseKVCache

__all__ = ["ModelBackend", "SimBackend"]


class ModelBackend:
    """Runs each step on a real CityLM, one forward per request of the batch.

    Keeps per request a KV cache and, for sampled requests, the private random generator
    (``make_generator``), so a request's tokens depend only on its own prompt and seed: the
    outputs equal ``model.reference_generate`` whatever else shares the batch.
    """

    time_unit = "step"
    cost_unit = "tokens"

    def __init__(self, model: CityLM) -> None:
        self.model = model
        self.eos_id: int | None = model.eos_id
        self.max_context: int | None = model.config.max_seq_len
        self.vocab_size: int | None = model.config.vocab_size
        self._caches: dict[Req, DenseKVCache] = {}
        self._generators: dict[Req, torch.Generator | None] = {}

    def run(self, batch: Batch) -> BatchResult:
        """Prefill the new requests, decode the running ones; cost = tokens computed."""
        tokens: list[int] = []
        computed = 0
        device = self.model.device
        with torch.inference_mode():
            for req in batch.prefill:
                cache = self._caches[req] = self.model.new_cache()
                generator = self._generators[req] = make_generator(req.params)
                ids = req.fill_ids
                logits = self.model(torch.tensor(ids, dtype=torch.long, device=device), cache)
                tokens.append(sample_next(logits[-1], req.params, generator))
                computed += len(ids)
            for req in batch.decode:
                last = torch.tensor([req.output[-1]], dtype=torch.long, device=device)
                logits = self.model(last, self._caches[req])
                tokens.append(sample_next(logits[-1], req.params, self._generators[req]))
                computed += 1
        return BatchResult(next_tokens=tokens, cost=float(computed), elapsed=1.0)

    def release(self, req: Req) -> None:
        """Drop the request's KV cache and generator."""
        self._caches.pop(req, None)
        self._generators.pop(req, None)

    @property
    def live_requests(self) -> int:
        """Requests whose KV cache is held right now."""
        return len(self._caches)


class SimBackend:
    """A simulated GPU: no model, each step takes the roofline time of its batch.

    ``cfg`` and ``gpu`` choose the model and accelerator (LLaMA-3-8B on an H100 by default);
    ``dtype_bytes`` is the width of weights and KV. Requests always run to their
    ``max_new_tokens`` (there is no ``<eos>``), which is how a workload fixes output lengths.
    The tokens it emits are deterministic dummies, so runs are reproducible.
    """

    time_unit = "s"
    cost_unit = "s"
    eos_id: int | None = None

    def __init__(
        self, cfg: ModelConfig = LLAMA3_8B, gpu: GPUSpec = H100, dtype_bytes: float = 2
    ) -> None:
        self.cfg = cfg
        self.gpu = gpu
        self.dtype_bytes = dtype_bytes
        self.max_context: int | None = cfg.max_seq_len or None
        self.vocab_size: int | None = cfg.vocab_size or None
        self._vocab = max(cfg.vocab_size, 2)

    def kv_capacity(self) -> int:
        """KV tokens that fit in the GPU memory left after the weights (an upper bound)."""
        budget = kv_budget_bytes(self.cfg, self.gpu, self.dtype_bytes)
        return int(budget // kv_bytes_per_token(self.cfg, self.dtype_bytes))

    def run(self, batch: Batch) -> BatchResult:
        """Roofline time of the step; prefill reads nothing cached, decode reads its context.

        The totals are the ones ``roofline.batch_step_cost`` derives from the same batch
        (``prefill=[(seq_len, 0), ...]``, ``decode_contexts=[seq_len - 1, ...]``: a decoding
        request's cache holds all its tokens but the last output, this step's input), summed
        here in one pass because a GPU-scale simulation asks for tens of thousands of steps.
        """
        vocab = self._vocab
        tokens = []
        new = attended = cached = 0
        for req in batch.prefill:
            n = len(req.prompt) + len(req.output)
            new += n
            attended += n * (n + 1) // 2  # causal attention within the prompt
            tokens.append((req.rid * 7919 + n) % vocab)
        for req in batch.decode:
            n = len(req.prompt) + len(req.output)
            cached += n - 1
            attended += n
            tokens.append((req.rid * 7919 + n) % vocab)
        new += len(batch.decode)
        cost = step_cost_from_totals(self.cfg, self.gpu, new, attended, cached, self.dtype_bytes)
        return BatchResult(next_tokens=tokens, cost=cost.time_s, elapsed=cost.time_s)

    def release(self, req: Req) -> None:
        """Nothing to free: the simulator keeps no per-request state."""
