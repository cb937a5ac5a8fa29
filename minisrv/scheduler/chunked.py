"""Chunked prefill: a token budget per step, long prompts computed in pieces.

With ``EngineConfig(chunked_prefill_size=N)`` no step computes more than ``N`` new tokens
(prefill tokens plus one per decode). A prompt longer than what is left of the budget is
split: its first chunk is an entry that does not sample, and the request waits, mid-prefill,
as the scheduler's ``chunked`` request (SGLang's ``chunked_req``). It keeps its seat and its
KV between steps; every later step continues it first, and nobody else starts a prefill
until its last chunk, the one that samples its first token, is formed. Each completed
chunk's KV goes into the prefix cache (``KVManager.cache_unfinished`` up to the chunk's
end, SGLang 0.5.23's ``checkpoint_kv_cache``), so a request arriving meanwhile with the same
prefix reuses it.

How a step is formed follows SGLang:

* ``mixed`` (SGLang's ``enable_mixed_chunk``, Sarathi-Serve's stall-free batching): every
  running request decodes first, and chunks fill what is left of the budget;
* ``prefill-first`` (SGLang's default): a step with any prefill work computes only
  prefills and chunks (up to the budget); the running requests wait, so chunking bounds
  the size of each step, not how long the decodes stall in all.

Where minisrv differs from SGLang: admission allocates the KV slots of the whole prompt
at the first chunk (SGLang counts the whole prompt in its admission budget but allocates
chunk by chunk), so a started prefill can always finish and decode-time retraction never
has to consider the chunked request; and the budget must be at least ``max_running``, so
a step of decodes alone never exceeds it either.

``ChunkedPrefill`` holds the chunking state (the request mid-prefill, where its next chunk
starts, the chunks launched and not completed) and cuts chunks; the scheduler forms the
budgeted step with it (``BatchFormer.get_next_budgeted_batch``, ``forming.py``).
"""

from __future__ import annotations

from collections import deque

from minisrv.core import Entry
from minisrv.kv.manager import KVManager
from minisrv.request import Req

__all__ = ["ChunkedPrefill"]


class ChunkedPrefill:
    """The one request mid-prefill (``req``, SGLang's ``chunked_req``), where its next chunk
    starts (``pos``), and the ends of its chunks launched but not completed (``ends``: the
    overlapped loop forms the next chunk before the previous one completes)."""

    def __init__(self) -> None:
        self.req: Req | None = None
        self.pos = 0
        self.ends: deque[tuple[Req, int]] = deque()

    def cut(self, req: Req, start: int, budget: int) -> Entry:
        """``req``'s prefill from ``start``, cut at ``budget`` tokens. The last piece samples
        (the caller seats ``req`` in ``running``); an earlier one leaves ``req`` mid-prefill,
        its end queued for ``completed``."""
        n = min(req.seq_len - start, budget)
        if start + n == req.seq_len:
            self.req = None
            return Entry(req, start, n)
        self.req, self.pos = req, start + n
        self.ends.append((req, start + n))
        return Entry(req, start, n, False)

    def next_chunk(self, budget: int) -> list[Entry]:
        """The next chunk of the request mid-prefill, at most ``budget`` tokens (none if
        there is no such request)."""
        if self.req is None or budget <= 0:
            return []
        return [self.cut(self.req, self.pos, budget)]

    def completed(self, req: Req, memory: KVManager) -> bool:
        """If the oldest chunk still to complete is ``req``'s, put its KV in the prefix
        cache and say so (``finish`` asks for each prefill entry of a completed step)."""
        ends = self.ends
        if not ends or ends[0][0] is not req:
            return False
        memory.cache_unfinished(req, ends.popleft()[1])
        return True

    def drop(self, req: Req) -> None:
        """``req`` leaves (aborted, retracted): if it was mid-prefill, nothing is any more."""
        if self.req is req:
            self.req = None
            self.ends.clear()
