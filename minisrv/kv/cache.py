"""The interface every prefix cache implements, and the cache that keeps nothing.

A prefix cache maps token sequences to the KV slots already computed for them. The scheduler
talks to it through ``PrefixCache`` alone, so RadixAttention's tree (``minisrv.kv.radix``),
vLLM's block-hash cache (``minisrv.kv.blocks``) and ``NoCache`` (no reuse at all:
``Engine(cache="none")``) are interchangeable, as in
mini-sglang's ``kvcache/base.py``. The small result types name each field, so a reader of
the scheduler sees what a match returns without opening the tree. ``kinds.py`` builds the
cache ``Engine(cache=...)`` names; ``events.py`` holds what the tree reports to a listener.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from minisrv.checks import check_int

__all__ = [
    "EvictCallback",
    "TreeNode",
    "MatchResult",
    "SizeInfo",
    "HostMatch",
    "PrefixCache",
    "NoCache",
]

EvictCallback = Callable[[list[Any]], None]


class TreeNode:
    """One node of the tree: the edge from its parent (``key``, a token run) and its KV.

    ``value[i]`` is the KV slot (or any payload) of token ``key[i]``. ``children`` is keyed by
    each child's first token, which is unique among siblings in a radix tree, so a lookup
    costs one dict access per edge.
    """

    __slots__ = ("id", "key", "value", "parent", "children", "lock_ref", "last_access",
                 "removed")

    def __init__(self, node_id: int, key: tuple[int, ...], value: list[Any],
                 parent: TreeNode | None, last_access: int) -> None:
        self.id = node_id
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = last_access
        self.removed = False  # set on eviction: the node no longer belongs to the tree

    @property
    def is_leaf(self) -> bool:
        """True when no edge continues below this node."""
        return not self.children

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, tokens={len(self.key)}, lock_ref={self.lock_ref}, "
                f"last_access={self.last_access})")


class MatchResult(NamedTuple):
    """What ``match_prefix`` found."""

    length: int  # leading tokens of the query whose KV is cached
    node: TreeNode  # node where the match ends (the root when nothing matched); lock it
    values: list[Any]  # the cached value (KV slot) of each of those ``length`` tokens


class SizeInfo(NamedTuple):
    """How the cached tokens split between what may and may not be evicted."""

    evictable: int  # tokens on unlocked nodes: memory the scheduler can reclaim
    protected: int  # tokens on locked paths: in use by running requests

    @property
    def total(self) -> int:
        """All cached tokens."""
        return self.evictable + self.protected


class HostMatch(NamedTuple):
    """The host-only nodes that continue a device match, and the tokens they hold."""

    nodes: tuple[TreeNode, ...]
    length: int


def insert_key(tokens: Sequence[int], values: Sequence[Any] | None) -> tuple[int, ...]:
    """``tokens`` as a tree key, after checking that ``values`` (if any) gives one KV slot per
    token: a tree told otherwise would hand out slots that belong to other tokens."""
    key = tuple(tokens)
    if values is not None and len(values) != len(key):
        raise ValueError(f"insert got {len(key)} tokens but {len(values)} values; "
                         "give one value (KV slot) per token")
    return key


class PrefixCache(ABC):
    """The interface the engine uses, so ``RadixCache``, ``BlockCache`` and ``NoCache`` are
    interchangeable.

    Ownership of values (KV slots): ``insert(tokens, values)`` returns ``k``, the number of
    leading tokens that were already cached. The cache keeps ``values[k:]`` up to the last
    whole page and hands them to ``on_evict`` when it evicts them; ``values[:k]`` duplicate
    what the tree already holds and, with a last partial page, stay the caller's to free.
    """

    root: TreeNode
    page_size: int = 1  # the cache matches, inserts and evicts whole pages of this many tokens

    @abstractmethod
    def match_prefix(self, tokens: Sequence[int], *, tag: str = "") -> MatchResult:
        """Longest cached prefix of ``tokens``."""

    @abstractmethod
    def insert(self, tokens: Sequence[int], values: Sequence[Any] | None = None, *,
               tag: str = "", inserted_len: int = 0) -> int:
        """Cache ``tokens``; return how many leading tokens were already cached.

        ``inserted_len``: how many leading tokens the inserting request inserted before
        (SGLang's ``InsertParams.inserted_len``). A cache that counts hits counts only the
        nodes past it, so a request inserting again (its next chunk, its finish) counts no
        node twice; the others ignore it.
        """

    @abstractmethod
    def cached_length(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` ``match_prefix`` would find on the device,
        changing nothing: no edge split, no LRU stamp. It is what a router fed by the cache's
        events could know (``Router(match_source="caches")``); a lookup that touched the path
        would change what the cache evicts next."""

    @abstractmethod
    def lock(self, node: TreeNode, *, tag: str = "") -> None:
        """Protect ``node`` and its ancestors from eviction (one more user)."""

    @abstractmethod
    def unlock(self, node: TreeNode, *, tag: str = "") -> None:
        """Undo one ``lock(node)``."""

    @abstractmethod
    def evict(self, n_tokens: int, *, tag: str = "") -> int:
        """Free at least ``n_tokens`` if possible; return the tokens actually freed."""

    @abstractmethod
    def size_info(self) -> SizeInfo:
        """Evictable and protected token counts."""

    def nodes(self) -> list[TreeNode]:
        """Every node holding cached KV, root first (a cache without a tree: its root)."""
        return [self.root]

    # ------------------------------------------------ the host tier's hooks (no-ops here)
    # A cache with a host tier (``kv/hiradix.py``) overrides these; ``KVManager`` calls
    # them on every cache, so it never asks which kind it holds.
    def host_match_length(self, node: TreeNode, tokens: Sequence[int], start: int) -> int:
        """Tokens of ``tokens`` past ``start`` (a device match ending at ``node``) held in
        host memory only, without changing anything: none without a host tier."""
        return 0

    def match_host(self, node: TreeNode, tokens: Sequence[int], start: int) -> HostMatch:
        """The host-only nodes continuing a device match of ``start`` tokens at ``node``."""
        return HostMatch((), 0)

    def load(self, found: HostMatch, device_slots: Sequence[Any]) -> TreeNode:
        """Put ``found``'s nodes back on the device in ``device_slots``; the last node."""
        raise ValueError("a cache without a host tier has nothing to load")

    def check_tiers(self) -> None:
        """``AssertionError`` if the tiers disagree (one tier: nothing to compare)."""
        return None

    def evictable_size(self) -> int:
        """Tokens that ``evict`` could free right now."""
        return self.size_info().evictable

    def protected_size(self) -> int:
        """Tokens locked by running requests."""
        return self.size_info().protected

    def total_size(self) -> int:
        """All cached tokens."""
        return self.size_info().total


class NoCache(PrefixCache):
    """The same interface, caching nothing: every prompt is prefilled in full.

    ``insert`` reports every token as "already cached", which under the ownership rule of
    ``PrefixCache`` means the caller keeps (and frees) all its values: nothing is retained.
    """

    def __init__(self) -> None:
        self.root = TreeNode(0, (), [], None, 0)

    def match_prefix(self, tokens: Sequence[int], *, tag: str = "") -> MatchResult:
        """Nothing is ever cached: length 0 at the root."""
        return MatchResult(0, self.root, [])

    def cached_length(self, tokens: Sequence[int]) -> int:
        """Nothing is ever cached."""
        return 0

    def insert(self, tokens: Sequence[int], values: Sequence[Any] | None = None, *,
               tag: str = "", inserted_len: int = 0) -> int:
        """Keep nothing; the caller remains the owner of all ``values``."""
        if values is not None and len(values) != len(tokens):
            raise ValueError(f"insert got {len(tokens)} tokens but {len(values)} values; "
                             "give one value (KV slot) per token")
        return len(tokens)

    def lock(self, node: TreeNode, *, tag: str = "") -> None:
        """Only the root exists; locking it protects nothing."""
        if node is not self.root:
            raise ValueError("NoCache has no nodes but its root to lock")

    def unlock(self, node: TreeNode, *, tag: str = "") -> None:
        """Only the root exists; unlocking it releases nothing."""
        if node is not self.root:
            raise ValueError("NoCache has no nodes but its root to unlock")

    def evict(self, n_tokens: int, *, tag: str = "") -> int:
        """Nothing to free."""
        check_int("evict's token count", n_tokens, minimum=0)
        return 0

    def size_info(self) -> SizeInfo:
        """Always empty."""
        return SizeInfo(0, 0)

    def __repr__(self) -> str:
        return "NoCache()"
