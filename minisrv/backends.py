"""What computes a step: the real CityLM, or a GPU simulated with the roofline model.

Both answer the scheduler the same way (one next token per request and the step's cost),
so every scheduling decision is made by the same ``Scheduler`` code at both scales.

* ``PerRequestBackend`` runs CityLM the plainest way: one forward per request of the batch,
  each request with its own ``DenseKVCache``. It is the scheduler chapter's first backend,
  trivially identical to running each request alone, and the baseline ``ModelBackend`` is
  measured against.
* ``ModelBackend`` runs CityLM: one forward per step over all new tokens of all requests
  (selective batching, ``CityLM.forward_flat``), their K/V in a shared ``KVPool`` whose
  slots the scheduler hands out. Outputs still equal running each request alone.
* ``SimBackend`` runs nothing. Each step takes the time the roofline model gives for that
  batch (LLaMA-3-8B on an H100 by default) and every request emits dummy tokens until its
  ``max_new_tokens``, so output lengths are fixed in advance by the workload.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from minisrv.configs import H100, LLAMA3_8B, GPUSpec, ModelConfig
from minisrv.kvpool import KVPool, SlotAllocator
from minisrv.kvsize import kv_budget_bytes, kv_bytes_per_token
from minisrv.request import Req
from minisrv.roofline import step_cost_from_totals
from minisrv.sampling import (
    SamplingParams,
    TokenLogprobs,
    make_generator,
    sample_next,
    sample_processed,
)
from minisrv.scheduler import Batch, BatchResult

if TYPE_CHECKING:
    from minisrv.model import CityLM, DenseKVCache

__all__ = ["ModelBackend", "ModelStep", "PerRequestBackend", "SimBackend", "SimStep"]


class ModelStep(NamedTuple):
    """A step's inputs copied out of its requests (``ModelBackend.prepare``)."""

    new_ids: list[list[int]]  # per request: the tokens to compute (a future id is < 0)
    slots: list[list[int]]  # per request: its KV slots, the new tokens' last
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    reqs: list[Req] = []  # noqa: RUF012 (never mutated) the requests, for their logprobs
    histories: list[tuple[list[int], list[int]]] | None = None  # (prompt, output) per request


class SimStep(NamedTuple):
    """A simulated step's totals and dummy tokens (``SimBackend.prepare``)."""

    tokens: list[int]
    new: int  # tokens computed
    attended: int  # (query, key) pairs attended
    cached: int  # KV tokens read from the cache


class PerRequestBackend:
    """Runs each step on a real CityLM, one forward per request of the batch.

    Keeps per request a growing ``DenseKVCache`` and, for sampled requests, the private
    random generator (``make_generator``), so a request's tokens depend only on its own
    prompt and seed: the outputs equal ``model.reference_generate`` whatever else shares the
    batch. It stores no KV pool, so the scheduler's slot accounting is pure bookkeeping.
    """

    time_unit = "step"
    cost_unit = "tokens"

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
        return BatchResult(next_tokens=tokens, cost=float(computed), elapsed=1.0)

    def release(self, req: Req) -> None:
        """Drop the request's KV cache and generator."""
        self._caches.pop(req, None)
        self._generators.pop(req, None)

    @property
    def live_requests(self) -> int:
        """Requests whose KV cache is held right now."""
        return len(self._caches)


class ModelBackend:
    """Runs each step on a real CityLM: one flat forward over every request of the batch.

    The KV of all requests lives in one ``KVPool`` built by ``attach_kv`` (the scheduler
    calls it with its ``kv_capacity``) and indexed by each request's ``kv_slots``.
    ``attention`` is ``"padded"`` (one masked attention call per layer), ``"flex"`` (one
    ragged flex_attention call per layer, no padding), ``"loop"`` (one call per request) or
    ``"auto"``, resolved once here to flex on a GPU and padded on the CPU. For sampled
    requests the backend keeps the private random generator (``make_generator``), across
    retractions too, so a request's tokens depend only on its own prompt and seed: the
    outputs equal ``model.reference_generate`` whatever else shares the batch.
    """

    time_unit = "step"
    cost_unit = "tokens"

    def __init__(self, model: CityLM, attention: str = "auto") -> None:
        from minisrv.model import resolve_attention

        self.model = model
        self.attention = resolve_attention(attention, model.device, model.dtype,
                                           model.config.head_dim)
        self.eos_ids: tuple[int, ...] = tuple(model.eos_ids)
        self.max_context: int | None = model.config.max_seq_len
        self.vocab_size: int | None = model.config.vocab_size
        self.pool: KVPool | None = None
        self._generators: dict[Req, torch.Generator | None] = {}
        self.logprobs: dict[Req, deque[TokenLogprobs]] = {}  # per request, oldest first

    def attach_kv(self, capacity: int) -> SlotAllocator:
        """Allocate the KV pool (``capacity`` token slots) on the model's device."""
        self.pool = KVPool.for_model(self.model, capacity)
        return self.pool.allocator

    def run(self, batch: Batch) -> BatchResult:
        """Prefill the new requests and decode the running ones in ONE forward pass.

        A prefill computes its ``fill_ids`` (its uncached prompt, plus output kept from before a
        retraction); a decode computes its last output token. Cost = tokens computed.
        """
        return self.compute(self.prepare(batch))

    def prepare(self, batch: Batch) -> ModelStep:
        """The CPU half of ``run``: copy out everything the forward reads from the requests.

        The overlapped loop calls this on its main thread and ``compute`` on the device's
        thread, so the requests may change (the next step is being formed) while the step
        runs. A decode input may be a future id (< 0) naming a token not yet sampled.
        """
        if self.pool is None:
            raise ValueError("ModelBackend has no KV pool: the scheduler calls attach_kv first")
        new_ids = [req.fill_ids for req in batch.prefill] + [[r.output[-1]] for r in batch.decode]
        for req in batch.prefill:
            if req not in self._generators:  # a retracted request keeps its generator
                self._generators[req] = make_generator(req.params)
        reqs = batch.reqs
        params = [req.params for req in reqs]
        histories = ([(req.prompt, list(req.output)) for req in reqs]
                     if any(p.processed for p in params) else None)
        return ModelStep(new_ids, [list(req.kv_slots) for req in reqs], params,
                         [self._generators[req] for req in reqs], reqs, histories)

    def compute(
        self,
        step: ModelStep,
        resolve: Callable[[torch.Tensor], torch.Tensor] | None = None,
        store: Callable[[list[int]], None] | None = None,
    ) -> BatchResult:
        """The device half of ``run``: one flat forward, then sampling.

        ``resolve`` replaces future ids (< 0) by their tokens (``FutureMap.resolve``): one
        ``torch.where`` over the step's input ids. ``store`` receives the sampled tokens
        before this returns (``FutureMap.store``): on a GPU part of the same step's work.
        """
        from minisrv.model import FlatBatch

        new_ids = step.new_ids
        if resolve is not None and any(t < 0 for ids in new_ids for t in ids):
            flat_ids = resolve(torch.tensor([t for ids in new_ids for t in ids])).tolist()
            it = iter(flat_ids)
            new_ids = [[next(it) for _ in ids] for ids in new_ids]
        flat = FlatBatch(new_ids, step.slots, self.model.device)
        logits = self.model.forward_flat(flat, self.pool, attention=self.attention, last_only=True)
        tokens, logprobs = sample_processed(logits, step.params, step.generators, step.histories,
                                            self.eos_ids)
        for req, entry in zip(step.reqs, logprobs):
            if entry is not None:
                self.logprobs.setdefault(req, deque()).append(entry)
        if store is not None:
            store(tokens)
        return BatchResult(next_tokens=tokens, cost=float(flat.num_tokens), elapsed=1.0)

    def release(self, req: Req) -> None:
        """Forget the request's generator (its KV slots are the scheduler's to free)."""
        self._generators.pop(req, None)
        self.logprobs.pop(req, None)

    @property
    def live_requests(self) -> int:
        """Requests admitted and not yet finished (running or retracted)."""
        return len(self._generators)


class SimBackend:
    """A simulated GPU: no model, each step takes the roofline time of its batch.

    ``cfg`` and ``gpu`` choose the model and accelerator (LLaMA-3-8B on an H100 by default);
    ``dtype_bytes`` is the width of weights and KV. Requests always run to their
    ``max_new_tokens`` (there is no ``<eos>``), which is how a workload fixes output lengths.
    The tokens it emits are deterministic dummies, so runs are reproducible.
    """

    time_unit = "s"
    cost_unit = "s"
    eos_ids: tuple[int, ...] = ()

    def __init__(
        self, cfg: ModelConfig = LLAMA3_8B, gpu: GPUSpec = H100, dtype_bytes: float = 2
    ) -> None:
        self.cfg = cfg
        self.gpu = gpu
        self.dtype_bytes = dtype_bytes
        self.max_context: int | None = cfg.max_seq_len or None
        self.vocab_size: int | None = cfg.vocab_size or None
        self._vocab = max(cfg.vocab_size, 2)

    def attach_kv(self, capacity: int) -> None:
        """No KV is stored: the scheduler's slot counts are the whole simulation of memory."""
        return None

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
        return self.compute(self.prepare(batch))

    def prepare(self, batch: Batch) -> SimStep:
        """The CPU half of ``run``: the batch's totals and dummy tokens (see ``run``)."""
        vocab = self._vocab
        tokens = []
        new = attended = cached = 0
        for req in batch.prefill:
            n = len(req.prompt) + len(req.output)
            hit = req.cached_len  # prefix KV read from the cache, not computed
            fill = n - hit
            new += fill
            cached += hit
            attended += fill * hit + fill * (fill + 1) // 2  # the prefix, then causal
            tokens.append((req.rid * 7919 + n) % vocab)
        for req in batch.decode:
            n = len(req.prompt) + len(req.output)
            cached += n - 1
            attended += n
            tokens.append((req.rid * 7919 + n) % vocab)
        new += len(batch.decode)
        return SimStep(tokens, new, attended, cached)

    def compute(
        self,
        step: SimStep,
        resolve: Callable[[torch.Tensor], torch.Tensor] | None = None,
        store: Callable[[list[int]], None] | None = None,
    ) -> BatchResult:
        """The device half of ``run``: the roofline time.

        The simulator reads no input ids (``prepare`` fixed its tokens), so no future id of
        an overlapped loop ever needs resolving from its steps: ``resolve`` and ``store`` are
        accepted, as ``ModelBackend.compute`` takes them, and left unused. Storing would only
        spend the host's time on a write that nothing reads (on a GPU the store is the
        device's work).
        """
        cost = step_cost_from_totals(
            self.cfg, self.gpu, step.new, step.attended, step.cached, self.dtype_bytes
        )
        return BatchResult(next_tokens=list(step.tokens), cost=cost.time_s, elapsed=cost.time_s)

    def release(self, req: Req) -> None:
        """Nothing to free: the simulator keeps no per-request state."""
