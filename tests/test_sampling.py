"""Greedy and top-p sampling: validated parameters, private reproducible random streams."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minisrv.sampling import (
    SamplingParams,
    make_generator,
    nucleus_probs,
    sample_batch,
    sample_next,
)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 0),
        ("max_new_tokens", 2.5),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("seed", "7"),
    ],
)
def test_bad_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_greedy_is_argmax_and_needs_no_generator() -> None:
    params = SamplingParams()
    assert params.greedy and make_generator(params) is None
    assert sample_next(torch.tensor([0.1, 2.0, -1.0, 2.0]), params, None) == 1  # first max


def test_sampling_without_generator_is_an_error() -> None:
    with pytest.raises(ValueError, match="generator"):
        sample_next(torch.zeros(4), SamplingParams(temperature=1.0), None)


def test_nucleus_keeps_the_smallest_set_reaching_top_p() -> None:
    logits = torch.log(torch.tensor([0.1, 0.5, 0.3, 0.1]))
    probs = nucleus_probs(logits, temperature=1.0, top_p=0.75)
    assert probs.dtype == torch.float64
    assert torch.allclose(probs, torch.tensor([0.0, 0.625, 0.375, 0.0], dtype=torch.float64))
    assert nucleus_probs(logits, 1.0, 0.01).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=123)

    def draw(p: SamplingParams) -> list[int]:
        gen = make_generator(p)
        return [sample_next(logits, p, gen) for _ in range(40)]

    assert draw(params) == draw(params)
    assert draw(params) != draw(SamplingParams(temperature=1.0, seed=124))


def test_samples_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2])
    params = SamplingParams(temperature=1.0, seed=0)
    gen = make_generator(params)
    draws = [sample_next(probs.log(), params, gen) for _ in range(4000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).double() / len(draws)
    assert torch.allclose(freq, probs.double(), atol=0.03)


def test_tokens_outside_the_nucleus_are_never_drawn() -> None:
    logits = torch.tensor([3.0, 2.9, -5.0, -6.0])
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1)
    gen = make_generator(params)
    assert {sample_next(logits, params, gen) for _ in range(300)} == {0, 1}


def test_a_draw_depends_only_on_the_request_and_not_on_logit_dtype_or_device() -> None:
    logits = torch.randn(61, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    gen_a, gen_b = make_generator(params), make_generator(params)
    a = [sample_next(logits, params, gen_a) for _ in range(20)]
    b = [sample_next(logits.double(), params, gen_b) for _ in range(20)]
    assert a == b


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.7, 1.3]), min_size=1, max_size=8), st.integers(0, 99))
def test_sample_batch_gives_each_rows_sample_next(temperatures: list[float], seed: int) -> None:
    """One call for the whole step picks exactly what one call per row picks: greedy rows
    (ties to the lowest id) and sampled rows, each from its own generator."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 4, (len(temperatures), 12), generator=gen).float()  # many ties
    params = [SamplingParams(temperature=t, top_p=0.9, seed=seed + i)
              for i, t in enumerate(temperatures)]
    one_by_one = [sample_next(row, p, make_generator(p)) for row, p in zip(logits, params)]
    batched = sample_batch(logits, params, [make_generator(p) for p in params])
    assert batched == one_by_one


def test_sample_batch_refuses_mismatched_rows() -> None:
    with pytest.raises(ValueError, match=r"\[requests, vocab\].*\(3, 5\), 2 params"):
        sample_batch(torch.zeros(3, 5), [SamplingParams()] * 2, [None] * 2)
