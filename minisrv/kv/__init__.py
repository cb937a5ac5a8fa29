"""KV memory, one owner: the pool, its slot allocator, the prefix caches and ``KVManager``.

* ``allocator.py``: ``SlotAllocator``, which pages of token slots are free
  (``page_size`` slots each, 1 by default: ``EngineConfig.page_size``);
* ``pool.py``: ``KVPool``, the K and V tensors those slots index;
* ``cache.py``: ``PrefixCache``, the interface, its result types and ``NoCache``;
* ``radix.py``: ``RadixCache``, RadixAttention's tree; ``events.py``: what it reports;
* ``blocks.py``: ``BlockCache``, vLLM V1's full blocks found by chained hashes;
* ``kinds.py``: ``CACHES`` and ``make_cache`` for ``Engine(cache=...)``;
* ``table.py``: ``ReqToTokenTable``, each running request's slots (the only record of
  them), on the host and mirrored on the device;
* ``manager.py``: ``KVManager``, the only code that moves a request's slots.
"""

from minisrv.kv.allocator import SlotAllocator, check_free
from minisrv.kv.blocks import Block, BlockCache
from minisrv.kv.cache import EvictCallback, MatchResult, NoCache, PrefixCache, SizeInfo, TreeNode
from minisrv.kv.events import NodeView, TreeEvent, TreeListener
from minisrv.kv.kinds import CACHES, Cache, make_cache
from minisrv.kv.manager import KVManager
from minisrv.kv.pool import KVPool
from minisrv.kv.radix import RadixCache
from minisrv.kv.table import ReqToTokenTable

__all__ = [
    "Block",
    "BlockCache",
    "CACHES",
    "Cache",
    "EvictCallback",
    "KVManager",
    "KVPool",
    "MatchResult",
    "NoCache",
    "NodeView",
    "PrefixCache",
    "RadixCache",
    "ReqToTokenTable",
    "SizeInfo",
    "SlotAllocator",
    "TreeEvent",
    "TreeListener",
    "TreeNode",
    "check_free",
    "make_cache",
]
