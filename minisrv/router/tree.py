"""The router's approximate radix tree: which worker has probably cached which prefix.

A router cannot ask every worker what its KV cache holds at the moment a request arrives:
that would cost a round trip per worker per request, and the answer would be stale by the
time the request lands. SGLang's router (``sgl-router``, ``tree.rs``) instead remembers
what it *sent*: every routed prompt is inserted into one radix tree, and each node records
which workers (tenants) were sent that prefix and when. A prefix match then predicts where
the prompt would hit.

The prediction is approximate on purpose. A worker may have evicted a prefix the router
still remembers, so the tree forgets too: each worker's share of the tree is trimmed to
``max_tree_size`` tokens by dropping that worker from its least recently used leaves, as
SGLang's ``evict_tenant_by_size`` does. A node that no worker holds any longer is removed.

Differences from SGLang, all for a deterministic single-threaded simulation: edges hold
token ids instead of characters, time is a counter of inserts instead of the wall clock,
and trimming runs right after the insert that overflows a worker (SGLang trims in a
background thread, every 30 s by its policy's default, every 120 s as the gateway binary
starts it and every 60 s as the Python launcher does: ``sgl-model-gateway/src/policies/mod.rs``,
``main.rs`` and ``sglang_router/router_args.py``, 0.3.2). SGLang's default size limits, 10,000
characters in the policy and 67,108,864 in either launcher, are characters, not tokens.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["ApproxTree", "TreeMatch", "common_prefix_length"]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share.

    Slices are compared in C, halving the window each time, so a 2,000-token prompt costs
    about a dozen slice comparisons instead of a 2,000-step Python loop.
    """
    n = min(len(a), len(b))
    if (a if len(a) == n else a[:n]) == (b if len(b) == n else b[:n]):  # no needless copy
        return n
    low, high = 0, n  # a[:low] == b[:low] and a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid
    return low


class _Node:
    """One edge of the tree: its tokens, its children by first token, and per worker the
    time that worker was last sent a prompt passing through this edge."""

    __slots__ = ("tokens", "children", "parent", "seen")

    def __init__(self, tokens: list[int], parent: _Node | None) -> None:
        self.tokens = tokens
        self.children: dict[int, _Node] = {}
        self.parent = parent
        # worker -> last access (insert counter), in the order the workers were first sent
        # this edge (a dict keeps insertion order; a trimmed worker that returns goes last)
        self.seen: dict[int, int] = {}


class TreeMatch(NamedTuple):
    """The longest prefix of a prompt the tree knows, and the workers that were sent it.

    ``length`` counts tokens, including a partial match into the last edge (a worker sent
    ``abcd`` has cached ``abc`` too). ``workers`` hold the whole matched prefix, the one most
    recently sent it first (its copy is the likeliest to be still cached), or with
    ``match(..., order="first")`` the one first sent it first.
    """

    length: int
    workers: tuple[int, ...]


class ApproxTree:
    """One radix tree over the prompts routed to ``n_workers`` workers.

    ``insert(tokens, worker)`` records that ``worker`` was sent ``tokens``; ``match(tokens)``
    returns the longest known prefix and who holds it; ``size(worker)`` is how many tokens
    of the tree ``worker`` holds. Every insert trims that worker to ``max_tree_size`` tokens.
    """

    def __init__(self, n_workers: int, max_tree_size: int = 2**20) -> None:
        if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 1:
            raise ValueError(f"n_workers must be an int >= 1, got {n_workers!r}")
        if isinstance(max_tree_size, bool) or not isinstance(max_tree_size, int) \
                or max_tree_size < 0:
            raise ValueError(f"max_tree_size must be an int >= 0 (tokens), got {max_tree_size!r}")
        self.n_workers = n_workers
        self.max_tree_size = max_tree_size
        self.root = _Node([], None)
        self._sizes = [0] * n_workers
        self._clock = 0

    # ----------------------------------------------------------------- queries
    def size(self, worker: int) -> int:
        """Tokens of the tree that ``worker`` holds (its edges' lengths summed)."""
        self._check_worker(worker)
        return self._sizes[worker]

    @property
    def sizes(self) -> list[int]:
        """``size(w)`` for every worker."""
        return list(self._sizes)

    def match(self, tokens: Sequence[int], order: str = "recent") -> TreeMatch:
        """Walk down the tree along ``tokens``; report how far it got and who holds that.

        The walk stops inside an edge where the tokens differ; the partial edge still counts,
        and its holders are the answer (the deepest node reached holds a subset of its
        ancestors' workers, so they hold the whole matched prefix). ``order``: holders most
        recently sent the prefix first (``"recent"``), or in the order they were first sent
        it (``"first"``: SGLang's gateway keeps the node's creator as its ``last_tenant``).
        """
        if order not in ("recent", "first"):
            raise ValueError(f"order must be 'recent' or 'first', got {order!r}")
        node, i, n = self.root, 0, len(tokens)
        holder = self.root
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                break
            shared = common_prefix_length(child.tokens, tokens[i:i + len(child.tokens)])
            i += shared
            holder = child
            if shared < len(child.tokens):
                break
            node = child
        if holder is self.root:
            return TreeMatch(0, ())
        seen = holder.seen
        if order == "first":
            return TreeMatch(i, tuple(seen))
        return TreeMatch(i, tuple(sorted(seen, key=seen.__getitem__, reverse=True)))

    def match_worker(self, tokens: Sequence[int], worker: int) -> int:
        """Length of the longest prefix of ``tokens`` that ``worker`` holds in the tree."""
        self._check_worker(worker)
        node, i, n = self.root, 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None or worker not in child.seen:
                break
            shared = common_prefix_length(child.tokens, tokens[i:i + len(child.tokens)])
            i += shared
            if shared < len(child.tokens):
                break
            node = child
        return i

    def nodes(self) -> int:
        """Nodes in the tree, the root excluded."""
        count, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            count += len(node.children)
            stack.extend(node.children.values())
        return count

    # ----------------------------------------------------------------- updates
    def insert(self, tokens: Sequence[int], worker: int) -> None:
        """Record that ``worker`` was sent ``tokens``: mark every edge on the path as held by
        ``worker`` now (splitting an edge where the prompt leaves it), then trim ``worker``."""
        self._check_worker(worker)
        self._clock += 1
        now, sizes = self._clock, self._sizes
        tokens = list(tokens)
        node, i, n = self.root, 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(tokens[i:], node)
                node.children[tokens[i]] = leaf
                leaf.seen[worker] = now
                sizes[worker] += n - i
                break
            shared = common_prefix_length(child.tokens, tokens[i:i + len(child.tokens)])
            if shared < len(child.tokens):
                child = self._split(child, shared)
            if worker not in child.seen:
                sizes[worker] += len(child.tokens)
            child.seen[worker] = now
            i += shared
            node = child
        if sizes[worker] > self.max_tree_size:
            self.trim(worker, self.max_tree_size)

    def trim(self, worker: int, max_size: int) -> int:
        """Drop ``worker`` from its least recently used leaves until it holds at most
        ``max_size`` tokens; return how many tokens it gave up.

        A leaf *of a worker* is a node it holds none of whose children it holds. When a leaf
        goes, its parent may become one, and joins the queue with its own access time. A node
        that nobody holds any more is removed from the tree.
        """
        self._check_worker(worker)
        if self._sizes[worker] <= max_size:
            return 0
        order = itertools.count()  # tie-break; access times of one worker's leaves differ
        heap = [(node.seen[worker], next(order), node) for node in self._leaves_of(worker)]
        heapq.heapify(heap)
        freed = 0
        while heap and self._sizes[worker] > max_size:
            _, _, node = heapq.heappop(heap)
            del node.seen[worker]
            self._sizes[worker] -= len(node.tokens)
            freed += len(node.tokens)
            parent = node.parent
            if not node.seen and not node.children and parent is not None:
                del parent.children[node.tokens[0]]
            if parent is not None and parent is not self.root and worker in parent.seen \
                    and not any(worker in c.seen for c in parent.children.values()):
                heapq.heappush(heap, (parent.seen[worker], next(order), parent))
        return freed

    # ----------------------------------------------------------------- helpers
    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s edge after ``at`` tokens; the new upper node keeps its holders."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.tokens[:at], parent)
        upper.seen = dict(child.seen)
        parent.children[upper.tokens[0]] = upper
        child.tokens = child.tokens[at:]
        child.parent = upper
        upper.children[child.tokens[0]] = child
        return upper

    def _leaves_of(self, worker: int) -> list[_Node]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            held = [c for c in node.children.values() if worker in c.seen]
            if not held and node is not self.root:
                leaves.append(node)
            stack.extend(held)
        return leaves

    def _check_worker(self, worker: int) -> None:
        if isinstance(worker, bool) or not isinstance(worker, int) \
                or not 0 <= worker < self.n_workers:
            raise ValueError(f"worker must be an int in 0..{self.n_workers - 1}, got {worker!r}")
