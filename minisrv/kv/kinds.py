"""The prefix caches ``Engine(cache=...)`` chooses from, and the one call that builds one.

Kept apart from both the interface (``cache.py``) and the tree (``radix.py``), so each of
them imports only what it builds on and no module imports its own importer.
"""

from __future__ import annotations

from typing import Literal

from minisrv.checks import check_choice
from minisrv.kv.cache import EvictCallback, NoCache, PrefixCache
from minisrv.kv.radix import RadixCache

__all__ = ["CACHES", "Cache", "make_cache"]

Cache = Literal["none", "radix"]
CACHES: tuple[Cache, ...] = ("none", "radix")
"""``Engine(cache=...)``: RadixAttention's tree, or no prefix cache at all."""


def make_cache(kind: Cache, on_evict: EvictCallback | None = None,
               page_size: int = 1) -> PrefixCache:
    """The cache named by ``Engine(cache=...)``; ``on_evict`` frees the radix tree's slots,
    ``page_size`` is the unit it caches in (``EngineConfig.page_size``)."""
    check_choice("cache", kind, CACHES)
    return RadixCache(on_evict=on_evict, page_size=page_size) if kind == "radix" else NoCache()
