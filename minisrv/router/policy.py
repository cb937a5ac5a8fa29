"""The router: which of N workers, each with its own KV cache, serves the next request.

Policies (``POLICIES``):

* ``"round-robin"``: workers in turn. Perfectly even, and blind to the cache: with G prompt
  groups, every worker must eventually hold all G prefixes.
* ``"random"``: a seeded uniform choice; even on average, equally blind.
* ``"least-load"``: the worker with the fewest requests in flight (SGLang's shortest queue).
* ``"cache-aware"``: SGLang's default (``sgl-model-gateway/src/policies/cache_aware.rs``,
  the router formerly called ``sgl-router``). If the load is imbalanced, i.e.
  ``max_load - min_load > balance_abs_threshold`` and
  ``max_load > min_load * balance_rel_threshold``, the least-loaded worker. Otherwise, if
  the approximate tree's longest match covers more than ``cache_threshold`` of the prompt,
  a worker holding that match. Otherwise (a miss) the least-loaded worker, as the gateway
  (0.3) does; ``sgl-router`` before the rename sent a miss to the worker with the smallest
  approximate tree (``get_smallest_tenant``), which can pick a busy worker that was only
  sent short prompts. ``Router(..., miss_rule="smallest-tree")`` follows that older rule
  (``MISS_RULES``).

Load is what the router itself counts: ``route`` adds one request in flight on the chosen
worker and ``finish`` removes it. Every routed prompt is inserted into the tree under its
worker, whatever the policy, so the tree always says where each prefix was sent.

A worker that is down (``mark_down``: its process died) gets nothing until ``mark_up``: every
policy chooses among the workers up, and the tree forgets what the dead worker held, since
its cache died with it; a request it never received is ``reroute``d (moved off its load and
routed again). With every worker up the choices are exactly those above.

Among several workers holding the match, minisrv sends the prompt to the one most recently
sent it (its copy is the freshest, so the likeliest to be still cached; a group the balancer
moved stays where it went). SGLang's gateway sends it to the first holder of the deepest node
the prompt reaches (``tree.rs`` keeps a node's creator as its ``last_tenant``; once that worker
is trimmed from the node, whichever holder its hash map yields first): ``Router(...,
match_rule="first-holder")`` follows that rule (``MATCH_RULES``), with the oldest remaining
holder for the hash map's pick. Among equally loaded workers, the smallest tree (the most
room: sgl-router's older miss rule), then the lowest index.

The tree is only an estimate of the caches. ``Router(..., match_source="caches")`` matches each
prompt against the workers' caches themselves instead, given to ``route`` as ``cached`` (each
worker's cached prefix of the prompt, ``PrefixCache.cached_length``): what a router fed by
the workers' KV events, with no delay, would know. Among the workers holding the longest
cached prefix it picks the least loaded. It is the yardstick for the tree, not a policy
SGLang's router 0.3.2 has.
"""

from __future__ import annotations

import math
import numbers
import random
from collections import Counter
from collections.abc import Sequence

from minisrv.router.tree import ApproxTree, TreeMatch

__all__ = ["POLICIES", "BRANCHES", "MISS_RULES", "MATCH_RULES", "MATCH_SOURCES",
           "LAUNCHER_DEFAULTS", "Router"]

POLICIES: tuple[str, ...] = ("round-robin", "random", "least-load", "cache-aware")

MISS_RULES: tuple[str, ...] = ("least-load", "smallest-tree")
"""Where the cache-aware policy sends a miss: the least-loaded worker (sgl-model-gateway 0.3,
the default) or the worker with the smallest approximate tree (``sgl-router`` before the
rename, ``get_smallest_tenant``; among equal trees the least loaded, then the lowest index)."""

MATCH_RULES: tuple[str, ...] = ("most-recent", "first-holder")
"""Which holder of a match the cache-aware policy picks: the worker most recently sent the
prefix (minisrv's default) or the one first sent it (sgl-model-gateway's ``tree.rs``)."""

MATCH_SOURCES: tuple[str, ...] = ("sent", "caches")
"""What the cache-aware policy matches a prompt against: the tree of the prompts it sent
(SGLang's router) or the workers' caches, passed to ``route`` as ``cached``."""

BRANCHES: tuple[str, ...] = ("balance", "cache", "miss", "policy")
"""Why a request went where it went: the cache-aware rule's three branches, or ``"policy"``
for the other policies."""

LAUNCHER_DEFAULTS: dict[str, float] = {
    "cache_threshold": 0.3, "balance_abs_threshold": 64, "balance_rel_threshold": 1.5}
"""What SGLang's router launcher passes (the policy's own defaults are 0.5, 32 and 1.1)."""


class Router:
    """Chooses a worker per request and remembers, approximately, what each worker caches.

    ``loads[w]`` is the number of requests in flight on worker ``w``; ``tree`` is the
    ``ApproxTree`` of routed prompts; ``decisions`` counts the branch taken per request
    (``BRANCHES``) and ``last_branch`` is the latest one.
    """

    def __init__(self, n_workers: int, policy: str = "cache-aware", *, cache_threshold: float = 0.5,
                 balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.1,
                 max_tree_size: int = 2**20, seed: int = 0,
                 miss_rule: str = "least-load", match_rule: str = "most-recent",
                 match_source: str = "sent") -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; supported: {', '.join(POLICIES)}")
        if miss_rule not in MISS_RULES:
            raise ValueError(f"unknown miss_rule {miss_rule!r}; supported: "
                             f"{', '.join(MISS_RULES)}")
        if match_rule not in MATCH_RULES:
            raise ValueError(f"unknown match_rule {match_rule!r}; supported: "
                             f"{', '.join(MATCH_RULES)}")
        if match_source not in MATCH_SOURCES:
            raise ValueError(f"unknown match_source {match_source!r}; supported: "
                             f"{', '.join(MATCH_SOURCES)}")
        _check_number("cache_threshold", cache_threshold, 0.0, 1.0)
        _check_number("balance_abs_threshold", balance_abs_threshold, 0.0, math.inf)
        _check_number("balance_rel_threshold", balance_rel_threshold, 0.0, math.inf)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.tree = ApproxTree(n_workers, max_tree_size)  # checks n_workers, max_tree_size
        self.n_workers = n_workers
        self.policy = policy
        self.miss_rule = miss_rule
        self.match_rule = match_rule
        self.match_source = match_source
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.loads: list[int] = [0] * n_workers
        self.up: list[bool] = [True] * n_workers
        self.routed: list[int] = [0] * n_workers  # requests ever sent to each worker
        self.decisions: Counter[str] = Counter()
        self.last_branch: str | None = None
        self._rng = random.Random(seed)
        self._turn = 0

    def route(self, tokens: Sequence[int], cached: Sequence[int] | None = None) -> int:
        """Choose the worker for a prompt, count it in flight there, insert it under it.

        ``cached[w]``: how many leading tokens of the prompt worker ``w``'s cache holds, needed
        (and only read) by a cache-aware router with ``match_source="caches"``."""
        if isinstance(tokens, str) or not isinstance(tokens, Sequence):
            raise ValueError(f"tokens must be a sequence of token ids, got {type(tokens).__name__}")
        worker, branch = self.choose(tokens, cached)
        self.tree.insert(tokens, worker)
        self.loads[worker] += 1
        self.routed[worker] += 1
        self.decisions[branch] += 1
        self.last_branch = branch
        return worker

    def finish(self, worker: int) -> None:
        """A request on ``worker`` has completed: one fewer in flight there."""
        self._check_worker(worker)
        if self.loads[worker] == 0:
            raise ValueError(f"worker {worker} has no request in flight to finish")
        self.loads[worker] -= 1

    def reroute(self, tokens: Sequence[int], worker: int,
                cached: Sequence[int] | None = None) -> int:
        """A request routed to ``worker`` never reached it (the worker died first): count it
        off there and ``route`` it again; return the new worker. ValueError, with nothing
        changed, if no worker is up."""
        self._check_worker(worker)
        if not any(self.up):
            raise ValueError("no worker is up")
        self._check_cached(tokens, cached)
        self.finish(worker)
        return self.route(tokens, cached)

    def mark_down(self, worker: int) -> None:
        """Take ``worker`` out (its process died): no request goes there until ``mark_up``,
        and the tree drops its prefixes (its cache is gone). Its in-flight requests still
        ``finish`` as their handlers learn they failed, or are ``reroute``d."""
        self._check_worker(worker)
        self.up[worker] = False
        self.tree.trim(worker, 0)

    def mark_up(self, worker: int) -> None:
        """``worker`` serves again (restarted and healthy)."""
        self._check_worker(worker)
        self.up[worker] = True

    def _check_cached(self, tokens: Sequence[int], cached: Sequence[int] | None) -> None:
        if self.policy != "cache-aware" or self.match_source != "caches":
            return
        if cached is None or len(cached) != self.n_workers or any(
                isinstance(n, bool) or not isinstance(n, numbers.Integral)
                or not 0 <= n <= len(tokens) for n in cached):
            raise ValueError(f"a router with match_source='caches' needs cached=: each of the "
                             f"{self.n_workers} workers' cached prefix, 0..{len(tokens)} tokens; "
                             f"got {cached!r}")

    def _check_worker(self, worker: int) -> None:
        if isinstance(worker, bool) or not isinstance(worker, int) \
                or not 0 <= worker < self.n_workers:
            raise ValueError(f"worker must be an int in 0..{self.n_workers - 1}, got {worker!r}")

    # ----------------------------------------------------------------- the rule
    def choose(self, tokens: Sequence[int],
               cached: Sequence[int] | None = None) -> tuple[int, str]:
        """The worker ``route`` would pick now and the branch that picked it.

        Changes nothing (but the random policy's generator). ValueError if no
        worker is up, or if ``cached`` is missing where ``route`` needs it."""
        self._check_cached(tokens, cached)
        if not all(self.up):
            return self.choose_among_up(tokens, cached)
        if self.policy == "round-robin":
            worker = self._turn
            self._turn = (self._turn + 1) % self.n_workers
            return worker, "policy"
        if self.policy == "random":
            return self._rng.randrange(self.n_workers), "policy"
        if self.policy == "least-load":
            loads = self.loads
            return min(range(self.n_workers), key=loads.__getitem__), "policy"
        return self.cache_aware(tokens, cached)

    def cache_aware(self, tokens: Sequence[int],
                    cached: Sequence[int] | None = None) -> tuple[int, str]:
        """SGLang's three steps with every worker up: balance, follow the cache, or a miss."""
        if self.imbalanced():
            return self.least_loaded(), "balance"
        match = self.holders_match(tokens, cached)
        if tokens and match.length / len(tokens) > self.cache_threshold:
            return match.workers[0], "cache"
        return self.miss_target(range(self.n_workers)), "miss"

    def choose_among_up(self, tokens: Sequence[int],
                        cached: Sequence[int] | None = None) -> tuple[int, str]:
        """``choose`` while some worker is down: the same rule over the workers up."""
        live = [w for w in range(self.n_workers) if self.up[w]]
        if not live:
            raise ValueError("no worker is up")
        if self.policy == "round-robin":
            while not self.up[self._turn]:
                self._turn = (self._turn + 1) % self.n_workers
            worker = self._turn
            self._turn = (self._turn + 1) % self.n_workers
            return worker, "policy"
        if self.policy == "random":
            return self._rng.choice(live), "policy"
        loads, sizes = self.loads, self.tree.sizes
        least = min(live, key=lambda w: (loads[w], sizes[w], w))
        if self.policy == "least-load":
            return min(live, key=loads.__getitem__), "policy"
        high, low = max(loads[w] for w in live), min(loads[w] for w in live)
        if high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold:
            return least, "balance"
        match = self.holders_match(tokens, cached)
        holders = [w for w in match.workers if self.up[w]]
        if tokens and holders and match.length / len(tokens) > self.cache_threshold:
            return holders[0], "cache"
        return self.miss_target(live), "miss"

    def holders_match(self, tokens: Sequence[int],
                      cached: Sequence[int] | None = None) -> TreeMatch:
        """The longest match of ``tokens`` and its holders: in the tree, in ``match_rule``'s
        order; in the caches (``match_source="caches"``), the workers up whose cache holds the
        longest prefix, least loaded first."""
        if self.match_source == "caches":
            if cached is None:
                raise ValueError("a router with match_source='caches' needs cached=")
            live = [w for w in range(self.n_workers) if self.up[w]]
            length = max((cached[w] for w in live), default=0)
            holders = sorted((w for w in live if cached[w] == length),
                             key=lambda w: (self.loads[w], w)) if length else []
            return TreeMatch(length, tuple(holders))
        return self.tree.match(tokens, "first" if self.match_rule == "first-holder" else "recent")

    def imbalanced(self) -> bool:
        """SGLang's test: the busiest worker is ahead of the idlest by more than
        the absolute threshold *and* by more than the relative one."""
        high, low = max(self.loads), min(self.loads)
        return (high - low > self.balance_abs_threshold
                and high > low * self.balance_rel_threshold)

    def least_loaded(self) -> int:
        """Fewest requests in flight; among equals the smallest tree, then the lowest index."""
        loads, sizes = self.loads, self.tree.sizes
        return min(range(self.n_workers), key=lambda w: (loads[w], sizes[w], w))

    def miss_target(self, workers: Sequence[int]) -> int:
        """Where a miss goes among ``workers``: by ``miss_rule``, the least loaded (then the
        smallest tree) or the smallest tree (then the least loaded); then the lowest index."""
        loads, sizes = self.loads, self.tree.sizes
        if self.miss_rule == "smallest-tree":
            return min(workers, key=lambda w: (sizes[w], loads[w], w))
        return min(workers, key=lambda w: (loads[w], sizes[w], w))

    def __repr__(self) -> str:
        return (f"Router({self.n_workers}, {self.policy!r}, "
                f"cache_threshold={self.cache_threshold}, "
                f"balance_abs_threshold={self.balance_abs_threshold}, "
                f"balance_rel_threshold={self.balance_rel_threshold}, loads={self.loads})")


def _check_number(name: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not low <= value <= high:
        raise ValueError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
