"""Prompt lookup: the proposal continues the longest, latest earlier match of the suffix."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisrv.spec import Draft, NgramDrafter

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=40)  # few symbols: many repeats


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, spelled out: every n, longest first; every start, latest first."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        for start in reversed(range(len(tokens) - n)):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(TOKENS, st.integers(0, 6), st.integers(1, 3), st.integers(0, 3))
def test_proposal_matches_the_definition(tokens: list[int], k: int, min_n: int, extra: int):
    drafter = NgramDrafter(min_n=min_n, max_n=min_n + extra)
    assert drafter.propose(tokens, k) == brute_force(tokens, k, min_n, min_n + extra)


@settings(max_examples=300, deadline=None)
@given(TOKENS, st.integers(1, 6))
def test_proposal_is_a_continuation_of_an_earlier_suffix_match(tokens: list[int], k: int):
    drafter = NgramDrafter(min_n=1, max_n=4)
    proposal = drafter.propose(tokens, k)
    assert len(proposal) <= k
    found = drafter.match(tokens)
    if found is None:
        assert proposal == [] and tokens[-1] not in tokens[:-1]  # the last token is new
        return
    n, start = found
    assert tokens[start:start + n] == tokens[-n:] and start + n < len(tokens)
    assert proposal == tokens[start + n:start + n + k]
    assert len(proposal) == min(k, len(tokens) - start - n) >= 1
    # No longer n (within max_n) matches anywhere earlier.
    for longer in range(n + 1, min(4, len(tokens) - 1) + 1):
        assert all(tokens[s:s + longer] != tokens[-longer:] for s in range(len(tokens) - longer))


@given(st.lists(st.integers(0, 60), min_size=1, max_size=6, unique=True), st.integers(2, 5))
def test_a_repeated_pattern_is_continued(pattern: list[int], repeats: int):
    tokens = pattern * repeats + pattern[:1]
    proposal = NgramDrafter(min_n=1, max_n=3).propose(tokens, 4)
    expected = (pattern * 3)[1:5]
    assert proposal == expected[: len(proposal)] and len(proposal) >= 1


def test_default_draft_is_certain_and_city_lists_are_looked_up() -> None:
    from minisrv.tokenizer import Tokenizer

    tok = Tokenizer()
    text = "FR: Paris, Marseille, Lyon\nFR: Paris, Mar"
    ids = tok.encode(text)
    drafter = NgramDrafter(min_n=2, max_n=4)
    assert tok.decode(drafter.propose(ids, 6)) == "seille"
    draft = drafter.draft(ids, 3, params=None, generator=None)  # type: ignore[arg-type]
    assert isinstance(draft, Draft) and draft.probs is None and len(draft) == 3


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(min_n=0)
    with pytest.raises(ValueError, match="max_n"):
        NgramDrafter(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="k"):
        NgramDrafter().propose([1, 2], -1)
    with pytest.raises(ValueError, match="empty"):
        NgramDrafter().propose([], 2)
