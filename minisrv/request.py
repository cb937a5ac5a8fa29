"""A request as the scheduler sees it: its prompt, how to decode it, and what happened to it.

The scheduler moves a ``Req`` through four states: *pending* (submitted, its arrival time
not reached yet), *waiting* (arrived, queued for admission), *running* (prefilled, holding
KV memory, decoding one token per step) and *finished*. Every output token is stamped with
the clock at the end of the step that produced it, so latency, time to first token and
inter-token latency are all read off the request afterwards instead of being tracked by
separate bookkeeping that could drift out of step with what actually ran.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from minisrv.sampling import SamplingParams

if TYPE_CHECKING:
    from minisrv.kv import TreeNode

__all__ = [
    "ReqState", "PENDING", "WAITING", "RUNNING", "FINISHED", "ABORTED", "Req", "SamplingParams",
]


class ReqState(str, Enum):
    """Where a request is in its life; a ``str`` so it prints and compares as its name."""

    PENDING = "pending"  # submitted, its arrival time not reached yet
    WAITING = "waiting"  # arrived, queued for admission (again, after a retraction)
    RUNNING = "running"  # admitted: holds KV slots and computes a token each step it is in
    FINISHED = "finished"  # stopped on <eos> or its length limit
    ABORTED = "aborted"  # withdrawn by the caller before it finished

    def __str__(self) -> str:
        return self.value


PENDING, WAITING, RUNNING, FINISHED, ABORTED = ReqState


@dataclass(eq=False, slots=True)
class Req:
    """One generation request.

    ``eq=False`` keeps identity semantics: two requests with the same prompt are still two
    requests, and a backend can key its per-request state (KV cache, random generator) on
    the object itself.
    """

    rid: int
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival: float = 0.0  # in the scheduler's clock units (steps, or simulated seconds)
    output: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # clock after each output token
    state: ReqState = ReqState.PENDING
    admitted_at: float | None = None  # clock when its prefill step started
    # a server's engine loop: ``time.perf_counter()`` when it took the request from its
    # inbox, between two steps (the engine's clock, in steps on CityLM, cannot say how long
    # the request took to reach the engine, nor how long it then queued); None elsewhere
    taken_at: float | None = None
    finish_reason: str | None = None  # "length" or "eos"
    # positions 0 .. kv_len - 1 have KV; where it lives is the request-to-token table's
    # record (``minisrv.kv.table``), the only one
    kv_len: int = 0
    # a request driven by hand (a runner without a scheduler's table): its KV slots, in
    # position order; a scheduled request's stay in its table row, never here
    kv_slots: list[int] = field(default_factory=list)
    retractions: int = 0  # times it was pushed back to the queue to free memory
    cached_len: int = 0  # leading tokens whose KV slots belong to the prefix cache (locked)
    cache_node: TreeNode | None = None  # the cache node locking that prefix while it runs
    # leading tokens this request has already inserted into the prefix cache (SGLang's
    # ``cache_inserted_len``): its later inserts count a hit only on the nodes past them, so
    # a request counts each node once (``HiRadixCache``'s write policies read the count)
    inserted_len: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens found in the cache at its first admission
    # the scheduler's prefill tokens when it arrived (SGLang's ``arrival_processed_tokens``):
    # the HRRN policy measures its wait as the prefill computed since
    arrival_prefilled: int = 0
    draft_tokens: int = 0  # speculative decoding: guesses checked for it
    accepted_tokens: int = 0  # of those, kept (acceptance rate: accepted / drafted)
    jump_forward_tokens: int = 0  # tokens its grammar forced, appended without a step
    # ``all_tokens``'s tuple, and the output it was built from
    _all_tokens: tuple[int, ...] = field(default=(), init=False, repr=False)
    _all_tokens_output: list[int] = field(default_factory=list, init=False, repr=False)

    @property
    def prompt_len(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt)

    @property
    def max_new_tokens(self) -> int:
        """Upper bound on the output length (the request may stop earlier at ``<eos>``)."""
        return self.params.max_new_tokens

    @property
    def seq_len(self) -> int:
        """Prompt plus the tokens generated so far: what its KV cache holds after a step."""
        return len(self.prompt) + len(self.output)

    @property
    def all_tokens(self) -> tuple[int, ...]:
        """Prompt plus output as one tuple (the key a prefix cache matches), built again
        only once the output has changed since the last call.

        A scheduling policy reads it for every waiting request each round; a waiting
        request's output does not change, so a round copies no prompt. The check compares
        the output with a copy of it, which costs no new list.
        """
        output = self.output
        if (len(self._all_tokens) != len(self.prompt) + len(output)
                or self._all_tokens_output != output):
            self._all_tokens = (*self.prompt, *output)
            self._all_tokens_output = list(output)
        return self._all_tokens

    @property
    def fill_ids(self) -> list[int]:
        """The tokens a prefill must compute: the prompt, plus any output kept from before,
        minus the first ``cached_len`` tokens whose KV the prefix cache already holds.

        A fresh request has no output yet, so this is its prompt (or its uncached suffix). A
        request that was pushed back to the queue by a retraction keeps its output and
        prefills it again as if it were part of the prompt, which is why its final output is
        unchanged.
        """
        return [*self.prompt, *self.output][self.cached_len:]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``start .. end - 1`` of prompt + output (what a step's entry computes),
        without joining the two."""
        n = len(self.prompt)
        if start >= n:
            return self.output[start - n:end - n]
        if end <= n:
            return self.prompt[start:end]
        return [*self.prompt[start:], *self.output[:end - n]]

    def stop_reason(self, token: int, position: int, eos_ids: Container[int]) -> str | None:
        """Why ``token``, as output token number ``position`` (from 0), ends the request:
        ``"eos"`` when it is an end-of-sequence id and the request does not ignore them,
        ``"length"`` when it is the ``max_new_tokens``-th, else ``None``. The one stop rule:
        the scheduler's ``BatchCompleter.accept`` and the runner's cut of a speculative
        check both ask it."""
        params = self.params
        if token in eos_ids and not params.ignore_eos:
            return "eos"
        if position + 1 >= params.max_new_tokens:
            return "length"
        return None

    @property
    def remaining_new_tokens(self) -> int:
        """Output tokens it may still generate (``max_new_tokens`` minus those it has)."""
        return self.params.max_new_tokens - len(self.output)

    @property
    def kv_reservation(self) -> int:
        """KV tokens it may ever need: the prompt plus its longest possible output."""
        return len(self.prompt) + self.params.max_new_tokens

    @property
    def finished(self) -> bool:
        """True once it has stopped (length or ``<eos>``)."""
        return self.state == FINISHED

    @property
    def first_token_time(self) -> float:
        """Clock at which its first output token existed (the end of its prefill step)."""
        self._require_output()
        return self.token_times[0]

    @property
    def finish_time(self) -> float:
        """Clock at which its last output token existed."""
        self._require_output()
        return self.token_times[-1]

    @property
    def latency(self) -> float:
        """End-to-end time: from arrival to its last token, queueing included."""
        return self.finish_time - self.arrival

    @property
    def ttft(self) -> float:
        """Time to first token: from arrival to the end of its prefill step."""
        return self.first_token_time - self.arrival

    def inter_token_latencies(self) -> list[float]:
        """Gaps between consecutive output tokens, as a streaming client would feel them."""
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    def _require_output(self) -> None:
        if not self.token_times:
            raise ValueError(f"request {self.rid} has produced no token yet (state {self.state})")
