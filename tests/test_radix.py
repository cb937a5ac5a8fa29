"""The radix cache against a plain oracle: the set of every cached prefix.

A radix tree is only an efficient encoding of "which token prefixes have KV". The oracle
keeps that set explicitly (prefix tuple -> values of its last page) and the state machine
checks, after every random operation, that the tree answers exactly as the set would. With
pages of ``PAGE`` tokens the set holds whole-page prefixes only: an insert keeps the whole
pages of its tokens, a match is the longest run of whole pages in the set.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minisrv.kv import MatchResult, NoCache, RadixCache, make_cache


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def closure(seq: tuple[int, ...], page: int = 1) -> set[tuple[int, ...]]:
    """Every non-empty prefix of ``seq`` made of whole pages."""
    return {seq[:i] for i in range(page, len(seq) + 1, page)}


def lcp_with(prefixes: dict[tuple[int, ...], object], tokens: list[int], page: int = 1) -> int:
    n = 0
    while n + page <= len(tokens) and tuple(tokens[: n + page]) in prefixes:
        n += page
    return n


tokens_st = st.lists(st.integers(0, 3), min_size=0, max_size=9)


class RadixMachine(RuleBasedStateMachine):
    """Random insert / match / lock / unlock / evict against the prefix-set oracle."""

    PAGE = 1  # tokens per page

    def __init__(self) -> None:
        super().__init__()
        self.freed: list[int] = []
        self.cache = RadixCache(on_evict=self.freed.extend, page_size=self.PAGE)
        # cached prefix -> the values of its last page
        self.prefixes: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.locks: list[tuple[object, tuple[int, ...]]] = []  # (node, prefix it ends)
        self.next_value = 0

    def protected_prefixes(self) -> set[tuple[int, ...]]:
        out: set[tuple[int, ...]] = set()
        for _, prefix in self.locks:
            out |= closure(prefix, self.PAGE)
        return out

    @rule(tokens=tokens_st)
    def insert(self, tokens: list[int]) -> None:
        values = list(range(self.next_value, self.next_value + len(tokens)))
        self.next_value += len(tokens)
        page = self.PAGE
        expected = lcp_with(self.prefixes, tokens, page)
        assert self.cache.insert(tokens, values) == expected
        for i in range(expected + page, len(tokens) + 1, page):
            self.prefixes[tuple(tokens[:i])] = tuple(values[i - page:i])

    @rule(tokens=tokens_st)
    def match(self, tokens: list[int]) -> None:
        result = self.cache.match_prefix(tokens)
        page = self.PAGE
        expected = lcp_with(self.prefixes, tokens, page)
        assert result.length == expected
        assert result.values == [v for i in range(page, expected + 1, page)
                                 for v in self.prefixes[tuple(tokens[:i])]]
        assert self.cache.prefix_of(result.node) == tuple(tokens[:expected])

    @rule(tokens=tokens_st)
    def peek(self, tokens: list[int]) -> None:
        """What a router fed by the cache's events reads: the match's length, and nothing in
        the tree moves (no split, no LRU stamp, so the next eviction is the same)."""
        before = self.cache.snapshot()
        assert self.cache.cached_length(tokens) == lcp_with(self.prefixes, tokens, self.PAGE)
        assert self.cache.snapshot() == before

    @rule(tokens=tokens_st)
    def lock(self, tokens: list[int]) -> None:
        result = self.cache.match_prefix(tokens)
        self.cache.lock(result.node)
        self.locks.append((result.node, tuple(tokens[: result.length])))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        node, _ = self.locks.pop(i % len(self.locks))
        self.cache.unlock(node)

    @rule(n=st.integers(0, 20))
    def evict(self, n: int) -> None:
        before = dict(self.prefixes)
        evictable = self.cache.evictable_size()
        self.freed.clear()
        freed = self.cache.evict(n)
        after = {p: before[p] for p in map(tuple, self._cached_prefixes())}
        assert freed == (len(before) - len(after)) * self.PAGE
        assert freed >= min(n, evictable)
        assert self.protected_prefixes() <= set(after)  # a locked prefix is never evicted
        assert sorted(self.freed) == sorted(v for p in before if p not in after
                                            for v in before[p])
        self.prefixes = after

    @rule()
    def evict_everything(self) -> None:
        self.cache.evict(self.cache.evictable_size())
        assert self.cache.evictable_size() == 0
        assert self.cache.total_size() == self.cache.protected_size()
        assert set(self._cached_prefixes()) == self.protected_prefixes()
        self.prefixes = {p: self.prefixes[p] for p in self.protected_prefixes()}

    def _cached_prefixes(self) -> set[tuple[int, ...]]:
        out: set[tuple[int, ...]] = set()
        for seq in self.cache.cached_sequences():
            out |= closure(seq, self.PAGE)
        return out

    @invariant()
    def sizes_add_up(self) -> None:
        info, page = self.cache.size_info(), self.PAGE
        assert (info.evictable + info.protected == self.cache.total_size()
                == len(self.prefixes) * page)
        assert info.protected == len(self.protected_prefixes()) * page

    @invariant()
    def tree_is_the_oracle(self) -> None:
        assert self._cached_prefixes() == set(self.prefixes)


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class PagedRadixMachine(RadixMachine):
    """The same operations on a tree of pages of two tokens (SGLang's ``page_size``)."""

    PAGE = 2


TestPagedRadixMachine = PagedRadixMachine.TestCase
TestPagedRadixMachine.settings = settings(max_examples=60, stateful_step_count=40,
                                          deadline=None)


def test_notes_exercise_6() -> None:
    """"abcde", "abcxy", "abfg" give ab -> {c -> {de, xy}, fg}; "abcxz" matches 4, splits xy."""
    cache = RadixCache()
    assert [cache.insert(chars(w)) for w in ("abcde", "abcxy", "abfg")] == [0, 3, 2]
    edges = {"".join(map(chr, cache.prefix_of(n))) for n in cache.nodes()[1:]}
    assert edges == {"ab", "abc", "abcde", "abcxy", "abfg"}
    result = cache.match_prefix(chars("abcxz"))
    assert result.length == 4
    assert "".join(map(chr, result.node.key)) == "x"
    assert "".join(map(chr, cache.prefix_of(result.node))) == "abcx"
    assert [len(c.key) for c in result.node.children.values()] == [1]  # "y" below "x"
    assert cache.total_size() == 9


def test_lru_evicts_least_recent_leaf_and_keeps_the_hot_prefix() -> None:
    freed: list[int] = []
    cache = RadixCache(on_evict=freed.extend)
    cache.insert(chars("sysA"), [1, 2, 3, 4])
    cache.insert(chars("sysB"), [1, 2, 3, 5])
    cache.insert(chars("sysC"), [1, 2, 3, 6])
    cache.match_prefix(chars("sysA"))  # A recently used; B is now the oldest leaf
    assert cache.evict(1) == 1
    assert freed == [5]
    assert cache.match_prefix(chars("sysB")).length == 3
    assert cache.evict(2) == 2  # C, then A; "sys" still has no lock but keeps its children..
    assert cache.evict(3) == 3  # .. until it becomes a leaf itself
    assert cache.total_size() == 0
    assert sorted(freed) == [1, 2, 3, 4, 5, 6]


def test_locked_path_survives_and_split_keeps_the_lock() -> None:
    cache = RadixCache()
    cache.insert(chars("abcdef"))
    node = cache.match_prefix(chars("abcdef")).node
    cache.lock(node)
    assert cache.protected_size() == 6
    cache.match_prefix(chars("abcz"))  # splits the locked edge after "abc"
    assert cache.protected_size() == 6 and cache.evictable_size() == 0
    assert cache.evict(100) == 0
    cache.unlock(node)
    assert cache.evictable_size() == 6
    assert cache.evict(1) == 3  # the whole leaf "def" goes
    assert cache.evict(1) == 3


def test_bad_input_raises_and_leaves_the_tree_intact() -> None:
    cache = RadixCache()
    cache.insert(chars("abc"))
    before = cache.snapshot()
    with pytest.raises(ValueError, match="values"):
        cache.insert(chars("abcd"), [1, 2])
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(cache.match_prefix(chars("abc")).node)
    with pytest.raises(ValueError, match="token count"):
        cache.evict(-1)
    other = RadixCache()
    other.insert(chars("x"))
    with pytest.raises(ValueError, match="another cache"):
        cache.lock(other.match_prefix(chars("x")).node)
    assert [(v.id, v.key, v.lock_ref) for v in cache.snapshot()] == [
        (v.id, v.key, v.lock_ref) for v in before]
    evicted = cache.match_prefix(chars("abc")).node
    cache.evict(3)
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(evicted)


def test_no_cache_twin_keeps_nothing() -> None:
    cache = make_cache("none")
    assert isinstance(cache, NoCache)
    assert cache.insert(chars("abc"), [7, 8, 9]) == 3  # caller keeps (and frees) all slots
    assert cache.match_prefix(chars("abc")) == MatchResult(0, cache.root, [])
    cache.lock(cache.root)
    cache.unlock(cache.root)
    assert cache.evict(10) == 0 and cache.total_size() == 0
    with pytest.raises(ValueError, match="unknown cache"):
        make_cache("lru")


def test_the_listener_hears_path_split_insert_and_eviction() -> None:
    heard = []
    cache = RadixCache(listener=lambda tree, event: heard.append((event, tree.n_nodes)))
    cache.insert(chars("abcde"), tag="A")
    cache.insert(chars("abxy"), tag="B")
    cache.evict(2)
    (insert_a, _), (insert_b, _), (evict, nodes_after) = heard
    assert insert_a.op == "insert" and insert_a.tag == "A" and len(insert_a.inserted) == 1
    assert insert_b.length == 2 and len(insert_b.split) == 1 and len(insert_b.inserted) == 1
    assert evict.op == "evict" and evict.length == 3 and evict.tag == ""
    assert [v.key for v in evict.evicted] == [tuple(chars("cde"))]
    assert nodes_after == 3  # root, "ab", "xy": the listener sees the tree after the operation


def test_the_recorder_keeps_a_snapshot_per_operation() -> None:
    from minisrv.viz.radix import TreeRecorder

    cache = RadixCache()
    recorder = TreeRecorder(cache)
    cache.insert(chars("abcde"), tag="A")
    cache.insert(chars("abxy"), tag="B")
    cache.evict(2)
    assert [e.op for e in recorder.events] == ["insert", "insert", "evict"]
    assert [e.label for e in recorder.events] == ["A", "B", ""]
    assert len(recorder.events[-1].tree) == 3 and recorder.events[0].step == 1
    with pytest.raises(ValueError, match="only a RadixCache"):
        TreeRecorder(NoCache())


ops_st = st.lists(st.one_of(
    st.tuples(st.just("insert"), tokens_st), st.tuples(st.just("match"), tokens_st),
    st.tuples(st.just("again"), st.just([])), st.tuples(st.just("evict"), st.integers(0, 6)),
    st.tuples(st.just("lock"), st.just([])), st.tuples(st.just("unlock"), st.just([])),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops=ops_st)
def test_asking_the_same_query_again_equals_a_fresh_walk(ops) -> None:
    """A match given the previous query's very tuple may skip the walk; the tree must end up
    exactly as if it had walked: same answers, LRU stamps, locks and eviction order."""
    memo, fresh = RadixCache(), RadixCache()  # fresh is only ever asked with new tuples
    freed: tuple[list[object], list[object]] = ([], [])
    memo.on_evict, fresh.on_evict = freed[0].extend, freed[1].extend
    last, locked = (), []
    for op, arg in ops:
        if op == "insert":
            assert memo.insert(arg, list(arg)) == fresh.insert(arg, list(arg))
        elif op in ("match", "again"):
            last = last if op == "again" else tuple(arg)
            got, want = memo.match_prefix(last), fresh.match_prefix(list(last))
            assert (got.length, got.node.id, got.values) == (want.length, want.node.id,
                                                              want.values)
            locked.append((got.node, want.node))
        elif op == "evict":
            assert memo.evict(arg) == fresh.evict(arg)
        elif locked:
            a, b = locked.pop()
            if op == "lock" and not a.removed:
                memo.lock(a), fresh.lock(b)
            elif op == "unlock" and a.lock_ref > 0:
                memo.unlock(a), fresh.unlock(b)
        assert memo.snapshot() == fresh.snapshot()
        assert freed[0] == freed[1]
    assert memo.evict(10**6) == fresh.evict(10**6) and freed[0] == freed[1]


def test_many_touches_keep_the_eviction_heap_small() -> None:
    cache = RadixCache()
    for i in range(20):
        cache.insert([i, 1, 2])
    for _ in range(500):
        for i in range(20):
            cache.match_prefix([i, 1, 2])
    assert len(cache._heap) <= 2 * cache.n_nodes + 65
    assert cache.evict(60) == 60


def test_drawing_marks_split_inserted_locked_and_evicted_nodes() -> None:
    from minisrv.tokenizer import Tokenizer
    from minisrv.viz.radix import COLORS, TreeRecorder, event_caption, to_graphviz

    tok = Tokenizer()
    cache = RadixCache()
    recorder = TreeRecorder(cache)
    cache.insert(tok.encode("FR: Paris\nJP:"))
    node = cache.match_prefix(tok.encode("FR: Paris\nUS:"), tag="B").node
    cache.lock(node, tag="B")
    cache.insert(tok.encode("FR: Paris\nUS: New York"), tag="B")
    source = to_graphviz(recorder, tok).source  # coloured by the last event: the insert
    assert "US:␣New␣York" in source and "FR:␣Paris⏎" in source
    assert COLORS["inserted"] in source and "lock 1" in source
    split_event = recorder.events[1]
    assert COLORS["split"] in to_graphviz(split_event, tok).source
    assert event_caption(split_event).startswith("t=2 · B: match: matched 11 tokens")
    assert "insert: 0 tokens already cached" in event_caption(recorder.events[0])
    empty = RadixCache()
    listener = TreeRecorder(empty)
    empty.lock(empty.match_prefix(tok.encode("JP:"), tag="C").node, tag="C")
    # an empty tree: the captions say so rather than "matched 0 tokens", "0 tokens on the path"
    assert [event_caption(e).split(": ", 2)[-1] for e in listener.events] == [
        "no cached prefix", "only the root"]
    cache.unlock(node)
    cache.evict(100)
    ghosts = to_graphviz(recorder.events[-1], tok).source
    assert "(evicted)" in ghosts and "dashed" in ghosts
    assert "(evicted)" not in to_graphviz(cache.snapshot()).source  # a snapshot has no event
    ids = " ".join(str(t) for t in tok.encode("FR", bos=False))
    assert ids in to_graphviz(split_event).source  # without a tokenizer: the token ids


def test_a_bushy_tree_is_drawn_in_the_narrower_direction() -> None:
    pytest.importorskip("graphviz")
    from minisrv.viz.radix import _width_pt, to_graphviz
    from minisrv.viz.style import PAGE_WIDTH_IN

    small = RadixCache()
    small.insert([1, 2, 3])
    assert "rankdir=TB" in to_graphviz(small).source  # fits: top-down
    bushy = RadixCache()
    for branch in range(8):
        bushy.insert([0] + [100 + branch] * 12)
    drawn = to_graphviz(bushy)
    assert "rankdir=LR" in drawn.source
    assert _width_pt(drawn) <= PAGE_WIDTH_IN * 72


def test_the_event_explorer_holds_the_tree_after_every_event() -> None:
    from minisrv.tokenizer import Tokenizer
    from minisrv.viz.radix import TreeRecorder, event_explorer, event_numbers

    tok = Tokenizer()
    cache = RadixCache()
    recorder = TreeRecorder(cache)
    for word in ("abcde", "abcxy", "abfg"):
        cache.insert(tok.encode(word, bos=False), tag=word)
    node = cache.match_prefix(tok.encode("abcxz", bos=False), tag="q").node
    cache.lock(node, tag="q")
    events = recorder.events
    ex = event_explorer(events, tok)
    assert ex.default == {"event": len(events) - 1}  # the tree as it is now, like the drawing
    assert [ex.metrics(event=i) for i in range(len(events))] == [event_numbers(e)
                                                                 for e in events]
    now = ex.metrics(**ex.default)
    assert now["cached tokens"] == cache.total_size() == 9  # "ab" "c" "de" "x" "y" "fg"
    assert now["nodes"] == len(cache.snapshot()) - 1 == 6
    assert (now["op"], now["request"], now["locked nodes"]) == ("lock", "q", 3)
    assert ex.metrics(event=0) == {"op": "insert", "request": "abcde", "length": 0,
                                   "nodes": 1, "cached tokens": 5, "locked nodes": 0}
    assert event_explorer(events, tok, start=1).default == {"event": 1}
    with pytest.raises(ValueError, match="event index"):
        event_explorer(events, tok, start=len(events))
    with pytest.raises(ValueError, match="at least one"):
        event_explorer([], tok)


def test_a_smaller_chat_is_taken_from_a_larger_one_built_before(citylm) -> None:
    from minisrv.experiments.radix import chat_workload
    from minisrv.workloads import chat_sessions_workload

    model, tok = citylm
    built = {(3, 2): chat_sessions_workload(model, tok, 3, 2)}
    for sessions, turns in ((2, 1), (1, 2), (3, 2)):
        taken = chat_workload(model, tok, sessions, turns, built)
        assert taken == chat_sessions_workload(model, tok, sessions, turns)
    assert list(built) == [(3, 2)]  # nothing was built
    chat_workload(model, tok, 4, 1, built)  # more sessions than any built chat: built now
    assert set(built) == {(3, 2), (4, 1)}
    with pytest.raises(ValueError, match="sessions must be >= 1"):
        chat_workload(model, tok, 0, 1, built)


def test_the_chat_explorer_serves_every_state_as_the_run_alone(citylm) -> None:
    from minisrv.experiments.radix import chat_capacity_run
    from minisrv.viz.radix import chat_capacity_explorer

    model, tok = citylm
    built: dict = {}
    ex = chat_capacity_explorer(model, tok, capacity=90, sessions=3, turns=2, built=built,
                                capacities=(90, 400), session_counts=(1, 3))
    assert ex.default == {"capacity": 90, "sessions": 3}
    assert list(built) == [(3, 2)]  # one chat built; every state serves a part of it
    for capacity in (90, 400):
        for sessions in (1, 3):
            run = chat_capacity_run(model, tok, capacity, sessions, 2)
            state = ex.metrics(capacity=capacity, sessions=sessions)
            assert [state[c] for c in run.table.columns] == run.hit_rates
            assert state["requests checked"] == run.identical == 2 * sessions
    # a small pool evicts the other sessions' histories: fewer hits than a roomy one
    assert ex.metrics(capacity=90, sessions=3)["all turns"] < ex.metrics(
        capacity=400, sessions=3)["all turns"]


def test_cache_comparison_counts_outputs_as_alone_and_shows_the_hit_rate_in_percent(
        citylm) -> None:
    from minisrv.experiments.radix import cache_comparison
    from minisrv.workloads import parallel_sampling_workload, shared_prompt_workload

    model, tok = citylm
    workloads = {"shared": shared_prompt_workload(tok, n_users=4),
                 "parallel": parallel_sampling_workload(tok, n_samples=3, output_len=4)}
    table = cache_comparison(model, workloads, kv_capacity=2000, max_running=4)
    assert list(table["outputs as alone"]) == ["4/4", "3/3"]  # counts, not a boolean
    for name, row in table.iterrows():
        rate = float(row["hit rate"].rstrip("%")) / 100
        saved = row["prefilled, no cache"] - row["prefilled, radix"]
        assert abs(rate - saved / row["prompt tokens"]) < 1e-3, name  # one decimal of a %


def test_the_event_explorer_keeps_one_orientation_for_every_event(monkeypatch) -> None:
    """Small early trees fit top-down, the last bushy one does not: every frame is drawn left
    to right, so stepping through the events never flips the drawing (it did at event 57 of
    the RadixAttention chapter)."""
    from minisrv.tokenizer import Tokenizer
    from minisrv.viz import radix as rv

    tok = Tokenizer()
    cache = RadixCache()
    recorder = rv.TreeRecorder(cache)
    for word in ("ab", "ac", *(f"{c}: Paris, Lyon" for c in "DEFGHIJKLMNOP")):
        cache.insert(tok.encode(word, bos=False), tag=word)
    events = recorder.events
    assert "rankdir=TB" in rv.to_graphviz(events[1], tok).source  # alone it would be top-down
    assert "rankdir=LR" in rv.to_graphviz(events[-1], tok).source
    drawn: list[str] = []
    original = rv.to_graphviz

    def spy(*args, **kwargs):
        dot = original(*args, **kwargs)
        drawn.append(dot.graph_attr["rankdir"])
        return dot

    monkeypatch.setattr(rv, "to_graphviz", spy)
    rv.event_explorer(events, tok)
    frames = drawn[-len(events):]  # after the orientation probe, one drawing per frame
    assert len(drawn) > len(events) and set(frames) == {"LR"}
