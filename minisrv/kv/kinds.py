"""The prefix caches ``Engine(cache=...)`` chooses from, and the one call that builds one.

Kept apart from both the interface (``cache.py``) and the caches (``radix.py``,
``blocks.py``), so each of them imports only what it builds on and no module imports its
own importer.
"""

from __future__ import annotations

from typing import Literal

from minisrv.checks import check_choice, check_int
from minisrv.kv.blocks import BlockCache
from minisrv.kv.cache import EvictCallback, NoCache, PrefixCache
from minisrv.kv.radix import RadixCache

__all__ = ["CACHES", "Cache", "make_cache"]

Cache = Literal["none", "radix", "blocks"]
CACHES: tuple[Cache, ...] = ("none", "radix", "blocks")
"""``Engine(cache=...)``: no prefix cache, RadixAttention's tree (SGLang), or full blocks
found by chained hashes (vLLM V1)."""


def make_cache(kind: Cache, on_evict: EvictCallback | None = None,
               page_size: int = 1) -> PrefixCache:
    """The cache named by ``Engine(cache=...)``; ``on_evict`` frees the slots it evicts,
    ``page_size`` is the unit it caches in (``EngineConfig.page_size``): the radix tree's
    pages, the block cache's blocks."""
    check_choice("cache", kind, CACHES)
    check_int("page_size", page_size, minimum=1)
    if kind == "blocks":
        return BlockCache(page_size, on_evict=on_evict)
    return RadixCache(on_evict=on_evict, page_size=page_size) if kind == "radix" else NoCache()
