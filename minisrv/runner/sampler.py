"""The sampler: each request's private random generator, logits processors, then sampling.

A logits processor is any callable ``(logits, reqs) -> logits`` applied to the step's
logits [sampling entries, vocab] before a token is drawn, in list order: where constrained
decoding (grammar masks), penalties, logit bias and logprobs plug in. With none, the step's
tokens are exactly ``minisrv.sampling.sample_batch``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from minisrv import sampling
from minisrv.request import Req
from minisrv.sampling import SamplingParams, make_generator

__all__ = ["LogitsProcessor", "Sampler"]

LogitsProcessor = Callable[[torch.Tensor, Sequence[Req]], torch.Tensor]


class Sampler:
    """Chooses each sampling entry's next token; keeps every request's generator.

    A request's generator is made at its first prefill and kept across retractions (until
    ``release``), so its tokens depend only on its own prompt and seed: the outputs equal
    ``model.reference_generate`` whatever else shares the batch.
    """

    def __init__(self, logits_processors: Sequence[LogitsProcessor] = ()) -> None:
        self.logits_processors: list[LogitsProcessor] = list(logits_processors)
        self._generators: dict[Req, torch.Generator | None] = {}

    def generators(self, reqs: Sequence[Req]) -> list[torch.Generator | None]:
        """The generators of ``reqs``, made for those that have none yet."""
        gens = self._generators
        for req in reqs:
            if req not in gens:
                gens[req] = make_generator(req.params)
        return [gens[req] for req in reqs]

    def sample(self, logits: torch.Tensor, reqs: Sequence[Req], params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None]) -> list[int]:
        """One token per row of ``logits``, after every logits processor."""
        for process in self.logits_processors:
            logits = process(logits, reqs)
        return sampling.sample_batch(logits, params, generators)

    def release(self, req: Req) -> None:
        """Forget ``req``'s generator."""
        self._generators.pop(req, None)

    @property
    def live_requests(self) -> int:
        """Requests with a generator held (admitted, not yet finished)."""
        return len(self._generators)
