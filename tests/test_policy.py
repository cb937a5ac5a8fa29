"""The waiting-queue policies: each rule on hand-made trees, then properties on random ones.

Oracles are independent of the implementation: matched lengths come from the tree's cached
sequences (longest common prefix), the DFS order from a recursive walk of the whole tree (as
SGLang writes it), the in-batch set from pairwise common prefixes, the optimum from a
token-by-token trie.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisrv.kv import NoCache, RadixCache, TreeNode
from minisrv.scheduler.policy import (
    CACHE_AWARE,
    IN_BATCH_CHECK_THRESHOLD,
    IN_BATCH_DEPRIORITIZE_THRESHOLD,
    POLICIES,
    WAITING_QUEUE_PREFIX_MATCH_MAX,
    PriorityResult,
    calc_priority,
    default_in_batch_check,
    distinct_prefix_tokens,
    optimal_hit_rate,
)
from minisrv.workloads import prefix_forest_workload


def tree_of(*sequences: list[int]) -> RadixCache:
    tree = RadixCache()
    for seq in sequences:
        tree.insert(seq)
    return tree


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ----------------------------------------------------------------------------- LPM
def test_lpm_sorts_longest_match_first_and_ties_keep_queue_order() -> None:
    tree = tree_of([1, 2, 3, 4, 5])
    prompts = [[1, 2, 9, 9], [1, 2, 3, 7], [1, 2, 8, 8], [5, 5], [1, 2, 3, 4, 6]]
    result = calc_priority("lpm", tree, prompts)
    assert result == PriorityResult([4, 1, 0, 2, 3], [], [2, 3, 2, 0, 4])


def test_lpm_caps_a_match_at_prompt_length_minus_one() -> None:
    tree = tree_of([1, 2, 3, 4])
    # Uncapped, both match 3 and the tie keeps queue order; capped, [1,2,3] counts 2.
    result = calc_priority("lpm", tree, [[1, 2, 3], [1, 2, 3, 9]])
    assert result.matched == [2, 3] and result.order == [1, 0]
    assert calc_priority("lpm", tree, [[1, 2, 3, 4]]).matched == [3]


def test_lpm_past_128_waiting_is_fcfs_without_matching_or_check() -> None:
    shared = list(range(100, 140))  # 40 tokens: the in-batch check would defer repeats
    def queue(n: int) -> list[list[int]]:
        return [shared + [i] for i in range(n - 1)] + [[7, 7, 7, 7, 1]]
    tree = tree_of([7, 7, 7, 7])
    at_max = calc_priority("lpm", tree, queue(WAITING_QUEUE_PREFIX_MATCH_MAX))
    assert at_max.order[0] == WAITING_QUEUE_PREFIX_MATCH_MAX - 1  # matched 4: first
    assert len(at_max.deprioritized) == WAITING_QUEUE_PREFIX_MATCH_MAX - 2
    clock, nodes = tree.clock, tree.n_nodes
    past = calc_priority("lpm", tree, queue(WAITING_QUEUE_PREFIX_MATCH_MAX + 1))
    n = WAITING_QUEUE_PREFIX_MATCH_MAX + 1
    assert past == PriorityResult(list(range(n)), [], [0] * n)
    assert (tree.clock, tree.n_nodes) == (clock, nodes)  # the tree was not consulted
    # DFS-weight never falls back.
    dfs = calc_priority("dfs-weight", tree, queue(n))
    assert dfs.order[0] == n - 1 and dfs.matched[-1] == 4


# ------------------------------------------------------------------------------ HRRN
def test_hrrn_ranks_tokens_waited_over_tokens_left_and_ties_keep_queue_order() -> None:
    tree = tree_of([1, 2, 3, 4, 5])
    prompts = [[1, 2, 3, 9],        # matches 3: 1 token left, waited 0 -> ratio 0
               [9, 9, 9, 9, 9],     # cold: 5 left, waited 100 -> 20
               [1, 2, 3, 4, 5, 6],  # matches 5: 1 left, waited 10 -> 10
               [8, 8]]              # cold: 2 left, waited 0 -> 0 (ties with 0: in order)
    result = calc_priority("hrrn", tree, prompts, waited_tokens=[0, 100, 10, 0])
    assert result == PriorityResult([1, 2, 0, 3], [], [3, 0, 5, 0])
    # Nobody has waited (no prefill since they arrived): queue order, as in SGLang's sort
    # (which breaks the ties by rid).
    assert calc_priority("hrrn", tree, prompts, waited_tokens=[0] * 4).order == [0, 1, 2, 3]


def test_hrrn_lets_a_cold_request_overtake_once_it_has_waited_long_enough() -> None:
    tree = tree_of(list(range(100, 140)))
    warm, cold = [*range(100, 140), 1], [7] * 41  # 1 token left against 41
    # The warm one waited 40 prefill tokens: ratio 40 / 1. The cold one passes it past
    # 40 x 41 tokens waited (at exactly 1,640 they tie and the queue order stands).
    for waited, first in ((40, 0), (40 * 41, 0), (40 * 41 + 1, 1)):
        order = calc_priority("hrrn", tree, [warm, cold], waited_tokens=[40, waited]).order
        assert order[0] == first, waited


def test_hrrn_past_128_waiting_is_fcfs_without_matching() -> None:
    tree = tree_of([7, 7, 7, 7])
    n = WAITING_QUEUE_PREFIX_MATCH_MAX + 1
    queue = [[i, 1] for i in range(n - 1)] + [[7, 7, 7, 7, 1]]
    clock = tree.clock
    past = calc_priority("hrrn", tree, queue, waited_tokens=[0] * (n - 1) + [500])
    assert past == PriorityResult(list(range(n)), [], [0] * n)
    assert tree.clock == clock  # the tree was not consulted


def test_hrrn_needs_one_non_negative_wait_per_request() -> None:
    tree = tree_of([1, 2, 3])
    with pytest.raises(ValueError, match="hrrn' needs waited_tokens, one per prompt"):
        calc_priority("hrrn", tree, [[1], [2]])
    with pytest.raises(ValueError, match="hrrn' needs waited_tokens, one per prompt"):
        calc_priority("hrrn", tree, [[1], [2]], waited_tokens=[1])
    with pytest.raises(ValueError, match=">= 0"):
        calc_priority("hrrn", tree, [[1]], waited_tokens=[-1])


# ------------------------------------------------------------------------- DFS-weight
def hand_tree() -> RadixCache:
    """root -> (1,1,1,1) -> {(2,2), (3,3)}; root -> (5,5,5). (1,1,1,1) entered first."""
    return tree_of([1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 3, 3], [5, 5, 5])


HAND_QUEUE = [
    [5, 5, 5, 9],  # 0: at (5,5,5)
    [1, 1, 1, 1, 3, 3, 7],  # 1: at (3,3)
    [1, 1, 1, 1, 2, 2, 8],  # 2: at (2,2)
    [1, 1, 1, 1, 4],  # 3: at (1,1,1,1)
    [1, 1, 1, 1, 3, 3, 6],  # 4: at (3,3)
    [8],  # 5: at the root
    [5, 5, 5, 1],  # 6: at (5,5,5)
]


def test_dfs_weight_order_on_a_hand_computed_tree() -> None:
    # Weights: (2,2) 1, (3,3) 2, (1,1,1,1) 1 + 1 + 2 = 4, (5,5,5) 2. From the root: the
    # heavier (1,1,1,1) subtree, inside it (3,3) before (2,2), then (1,1,1,1)'s own request;
    # then (5,5,5); the root's own request last.
    result = calc_priority("dfs-weight", hand_tree(), HAND_QUEUE)
    assert result.order == [1, 4, 2, 3, 0, 6, 5]
    assert result.matched == [3, 6, 6, 4, 6, 0, 3]
    # LPM on the same queue interleaves the two (1,1,1,1) branches by match length.
    assert calc_priority("lpm", hand_tree(), HAND_QUEUE).order == [1, 2, 4, 3, 0, 6, 5]


def test_dfs_weight_equal_weights_follow_the_order_branches_entered_the_tree() -> None:
    tree = tree_of([4, 4, 4], [3, 3, 3], [2, 2, 2])
    result = calc_priority("dfs-weight", tree, [[2, 2, 2, 0], [3, 3, 3, 0], [4, 4, 4, 0]])
    assert result.order == [2, 1, 0]


def test_dfs_weight_places_a_match_that_ends_inside_an_edge_at_the_split_node() -> None:
    tree = hand_tree()
    # [1, 1, 9] splits (1,1,1,1) into (1,1) -> (1,1): the new node weighs 1 + 4 = 5.
    queue = [[5, 5, 5, 9], [5, 5, 5, 8], [1, 1, 9], [1, 1, 1, 1, 2, 2, 0]]
    assert calc_priority("dfs-weight", tree, queue).order == [3, 2, 0, 1]


def test_dfs_weight_computes_the_in_batch_set_but_orders_without_it() -> None:
    head = list(range(10, 50))
    queue = [head + [1], head + [2], [3, 3]]
    result = calc_priority("dfs-weight", RadixCache(), queue)
    assert result.deprioritized == [1] and result.order == [0, 1, 2]
    assert calc_priority("dfs-weight", RadixCache(), queue,
                         in_batch_prefix_check=False).deprioritized == []


# -------------------------------------------------------------------- in-batch check
@pytest.mark.parametrize("shared, deferred", [(IN_BATCH_DEPRIORITIZE_THRESHOLD, True),
                                              (IN_BATCH_DEPRIORITIZE_THRESHOLD - 1, False)])
def test_in_batch_check_defers_at_32_shared_tokens(shared: int, deferred: bool) -> None:
    head = list(range(100, 100 + shared))
    queue = [head + [1, 1], head + [2, 2], [9, 9], head + [3, 3]]
    for policy in ("lpm", "fcfs"):
        result = calc_priority(policy, RadixCache(), queue, in_batch_prefix_check=True)
        assert result.deprioritized == ([1, 3] if deferred else [])
        assert result.order == ([0, 2, 1, 3] if deferred else [0, 1, 2, 3])


def test_in_batch_check_sorts_deferred_behind_shorter_matches_in_queue_order() -> None:
    head = list(range(100, 140))
    tree = tree_of([7, 7, 7])
    queue = [head + [1], head + [2], [7, 7, 7, 1], head + [3], [5]]
    result = calc_priority("lpm", tree, queue)
    assert result.deprioritized == [1, 3] and result.order == [2, 0, 4, 1, 3]
    assert calc_priority("fcfs", tree, queue, in_batch_prefix_check=True).order == [
        0, 2, 4, 1, 3]
    off = calc_priority("lpm", tree_of([7, 7, 7]), queue, in_batch_prefix_check=False)
    assert off.deprioritized == [] and off.order == [2, 0, 1, 3, 4]


@pytest.mark.parametrize("cached, checked", [(IN_BATCH_CHECK_THRESHOLD, True),
                                             (IN_BATCH_CHECK_THRESHOLD + 1, False)])
def test_in_batch_check_applies_to_requests_with_at_most_32_cached(cached: int,
                                                                   checked: bool) -> None:
    head = list(range(100, 140))
    tree = tree_of(head[:cached])
    result = calc_priority("lpm", tree, [head + [1], head + [2]])
    assert result.deprioritized == ([1] if checked else [])


def test_in_batch_check_uses_the_real_not_the_capped_match() -> None:
    prompt = list(range(100, 100 + IN_BATCH_CHECK_THRESHOLD + 1))  # 33 tokens, all cached
    result = calc_priority("lpm", tree_of(prompt), [prompt, prompt])
    assert result.matched == [32, 32] and result.deprioritized == []  # real 33 > 32


def test_fcfs_defaults_to_no_check_and_matches_nothing() -> None:
    head = list(range(100, 140))
    tree = tree_of(head)
    result = calc_priority("fcfs", tree, [head + [1], head + [2], [3]])
    assert result == PriorityResult([0, 1, 2], [], [0, 0, 0])
    assert default_in_batch_check("lpm") and default_in_batch_check("dfs-weight")
    assert not any(default_in_batch_check(p) for p in ("fcfs", "lof", "random"))


# ----------------------------------------------------------------- LOF, random, no cache
def test_lof_puts_longest_outputs_first_stably() -> None:
    result = calc_priority("lof", RadixCache(), [[1]] * 5, max_new_tokens=[5, 9, 5, 20, 9])
    assert result.order == [3, 1, 4, 0, 2]


def test_random_is_a_reproducible_permutation() -> None:
    queue = [[i] for i in range(30)]
    a = calc_priority("random", RadixCache(), queue, seed=3).order
    assert sorted(a) == list(range(30)) and a != list(range(30))
    assert calc_priority("random", RadixCache(), queue, seed=3).order == a
    assert calc_priority("random", RadixCache(), queue, seed=4).order != a
    rng = random.Random(3)
    assert calc_priority("random", RadixCache(), queue, seed=rng).order == a
    assert calc_priority("random", RadixCache(), queue, seed=rng).order != a  # drawn on


@pytest.mark.parametrize("policy", sorted(CACHE_AWARE))
def test_cache_aware_policies_without_a_cache_are_fcfs(policy: str) -> None:
    head = list(range(100, 140))
    result = calc_priority(policy, NoCache(), [head + [1], head + [2], [1, 2]],
                           waited_tokens=[0, 0, 90])
    assert result == PriorityResult([0, 1, 2], [], [0, 0, 0])


def test_bad_input_raises_value_error_and_leaves_the_tree_alone() -> None:
    tree = tree_of([1, 2, 3])
    clock = tree.clock
    with pytest.raises(ValueError, match="unknown policy 'sjf'.*fcfs, lpm"):
        calc_priority("sjf", tree, [[1]])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        calc_priority("lpm", tree, [[1], []])
    with pytest.raises(ValueError, match="max_new_tokens, one per prompt"):
        calc_priority("lof", tree, [[1], [2]], max_new_tokens=[3])
    with pytest.raises(ValueError, match="in-batch prefix check works with"):
        calc_priority("random", tree, [[1]], in_batch_prefix_check=True)
    assert tree.clock == clock


# ------------------------------------------------------------------------- properties
BLOCKS = [[b * 100 + i for i in range(17)] for b in range(4)]  # 17-token runs: long overlaps


@st.composite
def block_prompts(draw, min_size: int = 0, max_size: int = 12) -> list[list[int]]:
    """Prompts made of a few 17-token blocks plus a tail, so they share 32+ tokens often."""
    n = draw(st.integers(min_size, max_size))
    out = []
    for _ in range(n):
        blocks = draw(st.lists(st.integers(0, 3), max_size=3))
        tail = draw(st.lists(st.integers(0, 3), max_size=3))
        prompt = [t for b in blocks for t in BLOCKS[b]][: draw(st.integers(0, 51))] + tail
        out.append(prompt or [0])
    return out


def reference_dfs(tree: RadixCache, nodes: list[TreeNode]) -> list[int]:
    """SGLang's formulation: weights over the whole tree, then a recursive walk."""
    weight: dict[int, int] = {}

    def calc(node: TreeNode) -> int:
        w = sum(1 for n in nodes if n is node) + sum(calc(c) for c in node.children.values())
        weight[id(node)] = w
        return w

    def walk(node: TreeNode, out: list[int]) -> None:
        for child in sorted(node.children.values(), key=lambda c: -weight[id(c)]):
            walk(child, out)
        out.extend(i for i, n in enumerate(nodes) if n is node)

    calc(tree.root)
    out: list[int] = []
    walk(tree.root, out)
    return out


@settings(max_examples=150, deadline=None)
@given(cached=block_prompts(), queue=block_prompts(min_size=1),
       policy=st.sampled_from(POLICIES), check=st.sampled_from([None, True, False]),
       seed=st.integers(0, 3))
def test_every_round_is_a_permutation_and_follows_its_rule(cached, queue, policy, check,
                                                           seed) -> None:
    tree = tree_of(*cached)
    sequences = tree.cached_sequences()
    if policy in ("lof", "random") and check:
        check = None
    outs = [len(p) % 3 for p in queue]
    waits = [(7 * i + seed) % 5 * 10 for i in range(len(queue))]
    result = calc_priority(policy, tree, queue, in_batch_prefix_check=check, seed=seed,
                           max_new_tokens=outs, waited_tokens=waits)
    n = len(queue)
    assert sorted(result.order) == list(range(n))
    assert set(result.deprioritized) <= set(range(n))
    assert result.deprioritized == sorted(result.deprioritized)
    real = [max((lcp(p, s) for s in sequences), default=0) for p in queue]
    use_check = check if check is not None else policy in CACHE_AWARE
    if policy not in CACHE_AWARE and not use_check:
        assert result.matched == [0] * n and result.deprioritized == []
    else:
        assert result.matched == [min(r, len(p) - 1) for r, p in zip(real, queue)]
    if use_check:  # oracle: pairwise prefixes with the earlier checked, kept requests
        kept: list[list[int]] = []
        expect = []
        for i, p in enumerate(queue):
            if real[i] > IN_BATCH_CHECK_THRESHOLD:
                continue
            if max((lcp(p, k) for k in kept), default=0) >= IN_BATCH_DEPRIORITIZE_THRESHOLD:
                expect.append(i)
            else:
                kept.append(p)
        assert result.deprioritized == expect
    if policy in ("lpm", "fcfs"):
        deferred = set(result.deprioritized)
        # deferred requests keep queue order among themselves (SGLang's key: inf)
        key = [(i in deferred, 0 if i in deferred or policy == "fcfs"
                else -result.matched[i], i) for i in range(n)]
        assert result.order == sorted(range(n), key=lambda i: key[i])
    if policy == "hrrn":  # highest waited / uncached first, deferred last in queue order
        deferred = set(result.deprioritized)
        key = [(i in deferred, 0 if i in deferred
                else -waits[i] / (len(queue[i]) - result.matched[i]), i) for i in range(n)]
        assert result.order == sorted(range(n), key=lambda i: key[i])
    if policy == "dfs-weight":
        nodes = [tree.match_prefix(p).node for p in queue]  # the tree is split already
        assert result.order == reference_dfs(tree, nodes)
    if policy == "lof":
        assert result.order == sorted(range(n), key=lambda i: -outs[i])


def trie_count(prompts: list[list[int]]) -> int:
    """Distinct prefix tokens, one dict node per token."""
    root: dict = {}
    count = 0
    for prompt in prompts:
        node = root
        for t in prompt:
            if t not in node:
                node[t] = {}
                count += 1
            node = node[t]
    return count


@settings(max_examples=100, deadline=None)
@given(prompts=block_prompts(min_size=1))
def test_optimal_hit_rate_matches_a_token_trie(prompts) -> None:
    total = sum(map(len, prompts))
    assert distinct_prefix_tokens(prompts) == trie_count(prompts)
    assert optimal_hit_rate(prompts) == pytest.approx(1 - trie_count(prompts) / total)


def test_optimal_hit_rate_of_the_lecture_figures() -> None:
    forest = prefix_forest_workload()  # 4 x 4 x 8 prompts of 80 tokens
    assert (len(forest), sum(forest.prompt_lens)) == (128, 10240)
    assert distinct_prefix_tokens(forest.prompts) == 4 * 59 + 16 * 9 + 128 * 12 == 1916
    assert f"{optimal_hit_rate(forest.prompts):.1%}" == "81.3%"
    exercise = prefix_forest_workload((3, 5), (100, 20))  # the lecture's exercise 8
    assert optimal_hit_rate(exercise.prompts) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="at least one prompt token"):
        optimal_hit_rate([])


def serve_one_at_a_time(prompts: list[list[int]], policy: str, capacity: int,
                        check: bool | None = None) -> float:
    """Each round: order the queue, serve its first request (match, count hits, insert),
    then evict least-recently-used leaves down to ``capacity`` tokens. Returns the hit rate."""
    tree = RadixCache()
    queue = list(prompts)
    hits = 0
    while queue:
        first = calc_priority(policy, tree, queue, in_batch_prefix_check=check,
                              seed=len(queue)).order[0]
        prompt = queue.pop(first)
        hits += tree.match_prefix(prompt).length
        tree.insert(prompt)
        if tree.total_size() > capacity:
            tree.evict(tree.total_size() - capacity)
        assert tree.total_size() <= capacity
    return hits / sum(map(len, prompts))


forest_st = st.tuples(
    st.lists(st.integers(1, 4), min_size=1, max_size=3),  # widths per level
    st.lists(st.integers(1, 40), min_size=3, max_size=3),  # tokens per level
    st.integers(0, 10_000), st.integers(0, 3), st.sampled_from([6, 1000]))


@settings(max_examples=60, deadline=None)
@given(forest=forest_st)
def test_lpm_and_dfs_weight_reach_the_optimum_with_a_cache_of_the_longest_prompt(forest):
    shape, lengths, seed, extra, vocab = forest
    work = prefix_forest_workload(shape, lengths[: len(shape)], vocab_size=vocab, seed=seed)
    prompts = work.prompts
    capacity = max(map(len, prompts)) + extra
    best = optimal_hit_rate(prompts)
    for policy, check in (("lpm", True), ("lpm", False), ("dfs-weight", None)):
        assert serve_one_at_a_time(prompts, policy, capacity, check) == pytest.approx(best)
    for policy in ("fcfs", "random"):  # never above the bound
        assert serve_one_at_a_time(prompts, policy, capacity) <= best + 1e-12


@settings(max_examples=100, deadline=None)
@given(prompts=block_prompts(min_size=1))
def test_lpm_and_dfs_weight_reach_the_optimum_on_any_prefix_free_prompts(prompts) -> None:
    # A prompt that is a prefix of another (or a duplicate) is different: the match is
    # capped at len - 1, so LPM does not favour it; real prompts end in distinct questions.
    prompts = [p + [1000 + i] for i, p in enumerate(prompts)]
    capacity = max(map(len, prompts))
    best = optimal_hit_rate(prompts)
    for policy, check in (("lpm", True), ("lpm", False), ("dfs-weight", None)):
        assert serve_one_at_a_time(prompts, policy, capacity, check) == pytest.approx(best)


def test_random_order_falls_short_of_the_optimum_with_a_small_cache() -> None:
    prompts = prefix_forest_workload((4, 4, 8), (59, 9, 12), seed=1).prompts
    best = optimal_hit_rate(prompts)
    assert serve_one_at_a_time(prompts, "lpm", 80) == pytest.approx(best)
    assert serve_one_at_a_time(prompts, "random", 80) < best - 0.2
    assert serve_one_at_a_time(prompts, "fcfs", 80) < best - 0.2


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_a_round_copies_no_waiting_request_s_tokens(policy: str) -> None:
    """``QueuePolicy`` matches each waiting request by the tuple the request keeps
    (``Req.all_tokens``): two rounds over 100 waiting requests hand the tree the very same
    objects, so a round builds no token list. The order is that of ``calc_priority``."""
    from collections import deque

    from minisrv.request import Req
    from minisrv.scheduler.policy import QueuePolicy

    rng = random.Random(3)
    reqs = [Req(i, [rng.randrange(3) for _ in range(40)], output=[7] * (i % 3))
            for i in range(100)]
    tree = tree_of(*(r.prompt[:20] for r in reqs[::7]))
    seen: list[list[object]] = []
    match = tree.match_prefix

    def recording_match(key):
        seen[-1].append(key)
        return match(key)

    tree.match_prefix = recording_match  # type: ignore[method-assign]
    chooser = QueuePolicy(policy, None, seed=0)
    for _ in range(2):
        seen.append([])
        order = list(chooser.prioritize(deque(reqs), tree))
    assert all(a is b for a, b in zip(seen[0], seen[1], strict=True))
    assert all(key is req.all_tokens for key, req in zip(seen[1], reqs, strict=True))
    expected = calc_priority(policy, tree, [[*r.prompt, *r.output] for r in reqs])
    assert order == [reqs[i] for i in expected.order]


def test_all_tokens_follows_every_change_of_the_output() -> None:
    """Kept between calls, rebuilt once the output changes: an append, an overlapped step's
    placeholder replaced in place, a token dropped."""
    from minisrv.request import Req

    req = Req(0, [1, 2])
    assert req.all_tokens == (1, 2) and req.all_tokens is req.all_tokens
    req.output.append(-1)  # a placeholder
    assert req.all_tokens == (1, 2, -1)
    req.output[0] = 5  # its token arrives
    assert req.all_tokens == (1, 2, 5)
    req.output.pop()
    assert req.all_tokens == (1, 2)
