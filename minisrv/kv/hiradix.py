"""The radix tree over two tiers: each node's KV on the device, in host memory, or both.

RadixAttention drops what it evicts. With a host tier (SGLang's HiCache:
``mem_cache/unified_radix_cache.py`` in 0.5.23, ``hiradix_cache.py`` earlier) eviction from
the device *moves* a node's KV to host memory when the node has a host copy, so a later
request that matches it copies it back instead of recomputing it. The tree's shape stays the
same; each node records where its KV lives:

* ``value``, its device slots (empty once the device evicted it), and
* ``host_value``, its host slots (``None`` until it is backed up).

The device part is closed upwards: a node on the device has its parent on the device, so a
match walks device nodes first (``match_prefix``, what the scheduler may use at once) and
may go on through host-only nodes (``match_host``: what a load-back would bring back). A
device *leaf* is a device node with no child on the device; device eviction takes those,
least recently used first, and a host-only *leaf* (no child at all) is what host eviction
takes, in its own LRU order. A locked node is always on the device and never evicted from
either tier; a node loaded back is locked by the request it was loaded for.

When a node gets its host copy is the write policy (``HOST_POLICIES``):

* ``write_through``: as soon as it is cached (every prefix is backed up, PCIe traffic for
  all of them, and an eviction costs nothing);
* ``write_through_selective``: once the inserts of two requests reached it (SGLang's rule,
  below: only prefixes cached again are copied);
* ``write_back``: only when the device evicts it (the least traffic; the eviction waits for
  its copy).

Hits are counted as SGLang 0.5.23 counts them (``_inc_hit_count_and_check``,
``_finish_insert_walk_node`` and ``_should_backup_after_insert`` in
``mem_cache/unified_cache/unified_tree_core.py``): an insert adds one to every node it walks
through, a host-only one it fills again included, and to the leaf it adds, but only to the
nodes that end past what the same request inserted before (``inserted_len``, SGLang's
``req.kv.cache_inserted_len``). A request inserts after each prefill chunk and when it
finishes, and counts each node once across them; a node reaches a second count only when
another request, such as the chat's next turn, inserts through it. The write threshold
(``BACKUP_HITS``) is SGLang's ``write_through_threshold`` in
``mem_cache/unified_radix_cache.py``: 1 for ``write_through``, 2 for the selective policy. A
node the device drops (no host copy) takes its count with it: the same tokens cached again
start a new node at one.

A device eviction of a node without a host copy drops it, and with it its host-only
subtree (which no match could reach any more). Copies are queued in the host pool's plan
(``minisrv.kv.host``) and run right before the next step.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

from minisrv.checks import check_choice, check_int
from minisrv.kv.cache import EvictCallback, HostMatch, TreeNode, insert_key
from minisrv.kv.events import TreeListener, reports_evicted
from minisrv.kv.host import HOST_POLICIES, HostPool
from minisrv.kv.radix import RadixCache

__all__ = ["HiRadixCache", "HiTreeNode", "HostMatch"]

BACKUP_HITS = {"write_through": 1, "write_through_selective": 2}
"""A node without a host copy is backed up at this many hits (SGLang's
``write_through_threshold``); ``write_back`` counts none and copies at eviction."""


class HiTreeNode(TreeNode):
    """A tree node that also knows its host copy and how often requests hit it."""

    __slots__ = ("host_value", "hits")

    def __init__(self, node_id: int, key: tuple[int, ...], value: list[Any],
                 parent: TreeNode | None, last_access: int) -> None:
        super().__init__(node_id, key, value, parent, last_access)
        self.host_value: list[int] | None = None  # host slots, one per token, once backed up
        self.hits = 0  # requests whose inserts walked through this node or added it


class HiRadixCache(RadixCache):
    """A ``RadixCache`` whose evicted nodes may live on in a ``HostPool``.

    Args:
        host: the host tier's pool (its slots; its tensors when the device pool has some).
        policy: one of ``HOST_POLICIES``.
        on_evict: frees device slots (the engine's allocator), as for ``RadixCache``.
        listener: told about every operation, as for ``RadixCache``.

    ``size_info`` counts device tokens only (what device eviction could free);
    ``host_size`` the tokens with a host copy. ``backups`` and ``backed_up_tokens`` count
    the copies to the host, ``host_evicted_tokens`` the host copies dropped for room.
    """

    node_type = HiTreeNode

    def __init__(self, host: HostPool, policy: str = "write_through",
                 on_evict: EvictCallback | None = None,
                 listener: TreeListener | None = None, page_size: int = 1) -> None:
        super().__init__(on_evict, listener, page_size)
        if host.allocator.page_size != self.page_size:
            raise ValueError(f"the host pool's pages hold {host.allocator.page_size} tokens, "
                             f"the tree's {self.page_size}")
        self.host = host
        self.policy = check_choice("host_cache_policy", policy, HOST_POLICIES)
        self.backups = 0
        self.backed_up_tokens = 0
        self.host_evicted_tokens = 0
        self._host_heap: list[tuple[int, int, HiTreeNode]] = []

    # ----------------------------------------------------------------- where KV lives
    def on_device(self, node: TreeNode) -> bool:
        """True when ``node``'s KV is in device slots (the root always is)."""
        return node is self.root or bool(node.value)

    def tier_of(self, node: TreeNode) -> str:
        """``"device"``, ``"host"`` or ``"both"``."""
        host = getattr(node, "host_value", None) is not None
        if not self.on_device(node):
            return "host"
        return "both" if host else "device"

    def host_size(self) -> int:
        """Tokens with a host copy (host slots in use)."""
        return self.host.used_count

    def _next(self, node: TreeNode, key: tuple[int, ...], pos: int) -> TreeNode | None:
        """A device match goes on only through children on the device."""
        child = node.children.get(self._pages.at(key, pos))
        return child if child is not None and child.value else None

    # ----------------------------------------------------------------- insert
    def insert(self, tokens: Sequence[int], values: Sequence[Any] | None = None, *,
               tag: str = "", inserted_len: int = 0) -> int:
        """``RadixCache.insert``, where host-only nodes on the path take the new device
        slots (their KV is on the device again, and on the host as before), and the nodes
        walked through and the new leaf count a hit where they end past ``inserted_len``
        (``_count_insert``).

        Returns the tokens already cached *on the device*: the caller keeps and frees
        ``values[:returned]``, the tree keeps the rest, as ``PrefixCache`` says.
        """
        key = self._pages.whole(insert_key(tokens, values))
        self.clock += 1
        node, length, split = self._walk(key)
        walked = self._nodes_to(node)
        vals = [None] * len(key) if values is None else list(values[:len(key)])
        pos, split_ids = length, [node.id] if split else []
        while pos < len(key) and (child := node.children.get(self._pages.at(key, pos))) is not None:
            matched = self._pages.matched(child.key, key, pos)
            cut = matched < len(child.key)
            if cut:
                child = self._split(child, matched)
                split_ids.append(child.id)
            self._to_device(child, vals[pos:pos + matched])
            walked.append(child)
            pos, node = pos + matched, child
            if cut:
                break
        inserted: tuple[int, ...] = ()
        if pos < len(key):
            node = self._add_leaf(node, key[pos:], vals[pos:])
            inserted = (node.id,)
            walked.append(node)
        self._count_insert(walked, inserted_len)
        self._report("insert", tag, length, node, tuple(split_ids), inserted=inserted)
        return length

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """``RadixCache._split``, the host copy and the hit count split along with it."""
        upper = super()._split(child, at)
        assert isinstance(child, HiTreeNode) and isinstance(upper, HiTreeNode)
        upper.hits = child.hits
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:at], child.host_value[at:]
        return upper

    # ----------------------------------------------------------------- the host part of a match
    def match_host(self, node: TreeNode, tokens: Sequence[int], start: int) -> HostMatch:
        """The host-only nodes that continue ``tokens`` below ``node`` (where a device match
        of ``start`` tokens ended), splitting the last edge if the match ends inside it."""
        key = self._pages.whole(tuple(tokens))
        found: list[HiTreeNode] = []
        pos = start
        while pos < len(key) and (child := node.children.get(self._pages.at(key, pos))) is not None:
            matched = self._pages.matched(child.key, key, pos)
            if matched < len(child.key):
                child = self._split(child, matched)
            assert isinstance(child, HiTreeNode)
            child.last_access = self.clock
            found.append(child)
            pos, node = pos + matched, child
            if matched < len(child.key):
                break
        return HostMatch(tuple(found), pos - start)

    def host_match_length(self, node: TreeNode, tokens: Sequence[int], start: int) -> int:
        """How many tokens ``match_host`` would find, without splitting or touching a node."""
        key, pos = self._pages.whole(tuple(tokens)), start
        while pos < len(key) and (child := node.children.get(self._pages.at(key, pos))) is not None:
            matched = self._pages.matched(child.key, key, pos)
            pos, node = pos + matched, child
            if matched < len(child.key):
                break
        return pos - start

    def load(self, found: HostMatch, device_slots: Sequence[int]) -> TreeNode:
        """Put ``found``'s nodes back on the device, in ``device_slots`` (one per token, in
        order), queueing the copies from their host slots; return the last node (lock it)."""
        if len(device_slots) != found.length:
            raise ValueError(f"load of {found.length} tokens got {len(device_slots)} slots")
        offset = 0
        for node in found.nodes:
            assert isinstance(node, HiTreeNode)
            assert node.host_value is not None and not self.on_device(node)
            slots = list(device_slots[offset:offset + len(node.key)])
            self.host.load(node.host_value, slots)
            self._to_device(node, slots)
            offset += len(node.key)
        return found.nodes[-1]

    def _to_device(self, node: TreeNode, slots: list[Any]) -> None:
        """A host-only node gets device slots again (its host copy stays)."""
        node.value = slots
        self._evictable += len(node.key)
        self._shape += 1
        self._touch(node)

    # ----------------------------------------------------------------- hits and backups
    def _nodes_to(self, node: TreeNode) -> list[TreeNode]:
        """The nodes from below the root down to ``node``, top first."""
        path: list[TreeNode] = []
        while node is not self.root:
            path.append(node)
            assert node.parent is not None
            node = node.parent
        return path[::-1]

    def _count_insert(self, walked: Sequence[TreeNode], inserted_len: int) -> None:
        """An insert walked through ``walked`` (top first, then the leaf it added, if any):
        each node that ends past ``inserted_len``, the tokens this request inserted before,
        is hit once more; a node that ends within them was counted by this request's earlier
        insert. A node without a host copy is backed up once its hits reach the policy's
        ``BACKUP_HITS``, parents before children. ``write_back`` counts nothing, as in
        SGLang."""
        threshold = BACKUP_HITS.get(self.policy)
        if threshold is None:
            return
        end = 0
        for node in walked:
            assert isinstance(node, HiTreeNode)
            end += len(node.key)
            if end <= inserted_len:
                continue
            node.hits += 1
            if node.host_value is None and node.hits >= threshold:
                self._backup(node)

    def _backup(self, node: HiTreeNode) -> bool:
        """Give ``node`` a host copy (host LRU eviction first if the host is short); False,
        changing nothing, when even that leaves too little room."""
        n = len(node.key)
        if n > self.host.capacity:
            return False
        if n > self.host.free_count:
            self.evict_host(n - self.host.free_count)
        if n > self.host.free_count:
            return False
        node.host_value = self.host.allocator.alloc(n)
        self.host.backup(node.value, node.host_value)
        self.backups += 1
        self.backed_up_tokens += n
        return True

    # ----------------------------------------------------------------- device eviction
    def _evictable_leaf(self, node: TreeNode) -> bool:
        """A device leaf: on the device, unlocked, no child on the device."""
        return (not node.removed and node is not self.root and bool(node.value)
                and node.lock_ref == 0
                and not any(child.value for child in node.children.values()))

    @reports_evicted
    def evict(self, n_tokens: int, *, tag: str = "") -> int:
        """Free at least ``n_tokens`` device slots (returned: the slots freed), LRU device
        leaves first: one with a host copy moves to the host (``write_back`` copies it now),
        one without is dropped with its host-only subtree."""
        n_tokens = check_int("evict's token count", n_tokens, minimum=0)
        freed = 0
        while freed < n_tokens and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if not self._evictable_leaf(node) or stamp != node.last_access:
                continue  # stale entry
            parent, slots = node.parent, node.value
            if node.host_value is None and self.policy == "write_back":
                self._backup(node)
            if node.host_value is not None:
                self._move_to_host(node)
            else:
                self._drop_subtree(node)
                self._remove_leaf(node)
            freed += len(slots)
            if self.on_evict is not None:
                self.on_evict(slots)
            if parent is not None:
                self._push(parent)
        return freed

    def _move_to_host(self, node: HiTreeNode) -> None:
        """``node`` gives up its device slots (the caller frees them) and stays in the tree,
        on the host only, a candidate for the host's LRU."""
        node.value = []
        self._evictable -= len(node.key)
        self._shape += 1
        self._push_host(node)

    def _drop_subtree(self, node: TreeNode) -> None:
        """Free the host copies of ``node``'s descendants (all host-only) and cut them off."""
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            assert isinstance(child, HiTreeNode) and not child.value
            stack.extend(child.children.values())
            self._free_host(child)
            child.removed, child.parent = True, None
            self.n_nodes -= 1
        node.children = {}
        self._shape += 1

    # ----------------------------------------------------------------- host eviction
    def evict_host(self, n_tokens: int) -> int:
        """Drop least recently used host-only leaves until ``n_tokens`` host slots are
        free; a parent left a host-only leaf becomes a candidate. Returns the slots freed."""
        freed = 0
        while freed < n_tokens and self._host_heap:
            stamp, _, node = heapq.heappop(self._host_heap)
            if not self._host_leaf(node) or stamp != node.last_access:
                continue
            parent = node.parent
            assert parent is not None
            freed += self._free_host(node)
            del parent.children[self._pages.at(node.key, 0)]
            node.removed, node.parent = True, None
            self.n_nodes -= 1
            self._shape += 1
            self._push_host(parent)
            self._push(parent)
        self.host_evicted_tokens += freed
        return freed

    def _free_host(self, node: HiTreeNode) -> int:
        if node.host_value is None:
            return 0
        self.host.allocator.free(node.host_value)
        n, node.host_value = len(node.host_value), None
        return n

    def _host_leaf(self, node: TreeNode) -> bool:
        return (not node.removed and node is not self.root and not node.value
                and not node.children and node.lock_ref == 0)

    def _push_host(self, node: TreeNode) -> None:
        self._offer(self._host_heap, self._host_leaf, node)

    def _touch(self, node: TreeNode) -> None:
        super()._touch(node)
        self._push_host(node)

    # ----------------------------------------------------------------- invariants
    def check_tiers(self) -> None:
        """Raise ``AssertionError`` naming the broken rule if the two tiers disagree.

        * every node but the root holds its KV somewhere: device slots, host slots, or both,
          one slot per token in each;
        * the device part is closed upwards (a device node's parent is on the device);
        * a locked node is on the device;
        * the host slots in use are exactly the nodes' host slots, none held twice.
        """
        nodes = self.nodes()
        held: list[int] = []
        for node in nodes[1:]:
            assert isinstance(node, HiTreeNode)
            host = node.host_value
            assert node.value or host is not None, f"node {node.id} has its KV nowhere"
            assert not node.value or len(node.value) == len(node.key), (
                f"node {node.id}: {len(node.value)} device slots for {len(node.key)} tokens")
            assert host is None or len(host) == len(node.key), (
                f"node {node.id}: {len(host or ())} host slots for {len(node.key)} tokens")
            assert not node.value or self.on_device(node.parent), (
                f"node {node.id} is on the device below a node that is not")
            assert node.lock_ref == 0 or node.value, f"locked node {node.id} is not on the device"
            held.extend(host or ())
        assert len(set(held)) == len(held), "a host slot belongs to two nodes"
        assert len(held) == self.host.used_count, (
            f"{len(held)} host slots held by nodes, {self.host.used_count} in use")
        assert all(self.host.allocator.is_used(s) for s in held), "a node holds a free host slot"

    def __repr__(self) -> str:
        info = self.size_info()
        return (f"HiRadixCache(nodes={self.n_nodes}, evictable={info.evictable}, "
                f"protected={info.protected}, host={self.host_size()}/{self.host.capacity}, "
                f"policy={self.policy!r})")
