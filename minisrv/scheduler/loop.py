"""The scheduler: one step path that decides, step by step, which requests the model computes.

Every serving engine in the book runs these three calls::

    batch = form()           new arrivals join the queue; admit from it, pick who computes
    step = launch(batch)     the backend computes the batch: one forward pass (real model)
                             or its roofline time (simulated GPU)
    complete(step)           append each entry's tokens, stream them, stop and free the
                             finished (``finish``), record the step

The blocking loop (``step``) runs them one after the other; the overlapped loop
(``minisrv.scheduler.overlap``) forms and launches step i+1 before completing step i. The
scheduler never looks at logits or tensors: a *backend* computes the tokens and says how
long the step took, so the same code drives CityLM on a laptop and a simulated H100 serving
LLaMA-3-8B. It delegates memory and the prefix cache to ``KVManager`` (``minisrv.kv``),
how much may be admitted to an ``AdmissionRule`` (``admission.py``), and its queues and
records to ``SchedulerState`` (``state.py``). Bookkeeping per step touches only the
requests in the batch (plus the ones admitted or arriving), so simulating thousands stays
fast.
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

from minisrv.request import Req, ReqState
from minisrv.scheduler.policy import calc_priority, default_in_batch_check
from minisrv.scheduler.records import Batch, BatchResult, Entry, StepRecord
from minisrv.scheduler.state import SchedulerState

__all__ = ["Launched", "Scheduler"]


class Launched(NamedTuple):
    """A step handed to the backend: its batch, the trace fields known before, its answer."""

    batch: Batch
    before: dict[str, Any]
    result: BatchResult


class Scheduler(SchedulerState):
    """The main loop of an inference server, independent of what computes the tokens.

    ``Scheduler(backend, config)`` or ``Scheduler(backend, **options)`` with the options of
    ``EngineConfig`` (``kv_capacity``, ``max_running``, ``mode``, ``admission``, ``cache``,
    ...). ``step`` is the blocking loop's iteration: ``form``, ``launch``, ``complete``.
    With ``chunked_prefill_size`` its steps are formed under a token budget, the request
    mid-prefill held by its ``ChunkedPrefill`` (``chunks``); decode entries of several
    tokens come from its ``WideDecode`` (``wide``: speculative checks or jump-forward).
    """

    # ----------------------------------------------------------------- the loop
    def step(self) -> StepRecord | None:
        """Run one iteration of the blocking loop; ``None`` once there is nothing left to do."""
        batch = self.form()
        if batch is None:
            return None
        return self.complete(self.launch(batch))

    def run(self, progress: bool = False) -> None:
        """Step until every submitted request has finished.

        ``progress`` shows a tqdm bar counting finished requests (useful for long simulations).
        """
        if not progress:
            while self.step() is not None:
                pass
            return
        from tqdm.auto import tqdm

        total = len(self._pending) + len(self.waiting) + len(self.running)
        with tqdm(total=total, unit="req", desc=f"serving ({self.mode})") as bar:
            while (record := self.step()) is not None:
                bar.update(len(record.finished))

    def form(self, device_busy: bool = False) -> Batch | None:
        """The next batch, or ``None`` when nothing can run now.

        When nothing can run but requests are still to arrive, the clock jumps to the next
        arrival instead of spinning through empty steps (unless the device is still busy
        with a step: its end moves the clock).
        """
        self.receive_arrivals()
        batch = self.next_batch()
        if not batch and self._pending and not device_busy:
            self.clock = max(self.clock, self._pending[0][0])
            self.receive_arrivals()
            batch = self.next_batch()
        return batch if batch else None

    def next_batch(self) -> Batch:
        """``get_next_batch_to_run``, or its budgeted form under chunked prefill; with
        speculative decoding each decode entry becomes a check, with jump-forward it computes
        the tokens a grammar forced (``wide.py``)."""
        if self.config.chunked_prefill_size is None:
            batch = self.get_next_batch_to_run()
        else:
            batch = self.get_next_budgeted_batch()
        return batch if self.wide is None else self.wide.expand(batch)

    def launch(self, batch: Batch) -> Launched:
        """Hand ``batch`` to the backend; the blocking loop waits for its answer here."""
        before = self.trace_fields(batch)
        self.memory.transfer()  # the host tier's copies, before the step that reads them
        self.memory.launched(batch.reqs)  # the table's rows it reads stay theirs until done
        try:
            return Launched(batch, before, self.backend.run(batch))
        finally:
            self.memory.completed()

    def complete(self, step: Launched) -> StepRecord:
        """The step's tokens into the requests (``process_batch_result``), then its record."""
        batch, before, result = step
        before["start"] = self.clock  # a device's steps follow each other
        self.clock += result.elapsed
        finished = self.process_batch_result(batch, result)
        return self.record(batch, before, result, finished)

    # ----------------------------------------------------------------- forming a batch
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
        if self.mode == "static" and self.running:
            return Batch.of([], *self.prepare_decode())
        if self.mode == "mixed":
            decoding, retracted = self.prepare_decode() if self.running else ([], ())
            return Batch.of([] if retracted else self.admit(), decoding, retracted)
        new = self.admit()
        if new or not self.running:
            return Batch.of(new, [])
        return Batch.of([], *self.prepare_decode())

    def admit(self) -> list[Req]:
        """Admit waiting requests in queue order while a batch place and KV memory are free.

        Each request first looks up its longest cached prefix (``KVManager.match``, which
        locks it); only the rest is allocated and prefilled. The admission rule decides
        whether its memory need fits what is left this step; a short pool evicts unlocked
        cached prefixes (LRU) first. Admission stops at the first request that does not fit
        (no overtaking), which keeps the queue order fair.
        """
        adder = self.admission.adder(self.running, self.memory, self.max_running)
        if self.waiting and adder.has_place:
            self.prioritize()
        new: list[Req] = []
        while self.waiting and adder.has_place:
            req = self.waiting[0]
            match = self.memory.match(req)
            fill = req.seq_len - match.length
            if not (adder.fits(req, fill) and self.memory.allocate(req, match)):
                self.memory.drop_match(req, match)
                break
            adder.add(req, fill)
            self.waiting.popleft()
            self._start(req, req.cached_len)  # the match, plus what the host tier loaded
            new.append(req)
        self.running.extend(new)
        return new

    def get_next_budgeted_batch(self) -> Batch:
        """This step's work under ``chunked_prefill_size`` (``minisrv.scheduler.chunked``):
        mixed, decodes first and chunks in what is left; prefill-first, prefills and chunks
        up to the budget, decodes only in a step without them."""
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
        """The next chunk of the request mid-prefill (seated in ``running`` by its last)."""
        entries = self.chunks.next_chunk(budget)
        self.running.extend(e.req for e in entries if e.sample)
        return entries

    def admit_chunks(self, budget: int) -> list[Entry]:
        """``admit`` under a token budget: each request with the KV of its whole prompt (so
        it can finish its prefill), the first that does not fit in ``budget`` as a chunk,
        which ends admission."""
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
            entries.append(entry := self.chunks.cut(req, req.cached_len, budget))
            budget -= entry.n_tokens
            if not entry.sample:
                break
            self.running.append(req)
        return entries

    def prioritize(self) -> None:
        """Reorder the waiting queue by the policy (``policy.calc_priority``, as SGLang sorts
        its queue each round); FCFS without the in-batch check keeps arrival order."""
        config = self.config
        check = config.in_batch_prefix_check
        if check is None:
            check = default_in_batch_check(config.policy)
        if config.policy == "fcfs" and not check:
            return
        queue = list(self.waiting)
        result = calc_priority(config.policy, self.tree, [[*r.prompt, *r.output] for r in queue],
                               in_batch_prefix_check=check, seed=self._rng,
                               max_new_tokens=[r.max_new_tokens for r in queue])
        self.waiting = deque(queue[i] for i in result.order)

    def prepare_decode(self) -> tuple[list[Req], tuple[Req, ...]]:
        """Give every running request a slot for its next token; retract if there are too few.

        Cached prefixes nobody uses are evicted first. Then retraction frees the request with
        the fewest generated tokens (the least work lost), the longest prompt breaking ties
        (the most memory won). It keeps its output and goes back to the head of the queue;
        on re-admission it prefills prompt plus output and continues exactly where it
        stopped. Returns the requests that decode this step and those retracted.
        """
        retracted: list[Req] = []
        while (short := self.decode_tokens(self.running) - self.memory.free_count) > 0:
            if self.memory.evict(short, "decode"):
                continue
            victim = self.retraction_victim(self.running)
            self.running.remove(victim)
            self.retract(victim)
            retracted.append(victim)
        self.waiting.extendleft(reversed(retracted))
        self.admission.after_decode_prepared(self.running, retracted)
        if self.wide is None:
            self.memory.alloc_decode(self.running)
        else:  # each wide entry's slots (a check's drafts included)
            self.wide.alloc(self.running, self.memory)
        return list(self.running), tuple(retracted)

    def decode_tokens(self, running: list[Req]) -> int:
        """KV slots the running requests' decodes take this step: one token each, or with
        wider entries (``wide.py``) each one's tokens without KV plus its guesses."""
        return len(running) if self.wide is None else self.wide.room(running)

    @staticmethod
    def retraction_victim(running: list[Req]) -> Req:
        """The request to retract first: fewest generated tokens, then the longest prompt."""
        return min(running, key=lambda r: (len(r.output), -r.prompt_len))

    def set_aside_finishing(self) -> None:
        """Move the running requests whose pending token is their last to ``finishing``: they
        decode no more and their seats are free for admission, while their KV stays counted
        until that token arrives (the overlapped loop's ``skip_finishing_decode``)."""
        finishing: list[Req] = []
        staying: list[Req] = []
        for req in (*self.finishing, *self.running):
            if req.state is ReqState.RUNNING:
                last = len(req.output) >= req.params.max_new_tokens
                (finishing if last else staying).append(req)
        self.finishing, self.running = finishing, staying

    # ----------------------------------------------------------------- completing a step
    def process_batch_result(self, batch: Batch, result: BatchResult) -> list[Req]:
        """Append each entry's tokens, stream them, and stop and free finished requests.

        A request stops when it has ``max_new_tokens`` tokens, or when it produced one of
        the model's end-of-sequence ids and does not ignore them. A prefilled request that
        goes on gives its KV to the prefix cache at once. Returns the requests that finished.
        """
        if len(result.tokens) != len(batch):
            raise ValueError(
                f"backend returned tokens for {len(result.tokens)} entries, the batch has "
                f"{len(batch)}"
            )
        finished = self.append_tokens(batch.entries, result.tokens)
        self.finish(batch.prefill, finished)
        return finished

    def append_tokens(self, entries: tuple[Entry, ...], results: list[list[int]]) -> list[Req]:
        """Append each entry's tokens to its request and stream them, up to the first that
        stops it; return the requests that finished. Tokens computed past the end of a
        request (the rest of a speculative check) are dropped, their KV freed (``truncate``)."""
        now, stops, on_token = self.clock, self.backend.eos_ids, self.on_token
        finished = []
        for (req, _, n_new, sample), tokens in zip(entries, results, strict=True):
            output, params = req.output, req.params
            for token in tokens:
                output.append(token)
                req.token_times.append(now)
                if on_token is not None:
                    on_token(req, token)
                if token in stops and not params.ignore_eos:
                    req.finish_reason = "eos"
                elif len(output) >= params.max_new_tokens:
                    req.finish_reason = "length"
                else:
                    continue
                finished.append(req)
                break
            if sample and n_new > 1 and (extra := len(req.kv_slots) - req.seq_len + 1) > 0:
                self.memory.truncate(req, extra)  # KV past the newest token
        return finished

    def finish(self, prefilled: list[Req], finished: list[Req],
               late: frozenset[int] = frozenset()) -> None:
        """The one finish path: prefilled requests that go on give their KV to the cache (a
        chunk's request the KV of that chunk); finished ones give theirs, leave, and are
        counted.

        ``late`` holds the ids of finished requests found so one step late (the overlapped
        loop): the step in flight computed one more token for those, whose KV goes first.
        """
        done = {id(req) for req in finished}
        for req in prefilled:
            if id(req) not in done and req.state == ReqState.RUNNING and (
                    not self.chunks.completed(req, self.memory)):
                self.memory.cache_prefilled(req)
        requeued = False  # a request retracted while its last token was computed
        for req in finished:
            requeued |= req.state == ReqState.WAITING
            self._finish_one(req, late=id(req) in late)
        if finished:
            self.running = [req for req in self.running if req.state == ReqState.RUNNING]
            self.finishing = [req for req in self.finishing if req.state == ReqState.RUNNING]
        if requeued:
            self.waiting = deque(req for req in self.waiting if req.state == ReqState.WAITING)
        self.stats.evicted_tokens = self.memory.evicted_tokens
        self.stats.host_hit_tokens = self.memory.host_hit_tokens
        self.stats.loaded_tokens = self.memory.loaded_tokens

    def _finish_one(self, req: Req, late: bool) -> None:
        """``req`` ends: its KV to the cache (after dropping the token computed past its end,
        if ``late``), its seat freed; a request retracted meanwhile holds no KV any more."""
        if req.state == ReqState.WAITING:
            req.state = ReqState.FINISHED
            self.backend.release(req)
        else:
            if late:
                req.output.pop()
                self.memory.truncate(req, 1)
            self.memory.cache_finished(req)
            self._leave(req, ReqState.FINISHED, release=not late)  # the step in flight samples
        self.stats.finished += 1

    def _start(self, req: Req, cached: int) -> None:
        """Bookkeeping of an admitted request (its slots are already allocated)."""
        if not req.output:  # a first admission (a retracted request has output)
            req.cached_prompt_tokens = cached
            self.stats.prompt_tokens += len(req.prompt)
            self.stats.cached_prompt_tokens += cached
        self.stats.cached_tokens += cached
        req.state = ReqState.RUNNING
        if req.admitted_at is None:  # the first admission: queueing delay ends here
            req.admitted_at = self.clock
