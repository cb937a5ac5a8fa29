"""vLLM's block-hash cache and the radix tree, driven by one random trace against a model.

Both caches only encode "which prefixes have KV". The model keeps that set explicitly: every
cached prefix whose length is a whole number of pages (tuple -> the values of its last
page), the references each running request holds, and for the block cache the free queue
as a plain list. After every operation each cache must answer as the model does: an insert
returns the longest cached page-aligned prefix, a match finds it with its values, an evict
frees least recently freed blocks first (the block cache) and never a locked prefix.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minisrv.engine import Engine
from minisrv.kv import BlockCache, RadixCache, make_cache
from minisrv.sampling import SamplingParams
from minisrv.scheduler import EngineConfig, calc_priority

Prefix = tuple[int, ...]


def documents(page: int) -> list[list[int]]:
    """Three texts of five pages: the second shares the first's two pages and one token
    more (a hit must stop at the page boundary), the third shares nothing."""
    base = [(3 * i) % 5 for i in range(5 * page)]
    return [base, base[:2 * page + 1] + [7] * (3 * page - 1), [5 + i % 2 for i in range(5 * page)]]


def tokens_st(page: int):
    """A document cut anywhere, then up to three tokens of its own."""
    docs = documents(page)
    return st.builds(lambda d, cut, tail: docs[d][:cut] + tail, st.integers(0, 2),
                     st.integers(0, 5 * page), st.lists(st.integers(0, 9), max_size=3))


class CacheModel(RuleBasedStateMachine):
    """One cache against the model; subclasses name the cache and its page size."""

    page = 1

    def make(self, on_evict):  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    def __init__(self) -> None:
        super().__init__()
        self.freed: list[int] = []
        self.cache = self.make(self.freed.extend)
        self.prefixes: dict[Prefix, list[int]] = {}  # cached page-aligned prefix -> its page
        self.locks: list[tuple[object, Prefix]] = []  # (handle, prefix it locks)
        self.queue: list[Prefix] = []  # the block cache's free queue, head first
        self.next_value = 0

    # ---------------------------------------------------------------- the model
    def hit(self, tokens: list[int]) -> int:
        """The longest cached prefix of ``tokens`` that is a whole number of pages."""
        n = 0
        while n + self.page <= len(tokens) and tuple(tokens[:n + self.page]) in self.prefixes:
            n += self.page
        return n

    def pages_of(self, prefix: Prefix) -> list[Prefix]:
        """``prefix`` and its page-aligned prefixes, the longest first."""
        return [prefix[:n] for n in range(len(prefix), 0, -self.page)]

    def refs(self, prefix: Prefix) -> int:
        return sum(1 for _, locked in self.locks if locked[:len(prefix)] == prefix
                   and len(locked) >= len(prefix))

    def protected(self) -> set[Prefix]:
        return {p for _, locked in self.locks for p in self.pages_of(locked)}

    def requeue(self, prefixes: list[Prefix]) -> None:
        """Those of ``prefixes`` nobody references go to the queue's tail, in order."""
        for p in prefixes:
            if self.refs(p) == 0:
                if p in self.queue:
                    self.queue.remove(p)
                self.queue.append(p)

    # ---------------------------------------------------------------- the trace
    @rule(data=st.data())
    def insert(self, data) -> None:
        tokens = data.draw(tokens_st(self.page))
        values = list(range(self.next_value, self.next_value + len(tokens)))
        self.next_value += len(tokens)
        expected = self.hit(tokens)
        assert self.cache.insert(tokens, values) == expected
        kept = len(tokens) // self.page * self.page
        for end in range(expected + self.page, kept + 1, self.page):
            self.prefixes[tuple(tokens[:end])] = values[end - self.page:end]
        self.requeue(self.pages_of(tuple(tokens[:kept])))

    @rule(data=st.data())
    def match(self, data) -> None:
        tokens = data.draw(tokens_st(self.page))
        result = self.cache.match_prefix(tokens)
        expected = self.hit(tokens)
        assert result.length == expected
        assert result.values == [v for end in range(self.page, expected + 1, self.page)
                                 for v in self.prefixes[tuple(tokens[:end])]]
        assert self.cache.prefix_of(result.node) == tuple(tokens[:expected])

    @rule(data=st.data())
    def lock(self, data) -> None:
        tokens = data.draw(tokens_st(self.page))
        result = self.cache.match_prefix(tokens)
        self.cache.lock(result.node)
        prefix = tuple(tokens[:result.length])
        self.locks.append((result.node, prefix))
        self.queue = [p for p in self.queue if self.refs(p) == 0]

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        node, prefix = self.locks.pop(i % len(self.locks))
        self.cache.unlock(node)
        self.requeue([p for p in self.pages_of(prefix) if p not in self.queue])

    @rule(n=st.integers(0, 40))
    def evict(self, n: int) -> None:
        before = dict(self.prefixes)
        evictable = self.cache.evictable_size()
        self.freed.clear()
        freed = self.cache.evict(n)
        after = self.cached()
        assert after <= set(before)
        assert freed == self.page * (len(before) - len(after))
        assert freed >= min(n, evictable)
        assert self.protected() <= after  # no locked prefix, no referenced block evicted
        assert sorted(self.freed) == sorted(v for p in before if p not in after
                                            for v in before[p])
        if isinstance(self.cache, BlockCache):  # least recently freed first, exactly
            gone = 0
            while gone < n and self.queue:
                del before[self.queue.pop(0)]
                gone += self.page
            assert set(before) == after
        self.prefixes = {p: before[p] for p in after}

    def cached(self) -> set[Prefix]:
        """Every page-aligned prefix the cache holds, read from its nodes."""
        out: set[Prefix] = set()
        for node in self.cache.nodes()[1:]:
            prefix = self.cache.prefix_of(node)
            out |= {prefix[:n] for n in range(self.page, len(prefix) + 1, self.page)}
        return out

    # ---------------------------------------------------------------- invariants
    @invariant()
    def holds_what_the_model_holds(self) -> None:
        assert self.cached() == set(self.prefixes)  # prefix-closed, as the model is

    @invariant()
    def sizes_add_up(self) -> None:
        info = self.cache.size_info()
        assert info.total == self.page * len(self.prefixes)
        assert info.protected == self.page * len(self.protected())

    @invariant()
    def the_free_queue_is_the_models(self) -> None:
        if isinstance(self.cache, BlockCache):
            assert [self.cache.prefix_of(b) for b in self.cache.free_queue()] == self.queue


def machine(name: str, page: int, make) -> type:
    test = type(name, (CacheModel,), {"page": page, "make": make}).TestCase
    test.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
    return test


TestRadix1 = machine("Radix1", 1, lambda self, freed: RadixCache(on_evict=freed))
TestRadix4 = machine("Radix4", 4, lambda self, freed: RadixCache(on_evict=freed, page_size=4))
TestRadix16 = machine("Radix16", 16,
                      lambda self, freed: RadixCache(on_evict=freed, page_size=16))
TestBlocks1 = machine("Blocks1", 1, lambda self, freed: BlockCache(1, on_evict=freed))
TestBlocks4 = machine("Blocks4", 4, lambda self, freed: BlockCache(4, on_evict=freed))
TestBlocks16 = machine("Blocks16", 16, lambda self, freed: BlockCache(16, on_evict=freed))
# Every block hashes alike: each lookup must still find only its own prefix's block.
TestBlocksColliding = machine("BlocksColliding", 4, lambda self, freed: BlockCache(
    4, on_evict=freed, hash_fn=lambda key: 7))


def test_a_hit_is_whole_blocks_and_the_chain_tail_is_evicted_first() -> None:
    freed: list[int] = []
    cache = BlockCache(4, on_evict=freed.extend)
    assert cache.insert(range(10), range(100, 110)) == 0  # two blocks; 8, 9 stay the caller's
    assert cache.total_size() == 8 and cache.n_blocks == 2
    assert cache.match_prefix(range(7)).length == 4  # the second block is not full in 7
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 6, 99]).length == 4
    hit = cache.match_prefix(range(12))
    assert hit.length == 8 and hit.values == list(range(100, 108))
    cache.lock(hit.node)
    assert cache.evict(100) == 0 and cache.protected_size() == 8
    cache.unlock(hit.node)
    assert cache.evict(1) == 4 and freed == [104, 105, 106, 107]  # the tail block first
    assert cache.match_prefix(range(12)).length == 4


def test_bad_input_raises_and_changes_nothing() -> None:
    cache = BlockCache(2)
    cache.insert([1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).node
    with pytest.raises(ValueError, match="values"):
        cache.insert([1, 2, 3], [7])
    with pytest.raises(ValueError, match="nobody references"):
        cache.unlock(node)
    with pytest.raises(ValueError, match="another cache"):
        BlockCache(2).lock(node)
    with pytest.raises(ValueError, match="page_size"):
        BlockCache(0)
    with pytest.raises(ValueError, match="token count"):
        cache.evict(-1)
    assert cache.total_size() == 4 and cache.evictable_size() == 4
    cache.evict(4)
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(node)


@pytest.mark.parametrize("kind", ["blocks", "radix"])
def test_lpm_orders_by_whole_pages(kind) -> None:
    prompts = [list(range(5)), list(range(13)), list(range(12)), [9, 9, 9]]
    cache = make_cache(kind, page_size=4)
    cache.insert(list(range(12)))
    result = calc_priority("lpm", cache, prompts, in_batch_prefix_check=False)
    assert result.matched == [4, 12, 8, 0]  # at most len - 1, rounded down to whole pages
    assert result.order == [1, 2, 0, 3]


def test_dfs_weight_needs_the_tree() -> None:
    cache = make_cache("blocks", page_size=4)
    cache.insert(list(range(12)))
    prompts = [list(range(5)), list(range(13))]
    with pytest.raises(ValueError, match="radix tree's nodes"):
        calc_priority("dfs-weight", cache, prompts)
    with pytest.raises(ValueError, match="cache='radix'"):
        EngineConfig(cache="blocks", policy="dfs-weight")
    assert EngineConfig(cache="blocks", policy="lpm").cache == "blocks"


def model_hit(inserted: list[list[int]], prompt: list[int], page: int) -> int:
    """The hit a prompt must get from a cache that never evicted: the longest prefix of the
    prompt but its last token that one inserted sequence starts with, in whole pages."""
    best = 0
    for seq in inserted:
        n = 0
        while n < min(len(seq), len(prompt) - 1) and seq[n] == prompt[n]:
            n += 1
        best = max(best, n // page * page)
    return best


@pytest.mark.parametrize("cache", ["blocks", "radix"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_multi_turn_hits_match_the_model(model, cache, page_size) -> None:
    """Three chats behind one 20-token system prompt, three turns each, served one request
    at a time into a pool that never evicts: every request's hit is the model's, and both
    caches hit the same tokens (their difference is in what they evict, and when)."""
    system = [0, *range(3, 22)]
    engine = Engine(model, cache=cache, page_size=page_size, kv_capacity=512, max_running=1,
                    debug=True)
    history = [list(system) for _ in range(3)]
    inserted: list[list[int]] = []
    expected, got = [], []
    for turn in range(3):
        for chat in range(3):
            prompt = history[chat] + [30 + 7 * chat + turn] * (5 + 3 * chat)
            req = engine.make_requests([prompt], None, SamplingParams(6, ignore_eos=True))[0]
            engine.serve([req])
            expected.append(model_hit(inserted, prompt, page_size))
            got.append(req.cached_prompt_tokens)
            history[chat] = prompt + req.output
            inserted.append(history[chat][:-1])  # the last token's KV is never computed
    assert got == expected
    assert engine.stats.cached_prompt_tokens == sum(expected) > 0
    assert engine.scheduler.memory.evicted_tokens == 0


def test_the_benchmark_serves_every_cache_the_same_unlimited_hits() -> None:
    """``bench_radix``'s comparison: with no capacity the radix tree and the block cache at
    one page size hit the same tokens; with one, the block cache stays within it."""
    from bench_scripts import load

    bench = load("bench_radix")
    trace = bench.make_trace(40, seed=1)
    hits = {name: bench.serve(make(), trace, name)[1] for name, make in bench.caches()
            if not name.startswith("SGLang")}
    assert hits["radix tree, page 1"] == hits["blocks, page 1"] > hits["blocks, page 16"]
    assert hits["radix tree, page 16"] == hits["blocks, page 16"] > 0
    cache = BlockCache(16)
    bench.serve(cache, trace, "blocks", capacity=2000)
    assert cache.total_size() <= 2000 and cache.n_blocks == cache.total_size() // 16


def test_the_server_flags_choose_the_block_cache() -> None:
    from minisrv.server.cli import build_parser, server_config

    def config(*flags: str):
        return server_config(build_parser().parse_args(["serve", *flags]))

    engine = config("--cache", "blocks", "--page-size", "16", "--policy", "lpm").engine
    assert (engine.cache, engine.page_size, engine.policy) == ("blocks", 16, "lpm")
    with pytest.raises(ValueError, match="radix tree's nodes"):
        config("--cache", "blocks", "--policy", "dfs-weight")
    with pytest.raises(ValueError, match="blocks"):
        config("--cache", "lru")  # the message lists the caches there are


@pytest.mark.parametrize("kind", ["radix", "blocks", "none"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_cached_length_is_the_match_length_of_every_cache(kind, page_size) -> None:
    cache = make_cache(kind, page_size=page_size)
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5]):
        cache.insert(prompt)
    for query in ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5], [7], []):
        length = cache.cached_length(query)
        assert length == cache.match_prefix(query).length
        assert length % page_size == 0

