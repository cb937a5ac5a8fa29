"""One frozen configuration for the engine, the scheduler and the simulator.

Every option is declared once, with one default, and validated once (``__post_init__``),
so ``Engine``, ``Scheduler``, ``simulate`` and the book's experiment helpers cannot drift
apart. ``EngineConfig.from_options(**options)`` turns keyword arguments into a config and
names the valid options when one is misspelled.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, fields
from typing import Any, Literal

from minisrv.checks import check_choice, check_int, check_number
from minisrv.kv import CACHES, Cache
from minisrv.kv.host import HOST_POLICIES
from minisrv.scheduler.policy import IN_BATCH_POLICIES, POLICIES, TREE_POLICIES, Policy

__all__ = [
    "ADMISSIONS",
    "ADMISSION_ORDERS",
    "MAX_DRAFT_TOKENS",
    "MODES",
    "POLICIES",
    "Admission",
    "AdmissionOrder",
    "ConfigView",
    "EngineConfig",
    "Mode",
    "Policy",
    "SPECULATIVE",
]

Mode = Literal["static", "prefill-first", "mixed"]
MODES: tuple[Mode, ...] = ("static", "prefill-first", "mixed")
"""How steps are formed: request-level batching, SGLang's default, and ORCA's mixed steps."""

Admission = Literal["reserve", "budget"]
ADMISSIONS: tuple[Admission, ...] = ("reserve", "budget")
"""How requests are admitted: reserve the worst case up front, or SGLang's estimated budget."""

AdmissionOrder = Literal["allocate-each", "lock-round-first"]
ADMISSION_ORDERS: tuple[AdmissionOrder, ...] = ("allocate-each", "lock-round-first")
"""When a step's admissions get their KV: each as it is admitted, evicting for it before the
next request is matched; or, as SGLang (``PrefillAdder`` then ``prepare_for_extend``), after
every admission of the round has matched and locked its prefix (``forming.py``)."""


SPECULATIVE: tuple[str, ...] = ("ngram", "draft")
"""``Engine(model, speculative=...)``: prompt lookup, or the shipped draft model
(``minisrv.spec``); a ``Drafter`` object is taken as it is."""

MAX_DRAFT_TOKENS = 16
"""The most guesses ``num_draft_tokens`` allows per request and step."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes how an engine schedules; one default per option."""

    kv_capacity: int = 4000  # KV token slots in the pool
    max_running: int = 8  # cap on the running batch
    policy: Policy = "fcfs"  # order in which waiting requests are considered (policy.py)
    in_batch_prefix_check: bool | None = None  # None: on for the cache-aware policies
    seed: int | None = None  # the random policy's generator
    cache: Cache = "none"  # "radix": RadixAttention's tree; "blocks": vLLM's block hashes
    mode: Mode = "prefill-first"  # how a step is formed
    overlap: bool = False  # form step i+1 on the CPU while the device computes step i
    skip_finishing_decode: bool = True  # overlap: requests ending on length skip i+1 (SGLang)
    admission: Admission = "budget"  # how memory is promised to admitted requests
    admission_order: AdmissionOrder = "allocate-each"  # when admissions get KV (forming.py)
    new_token_ratio: float = 0.7  # budget: share of remaining output assumed still needed
    ratio_decay: float = 0.001  # budget: how much the ratio falls per decode step
    min_ratio: float = 0.1  # budget: the ratio's floor
    record_trace: bool = True  # keep one StepRecord per step
    debug: bool = False  # check the memory invariants after every step (slow)
    attention: str = "auto"  # a model's attention backend (_check_attention)
    device: str | None = None  # where a model runs ("cpu", "cuda", ...); None: where it is
    chunked_prefill_size: int | None = None  # most new tokens one step computes; None: no cap
    cuda_graph: bool = False  # a model's decode steps replay CUDA graphs (CUDA only; untested)
    speculative: Any = None  # None, "ngram", "draft" or a Drafter: guess, check in one forward
    num_draft_tokens: int = 4  # speculative: most guesses a request drafts per step
    jump_forward: bool = False  # constrained requests append the tokens their grammar forces
    host_cache_tokens: int = 0  # token slots of the host tier (evicted prefixes kept); 0: none
    host_cache_policy: str = "write_through"  # when the host tier gets a copy (kv/host.py)
    page_size: int = 1  # KV slots per page: the allocator's and the prefix cache's unit
    #                     (cache="blocks": vLLM's block; its default there is 16)

    def __post_init__(self) -> None:
        check_int("kv_capacity", self.kv_capacity, minimum=1)
        check_int("max_running", self.max_running, minimum=1)
        check_int("page_size", self.page_size, minimum=1)
        if self.kv_capacity < self.page_size:
            raise ValueError(f"kv_capacity={self.kv_capacity} holds no page of "
                             f"page_size={self.page_size} slots")
        check_choice("policy", self.policy, POLICIES)
        check_choice("cache", self.cache, CACHES)
        if self.cache == "blocks" and self.policy in TREE_POLICIES:
            raise ValueError(f"policy={self.policy!r} walks the radix tree's nodes and "
                             f"cache='blocks' keeps a hash table of blocks, not a tree; use "
                             f"cache='radix', or policy='lpm' (it needs only match lengths)")
        check_choice("mode", self.mode, MODES)
        check_choice("admission", self.admission, ADMISSIONS)
        check_choice("admission_order", self.admission_order, ADMISSION_ORDERS)
        check_number("new_token_ratio", self.new_token_ratio, 0.0, 1.0)
        check_number("min_ratio", self.min_ratio, 0.0, self.new_token_ratio)
        check_number("ratio_decay", self.ratio_decay, 0.0)
        for name in ("overlap", "skip_finishing_decode", "record_trace", "debug", "cuda_graph",
                     "jump_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check = self.in_batch_prefix_check
        if check is not None and not isinstance(check, bool):
            raise ValueError(f"in_batch_prefix_check must be True, False or None, got {check!r}")
        if check and self.policy not in IN_BATCH_POLICIES:
            raise ValueError(f"in_batch_prefix_check=True works with policies "
                             f"{', '.join(sorted(IN_BATCH_POLICIES))}, not {self.policy!r}")
        if self.seed is not None:
            check_int("seed", self.seed)
        self._check_attention()
        if self.device is not None and not isinstance(self.device, str):
            raise ValueError(f"device must be a device name such as 'cpu' or 'cuda', or None, "
                             f"got {self.device!r}")
        if self.cuda_graph and self.device is not None and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graph=True needs a CUDA device, not device={self.device!r}")
        self._check_chunking()
        self._check_multi_token()
        self._check_host_tier()

    def _check_attention(self) -> None:
        """Only that ``attention`` is a name: which names exist is the registry's
        (``minisrv.runner.attention.BACKENDS``, or ``"auto"``), and the runner checks the
        name against it when the engine builds it, with a ValueError naming them all. The
        registry lives with torch in ``runner/``, which ``scheduler/`` does not import (it
        imports without torch), and it is open (a backend is one module and one line
        there, or a test's entry): a copy of its names here would be a second table to
        keep in step. A simulated GPU has no attention, so it ignores the name."""
        if not isinstance(self.attention, str) or not self.attention:
            raise ValueError(f"attention must be a backend's name or 'auto', got "
                             f"{self.attention!r}")

    def _check_host_tier(self) -> None:
        """A host tier keeps what the radix tree evicts, so it needs the tree."""
        check_int("host_cache_tokens", self.host_cache_tokens, minimum=0)
        if 0 < self.host_cache_tokens < self.page_size:
            raise ValueError(f"host_cache_tokens={self.host_cache_tokens} holds no page of "
                             f"page_size={self.page_size} slots")
        check_choice("host_cache_policy", self.host_cache_policy, HOST_POLICIES)
        if self.host_cache_tokens and self.cache != "radix":
            raise ValueError(f"host_cache_tokens={self.host_cache_tokens} needs cache='radix': "
                             f"the host tier keeps the prefixes the radix tree evicts, and "
                             f"cache={self.cache!r} keeps none")

    def _check_multi_token(self) -> None:
        """Speculation and jump-forward both need each step's result before the next step
        is formed, so neither runs under the overlapped loop."""
        spec = self.speculative
        k = check_int("num_draft_tokens", self.num_draft_tokens, minimum=1)
        if k > MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be in 1..{MAX_DRAFT_TOKENS}, got {k}")
        if spec is None:
            pass
        elif isinstance(spec, str):
            check_choice("speculative", spec, SPECULATIVE)
        elif not (callable(getattr(spec, "draft", None))
                  and callable(getattr(spec, "release", None))):
            raise ValueError(f"speculative must be None, one of {', '.join(SPECULATIVE)} or a "
                             f"minisrv.spec.Drafter, got {spec!r}")
        if spec is not None and self.overlap:
            raise ValueError(
                "speculative decoding needs the blocking loop: a check keeps 1..k+1 tokens, "
                "so the next step's positions, KV slots and drafts are known only after this "
                "step's result, while the overlapped loop forms step i+1 before step i "
                "completes")
        if self.jump_forward and self.overlap:
            raise ValueError(
                "jump_forward needs the blocking loop: the tokens a grammar forces after step "
                "i's token are fed in step i+1, which the overlapped loop forms before step "
                "i's token is known")

    def _check_chunking(self) -> None:
        """A step budget must let every running request decode in one step (so no step is
        over it), and a static batch has no steps that mix admissions in."""
        size = self.chunked_prefill_size
        if size is None:
            return
        if self.admission_order != "allocate-each":
            raise ValueError("chunked_prefill_size cuts admissions one at a time: it works "
                             "with admission_order='allocate-each' only")
        check_int("chunked_prefill_size", size, minimum=1)
        if self.mode == "static":
            raise ValueError("chunked_prefill_size works with the prefill-first and mixed "
                             "modes, not mode='static'")
        if size < self.max_running:
            raise ValueError(f"chunked_prefill_size ({size}) must be at least max_running "
                             f"({self.max_running}): every running request decodes one token "
                             "in a step")

    @classmethod
    def from_options(cls, config: EngineConfig | None = None, **options: Any) -> EngineConfig:
        """``config`` (or the defaults) with ``options`` replaced; unknown names are an error."""
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(
                f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                f"valid options: {', '.join(valid)}"
            )
        return dataclasses.replace(config or cls(), **options)


def _option(name: str, doc: str) -> property:
    """A read-only property for ``self.config.<name>``."""
    return property(operator.attrgetter(f"config.{name}"), doc=doc)


class ConfigView:
    """Read-only shortcuts to the options of ``self.config``, for the engine and the loop.

    The scheduler, which inherits nothing, takes the same property objects as class attributes.
    """

    config: EngineConfig

    mode = _option("mode", "The batching mode (``config.mode``).")
    max_running = _option("max_running", "Seats in the running batch (``config.max_running``).")
    kv_capacity = _option("kv_capacity", "KV token slots (``config.kv_capacity``).")
    policy = _option("policy", "The waiting queue's order (``config.policy``).")
    cache = _option("cache", "The prefix cache's kind (``config.cache``).")
