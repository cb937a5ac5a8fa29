"""The time of one forward step on a GPU, from a roofline model.

A step must do its arithmetic and move its bytes; on a GPU the two overlap, so the step
takes as long as the slower of the two (Williams et al., 2009):

    time = max(FLOPs / peak FLOP/s, bytes moved / memory bandwidth)

What one step of a serving engine computes and moves, for a batch that mixes prefilling
requests (many new tokens each) and decoding ones (one new token each):

* FLOPs = 2 x activated parameters x new tokens (one multiply-add per weight per token),
  less the input embedding, a table lookup with no arithmetic (the output head stays)
  + attention: for every new token, a score and a weighted value sum against every token it
  attends to (its cached context, the new tokens before it, and itself).
* bytes = all weights once (each is read once per step, however many tokens share it)
  + the KV cache of every request's cached context (read by attention)
  + the KV of every new token (written). Activations are ignored: they stay small and mostly
  on chip.

Peak FLOP/s and bandwidth are never reached in practice, so the times are lower bounds; the
model is for reasoning about *shape* (where the time goes, what batching buys) and for the
simulated backend, which needs a step time that reacts to batch composition.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import NamedTuple

from minisrv.configs import GPUSpec, ModelConfig
from minisrv.kvsize import check_dtype_bytes, kv_bytes_per_token
from minisrv.sim.sizing import check_positive_int, weight_bytes


class StepCost(NamedTuple):
    """What one forward step costs, and which resource sets its time."""

    time_s: float  # wall time of the step: max(compute_s, memory_s)
    compute_s: float  # time the arithmetic would take at peak FLOP/s
    memory_s: float  # time the memory traffic would take at full bandwidth
    flops: float  # floating-point operations (a multiply-add counts as 2)
    bytes: float  # bytes read or written in device memory

    @property
    def bound(self) -> str:
        """``"compute"`` if arithmetic sets the step time, else ``"memory"``."""
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte moved: the x-axis of a roofline plot."""
        return self.flops / self.bytes


def attention_flops_per_pair(cfg: ModelConfig) -> int:
    """FLOPs for one query token to attend to one key token, summed over heads and layers.

    Per head, a dot product for the score and a weighted add of the value: 2 x (q·k width)
    + 2 x (value width). MHA/GQA/MQA: both widths are ``head_dim``, so 4 x heads x head_dim
    per layer. MLA is counted as DeepSeek decodes it, with the up-projections absorbed, so each
    head scores against the 576-wide cached latent and sums 512-wide latent values.
    """
    if cfg.attention == "mla":
        qk, v = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    else:
        qk = v = cfg.head_dim
    return cfg.n_layers * cfg.n_heads * 2 * (qk + v)


class ModelRates(NamedTuple):
    """What a step's cost multiplies its totals by (``model_rates``)."""

    per_token: float  # FLOPs per new token: 2 x the active parameters it multiplies by
    per_pair: float  # FLOPs per attended (query, key) pair
    weights: float  # bytes of the weights, read once per step
    kv_token: float  # KV bytes per token, read from the cache or written


@functools.lru_cache(maxsize=64)
def model_rates(cfg: ModelConfig, dtype_bytes: float) -> ModelRates:
    """The rates of ``cfg`` at ``dtype_bytes`` (the embedding lookup does no arithmetic, so
    ``per_token`` leaves it out). They depend only on the model and the width, so they are
    worked out once, not on each of the tens of thousands of steps a simulation asks for."""
    dtype_bytes = check_dtype_bytes(dtype_bytes)
    return ModelRates(2.0 * cfg.matmul_param_count, float(attention_flops_per_pair(cfg)),
                      weight_bytes(cfg, dtype_bytes), float(kv_bytes_per_token(cfg, dtype_bytes)))


def step_cost_from_totals(
    cfg: ModelConfig,
    gpu: GPUSpec,
    new_tokens: int,
    attended_pairs: int,
    cached_tokens: int,
    dtype_bytes: float,
) -> StepCost:
    """The roofline cost from the three totals every batch reduces to.

    ``new_tokens``: tokens this step computes (and whose KV it writes). ``attended_pairs``:
    (query, key) pairs attention computes; every new token attends at least to itself.
    ``cached_tokens``: tokens whose KV is read from the cache (each request's context before
    this step). ``batch_step_cost`` and ``decode_step_cost`` derive these from requests.
    """
    check_positive_int("new_tokens", new_tokens)
    if attended_pairs < new_tokens:
        raise ValueError(
            f"attended_pairs ({attended_pairs}) must be >= new_tokens ({new_tokens}): "
            "every new token attends at least to itself"
        )
    if cached_tokens < 0:
        raise ValueError(f"cached_tokens must be >= 0, got {cached_tokens}")
    return rates_step_cost(model_rates(cfg, check_dtype_bytes(dtype_bytes)), gpu, new_tokens,
                           attended_pairs, cached_tokens)


def rates_step_cost(rates: ModelRates, gpu: GPUSpec, new_tokens: int, attended_pairs: int,
                    cached_tokens: int) -> StepCost:
    """The roofline: a step's FLOPs and bytes from its three totals and the model's rates,
    and the slower of the two times. The totals are trusted here (``step_cost_from_totals``
    checks them), so the simulated GPU can call this on every step."""
    flops = rates.per_token * new_tokens + rates.per_pair * attended_pairs
    traffic = rates.weights + rates.kv_token * (cached_tokens + new_tokens)
    compute_s = flops / gpu.flops
    memory_s = traffic / gpu.bandwidth
    return StepCost(max(compute_s, memory_s), compute_s, memory_s, flops, traffic)


def batch_step_cost(
    cfg: ModelConfig,
    gpu: GPUSpec,
    prefill: Iterable[tuple[int, int]] = (),
    decode_contexts: Iterable[int] = (),
    dtype_bytes: float = 2,
) -> StepCost:
    """Cost of one step over a mixed batch.

    ``prefill``: one ``(new_tokens, cached_tokens)`` pair per prefilling request (new >= 1;
    cached >= 0 is the prefix already in the cache, e.g. a radix-tree hit).
    ``decode_contexts``: one entry per decoding request, the tokens already in its KV cache
    (>= 1); each such request adds one new token.
    Weights count once per step; FLOPs scale with new tokens; KV traffic with context.
    """
    check_dtype_bytes(dtype_bytes)
    new_tokens = attended = cached = 0
    for i, pair in enumerate(prefill):
        try:
            n_new, n_cached = pair
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"prefill[{i}] must be (new_tokens, cached_tokens), got {pair!r}"
            ) from err
        n_new = check_positive_int(f"prefill[{i}] new_tokens", n_new)
        if n_cached != 0:  # a prefill may start from an empty cache
            n_cached = check_positive_int(f"prefill[{i}] cached_tokens", n_cached)
        new_tokens += n_new
        cached += n_cached
        attended += n_new * n_cached + n_new * (n_new + 1) // 2  # causal within the chunk
    for i, context in enumerate(decode_contexts):
        context = check_positive_int(f"decode_contexts[{i}]", context)
        new_tokens += 1
        cached += context
        attended += context + 1
    if new_tokens == 0:
        raise ValueError("a step needs at least one prefilling or decoding request")
    return step_cost_from_totals(cfg, gpu, new_tokens, attended, cached, dtype_bytes)


def batch_step_time(
    cfg: ModelConfig,
    gpu: GPUSpec,
    prefill: Iterable[tuple[int, int]] = (),
    decode_contexts: Iterable[int] = (),
    dtype_bytes: float = 2,
) -> float:
    """Seconds one mixed step takes: ``batch_step_cost(...).time_s``."""
    return batch_step_cost(cfg, gpu, prefill, decode_contexts, dtype_bytes).time_s


def decode_step_cost(
    cfg: ModelConfig, gpu: GPUSpec, batch_size: int, context_len: int, dtype_bytes: float = 2
) -> StepCost:
    """Cost of one decode step for ``batch_size`` requests that each have ``context_len``
    tokens cached. Same numbers as ``batch_step_cost`` with ``[context_len] * batch_size``,
    computed in O(1) so that plots can sweep thousands of batch sizes.
    """
    batch = check_positive_int("batch_size", batch_size)
    context = check_positive_int("context_len", context_len)
    check_dtype_bytes(dtype_bytes)
    pairs, cached = batch * (context + 1), batch * context  # each sees its context and itself
    return step_cost_from_totals(cfg, gpu, batch, pairs, cached, dtype_bytes)


def decode_step_time(
    cfg: ModelConfig, gpu: GPUSpec, batch_size: int, context_len: int, dtype_bytes: float = 2
) -> float:
    """Seconds for one decode step. LLaMA-3-8B on an H100 at context 1024: 4.83 ms for one
    request, 5.44 ms for 16, 7.36 ms for 64. Memory fit is not checked here: compare the batch
    with ``sim.sizing.max_concurrent_requests``.
    """
    return decode_step_cost(cfg, gpu, batch_size, context_len, dtype_bytes).time_s


def decode_throughput(
    cfg: ModelConfig, gpu: GPUSpec, batch_size: int, context_len: int, dtype_bytes: float = 2
) -> float:
    """Tokens per second generated by steady decoding: one token per request per step."""
    return batch_size / decode_step_time(cfg, gpu, batch_size, context_len, dtype_bytes)


def compute_bound_batch(
    cfg: ModelConfig, gpu: GPUSpec, context_len: int, dtype_bytes: float = 2
) -> int | None:
    """Smallest decode batch at which arithmetic, not memory traffic, sets the step time.

    Both terms grow linearly with the batch: compute by ``a`` per request, traffic by ``b``
    per request (its KV) on top of a fixed weight read ``w``. Compute catches up at
    ``w / (a - b)`` if ``a > b``; if each request's KV costs more time to read than its
    arithmetic takes, decoding stays memory-bound at any batch size and this returns None.
    """
    context = check_positive_int("context_len", context_len)
    one = decode_step_cost(cfg, gpu, 1, context, dtype_bytes)
    two = decode_step_cost(cfg, gpu, 2, context, dtype_bytes)
    per_request_compute = two.compute_s - one.compute_s
    per_request_memory = two.memory_s - one.memory_s
    fixed_memory = one.memory_s - per_request_memory
    if per_request_compute <= per_request_memory:
        return None
    def bound(batch: int) -> str:
        return decode_step_cost(cfg, gpu, batch, context, dtype_bytes).bound

    batch = max(1, int(fixed_memory / (per_request_compute - per_request_memory)))
    while batch > 1 and bound(batch - 1) == "compute":  # float rounding: settle exactly
        batch -= 1
    while bound(batch) != "compute":
        batch += 1
    return batch
