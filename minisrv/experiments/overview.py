"""The overview chapter's run: a few requests through the engine, one step at a time.

``step_by_step`` drives a real ``Engine`` with ``Engine.step()`` and keeps, after every step,
what the step did (its ``StepRecord``) and where each request stood: what it did in the step,
the tokens it had so far and the KV slots it held. The run is small on purpose (a handful of
requests, a short output each, a pool of a few dozen slots), so that every step can be drawn
and read: a request waiting for a place in the batch, prefilled, decoding one token per step,
finishing and freeing its slots for the next one. Its outputs are checked, as every run of the
book is, against each request generated alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from minisrv.engine import Engine
from minisrv.scheduler import StepRecord

__all__ = ["DEMO_LENGTHS", "DEMO_QUESTIONS", "RequestAtStep", "StepByStep", "StepView",
           "step_by_step"]

DEMO_QUESTIONS: tuple[str, ...] = ("FR:", "JP:", "IT:", "DE:")
"""The overview's requests: four country codes for CityLM to complete."""
DEMO_LENGTHS: tuple[int, ...] = (17, 6, 5, 7)
"""Their output lengths: each stops at the end of a city name (" Paris, Marseille", " Tokyo",
" Rome", " Berlin"), and unequal, so the requests finish at different steps."""

ROLES = ("waiting", "prefill", "decode", "paused", "done")
"""What a request did in a step: waited for admission, was prefilled, decoded one token, sat
out a prefill step while running (prefill-first mode), or had finished before it."""


class RequestAtStep(NamedTuple):
    """One request right after a step: what it did in it and what it holds."""

    rid: int
    role: str  # one of ROLES
    finished: bool  # it has stopped (at this step or before)
    new: tuple[int, ...]  # the tokens this step gave it
    output: tuple[int, ...]  # all its tokens so far
    slots: tuple[int, ...]  # the KV pool slots it holds, in position order (none once done)


class StepView(NamedTuple):
    """One step of the run: the engine's record of it and every request after it."""

    record: StepRecord
    requests: tuple[RequestAtStep, ...]

    @property
    def slots_held(self) -> int:
        """KV slots the requests hold once the step is over (finished ones freed theirs)."""
        return sum(len(r.slots) for r in self.requests)


class StepByStep(NamedTuple):
    """A whole run, step by step, and its check against each request alone."""

    prompts: list[list[int]]
    max_new_tokens: list[int]
    kv_capacity: int
    max_running: int
    steps: list[StepView]
    outputs: list[list[int]]  # what the engine generated, per request
    alone: list[list[int]]  # what each request generates alone (reference_generate)

    @property
    def identical(self) -> int:
        """Requests whose tokens equal those they get alone."""
        return sum(o == a for o, a in zip(self.outputs, self.alone, strict=True))

    @property
    def trace(self) -> list[StepRecord]:
        return [view.record for view in self.steps]


def _role(rid: int, record: StepRecord, done_before: bool) -> str:
    for role in ("prefill", "decode", "paused"):
        if rid in getattr(record, role):
            return role
    return "done" if done_before else "waiting"


def step_by_step(model: Any, prompts: Sequence[Sequence[int]],
                 max_new_tokens: int | Sequence[int], *, kv_capacity: int = 48,
                 max_running: int = 2, **options: Any) -> StepByStep:
    """Serve ``prompts`` on a fresh ``Engine(model, kv_capacity, max_running, **options)`` one
    ``step()`` at a time, keeping every step's view, then generate each prompt alone with
    ``model.reference_generate`` for the check.

    Greedy decoding, all requests arriving at once; ``max_new_tokens`` is one length for all
    or one per prompt. The engine's own checks refuse a bad prompt, length or option
    (ValueError) before anything runs.
    """
    engine = Engine(model, kv_capacity=kv_capacity, max_running=max_running, **options)
    reqs = engine.make_requests(prompts, max_new_tokens)
    for req in reqs:
        engine.add_request(req)
    steps: list[StepView] = []
    done: set[int] = set()
    while (out := engine.step()).record is not None:
        record = out.record
        requests = tuple(
            RequestAtStep(req.rid, _role(req.rid, record, req.rid in done), req.finished,
                          tuple(out.tokens_of(req)), tuple(req.output),
                          () if req.finished else tuple(engine.scheduler.memory.slots(req)))
            for req in reqs)
        done.update(r.rid for r in requests if r.finished)
        steps.append(StepView(record, requests))
    lengths = [req.max_new_tokens for req in reqs]
    alone = [model.reference_generate(req.prompt, n) for req, n in zip(reqs, lengths)]
    return StepByStep([list(r.prompt) for r in reqs], lengths, kv_capacity, max_running, steps,
                      [list(r.output) for r in reqs], alone)
