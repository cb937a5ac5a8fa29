"""How the next token is chosen from the logits: greedy, or temperature + top-p sampling.

Scheduling must never change which tokens come out (DESIGN principle 3). For sampled
requests that means the random draws of one request may depend only on that request's seed
and its own logits, never on which other requests share its batch or on the device. So
each request owns a CPU ``torch.Generator`` (``make_generator``), the distribution is built
on the CPU in float64, and every token consumes exactly one uniform draw from it. The
batched engine and ``CityLM.reference_generate`` both call ``sample_next`` and therefore
produce the same samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minisrv.checks import check_int


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    ``temperature == 0`` means greedy (argmax). Otherwise logits are divided by the
    temperature and the token is drawn from the smallest set of most likely tokens whose
    probability reaches ``top_p`` (nucleus sampling). ``seed`` makes the draws repeatable;
    ``ignore_eos`` keeps generating past ``<eos>`` (benchmarks use it to fix output lengths).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            check_int("seed", self.seed)

    @property
    def greedy(self) -> bool:
        """True when no randomness is involved."""
        return self.temperature == 0


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The private random stream of one request: ``None`` for greedy, else a seeded CPU generator.

    A request without a seed still gets its own generator (seeded from the OS), so its
    draws never disturb another request's stream.
    """
    if params.greedy:
        return None
    generator = torch.Generator(device="cpu")
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def nucleus_probs(logits_1d: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The sampling distribution (float64, CPU): softmax(logits / T) cut to its top-p nucleus.

    Tokens are ranked by probability (ties by id, since the sort is stable); the nucleus is
    the shortest prefix of that ranking whose mass reaches ``top_p``. The most likely token
    is always kept, so the result is never empty.
    """
    probs = torch.softmax(logits_1d.detach().to("cpu", torch.float64) / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep = torch.zeros_like(keep_sorted)
    keep[order] = keep_sorted
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum()


def sample_next(
    logits_1d: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """The next token id for one request, given the logits of its last position.

    Greedy takes the argmax (the lowest id among exact ties). Sampling inverts the CDF of
    ``nucleus_probs`` at one uniform draw from ``generator``, so the token depends only on
    these logits and on how many tokens this generator has produced before.
    """
    if logits_1d.dim() != 1:
        raise ValueError(f"logits_1d must be 1-D [vocab], got shape {tuple(logits_1d.shape)}")
    if params.greedy:
        return int(torch.argmax(logits_1d).item())
    if generator is None:
        raise ValueError("sampling with temperature > 0 needs a generator (see make_generator)")
    probs = nucleus_probs(logits_1d, params.temperature, params.top_p)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    index = int(torch.searchsorted(cdf, u * cdf[-1], right=True).item())
    # A draw at the very top of the CDF could fall past the last kept token through rounding.
    index = min(index, probs.numel() - 1)
    while probs[index] == 0:  # never land on a token outside the nucleus
        index -= 1
    return index


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """``sample_next`` for every row of a step's logits [requests, vocab], in one go.

    The same tokens as one ``sample_next`` call per row, but the step waits for the device
    ONCE (one argmax for every row and one copy to the host) instead of once per request:
    at batch 64 that is 63 synchronisations saved per step. When some rows sample, those
    rows travel with every argmax in the same copy, in the logits' dtype widened to at
    least float32 (exact for every logit and for ids below 2**24); the draws are made on
    the host with each request's generator, where ``sample_next`` works in float64 anyway.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(
            f"logits must be [requests, vocab] with one params and generator per row, got "
            f"{tuple(logits.shape)}, {len(params)} params, {len(generators)} generators"
        )
    greedy = logits.argmax(dim=-1)  # greedy rows: the lowest id of ties
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return greedy.tolist()
    wide = torch.promote_types(logits.dtype, torch.float32)
    rows = logits[torch.tensor(sampled, device=logits.device)].to(wide)
    host = torch.cat([greedy.to(wide), rows.flatten()]).cpu()  # the step's one read-back
    tokens: list[int] = host[: len(params)].long().tolist()
    for row, i in zip(host[len(params):].view(len(sampled), -1), sampled):
        tokens[i] = sample_next(row, params[i], generators[i])
    return tokens
