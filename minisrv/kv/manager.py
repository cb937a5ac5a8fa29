"""The one owner of KV memory: the pool's slots and the prefix cache's bookkeeping.

Every slot is in exactly one of three places: free in the allocator, owned by a running
request (the tokens it computed itself), or owned by the prefix cache (a cached prefix,
shared by every request that matched it). All moves between them happen here, following
SGLang 0.5.23 (``mem_cache/common.py``): ``checkpoint_kv_cache`` after a prefill or chunk,
``release_kv_cache`` when a request leaves (``checkpoint=True`` at finish, inserting first;
both insert through ``RadixCache.checkpoint``):

* **admission**: match the request's longest cached prefix and lock it; allocate slots for
  the rest (evicting unlocked prefixes when the pool is short);
* **after its prefill** (or each chunk of it): insert what it computed into the tree, so
  requests arriving from the next step on can share it, and lock the longer prefix;
* **at finish**: insert prompt + output, unlock; the KV stays cached (evictable);
* **on retraction or abort**: free the request's own slots and unlock;
* **rejected tokens** (a speculative check, a late stop): ``truncate`` frees the KV of a
  request's last tokens.

No other code writes the request-to-token table (``kv/table.py``), the only record of where
a request's tokens live (a request holds lengths: ``kv_len``, ``cached_len``): a row is
taken at admission, written with every allocation, cut by ``truncate``, given back when the
request leaves (reused once the steps that read it have completed: ``launched`` and
``completed`` are told by the loops). Without a pool (the simulated GPU) the table keeps
its host record alone.

**Pages.** The allocator hands out pages of ``page_size`` slots (``kv/allocator.py``) and
the table maps every token to its slot, position ``i`` at offset ``i % page_size`` of its
page. The cache holds whole pages; a request owns the pages past its cached prefix, the
last one maybe partly filled (the next tokens fill it before a new page is taken), and a
page goes back when its last token does: at finish (the partial page the cache does not
take), abort, retraction, and a truncation that empties it. ``growth`` and ``room`` say
what more tokens cost in slots of whole pages, which is what the scheduler counts.

The manager asks the cache nothing about its kind: a cache with a host tier answers the
contract's host hooks (``PrefixCache.match_host``, ``load``), every other
cache their no-ops.

``check_integrity`` verifies the bookkeeping; the tests call it after every run, and
``EngineConfig(debug=True)`` after every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from minisrv.kv.allocator import SlotAllocator
from minisrv.kv.cache import MatchResult, PrefixCache, TreeNode
from minisrv.kv.hiradix import HiRadixCache
from minisrv.kv.host import CopyPlan, HostPool
from minisrv.kv.kinds import Cache, make_cache
from minisrv.kv.table import ReqToTokenTable
from minisrv.request import Req

__all__ = ["KVManager"]


def _now(work: Callable[[], None]) -> None:
    work()


def _tag(req: Req) -> str:
    return f"r{req.rid}"


class KVManager:
    """KV slots and the prefix cache, moved together so that no slot is lost or shared."""

    def __init__(self, allocator: SlotAllocator, cache: Cache, host: HostPool | None = None,
                 host_policy: str = "write_through",
                 table: ReqToTokenTable | None = None) -> None:
        self.kv = allocator
        self.page_size = ps = allocator.page_size
        # None: no pool to index (the simulated GPU): the host record alone
        self.table = ReqToTokenTable.host_only() if table is None else table
        # The prefix cache owns the slots of the prefixes it keeps; evicting one frees them.
        # With a host tier (``kv/hiradix.py``) the device evicts to host memory instead.
        self.tree: PrefixCache = (
            make_cache(cache, on_evict=allocator.free, page_size=ps) if host is None
            else HiRadixCache(host, host_policy, on_evict=allocator.free, page_size=ps))
        self.host = host
        self.evicted_tokens = 0
        self.host_hit_tokens = 0  # matched in the host tier at admission
        self.loaded_tokens = 0  # of those, copied back (fewer when the host dropped some)
        self._last_query: tuple[Req | None, int, tuple[int, ...]] = (None, 0, ())

    @property
    def host_used(self) -> int:
        """Host-tier slots holding a prefix's copy (0 without a host tier)."""
        return 0 if self.host is None else self.host.used_count

    def slots(self, req: Req, start: int = 0, end: int | None = None) -> list[int]:
        """The KV slots of ``req``'s positions ``start .. end - 1`` (the table's record)."""
        return self.table.slots(req, start, end)

    @property
    def free_count(self) -> int:
        """Slots free right now."""
        return self.kv.free_count

    def available(self) -> int:
        """Slots a new request could get: free ones plus cached prefixes nobody uses."""
        return self.kv.free_count + self.tree.evictable_size()

    # ------------------------------------------------------------------ pages
    def pages(self, n_tokens: int) -> int:
        """Slots of the whole pages ``n_tokens`` tokens take from a page boundary."""
        ps = self.page_size
        return n_tokens if ps == 1 else -(-n_tokens // ps) * ps

    def growth(self, req: Req, n: int) -> int:
        """Slots of the new pages that ``n`` more tokens of ``req`` take (its last page's
        free slots first)."""
        return n if self.page_size == 1 else self.pages(req.kv_len + n) - self.pages(req.kv_len)

    def room(self, reqs: Sequence[Req], tokens: Callable[[Req], int] | None = None) -> int:
        """Slots of the new pages that giving each of ``reqs`` ``tokens(req)`` more tokens
        takes (one each by default: a decode step)."""
        if self.page_size == 1:
            return len(reqs) if tokens is None else sum(map(tokens, reqs))
        return sum(self.growth(req, 1 if tokens is None else tokens(req)) for req in reqs)

    def _extend(self, req: Req, n: int) -> list[int]:
        """Slots for ``req``'s next ``n`` tokens: the rest of its last page, then new pages
        (the caller made room)."""
        ps, k = self.page_size, req.kv_len
        if ps == 1:
            return self.kv.alloc(n)
        room = min(-k % ps, n)
        head = []
        if room:
            last = self.table.slots(req, k - 1, k)[0]
            head = list(range(last + 1, last + 1 + room))
        return [*head, *self.kv.alloc(self.pages(n - room))[:n - room]]

    def evict(self, n_tokens: int, tag: str) -> int:
        """Evict at least ``n_tokens`` cached tokens if possible; return how many were freed."""
        freed = self.tree.evict(n_tokens, tag=tag)
        self.evicted_tokens += freed
        return freed

    # ------------------------------------------------------------------ admission
    def match(self, req: Req) -> MatchResult:
        """Find and lock ``req``'s longest cached prefix, leaving at least its last token to
        compute (the forward over that token yields the logits of the next one)."""
        tag = _tag(req)
        match = self.tree.match_prefix(self._query(req), tag=tag)
        self.tree.lock(match.node, tag=tag)
        return match

    def _query(self, req: Req) -> tuple[int, ...]:
        """``req``'s tokens but the last, the same tuple object while they stay the same: a
        request that does not fit is matched again at every step, and the tree skips the walk
        when asked the same object twice with nothing changed in between. Its output changes
        only in length, or in its last token (the overlapped loop's placeholder), left out."""
        if self._last_query[0] is not req or self._last_query[1] != len(req.output):
            self._last_query = (req, len(req.output), (*req.prompt, *req.output)[:-1])
        return self._last_query[2]

    def allocate(self, req: Req, match: MatchResult) -> bool:
        """Give ``req`` the matched prefix plus fresh slots for the rest; False (changing
        nothing) when even evicting every unused prefix leaves too few slots."""
        fill = req.seq_len - match.length
        need = self.pages(fill)  # the match ends on a page boundary
        host_hit = self.tree.host_match_length(match.node, self._query(req), match.length)
        if need > self.kv.free_count:
            self.evict(need - self.kv.free_count, _tag(req))
        if need > self.kv.free_count:
            return False
        self.table.take(req, [*match.values, *self.kv.alloc(need)[:fill]])
        req.kv_len = req.seq_len
        req.cached_len, req.cache_node = match.length, match.node
        self._load_host_part(req, host_hit)
        return True

    def _load_host_part(self, req: Req, host_hit: int) -> None:
        """The host tier's part of ``req``'s match: loaded into its first fresh slots (the
        ones its prefill would have computed) and locked as its cached prefix (the tree counts
        hits when this request's KV is inserted, not here). What the host dropped since the
        match (room for this very allocation) is computed instead: a miss, never a failure.
        Without a host tier nothing is found."""
        tree = self.tree
        found = tree.match_host(req.cache_node, self._query(req), req.cached_len)
        if found.length:
            start = req.cached_len
            node = tree.load(found, self.table.slots(req, start, start + found.length))
            tree.lock(node, tag=_tag(req))
            tree.unlock(req.cache_node, tag=_tag(req))
            req.cached_len, req.cache_node = start + found.length, node
        self.host_hit_tokens += host_hit
        self.loaded_tokens += found.length

    def transfer(self, where: Callable[[Callable[[], None]], None] | None = None) -> CopyPlan:
        """Run the host tier's queued copies (one batched copy each way) before the step
        that reads them; the plan that ran (empty without a host tier). ``where`` runs the
        tensor copies where the steps run (the overlapped loop's device thread); without
        it they run here and now."""
        if self.host is None:
            return CopyPlan()
        plan = self.host.take()
        if plan:
            (where or _now)(lambda: self.host.copy(plan))
        return plan

    def drop_match(self, req: Req, match: MatchResult) -> None:
        """Undo ``match`` for a request that was not admitted after all."""
        self.tree.unlock(match.node, tag=_tag(req))

    def alloc_decode(self, reqs: Sequence[Req]) -> None:
        """A slot each for the newest token of ``reqs``, in one allocation (the caller made
        room); ``alloc_tokens`` gives one request several (a speculative check)."""
        ps = self.page_size
        if ps == 1:
            slots = self.kv.alloc(len(reqs))
        else:  # a new page for those whose last page is full, the next slot for the others
            full = [req for req in reqs if req.kv_len % ps == 0]
            pages = iter(self.kv.alloc(len(full) * ps)[::ps])
            slots = [next(pages) if req.kv_len % ps == 0
                     else self.table.slots(req, req.kv_len - 1, req.kv_len)[0] + 1
                     for req in reqs]
        self.table.append(reqs, slots)
        for req in reqs:
            req.kv_len += 1

    def alloc_tokens(self, req: Req, n: int) -> None:
        """``n`` slots for ``req``'s next ``n`` tokens (a speculative check's k+1, a chunk);
        the caller made room."""
        self.table.write(req, req.kv_len, self._extend(req, n))
        req.kv_len += n

    # ------------------------------------------------------------------ handing KV over
    def cache_unfinished(self, req: Req, end: int | None = None) -> None:
        """Right after ``req``'s prefill (or a chunk of it: its KV up to ``end``), put its KV
        in the cache and switch ``req`` to the cache's copy (SGLang 0.5.23's
        ``checkpoint_kv_cache``, which calls ``RadixCache.checkpoint(req, up_to=...)``).

        Where the tree already held some of these tokens (another request prefilled the same
        text meanwhile), ``req``'s duplicate slots are freed and its table row takes the
        tree's instead; then ``req`` locks the longer prefix and releases the old lock. The
        cache takes whole pages: a last partial page stays ``req``'s.
        """
        tree, tag = self.tree, _tag(req)
        end = req.kv_len if end is None else end
        tokens = req.all_tokens[:end]  # a tuple: the tree's key type
        slots = self.table.slots(req, 0, end)
        already = self._insert(req, tokens, slots)
        match = tree.match_prefix(tokens, tag=tag)
        if match.length <= req.cached_len:  # the cache keeps nothing (NoCache)
            return
        self.kv.free(slots[req.cached_len:already])
        self.table.write(req, req.cached_len, match.values[req.cached_len:])
        tree.lock(match.node, tag=tag)
        tree.unlock(req.cache_node, tag=tag)
        req.cached_len, req.cache_node = match.length, match.node

    def cache_finished(self, req: Req) -> None:
        """Give a finished request's KV (prompt + output) to the cache, then unlock (SGLang
        0.5.23's ``release_kv_cache(req, tree_cache, checkpoint=True)``).

        Its KV is not freed but kept for the next turn of a chat or any request with the same
        prefix; it becomes evictable. Slots duplicating what the tree already held are freed
        (with ``NoCache`` that is all of them), and so is a last partial page, which the
        cache does not take.
        """
        tokens = req.all_tokens[: req.kv_len]
        slots = self.table.slots(req)
        already = self._insert(req, tokens, slots)
        whole = req.kv_len - req.kv_len % self.page_size
        self.kv.free([*slots[req.cached_len:already], *slots[max(already, whole):]])
        self._unlock(req)

    def _insert(self, req: Req, tokens: tuple[int, ...], slots: Sequence[int]) -> int:
        """Insert ``req``'s ``tokens`` and remember how far it has inserted (the tree's whole
        pages), so that its next insert counts a hit only on what lies past (SGLang's
        ``cache_inserted_len``). Returns what was already cached, as ``insert`` does."""
        already = self.tree.insert(tokens, slots, tag=_tag(req), inserted_len=req.inserted_len)
        whole = len(tokens) - len(tokens) % self.page_size
        req.inserted_len = max(req.inserted_len, whole)
        return already

    def release(self, req: Req) -> int:
        """Free the slots ``req`` owns and unlock its cached prefix (retraction, abort);
        return how many computed tokens were thrown away."""
        owned = self.table.slots(req, req.cached_len)
        self.kv.free(owned)
        self._unlock(req)
        return len(owned)

    def truncate(self, req: Req, n: int) -> None:
        """Free the KV of ``req``'s last ``n`` tokens (tokens computed and then rejected):
        the pages left empty go back, a page still holding one of its tokens stays.

        Only slots ``req`` owns can go: ValueError, changing nothing, if ``n`` reaches into
        the cached prefix it shares with the tree.
        """
        owned = req.kv_len - req.cached_len
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= owned:
            raise ValueError(f"truncate of request {req.rid}: n must be an int in 0..{owned} "
                             f"(the slots it owns), got {n!r}")
        if n:
            self.kv.free(self.table.slots(req, self.pages(req.kv_len - n)))
            req.kv_len -= n
            self.table.cut(req, req.kv_len)

    def _unlock(self, req: Req) -> None:
        self.table.give_back(req)
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node, tag=_tag(req))
        req.kv_len, req.cached_len, req.cache_node, req.inserted_len = 0, 0, None, 0

    # ------------------------------------------------------------------ steps
    def launched(self, reqs: Sequence[Req]) -> None:
        """A step reading the KV of ``reqs`` went to the device (their rows stay theirs,
        given back or not, until it completes)."""
        self.table.launched(reqs)

    def completed(self) -> None:
        """The oldest launched step has completed."""
        self.table.completed()

    def settle(self) -> None:
        """No launched step runs any more (after a device error)."""
        self.table.settle()

    # ------------------------------------------------------------------ invariants
    def check_integrity(self, running: Sequence[Req]) -> None:
        """Raise ``AssertionError`` naming the broken rule if the bookkeeping is off.

        * every page is free, owned by one running request, or owned by the tree, never two
          of these: owned + cached + free == capacity (in slots of pages);
        * position ``i`` of a request sits at offset ``i % page_size`` of its page, and the
          tree's nodes hold whole pages;
        * the tree's evictable + protected sizes add up to the tokens it holds;
        * every node's lock count equals the running requests whose prefix passes through it
          (so no locked node is left without a running owner).
        """
        tree = self.tree
        table, ps = self.table, self.page_size
        owned_by = [table.slots(req, req.cached_len) for req in running]
        owned = [s for slots in owned_by for s in slots]
        shared = [s for req in running for s in table.slots(req, 0, req.cached_len)]
        nodes = tree.nodes()
        cached = [s for node in nodes for s in node.value]
        n_owned = sum(len({s // ps for s in slots}) for slots in owned_by) * ps
        n_cached = len(cached)
        total = n_owned + n_cached + self.kv.free_count
        assert total == self.kv.capacity, (
            f"slots leaked or double-counted: {n_owned} owned by requests + {n_cached} "
            f"cached + {self.kv.free_count} free = {total} != capacity {self.kv.capacity}"
        )
        pages = [s // ps for s in (*owned, *cached)]
        assert len(set(pages)) * ps == n_owned + n_cached and len(set(owned)) == len(owned), (
            "a slot has two owners")
        if ps > 1:  # pages of one slot: every position is at offset 0 of its page
            for values, what in [*((table.slots(r), f"request {r.rid}") for r in running),
                                 *((n.value, f"node {n.id}") for n in nodes)]:
                at = np.asarray(values, dtype=np.int64) % ps
                assert (at == np.arange(len(at)) % ps).all(), (
                    f"{what}: a position off its offset in its page")
            assert all(len(n.value) % ps == 0 for n in nodes), "a tree node holds part of a page"
        assert all(self.kv.is_used(s) for s in owned), "a request holds a free slot"
        assert all(self.kv.is_used(s) for s in cached), "the tree holds a free slot"
        assert set(shared) <= set(cached), "a request reads a prefix slot the tree does not hold"
        info = tree.size_info()
        held = sum(len(node.value) for node in nodes)  # a host-only node holds no device slot
        assert info.total == held, f"sizes say {info.total} cached tokens, the tree holds {held}"
        expected: dict[int, int] = {}
        for req in running:
            node: TreeNode | None = req.cache_node
            while node is not None and node is not tree.root:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        for node in nodes[1:]:
            assert node.lock_ref == expected.get(id(node), 0), (
                f"node {node.id} has lock count {node.lock_ref} but "
                f"{expected.get(id(node), 0)} running requests use it"
            )
        protected = sum(len(n.key) for n in nodes[1:] if n.lock_ref > 0)
        assert info.protected == protected, (
            f"protected size {info.protected} != {protected} tokens on locked nodes"
        )
        tree.check_tiers()
        table.check(running)
