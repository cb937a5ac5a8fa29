"""A step with speculative checks on the runner: every row of a check scored, then verified.

A check entry (``Batch.drafts``) feeds ``[last token, *guesses]``; the forward keeps the
logits of all of its rows (a plain entry keeps only its last row, as always). The sampler
draws the plain entries' tokens (prefills, requests that do not draft) with its logits
processors; ``minisrv.spec.verify_batch`` keeps each check's tokens (greedy: the guesses
equal to the target's argmax, then the target's own; sampled: the rejection rule, with the
request's own generator). Each check's tokens are then cut at its request's stop (an eos,
unless ignored; its ``max_new_tokens``), so the result holds exactly what the scheduler
appends and ``stats.generated_tokens`` counts it right.

``ModelRunner`` drives these: ``plan_checks`` says what its ``prepare`` feeds and scores,
``verify_checks`` what its ``compute`` keeps; neither needs the runner, so this module
imports nothing of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from minisrv.core import Batch, BatchResult
from minisrv.request import Req
from minisrv.runner.sampler import Sampler
from minisrv.sampling import SamplingParams

__all__ = ["CheckPlan", "Checks", "cut_at_stop", "jump_forward", "plan_checks",
           "verify_checks"]


class Checks(NamedTuple):
    """The checks of one step: their drafts, requests, sampling and where their rows are."""

    drafts: list[Any]  # minisrv.spec.Draft per check, in entry order
    reqs: list[Req]
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    kinds: tuple[int, ...]  # per entry: 0 no token (a chunk), 1 sampled, 2 a check


def cut_at_stop(tokens: list[int], req: Req, eos_ids: Sequence[int]) -> list[int]:
    """``tokens`` (a check's, to follow ``req``'s output) up to the first that stops it
    (``Req.stop_reason``: the first eos, or its ``max_new_tokens``-th token)."""
    start = len(req.output)
    for i, token in enumerate(tokens):
        if req.stop_reason(token, start + i, eos_ids) is not None:
            return tokens[: i + 1]
    return tokens


class CheckPlan(NamedTuple):
    """What a step holding checks feeds and scores (``plan_checks``)."""

    new_ids: list[list[int]]  # per entry: its tokens, a check's guesses after its last one
    rows: list[int]  # the rows to score: plain entries' last rows, then every check's rows
    plain: list[Req]  # the plain entries that sample, in entry order
    checks: Checks


def plan_checks(batch: Batch, sampler: Sampler) -> CheckPlan:
    """The new tokens of a batch holding checks, and the rows to score ordered plain
    entries' first, then every check's rows in entry order."""
    assert batch.drafts is not None
    new_ids, plain_rows, check_rows = [], [], []
    plain: list[Req] = []
    checks = Checks([], [], [], [], ())
    kinds = []
    row = 0
    for entry, draft in zip(batch.entries, batch.drafts, strict=True):
        req = entry.req
        if draft is None:
            ids = req.tokens(entry.start, entry.end)
        else:
            ids = [*req.tokens(entry.start, req.seq_len), *draft.tokens]
        new_ids.append(ids)
        row += entry.n_tokens
        if draft is not None:
            check_rows.extend(range(row - len(draft) - 1, row))
            checks.drafts.append(draft)
            checks.reqs.append(req)
            kinds.append(2)
        elif entry.sample:
            plain_rows.append(row - 1)
            plain.append(req)
            kinds.append(1)
        else:
            kinds.append(0)
    checks.params.extend(req.params for req in checks.reqs)
    checks.generators.extend(sampler.generators(checks.reqs))
    return CheckPlan(new_ids, [*plain_rows, *check_rows], plain,
                     checks._replace(kinds=tuple(kinds)))


def verify_checks(logits: torch.Tensor, plain: list[int], checks: Checks,
                  eos_ids: Sequence[int]) -> list[list[int]]:
    """Each entry's tokens: the ``plain`` entries' sampled ones, and each check's kept
    guesses (``logits`` [its rows, vocab], every check's rows in entry order) cut at its
    request's stop."""
    from minisrv.spec.verify import verify_batch

    kept = verify_batch(logits, checks.drafts, checks.params,
                        checks.generators) if checks.drafts else []
    sampled = iter(plain)
    checked = iter(cut_at_stop(k, req, eos_ids) for k, req in zip(kept, checks.reqs, strict=True))
    return [[next(sampled)] if kind == 1 else next(checked) if kind == 2 else []
            for kind in checks.kinds]


def jump_forward(jump: Any, reqs: list[Req], generators: list[torch.Generator | None],
                 per_entry: list[list[int]], cost: float,
                 rows: list[list[int]] | None = None) -> BatchResult:
    """The step's result with each sampled entry's forced tokens after its token (the
    sampler's rows, ``reqs`` with their ``generators``: ``rows`` are their lists in
    ``per_entry``, by default every non-empty one). Jump-forward: ``GrammarSampling.jump``."""
    if rows is None:
        rows = [t for t in per_entry if t]
    jumped = 0
    for row, forced in zip(rows, jump.jump(reqs, generators), strict=True):
        row.extend(forced)
        jumped += len(forced)
    return BatchResult(per_entry, cost=cost, elapsed=1.0, jumped=jumped)
