"""The drafter interface, and the draft that needs no model: prompt lookup (n-gram).

A drafter guesses the next tokens of one request cheaply; the target model then checks
all of them in one forward (``minisrv.spec.verify``). Only the guesses' quality matters
for speed, never for correctness: a wrong guess is rejected by the check.

``Draft`` carries the guesses and, for a sampled request, the distribution ``q`` each was
drawn from (the rejection rule needs it); a drafter that guesses deterministically leaves
``probs`` as ``None``, meaning each guess had probability 1 under ``q``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from minisrv.checks import check_int
from minisrv.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    """The guessed tokens of one request, and the distributions they were drawn from.

    ``probs`` is ``None`` (every guess was certain: ``q`` is one-hot on it) or a float64
    [len(tokens), vocab] tensor whose row j is the ``q`` that ``tokens[j]`` was drawn from.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.probs is not None and (
            self.probs.dim() != 2 or self.probs.shape[0] != len(self.tokens)
        ):
            raise ValueError(
                f"probs must be [len(tokens)={len(self.tokens)}, vocab], "
                f"got {tuple(self.probs.shape)}"
            )

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(ABC):
    """What the engine and ``speculative_generate`` ask of a draft.

    ``propose(tokens, k)`` returns up to ``k`` guesses that follow ``tokens`` (the request's
    prompt and output so far); ``draft`` is the same for a request that may sample. A
    drafter with per-request state keys it by ``key`` and frees it in ``release(key)``;
    that state must follow ``tokens`` alone (a drafter re-synchronises to whatever
    ``tokens`` it is given, so the caller never reports acceptances or rejections).
    """

    @abstractmethod
    def propose(self, tokens: Sequence[int], k: int, *, key: Hashable = None) -> list[int]:
        """Up to ``k`` greedy guesses for the tokens after ``tokens`` (each drafter's own)."""

    def draft(
        self,
        tokens: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        *,
        key: Hashable = None,
    ) -> Draft:
        """Up to ``k`` guesses for a request decoded with ``params``.

        The default guesses deterministically (``propose``), which the rejection rule
        handles as a one-hot ``q``; a model draft overrides it to sample from its own ``q``.
        """
        return Draft(self.propose(tokens, k, key=key))

    def release(self, key: Hashable) -> None:  # noqa: B027 (a stateless drafter keeps nothing)
        """Forget the state kept for request ``key`` (finished or retracted); no-op here."""


def check_draft_args(tokens: Sequence[int], k: int) -> int:
    """``k`` as an int; ValueError for a negative ``k`` or an empty ``tokens``."""
    k = check_int("k", k, minimum=0)
    if len(tokens) == 0:
        raise ValueError("tokens is empty: a draft continues at least <bos>")
    return k


class NgramDrafter(Drafter):
    """Prompt lookup: continue the last earlier occurrence of the request's last n tokens.

    For n from ``max_n`` down to ``min_n`` (longest first, as vLLM's ``prompt_lookup_max``
    / ``prompt_lookup_min`` and SGLang's n-gram speculation), the suffix of length n is
    searched for in the tokens before it; at the most recent occurrence, the up to ``k``
    tokens that followed it are proposed. No match at any n: no guess (a plain decode
    step). City lists repeat a lot (a few-shot prompt's lines, a chat's earlier answers),
    which is where the lookup guesses right.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        self.min_n = check_int("min_n", min_n, minimum=1)
        self.max_n = check_int("max_n", max_n, minimum=self.min_n)

    def match(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """(n, start) of the chosen match: the longest n, then the latest ``start`` such that
        ``tokens[start:start + n]`` equals the last n tokens, with ``start + n < len(tokens)``
        (the suffix itself does not count); ``None`` when no n in range matches."""
        seq = list(tokens)
        length = len(seq)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = seq[length - n:]
            for start in range(length - n - 1, -1, -1):
                if seq[start:start + n] == suffix:
                    return n, start
        return None

    def propose(self, tokens: Sequence[int], k: int, *, key: Hashable = None) -> list[int]:
        """The up to ``k`` tokens that followed the chosen match (``match``)."""
        k = check_draft_args(tokens, k)
        found = self.match(tokens) if k else None
        if found is None:
            return []
        n, start = found
        return [int(t) for t in tokens[start + n:start + n + k]]

    def __repr__(self) -> str:
        return f"NgramDrafter(min_n={self.min_n}, max_n={self.max_n})"
