"""RadixAttention's prefix cache: a radix tree of token runs whose nodes hold KV slots.

Serving patterns repeat prefixes (a shared system prompt, a chat's history, few-shot
examples). SGLang keeps the KV of every finished prefix in a radix tree (a compressed trie):
each edge is a run of tokens, each node stores the KV slots of its edge's tokens, and the
path from the root to a node spells a prefix. A new prompt walks the tree to find its longest
cached prefix; only the rest is prefilled.

Three rules keep the tree safe to share:

* **Reference counts.** A running request *locks* the node where its cached prefix ends; the
  lock walks to the root, so no node on the path can be evicted while the request reads it.
* **Sizes.** Every cached token is either *protected* (on a locked path) or *evictable*;
  ``lock``/``unlock`` move a node's tokens between the two, so the scheduler knows at once how
  much memory it could reclaim.
* **LRU eviction.** ``evict(n)`` removes least-recently-used unlocked leaves (a heap keyed by
  last access) until ``n`` tokens are free; a parent that becomes an unlocked leaf joins the
  heap. The root is never evicted.

**Pages.** With ``page_size`` > 1 the tree matches, inserts, locks and evicts whole pages,
as SGLang's does (``mem_cache/radix_cache.py``: children keyed by their first page, keys
compared page by page, a match cut to whole pages): every edge holds a multiple of
``page_size`` tokens, a query's last partial page is never matched and an insert keeps
only the whole pages of what it is given. At ``page_size`` 1 nothing of this shows.

The tree runs standalone (values may be ``None`` or any ints; nothing is allocated), which
is how the book draws it and the tests drive it; the engine passes real KV slot ids and an
``on_evict`` callback that returns evicted slots to the pool. ``NoCache`` is a twin with the
same interface that caches nothing (``Engine(cache="none")``, ``minisrv.kv.cache``).

The tree draws nothing and records nothing itself. Like SGLang publishing KV-cache events, it
reports each operation (what it matched, split, inserted, locked or evicted) to an optional
``listener`` (``minisrv.kv.events``); ``minisrv.viz.radix.TreeRecorder`` is the listener that
keeps the log and the snapshots the book draws. Every operation takes an optional ``tag``
(e.g. the request it serves) that is passed through to the listener and used for nothing else.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from minisrv.checks import check_int
from minisrv.kv.cache import EvictCallback, MatchResult, PrefixCache, SizeInfo, TreeNode, insert_key
from minisrv.kv.events import NodeView, TreeEvent, TreeListener, reports_evicted, reports_path
from minisrv.kv.pages import Pages

__all__ = ["RadixCache"]


class RadixCache(PrefixCache):
    """A radix tree of cached token runs with reference counts and LRU eviction.

    Args:
        on_evict: called with the list of values of every evicted node (the engine passes
            a function that frees those KV slots); ``None`` in standalone mode.
        listener: told about every operation (a ``TreeListener``, e.g. the book's
            ``TreeRecorder``); ``None`` costs nothing. It may be set later, too.
        page_size: tokens per page, the unit the tree matches, splits and evicts in.

    Costs: ``match_prefix`` and ``insert`` are O(length of the query) plus one dict lookup
    per edge; ``lock``/``unlock`` O(depth); ``evict`` O(log n) per removed leaf. Eviction
    keeps a lazy heap of (last access, node) entries: an entry whose node has since been
    touched, locked, extended or removed is skipped when popped, so no operation scans the
    whole tree (the heap is compacted when stale entries outnumber the nodes). A
    ``match_prefix`` given the very tuple of the previous one, with no node added, split or
    removed since, only renews the LRU stamps of the path it found then (O(depth)).
    """

    node_type: type[TreeNode] = TreeNode  # a tree with more per node (the host tier) extends it

    def __init__(self, on_evict: EvictCallback | None = None,
                 listener: TreeListener | None = None, page_size: int = 1) -> None:
        self.page_size = check_int("page_size", page_size, minimum=1)
        self._pages = Pages(self.page_size)
        self.on_evict = on_evict
        self.listener = listener
        self._ids = itertools.count()
        self.clock = 0
        self.root = self.node_type(next(self._ids), (), [], None, 0)
        self.n_nodes = 1
        self._evictable = 0
        self._protected = 0
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._seq = itertools.count()  # tie-breaker: heap entries never compare nodes
        self._shape = 0  # bumped whenever a node is added, split or removed
        self._last: tuple[Any, ...] = (None, -1)  # (key, shape, end node, length) of the last match

    # ----------------------------------------------------------------- lookups
    def match_prefix(self, tokens: Sequence[int], *, tag: str = "") -> MatchResult:
        """Find the longest cached prefix of ``tokens``.

        When the match ends inside an edge, that edge is split so the match ends exactly on
        a node: the caller can then lock precisely the matched prefix. Every node on the path
        counts as just used (LRU).

        Args:
            tokens: the query, e.g. a prompt's token ids.
            tag: passed to the listener (e.g. the request's name); nothing else.

        Returns:
            ``MatchResult(length, node, values)``: how many leading tokens are cached, the
            node where they end (the root when none), and their values (KV slots) in order.
        """
        key = tuple(tokens)
        self.clock += 1
        node, length, split = self._walk_again_or_anew(key)
        self._report("match", tag, length, node, (node.id,) if split else ())
        return MatchResult(length, node, self._values_to(node))

    def cached_length(self, tokens: Sequence[int]) -> int:
        """``match_prefix``'s length, walked without splitting an edge or renewing a stamp."""
        return self._walk(self._pages.whole(tuple(tokens)), change=False)[1]

    def insert(self, tokens: Sequence[int], values: Sequence[Any] | None = None, *,
               tag: str = "", inserted_len: int = 0) -> int:
        """Cache ``tokens`` with their ``values`` (one per token; ``None``: standalone mode).

        Args:
            tokens: the token run to cache, e.g. a prompt, or prompt + output.
            values: the KV slot of each token; defaults to ``None`` per token.
            inserted_len: unused: this tree counts no hits (``PrefixCache.insert``).

        Returns:
            How many leading tokens were already cached. The tree keeps the values of the
            rest of the whole pages; the caller frees ``values[:returned]``, which duplicate
            the tree's own (and keeps any last partial page's, which the tree never takes).
        """
        key = self._pages.whole(insert_key(tokens, values))
        self.clock += 1
        node, length, split = self._walk(key)
        split_ids = (node.id,) if split else ()
        inserted: tuple[int, ...] = ()
        if length < len(key):
            vals = [None] * (len(key) - length) if values is None else list(values[length:len(key)])
            node = self._add_leaf(node, key[length:], vals)
            inserted = (node.id,)
        self._report("insert", tag, length, node, split_ids, inserted=inserted)
        return length

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], values: list[Any]) -> TreeNode:
        """A new evictable leaf below ``parent`` for the edge ``key``."""
        leaf = self.node_type(next(self._ids), key, values, parent, self.clock)
        parent.children[self._pages.at(key, 0)] = leaf
        self.n_nodes += 1
        self._shape += 1
        self._evictable += len(leaf.key)
        self._push(leaf)
        return leaf

    def _walk(self, key: tuple[int, ...], change: bool = True) -> tuple[TreeNode, int, bool]:
        """Follow ``key`` down from the root, one edge at a time, as far as the tree holds it;
        where the match ends inside an edge, split the edge there and stop on its upper part.
        Every node passed counts as just used (LRU). ``change=False`` (``cached_length``) does
        neither: only the length it returns is meaningful then.

        Returns (the node where the match ends, the matched length, whether it split an edge).
        """
        node, pos = self.root, 0
        if change:
            node.last_access = self.clock
        split = False
        while pos < len(key) and (child := self._next(node, key, pos)) is not None:
            matched = self._pages.matched(child.key, key, pos)  # tokens of the edge that match
            split = matched < len(child.key)  # the match ends inside this edge
            if change:
                child = self._split(child, matched) if split else child
                self._touch(child)
            node, pos = child, pos + matched
            if split:
                break
        return node, pos, split

    def _walk_again_or_anew(self, key: tuple[int, ...]) -> tuple[TreeNode, int, bool]:
        """``_walk(key)``, with a shortcut: asked the very tuple of the previous match, with
        no node added, split or removed since, only ``_rewalk`` the path found then."""
        if key is self._last[0] and self._shape == self._last[1]:
            node, length = self._last[2:]
            self._rewalk(node)
            return node, length, False
        node, length, split = self._walk(self._pages.whole(key))
        self._last = (key, self._shape, node, length)
        return node, length, split

    def _rewalk(self, node: TreeNode) -> None:
        """``_walk`` again for the same key object in a tree of the same shape: renew the LRU
        stamps of the path that ends at ``node``, comparing no token. The scheduler asks this
        at every step for the request at the head of the queue while it does not fit."""
        walker = node
        while walker is not self.root:
            self._touch(walker)
            walker = walker.parent
        self.root.last_access = self.clock

    def _next(self, node: TreeNode, key: tuple[int, ...], pos: int) -> TreeNode | None:
        """The child of ``node`` whose edge starts with ``key``'s page at ``pos``, where a
        match may go on."""
        return node.children.get(self._pages.at(key, pos))

    def _touch(self, node: TreeNode) -> None:
        """``node`` was just used: renew its LRU stamp; a leaf goes back on the heap."""
        node.last_access = self.clock
        self._push(node)

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut ``child``'s edge after ``at`` tokens; return the new upper node.

        The old node object keeps the lower part, so a caller holding it (e.g. a lock taken
        before the split) still refers to the same prefix end. The upper node inherits the
        lock count, since every lock on ``child`` also covered its whole edge; sizes do not
        change.
        """
        parent = child.parent
        assert parent is not None  # the root is never split: its edge is empty
        upper = self.node_type(next(self._ids), child.key[:at], child.value[:at], parent,
                               child.last_access)
        upper.lock_ref = child.lock_ref
        child.key = child.key[at:]
        child.value = child.value[at:]
        child.parent = upper
        upper.children[self._pages.at(child.key, 0)] = child
        parent.children[self._pages.at(upper.key, 0)] = upper
        self.n_nodes += 1
        self._shape += 1
        return upper

    # ------------------------------------------------------------ reference counts
    @reports_path("lock")
    def lock(self, node: TreeNode, *, tag: str = "") -> None:
        """One more running request uses the prefix ending at ``node``: protect the path.

        A node whose count goes from 0 to 1 moves its tokens from evictable to protected.
        """
        self._check_live(node)
        walker: TreeNode | None = node
        while walker is not None and walker is not self.root:
            if walker.lock_ref == 0:
                self._evictable -= len(walker.key)
                self._protected += len(walker.key)
            walker.lock_ref += 1
            walker = walker.parent

    @reports_path("unlock")
    def unlock(self, node: TreeNode, *, tag: str = "") -> None:
        """Undo one ``lock(node)``; nodes whose count drops to 0 become evictable again."""
        self._check_live(node)
        if node is not self.root and node.lock_ref == 0:
            raise ValueError(f"unlock of node {node.id}, which is not locked")
        walker: TreeNode | None = node
        while walker is not None and walker is not self.root:
            walker.lock_ref -= 1
            if walker.lock_ref == 0:
                self._protected -= len(walker.key)
                self._evictable += len(walker.key)
                self._push(walker)
            walker = walker.parent

    def _check_live(self, node: TreeNode) -> None:
        if not isinstance(node, TreeNode):
            raise ValueError(f"expected a TreeNode from match_prefix, got {node!r}")
        if node.removed:
            raise ValueError(f"node {node.id} was evicted; match the prefix again")
        walker = node
        while walker.parent is not None:
            walker = walker.parent
        if walker is not self.root:
            raise ValueError(f"node {node.id} belongs to another cache")

    # ------------------------------------------------------------------ eviction
    @reports_evicted
    def evict(self, n_tokens: int, *, tag: str = "") -> int:
        """Remove least-recently-used unlocked leaves until ``n_tokens`` are freed; return
        the tokens freed: slightly more, since whole leaves go, or fewer when the tree has not
        enough evictable tokens. A parent left as an unlocked leaf becomes a candidate in
        turn. Each removed node's values go to ``on_evict``."""
        n_tokens = check_int("evict's token count", n_tokens, minimum=0)
        freed = 0
        while freed < n_tokens and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if not self._evictable_leaf(node) or stamp != node.last_access:
                continue  # stale entry
            parent = node.parent
            self._remove_leaf(node)
            freed += len(node.key)
            if self.on_evict is not None:
                self.on_evict(node.value)
            if not parent.children:
                self._push(parent)
        return freed

    def _remove_leaf(self, node: TreeNode) -> None:
        """Take the unlocked leaf ``node`` out of the tree (its values are not freed here)."""
        parent = node.parent
        assert parent is not None  # the root is never evicted
        del parent.children[self._pages.at(node.key, 0)]
        node.removed = True
        node.parent = None
        self.n_nodes -= 1
        self._shape += 1
        self._evictable -= len(node.key)

    def _evictable_leaf(self, node: TreeNode) -> bool:
        return (not node.removed and node is not self.root and not node.children
                and node.lock_ref == 0)

    def _push(self, node: TreeNode) -> None:
        """Offer ``node`` to the eviction heap (checked again when popped)."""
        self._offer(self._heap, self._evictable_leaf, node)

    def _offer(self, heap: list, evictable: Callable[[TreeNode], bool], node: TreeNode) -> None:
        """Push ``node`` onto an LRU ``heap`` if ``evictable``; stale entries are skipped when
        popped, and dropped here once the heap outgrows the tree twice over (in place, so
        every tier's heap shares this)."""
        if not evictable(node):
            return
        heapq.heappush(heap, (node.last_access, next(self._seq), node))
        if len(heap) > 2 * self.n_nodes + 64:
            heap[:] = [entry for entry in heap
                       if evictable(entry[2]) and entry[0] == entry[2].last_access]
            heapq.heapify(heap)

    # --------------------------------------------------------------------- sizes
    def size_info(self) -> SizeInfo:
        """Evictable and protected token counts, kept up to date by every operation."""
        return SizeInfo(self._evictable, self._protected)

    def reset(self) -> None:
        """Drop every unlocked node (their values go to ``on_evict``)."""
        self.evict(self._evictable)

    # ------------------------------------------------------------ introspection
    def nodes(self) -> list[TreeNode]:
        """All nodes, root first, parents before children (depth-first)."""
        out: list[TreeNode] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(sorted(node.children.values(), key=lambda c: self._pages.at(c.key, 0),
                                reverse=True))
        return out

    def cached_sequences(self) -> list[tuple[int, ...]]:
        """The token sequence spelled by every leaf: what the cache can serve in full."""
        return [self.prefix_of(n) for n in self.nodes() if n is not self.root and not n.children]

    def prefix_of(self, node: TreeNode) -> tuple[int, ...]:
        """The tokens on the path from the root to ``node``."""
        parts: list[tuple[int, ...]] = []
        walker: TreeNode | None = node
        while walker is not None:
            parts.append(walker.key)
            walker = walker.parent
        return tuple(t for part in reversed(parts) for t in part)

    def snapshot(self) -> tuple[NodeView, ...]:
        """A frozen copy of the tree (root first), for drawing it later."""
        return tuple(self._view(node) for node in self.nodes())

    def _view(self, node: TreeNode) -> NodeView:
        parent = None if node.parent is None else node.parent.id
        return NodeView(node.id, parent, node.key, node.lock_ref, node.last_access,
                        self.tier_of(node))

    def tier_of(self, node: TreeNode) -> str:
        """Where ``node``'s KV lives: ``"device"`` (a one-tier tree keeps nothing else)."""
        return "device"

    def _path_to(self, node: TreeNode) -> tuple[int, ...]:
        """The ids of the nodes from below the root down to ``node``, top first."""
        ids: list[int] = []
        while node is not None and node is not self.root:
            ids.append(node.id)
            node = node.parent
        return tuple(reversed(ids))

    def _values_to(self, node: TreeNode) -> list[Any]:
        """The values (KV slots) of the prefix that ends at ``node``, in order."""
        parts: list[list[Any]] = []
        while node is not self.root:
            parts.append(node.value)
            node = node.parent
        return list(itertools.chain.from_iterable(reversed(parts)))

    def _report(self, op: str, tag: str, length: int, end: TreeNode,
                split: tuple[int, ...] = (), inserted: tuple[int, ...] = (),
                evicted: tuple[NodeView, ...] = ()) -> None:
        """Tell the listener, if any, of an operation whose path ends at ``end`` (root: none)."""
        if self.listener is not None:
            self.listener(self, TreeEvent(op, tag, length, self._path_to(end), split, inserted,
                                          evicted))

    def __repr__(self) -> str:
        info = self.size_info()
        page = "" if self.page_size == 1 else f", page_size={self.page_size}"
        return (f"RadixCache(nodes={self.n_nodes}, evictable={info.evictable}, "
                f"protected={info.protected}{page})")

