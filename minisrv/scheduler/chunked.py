"""Chunked prefill: a token budget per step, long prompts computed in pieces.

With ``EngineConfig(chunked_prefill_size=N)`` no step computes more than ``N`` new tokens
(prefill tokens plus one per decode). A prompt longer than what is left of the budget is
split: its first chunk is an entry that does not sample, and the request waits, mid-prefill,
as the scheduler's ``chunked`` request (SGLang's ``chunked_req``). It keeps its seat and its
KV between steps; every later step continues it first, and nobody else starts a prefill
until its last chunk, the one that samples its first token, is formed. Each completed
chunk's KV goes into the prefix cache (``KVManager.cache_unfinished`` up to the chunk's
end, SGLang's ``cache_unfinished_req``), so a request arriving meanwhile with the same
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
"""

from __future__ import annotations

from minisrv.request import Req
from minisrv.scheduler.records import Batch, Entry

__all__ = ["ChunkedPrefill"]


class ChunkedPrefill:
    """The step-forming half of ``Scheduler`` under a token budget (mixed into it)."""

    def get_next_budgeted_batch(self) -> Batch:
        """This step's work under ``chunked_prefill_size`` (see the module docstring)."""
        budget = self.config.chunked_prefill_size
        if self.mode == "mixed":
            decoding, retracted = self.prepare_decode() if self.running else ([], ())
            left = budget - len(decoding)
            prefill = self.continue_chunk(left)
            if self.chunked is None and not retracted:
                prefill += self.admit_chunks(left - sum(e.n_tokens for e in prefill))
            return Batch.with_chunks(prefill, decoding, retracted)
        prefill = self.continue_chunk(budget)
        if self.chunked is None:
            prefill += self.admit_chunks(budget - sum(e.n_tokens for e in prefill))
        if prefill or not self.running:
            return Batch.with_chunks(prefill, [])
        return Batch.of([], *self.prepare_decode())

    def continue_chunk(self, budget: int) -> list[Entry]:
        """The next chunk of the request mid-prefill, at most ``budget`` tokens (none if
        there is no such request)."""
        req = self.chunked
        if req is None or budget <= 0:
            return []
        return [self._chunk(req, self.chunk_pos, budget)]

    def admit_chunks(self, budget: int) -> list[Entry]:
        """Admit waiting requests in queue order while a seat, KV memory and ``budget``
        tokens are left; the first that does not fit in the budget starts as a chunk.

        As ``admit``, but each request is admitted with the KV of its whole prompt (so it
        can finish its prefill), and admission ends at the request that is chunked.
        """
        adder = self.admission.adder(self.running, self.memory, self.max_running)
        if self.waiting and adder.has_place and budget > 0:
            self.prioritize()
        entries: list[Entry] = []
        while self.waiting and adder.has_place and budget > 0:
            req = self.waiting[0]
            match = self.memory.match(req)
            fill = req.seq_len - match.length
            if not (adder.fits(req, fill) and self.memory.allocate(req, match)):
                self.memory.drop_match(req, match)
                break
            adder.add(req, fill)
            self.waiting.popleft()
            self._start(req, req.cached_len)  # the match, plus what the host tier loaded
            entries.append(self._chunk(req, req.cached_len, budget))
            budget -= entries[-1].n_tokens
            if self.chunked is not None:
                break
        return entries

    def _chunk(self, req: Req, start: int, budget: int) -> Entry:
        """``req``'s prefill from ``start``, cut at ``budget`` tokens. The last piece samples
        and seats ``req`` in ``running``; an earlier one leaves it as ``chunked``, its end
        queued for ``finish`` (``chunk_ends``: the overlapped loop forms the next chunk
        before the previous one completes)."""
        n = min(req.seq_len - start, budget)
        if start + n == req.seq_len:
            self.chunked = None
            self.running.append(req)
            return Entry(req, start, n)
        self.chunked, self.chunk_pos = req, start + n
        self.chunk_ends.append((req, start + n))
        return Entry(req, start, n, False)

    def cache_chunk_of(self, req: Req) -> bool:
        """If the oldest chunk still to complete is ``req``'s, put its KV in the prefix
        cache (``finish`` calls this for each prefill entry of a completed step)."""
        ends = self.chunk_ends
        if not ends or ends[0][0] is not req:
            return False
        self.memory.cache_unfinished(req, ends.popleft()[1])
        return True
