"""The router's approximate tree and its routing rule, on hand-computed cases and against
a brute-force model of what each worker was sent."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisrv.router import POLICIES, ApproxTree, Router, common_prefix_length


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ----------------------------------------------------------------------------- the tree
def test_common_prefix_length_cases() -> None:
    assert common_prefix_length([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix_length([1, 2, 3], [1, 2]) == 2
    assert common_prefix_length([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length(list(range(1000)), [*range(777), -1]) == 777


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40))
def test_common_prefix_length_equals_loop(a: list[int], b: list[int]) -> None:
    assert common_prefix_length(a, b) == lcp(a, b)


def test_match_reports_partial_edges_and_holders() -> None:
    tree = ApproxTree(3)
    tree.insert([1, 2, 3, 4, 5], 0)  # "abcde" to worker 0
    tree.insert([1, 2, 3, 7, 8], 1)  # "abcxy" to worker 1: splits after "abc"
    tree.insert([1, 2, 6, 7], 2)  # "abfg" to worker 2: splits after "ab"
    assert tree.match([1, 2, 3, 7, 9]) == (4, (1,))  # "abcxz": 4 tokens, inside worker 1's edge
    assert tree.match([1, 2, 3]).length == 3
    assert tree.match([1, 2, 3]).workers == (1, 0)  # both hold "abc"; worker 1 most recent
    assert tree.match([1, 2]).workers == (2, 1, 0)
    assert tree.match([1, 2], order="first").workers == (0, 1, 2)  # in the order first sent
    tree.insert([1, 2, 3], 0)  # worker 0 again: now the most recent, and still the first
    assert tree.match([1, 2, 3]).workers == (0, 1) == tree.match([1, 2, 3], "first").workers
    assert tree.match([9]) == (0, ())
    with pytest.raises(ValueError, match="order must be 'recent' or 'first'"):
        tree.match([1], order="last")
    assert tree.match_worker([1, 2, 3, 4, 5], 2) == 2  # worker 2 holds only "ab" of it
    assert tree.sizes == [5, 5, 4]
    assert tree.nodes() == 5  # ab, c, de, xy, fg


def test_trim_drops_least_recent_leaves_per_worker() -> None:
    tree = ApproxTree(2, max_tree_size=100)
    tree.insert([1, 1, 1, 1], 0)  # oldest
    tree.insert([1, 1, 2, 2], 0)
    tree.insert([3, 3, 3], 0)
    tree.insert([1, 1, 1, 1], 1)  # worker 1 shares the first path
    assert tree.sizes == [9, 4]
    assert tree.trim(0, 7) == 2  # the leaf "11" of [1,1,1,1] is worker 0's oldest
    assert tree.sizes == [7, 4]
    assert tree.match_worker([1, 1, 1, 1], 0) == 2
    assert tree.match_worker([1, 1, 1, 1], 1) == 4  # worker 1 keeps its copy
    assert tree.trim(0, 3) == 4  # then [1,1,2,2]'s leaf, whose parent "11" becomes a leaf
    assert tree.sizes == [3, 4]
    assert tree.match_worker([3, 3, 3], 0) == 3
    assert tree.match([1, 1, 2, 2]) == (2, (1,))  # the "22" node, held by nobody, is gone
    assert tree.nodes() == 3  # 11 -> 11 (worker 1), and 333 (worker 0)


def test_insert_trims_to_max_tree_size() -> None:
    tree = ApproxTree(1, max_tree_size=10)
    for start in range(0, 40, 4):
        tree.insert(list(range(start, start + 4)), 0)
        assert tree.size(0) <= 10
    assert tree.match_worker([36, 37, 38, 39], 0) == 4  # the newest survives
    assert tree.match_worker([0, 1, 2, 3], 0) == 0


def test_tree_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="n_workers"):
        ApproxTree(0)
    with pytest.raises(ValueError, match="max_tree_size"):
        ApproxTree(2, max_tree_size=-1)
    tree = ApproxTree(2)
    with pytest.raises(ValueError, match="worker must be an int in 0..1"):
        tree.insert([1], 2)
    assert tree.sizes == [0, 0] and tree.nodes() == 0


prompts = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=8), min_size=1, max_size=25)


@settings(max_examples=150, deadline=None)
@given(prompts, st.lists(st.integers(0, 2), min_size=25, max_size=25))
def test_tree_matches_brute_force(sent: list[list[int]], workers: list[int]) -> None:
    """Without trimming, a worker's match is its longest common prefix with anything it was
    sent, the overall match the longest over workers, and its size the distinct tokens."""
    tree = ApproxTree(3)
    for tokens, w in zip(sent, workers, strict=False):
        tree.insert(tokens, w)
    history = list(zip(sent, workers, strict=False))
    for probe in [*sent, [0, 1, 2, 0], [2, 2, 2, 2, 2, 2]]:
        best = [max((lcp(p, probe) for p, w in history if w == k), default=0) for k in range(3)]
        for k in range(3):
            assert tree.match_worker(probe, k) == best[k]
        match = tree.match(probe)
        assert match.length == max(best)
        if match.length:
            assert set(match.workers) == {k for k in range(3) if best[k] == max(best)}
    for k in range(3):
        distinct = {tuple(p[:i]) for p, w in history if w == k for i in range(1, len(p) + 1)}
        assert tree.size(k) == len(distinct)


@settings(max_examples=150, deadline=None)
@given(prompts, st.lists(st.integers(0, 2), min_size=25, max_size=25), st.integers(0, 12))
def test_trimming_bounds_each_worker_and_keeps_the_newest(
    sent: list[list[int]], workers: list[int], limit: int
) -> None:
    tree = ApproxTree(3, max_tree_size=limit)
    for tokens, w in zip(sent, workers, strict=False):
        tree.insert(tokens, w)
        assert tree.size(w) <= limit
        # what was just sent survives, as far as the limit allows (LRU keeps the newest)
        assert tree.match_worker(tokens, w) == min(len(tokens), limit) if len(tokens) <= limit \
            else tree.match_worker(tokens, w) <= limit
    for k in range(3):  # a trimmed worker holds a subset of what it was sent
        for probe in sent:
            full = max((lcp(p, probe) for p, w in zip(sent, workers, strict=False) if w == k),
                       default=0)
            assert tree.match_worker(probe, k) <= full


# ----------------------------------------------------------------------------- the rule
def test_round_robin_random_and_least_load() -> None:
    rr = Router(3, "round-robin")
    assert [rr.route([1]) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert rr.loads == [2, 2, 1] and rr.decisions["policy"] == 5
    ll = Router(3, "least-load")
    assert [ll.route([1]) for _ in range(3)] == [0, 1, 2]
    ll.finish(1)
    assert ll.route([7]) == 1
    a, b = Router(4, "random", seed=3), Router(4, "random", seed=3)
    picks = [a.route([i]) for i in range(30)]
    assert picks == [b.route([i]) for i in range(30)]
    assert len(set(picks)) > 1


def test_cache_branch_follows_the_match() -> None:
    r = Router(2)
    assert r.route([1, 1, 1, 1, 5]) == 0 and r.last_branch == "miss"  # all empty: worker 0
    assert r.route([2, 2, 2, 2, 5]) == 1 and r.last_branch == "miss"  # least loaded
    assert r.route([1, 1, 1, 1, 6]) == 0 and r.last_branch == "cache"  # 4/5 = 0.8 > 0.5
    assert r.route([2, 2, 2, 2, 6]) == 1 and r.last_branch == "cache"
    assert r.loads == [2, 2]


def test_match_at_threshold_is_a_miss() -> None:
    r = Router(2, cache_threshold=0.5)
    r.route([1, 1, 8, 8])  # worker 0
    r.route([3])  # worker 1 (least loaded)
    r.finish(1)
    r.route([4])  # loads [1, 0] -> worker 1
    # [1, 1, 9, 9] matches 2 of 4 = 0.5, not > 0.5: the least-loaded worker, 1 (load 1 vs 1,
    # then the smaller tree: worker 0 holds 4 tokens, worker 1 two)
    assert r.route([1, 1, 9, 9]) == 1 and r.last_branch == "miss"
    r2 = Router(2, cache_threshold=0.49)
    r2.route([1, 1, 8, 8])
    r2.route([3])
    assert r2.route([1, 1, 9, 9]) == 0 and r2.last_branch == "cache"


def test_a_router_reading_the_caches_follows_what_they_hold_not_what_it_sent() -> None:
    r = Router(3, match_source="caches")
    prompt = [1, 1, 1, 1, 5]
    # sent nothing yet, but workers 1 and 2 hold four tokens: the less loaded of the two
    r.loads[1] = 2
    assert r.route(prompt, cached=[0, 4, 4]) == 2 and r.last_branch == "cache"
    # the tree now says worker 2; the caches say worker 0 holds more (worker 2 evicted it)
    assert r.route(prompt, cached=[4, 0, 0]) == 0 and r.last_branch == "cache"
    # 2 of 5 is under the threshold: a miss, to the least-loaded worker
    r.finish(2)
    assert r.route(prompt, cached=[2, 0, 0]) == 2 and r.last_branch == "miss"
    assert r.loads == [1, 2, 1] and r.decisions == {"cache": 2, "miss": 1}
    r.mark_down(0)  # a dead worker's cache counts for nothing
    assert r.route(prompt, cached=[5, 4, 0]) == 1 and r.last_branch == "cache"
    with pytest.raises(ValueError, match="needs cached="):
        r.route(prompt)
    with pytest.raises(ValueError, match="needs cached="):
        r.route(prompt, cached=[0, 6, 0])  # more than the prompt
    with pytest.raises(ValueError, match="needs cached="):
        r.reroute(prompt, 1, cached=[0, 0])
    assert r.loads == [1, 3, 1]
    assert Router(2, "round-robin", match_source="caches").route(prompt) == 0  # not read


def test_a_miss_goes_to_the_least_loaded_worker_not_the_smallest_tree() -> None:
    """sgl-model-gateway's rule (the renamed sgl-router): a miss goes to the least-loaded
    worker. sgl-router before it sent a miss to the smallest approximate tree
    (``get_smallest_tenant``), which could pick a busy worker that had only been sent short
    prompts; here worker 0 is busier with the smaller tree, and the miss goes to worker 1."""
    r = Router(2, balance_abs_threshold=100, balance_rel_threshold=10.0)  # never balances
    r.route([1] * 40)  # worker 0 (both empty): a long prompt
    r.route([2])  # worker 1: least loaded
    r.route([3])  # loads [1, 1], worker 1's tree is smaller: worker 1
    r.route([4])  # loads [1, 2]: worker 0
    r.finish(1)
    r.finish(1)
    r.route([5] * 40)  # loads [2, 0]: worker 1 now holds the larger tree
    assert r.loads == [2, 1] and r.tree.sizes[0] < r.tree.sizes[1]
    assert r.route([7, 7, 7]) == 1 and r.last_branch == "miss"


def test_the_older_miss_rule_picks_the_smallest_tree() -> None:
    """``miss_rule="smallest-tree"``: sgl-router's ``get_smallest_tenant``. The run of the
    test above, whose last miss then goes to busy worker 0 (2 in flight, the smaller tree);
    everything else is the same rule, and the choice among equal trees is the least loaded."""
    r = Router(2, balance_abs_threshold=100, balance_rel_threshold=10.0,
               miss_rule="smallest-tree")
    assert r.route([1] * 40) == 0  # both empty
    assert r.route([2]) == 1  # worker 1's tree is empty
    assert r.route([3]) == 1  # 1 token against 40
    assert r.route([4]) == 1  # 2 against 40: loads now [1, 3]
    assert r.route([1] * 40 + [9]) == 0 and r.last_branch == "cache"  # 40/41 > 0.5
    r.finish(1)
    r.finish(1)
    r.route([5] * 40)  # worker 1 (3 tokens against 41): worker 1 now holds the larger tree
    assert r.loads == [2, 2] and r.tree.sizes[0] < r.tree.sizes[1]
    r.finish(1)
    assert r.route([7, 7, 7]) == 0 and r.last_branch == "miss"  # loads [2, 1]: still 0
    even = Router(2, miss_rule="smallest-tree")
    even.route([1, 2])
    even.route([3, 4])  # worker 1, whose tree is empty: trees [2, 2], loads [1, 1]
    even.finish(0)
    assert even.route([5, 6]) == 0  # equal trees, worker 0 less loaded
    with pytest.raises(ValueError, match="unknown miss_rule 'random'; supported: least-load"):
        Router(2, miss_rule="random")


def test_the_first_holder_rule_sends_a_balanced_group_back() -> None:
    """The chapter's hand example: group A's fifth request is balanced onto worker 1; the
    next A goes to worker 1 under minisrv's rule and back to worker 0 under the gateway's."""
    picks = {}
    for rule in ("most-recent", "first-holder"):
        router = Router(2, balance_abs_threshold=2, balance_rel_threshold=1.5, match_rule=rule)
        router.route([2, 2, 2, 2, 5])  # group B first: worker 0
        steps = [router.route([1, 1, 1, 1, 6 + i]) for i in range(6)]  # group A
        picks[rule] = (steps, router.last_branch)
    assert picks["most-recent"][0][:5] == picks["first-holder"][0][:5]
    assert picks["most-recent"][0][4] != picks["most-recent"][0][0]  # the balanced one
    assert picks["most-recent"] == (picks["most-recent"][0][:5] + [picks["most-recent"][0][4]],
                                    "cache")
    assert picks["first-holder"] == (picks["first-holder"][0][:5] + [picks["first-holder"][0][0]],
                                     "cache")


def test_balance_branch_needs_both_thresholds() -> None:
    r = Router(2, balance_abs_threshold=2, balance_rel_threshold=1.5)
    for _ in range(3):
        assert r.route([1, 1, 1]) == 0  # the same prompt sticks to worker 0 ...
    r.route([2])  # worker 1 (miss, least loaded): loads [3, 1], diff 2, not > 2
    assert r.route([1, 1, 1]) == 0 and r.last_branch == "cache"  # loads [4, 1]: diff 3 > 2
    assert r.route([1, 1, 1]) == 1 and r.last_branch == "balance"  # and 4 > 1 * 1.5
    # loads [4, 2]: the absolute gap is only 2 -> cache again; the balanced request made
    # worker 1 the most recent holder of [1, 1, 1], so the group now follows it there
    assert r.route([1, 1, 1]) == 1 and r.last_branch == "cache"
    rel = Router(2, balance_abs_threshold=0, balance_rel_threshold=3.0)
    assert rel.route([6]) == 0 and rel.last_branch == "miss"
    assert rel.route([5, 5]) == 1 and rel.last_branch == "balance"  # [1, 0]: 1 > 0 * 3
    for loads in ([1, 1], [1, 2], [1, 3]):  # not 3x apart: the match decides
        assert rel.loads == loads
        assert rel.route([5, 5]) == 1 and rel.last_branch == "cache"
    assert rel.route([5, 5]) == 0 and rel.last_branch == "balance"  # [1, 4]: 4 > 1 * 3


def test_every_request_is_inserted_under_its_worker() -> None:
    for policy in POLICIES:
        r = Router(3, policy)
        picks = [(r.route([i, i, i]), i) for i in range(6)]
        for w, i in picks:
            assert r.tree.match_worker([i, i, i], w) == 3
        assert sum(r.loads) == 6 == sum(r.routed)


def test_router_rejects_bad_arguments_and_stays_intact() -> None:
    with pytest.raises(ValueError, match="unknown policy 'fastest'; supported: round-robin"):
        Router(2, "fastest")
    with pytest.raises(ValueError, match="cache_threshold"):
        Router(2, cache_threshold=1.5)
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        Router(2, balance_rel_threshold=-1)
    with pytest.raises(ValueError, match="n_workers"):
        Router(0)
    with pytest.raises(ValueError, match="unknown match_rule 'last'; supported: most-recent"):
        Router(2, match_rule="last")
    with pytest.raises(ValueError, match="unknown match_source 'events'; supported: sent"):
        Router(2, match_source="events")
    r = Router(2)
    with pytest.raises(ValueError, match="no request in flight"):
        r.finish(0)
    with pytest.raises(ValueError, match="worker must be an int in 0..1"):
        r.finish(2)
    with pytest.raises(ValueError, match="sequence of token ids"):
        r.route("FR:")
    assert r.loads == [0, 0] and r.tree.nodes() == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=6), st.booleans()),
                min_size=1, max_size=40),
       st.integers(0, 3), st.sampled_from([1.0, 1.5, 3.0]), st.sampled_from([0.0, 0.5, 0.9]),
       st.sampled_from(["least-load", "smallest-tree"]),
       st.sampled_from(["most-recent", "first-holder"]))
def test_every_decision_follows_the_rule(ops, abs_t: int, rel_t: float, cache_t: float,
                                         miss_rule: str, match_rule: str) -> None:
    """Against an independent statement of SGLang's rule, at every step of a random run of
    routes and completions, with either miss rule and either match rule."""
    r = Router(3, balance_abs_threshold=abs_t, balance_rel_threshold=rel_t,
               cache_threshold=cache_t, miss_rule=miss_rule, match_rule=match_rule)
    sent: list[tuple[list[int], int]] = []
    for tokens, finish in ops:
        if finish and any(r.loads):
            r.finish(max(range(3), key=r.loads.__getitem__))
            continue
        loads, sizes = list(r.loads), r.tree.sizes
        w = r.route(tokens)
        high, low = max(loads), min(loads)
        best = [max((lcp(p, tokens) for p, k in sent if k == j), default=0) for j in range(3)]
        least = min(range(3), key=lambda j: (loads[j], sizes[j], j))
        if high - low > abs_t and high > low * rel_t:
            assert (w, r.last_branch) == (least, "balance")
        elif max(best) / len(tokens) > cache_t:
            assert r.last_branch == "cache" and best[w] == max(best)
            # the holder most recently (or first) sent the matched prefix
            senders = [i for i, (p, k) in enumerate(sent) if lcp(p, tokens) >= max(best)]
            pick = max(senders) if match_rule == "most-recent" else min(senders)
            assert w == sent[pick][1]
        else:
            smallest = min(range(3), key=lambda j: (sizes[j], loads[j], j))
            assert (w, r.last_branch) == (least if miss_rule == "least-load" else smallest,
                                          "miss")
        assert r.loads[w] == loads[w] + 1
        sent.append((tokens, w))
