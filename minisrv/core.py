"""The step's contract: what the scheduler hands a backend, what comes back, and what a
backend declares it can do.

``Batch`` (a list of ``Entry``: request, first position, tokens, whether to sample) goes to
the backend, ``BatchResult`` (the tokens of each entry) comes back. ``Backend`` declares
everything the scheduler needs from whatever computes the tokens, and ``capabilities`` (a
frozenset of ``Capability``) what it can do beyond that, each with the short protocol of
the methods it stands for; ``require`` checks them once, when the engine is built, so the
step path never probes a backend for optional methods.

This module sits below the scheduler (``minisrv.scheduler``), the model runner
(``minisrv.runner``) and the simulated GPU (``minisrv.sim``): each of them imports the
contract from here and none imports another for it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from itertools import repeat
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from minisrv.request import Req

if TYPE_CHECKING:
    import torch

    from minisrv.kv import SlotAllocator
    from minisrv.kv.table import ReqToTokenTable

__all__ = [
    "Backend", "Batch", "BatchResult", "Capability", "DraftVerifier", "Entry", "HostTimedBackend",
    "JumpForwarder", "Pending", "PoolBackend", "SamplingBackend", "SelfTimedBackend",
    "SplitBackend", "StepWorker", "require",
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
    # what it can do beyond ``run`` (``Capability`` below), checked once
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


class Capability(StrEnum):
    """One thing a backend can do beyond ``Backend.run``; the value says what it is."""

    SAMPLES_PROCESSORS = "samples through logits processors (grammars, penalties)"
    VERIFIES_DRAFTS = "checks drafts (speculative decoding)"
    JUMPS_FORWARD = "appends the tokens a grammar forces (jump-forward)"
    GIVES_LOGPROBS = "gives the logprobs of its tokens"
    SPLITS_STEP = "splits a step into prepare() and compute() (the overlapped loop's halves)"
    ENDS_OWN_STEPS = "ends its steps on its own (wait(result): no device thread)"
    COMPUTES_CHUNKS = "computes prefill chunks (chunked prefill)"
    LENDS_KV_POOL = "keeps its KV in a pool of tensors (pool) that the host tier copies"
    TIMES_HOST_COPIES = "puts the host tier's copies on its clock (charge_host_copies)"


class SamplingBackend(Backend, Protocol):
    """``SAMPLES_PROCESSORS`` / ``GIVES_LOGPROBS``: a ``Sampler`` whose logits processors
    run on every step's logits, the model it samples (for its tokenizer), the logprobs."""

    sampler: Any  # minisrv.runner.sampler.Sampler
    model: Any

    @property
    def logprobs(self) -> dict[Req, deque[Any]]: ...


class DraftVerifier(SamplingBackend, Protocol):
    """``VERIFIES_DRAFTS``: a batch's ``drafts`` are checked (``runner/speculative.py``)."""


class JumpForwarder(SamplingBackend, Protocol):
    """``JUMPS_FORWARD``: after sampling, ``jump`` appends each request's forced tokens."""

    def set_jump(self, jump: Any) -> None: ...


class SplitBackend(Backend, Protocol):
    """``SPLITS_STEP``: ``run`` as two halves, and where the second one computes."""

    device: Any  # None: no GPU, so the device thread gets no CUDA stream

    def prepare(self, batch: Any) -> Any: ...

    def compute(self, prepared: Any, resolve: Callable[[torch.Tensor], torch.Tensor] | None,
                store: Callable[[list[int]], None] | None) -> BatchResult: ...


class SelfTimedBackend(SplitBackend, Protocol):
    """``ENDS_OWN_STEPS``: ``wait(result)`` returns once the device has ended that step."""

    def wait(self, result: BatchResult) -> None: ...


class PoolBackend(Backend, Protocol):
    """``LENDS_KV_POOL``: the ``KVPool`` of ``attach_kv``, whose slots the host tier's
    copies move (``minisrv.kv.host``)."""

    pool: Any  # minisrv.kv.pool.KVPool


class HostTimedBackend(Backend, Protocol):
    """``TIMES_HOST_COPIES``: told before each step how many tokens the host tier loads
    back and backs up, so that the copies take their time on its clock."""

    def charge_host_copies(self, loaded: int, backed_up: int) -> None: ...


class Pending(Protocol):
    """A step handed to the device: its answer (or its error) once the device has ended it.
    A ``Future`` from a device thread is one."""

    def result(self) -> BatchResult: ...

    def exception(self) -> BaseException | None: ...


class StepWorker(Protocol):
    """Where the overlapped loop's steps run (the runner's ``DeviceWorker``; the engine
    builds one and hands it to ``minisrv.scheduler.overlap.OverlapLoop``)."""

    def submit(self, batch: Batch) -> tuple[Pending, list[int]]:
        """Start ``batch``; its answer-to-be and one future id per sampling entry."""
        ...

    def call(self, work: Callable[[], Any]) -> None:
        """Run ``work`` where the steps run, after the step in flight."""
        ...

    def result(self, handle: Pending) -> BatchResult:
        """Wait for a submitted step and return its answer (or raise its error)."""
        ...


def require(backend: Backend, wanted: dict[Capability, str] | Iterable[Capability],
            what: str = "") -> None:
    """Raise ValueError naming each capability in ``wanted`` that ``backend`` lacks (and
    the option asking for it); ``what`` names the asker when ``wanted`` is a plain set."""
    asked = wanted if isinstance(wanted, dict) else dict.fromkeys(wanted, what)
    missing = [(option, cap) for cap, option in asked.items() if cap not in backend.capabilities]
    if missing:
        reasons = "; ".join(f"{option} needs a backend that {cap.value}"
                            for option, cap in missing)
        have = ", ".join(sorted(cap.name for cap in backend.capabilities)) or "none"
        raise ValueError(f"{reasons}: {type(backend).__name__} cannot (its capabilities: "
                         f"{have})")
