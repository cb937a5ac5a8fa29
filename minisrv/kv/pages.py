"""Page arithmetic for a tree of token runs (the radix tree and its host tier).

With pages of more than one token, SGLang's radix tree (``mem_cache/radix_cache.py``) keys a
node's children by their first page, compares keys page by page and cuts every match and
insert to whole pages. ``Pages`` holds those three rules, so the tree's own code reads the
same at any page size (at one token per page each is the plain token-level rule).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Pages"]


class Pages:
    """The rules of pages of ``size`` tokens for keys that are tuples of token ids."""

    def __init__(self, size: int) -> None:
        self.size = size

    def whole(self, key: tuple[int, ...]) -> tuple[int, ...]:
        """``key`` without its last partial page."""
        cut = len(key) % self.size
        return key[:len(key) - cut] if cut else key

    def at(self, key: tuple[int, ...], pos: int) -> Any:
        """What children are keyed by: the token at ``pos`` (pages of one token) or the page
        starting there (a tuple, shorter than a page where ``key`` ends first)."""
        return key[pos] if self.size == 1 else key[pos:pos + self.size]

    def matched(self, edge: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        """Leading tokens of ``edge`` that equal ``key[pos:]``, in whole pages (at least one
        page: the child was found by its first one). A whole-edge match is one tuple
        comparison."""
        n = len(edge)
        if key[pos:pos + n] == edge:
            return n
        matched, limit = 1, min(n, len(key) - pos)
        while matched < limit and edge[matched] == key[pos + matched]:
            matched += 1
        return matched - matched % self.size
