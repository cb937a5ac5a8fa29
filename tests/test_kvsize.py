"""KV bytes per token and per request, weight bytes, and how many requests fit."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minisrv.configs import (
    CITYLM,
    DEEPSEEK_V3,
    GPUS,
    H100,
    L4,
    LLAMA3_8B,
    LLAMA3_70B,
    LLAMA3_70B_MHA,
    MODELS,
    QWEN25_7B,
    T4,
)
from minisrv.kvsize import kv_bytes_per_token
from minisrv.sim.sizing import (
    kv_bytes_per_request,
    max_concurrent_requests,
    weight_bytes,
)

KIB, MIB, GIB = 2**10, 2**20, 2**30


def test_llama3_8b_kv_per_token_is_128_kib() -> None:
    assert kv_bytes_per_token(LLAMA3_8B) == 131_072 == 128 * KIB
    assert kv_bytes_per_token(LLAMA3_8B) == 2 * 32 * 8 * 128 * 2


def test_llama3_8b_32k_request_is_4_gib() -> None:
    assert kv_bytes_per_request(LLAMA3_8B, 32 * 1024) == 4 * GIB


def test_llama3_8b_weights_are_16_06_gb() -> None:
    assert weight_bytes(LLAMA3_8B) == pytest.approx(16.06e9)


def test_llama3_70b_all_heads_is_2_5_mib_per_token_and_20_gib_per_8k() -> None:
    assert kv_bytes_per_token(LLAMA3_70B_MHA) == 2.5 * MIB
    assert kv_bytes_per_request(LLAMA3_70B_MHA, 8192) == 20 * GIB


def test_gqa_stores_eight_times_less_than_all_heads() -> None:
    assert kv_bytes_per_token(LLAMA3_70B_MHA) == 8 * kv_bytes_per_token(LLAMA3_70B)


def test_pitfall_mha_formula_overcounts_gqa() -> None:
    """2 x layers x d_model x bytes is right only for all-heads models."""
    naive = 2 * LLAMA3_70B.n_layers * LLAMA3_70B.d_model * 2
    assert naive == kv_bytes_per_token(LLAMA3_70B_MHA) == 8 * kv_bytes_per_token(LLAMA3_70B)
    naive_8b = 2 * LLAMA3_8B.n_layers * LLAMA3_8B.d_model * 2
    assert naive_8b == 4 * kv_bytes_per_token(LLAMA3_8B)


def test_mla_caches_latent_plus_rope_key_per_layer() -> None:
    assert kv_bytes_per_token(DEEPSEEK_V3) == 61 * (512 + 64) * 2 == 70_272


def test_other_published_models() -> None:
    assert kv_bytes_per_token(QWEN25_7B) == 2 * 28 * 4 * 128 * 2 == 56 * KIB
    assert kv_bytes_per_token(CITYLM, dtype_bytes=4) == 2 * 4 * 2 * 32 * 4


def test_dtype_scales_linearly_and_rounds_sub_byte_up() -> None:
    assert kv_bytes_per_token(LLAMA3_8B, 1) * 2 == kv_bytes_per_token(LLAMA3_8B, 2)
    assert kv_bytes_per_token(LLAMA3_8B, 0.5) == 32 * KIB
    assert kv_bytes_per_token(CITYLM.with_(n_layers=1, n_kv_heads=1, head_dim=1), 0.5) == 1


@pytest.mark.parametrize(("context", "expected"), [(1024, 476), (8192, 59), (32768, 14)])
def test_max_concurrent_llama3_8b_on_h100(context, expected) -> None:
    assert max_concurrent_requests(LLAMA3_8B, H100, context) == expected


def test_max_concurrent_is_memory_left_over_kv_per_request() -> None:
    left = H100.memory_bytes - weight_bytes(LLAMA3_8B)
    for context in (1, 100, 4096, 100_000):
        per_request = kv_bytes_per_request(LLAMA3_8B, context)
        assert max_concurrent_requests(LLAMA3_8B, H100, context) == int(left // per_request)


@given(
    model=st.sampled_from(list(MODELS.values())),
    gpu=st.sampled_from(list(GPUS.values())),
    context=st.integers(1, 200_000),
    extra=st.integers(0, 200_000),
    dtype_bytes=st.sampled_from([0.5, 1, 2, 4]),
)
def test_more_context_never_fits_more_requests(model, gpu, context, extra, dtype_bytes) -> None:
    try:
        longer = max_concurrent_requests(model, gpu, context + extra, dtype_bytes)
    except ValueError:
        return  # nothing fits at the longer context: nothing to compare
    assert max_concurrent_requests(model, gpu, context, dtype_bytes) >= longer


def test_weights_that_do_not_fit_name_model_and_card() -> None:
    message = r"LLaMA-3-70B weights \(141 GB\) do not fit on L4 \(24 GB\)"
    with pytest.raises(ValueError, match=message):
        max_concurrent_requests(LLAMA3_70B, L4, 1024)
    with pytest.raises(ValueError, match=r"LLaMA-3-8B weights \(16.1 GB\) do not fit on T4"):
        max_concurrent_requests(LLAMA3_8B, T4, 1024)


def test_context_where_not_one_request_fits() -> None:
    with pytest.raises(ValueError, match="100000-token request of LLaMA-3-8B needs 13.1 GB"):
        max_concurrent_requests(LLAMA3_8B, L4, 100_000)


@pytest.mark.parametrize("bad", [0, -1, -1024])
def test_non_positive_context_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="context_len must be >= 1"):
        kv_bytes_per_request(LLAMA3_8B, bad)
    with pytest.raises(ValueError, match="context_len must be >= 1"):
        max_concurrent_requests(LLAMA3_8B, H100, bad)


@pytest.mark.parametrize("bad", [1.5, "1024", None, True])
def test_non_integer_context_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="context_len must be an integer"):
        kv_bytes_per_request(LLAMA3_8B, bad)


@pytest.mark.parametrize("bad", [0, -2, "2", None])
def test_non_positive_dtype_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="dtype_bytes"):
        kv_bytes_per_token(LLAMA3_8B, bad)
    with pytest.raises(ValueError, match="dtype_bytes"):
        weight_bytes(LLAMA3_8B, bad)


def test_numpy_integers_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    assert kv_bytes_per_request(LLAMA3_8B, np.int64(32768)) == 4 * GIB
