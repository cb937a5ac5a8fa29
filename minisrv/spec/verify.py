"""The check: which drafted tokens the target keeps, for many requests at once.

A check feeds the target ``[last token] + draft`` (k + 1 tokens) of a request and gets
k + 1 rows of logits: row j is the target's next-token prediction after draft token j-1.

- Greedy: keep the longest prefix of the draft equal to the target's argmax, then the
  target's own argmax after it, so 1..k+1 tokens and exactly what decoding alone gives.
- Sampling (Leviathan et al. 2023; Chen et al. 2023): draft token x, drawn from q, is
  accepted with probability min(1, p(x) / q(x)); the first rejected one is replaced by a
  draw from normalise(max(0, p - q)); if all k pass, one more token is drawn from p. The
  kept tokens are then distributed exactly as sampling from p would give.

p and q are ``nucleus_probs`` of the logits (temperature and top-p applied the same way
as ``minisrv.sampling``). Every draw comes from the request's own CPU generator, so one
request's tokens depend only on its seed, never on its batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from minisrv.sampling import SamplingParams, nucleus_probs, sample_next
from minisrv.spec.drafter import Draft


def sample_probs(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from the distribution ``probs`` [vocab] (need not sum to 1), one uniform draw.

    The same CDF inversion as ``sample_next``, so ``sample_probs(nucleus_probs(l, T, p), g)``
    equals ``sample_next(l, ...)`` draw for draw; a zero-probability token is never returned.
    """
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    index = int(torch.searchsorted(cdf, u * cdf[-1], right=True).item())
    index = min(index, probs.numel() - 1)
    while probs[index] == 0:
        index -= 1
    return index


def greedy_accept(target_argmax: Sequence[int], draft: Sequence[int]) -> list[int]:
    """The kept tokens: the draft's longest prefix equal to ``target_argmax``, then the
    target's next token. ``target_argmax`` has ``len(draft) + 1`` entries."""
    if len(target_argmax) != len(draft) + 1:
        raise ValueError(
            f"need len(draft) + 1 = {len(draft) + 1} target predictions, got {len(target_argmax)}"
        )
    kept: list[int] = []
    for guess, target in zip(draft, target_argmax):
        if guess != target:
            break
        kept.append(int(guess))
    kept.append(int(target_argmax[len(kept)]))
    return kept


def rejection_accept(
    logits: torch.Tensor, draft: Draft, params: SamplingParams, generator: torch.Generator,
) -> list[int]:
    """The kept tokens of one sampled request under the rejection rule (module docstring).
    ``logits`` [len(draft) + 1, vocab] are the target's rows of this check. One uniform draw
    per examined guess, plus one for the replacement or the bonus token."""
    _check_rows(logits, len(draft))
    kept: list[int] = []
    for j, token in enumerate(draft.tokens):
        p = nucleus_probs(logits[j], params.temperature, params.top_p)
        q = _draft_distribution(draft, j, p)  # one-hot for a deterministic draft (n-gram)
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if q[token] > 0 and u * float(q[token]) < float(p[token]):  # kept: min(1, p/q)
            kept.append(int(token))
            continue
        residual = torch.clamp(p - q, min=0.0)  # rejected: a draw from max(0, p - q)
        # p == q everywhere would accept with probability 1; guard the rounding case anyway.
        kept.append(sample_probs(residual if residual.sum() > 0 else p, generator))
        return kept
    kept.append(sample_next(logits[len(draft)], params, generator))  # all kept: one from p
    return kept


def _check_rows(logits: torch.Tensor, guesses: int) -> None:
    if logits.dim() != 2 or logits.shape[0] != guesses + 1:
        raise ValueError(f"logits must be [len(draft) + 1 = {guesses + 1}, vocab], "
                         f"got {tuple(logits.shape)}")


def _draft_distribution(draft: Draft, j: int, p: torch.Tensor) -> torch.Tensor:
    """q of guess ``j``: the draft's probabilities, or all mass on the guess when the draft
    is deterministic (``draft.probs is None``), which keeps it with probability p(x)."""
    if draft.probs is not None:
        return draft.probs[j].to(torch.float64)
    q = torch.zeros_like(p)
    q[draft.tokens[j]] = 1.0
    return q


def verify_batch(
    logits: torch.Tensor,
    drafts: Sequence[Draft],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[list[int]]:
    """The kept tokens (1..len(draft)+1 each) of every request of one check.

    ``logits`` [sum(len(d) + 1), vocab] holds the requests' rows back to back, in the order
    of ``drafts``: what ``CityLM.forward_flat`` returns for entries ``[last] + draft``.
    Greedy rows need one argmax over the whole batch (one device sync); sampled rows are
    moved to the CPU once and checked there with their own generators.
    """
    sizes = [len(d) + 1 for d in drafts]
    if not len(drafts) == len(params) == len(generators):
        raise ValueError(
            f"one params and generator per draft: {len(drafts)} drafts, {len(params)} params, "
            f"{len(generators)} generators"
        )
    if logits.dim() != 2 or logits.shape[0] != sum(sizes):
        raise ValueError(
            f"logits must be [sum(len(draft) + 1) = {sum(sizes)}, vocab], "
            f"got {tuple(logits.shape)}"
        )
    vocab = logits.shape[1]
    for i, draft in enumerate(drafts):
        if any(not 0 <= t < vocab for t in draft.tokens):
            raise ValueError(f"draft {i} has a token outside the vocabulary (0..{vocab - 1})")
    argmax: list[int] = logits.argmax(dim=-1).tolist()
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    starts = [0, *itertools.accumulate(sizes)]
    cpu_rows = logits.to("cpu") if sampled else None
    kept: list[list[int]] = []
    for i, draft in enumerate(drafts):
        lo, hi = starts[i], starts[i] + sizes[i]
        if params[i].greedy:
            kept.append(greedy_accept(argmax[lo:hi], draft.tokens))
        else:
            generator = generators[i]
            if generator is None:
                raise ValueError(f"request {i} samples but has no generator (make_generator)")
            kept.append(rejection_accept(cpu_rows[lo:hi], draft, params[i], generator))
    return kept
