"""What an ``EngineConfig`` asks of its backend, checked once, when the engine is built.

A backend names its abilities in a ``capabilities`` frozenset of ``Capability`` members
(the step's contract, ``minisrv.core``); ``needs`` lists the ones a configuration asks for,
and ``minisrv.core.require`` raises one ValueError naming every missing one. After that
check the step path calls what the configuration needs without asking the backend again
(no ``getattr`` probing): an option the backend cannot serve fails at construction, not in
the middle of a run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisrv.core import Capability

if TYPE_CHECKING:
    from minisrv.scheduler.config import EngineConfig

__all__ = ["needs"]


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
