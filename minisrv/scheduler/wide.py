"""Decode entries wider than one token: speculative checks, and jump-forward's catch-up.

Two features make a running request's entry compute more than its newest token, for
different reasons. Speculative decoding (``speculative.py``'s ``Speculation``) widens it
by the draft's guesses, which the runner checks. Jump-forward (``JumpForward`` here) widens
it by the tokens a grammar forced after the last step: they were appended without KV, so
the next entry computes every token from the first one without KV through the newest, and
samples after them as a plain decode does. Nothing is guessed, nothing is checked.

The scheduler drives either through the same four calls (``WideDecode``): the tokens each
request's entry may give KV this step (``tokens``: the scheduler counts their pages), their
slots (``alloc``, before the step is formed), the widened entries (``expand``), and
forgetting a request (``release``); ``count`` adds a step's checks to the totals.
``make_wide`` picks the one an ``EngineConfig`` asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from minisrv.core import Backend, Batch, BatchResult, DraftVerifier, Entry
from minisrv.kv.manager import KVManager
from minisrv.request import Req
from minisrv.scheduler.records import SchedulerStats
from minisrv.scheduler.speculative import Speculation, make_drafter

if TYPE_CHECKING:
    from minisrv.scheduler.config import EngineConfig

__all__ = ["JumpForward", "WideDecode", "make_wide"]


class WideDecode(Protocol):
    """What the scheduler asks of a feature that widens decode entries."""

    def tokens(self, req: Req) -> int: ...

    def alloc(self, running: Sequence[Req], memory: KVManager) -> None: ...

    def expand(self, batch: Batch) -> Batch: ...

    def count(self, batch: Batch, result: BatchResult, stats: SchedulerStats,
              before: dict[str, Any]) -> None: ...

    def release(self, req: Req) -> None: ...


class JumpForward:
    """Jump-forward's entries: each decode computes its tokens without KV, then samples.

    A request the grammar moved forward holds ``seq_len - kv_len > 1`` tokens
    without KV; its entry starts at the first of them (``alloc`` remembers where, then
    takes their slots). The runner appends the grammar's next forced tokens after sampling
    (``ModelRunner.set_jump``), so the scheduler only sees longer results.
    """

    def __init__(self) -> None:
        self._starts: dict[Req, int] = {}  # req -> its entry's first position, this step

    def tokens(self, req: Req) -> int:
        """Tokens ``req``'s entry gives KV this step: every token without KV."""
        return req.seq_len - req.kv_len

    def alloc(self, running: Sequence[Req], memory: KVManager) -> None:
        """Give every running request the slots of its tokens without KV."""
        starts = self._starts
        starts.clear()
        for req in running:
            starts[req] = start = req.kv_len
            memory.alloc_tokens(req, req.seq_len - start)

    def expand(self, batch: Batch) -> Batch:
        """``batch`` with each decode entry widened to every token ``alloc`` gave slots."""
        starts = self._starts
        if not starts:
            return batch
        n_prefill = batch.n_prefill
        entries = list(batch.entries[:n_prefill])
        for entry in batch.entries[n_prefill:]:
            req = entry.req
            entries.append(Entry(req, starts[req], req.seq_len - starts[req]))
        starts.clear()
        return Batch(tuple(entries), n_prefill, batch.retracted)

    def count(self, batch: Batch, result: BatchResult, stats: SchedulerStats,
              before: dict[str, Any]) -> None:
        """Nothing to count: the forced tokens are in ``result.jumped`` already."""

    def release(self, req: Req) -> None:
        """Nothing is kept per request between steps."""


def make_wide(config: EngineConfig, backend: Backend) -> WideDecode | None:
    """Speculative checks (``config.speculative``, which also carry jump-forward's tokens),
    jump-forward's entries alone, or None: decodes of one token. The backend's
    capabilities were checked when the scheduler was built."""
    if config.speculative is None:
        return JumpForward() if config.jump_forward else None
    sampler = cast(DraftVerifier, backend).sampler
    if sampler.logits_processors:
        raise ValueError("speculative decoding checks its rows without the runner's logits "
                         "processors: give the ModelRunner none")
    return Speculation(make_drafter(config.speculative), config.num_draft_tokens,
                       sampler.generators, backend.vocab_size)
