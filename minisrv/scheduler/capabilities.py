"""What a backend can do, declared by the backend and checked once, when the engine is built.

A backend names its abilities in a ``capabilities`` frozenset of ``Capability`` members;
``require`` compares them with what an ``EngineConfig`` asks for and raises one ValueError
naming every missing one. After that check the step path calls what the configuration
needs without asking the backend again (no ``getattr`` probing): an option the backend
cannot serve fails at construction, not in the middle of a run.

The protocols below are the methods and attributes each capability stands for, so a
backend that declares one is checked against one short list (``Backend`` in
``records.py`` is what every backend has).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

import torch

from minisrv.scheduler.records import Backend, BatchResult

if TYPE_CHECKING:
    from minisrv.request import Req
    from minisrv.scheduler.config import EngineConfig

__all__ = [
    "Capability", "DraftVerifier", "JumpForwarder", "SamplingBackend", "SelfTimedBackend",
    "SplitBackend", "needs", "require",
]


class Capability(StrEnum):
    """One thing a backend can do beyond ``Backend.run``; the value says what it is."""

    SAMPLES_PROCESSORS = "samples through logits processors (grammars, penalties)"
    VERIFIES_DRAFTS = "checks drafts (speculative decoding)"
    JUMPS_FORWARD = "appends the tokens a grammar forces (jump-forward)"
    GIVES_LOGPROBS = "gives the logprobs of its tokens"
    SPLITS_STEP = "splits a step into prepare() and compute() (the overlapped loop's halves)"
    ENDS_OWN_STEPS = "ends its steps on its own (wait(result): no device thread)"
    COMPUTES_CHUNKS = "computes prefill chunks (chunked prefill)"


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


def needs(config: EngineConfig) -> dict[Capability, str]:
    """What ``config`` asks of its backend: capability -> the option that asks for it."""
    wanted: dict[Capability, str] = {}
    if config.overlap:
        wanted[Capability.SPLITS_STEP] = "overlap=True"
    if config.chunked_prefill_size is not None:
        wanted[Capability.COMPUTES_CHUNKS] = "chunked_prefill_size"
    if config.speculative is not None:
        wanted[Capability.VERIFIES_DRAFTS] = "speculative decoding"
        wanted[Capability.SAMPLES_PROCESSORS] = "speculative decoding"
    if config.jump_forward:
        wanted[Capability.JUMPS_FORWARD] = "jump_forward=True"
    return wanted


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
