"""The sampler: each request's private random generator, logits processors, then sampling.

A logits processor is any callable ``(logits, reqs) -> logits`` applied to the step's
logits [sampling entries, vocab] before a token is drawn, in list order: where constrained
decoding (grammar masks) plugs in. A request's own sampling parameters (penalties, logit
bias, ``min_tokens``) are applied by ``minisrv.sampling.sample_processed``, given each
request's history, which also returns the logprobs a request asked for. With neither, the
step's tokens are exactly ``minisrv.sampling.sample_batch``'s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch

from minisrv import sampling
from minisrv.request import Req
from minisrv.sampling import SamplingParams, TokenLogprobs, make_generator

__all__ = ["LogitsProcessor", "Sampler"]

LogitsProcessor = Callable[[torch.Tensor, Sequence[Req]], torch.Tensor]


class Sampler:
    """Chooses each sampling entry's next token; keeps every request's generator.

    A request's generator is made at its first prefill and kept across retractions (until
    ``release``), so its tokens depend only on its own prompt and seed: the outputs equal
    ``model.reference_generate`` whatever else shares the batch.
    """

    def __init__(self, logits_processors: Sequence[LogitsProcessor] = (),
                 stop_ids: Sequence[int] = ()) -> None:
        self.logits_processors: list[LogitsProcessor] = list(logits_processors)
        self.stop_ids = tuple(stop_ids)  # what min_tokens holds back
        self._generators: dict[Req, torch.Generator | None] = {}
        # Per request that asked for them: its tokens' logprobs, oldest first, until read.
        self.logprobs: dict[Req, deque[TokenLogprobs]] = {}

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
        for process in self.logits_processors:
            logits = process(logits, reqs)
        tokens, logprobs = sampling.sample_processed(logits, params, generators, histories,
                                                     self.stop_ids)
        for process in self.logits_processors:  # a processor that follows the tokens
            if hasattr(process, "accept"):
                process.accept(reqs, tokens)
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
        for process in self.logits_processors:
            if hasattr(process, "release"):
                process.release(req)

    @property
    def live_requests(self) -> int:
        """Requests with a generator held (admitted, not yet finished)."""
        return len(self._generators)
