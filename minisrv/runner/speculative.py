"""A step with speculative checks on the runner: every row of a check scored, then verified.

A check entry (``Batch.drafts``) feeds ``[last token, *guesses]``; the forward keeps the
logits of all of its rows (a plain entry keeps only its last row, as always). The sampler
draws the plain entries' tokens (prefills, requests that do not draft) with its logits
processors; ``minisrv.spec.verify_batch`` keeps each check's tokens (greedy: the guesses
equal to the target's argmax, then the target's own; sampled: the rejection rule, with the
request's own generator). Each check's tokens are then cut at its request's stop (an eos,
unless ignored; its ``max_new_tokens``), so the result holds exactly what the scheduler
appends and ``stats.generated_tokens`` counts it right.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from minisrv.request import Req
from minisrv.runner.step_inputs import StepInputs, entry_tokens
from minisrv.sampling import SamplingParams
from minisrv.scheduler.records import Batch, BatchResult

if TYPE_CHECKING:
    from minisrv.runner.model_runner import ModelRunner

__all__ = ["Checks", "compute_checks", "cut_at_stop", "jump_forward", "prepare_checks"]


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


def prepare_checks(runner: ModelRunner, batch: Batch) -> StepInputs:
    """``ModelRunner.prepare`` for a batch holding checks: the flat batch, and the rows to
    score ordered plain entries' first, then every check's rows in entry order."""
    assert batch.drafts is not None
    new_ids, plain_rows, check_rows = [], [], []
    plain: list[Req] = []
    checks = Checks([], [], [], [], ())
    kinds = []
    row = 0
    for entry, draft in zip(batch.entries, batch.drafts, strict=True):
        req = entry.req
        if draft is None:
            ids = entry_tokens(req, entry.start, entry.end)
        else:
            ids = [*entry_tokens(req, entry.start, req.seq_len), *draft.tokens]
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
    sampler = runner.sampler
    checks.params.extend(req.params for req in checks.reqs)
    checks.generators.extend(sampler.generators(checks.reqs))
    device = runner.model.device
    flat = runner.flat_batch(new_ids, batch.entries)
    return StepInputs(
        flat, runner.attn.prepare(flat), False,
        torch.tensor([*plain_rows, *check_rows], dtype=torch.long, device=device),
        tuple(k > 0 for k in kinds), plain, [req.params for req in plain],
        sampler.generators(plain), sampler.histories(plain),
        checks._replace(kinds=tuple(kinds)))


def compute_checks(runner: ModelRunner, step: StepInputs) -> BatchResult:
    """``ModelRunner.compute`` for a step with checks: one forward, the plain rows sampled,
    the checks verified and cut at their stops."""
    from minisrv.spec.verify import verify_batch

    checks = step.checks
    assert step.flat is not None and checks is not None
    logits = runner.forward(step, step.flat.ids)
    n_plain = len(step.reqs)
    plain = iter(runner.sampler.sample(logits[:n_plain], step.reqs, step.params,
                                       step.generators, step.histories) if n_plain else [])
    kept = verify_batch(logits[n_plain:], checks.drafts, checks.params,
                        checks.generators) if checks.drafts else []
    eos = runner.eos_ids
    checked = iter(cut_at_stop(k, req, eos) for k, req in zip(kept, checks.reqs, strict=True))
    per_entry = [[next(plain)] if kind == 1 else next(checked) if kind == 2 else []
                 for kind in checks.kinds]
    if runner.jump is not None and n_plain:
        sampled = [tokens for tokens, kind in zip(per_entry, checks.kinds) if kind == 1]
        return jump_forward(runner.jump, step, per_entry, float(step.flat.num_tokens), sampled)
    return BatchResult(per_entry, cost=float(step.flat.num_tokens), elapsed=1.0)


def jump_forward(jump: Any, step: StepInputs, per_entry: list[list[int]], cost: float,
                 rows: list[list[int]] | None = None) -> BatchResult:
    """The step's result with each sampled entry's forced tokens after its token (the
    sampler's rows, ``step.reqs``: ``rows`` are their lists in ``per_entry``, by default
    every non-empty one). Jump-forward: ``GrammarSampling.jump``."""
    if rows is None:
        rows = [t for t in per_entry if t]
    jumped = 0
    for row, forced in zip(rows, jump.jump(step.reqs, step.generators), strict=True):
        row.extend(forced)
        jumped += len(forced)
    return BatchResult(per_entry, cost=cost, elapsed=1.0, jumped=jumped)
