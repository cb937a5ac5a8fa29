"""The expected tokens per check, and the roofline speed-up of speculation on the H100."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from minisrv.configs import H100, L4, LLAMA3_8B, LLAMA32_1B
from minisrv.sim.roofline import batch_step_cost, decode_step_cost
from minisrv.sim.sizing import kv_bytes_per_request, max_concurrent_requests, weight_bytes
from minisrv.sim.speedup import (
    acceptance_by_position,
    breakeven_batch,
    check_step_cost,
    conditional_acceptance,
    expected_tokens_by_position,
    expected_tokens_per_check,
    max_speculative_requests,
    positions_reached,
    speculative_speedup,
    speedup_table,
)


@pytest.mark.parametrize(("a", "k"), [(0.0, 3), (0.3, 1), (0.6, 4), (0.8, 6), (0.95, 8)])
def test_formula_matches_a_monte_carlo_count(a: float, k: int) -> None:
    rng = np.random.default_rng(0)
    accepted = rng.random((200_000, k)) < a  # each guess passes with probability a
    run = np.where(accepted.all(axis=1), k, np.argmin(accepted, axis=1))  # first rejection
    tokens = run + 1  # plus the target's own token
    assert tokens.mean() == pytest.approx(expected_tokens_per_check(a, k), abs=0.02)


def test_formula_edges_and_monotonicity() -> None:
    assert expected_tokens_per_check(0.0, 5) == 1.0
    assert expected_tokens_per_check(1.0, 5) == 6.0
    assert expected_tokens_per_check(0.5, 0) == 1.0
    for a in (0.2, 0.5, 0.9):
        values = [expected_tokens_per_check(a, k) for k in range(10)]
        assert all(x < y for x, y in zip(values, values[1:]))  # more guesses, more tokens
        assert values[-1] < 1 / (1 - a)  # never past the infinite-k limit
    assert expected_tokens_per_check(0.5, 4) < expected_tokens_per_check(0.6, 4)


def test_check_cost_is_the_mixed_batch_cost_and_k0_is_decode() -> None:
    for batch, context, k in [(1, 100, 4), (7, 1024, 2), (64, 3000, 6)]:
        fast = check_step_cost(LLAMA3_8B, H100, batch, context, k)
        slow = batch_step_cost(LLAMA3_8B, H100, prefill=[(k + 1, context)] * batch)
        assert fast.time_s == pytest.approx(slow.time_s, rel=1e-12)
        assert fast.flops == pytest.approx(slow.flops, rel=1e-12)
    assert check_step_cost(LLAMA3_8B, H100, 8, 512, 0) == decode_step_cost(LLAMA3_8B, H100, 8, 512)


def test_speedup_falls_with_batch_and_is_the_expected_tokens_when_memory_bound() -> None:
    a, context = 0.7, 1024
    for k in (1, 2, 4, 8):
        small = speculative_speedup(LLAMA3_8B, H100, 1, context, k, a)
        # One request: the check is memory-bound like a decode step, so it costs the same
        # bytes plus k tokens' KV: nearly all of the expected tokens are gained.
        assert small == pytest.approx(expected_tokens_per_check(a, k), rel=0.01)
        curve = [speculative_speedup(LLAMA3_8B, H100, b, context, k, a)
                 for b in range(1, 1025, 7)]
        assert all(y <= x * (1 + 1e-12) for x, y in zip(curve, curve[1:]))
    # A model draft costs k of its own decode steps, so it pays less than free n-gram guesses.
    assert speculative_speedup(LLAMA3_8B, H100, 16, context, 4, a, draft=LLAMA32_1B) < \
        speculative_speedup(LLAMA3_8B, H100, 16, context, 4, a)


def test_breakeven_batch_is_where_the_speedup_crosses_one() -> None:
    for k, draft in [(8, None), (4, LLAMA32_1B), (8, LLAMA32_1B)]:
        batch = breakeven_batch(LLAMA3_8B, H100, 1024, k, 0.7, draft=draft)
        assert batch is not None and batch > 1
        assert speculative_speedup(LLAMA3_8B, H100, batch, 1024, k, 0.7, draft) <= 1.0
        assert speculative_speedup(LLAMA3_8B, H100, batch - 1, 1024, k, 0.7, draft) > 1.0
    # More guesses run out of free arithmetic sooner.
    assert breakeven_batch(LLAMA3_8B, H100, 1024, 8, 0.7, draft=LLAMA32_1B) < \
        breakeven_batch(LLAMA3_8B, H100, 1024, 4, 0.7, draft=LLAMA32_1B)
    assert breakeven_batch(LLAMA3_8B, H100, 1024, 1, 0.7, max_batch=64) is None


def test_a_draft_model_takes_its_weights_and_kv_out_of_the_memory_budget() -> None:
    """A draft model's weights and its KV of every request's context share the card."""
    for context in (256, 512, 1024):
        assert max_speculative_requests(LLAMA3_8B, H100, context) == \
            max_concurrent_requests(LLAMA3_8B, H100, context)
        left = H100.memory_bytes - weight_bytes(LLAMA3_8B) - weight_bytes(LLAMA32_1B)
        both = kv_bytes_per_request(LLAMA3_8B, context) + kv_bytes_per_request(LLAMA32_1B, context)
        assert max_speculative_requests(LLAMA3_8B, H100, context, LLAMA32_1B) == left // both
    assert max_speculative_requests(LLAMA3_8B, H100, 1024, LLAMA32_1B) == 366  # 476 alone
    with pytest.raises(ValueError, match="LLaMA-3.2-1B"):
        max_speculative_requests(LLAMA3_8B, L4, 100_000, LLAMA32_1B)


def test_table_and_bad_arguments() -> None:
    table = speedup_table(LLAMA3_8B, H100, 1024, 0.7, ks=(2, 4), batches=(1, 256))
    assert set(table) == {2, 4} and set(table[2]) == {1, 256}
    assert table[4][1] > table[2][1] > 1.0
    with pytest.raises(ValueError, match="acceptance"):
        expected_tokens_per_check(1.5, 3)
    with pytest.raises(ValueError, match="k"):
        expected_tokens_per_check(0.5, -1)
    with pytest.raises(ValueError, match="batch_size"):
        check_step_cost(LLAMA3_8B, H100, 0, 10, 2)


def test_acceptance_by_position_is_conditional_on_the_guesses_before() -> None:
    """Guess i counts only in checks that drafted it and kept guesses 1..i-1; the pooled rate
    counts every kept guess and each check's first rejection, never the guesses after it."""
    drafted, accepted = [4, 4, 4, 2], [4, 1, 0, 2]
    assert acceptance_by_position(drafted, accepted, 4) == pytest.approx([3 / 4, 2 / 3, 1, 1])
    assert conditional_acceptance(drafted, accepted) == pytest.approx(7 / 9)
    assert math.isnan(acceptance_by_position([1], [0], 2)[1])  # nothing reached guess 2
    assert positions_reached(drafted, accepted, 4) == [4, 3, 1, 1]  # the rates' samples


def test_rates_by_position_reproduce_the_measured_tokens_per_check() -> None:
    """With every check drafting k guesses, 1 + a_1 + a_1 a_2 + ... of the measured rates is
    the measured mean exactly (the products telescope); a constant rate gives the formula, and
    kept/drafted underestimates the per-guess rate the formula takes."""
    rng = random.Random(0)
    k, a = 4, 0.8
    accepted = [next((i for i in range(k) if rng.random() >= a), k) for _ in range(20_000)]
    drafted = [k] * len(accepted)
    measured = (sum(accepted) + len(accepted)) / len(accepted)
    rates = acceptance_by_position(drafted, accepted, k)
    assert expected_tokens_by_position(rates) == pytest.approx(measured, rel=1e-12)
    assert conditional_acceptance(drafted, accepted) == pytest.approx(a, abs=0.01)
    assert sum(accepted) / sum(drafted) < a - 0.1
    assert expected_tokens_by_position([a] * k) == pytest.approx(expected_tokens_per_check(a, k))
