"""Speculative decoding in the scheduler: drafts before the step, checks as entries, counts after.

With ``EngineConfig(speculative=..., num_draft_tokens=k)`` every running request that
decodes drafts ``k_r = min(k, max_new_tokens - len(output) - 1)`` guesses (the drafter of
``minisrv.spec``; the last token of a request never gets guesses, so nothing is computed
past ``max_new_tokens``). Its entry becomes a check: ``[last token, *guesses]``, one KV slot
each, whose result keeps 1..k_r+1 tokens (the runner verifies them, ``verify_batch``). The
scheduler's ordinary path does the rest: ``append_tokens`` appends the kept tokens and
frees the KV of the rejected guesses (``KVManager.truncate``), so a request holds only
accepted tokens between steps and the prefix cache never sees a guess.

The order of one request's random draws is fixed: its draft for check i (a sampled model
draft draws from the request's own generator), then check i's verification, then check
i+1's draft. So its tokens depend only on its seed, and equal ``speculative_generate``'s.

A request whose logits are processed (penalties, bias, ``min_tokens``, a grammar) or that
asks for logprobs drafts nothing: its entry is an ordinary decode, sampled by the sampler.

A check's entry also starts at the request's first token without KV, so it carries the
tokens a grammar forced (jump-forward) too; jump-forward alone has its own entries
(``wide.py``'s ``JumpForward``), which guess nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from minisrv.core import Batch, BatchResult, Entry
from minisrv.kv.manager import KVManager
from minisrv.request import Req
from minisrv.sampling import SamplingParams
from minisrv.scheduler.records import SchedulerStats

__all__ = ["Speculation", "drafts_for", "make_drafter"]

Generators = Callable[[Sequence[Req]], list[Any]]


def make_drafter(speculative: Any) -> Any:
    """The drafter ``EngineConfig.speculative`` names ("ngram", "draft"), or the object given."""
    if speculative == "ngram":
        from minisrv.spec.drafter import NgramDrafter

        return NgramDrafter()
    if speculative == "draft":
        from minisrv.spec.draft_model import DraftModelDrafter

        return DraftModelDrafter()
    return speculative


def drafts_for(params: SamplingParams) -> bool:
    """Whether a request with ``params`` is checked speculatively: not when a logits
    processor or logprobs need each of its rows to pass through the sampler."""
    return not (params.processed or params.logprobs is not None or params.grammar is not None)


class Speculation:
    """One engine's drafter and draft length, and the drafts of the step being formed.

    ``generators`` gives the requests' random generators (the runner's ``Sampler``): a
    sampled draft draws from them. ``drafter`` is the object ``make_drafter`` returns. It is
    one ``WideDecode`` (``wide.py``): the scheduler calls it as it calls ``JumpForward``.
    """

    def __init__(self, drafter: Any, k: int, generators: Generators,
                 vocab_size: int | None = None) -> None:
        self.drafter = drafter
        self.k = k
        self.generators = generators
        self.vocab_size = vocab_size  # a guess must be a token of the target
        self._planned: dict[Req, tuple[int, Any]] = {}  # req -> (first position, draft)

    def guesses(self, req: Req) -> int:
        """The most guesses ``req`` may draft now (0 for its last token, or no drafting)."""
        if not drafts_for(req.params):
            return 0
        return max(0, min(self.k, req.remaining_new_tokens - 1))

    def tokens(self, req: Req) -> int:
        """Tokens ``req``'s entry may give KV this step (an upper bound: a drafter may
        guess fewer)."""
        return req.seq_len - req.kv_len + self.guesses(req)

    def alloc(self, running: Sequence[Req], memory: KVManager) -> None:
        """Draft for every running request and give each the slots of its entry: every
        token from its first one without KV (its newest) through its last guess. A bad
        draft (too long, a token outside the vocabulary) is a ValueError before any slot
        is taken."""
        from minisrv.spec.drafter import Draft

        planned = self._planned
        planned.clear()
        vocab, drafter = self.vocab_size, self.drafter
        for req, generator in zip(running, self.generators(running), strict=True):
            draft = None
            if drafts_for(req.params):
                k = self.guesses(req)
                draft = drafter.draft([*req.prompt, *req.output], k, req.params, generator,
                                      key=req.rid)
                if not isinstance(draft, Draft) or len(draft) > k or (vocab is not None and any(
                        not 0 <= t < vocab for t in draft.tokens)):
                    planned.clear()
                    raise ValueError(f"the drafter must return a Draft of at most {k} tokens "
                                     f"of the vocabulary (0..{vocab}) for request {req.rid}, "
                                     f"got {draft!r}")
            planned[req] = (req.kv_len, draft)
        for req, (start, draft) in planned.items():
            memory.alloc_tokens(req, req.seq_len - start + (len(draft) if draft else 0))

    def expand(self, batch: Batch) -> Batch:
        """``batch`` with each decode entry widened to its check (``alloc``'s plan)."""
        planned = self._planned
        if not planned:
            return batch
        n_prefill = batch.n_prefill
        entries = list(batch.entries[:n_prefill])
        drafts: list[Any] = [None] * n_prefill
        for entry in batch.entries[n_prefill:]:
            req = entry.req
            start, draft = planned[req]
            entries.append(Entry(req, start, req.seq_len - start + (len(draft) if draft else 0)))
            drafts.append(draft)
        planned.clear()
        return Batch(tuple(entries), n_prefill, batch.retracted, tuple(drafts))

    def count(self, batch: Batch, result: BatchResult, stats: SchedulerStats,
              before: dict[str, Any]) -> None:
        """Count each check's guesses and kept ones: totals, per request, the step's trace
        line (the runner cut each check's tokens at its request's stop, so its tokens are
        what was appended: the kept guesses, then one of the target's)."""
        if batch.drafts is None:
            return
        checks = []
        for entry, draft, tokens in zip(batch.entries, batch.drafts, result.tokens,
                                        strict=True):
            if draft is None:
                continue
            req, drafted, accepted = entry.req, len(draft), len(tokens) - 1
            req.draft_tokens += drafted
            req.accepted_tokens += accepted
            checks.append((req.rid, drafted, accepted))
        drafted = sum(c[1] for c in checks)
        accepted = sum(c[2] for c in checks)
        stats.draft_tokens += drafted
        stats.accepted_tokens += accepted
        before.update(drafted=drafted, accepted=accepted, checks=tuple(checks))

    def release(self, req: Req) -> None:
        """Forget the drafter's state of ``req`` (finished, aborted or retracted)."""
        self.drafter.release(req.rid)
