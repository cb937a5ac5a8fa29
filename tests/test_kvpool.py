"""The KV pool: slot accounting after every operation, and errors that change nothing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minisrv.configs import CITYLM
from minisrv.kv import KVPool, SlotAllocator


def test_fresh_pool_hands_out_distinct_slots_in_order() -> None:
    alloc = SlotAllocator(8)
    assert alloc.alloc(3) == [0, 1, 2]
    assert alloc.alloc(2) == [3, 4]
    assert (alloc.free_count, alloc.used_count) == (3, 5)


def test_freed_slots_are_reused() -> None:
    alloc = SlotAllocator(4)
    first = alloc.alloc(4)
    alloc.free(first[1:3])
    assert sorted(alloc.alloc(2)) == first[1:3]
    assert alloc.free_count == 0


def test_asking_for_too_much_raises_and_changes_nothing() -> None:
    alloc = SlotAllocator(5)
    alloc.alloc(3)
    with pytest.raises(ValueError, match="only 2 of 5 are free"):
        alloc.alloc(3)
    assert (alloc.free_count, alloc.used_count) == (2, 3)
    assert len(alloc.alloc(2)) == 2


def test_freed_slots_come_back_first_in_the_order_they_were_freed() -> None:
    alloc = SlotAllocator(8)
    held = alloc.alloc(6)
    alloc.free([held[4], held[1], held[2]])
    assert alloc.alloc(2) == [held[4], held[1]] and alloc.alloc(2) == [held[2], 6]
    with pytest.raises(ValueError, match="slot 3 is not in use"):
        alloc.free([held[3], held[3]])  # a repeat within one call: nothing is freed
    assert alloc.used_count == 7 and alloc.is_used(3) and alloc.alloc(1) == [7]


@pytest.mark.parametrize("bad", [[7], [-1], [1], [0, 0]])
def test_foreign_or_double_free_raises_and_changes_nothing(bad: list[int]) -> None:
    alloc = SlotAllocator(5)
    alloc.alloc(1)  # slot 0 in use; slot 1 never handed out
    with pytest.raises(ValueError, match="slot"):
        alloc.free(bad)
    assert alloc.used_count == 1 and alloc.is_used(0)


def test_double_free_across_calls_is_rejected() -> None:
    alloc = SlotAllocator(3)
    slots = alloc.alloc(2)
    alloc.free(slots)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(slots[:1])
    assert alloc.free_count == 3


@pytest.mark.parametrize("capacity", [0, -3, 2.5, True])
def test_bad_capacity_is_rejected(capacity: object) -> None:
    with pytest.raises(ValueError, match="capacity"):
        SlotAllocator(capacity)  # type: ignore[arg-type]


def test_bad_alloc_count_is_rejected() -> None:
    with pytest.raises(ValueError, match="count"):
        SlotAllocator(3).alloc(-1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=40))
def test_random_alloc_free_sequences_never_leak(ops: list[tuple[bool, int]]) -> None:
    alloc = SlotAllocator(20)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc:
            if n <= alloc.free_count:
                held.append(alloc.alloc(n))
            else:
                with pytest.raises(ValueError):
                    alloc.alloc(n)
        elif held:
            alloc.free(held.pop(n % len(held)))
        owned = [s for run in held for s in run]
        assert len(set(owned)) == len(owned) == alloc.used_count
        assert alloc.free_count + alloc.used_count == alloc.capacity


def test_pool_tensors_have_the_model_layout() -> None:
    pool = KVPool(CITYLM, 10, dtype=torch.float64)
    shape = (CITYLM.n_layers, 10, CITYLM.n_kv_heads, CITYLM.head_dim)
    assert pool.k.shape == pool.v.shape == shape and pool.k.dtype == torch.float64
    assert pool.nbytes == 2 * 10 * CITYLM.n_layers * CITYLM.n_kv_heads * CITYLM.head_dim * 8
    slots = pool.alloc(4)
    pool.free(slots)
    assert (pool.free_count, pool.used_count, pool.capacity) == (10, 0, 10)


def test_asking_for_more_than_is_free_raises_and_changes_nothing() -> None:
    """The pool refuses an allocation it cannot serve whole, naming the numbers, before it
    hands out a single slot (the selective-batching chapter's demonstration, moved here)."""
    alloc = SlotAllocator(120)
    held = alloc.alloc(5)
    with pytest.raises(ValueError, match="asked for 121 slots, only 115 of 120 are free"):
        alloc.alloc(121)
    assert alloc.free_count == 115 and all(alloc.is_used(s) for s in held)
