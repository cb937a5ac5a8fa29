"""Admission rules: how much KV memory a waiting request must find before it may start.

A rule owns its state (what is reserved, SGLang's ``new_token_ratio``) and, for each step,
hands the scheduler a ``PrefillAdder`` that tracks what is left while the step's prefills
are chosen (SGLang's ``PrefillAdder``, mini-sglang's ``scheduler/prefill.py``). Two rules:

* ``ReserveAdmission``: every request reserves its prompt plus ``max_new_tokens`` up front.
  Nothing ever runs out, but memory sits idle for outputs that end early.
* ``BudgetAdmission`` (SGLang): running requests are assumed to need only
  ``new_token_ratio`` of their remaining tokens. The ratio falls a little each decode step
  and is re-estimated upwards whenever memory runs out and requests must be retracted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from minisrv.kv.manager import KVManager
from minisrv.request import Req
from minisrv.scheduler.config import EngineConfig

__all__ = [
    "CLIP_MAX_NEW_TOKENS",
    "RETRACT_DECODE_STEPS",
    "AdmissionRule",
    "BudgetAdmission",
    "PrefillAdder",
    "ReserveAdmission",
    "make_admission",
]

CLIP_MAX_NEW_TOKENS = 4096
"""SGLang's cap on how many future tokens one request is assumed to still need."""

RETRACT_DECODE_STEPS = 20
"""After a retraction the ratio is re-estimated as if each survivor decodes this many more."""


class PrefillAdder:
    """What is left while one step's new requests are chosen: batch places and KV budget."""

    def __init__(self, rule: AdmissionRule, places: int, budget: float) -> None:
        self.rule = rule
        self.places = places  # running-batch places still free
        self.budget = budget  # KV tokens the rule still allows

    @property
    def has_place(self) -> bool:
        """True while the running batch has room for one more request."""
        return self.places > 0

    def fits(self, req: Req, fill: int) -> bool:
        """Whether ``req``, with ``fill`` tokens to prefill, fits in what is left."""
        return self.rule.need(req, fill) <= self.budget

    def add(self, req: Req, fill: int) -> None:
        """Count ``req`` as admitted in this step."""
        self.places -= 1
        self.budget -= self.rule.need(req, fill)
        self.rule.reserved += self.rule.reservation(req)


class AdmissionRule(ABC):
    """How memory is promised; ``reserved`` (worst cases of running requests) is kept by
    both rules, for the trace. ``fill`` and every count are KV slots of whole pages of
    ``page_size`` (a request's last page may be partly filled, but it is taken whole)."""

    def __init__(self, page_size: int = 1) -> None:
        self.reserved = 0  # KV tokens promised to running requests, worst case
        self.page_size = page_size

    def pages(self, n_tokens: int) -> int:
        """Slots of the whole pages ``n_tokens`` tokens take."""
        return -(-n_tokens // self.page_size) * self.page_size

    def reservation(self, req: Req) -> int:
        """KV slots ``req`` may ever take: its ``kv_reservation`` in whole pages."""
        return self.pages(req.kv_reservation)

    @property
    def ratio(self) -> float:
        """The estimate in force (``BudgetAdmission``); 1.0 when every token is reserved."""
        return 1.0

    def adder(self, running: Sequence[Req], memory: KVManager, max_running: int) -> PrefillAdder:
        """The budget for this step's admissions."""
        return PrefillAdder(self, max_running - len(running), self.budget(running, memory))

    @abstractmethod
    def budget(self, running: Sequence[Req], memory: KVManager) -> float:
        """KV tokens new requests may claim in this step."""

    @abstractmethod
    def need(self, req: Req, fill: int) -> float:
        """KV tokens ``req`` claims when admitted with ``fill`` tokens to prefill."""

    def released(self, req: Req) -> None:
        """``req`` left the running batch (finished, aborted or retracted)."""
        self.reserved -= self.reservation(req)

    def after_decode_prepared(self, running: Sequence[Req], retracted: Sequence[Req]) -> None:
        """Called once per decoding step, after any retraction (SGLang updates its ratio)."""
        return None  # reserving the worst case needs no estimate


class ReserveAdmission(AdmissionRule):
    """Admit a request only if its worst case fits beside everyone else's."""

    def __init__(self, capacity: int, page_size: int = 1) -> None:
        super().__init__(page_size)
        self.capacity = capacity - capacity % page_size  # whole pages

    def budget(self, running: Sequence[Req], memory: KVManager) -> float:
        return self.capacity - self.reserved

    def need(self, req: Req, fill: int) -> float:
        return self.reservation(req)


class BudgetAdmission(AdmissionRule):
    """SGLang's estimate: admit while the expected need of everyone fits in free memory."""

    def __init__(self, new_token_ratio: float, ratio_decay: float, min_ratio: float,
                 page_size: int = 1) -> None:
        super().__init__(page_size)
        self.init_ratio, self.ratio_decay, self.min_ratio = new_token_ratio, ratio_decay, min_ratio
        self.new_token_ratio = new_token_ratio

    @property
    def ratio(self) -> float:
        return self.new_token_ratio

    def budget(self, running: Sequence[Req], memory: KVManager) -> float:
        """Free slots, plus cached prefixes that could be evicted, minus what the running
        requests are expected to need before they end: each one's remaining
        ``max_new_tokens`` (clipped) times ``new_token_ratio``. A low ratio is a bet that
        most requests stop well before their limit; when the bet fails, the scheduler
        retracts."""
        expected = sum(min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) for req in running)
        return memory.available() - expected * self.new_token_ratio

    def need(self, req: Req, fill: int) -> float:
        """Its uncached tokens (prompt, and any output kept from before a retraction) plus
        its remaining ``max_new_tokens``, clipped."""
        return fill + min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS)

    def after_decode_prepared(self, running: Sequence[Req], retracted: Sequence[Req]) -> None:
        """Decay the ratio; after a retraction, re-estimate it from what the survivors have
        actually decoded so far plus a few more steps each (SGLang's reset)."""
        if not retracted:
            self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
        elif not running:
            self.new_token_ratio = self.init_ratio
        else:
            decoded = sum(len(req.output) for req in running)
            limit = sum(req.max_new_tokens for req in running) + 1  # SGLang's + 1
            self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(running)) / limit)


def make_admission(config: EngineConfig) -> AdmissionRule:
    """The rule named by ``config.admission``."""
    if config.admission == "reserve":
        return ReserveAdmission(config.kv_capacity, config.page_size)
    return BudgetAdmission(config.new_token_ratio, config.ratio_decay, config.min_ratio,
                           config.page_size)
