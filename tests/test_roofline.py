"""Roofline step times: the exact figures, the model's structure, and bad input."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minisrv.configs import CITYLM, DEEPSEEK_V3, GPUS, H100, LLAMA3_8B, MODELS
from minisrv.kvsize import kv_bytes_per_token
from minisrv.sim.roofline import (
    attention_flops_per_pair,
    batch_step_cost,
    batch_step_time,
    compute_bound_batch,
    decode_step_cost,
    decode_step_time,
    decode_throughput,
    step_cost_from_totals,
)
from minisrv.sim.sizing import weight_bytes


@pytest.mark.parametrize(("batch", "ms"), [(1, 4.83), (16, 5.44), (64, 7.36)])
def test_llama3_8b_decode_on_h100_at_context_1024(batch, ms) -> None:
    assert round(decode_step_time(LLAMA3_8B, H100, batch, 1024) * 1e3, 2) == ms


def test_batch_64_gives_42x_the_throughput_of_batch_1() -> None:
    ratio = decode_throughput(LLAMA3_8B, H100, 64, 1024) / decode_throughput(
        LLAMA3_8B, H100, 1, 1024
    )
    assert round(ratio) == 42


def test_batch_1_decode_is_a_weight_read() -> None:
    cost = decode_step_cost(LLAMA3_8B, H100, 1, 1024)
    assert cost.bound == "memory"
    assert cost.bytes == weight_bytes(LLAMA3_8B) + 1025 * kv_bytes_per_token(LLAMA3_8B)
    assert cost.time_s == cost.memory_s == cost.bytes / H100.bandwidth
    assert cost.intensity < 2  # about one FLOP per byte: far below the H100's ridge of 295


def test_flops_are_two_per_parameter_per_token_plus_attention() -> None:
    """2 FLOPs per weight a token multiplies by: all but the untied input embedding, which
    is looked up, not multiplied (128,256 x 4,096 of LLaMA-3-8B's 8.03e9)."""
    cost = decode_step_cost(LLAMA3_8B, H100, 16, 1024)
    attention = attention_flops_per_pair(LLAMA3_8B) * 16 * 1025
    assert attention_flops_per_pair(LLAMA3_8B) == 32 * 32 * 4 * 128
    assert cost.flops == 2 * (8.03e9 - 128256 * 4096) * 16 + attention
    assert cost.compute_s == cost.flops / H100.flops


def test_moe_computes_with_activated_and_reads_all_parameters() -> None:
    cost = batch_step_cost(DEEPSEEK_V3, H100, prefill=[(1, 0)])
    lookup = 129280 * 7168  # the input embedding: a lookup, not a matmul
    assert cost.flops == 2 * (37e9 - lookup) + attention_flops_per_pair(DEEPSEEK_V3)
    assert cost.bytes == 671e9 * 2 + kv_bytes_per_token(DEEPSEEK_V3)
    assert attention_flops_per_pair(DEEPSEEK_V3) == 61 * 128 * 2 * (576 + 512)


def test_decode_shortcut_equals_the_general_batch() -> None:
    assert decode_step_cost(LLAMA3_8B, H100, 64, 1024) == batch_step_cost(
        LLAMA3_8B, H100, decode_contexts=[1024] * 64
    )


def test_prefill_counts_causal_pairs_and_cached_prefix() -> None:
    cost = batch_step_cost(CITYLM, H100, prefill=[(3, 5)])
    pairs = 3 * 5 + (1 + 2 + 3)  # each new token sees the 5 cached ones and those up to itself
    lookup = CITYLM.vocab_size * CITYLM.d_model  # untied: the input table is only read
    assert cost.flops == (2 * (CITYLM.param_count - lookup) * 3
                          + attention_flops_per_pair(CITYLM) * pairs)
    kv = kv_bytes_per_token(CITYLM)
    assert cost.bytes == weight_bytes(CITYLM) + kv * (5 + 3)


def test_mixed_batch_adds_its_parts_on_top_of_one_weight_read() -> None:
    prefill = [(512, 0), (100, 400)]
    decodes = [300, 2000, 7]
    mixed = batch_step_cost(LLAMA3_8B, H100, prefill, decodes)
    alone = [batch_step_cost(LLAMA3_8B, H100, prefill=[p]) for p in prefill]
    alone += [batch_step_cost(LLAMA3_8B, H100, decode_contexts=[d]) for d in decodes]
    weights = weight_bytes(LLAMA3_8B)
    assert mixed.flops == pytest.approx(sum(c.flops for c in alone))
    assert mixed.bytes == pytest.approx(sum(c.bytes - weights for c in alone) + weights)
    assert batch_step_time(LLAMA3_8B, H100, prefill, decodes) == mixed.time_s


def test_long_prefill_is_compute_bound() -> None:
    assert batch_step_cost(LLAMA3_8B, H100, prefill=[(2048, 0)]).bound == "compute"


def test_compute_bound_batch_short_context_only() -> None:
    """At 128 tokens of context decode turns compute-bound at batch 471; at 1024 never,
    because each request's KV read then grows the traffic faster than its arithmetic."""
    batch = compute_bound_batch(LLAMA3_8B, H100, 128)
    assert batch == 471  # 426 if the embedding lookup counted as a matmul
    assert decode_step_cost(LLAMA3_8B, H100, batch, 128).bound == "compute"
    assert decode_step_cost(LLAMA3_8B, H100, batch - 1, 128).bound == "memory"
    assert compute_bound_batch(LLAMA3_8B, H100, 1024) is None
    assert decode_step_cost(LLAMA3_8B, H100, 100_000, 1024).bound == "memory"


@given(
    model=st.sampled_from(list(MODELS.values())),
    gpu=st.sampled_from(list(GPUS.values())),
    batch=st.integers(1, 5000),
    more=st.integers(0, 5000),
    context=st.integers(1, 100_000),
    dtype_bytes=st.sampled_from([0.5, 1, 2, 4]),
)
def test_more_batch_never_makes_a_step_faster(model, gpu, batch, more, context, dtype_bytes):
    small = decode_step_time(model, gpu, batch, context, dtype_bytes)
    assert decode_step_time(model, gpu, batch + more, context, dtype_bytes) >= small


@given(
    decodes=st.lists(st.integers(1, 50_000), min_size=1, max_size=30),
    extra=st.integers(1, 50_000),
    prefill=st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 4096)), max_size=4),
)
def test_adding_a_request_to_a_mixed_batch_never_makes_it_faster(decodes, extra, prefill):
    before = batch_step_time(LLAMA3_8B, H100, prefill, decodes)
    assert batch_step_time(LLAMA3_8B, H100, prefill, [*decodes, extra]) >= before
    assert batch_step_time(LLAMA3_8B, H100, [*prefill, (1, extra)], decodes) >= before


@given(batch=st.integers(1, 2000), context=st.integers(1, 50_000))
def test_step_time_is_the_slower_of_compute_and_memory(batch, context):
    cost = decode_step_cost(LLAMA3_8B, H100, batch, context)
    assert cost.time_s == max(cost.compute_s, cost.memory_s)
    assert cost.bound == ("compute" if cost.compute_s >= cost.memory_s else "memory")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0, "context_len": 1024}, "batch_size must be >= 1"),
        ({"batch_size": -3, "context_len": 1024}, "batch_size must be >= 1"),
        ({"batch_size": 2, "context_len": 0}, "context_len must be >= 1"),
        ({"batch_size": 2.5, "context_len": 10}, "batch_size must be an integer"),
        ({"batch_size": 2, "context_len": 10, "dtype_bytes": 0}, "dtype_bytes must be > 0"),
    ],
)
def test_decode_step_refuses_bad_sizes(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        decode_step_time(LLAMA3_8B, H100, **kwargs)


@pytest.mark.parametrize(
    ("prefill", "decodes", "message"),
    [
        ((), (), "at least one prefilling or decoding request"),
        ([(0, 10)], (), r"prefill\[0\] new_tokens must be >= 1"),
        ([(10, -1)], (), r"prefill\[0\] cached_tokens must be >= 1"),
        ([(10,)], (), r"prefill\[0\] must be \(new_tokens, cached_tokens\)"),
        ((), [5, 0], r"decode_contexts\[1\] must be >= 1"),
    ],
)
def test_batch_step_refuses_bad_batches(prefill, decodes, message) -> None:
    with pytest.raises(ValueError, match=message):
        batch_step_cost(LLAMA3_8B, H100, prefill, decodes)


def test_compute_bound_batch_refuses_bad_context() -> None:
    with pytest.raises(ValueError, match="context_len must be >= 1"):
        compute_bound_batch(LLAMA3_8B, H100, 0)


@pytest.mark.parametrize(
    ("totals", "message"),
    [
        ((0, 0, 0), "new_tokens must be >= 1"),
        ((4, 3, 0), r"attended_pairs \(3\) must be >= new_tokens \(4\)"),
        ((1, 1, -5), "cached_tokens must be >= 0"),
    ],
)
def test_step_cost_from_totals_refuses_impossible_totals(totals, message) -> None:
    with pytest.raises(ValueError, match=message):
        step_cost_from_totals(LLAMA3_8B, H100, *totals, dtype_bytes=2)
