"""Hypothesis strategies shared by the engine tests: requests that share prefixes.

A workload is three shared prefixes and up to eight requests, each naming the prefix it
starts with, its own suffix, its ``max_new_tokens``, whether it ignores ``<eos>`` and its
arrival step. Prefixes long enough to matter (over 32 tokens) exercise the in-batch check.
"""

from __future__ import annotations

from hypothesis import strategies as st

VOCAB = 61  # the random test model's vocabulary (tests/conftest.py)


def prefix_sharing(max_prefix: int, max_suffix: int, max_new: int, max_arrival: int):
    """``(prefixes, spec)`` strategies; ``prompts_of`` turns a draw into token prompts."""
    prefixes = st.lists(st.lists(st.integers(2, VOCAB - 1), max_size=max_prefix),
                        min_size=3, max_size=3)
    spec = st.lists(
        st.tuples(
            st.integers(0, 2),  # which shared prefix
            st.lists(st.integers(2, VOCAB - 1), max_size=max_suffix),  # own suffix
            st.integers(1, max_new),  # max_new_tokens
            st.booleans(),  # ignore_eos
            st.integers(0, max_arrival),  # arrival step
        ),
        min_size=1,
        max_size=8,
    )
    return prefixes, spec


def prompts_of(prefixes: list[list[int]], spec: list[tuple]) -> list[list[int]]:
    """Each request's prompt: ``<bos>`` (id 0), its shared prefix, then its own suffix."""
    return [[0, *prefixes[k], *own] for k, own, _, _, _ in spec]
