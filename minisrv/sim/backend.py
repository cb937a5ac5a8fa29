"""The simulated GPU's backend: no model, each step takes the roofline time of its batch.

``SimBackend`` answers the scheduler as the model runner does (tokens per entry and the
step's cost), so every scheduling decision is made by the same ``Scheduler`` code at toy
and at GPU scale. Each step takes the time the roofline model gives for that batch
(LLaMA-3-8B on an H100 by default) and every request emits dummy tokens until its
``max_new_tokens``, so output lengths are fixed in advance by the workload.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from minisrv.configs import H100, LLAMA3_8B, GPUSpec, ModelConfig
from minisrv.core import Batch, BatchResult, Capability
from minisrv.kvsize import check_dtype_bytes, kv_bytes_per_token
from minisrv.request import Req
from minisrv.sim.roofline import model_rates, rates_step_cost
from minisrv.sim.sizing import kv_budget_bytes

if TYPE_CHECKING:  # the simulated GPU touches no tensor
    import torch

__all__ = ["SimBackend", "SimStep"]


class SimStep(NamedTuple):
    """A simulated step's totals and dummy tokens (``SimBackend.prepare``)."""

    tokens: list[list[int]]  # per entry
    new: int  # tokens computed
    attended: int  # (query, key) pairs attended
    cached: int  # KV tokens read from the cache
    loaded: int = 0  # KV tokens copied back from the host tier before the step


class SimBackend:
    """A simulated GPU: no model, each step takes the roofline time of its batch.

    ``cfg`` and ``gpu`` choose the model and accelerator (LLaMA-3-8B on an H100 by default);
    ``dtype_bytes`` is the width of weights and KV; ``token_ids`` the ids its dummy tokens
    take (default: the model's vocabulary). Requests always run to their
    ``max_new_tokens`` (there is no ``<eos>``), which is how a workload fixes output lengths.
    The tokens it emits are deterministic dummies, so runs are reproducible. The model, GPU
    and width are fixed at construction: their rates are worked out then, once, not at each
    of the tens of thousands of steps a simulation asks for.
    """

    time_unit = "s"
    cost_unit = "s"
    eos_ids: tuple[int, ...] = ()
    device = None  # no GPU: the overlapped loop gives its steps no CUDA stream
    capabilities = frozenset({Capability.SPLITS_STEP, Capability.COMPUTES_CHUNKS,
                              Capability.TIMES_HOST_COPIES})

    def __init__(
        self, cfg: ModelConfig = LLAMA3_8B, gpu: GPUSpec = H100, dtype_bytes: float = 2,
        token_ids: range | None = None,
    ) -> None:
        self.cfg = cfg
        self.gpu = gpu
        self.dtype_bytes = dtype_bytes
        self._rates = model_rates(cfg, check_dtype_bytes(dtype_bytes))  # ValueError if bad
        self.max_context: int | None = cfg.max_seq_len or None
        self.vocab_size: int | None = cfg.vocab_size or None
        # the ids the dummy tokens take: the model's vocabulary, or (for a server that
        # decodes them with another tokenizer) a range of that tokenizer's ids
        self._ids = token_ids if token_ids is not None else range(max(cfg.vocab_size, 2))
        if len(self._ids) == 0:
            raise ValueError("token_ids must hold at least one id")
        if token_ids is not None:
            self.vocab_size = token_ids.stop
        self._loaded = 0  # host-tier tokens the next step copies back first

    def charge_host_copies(self, loaded: int, backed_up: int) -> None:
        """The host tier's copies before the next step: the ``loaded`` tokens' KV crosses
        the host link (``gpu.host_bandwidth``) before the step may read it. Backups go the
        other way on a full-duplex link, behind the steps, and cost the step nothing."""
        self._loaded += loaded

    def host_copy_seconds(self, tokens: int) -> float:
        """How long ``tokens`` tokens' KV takes from host memory to the device."""
        return tokens * self._rates.kv_token / self.gpu.host_bandwidth

    def attach_kv(self, capacity: int) -> None:
        """No KV is stored: the scheduler's slot counts are the whole simulation of memory."""
        return None

    def attach_table(self, table: object) -> None:
        """No pool, so no table to read (the scheduler passes ``None``)."""

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
        """The CPU half of ``run``: the batch's totals and dummy tokens (see ``run``).

        An entry computes ``n`` tokens after ``start`` cached ones: it reads those, attends
        to them and causally among its own (a decode: ``n = 1``, ``start = seq_len - 1``).
        """
        ids, vocab = self._ids, len(self._ids)
        tokens: list[list[int]] = []
        new = attended = cached = 0
        for req, start, n, sample in batch.entries:
            new += n
            cached += start  # prefix KV read from the cache, not computed
            attended += n * start + n * (n + 1) // 2  # the prefix, then causal
            tokens.append([ids[(req.rid * 7919 + start + n) % vocab]] if sample else [])
        loaded, self._loaded = self._loaded, 0
        return SimStep(tokens, new, attended, cached, loaded)

    def compute(
        self,
        step: SimStep,
        resolve: Callable[[torch.Tensor], torch.Tensor] | None = None,
        store: Callable[[list[int]], None] | None = None,
    ) -> BatchResult:
        """The device half of ``run``: the roofline time, after the host tier's load-backs
        (``charge_host_copies``) at the host link's bandwidth.

        The simulator reads no input ids (``prepare`` fixed its tokens), so no future id of
        an overlapped loop ever needs resolving from its steps: ``resolve`` and ``store`` are
        accepted, as ``ModelBackend.compute`` takes them, and left unused. Storing would only
        spend the host's time on a write that nothing reads (on a GPU the store is the
        device's work).
        """
        cost = rates_step_cost(self._rates, self.gpu, step.new, step.attended, step.cached)
        time_s = cost.time_s + self.host_copy_seconds(step.loaded)
        return BatchResult(step.tokens, cost=time_s, elapsed=time_s)

    def release(self, req: Req) -> None:
        """Nothing to free: the simulator keeps no per-request state."""
