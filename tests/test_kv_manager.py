"""KVManager: admission, speculative growth and ``truncate`` never lose or share a slot."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisrv.kv import KVManager, SlotAllocator
from minisrv.request import Req
from minisrv.sampling import SamplingParams

prompt_st = st.lists(st.integers(0, 3), min_size=1, max_size=8)
op_st = st.one_of(
    st.tuples(st.just("admit"), prompt_st),
    st.tuples(st.just("grow"), st.integers(0, 9), st.integers(1, 4)),  # k+1 new tokens
    st.tuples(st.just("truncate"), st.integers(0, 9), st.integers(0, 4)),
    st.tuples(st.just("finish"), st.integers(0, 9)),
    st.tuples(st.just("release"), st.integers(0, 9)),
)


def _admit(memory: KVManager, rid: int, prompt: list[int]) -> Req | None:
    req = Req(rid=rid, prompt=prompt, params=SamplingParams(max_new_tokens=64))
    match = memory.match(req)
    if memory.allocate(req, match):
        return req
    memory.drop_match(req, match)
    return None


@settings(max_examples=200, deadline=None)
@given(cache=st.sampled_from(["radix", "blocks", "none"]),
       ops=st.lists(op_st, max_size=40), page_size=st.sampled_from([1, 4, 16]))
def test_truncate_after_any_history_leaks_no_slot(cache: str, ops: list[tuple],
                                                  page_size: int) -> None:
    """At every page size: a truncation frees exactly the pages it empties, and nothing
    leaks (``check_integrity``: every page free, one request's or the cache's)."""
    memory = KVManager(SlotAllocator(48, page_size), cache)  # type: ignore[arg-type]
    running: list[Req] = []
    for rid, (op, *args) in enumerate(ops):
        if op == "admit":
            if (req := _admit(memory, rid, args[0])) is not None:
                running.append(req)
        elif running:
            req = running[args[0] % len(running)]
            if op == "grow":  # a speculative check: k+1 tokens get KV, outputs follow
                n = args[1] if memory.growth(req, args[1]) <= memory.free_count else 0
                memory.alloc_tokens(req, n)
                req.output.extend([1] * n)
            elif op == "truncate":  # the rejected ones go again
                n = min(args[1], req.kv_len - req.cached_len, len(req.output))
                before, k = memory.free_count, req.kv_len
                memory.truncate(req, n)
                del req.output[len(req.output) - n:]
                assert memory.free_count == before + memory.pages(k) - memory.pages(k - n)
            elif op == "finish":
                running.remove(req)
                memory.cache_finished(req)
            else:
                running.remove(req)
                memory.release(req)
        memory.check_integrity(running)
    for req in running:
        memory.release(req)
    memory.check_integrity([])
    memory.tree.evict(memory.tree.evictable_size())
    assert memory.free_count == 48


def test_truncate_rejects_the_shared_prefix_and_changes_nothing() -> None:
    memory = KVManager(SlotAllocator(16), "radix")
    first = _admit(memory, 0, [1, 2, 3, 4])
    assert first is not None
    first.output.append(5)
    memory.alloc_tokens(first, 1)
    memory.cache_finished(first)
    second = _admit(memory, 1, [1, 2, 3, 4, 5, 6])
    assert second is not None and second.cached_len == 5
    slots = memory.slots(second)
    for bad in (2, -1, 1.0, True):
        with pytest.raises(ValueError, match="truncate of request 1"):
            memory.truncate(second, bad)  # type: ignore[arg-type]
    assert memory.slots(second) == slots
    memory.truncate(second, 1)
    assert memory.slots(second) == slots[:-1]
    memory.check_integrity([second])
