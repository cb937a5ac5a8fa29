"""What speculation buys on a GPU: expected tokens per check, and the roofline speed-up.

If each guess is accepted with probability ``a`` once the guesses before it were (a
conditional, per-position rate), a check of k guesses keeps
1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a) tokens on average (Leviathan et al.
2023): the accepted run plus the target's own token. Measured checks give that ``a`` as
kept guesses over the guesses a check reached (``conditional_acceptance``), not over the
guesses drafted: a guess after a rejection is never examined. With a rate per position
a_1, a_2, ... the mean is 1 + a_1 + a_1 a_2 + ... (``expected_tokens_by_position``).

A check feeds k + 1 tokens per request. When decoding is memory-bound (small batches), a
step's time is mostly the weight read, so k + 1 tokens cost little more than one and the
expected tokens are almost pure gain. As the batch grows, the step turns compute-bound
(``minisrv.sim.roofline``): then k + 1 tokens cost k + 1 times as much, the rejected guesses
are wasted arithmetic, and speculation loses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from minisrv.checks import check_int, check_number
from minisrv.configs import GPUSpec, ModelConfig
from minisrv.sim.roofline import StepCost, decode_step_time, step_cost_from_totals
from minisrv.sim.sizing import (
    gb,
    kv_budget_bytes,
    kv_bytes_per_request,
    max_concurrent_requests,
    weight_bytes,
)


def expected_tokens_per_check(acceptance: float, k: int) -> float:
    """(1 - a^(k+1)) / (1 - a): mean tokens one check of ``k`` guesses keeps (k + 1 at a = 1)."""
    a = check_number("acceptance", acceptance, 0.0, 1.0)
    k = check_int("k", k, minimum=0)
    if a == 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def acceptance_by_position(drafted: Sequence[int], accepted: Sequence[int],
                           k: int) -> list[float]:
    """a_i for i = 1..k from checks (``drafted[c]`` guesses, ``accepted[c]`` kept): of the
    checks that drafted guess i and kept guesses 1..i-1, the share that kept guess i too
    (``nan`` where no check reached position i)."""
    k = check_int("k", k, minimum=1)
    rates = []
    for i in range(1, k + 1):
        reached = [a for d, a in zip(drafted, accepted, strict=True) if d >= i and a >= i - 1]
        rates.append(sum(a >= i for a in reached) / len(reached) if reached else math.nan)
    return rates


def positions_reached(drafted: Sequence[int], accepted: Sequence[int], k: int) -> list[int]:
    """For i = 1..k, how many checks examined guess i (drafted it and kept 1..i-1): the
    sample behind ``acceptance_by_position``'s rate i, so that a rate from a handful of checks
    can be told from one from hundreds."""
    k = check_int("k", k, minimum=1)
    return [sum(d >= i and a >= i - 1 for d, a in zip(drafted, accepted, strict=True))
            for i in range(1, k + 1)]


def conditional_acceptance(drafted: Sequence[int], accepted: Sequence[int]) -> float:
    """Kept guesses over the guesses the checks reached (every kept one, plus the first
    rejected one of each check that rejected one): the estimate of the formula's ``a`` when
    every position shares one rate (``nan`` when nothing was reached)."""
    kept = sum(accepted)
    rejected = sum(a < d for d, a in zip(drafted, accepted, strict=True))
    return kept / (kept + rejected) if kept + rejected else math.nan


def expected_tokens_by_position(rates: Sequence[float]) -> float:
    """1 + a_1 + a_1 a_2 + ... : mean tokens per check when guess i is kept with probability
    ``rates[i - 1]`` once guesses 1..i-1 were; ``expected_tokens_per_check(a, k)`` when all
    k rates equal a."""
    total, run = 1.0, 1.0
    for rate in rates:
        run *= check_number("rate", rate, 0.0, 1.0)
        total += run
    return total


def check_step_cost(
    cfg: ModelConfig, gpu: GPUSpec, batch_size: int, context_len: int, k: int,
    dtype_bytes: float = 2,
) -> StepCost:
    """Roofline cost of one check: ``batch_size`` requests, each feeding k + 1 tokens after
    ``context_len`` cached ones (what ``batch_step_cost`` gives for ``[(k + 1, context)] *
    batch``, in O(1)). At k = 0 it is ``decode_step_cost``."""
    batch = check_int("batch_size", batch_size, minimum=1)
    context = check_int("context_len", context_len, minimum=1)
    new = check_int("k", k, minimum=0) + 1
    pairs = batch * (new * context + new * (new + 1) // 2)  # causal among the k + 1
    return step_cost_from_totals(cfg, gpu, batch * new, pairs, batch * context, dtype_bytes)


def speculative_speedup(
    cfg: ModelConfig, gpu: GPUSpec, batch_size: int, context_len: int, k: int,
    acceptance: float, draft: ModelConfig | None = None, dtype_bytes: float = 2,
) -> float:
    """Tokens per second with speculation over tokens per second without, on the roofline.

    Without: one token per request per decode step. With: ``expected_tokens_per_check``
    tokens per request per check, a check costing its roofline time plus, for a model draft
    (``draft``), k decode steps of the draft at the same batch (n-gram lookup: free).
    Above 1 speculation pays.
    """
    check = check_step_cost(cfg, gpu, batch_size, context_len, k, dtype_bytes).time_s
    if draft is not None:
        check += k * decode_step_time(draft, gpu, batch_size, context_len, dtype_bytes)
    plain = decode_step_time(cfg, gpu, batch_size, context_len, dtype_bytes)
    return expected_tokens_per_check(acceptance, k) * plain / check


def max_speculative_requests(
    cfg: ModelConfig, gpu: GPUSpec, context_len: int, draft: ModelConfig | None = None,
    dtype_bytes: float = 2,
) -> int:
    """How many requests of ``context_len`` tokens fit in memory while they speculate.

    Free guesses (``draft=None``, n-gram) take no memory: ``max_concurrent_requests``. A draft
    model shares the card: its weights come off the KV budget, and it keeps its own KV for
    every request's context, so each request costs both models' KV per token. LLaMA-3-8B
    with a LLaMA-3.2-1B draft on an H100 at 1,024 tokens: 366 requests, against 476 alone.
    Raises ValueError when not one request fits.
    """
    if draft is None:
        return max_concurrent_requests(cfg, gpu, context_len, dtype_bytes)
    budget = kv_budget_bytes(cfg, gpu, dtype_bytes) - weight_bytes(draft, dtype_bytes)
    per_request = (kv_bytes_per_request(cfg, context_len, dtype_bytes)
                   + kv_bytes_per_request(draft, context_len, dtype_bytes))
    count = int(max(budget, 0.0) // per_request)
    if count < 1:
        raise ValueError(
            f"a {context_len}-token request of {cfg.name} with a {draft.name} draft needs "
            f"{gb(per_request)} of KV cache, but only {gb(max(budget, 0.0))} of {gpu.name} is "
            f"left after both models' weights"
        )
    return count


def breakeven_batch(
    cfg: ModelConfig, gpu: GPUSpec, context_len: int, k: int, acceptance: float,
    draft: ModelConfig | None = None, max_batch: int = 4096, dtype_bytes: float = 2,
) -> int | None:
    """The smallest batch at which speculation no longer pays (speed-up <= 1), or ``None``
    if it still pays at ``max_batch``. The speed-up falls as the batch grows (the check
    turns compute-bound first), so a bisection finds the crossing."""
    def loses(batch: int) -> bool:
        return speculative_speedup(cfg, gpu, batch, context_len, k, acceptance, draft,
                                   dtype_bytes) <= 1.0

    max_batch = check_int("max_batch", max_batch, minimum=1)
    if not loses(max_batch):
        return None
    low, high = 0, max_batch  # loses(high); low == 0 or not loses(low)
    while high - low > 1:
        mid = (low + high) // 2
        if loses(mid):
            high = mid
        else:
            low = mid
    return high


def speedup_table(
    cfg: ModelConfig, gpu: GPUSpec, context_len: int, acceptance: float,
    ks: tuple[int, ...] = (1, 2, 3, 4, 6, 8), batches: tuple[int, ...] = (1, 8, 32, 64, 128, 256),
    draft: ModelConfig | None = None, dtype_bytes: float = 2,
) -> dict[int, dict[int, float]]:
    """``{k: {batch: speed-up}}`` for the chapter's grid (rows k, columns batch size)."""
    return {k: {b: speculative_speedup(cfg, gpu, b, context_len, k, acceptance, draft,
                                       dtype_bytes) for b in batches} for k in ks}
