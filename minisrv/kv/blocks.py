"""vLLM V1's prefix cache: full blocks of tokens found by a hash chained from their parent's.

RadixAttention (``radix.py``) keeps cached prefixes in a tree whose edges are token runs of
any length. vLLM V1 keeps no tree. Its KV lives in blocks of ``page_size`` tokens (16 by
default), and a *full* block is cached under a hash of its tokens and of its parent block's
hash; the first block's parent hash is a seed. Two prompts share a block exactly when
they share every token up to its end, so a dict from hash to block finds a prompt's cached
prefix one block at a time, and a hit is a run of full blocks: the tokens after the last
full block are always computed again. This module follows these vLLM files:

* ``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens`` (the chained hash of
  ``(parent hash, block tokens, extra keys)``; minisrv has no extra keys, no LoRA nor
  images), ``FreeKVCacheBlockQueue`` (every free block, taken from the head: cached ones
  least recently freed first; a request's blocks are freed in reverse order, so a chain's
  tail goes first);
* ``vllm/v1/core/block_pool.py``: ``cached_block_hash_to_block`` (the dict), ``touch`` (a
  hit on a block nobody references takes it out of the free queue), ``free_blocks`` (a block
  whose count drops to 0 is appended to the queue's tail if it has a hash, still cached,
  and prepended to its head if not, to be reused first), ``get_new_blocks`` and
  ``_maybe_evict_cached_block`` (a cached block is forgotten only when an allocation pops it
  from the queue's head). minisrv's queue holds cached blocks only; its other free pages
  are the allocator's;
* ``vllm/v1/core/kv_cache_manager.py``: ``get_computed_blocks`` (the hit is at most
  ``request.num_tokens - 1`` tokens, ``max_cache_hit_length``: the last token is computed
  again for its logits; minisrv's ``KVManager.match`` asks the cache for the prompt without
  its last token, which caps both caches alike).

How minisrv's version fits the ``PrefixCache`` contract, and where it departs from vLLM:

* **A hit's handle is its last block.** Each block keeps its parent, the block its hash is
  chained from, so ``lock(last block)`` counts one more reference on every block of the hit,
  as vLLM's ``touch`` does on each block of a request's list. A running request thus holds
  a reference on every cached block it reads; ``unlock`` drops them, deepest block first, and
  blocks reaching 0 join the free queue in that order.
* **Blocks are shared, not copied.** vLLM caches a request's own full blocks even when an
  identical block is cached already (its block tables stay append-only); minisrv's contract
  swaps a request's duplicate slots for the cache's (``insert`` returns how many leading
  tokens were cached already), so each cached prefix has exactly one block.
* **Eviction only when allocation needs it.** ``KVManager.allocate`` takes never-cached free
  slots first and calls ``evict`` only for the rest; ``evict`` pops blocks from the queue's
  head. A block never joins the queue after its cached descendants (a reference on a block
  holds its parent; an unlock and an insert append a chain deepest first), so the head is
  never the parent of a cached block and the cached set stays closed under prefixes: no
  block is cached whose parent is not.
* **Matching changes nothing.** A match neither moves blocks in the queue nor takes
  references (``get_computed_blocks`` does not either): only locks and inserts count as use.
  The radix tree instead renews the LRU stamp of every node a match walks.
* **The hash** is Python's ``hash`` of ``(parent hash, block tokens)``. It is computed in C
  and is stable within the process (small ints hash to themselves and tuples combine their
  items; ``PYTHONHASHSEED`` only salts strings and bytes), which is all it needs: the cache
  never leaves the process. vLLM's hashes do (KV events, connectors), and it hashes with
  SHA-256 by default (``kv_cache_utils.py``: block hashes are SHA-256 bytes, the seed
  random). Python's tuple hash resists no crafted collision, so a hit here is confirmed by
  comparing the block's own tokens and parent: a collision is a miss, never a wrong KV, and
  a block whose hash is taken is indexed by ``(parent, tokens)`` instead.

Which scheduling policies work on it: FCFS, LPM (its match length is a run of blocks) and the
cache-agnostic ones. DFS-weight walks the tree's children from the root, which a hash table
of blocks does not have: ``policy="dfs-weight"`` with ``cache="blocks"`` is refused. The
host tier is the radix tree's (``hiradix.py``) and needs ``cache="radix"``.

Standalone, as the radix tree: values may be ``None`` or any ints and nothing is allocated.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from minisrv.checks import check_int
from minisrv.kv.cache import EvictCallback, MatchResult, PrefixCache, SizeInfo, TreeNode, insert_key

__all__ = ["Block", "BlockCache", "ROOT_HASH"]

ROOT_HASH = 0x5EED
"""The parent hash of a chain's first block (vLLM: ``NONE_HASH``, a random seed there)."""


class Block(TreeNode):
    """One cached full block: ``key`` its ``page_size`` tokens, ``value`` their KV slots,
    ``parent`` the block its ``hash`` is chained from, ``lock_ref`` its reference count
    (vLLM's ``ref_cnt``), ``depth`` its place in the chain (1 for a first block).
    ``children`` stays empty: the cache is a dict, not a tree."""

    __slots__ = ("hash", "depth")

    def __init__(self, node_id: int, key: tuple[int, ...], value: list[Any],
                 parent: Block | None, block_hash: int) -> None:
        super().__init__(node_id, key, value, parent, 0)
        self.hash = block_hash
        self.depth = 0 if parent is None else parent.depth + 1  # blocks up to this one

    def __repr__(self) -> str:
        return f"Block(id={self.id}, tokens={len(self.key)}, ref={self.lock_ref})"


class BlockCache(PrefixCache):
    """Full blocks keyed by chained hashes, reference counts and an LRU queue of free blocks.

    Args:
        page_size: tokens per block (vLLM's ``block_size``, 16 by default there).
        on_evict: called with the values (KV slots) of every evicted block; ``None``
            standalone.
        hash_fn: hashes ``(parent hash, block tokens)`` to an int; Python's ``hash`` unless
            a test wants collisions.

    Every operation takes the contract's ``tag`` (the request it serves), which the radix
    tree passes to its listener; the block cache reports to none and ignores it.

    Costs: ``match_prefix`` and ``insert`` hash and look up one block per ``page_size``
    tokens; ``lock``/``unlock`` O(blocks in the hit); ``evict`` O(1) per block (the queue is
    an ``OrderedDict``, a doubly linked list in C, as vLLM links its blocks by hand to
    remove one from the middle in O(1)).
    """

    def __init__(self, page_size: int = 16, on_evict: EvictCallback | None = None,
                 hash_fn: Callable[[tuple[int, tuple[int, ...]]], int] = hash) -> None:
        self.page_size = check_int("page_size", page_size, minimum=1)
        self.on_evict = on_evict
        self.hash_fn = hash_fn
        self._ids = itertools.count()
        self.root = Block(next(self._ids), (), [], None, ROOT_HASH)
        self._by_hash: dict[int, Block] = {}  # vLLM's cached_block_hash_to_block
        self._collided: dict[tuple[Block, tuple[int, ...]], Block] = {}  # hash taken
        self._free: OrderedDict[Block, None] = OrderedDict()  # ref 0, head evicted first
        self._evictable = 0
        self._protected = 0

    # ----------------------------------------------------------------- lookups
    def match_prefix(self, tokens: Sequence[int], *, tag: str = "") -> MatchResult:
        """The longest run of cached full blocks that starts ``tokens``.

        Returns:
            ``MatchResult(length, node, values)``: a multiple of ``page_size``, the last
            block of the run (the root when none) and the slots of its tokens. Nothing in
            the cache changes.
        """
        chain = self._chain(tuple(tokens))
        values = [value for block in chain for value in block.value]
        return MatchResult(len(values), chain[-1] if chain else self.root, values)

    def cached_length(self, tokens: Sequence[int]) -> int:
        """``match_prefix``'s length: a lookup by hash changes nothing here either."""
        return len(self._chain(tuple(tokens))) * self.page_size

    def _chain(self, key: tuple[int, ...]) -> list[Block]:
        """The cached blocks of ``key``'s leading full blocks, in order, up to the first miss:
        each found by the hash of its parent's hash and its tokens."""
        size, node, by_hash, hash_fn = self.page_size, self.root, self._by_hash, self.hash_fn
        chain: list[Block] = []
        for start in range(0, len(key) - size + 1, size):
            tokens = key[start:start + size]
            block = self._confirmed(by_hash.get(hash_fn((node.hash, tokens))), node, tokens)
            if block is None:
                break
            chain.append(block)
            node = block
        return chain

    def _confirmed(self, block: Block | None, parent: Block,
                   tokens: tuple[int, ...]) -> Block | None:
        """``block`` (found by its hash) if its parent and tokens are those asked for; else
        the cached block of ``(parent, tokens)`` whose hash another block took (a collision,
        which Python's ``hash`` makes easy), or None."""
        if block is not None and block.parent is parent and block.key == tokens:
            return block
        return self._collided.get((parent, tokens))

    def insert(self, tokens: Sequence[int], values: Sequence[Any] | None = None, *,
               tag: str = "", inserted_len: int = 0) -> int:
        """Cache the full blocks of ``tokens``; the tail after the last one is not kept.

        Args:
            tokens: the token run, e.g. a prompt, or prompt + output.
            values: the KV slot of each token; defaults to ``None`` per token.
            inserted_len: unused: this cache counts no hits (``PrefixCache.insert``).

        Returns:
            How many leading tokens were cached already (whole blocks). The cache keeps the
            values from there to the last full block; the caller frees the rest. Every
            block of the run nobody references moves to the queue's tail, deepest first,
            as vLLM frees a finished request's blocks.
        """
        key = insert_key(tokens, values)
        size = self.page_size
        path = self._chain(key)
        already = len(path) * size
        node = path[-1] if path else self.root
        for start in range(already, len(key) - size + 1, size):
            block_tokens = key[start:start + size]
            vals = [None] * size if values is None else list(values[start:start + size])
            node = self._add(node, block_tokens, vals)
            path.append(node)
        for block in reversed(path):
            if block.lock_ref == 0:
                self._free[block] = None
                self._free.move_to_end(block)
        return already

    def _add(self, parent: Block, tokens: tuple[int, ...], values: list[Any]) -> Block:
        """A new unreferenced block after ``parent`` (the caller queues it)."""
        block_hash = self.hash_fn((parent.hash, tokens))
        block = Block(next(self._ids), tokens, values, parent, block_hash)
        if block_hash in self._by_hash:
            self._collided[(parent, tokens)] = block
        else:
            self._by_hash[block_hash] = block
        self._evictable += len(tokens)
        return block

    # ------------------------------------------------------------ reference counts
    def lock(self, node: TreeNode, *, tag: str = "") -> None:
        """One more reference on ``node`` and every block before it; a block leaving 0
        leaves the free queue (vLLM's ``touch``)."""
        for block in self._blocks_to(node):
            if block.lock_ref == 0:
                del self._free[block]
                self._evictable -= len(block.key)
                self._protected += len(block.key)
            block.lock_ref += 1

    def unlock(self, node: TreeNode, *, tag: str = "") -> None:
        """Undo one ``lock(node)``; blocks reaching 0 join the free queue's tail, deepest
        first (vLLM's ``free_blocks`` over a request's blocks in reverse)."""
        blocks = self._blocks_to(node)
        if blocks and blocks[0].lock_ref == 0:
            raise ValueError(f"unlock of block {node.id}, which nobody references")
        for block in blocks:
            block.lock_ref -= 1
            if block.lock_ref == 0:
                self._protected -= len(block.key)
                self._evictable += len(block.key)
                self._free[block] = None

    def _blocks_to(self, node: TreeNode) -> list[Block]:
        """``node`` and its ancestors, deepest first, after checking it is a live block of
        this cache (the root: none)."""
        if not isinstance(node, Block):
            raise ValueError(f"expected a block from match_prefix, got {node!r}")
        if node.removed:
            raise ValueError(f"block {node.id} was evicted; match the prefix again")
        blocks: list[Block] = []
        walker: TreeNode | None = node
        while walker is not None and walker is not self.root:
            blocks.append(walker)  # type: ignore[arg-type]
            walker = walker.parent
        if walker is not self.root:
            raise ValueError(f"block {node.id} belongs to another cache")
        return blocks

    # ------------------------------------------------------------------ eviction
    def evict(self, n_tokens: int, *, tag: str = "") -> int:
        """Forget blocks from the free queue's head until ``n_tokens`` are freed (fewer
        when fewer are free); each one's values go to ``on_evict``.

        Returns:
            The number of tokens freed (whole blocks).
        """
        n_tokens = check_int("evict's token count", n_tokens, minimum=0)
        freed = 0
        while freed < n_tokens and self._free:
            block, _ = self._free.popitem(last=False)
            self._forget(block)
            freed += len(block.key)
            if self.on_evict is not None:
                self.on_evict(block.value)
        return freed

    def _forget(self, block: Block) -> None:
        """Take ``block`` out of the index (vLLM's ``_maybe_evict_cached_block``)."""
        if self._by_hash.get(block.hash) is block:
            del self._by_hash[block.hash]
        else:
            del self._collided[(block.parent, block.key)]  # type: ignore[index]
        block.removed = True
        self._evictable -= len(block.key)

    def reset(self) -> None:
        """Forget every block nobody references (their values go to ``on_evict``)."""
        self.evict(self._evictable)

    # --------------------------------------------------------------------- sizes
    def size_info(self) -> SizeInfo:
        """Tokens in free cached blocks and in referenced ones, kept by every operation."""
        return SizeInfo(self._evictable, self._protected)

    @property
    def n_blocks(self) -> int:
        """Cached blocks."""
        return len(self._by_hash) + len(self._collided)

    # ------------------------------------------------------------ introspection
    def nodes(self) -> list[TreeNode]:
        """The root, then every cached block, parents before their blocks."""
        blocks = [*self._by_hash.values(), *self._collided.values()]
        return [self.root, *sorted(blocks, key=lambda block: block.depth)]

    def free_queue(self) -> list[Block]:
        """Blocks nobody references, the next to be evicted first."""
        return list(self._free)

    def prefix_of(self, node: TreeNode) -> tuple[int, ...]:
        """The tokens of ``node``'s block and every block before it."""
        blocks = self._blocks_to(node)
        return tuple(t for block in reversed(blocks) for t in block.key)

    def __repr__(self) -> str:
        info = self.size_info()
        return (f"BlockCache(page_size={self.page_size}, blocks={self.n_blocks}, "
                f"evictable={info.evictable}, protected={info.protected})")
