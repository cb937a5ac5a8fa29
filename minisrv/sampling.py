"""How the next token is chosen from the logits: greedy, or temperature + top-p sampling,
after the logits processors a request asks for (penalties, logit bias, min_tokens).

Scheduling must never change which tokens come out (DESIGN principle 3). For sampled
requests that means the random draws of one request may depend only on that request's seed
and its own logits, never on which other requests share its batch or on the device. So
each request owns a CPU ``torch.Generator`` (``make_generator``), the distribution is built
on the CPU in float64, and every token consumes exactly one uniform draw from it. The
batched engine and ``CityLM.reference_generate`` both call ``sample_next`` and therefore
produce the same samples.

The logits processors (``process_logits``, batched over a step's rows; ``process_row`` is
the per-request reference it must equal) change a request's logits from its own prompt and
output only, in vLLM's order: ``logit_bias`` is added, stop ids are masked while fewer
than ``min_tokens`` tokens exist, then the repetition penalty (CTRL's: a positive logit of a
token seen in the prompt or the output is divided by it, a negative one multiplied), the
frequency penalty (minus ``frequency_penalty`` times the token's count in the output) and
the presence penalty (minus ``presence_penalty`` once it occurred). ``logprobs`` are those
of the model's own distribution (``log_softmax`` of the raw logits, as vLLM and OpenAI
report them), for the chosen token and the ``k`` most likely ones, computed only for the
rows that asked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minisrv.checks import check_int

if TYPE_CHECKING:  # imported where a tensor is made: ``SamplingParams`` needs no torch
    import torch

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""The seeds ``torch.Generator.manual_seed`` accepts."""


GRAMMAR_KINDS = ("regex", "json_schema", "ebnf")


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    ``temperature == 0`` means greedy (argmax). Otherwise logits are divided by the
    temperature and the token is drawn from the smallest set of most likely tokens whose
    probability reaches ``top_p`` (nucleus sampling). ``seed`` makes the draws repeatable;
    ``ignore_eos`` keeps generating past ``<eos>`` (benchmarks use it to fix output lengths).
    ``regex``, ``json_schema`` (its JSON text) or ``ebnf`` (SGLang's names) constrain the
    output to a grammar (``minisrv.grammar``): at most one of them.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # stop ids are masked until this many tokens exist
    logprobs: int | None = None  # None: none; k: the chosen token's and the top k's
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        self._check_grammar()
        check_int("min_tokens", self.min_tokens, minimum=0)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, minimum=0)
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            check_int("logit_bias token id", token, minimum=0)
            if not math.isfinite(bias):
                raise ValueError(f"logit_bias of token {token} must be finite, got {bias}")
        # Read every step for every request: worked out once (not a field: no effect on ==).
        object.__setattr__(self, "_processed", bool(
            self.presence_penalty or self.frequency_penalty or self.logit_bias
            or self.min_tokens or self.repetition_penalty != 1.0))
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):  # NaN, inf
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            check_int("seed", self.seed)
            if not SEED_MIN <= self.seed <= SEED_MAX:  # what torch.Generator.manual_seed takes
                raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")

    @property
    def greedy(self) -> bool:
        """True when no randomness is involved."""
        return self.temperature == 0

    def _check_grammar(self) -> None:
        given = [name for name in GRAMMAR_KINDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of regex, json_schema, ebnf; got {given}")
        for name in given:
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string")
        if given and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a grammar: the grammar ends "
                             "the output with <eos> when its text is complete")

    @property
    def grammar(self) -> tuple[str, str] | None:
        """``(kind, text)`` of the grammar this request follows, or None."""
        for name in GRAMMAR_KINDS:
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        return None

    @property
    def processed(self) -> bool:
        """True when a logits processor changes this request's logits."""
        return self._processed  # type: ignore[attr-defined, no-any-return]


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The private random stream of one request: ``None`` for greedy, else a seeded CPU generator.

    A request without a seed still gets its own generator (seeded from the OS), so its
    draws never disturb another request's stream.
    """
    import torch

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
    import torch

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
    import torch

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
    import torch

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


# ---------------------------------------------------------------------- logits processors
TokenLogprobs = tuple[float, list[tuple[int, float]]]
"""One token's logprob and the top alternatives ``[(id, logprob)]``, most likely first."""


def process_row(logits_1d: torch.Tensor, params: SamplingParams, prompt: Sequence[int],
                output: Sequence[int], stop_ids: Sequence[int]) -> torch.Tensor:
    """The per-request reference of ``process_logits``: one row, plain loops."""
    out = logits_1d.clone()
    for token, bias in params.logit_bias:
        if token < out.numel():
            out[token] += bias
    if len(output) < params.min_tokens:
        for token in stop_ids:
            out[token] = -math.inf
    if params.repetition_penalty != 1.0:
        for token in set(prompt) | set(output):
            value = out[token]
            out[token] = value / params.repetition_penalty if value > 0 \
                else value * params.repetition_penalty
    for token in set(output):
        out[token] -= params.frequency_penalty * list(output).count(token)
        out[token] -= params.presence_penalty
    return out


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                   histories: Sequence[tuple[Sequence[int], Sequence[int]]],
                   stop_ids: Sequence[int]) -> torch.Tensor:
    """Apply every row's logits processors at once: one scatter per kind for the batch.

    ``histories`` holds each row's ``(prompt, output)``. Rows without a processor are left
    as they are (the result is a new tensor only when some row has one).
    """
    import torch

    rows = [i for i, p in enumerate(params) if p.processed]
    if not rows:
        return logits
    out = logits.clone()
    vocab, device = logits.shape[1], logits.device
    sub = out[rows]
    bias_rows, bias_ids, bias_vals = [], [], []
    for r, i in enumerate(rows):
        for token, bias in params[i].logit_bias:
            if token < vocab:
                bias_rows.append(r)
                bias_ids.append(token)
                bias_vals.append(bias)
    if bias_rows:
        sub.index_put_((torch.tensor(bias_rows, device=device),
                        torch.tensor(bias_ids, device=device)),
                       torch.tensor(bias_vals, device=device, dtype=sub.dtype), accumulate=True)
    early = [r for r, i in enumerate(rows) if len(histories[i][1]) < params[i].min_tokens]
    if early and stop_ids:
        sub[torch.tensor(early, device=device)[:, None],
            torch.tensor(list(stop_ids), device=device)[None, :]] = -math.inf
    counts = torch.zeros_like(sub)
    seen = torch.zeros(sub.shape, dtype=torch.bool, device=device)
    for r, i in enumerate(rows):
        prompt, output = histories[i]
        if output:
            counts[r].index_add_(0, torch.tensor(list(output), device=device),
                                 torch.ones(len(output), device=device, dtype=sub.dtype))
        seen[r, torch.tensor([*prompt, *output], device=device, dtype=torch.long)] = True
    rep = torch.tensor([params[i].repetition_penalty for i in rows], device=device,
                       dtype=sub.dtype)[:, None]
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen & (rep != 1.0), penalised, sub)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], device=device,
                        dtype=sub.dtype)[:, None]
    pres = torch.tensor([params[i].presence_penalty for i in rows], device=device,
                        dtype=sub.dtype)[:, None]
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    out[rows] = sub
    return out


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int],
                   wanted: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """Each row's chosen-token logprob and its ``k`` most likely tokens (``wanted[i]``;
    None: nothing for that row), from ``log_softmax`` of the raw logits, in float32."""
    import torch

    rows = [i for i, k in enumerate(wanted) if k is not None]
    out: list[TokenLogprobs | None] = [None] * len(wanted)
    if not rows:
        return out
    logp = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = logp[torch.arange(len(rows), device=logp.device),
                  torch.tensor([tokens[i] for i in rows], device=logp.device)].tolist()
    k = max(wanted[i] or 0 for i in rows)
    top_vals, top_ids = (logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long()))
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for r, i in enumerate(rows):
        n = wanted[i] or 0
        out[i] = (chosen[r], list(zip(top_ids[r][:n], top_vals[r][:n])))
    return out


def sample_processed(
    logits: torch.Tensor, params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None,
    stop_ids: Sequence[int],
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """A step's tokens (``sample_batch`` after the processors) and the logprobs asked for.

    Without processors and logprobs this is ``sample_batch`` exactly: the same tokens.
    """
    processed = logits if histories is None else process_logits(logits, params, histories,
                                                                stop_ids)
    tokens = sample_batch(processed, params, generators)
    return tokens, token_logprobs(logits, tokens, [p.logprobs for p in params])
