"""What the scheduler exchanges with a backend, and what it keeps about each step.

``Batch`` (a list of ``Entry``: request, first position, tokens, whether to sample) goes to
the backend, ``BatchResult`` (the tokens of each entry) comes back; ``StepRecord`` is one
line of the trace and ``SchedulerStats`` the running totals. ``Backend`` declares everything the
scheduler needs from whatever computes the tokens, so a new backend is checked against
one list instead of the scheduler probing it for optional methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from minisrv.request import Req

if TYPE_CHECKING:
    from minisrv.kv import SlotAllocator
    from minisrv.kv.table import ReqToTokenTable
    from minisrv.scheduler.capabilities import Capability

__all__ = [
    "Backend", "Batch", "BatchResult", "EngineSnapshot", "Entry", "SchedulerStats", "StepOutput",
    "StepRecord", "hit_rate",
]


class Entry(NamedTuple):
    """One request's work in a step: compute ``n_tokens`` tokens from position ``start``.

    A prefill is an entry from the first uncached position to the end of the request; a
    decode computes its one newest token; a prefill chunk is an entry that does not
    ``sample`` (its result holds no token); a speculative check is an entry of k+1 tokens
    whose result holds 1..k+1 of them. The request's KV slots ``start .. start + n_tokens
    - 1`` are allocated when the entry is formed. (A named tuple: a GPU-scale simulation
    forms hundreds of thousands of them.)
    """

    req: Req
    start: int  # position of the first token computed (its index in prompt + output)
    n_tokens: int  # tokens computed: their K/V are written, the last one's logits sampled
    sample: bool = True  # False: the entry only fills KV (a chunk of a longer prefill)

    @property
    def end(self) -> int:
        """One past the last position computed."""
        return self.start + self.n_tokens


_new_entry = partial(tuple.__new__, Entry)  # Entry(*fields) without a Python-level call


@dataclass(frozen=True, slots=True)
class Batch:
    """The entries one step computes: admitted requests' prefills first, then decodes.

    The backend answers each entry with a list of tokens (``BatchResult.tokens``).
    ``retracted`` lists the requests pushed back to the queue while the step was formed;
    they compute nothing in it and are there for the trace. ``drafts`` (speculative
    decoding, ``minisrv.scheduler.speculative``) marks the entries that are checks.
    """

    entries: tuple[Entry, ...]
    n_prefill: int = 0  # the first ``n_prefill`` entries are this step's admissions
    retracted: tuple[Req, ...] = ()
    # Speculative decoding: per entry its draft (a ``minisrv.spec.Draft``: the guesses the
    # entry's last tokens are), None where the entry is not a check; None: no check at all.
    drafts: tuple[Any, ...] | None = None

    @classmethod
    def of(cls, prefill: Sequence[Req], decode: Sequence[Req],
           retracted: tuple[Req, ...] = ()) -> Batch:
        """Each of ``prefill`` computes everything past its cached prefix, each of ``decode``
        its newest token; every one samples its next token."""
        entries = [Entry(req, req.cached_len, req.seq_len - req.cached_len) for req in prefill]
        starts = [len(req.prompt) + len(req.output) - 1 for req in decode]
        entries += map(_new_entry, zip(decode, starts, repeat(1), repeat(True)))
        return cls(tuple(entries), len(prefill), retracted)

    @classmethod
    def with_chunks(cls, prefill: Sequence[Entry], decode: Sequence[Req],
                    retracted: tuple[Req, ...] = ()) -> Batch:
        """``prefill`` entries as given (whole prefills, or chunks of one: chunked prefill),
        then each of ``decode`` computing its newest token."""
        decoding = cls.of((), decode, retracted).entries
        return cls((*prefill, *decoding), len(prefill), retracted)

    @property
    def prefill(self) -> list[Req]:
        """Requests admitted this step, or computing a chunk of their prefill in it."""
        return [e.req for e in self.entries[: self.n_prefill]]

    @property
    def decode(self) -> list[Req]:
        """Running requests that compute in this step."""
        return [e.req for e in self.entries[self.n_prefill:]]

    @property
    def reqs(self) -> list[Req]:
        """All requests of the step in the order of their entries."""
        return [e.req for e in self.entries]

    @property
    def sampling(self) -> list[Req]:
        """Requests whose entry samples a token (all but a prefill chunk's)."""
        return [e.req for e in self.entries if e.sample]

    @property
    def prefill_tokens(self) -> int:
        """Tokens the step's prefill entries (chunks included) compute."""
        return sum(e.n_tokens for e in self.entries[: self.n_prefill])

    @property
    def new_tokens(self) -> int:
        """Tokens the step computes, all entries together."""
        return sum(e.n_tokens for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)


@dataclass(frozen=True, slots=True)
class BatchResult:
    """What a backend reports for one step.

    ``tokens[i]`` are the tokens entry ``i`` produced, in order (one for a decode or a
    prefill, none for a chunk that does not sample, 1..k+1 for a speculative check).
    ``cost`` is what the step computed in the backend's own unit (tokens for the real model,
    seconds for the simulator); ``elapsed`` is how far the clock advances: one step for the
    real model, the roofline time for the simulator.
    """

    tokens: list[list[int]]
    cost: float
    elapsed: float
    # Of the tokens, those a grammar forced (jump-forward); keyword-only, so a subclass's
    # own fields (the simulator's TimedResult) stay positional after ``elapsed``.
    jumped: int = field(default=0, kw_only=True)

    @property
    def next_tokens(self) -> list[int]:
        """Every entry's tokens, end to end."""
        return [t for tokens in self.tokens for t in tokens]


@runtime_checkable
class Backend(Protocol):
    """What the scheduler needs from whatever computes the tokens."""

    time_unit: str  # unit of the clock, e.g. "step" or "s"
    cost_unit: str  # unit of BatchResult.cost, e.g. "tokens" or "s"
    eos_ids: tuple[int, ...]  # tokens that end a request (empty: outputs have fixed lengths)
    max_context: int | None  # longest sequence (prompt + output) the model takes (None: any)
    vocab_size: int | None  # prompts must hold ids below this (None: any id)
    # what it can do beyond ``run`` (``minisrv.scheduler.capabilities``), checked once
    capabilities: frozenset[Capability]

    def attach_kv(self, capacity: int) -> SlotAllocator | None:
        """Build the KV store for ``capacity`` token slots and return its allocator, so the
        slots the scheduler hands out index the backend's tensors; ``None`` when the backend
        stores no KV (the scheduler then counts slots alone)."""
        ...

    def attach_table(self, table: ReqToTokenTable | None) -> None:
        """The request-to-token table over the pool of ``attach_kv`` (``kv/table.py``):
        a backend whose attention reads KV through it keeps it (and puts it on its
        device); ``None``, or a backend that stores no KV, ignores it."""
        ...

    def run(self, batch: Batch) -> BatchResult:
        """Compute one step: the tokens of every entry of ``batch``."""
        ...

    def release(self, req: Req) -> None:
        """Forget everything kept for ``req`` (its random generator, any private state)."""
        ...


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
        self.prefill_steps += bool(batch.prefill)
        self.prefill_tokens += prefill_tokens
        self.decode_tokens += len(batch.decode)
        self.generated_tokens += len(result.next_tokens)
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
