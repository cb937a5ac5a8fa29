"""What the scheduler keeps about each step, and what a step and the engine report.

``StepRecord`` is one line of the trace, ``SchedulerStats`` the running totals,
``StepOutput`` what one ``Engine.step()`` did and ``EngineSnapshot`` the engine's gauges.
What the scheduler exchanges with a backend (``Batch``, ``BatchResult``, ``Backend``) is
the step's contract, in ``minisrv.core``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from minisrv.request import Req

if TYPE_CHECKING:
    from minisrv.core import Batch, BatchResult

__all__ = ["EngineSnapshot", "SchedulerStats", "StepOutput", "StepRecord", "hit_rate"]


class StepRecord(NamedTuple):
    """One line of the trace: who did what in one step, and what the step cost."""

    index: int
    start: float  # clock when the step began
    end: float  # clock when its tokens existed
    prefill: tuple[int, ...]  # request ids prefilled (or computing a chunk of their prompt)
    decode: tuple[int, ...]  # request ids that decoded (one token, or a speculative check)
    paused: tuple[int, ...]  # running requests that sat this step out
    finished: tuple[int, ...]  # request ids that stopped at the end of this step
    queued: int  # requests left waiting in the queue after admission
    kv_reserved: int  # KV tokens promised to the requests running in this step
    prefill_tokens: int  # tokens the prefills computed
    cost: float  # backend cost of the step (tokens, or seconds)
    kv_used: int = 0  # KV slots held while the step ran (its new tokens included)
    new_token_ratio: float = 0.0  # the admission estimate in force during the step
    retracted: tuple[int, ...] = ()  # request ids pushed back to the queue before the step
    drafted: int = 0  # speculative: guesses checked in this step, all requests together
    accepted: int = 0  # of those, kept (the KV of the other drafted - accepted was freed)
    checks: tuple[tuple[int, int, int], ...] = ()  # (request id, drafted, accepted) per check
    jumped: int = 0  # jump-forward: tokens appended without a step (forced by grammars)

    @property
    def duration(self) -> float:
        """How long the step took on the clock."""
        return self.end - self.start

    @property
    def batch_size(self) -> int:
        """Requests that computed a token in this step."""
        return len(self.prefill) + len(self.decode)


def hit_rate(cached_prompt_tokens: int, prompt_tokens: int) -> float:
    """The lecture's hit rate: prompt tokens found in the prefix cache / all prompt tokens.

    The one definition in the package: ``SchedulerStats.hit_rate`` applies it to a run's
    totals and ``minisrv.metrics.request_hit_rate`` to any subset of requests.
    """
    return cached_prompt_tokens / prompt_tokens if prompt_tokens else 0.0


@dataclass
class SchedulerStats:
    """Running totals over everything the scheduler has executed.

    ``cached_tokens`` counts tokens whose KV came from the prefix cache instead of a prefill,
    re-admissions after a retraction included (always 0 with ``cache="none"``); ``hit_rate``
    uses first admissions only: cached prompt tokens / all prompt tokens, the lecture's
    definition. ``retractions`` counts requests pushed back to the queue to free memory,
    ``wasted_tokens`` the KV they threw away (and must compute again when they are
    re-admitted); ``evicted_tokens`` the cached tokens the prefix cache dropped for room.
    Speculative decoding: ``draft_tokens`` guesses were checked and ``accepted_tokens`` of
    them kept, so ``generated_tokens`` = first tokens + ``decode_tokens`` (one per check) +
    ``accepted_tokens`` (+ ``jump_forward_tokens``, the tokens grammars forced).
    """

    steps: int = 0
    prefill_steps: int = 0  # steps that prefilled at least one request
    prefill_tokens: int = 0  # prompt tokens computed
    decode_tokens: int = 0  # decode entries computed (one token each; one check each)
    cached_tokens: int = 0  # tokens served from a prefix cache instead of computed
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission only)
    cached_prompt_tokens: int = 0  # of those, found in the prefix cache at admission
    evicted_tokens: int = 0  # cached tokens evicted to make room
    host_hit_tokens: int = 0  # host tier: tokens matched there at admission
    loaded_tokens: int = 0  # host tier: of those, copied back to the device
    retractions: int = 0
    wasted_tokens: int = 0  # tokens computed and then thrown away
    late_stop_tokens: int = 0  # overlap: tokens computed after a finish (in wasted_tokens too)
    finished: int = 0  # requests completed
    generated_tokens: int = 0  # output tokens, the first (from prefill) included
    draft_tokens: int = 0  # speculative: guesses checked
    accepted_tokens: int = 0  # speculative: guesses kept (each check adds one more token)
    jump_forward_tokens: int = 0  # tokens a grammar forced, appended without a step
    busy_time: float = 0.0  # clock time spent in steps (idle gaps excluded)
    cost: float = 0.0  # sum of the backend's step costs

    @property
    def rejected_tokens(self) -> int:
        """Guesses the checks threw away (their KV freed at once)."""
        return self.draft_tokens - self.accepted_tokens

    @property
    def hit_rate(self) -> float:
        """Share of admitted requests' prompt tokens that were found in the prefix cache."""
        return hit_rate(self.cached_prompt_tokens, self.prompt_tokens)

    def as_dict(self) -> dict[str, float]:
        """Every field plus ``hit_rate``, e.g. for a table in a chapter."""
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return {**fields, "hit_rate": self.hit_rate}

    def count_step(self, batch: Batch, result: BatchResult, prefill_tokens: int) -> None:
        """Add one executed step to the totals."""
        self.steps += 1
        self.prefill_steps += batch.n_prefill > 0
        self.prefill_tokens += prefill_tokens
        self.decode_tokens += len(batch) - batch.n_prefill
        self.generated_tokens += sum(map(len, result.tokens))
        self.jump_forward_tokens += result.jumped
        self.busy_time += result.elapsed
        self.cost += result.cost


@dataclass(frozen=True)
class StepOutput:
    """What one ``Engine.step()`` did.

    ``record`` is the step's trace line (``None``: nothing could run, the engine is idle or
    waits for arrivals); ``tokens`` every token the step produced, ``(request, token)`` in the
    order they were produced; ``finished`` the requests that ended with it (their
    ``finish_reason`` set); ``logprobs`` per request that asked for them, one entry per
    token of ``tokens`` (``minisrv.sampling.TokenLogprobs``).
    """

    record: StepRecord | None
    tokens: list[tuple[Req, int]] = field(default_factory=list)
    finished: list[Req] = field(default_factory=list)
    logprobs: dict[Req, list[Any]] = field(default_factory=dict)

    def tokens_of(self, req: Req) -> list[int]:
        """The tokens ``req`` got in this step."""
        return [token for r, token in self.tokens if r is req]


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's gauges at one moment (``Engine.snapshot()``), e.g. for ``/metrics``.

    ``kv_used`` counts the KV slots held by requests: cached prefixes nobody uses do not
    count, since they can be evicted at any time (SGLang's ``token_usage``).
    """

    running: int  # requests in the running batch
    queued: int  # requests waiting, or submitted and not yet arrived
    kv_used: int
    token_usage: float  # kv_used / kv_capacity
    hit_rate: float  # prefix-cache hit rate so far
    prompt_tokens: int  # prompt tokens admitted so far
    steps: int
    host_tokens: int = 0  # host tier: its token slots (0: no host tier)
    host_used: int = 0  # host tier: slots holding a prefix's copy
    host_hit_tokens: int = 0  # host tier: prompt tokens matched there so far

    def as_dict(self) -> dict[str, float]:
        """Every gauge as a float, keyed by its name."""
        return {name: float(getattr(self, name)) for name in self.__dataclass_fields__}
