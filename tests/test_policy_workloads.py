"""Workloads of the cache-aware scheduling chapter: prefix forests and few-shot groups."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisrv.scheduler.policy import distinct_prefix_tokens
from minisrv.tokenizer import Tokenizer
from minisrv.workloads import (
    FOREST_LENGTHS,
    FOREST_SHAPE,
    few_shot_groups_workload,
    prefix_forest_workload,
)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def forest_distinct(shape, lengths) -> int:
    return sum(math.prod(shape[: d + 1]) * lengths[d] for d in range(len(shape)))


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       lengths=st.lists(st.integers(2, 30), min_size=3, max_size=3),
       seed=st.integers(0, 100), text=st.booleans())
def test_forest_has_the_shape_it_was_asked_for(shape, lengths, seed, text) -> None:
    lengths = lengths[: len(shape)]
    if text and len(shape) > 1:
        lengths[0] = max(lengths[0], 3)
    tok = Tokenizer() if text else None
    w = prefix_forest_workload(shape, lengths, tok=tok, seed=seed, vocab_size=50)
    assert len(w) == math.prod(shape) and set(w.prompt_lens) == {sum(lengths)}
    assert len({tuple(p) for p in w.prompts}) == len(w)
    shared_bos = shape[0] - 1 if text else 0
    assert distinct_prefix_tokens(w.prompts) == forest_distinct(shape, lengths) - shared_bos
    if text:
        assert all(p[0] == Tokenizer().bos_id for p in w.prompts)
        Tokenizer().decode(w.prompts[0])  # valid CityLM ids
    else:
        assert all(2 <= t < 50 for p in w.prompts for t in p)


def test_forest_is_deterministic_for_a_seed_and_shuffled_unless_told() -> None:
    a = prefix_forest_workload(seed=5)
    assert a.prompts == prefix_forest_workload(seed=5).prompts
    assert a.prompts != prefix_forest_workload(seed=6).prompts
    assert (FOREST_SHAPE, FOREST_LENGTHS) == ((4, 4, 8), (59, 9, 12))
    ordered = prefix_forest_workload(seed=5, shuffle=False).prompts
    assert sorted(ordered) == sorted(a.prompts) and ordered != a.prompts
    # Unshuffled, the list is depth first: the 8 questions of a set are neighbours.
    assert all(common_prefix(ordered[i], ordered[i + 1]) >= 68 for i in range(7))
    w = prefix_forest_workload((2, 2), (3, 3), output_len=7, arrival_every=0.5)
    assert w.output_lens == [7] * 4 and w.arrivals == [0.0, 0.5, 1.0, 1.5]


def test_forest_text_reads_as_country_lines() -> None:
    tok = Tokenizer()
    w = prefix_forest_workload((2, 2, 2), (40, 20, 10), tok=tok, seed=0)
    text = tok.decode(w.prompts[0])
    lines = text.replace("<bos>", "").split("\n")
    assert len(lines) >= 3 and all(line[2] == ":" for line in lines if len(line) > 2)


def test_forest_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="same number"):
        prefix_forest_workload((4, 4), (10,))
    with pytest.raises(ValueError, match=">= 1 node"):
        prefix_forest_workload((4, 0), (10, 10))
    with pytest.raises(ValueError, match="distinct first ids"):
        prefix_forest_workload((10,), (5,), vocab_size=8)
    with pytest.raises(ValueError, match="different letters"):
        prefix_forest_workload((30,), (5,), tok=Tokenizer())


def test_few_shot_groups_headers_hold_exactly_the_asked_prefix_tokens() -> None:
    tok = Tokenizer()
    w = few_shot_groups_workload(tok)  # the lecture: 4 groups, 164 tokens of headers
    assert len(w) == 32 and w.arrivals[:8] == [0.0] * 4 + [1.0] * 4
    headers = []
    for g in range(4):
        members = w.prompts[g::4]
        n = min(common_prefix(members[0], p) for p in members[1:])
        assert tok.decode(members[0][:n]).endswith("\n")  # whole example lines
        headers.append(members[0][:n])
        assert all(tok.decode(p).endswith((":", ",")) for p in members)
    assert distinct_prefix_tokens(headers) == 164
    for a in range(4):  # interleaved groups share only <bos>
        for b in range(a + 1, 4):
            assert common_prefix(w.prompts[a], w.prompts[b]) == 1
    assert w.prompts == few_shot_groups_workload(tok).prompts
    assert few_shot_groups_workload(tok, seed=1).prompts != w.prompts


def test_few_shot_groups_sizes_and_errors() -> None:
    tok = Tokenizer()
    w = few_shot_groups_workload(tok, n_groups=3, per_group=5, prefix_tokens=200)
    assert len(w) == 15 and len({tuple(p) for p in w.prompts}) == 15
    with pytest.raises(ValueError, match="no two unused example lines"):
        few_shot_groups_workload(tok, n_groups=4, prefix_tokens=40)
