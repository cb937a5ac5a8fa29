"""What the radix tree reports to a listener, and the wrappers that report it.

Like SGLang publishing KV-cache events, ``RadixCache`` tells an optional ``listener`` about
each operation (what it matched, split, inserted, locked or evicted) as a ``TreeEvent``; the
book's recorder (``minisrv.viz.radix.TreeRecorder``) is such a listener. ``lock``,
``unlock`` and ``evict`` are wrapped here (``reports_path``, ``reports_evicted``), so their
bodies hold only the idea, and nothing is worked out for a report nobody reads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

if TYPE_CHECKING:
    from minisrv.kv.cache import PrefixCache, TreeNode

__all__ = ["NodeView", "TreeEvent", "TreeListener", "reports_evicted", "reports_path"]

Method = TypeVar("Method", bound=Callable[..., Any])


class NodeView(NamedTuple):
    """A frozen copy of one node, for drawings of past states of the tree."""

    id: int  # node id (the root is 0)
    parent: int | None  # parent's id; None for the root
    key: tuple[int, ...]  # the edge's tokens
    lock_ref: int  # running requests using this node
    last_access: int  # logical clock of the last match or insert that walked here
    tier: str = "device"  # where its KV lives: "device", "host" or "both" (the host tier)


class TreeEvent(NamedTuple):
    """What one operation did, as reported to the tree's ``listener``."""

    op: str  # "match", "insert", "lock", "unlock" or "evict"
    tag: str  # the caller's ``tag`` argument (e.g. the request served), else ""
    length: int  # tokens matched, already cached, locked/unlocked, or freed
    path: tuple[int, ...]  # ids of the nodes walked, root excluded, in order
    split: tuple[int, ...]  # ids of nodes created by splitting an edge
    inserted: tuple[int, ...]  # ids of new leaves
    evicted: tuple[NodeView, ...]  # nodes removed, as they were just before


class TreeListener(Protocol):
    """Anything told about each operation right after it ran (the tree is already updated)."""

    def __call__(self, tree: PrefixCache, event: TreeEvent) -> None: ...


def reports_path(op: str) -> Callable[[Method], Method]:
    """Wrap ``lock``/``unlock(node)``: after it ran, report the path from the root to
    ``node`` and its length in tokens to the tree's listener, if it has one."""

    def wrap(method: Method) -> Method:
        @functools.wraps(method)
        def reported(self: Any, node: TreeNode, *, tag: str = "") -> None:
            method(self, node, tag=tag)
            if self.listener is not None:
                self._report(op, tag, len(self.prefix_of(node)), node)

        return reported  # type: ignore[return-value]

    return wrap


def reports_evicted(method: Method) -> Method:
    """Wrap ``evict(n_tokens)``: when the tree has a listener, keep a view of every node
    just before ``_remove_leaf`` removes it, and report them with the tokens freed."""

    @functools.wraps(method)
    def reported(self: Any, n_tokens: int, *, tag: str = "") -> int:
        if self.listener is None:
            return method(self, n_tokens, tag=tag)
        evicted: list[NodeView] = []
        remove = type(self)._remove_leaf

        def remove_and_keep(node: TreeNode) -> None:
            evicted.append(self._view(node))
            remove(self, node)

        self._remove_leaf = remove_and_keep  # this call only: the class's method again after
        try:
            freed = method(self, n_tokens, tag=tag)
        finally:
            del self._remove_leaf
        if freed or n_tokens:
            self._report("evict", tag, freed, self.root, evicted=tuple(evicted))
        return freed

    return reported  # type: ignore[return-value]
