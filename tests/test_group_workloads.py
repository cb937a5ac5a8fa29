"""The one prefix-group generator: prompts are a group's prefix + the request's question,
and every group workload of the book (routing, shared prompt, few-shot) is built on it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from minisrv.tokenizer import Tokenizer
from minisrv.train.data import country_line
from minisrv.workloads import (
    few_shot_workload,
    group_workload,
    prefix_groups_workload,
    wave_order,
)

TOK = Tokenizer()


@given(st.lists(st.lists(st.integers(2, 50), max_size=5), min_size=1, max_size=4),
       st.data())
def test_each_prompt_is_its_groups_prefix_then_its_question(prefixes, data) -> None:
    groups = data.draw(st.lists(st.integers(0, len(prefixes) - 1), max_size=12))
    seen: list[tuple[int, int, int]] = []

    def question(i: int, g: int, m: int) -> list[int]:
        seen.append((i, g, m))
        return [100 + i]

    w = group_workload("g", prefixes, groups, question, [1] * len(groups),
                       [0.0] * len(groups), "")
    assert w.prompts == [[*prefixes[g], 100 + i] for i, g in enumerate(groups)]
    # member m counts the group's earlier requests
    assert [m for _, _, m in seen] == [groups[:i].count(g) for i, g in enumerate(groups)]


def test_wave_order_groups_by_group_or_interleaved() -> None:
    assert wave_order(2, 3, interleave=False) == [0, 0, 0, 1, 1, 1]
    assert wave_order(2, 3, interleave=True) == [0, 1, 0, 1, 0, 1]
    assert wave_order(0, 3, interleave=True) == []


def test_group_members_share_exactly_their_prefix() -> None:
    w = prefix_groups_workload(n=200, n_groups=4, prefix_len=30, seed=3)
    by_prefix: dict[tuple[int, ...], int] = {}
    for p in w.prompts:
        by_prefix[tuple(p[:30])] = by_prefix.get(tuple(p[:30]), 0) + 1
    assert len(by_prefix) == 4 and sum(by_prefix.values()) == 200


def test_few_shot_prompts_are_two_example_lines_then_a_question() -> None:
    w = few_shot_workload(TOK, n_groups=2, per_group=2, group_gap=5.0)
    head = country_line("FR", 3) + "\n" + country_line("DE", 3) + "\n"
    second = country_line("JP", 3) + "\n" + country_line("US", 3) + "\n"
    assert w.prompts == [TOK.encode(head + "JP:"), TOK.encode(head + "US:"),
                         TOK.encode(second + "FR:"), TOK.encode(second + "DE:")]
    assert w.arrivals == [0.0, 0.0, 5.0, 5.0]
