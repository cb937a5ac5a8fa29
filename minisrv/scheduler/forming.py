"""Forming a batch: who is admitted, who computes, and how many tokens each entry computes.

``BatchFormer`` is the first of the step's three calls (``form``, ``launch``, ``complete``)
without the clock or the arrivals, which are the loop's. It composes the parts that decide:
the ``QueuePolicy`` orders the waiting queue (``policy.py``), the ``AdmissionRule`` says
whether a request's memory need fits (``admission.py``), the ``KVManager`` matches its
prefix and hands out slots (``minisrv.kv``), ``ChunkedPrefill`` cuts prompts under a token
budget (``chunked.py``), a ``WideDecode`` widens decode entries (``wide.py``); moving a
request between places is ``Lifecycle``'s. One admission loop (``admissions``) serves both
the plain step and the budgeted one.
"""

from __future__ import annotations

from collections.abc import Iterator

from minisrv.core import Batch, Entry
from minisrv.kv.cache import MatchResult
from minisrv.kv.manager import KVManager
from minisrv.request import Req
from minisrv.scheduler.admission import AdmissionRule, PrefillAdder
from minisrv.scheduler.config import EngineConfig
from minisrv.scheduler.lifecycle import Lifecycle
from minisrv.scheduler.policy import QueuePolicy
from minisrv.scheduler.queues import RequestQueues
from minisrv.scheduler.wide import WideDecode

__all__ = ["BatchFormer"]


class BatchFormer:
    """This step's ``Batch`` by ``config.mode``, under ``chunked_prefill_size`` if set."""

    def __init__(self, config: EngineConfig, queues: RequestQueues, memory: KVManager,
                 admission: AdmissionRule, wide: WideDecode | None, lifecycle: Lifecycle
                 ) -> None:
        self.config, self.queues, self.memory = config, queues, memory
        self.admission, self.wide, self.lifecycle = admission, wide, lifecycle
        self.policy = QueuePolicy(config.policy, config.in_batch_prefix_check, config.seed)
        self.mode, self.max_running = config.mode, config.max_running

    def next_batch(self) -> Batch:
        """``get_next_batch_to_run``, or its budgeted form under chunked prefill; with
        speculative decoding each decode entry becomes a check, with jump-forward it computes
        the tokens a grammar forced (``wide.py``)."""
        if self.config.chunked_prefill_size is None:
            batch = self.get_next_batch_to_run()
        else:
            batch = self.get_next_budgeted_batch()
        self.queues.prefilled += batch.prefill_tokens  # HRRN's clock
        return batch if self.wide is None else self.wide.expand(batch)

    def get_next_batch_to_run(self) -> Batch:
        """Choose this step's work according to ``mode``.

        * ``static``: a new batch is admitted only when nothing is running; it then decodes
          until its longest request ends (requests that finish early leave idle slots).
        * ``prefill-first``: if anyone can be admitted, the step prefills only them and the
          running requests wait; otherwise everyone running decodes.
        * ``mixed``: newly admitted requests prefill in the same step as the running ones
          decode.

        Before any step that decodes, every running request gets a slot for its next token
        (``prepare_decode``), retracting requests if the pool is short. A mixed step that
        had to retract admits nobody: the memory it just freed is already spoken for.
        """
        running = self.queues.running
        if self.mode == "static" and running:
            return Batch.of([], *self.prepare_decode())
        if self.mode == "mixed":
            decoding, retracted = self.prepare_decode() if running else ([], ())
            return Batch.of([] if retracted else self.admit(), decoding, retracted)
        new = self.admit()
        if new or not running:
            return Batch.of(new, [])
        return Batch.of([], *self.prepare_decode())

    def admit(self) -> list[Req]:
        """The requests ``admissions`` lets in, seated in the running batch."""
        new = list(self.admissions())
        self.queues.running.extend(new)
        return new

    def admissions(self) -> Iterator[Req]:
        """Admit waiting requests in queue order while a batch place and KV memory are free.

        Each first locks its longest cached prefix (``KVManager.match``); only the rest is
        allocated, and a short pool evicts unlocked cached prefixes (LRU) first. Admission
        stops at the first request that does not fit (no overtaking, so the queue order
        stays fair) or when the caller asks for no more (its token budget spent). Under
        ``admission_order="lock-round-first"`` the allocation waits for the whole round
        (``lock_round_first``)."""
        queues = self.queues
        if not queues.waiting or len(queues.running) >= self.max_running:
            return  # nobody waits, or no seat is free: no budget to work out
        adder = self.admission.adder(queues.running, self.memory, self.max_running)
        if queues.waiting and adder.has_place:
            queues.waiting = self.policy.prioritize(queues.waiting, self.memory.tree,
                                                    queues.prefilled)
        if self.config.admission_order == "lock-round-first":
            yield from self.lock_round_first(adder)
            return
        while queues.waiting and adder.has_place:
            req = queues.waiting[0]
            match = self.memory.match(req)
            fill = req.seq_len - match.length  # tokens to prefill (a match is whole pages)
            if not (adder.fits(req, fill) and self.memory.allocate(req, match)):
                self.memory.drop_match(req, match)
                return
            adder.add(req, fill)
            queues.waiting.popleft()
            self.lifecycle.start(req)  # cached: the match, plus what the host tier loaded
            yield req

    def lock_round_first(self, adder: PrefillAdder) -> Iterator[Req]:
        """SGLang's order of work: ``PrefillAdder.add_one_req`` locks the matched prefix of
        each request it admits (``schedule_policy.py``), and only then ``prepare_for_extend``
        allocates for the round (``schedule_batch.py``), evicting unlocked nodes alone. So no
        admission evicts a prefix that a later request of the same round matched. A request
        fits while the round's fresh slots stay within the free ones plus what is still
        evictable with every prefix of the round locked, so the allocation cannot fail."""
        queues, memory = self.queues, self.memory
        round_: list[tuple[Req, MatchResult]] = []
        slots = 0  # fresh slots the round's admissions need
        while queues.waiting and adder.has_place:
            req = queues.waiting[0]
            match = memory.match(req)
            fill = req.seq_len - match.length
            if not (adder.fits(req, fill) and slots + memory.pages(fill) <= memory.available()):
                memory.drop_match(req, match)
                break
            slots += memory.pages(fill)
            adder.add(req, fill)
            round_.append((queues.waiting.popleft(), match))
        for req, match in round_:
            if not memory.allocate(req, match):
                raise RuntimeError(f"r{req.rid}: the round was counted to fit, its slots "
                                   f"were not there")
            self.lifecycle.start(req)
            yield req

    def get_next_budgeted_batch(self) -> Batch:
        """This step's work under ``chunked_prefill_size`` (``minisrv.scheduler.chunked``):
        mixed, decodes first and chunks in what is left; prefill-first, prefills and chunks
        up to the budget, decodes only in a step without them."""
        budget, queues = self.config.chunked_prefill_size, self.queues
        assert budget is not None  # next_batch asks only under chunked prefill
        if self.mode == "mixed":
            decoding, retracted = self.prepare_decode() if queues.running else ([], ())
            left = budget - len(decoding)
            prefill = self.continue_chunk(left)
            if queues.chunked is None and not retracted:
                prefill += self.admit_chunks(left - sum(e.n_tokens for e in prefill))
            return Batch.with_chunks(prefill, decoding, retracted)
        prefill = self.continue_chunk(budget)
        if queues.chunked is None:
            prefill += self.admit_chunks(budget - sum(e.n_tokens for e in prefill))
        if prefill or not queues.running:
            return Batch.with_chunks(prefill, [])
        return Batch.of([], *self.prepare_decode())

    def continue_chunk(self, budget: int) -> list[Entry]:
        """The next chunk of the request mid-prefill (seated in ``running`` by its last)."""
        entries = self.queues.chunks.next_chunk(budget)
        self.queues.running.extend(e.req for e in entries if e.sample)
        return entries

    def admit_chunks(self, budget: int) -> list[Entry]:
        """``admissions`` under a token budget: each request with the KV of its whole prompt
        (so it can finish its prefill), the first that does not fit in ``budget`` as a
        chunk, which ends admission."""
        entries: list[Entry] = []
        if budget <= 0:
            return entries
        for req in self.admissions():
            entries.append(entry := self.queues.chunks.cut(req, req.cached_len, budget))
            budget -= entry.n_tokens
            if not entry.sample:
                break
            self.queues.running.append(req)
            if budget <= 0:
                break
        return entries

    def prepare_decode(self) -> tuple[list[Req], tuple[Req, ...]]:
        """Give every running request a slot for its next token; retract if there are too few.

        Cached prefixes nobody uses are evicted first. Then retraction frees the request with
        the fewest generated tokens (the least work lost), the longest prompt breaking ties
        (the most memory won). It keeps its output and goes back to the head of the queue;
        on re-admission it prefills prompt plus output and continues exactly where it
        stopped. Returns the requests that decode this step and those retracted.
        """
        running, memory = self.queues.running, self.memory
        retracted: list[Req] = []
        while (short := self.decode_tokens(running) - memory.free_count) > 0:
            if memory.evict(short, "decode"):
                continue
            victim = self.retraction_victim(running)
            running.remove(victim)
            self.lifecycle.retract(victim)
            retracted.append(victim)
        self.queues.waiting.extendleft(reversed(retracted))
        self.admission.after_decode_prepared(running, retracted)
        if self.wide is None:
            memory.alloc_decode(running)
        else:  # several new tokens a request (later chapters: wide.py)
            self.wide.alloc(running, memory)
        return list(running), tuple(retracted)

    def decode_tokens(self, running: list[Req]) -> int:
        """KV slots the running requests' decodes take this step, in whole pages: one token
        each, or with wider entries (``wide.py``) each one's tokens without KV plus its
        guesses (``KVManager.room``: a token that fits its request's last page takes none)."""
        return self.memory.room(running, None if self.wide is None else self.wide.tokens)

    @staticmethod
    def retraction_victim(running: list[Req]) -> Req:
        """The request to retract first: fewest generated tokens, then the longest prompt."""
        return min(running, key=lambda r: (len(r.output), -r.prompt_len))
