"""Completing a batch: its tokens into the requests, the stop rules, the one finish path.

``BatchCompleter`` is the third of the step's calls. The blocking loop hands it a step's
result (``process_batch_result``); the overlapped loop applies the tokens itself, one step
late, and calls the same ``finish``, so a request leaves, gives its KV to the prefix cache
and frees its seat the same way in both loops.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from minisrv.core import Backend, Batch, BatchResult, Entry
from minisrv.kv.manager import KVManager
from minisrv.request import Req, ReqState
from minisrv.scheduler.lifecycle import Lifecycle
from minisrv.scheduler.queues import RequestQueues
from minisrv.scheduler.recorder import StepRecorder

__all__ = ["BatchCompleter", "accept_token"]


class BatchCompleter:
    """Appends, streams (``on_token``), stops and finishes the requests of a step."""

    def __init__(self, queues: RequestQueues, memory: KVManager, lifecycle: Lifecycle,
                 recorder: StepRecorder, backend: Backend) -> None:
        self.queues, self.memory, self.lifecycle = queues, memory, lifecycle
        self.recorder, self.backend = recorder, backend
        self.on_token: Callable[[Req, int], None] | None = None  # streaming hook

    def process_batch_result(self, batch: Batch, result: BatchResult) -> list[Req]:
        """Append each entry's tokens, stream them, and stop and free finished requests.

        Each token goes through ``accept``, the one stop rule. A prefilled request that goes
        on gives its KV to the prefix cache at once. Returns the requests that finished.
        """
        self.check_size(batch, result)
        finished = self.append_tokens(batch.entries, result.tokens)
        self.finish(batch.prefill, finished)
        return finished

    @staticmethod
    def check_size(batch: Batch, result: BatchResult) -> None:
        """Raise ValueError unless the backend answered once per entry of ``batch``."""
        if len(result.tokens) != len(batch):
            raise ValueError(
                f"backend returned tokens for {len(result.tokens)} entries, the batch has "
                f"{len(batch)}"
            )

    def accept(self, req: Req, token: int, position: int) -> str | None:
        """Put ``token`` at ``position`` of ``req``'s output, stamp it with the clock, and
        return why it ends ``req`` (also set as ``req.finish_reason``), or ``None``.

        Both loops take every token through here: the blocking loop appends (``position``
        is the output's length); the overlapped loop writes over the placeholder it put at
        ``position`` when the step was launched, which a later step's placeholder may
        already follow. The stop itself is the request's rule (``Req.stop_reason``): the
        model's end-of-sequence ids unless ignored, then ``max_new_tokens``.
        """
        return accept_token(req, token, position, self.recorder.clock, self.backend.eos_ids)

    def append_tokens(self, entries: tuple[Entry, ...], results: list[list[int]]) -> list[Req]:
        """Append each entry's tokens to its request and stream them, up to the first that
        stops it (``accept``); return the requests that finished. Tokens computed past the end
        of a request (the rest of a speculative check) are dropped, their KV freed
        (``truncate``)."""
        on_token, clock, eos_ids = self.on_token, self.recorder.clock, self.backend.eos_ids
        finished = []
        for (req, _, n_new, sample), tokens in zip(entries, results, strict=True):
            for token in tokens:
                stop = accept_token(req, token, len(req.output), clock, eos_ids)
                if on_token is not None:
                    on_token(req, token)
                if stop is not None:
                    finished.append(req)
                    break
            if sample and n_new > 1 and (extra := req.kv_len - req.seq_len + 1) > 0:
                self.memory.truncate(req, extra)  # KV past the newest token
        return finished

    def finish(self, prefilled: list[Req], finished: list[Req],
               late: frozenset[int] = frozenset(), release: bool = True) -> None:
        """The one finish path: prefilled requests that go on give their KV to the cache (a
        chunk's request the KV of that chunk); finished ones give theirs, leave, and are
        counted.

        ``late`` holds the ids of finished requests found so one step late (the overlapped
        loop): the step in flight computed one more token for those, whose KV goes first.
        ``release=False`` keeps the backend's state of every finished request (its sampler
        state and unread logprobs) for the caller to release: the overlapped loop streams a
        step's tokens, and their logprobs, after it has finished the step's requests.
        """
        queues, memory = self.queues, self.memory
        done = {id(req) for req in finished}
        for req in prefilled:
            if id(req) not in done and req.state == ReqState.RUNNING and (
                    not queues.chunks.completed(req, memory)):
                memory.cache_unfinished(req)
        requeued = False  # a request retracted while its last token was computed
        for req in finished:
            requeued |= req.state == ReqState.WAITING
            self._finish_one(req, late=id(req) in late, release=release)
        if finished:
            queues.drop_left()
        if requeued:
            queues.waiting = deque(req for req in queues.waiting
                                   if req.state == ReqState.WAITING)
        self.recorder.count_memory()

    def _finish_one(self, req: Req, late: bool, release: bool) -> None:
        """``req`` ends: its KV to the cache (after dropping the token computed past its end,
        if ``late``), its seat freed; a request retracted meanwhile holds no KV any more."""
        if req.state == ReqState.WAITING:
            req.state = ReqState.FINISHED
            if release:
                self.backend.release(req)
        else:
            if late:
                req.output.pop()
                self.memory.truncate(req, 1)
            self.memory.cache_finished(req)
            self.lifecycle.leave(req, ReqState.FINISHED, release=release)
        self.recorder.stats.finished += 1


def accept_token(req: Req, token: int, position: int, clock: float,
                 eos_ids: tuple[int, ...]) -> str | None:
    """``BatchCompleter.accept`` with the step's clock and the backend's end-of-sequence ids
    read once per step, not once per token: a GPU-scale simulation appends hundreds of
    thousands of tokens."""
    output = req.output
    if position == len(output):
        output.append(token)
    else:
        output[position] = token
    req.token_times.append(clock)
    reason = req.stop_reason(token, position, eos_ids)
    if reason is not None:
        req.finish_reason = reason
    return reason
