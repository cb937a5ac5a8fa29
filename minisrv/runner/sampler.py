"""The sampler: each request's private random generator, logits processors, then sampling.

A logits processor is any callable ``(logits, reqs) -> logits`` applied to the step's
logits [sampling entries, vocab] before a token is drawn, in order: where constrained
decoding (grammar masks) plugs in. One that keeps state per request (a grammar's automaton)
declares it by being a ``TokenFollower``: it is then also told each step's tokens and each
request that ends. A request's own sampling parameters (penalties, logit bias,
``min_tokens``) are applied by ``minisrv.sampling.sample_processed``, given each request's
history, which also returns the logprobs a request asked for. With neither, the step's
tokens are exactly ``minisrv.sampling.sample_batch``'s.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from minisrv import sampling
from minisrv.request import Req
from minisrv.sampling import SamplingParams, TokenLogprobs, make_generator

__all__ = ["LogitsProcessor", "Sampler", "TokenFollower"]

LogitsProcessor = Callable[[torch.Tensor, Sequence[Req]], torch.Tensor]


class TokenFollower(ABC):
    """A logits processor that keeps state per request: after each step it is given the
    tokens drawn (``accept``), and a request that ends is forgotten (``release``). Being a
    subclass is the declaration; the sampler reads it once, when the processor is installed,
    never during a step."""

    @abstractmethod
    def __call__(self, logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
        """The step's logits, processed (in place or anew)."""

    @abstractmethod
    def accept(self, reqs: Sequence[Req], tokens: Sequence[int]) -> None:
        """Follow the tokens drawn for ``reqs`` (one per row)."""

    @abstractmethod
    def release(self, req: Req) -> None:
        """Forget a request that finished or was aborted."""


@dataclass(frozen=True)
class _Installed:
    """The processors a step applies, in order, and those of them that follow tokens. The
    sampler holds one and replaces it whole, so a step that reads it once sees one set."""

    processors: tuple[LogitsProcessor, ...] = ()
    followers: tuple[TokenFollower, ...] = ()

    @classmethod
    def of(cls, processors: Iterable[LogitsProcessor]) -> _Installed:
        processors = tuple(processors)
        return cls(processors, tuple(p for p in processors if isinstance(p, TokenFollower)))


class Sampler:
    """Chooses each sampling entry's next token; keeps every request's generator.

    A request's generator is made at its first prefill and kept across retractions (until
    ``release``), so its tokens depend only on its own prompt and seed: the outputs equal
    ``model.reference_generate`` whatever else shares the batch.
    """

    def __init__(self, logits_processors: Sequence[LogitsProcessor] = (),
                 stop_ids: Sequence[int] = ()) -> None:
        self._installed = _Installed.of(logits_processors)
        self._install_lock = threading.Lock()  # orders installers; a step never waits on it
        self.stop_ids = tuple(stop_ids)  # what min_tokens holds back
        self._generators: dict[Req, torch.Generator | None] = {}
        # Per request that asked for them: its tokens' logprobs, oldest first, until read.
        self.logprobs: dict[Req, deque[TokenLogprobs]] = {}

    @property
    def logits_processors(self) -> tuple[LogitsProcessor, ...]:
        """The processors applied to every step, in order."""
        return self._installed.processors

    def install(self, processor: LogitsProcessor,
                replacing: LogitsProcessor | None = None) -> None:
        """Apply ``processor`` last from the next step on, in place of ``replacing`` if that
        is given. Safe from any thread while another runs steps: the new set is one
        assignment, and a step reads the set once, so it applies the old processors or the
        new ones, never a mix (a step half done when a processor comes never masks with it
        and then gives it tokens, nor the reverse)."""
        with self._install_lock:
            kept = [p for p in self._installed.processors if p is not replacing]
            self._installed = _Installed.of([*kept, processor])

    def generators(self, reqs: Sequence[Req]) -> list[torch.Generator | None]:
        """The generators of ``reqs``, made for those that have none yet."""
        gens = self._generators
        for req in reqs:
            if req not in gens:
                gens[req] = make_generator(req.params)
        return [gens[req] for req in reqs]

    def sample(self, logits: torch.Tensor, reqs: Sequence[Req], params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None],
               histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
               ) -> list[int]:
        """One token per row of ``logits``, after every logits processor.

        ``histories`` (each request's prompt and output, or None when no request of the step
        has a penalty, a bias or ``min_tokens``) feed the per-request processing.
        """
        installed = self._installed  # read once: one set masks and follows this step
        for process in installed.processors:
            logits = process(logits, reqs)
        tokens, logprobs = sampling.sample_processed(logits, params, generators, histories,
                                                     self.stop_ids)
        for follower in installed.followers:
            follower.accept(reqs, tokens)
        for req, entry in zip(reqs, logprobs):
            if entry is not None:
                self.logprobs.setdefault(req, deque()).append(entry)
        return tokens

    @staticmethod
    def histories(reqs: Sequence[Req]) -> list[tuple[list[int], list[int]]] | None:
        """What the per-request processing reads: copies, since the loop appends to them."""
        if not any(req.params.processed for req in reqs):
            return None
        return [(req.prompt, list(req.output)) for req in reqs]

    def release(self, req: Req) -> None:
        """Forget ``req``'s generator and any logprobs not read."""
        self._generators.pop(req, None)
        self.logprobs.pop(req, None)
        for follower in self._installed.followers:
            follower.release(req)

    @property
    def live_requests(self) -> int:
        """Requests with a generator held (admitted, not yet finished)."""
        return len(self._generators)
