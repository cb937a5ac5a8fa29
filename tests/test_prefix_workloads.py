"""The four prefix-sharing serving patterns: shapes, sharing, arrivals and strictness."""

from __future__ import annotations

import pytest

from minisrv.tokenizer import Tokenizer
from minisrv.workloads import (
    chat_sessions_workload,
    few_shot_workload,
    parallel_sampling_workload,
    repeated_prefill,
    shared_prompt_workload,
)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_shared_prompt_users_share_the_header_and_differ_after_it() -> None:
    tok = Tokenizer()
    w = shared_prompt_workload(tok, n_users=12)
    assert len(w) == 12 and len({tuple(p) for p in w.prompts}) == 12
    header = min(common_prefix(w.prompts[0], p) for p in w.prompts[1:])
    assert header >= 70  # the three-country system prompt
    assert w.arrivals == [float(i) for i in range(12)]


def test_few_shot_groups_share_examples_and_interleave_alternates_groups() -> None:
    tok = Tokenizer()
    grouped = few_shot_workload(tok, n_groups=3, per_group=4, group_gap=10.0)
    assert grouped.arrivals == [0.0] * 4 + [10.0] * 4 + [20.0] * 4
    assert common_prefix(grouped.prompts[0], grouped.prompts[3]) > 30
    assert common_prefix(grouped.prompts[0], grouped.prompts[4]) <= 1  # only <bos>
    mixed = few_shot_workload(tok, n_groups=3, per_group=4, group_gap=10.0, interleave=True)
    assert sorted(map(tuple, mixed.prompts)) == sorted(map(tuple, grouped.prompts))
    assert mixed.prompts[:3] == [grouped.prompts[0], grouped.prompts[4], grouped.prompts[8]]
    assert mixed.arrivals[:4] == [0.0, 0.0, 0.0, 10.0]


def test_parallel_sampling_repeats_one_prompt() -> None:
    w = parallel_sampling_workload(Tokenizer(), n_samples=5)
    assert len({tuple(p) for p in w.prompts}) == 1 and len(w) == 5
    assert repeated_prefill(w.prompts).repeated == 4 * (len(w.prompts[0]) - 1)  # logits


def test_chat_turn_extends_the_previous_prompt(citylm) -> None:
    model, tok = citylm
    w = chat_sessions_workload(model, tok, n_sessions=2, n_turns=3, max_answer_tokens=12)
    assert len(w) == 6 and w.arrivals == [0.0, 0.0, 48.0, 48.0, 96.0, 96.0]
    for i in range(2, 6):  # request i continues request i - 2 of the same session
        prev, cur = w.prompts[i - 2], w.prompts[i]
        assert cur[: len(prev)] == prev and len(cur) > len(prev) + w.output_lens[i - 2] - 1
    assert common_prefix(w.prompts[0], w.prompts[1]) == 1  # sessions share only <bos>


@pytest.mark.parametrize("bad", [dict(output_len=0), dict(arrival_every=-1.0)])
def test_bad_parameters_raise(bad: dict) -> None:
    with pytest.raises(ValueError):
        shared_prompt_workload(Tokenizer(), **bad)
