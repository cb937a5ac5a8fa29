"""Which waiting request to admit first: the scheduling policies of cache-aware serving.

A prefix cache only pays off if requests that share a prefix run while that prefix is still
cached. First come, first served (FCFS) ignores the cache: with four interleaved few-shot
groups and a small cache, each request evicts the examples the next one needs. SGLang
therefore lets the scheduler reorder its waiting queue every round by what the radix tree
holds (``schedule_policy.py`` in SGLang 0.5.23); this module is that decision, as a pure
function of the queue and the tree, so the scheduler, the book and a reader call the same
code (``QueuePolicy`` is the scheduler's part that applies it, once per admission round):

* ``"fcfs"``: queue order (SGLang's default).
* ``"lpm"``: longest prefix match first. Each prompt is matched against the tree and the
  queue is sorted by matched length, longest first; the sort is stable, so ties keep queue
  order. The length is capped at ``len(prompt) - 1`` because one token must still be computed
  to get the logits of the next. Matching costs time proportional to the queue, so with more
  than ``WAITING_QUEUE_PREFIX_MATCH_MAX`` (128) requests waiting, LPM serves that round in
  FCFS order without matching at all. SGLang 0.5.23 names it the same (before, the number
  stood in ``SchedulePolicy._determine_active_policy``) and caps ``hrrn`` too.
* ``"dfs-weight"``: each request sits at the node where its match ends; a node weighs the
  requests at it plus its children's weights. A depth-first walk from the root visits heavier
  children first (equal weights in the order the branches entered the tree) and emits a
  node's own requests after its children. Requests sharing a prefix therefore run back to
  back, deepest shared prefix first. It never falls back to FCFS.
* ``"hrrn"``: highest response ratio next, SGLang 0.5.23's answer to LPM's starvation
  (``_sort_by_hrrn``). A request's ratio is the prefill tokens the server has computed since
  it arrived over its own uncached tokens (its prompt past the capped match): it grows while
  the request waits, fastest for a request with little left to compute, so nobody waits
  forever and a long match still helps. Highest first; deferred requests last. Capped at
  ``WAITING_QUEUE_PREFIX_MATCH_MAX`` waiting like LPM. Ties (every ratio 0 when no prefill
  ran since the requests arrived) keep queue order; SGLang breaks them by ``rid``, a random
  hex string unless the client sets it.
* ``"lof"``: longest ``max_new_tokens`` first (stable), cache-agnostic.
* ``"random"``: a seeded shuffle, the baseline a cache-aware order must beat.

Cache-aware policies given a ``NoCache`` become FCFS, as in SGLang: there is nothing to match.

**Which policies need a tree.** LPM needs only a match length, which vLLM's block-hash cache
(``BlockCache``, ``cache="blocks"``) gives as well as the radix tree: a run of whole blocks,
capped at ``len(prompt) - 1`` rounded down to whole blocks (so is the radix tree's in pages,
``page_size`` > 1). DFS-weight walks the
tree's children from the root; a hash table of blocks has none, so DFS-weight refuses it.
The in-batch check matches the waiting prompts against a scratch radix tree of their own,
whichever cache serves them.

**In-batch prefix check.** A cold prefix (not in the tree) shared by several waiting requests
would otherwise be prefilled by all of them in the same batch, since none can reuse KV that
does not exist yet. So a scratch tree, empty at the start of each round, receives the prompts
in queue order: a request whose real cached prefix is at most ``IN_BATCH_CHECK_THRESHOLD``
(32) tokens is matched against it, and if it shares at least
``IN_BATCH_DEPRIORITIZE_THRESHOLD`` (32) tokens with an earlier such request it is
*deprioritized* (sorted behind everyone else, in queue order); otherwise it is inserted. The
first request of a cold group runs, the others find its prefix cached a round later. LPM
uses the check by default; FCFS may use it (the RadixAttention chapter's experiment); for
DFS-weight SGLang computes the set but does not use it in the order, and so does this code.

Matching goes through ``RadixCache.match_prefix``, which splits a node where a match ends
inside an edge and marks the matched path as just used (LRU), exactly as SGLang's matching in
its scheduler does: prefixes that waiting requests want become the last to be evicted.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from typing import Literal, NamedTuple, get_args

from minisrv.kv import BlockCache, NoCache, PrefixCache, RadixCache, TreeNode
from minisrv.request import Req

__all__ = [
    "Policy",
    "POLICIES",
    "CACHE_AWARE",
    "CAPPED_POLICIES",
    "TREE_POLICIES",
    "IN_BATCH_POLICIES",
    "WAITING_QUEUE_PREFIX_MATCH_MAX",
    "IN_BATCH_CHECK_THRESHOLD",
    "IN_BATCH_DEPRIORITIZE_THRESHOLD",
    "PriorityResult",
    "QueuePolicy",
    "cache_aware_order",
    "calc_priority",
    "default_in_batch_check",
    "optimal_hit_rate",
    "distinct_prefix_tokens",
]

Policy = Literal["fcfs", "lpm", "dfs-weight", "hrrn", "lof", "random"]
POLICIES: tuple[str, ...] = get_args(Policy)
CACHE_AWARE: frozenset[str] = frozenset({"lpm", "dfs-weight", "hrrn"})
# Policies that stop matching past WAITING_QUEUE_PREFIX_MATCH_MAX waiting requests.
CAPPED_POLICIES: frozenset[str] = frozenset({"lpm", "hrrn"})
# Policies that walk the radix tree's nodes, not only its match lengths.
TREE_POLICIES: frozenset[str] = frozenset({"dfs-weight"})
# Policies the in-batch prefix check may be combined with (it needs matches against a tree).
IN_BATCH_POLICIES: frozenset[str] = frozenset({"fcfs", "lpm", "dfs-weight", "hrrn"})

# Past this many waiting requests LPM stops matching, for the cost of matching the queue
# (SGLang 0.5.23's name and value, which its source calls arbitrary).
WAITING_QUEUE_PREFIX_MATCH_MAX = 128
# A request is checked against the scratch tree when its real cached prefix is <= this ...
# (SGLang: IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD, an environment variable of that name)
IN_BATCH_CHECK_THRESHOLD = 32
# ... and deprioritized when it shares >= this many tokens with an earlier checked request
# (SGLang: IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD, likewise)
IN_BATCH_DEPRIORITIZE_THRESHOLD = 32


class PriorityResult(NamedTuple):
    """One round's decision over the waiting queue."""

    order: list[int]  # indices into ``prompts``, in the order they would be admitted
    deprioritized: list[int]  # indices the in-batch check deferred, in queue order
    matched: list[int]  # per prompt (input order): cached prefix, capped at len - 1 (in
    #                     whole pages where page_size > 1); 0 when the round made no match
    #                     (FCFS/LOF/random, LPM and HRRN past 128 waiting)


class QueuePolicy:
    """The scheduler's policy: its waiting queue reordered each round by ``calc_priority``
    (as SGLang sorts its queue each round), the random policy drawing from one generator
    round after round (seeded by ``seed``, so a run repeats)."""

    def __init__(self, policy: str, in_batch_prefix_check: bool | None,
                 seed: int | None) -> None:
        self.policy = policy
        self.check = (default_in_batch_check(policy) if in_batch_prefix_check is None
                      else in_batch_prefix_check)
        self.rng = random.Random(seed)

    def prioritize(self, waiting: deque[Req], tree: PrefixCache,
                   prefilled: int = 0) -> deque[Req]:
        """``waiting`` in the order of this round (FCFS without the in-batch check: as is).
        ``prefilled``: the prefill tokens the scheduler has computed so far (SGLang's
        ``processed_tokens_counter``), which HRRN's ratios count from each request's arrival.

        Only the order is read here, so a round computes nothing the order does without:
        DFS-weight's in-batch set (reported by ``calc_priority``, not used in its order),
        the output limits that only LOF sorts by and the waits that only HRRN does."""
        if self.policy == "fcfs" and not self.check:
            return waiting
        queue = list(waiting)
        result = calc_priority(
            self.policy, tree, [r.all_tokens for r in queue],
            in_batch_prefix_check=self.check and self.policy != "dfs-weight", seed=self.rng,
            max_new_tokens=[r.max_new_tokens for r in queue] if self.policy == "lof" else None,
            waited_tokens=([prefilled - r.arrival_prefilled for r in queue]
                           if self.policy == "hrrn" else None))
        return deque(queue[i] for i in result.order)


def default_in_batch_check(policy: str) -> bool:
    """Whether a policy uses the in-batch prefix check unless told otherwise.

    On for the cache-aware policies (as in SGLang, where it lives in their matching step);
    off for FCFS, LOF and random, which match nothing.
    """
    _check_policy(policy)
    return policy in CACHE_AWARE


def calc_priority(
    policy: str,
    tree: PrefixCache,
    prompts: Sequence[Sequence[int]],
    *,
    in_batch_prefix_check: bool | None = None,
    seed: int | random.Random | None = None,
    max_new_tokens: Sequence[int] | None = None,
    waited_tokens: Sequence[int] | None = None,
) -> PriorityResult:
    """Order the waiting queue for one scheduling round.

    Args:
        policy: one of ``POLICIES``.
        tree: the prefix cache (``RadixCache``, or ``BlockCache`` for all but DFS-weight);
            with ``NoCache`` cache-aware policies are FCFS and the in-batch check is skipped
            (nothing could be reused a round later). The radix tree's matching splits nodes
            and refreshes LRU clocks, as the scheduler's matching does; the block cache's
            changes nothing, as vLLM's lookup.
        prompts: the waiting requests' token lists, in queue order (oldest first).
        in_batch_prefix_check: run the in-batch prefix check; ``None`` means the policy's
            default (``default_in_batch_check``: on for LPM and DFS-weight). Allowed with
            FCFS, LPM and DFS-weight; DFS-weight reports the set but orders without it.
        seed: for ``"random"``: an int seed or a ``random.Random`` to draw from (a scheduler
            passes its own generator so successive rounds differ but runs repeat).
        max_new_tokens: for ``"lof"``: each request's output limit, in queue order.
        waited_tokens: for ``"hrrn"``: the prefill tokens the server computed since each
            request arrived, in queue order.

    Returns:
        ``PriorityResult(order, deprioritized, matched)``.
    """
    _check_policy(policy)
    n = len(prompts)
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; every waiting request needs >= 1 token")
    check = default_in_batch_check(policy) if in_batch_prefix_check is None \
        else in_batch_prefix_check
    if check and policy not in IN_BATCH_POLICIES:
        raise ValueError(f"the in-batch prefix check works with {sorted(IN_BATCH_POLICIES)}, "
                         f"not {policy!r}; pass in_batch_prefix_check=False")
    queue = list(range(n))
    if policy == "lof":
        return PriorityResult(_longest_output_first(max_new_tokens, n), [], [0] * n)
    if policy == "random":
        rng = seed if isinstance(seed, random.Random) else random.Random(seed)
        rng.shuffle(queue)
        return PriorityResult(queue, [], [0] * n)
    if policy == "hrrn":
        _check_waits(waited_tokens, n)
    no_cache = isinstance(tree, NoCache)
    past_max = policy in CAPPED_POLICIES and n > WAITING_QUEUE_PREFIX_MATCH_MAX
    if no_cache or past_max or (policy == "fcfs" and not check):
        return PriorityResult(queue, [], [0] * n)
    _check_tree(policy, tree)
    return cache_aware_order(policy, tree, [tuple(p) for p in prompts], check,
                             waited_tokens or ())


def cache_aware_order(policy: str, tree: PrefixCache, prompts: Sequence[tuple[int, ...]],
                      check: bool, waited_tokens: Sequence[int] = ()) -> PriorityResult:
    """A round that matches the queue against the tree: LPM, DFS-weight, HRRN, or FCFS
    with the in-batch check (``calc_priority`` past its early returns, which checked the
    arguments). ``prompts`` are tuples, the cache's keys; ``check`` runs the in-batch
    prefix check; ``waited_tokens``: HRRN's, one per prompt."""
    real, nodes = _match_all(tree, prompts)  # each path marked just used (LRU)
    page = tree.page_size  # a match is whole pages, so its cap is too
    matched = [min(n, (len(p) - 1) // page * page)
               for n, p in zip(real, prompts)]
    deferred = _in_batch_deprioritized(prompts, real) if check else []
    if policy == "dfs-weight":  # SGLang computes the deferred set, unused here
        order = _dfs_weight_order(tree.root, nodes)
        return PriorityResult(order, deferred, matched)
    queue = range(len(prompts))
    if policy == "lpm":
        key = {i: -matched[i] for i in queue}  # longest match first
    elif policy == "hrrn":  # highest ratio of tokens waited to tokens left to compute
        key = {i: -waited_tokens[i] / (len(prompts[i]) - matched[i]) for i in queue}
    else:
        key = dict.fromkeys(queue, 0)  # FCFS: queue order
    for i in deferred:
        key[i] = 1  # behind every request not deferred (their keys are <= 0)
    order = sorted(queue, key=key.__getitem__)  # stable: ties keep queue order
    return PriorityResult(order, deferred, matched)


def _check_tree(policy: str, tree: PrefixCache) -> None:
    """ValueError unless ``tree`` is a cache ``policy`` can order by: a ``RadixCache`` for
    every policy, a ``BlockCache`` for all but the ones that walk the tree."""
    if isinstance(tree, RadixCache):
        return
    if not isinstance(tree, BlockCache):
        raise ValueError(f"tree must be a RadixCache, BlockCache or NoCache, got "
                         f"{type(tree).__name__}")
    if policy in TREE_POLICIES:
        raise ValueError(f"policy {policy!r} walks the radix tree's nodes, and the block "
                         f"cache keeps a hash table of blocks; use cache='radix' or policy "
                         f"'lpm'")


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")


def _check_waits(waited_tokens: Sequence[int] | None, n: int) -> None:
    if waited_tokens is None or len(waited_tokens) != n:
        got = "none" if waited_tokens is None else f"{len(waited_tokens)} values"
        raise ValueError(f"policy 'hrrn' needs waited_tokens, one per prompt ({n}); got {got}")
    if any(w < 0 for w in waited_tokens):
        raise ValueError("waited_tokens counts prefill tokens since each arrival: >= 0")


def _longest_output_first(max_new_tokens: Sequence[int] | None, n: int) -> list[int]:
    if max_new_tokens is None or len(max_new_tokens) != n:
        got = "none" if max_new_tokens is None else f"{len(max_new_tokens)} values"
        raise ValueError(f"policy 'lof' needs max_new_tokens, one per prompt ({n}); got {got}")
    return sorted(range(n), key=lambda i: -max_new_tokens[i])


def _match_all(tree: PrefixCache, prompts: Sequence[Sequence[int]]
               ) -> tuple[list[int], list[TreeNode]]:
    """Real (uncapped) cached length and end node of every prompt, in queue order."""
    lengths: list[int] = []
    nodes: list[TreeNode] = []
    for prompt in prompts:
        result = tree.match_prefix(prompt)
        lengths.append(result.length)
        nodes.append(result.node)
    return lengths, nodes


def _in_batch_deprioritized(prompts: Sequence[Sequence[int]], real: list[int]) -> list[int]:
    """Requests whose cold prefix an earlier waiting request is about to compute.

    Only requests with little cached (``real`` <= 32) are checked: one that already hits the
    tree gains little from waiting. Checked requests that are not deferred enter the scratch
    tree, so the first of a group is the one that runs.
    """
    scratch = RadixCache()
    deferred: list[int] = []
    for i, prompt in enumerate(prompts):
        if real[i] > IN_BATCH_CHECK_THRESHOLD:
            continue
        if scratch.match_prefix(prompt).length >= IN_BATCH_DEPRIORITIZE_THRESHOLD:
            deferred.append(i)
        else:
            scratch.insert(prompt)
    return deferred


def _dfs_weight_order(root: TreeNode, nodes: list[TreeNode]) -> list[int]:
    """Queue indices in depth-first order of the tree, heavier subtrees first.

    Weights are accumulated by walking up from each request's node, so only the paths that
    carry requests are visited (SGLang walks the whole tree; subtrees of weight 0 emit
    nothing, so the order is the same). The walk is iterative: a radix tree can be deep.
    """
    at_node: dict[int, list[int]] = {}  # id(node) -> queue indices sitting there
    weight: dict[int, int] = {}  # id(node) -> requests in its subtree
    for i, node in enumerate(nodes):
        at_node.setdefault(id(node), []).append(i)
        walker: TreeNode | None = node
        while walker is not None:
            weight[id(walker)] = weight.get(id(walker), 0) + 1
            walker = walker.parent
    order: list[int] = []
    stack: list[tuple[TreeNode, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            order.extend(at_node.get(id(node), ()))
            continue
        stack.append((node, True))
        heavy = [c for c in node.children.values() if id(c) in weight]
        heavy.sort(key=lambda c: -weight[id(c)])  # stable: ties keep the tree's order
        stack.extend((child, False) for child in reversed(heavy))
    return order


def distinct_prefix_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens in the prefix tree of ``prompts``: each distinct (prefix, next token) once.

    Sorted lexicographically, each prompt adds exactly the tokens after its longest common
    prefix with the one before it (the deepest branch point it shares with any earlier one).
    """
    total = 0
    previous: tuple[int, ...] = ()
    for prompt in sorted(tuple(p) for p in prompts):
        common = 0
        limit = min(len(prompt), len(previous))
        while common < limit and prompt[common] == previous[common]:
            common += 1
        total += len(prompt) - common
        previous = prompt
    return total


def optimal_hit_rate(prompts: Sequence[Sequence[int]]) -> float:
    """The best prefix-cache hit rate any order can reach: 1 - distinct / total tokens.

    Every distinct prefix token must be computed at least once; a depth-first order of the
    prefix tree with a cache at least as large as the longest prompt computes each exactly
    once (the DFS theorem of the SGLang paper), so this bound is reached.
    """
    total = sum(len(p) for p in prompts)
    if total == 0:
        raise ValueError("optimal_hit_rate needs at least one prompt token")
    return 1.0 - distinct_prefix_tokens(prompts) / total
