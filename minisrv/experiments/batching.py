"""The selective-batching chapter's runs: one flat forward against separate ones, the engine
against generating each request alone, and the KV pool's capacity and admission sweeps.

Each function builds fresh engines, serves a workload, checks the outputs where a reference
is given, and returns plain results (named tuples or DataFrames); ``minisrv.viz`` only draws
them. The defaults are the chapter's small settings, so each call takes seconds.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import pandas as pd
import torch
from tqdm.auto import tqdm

from minisrv.engine import Engine
from minisrv.kv import KVPool
from minisrv.model import CityLM, FlatBatch
from minisrv.request import Req
from minisrv.scheduler.admission import CLIP_MAX_NEW_TOKENS, PrefillAdder
from minisrv.workloads import Workload

__all__ = [
    "Admission",
    "EngineVsAlone",
    "FlatCheck",
    "PoolRun",
    "alone_outputs",
    "engine_vs_alone",
    "flat_equivalence",
    "pool_sweep",
    "record_admissions",
    "run_pool",
]


class FlatCheck(NamedTuple):
    """One flat forward over prefills and decodes against running each request alone."""

    n_requests: int  # requests in the step
    n_tokens: int  # new tokens the step computes (rows of every linear layer)
    max_diff: dict[str, float]  # per attention kind: largest |flat - separate| logit


def flat_equivalence(model: CityLM, prompts: Sequence[Sequence[int]], n_decodes: int) -> FlatCheck:
    """Run ``prompts`` as one flat step, the last ``n_decodes`` of them as decodes (their
    earlier tokens already in the pool), and compare each attention kind's logits with a
    separate forward per request. Use a float64 model to see only rounding differences."""
    seqs = [list(p) for p in prompts]
    n_prefill = len(seqs) - n_decodes
    n_new = [len(s) for s in seqs[:n_prefill]] + [1] * n_decodes
    pool = KVPool.for_model(model, sum(map(len, seqs)))
    slots = [pool.alloc(len(s)) for s in seqs]
    with torch.no_grad():
        if n_decodes:
            earlier = FlatBatch([s[:-1] for s in seqs[n_prefill:]],
                                [sl[:-1] for sl in slots[n_prefill:]], model.device)
            model.forward_flat(earlier, pool)
        step = FlatBatch([s[len(s) - n:] for s, n in zip(seqs, n_new)], slots, model.device)
        ids = [torch.tensor(s, device=model.device) for s in seqs]
        separate = torch.cat([model(t)[len(t) - n:] for t, n in zip(ids, n_new)])
        diffs = {attention: (model.forward_flat(step, pool, attention=attention) - separate)
                 .abs().max().item() for attention in ("loop", "padded")}
    return FlatCheck(len(step), step.num_tokens, diffs)


class EngineVsAlone(NamedTuple):
    """The engine against generating every request alone, on the same prompts."""

    tokens: int  # output tokens generated (the same both ways)
    seconds_alone: float  # reference_generate, one request after another
    seconds_engine: float  # Engine.generate, all requests together
    steps: int  # engine steps
    identical: int  # requests whose outputs are equal both ways
    total: int
    outputs: list[list[int]]  # what the engine served, for a page's own check
    reference: list[list[int]]  # each request generated alone

    @property
    def speedup(self) -> float:
        """How many times faster the engine served the same tokens."""
        return self.seconds_alone / self.seconds_engine


def engine_vs_alone(model: CityLM, workload: Workload, **options: Any) -> EngineVsAlone:
    """Time ``reference_generate`` request by request against one ``Engine(**options)``
    serving them all (default: mixed steps, every request in one batch)."""
    options = {"kv_capacity": 8000, "max_running": len(workload), "mode": "mixed", **options}
    start = time.perf_counter()
    alone = [model.reference_generate(p, m) for p, m in zip(workload.prompts, workload.output_lens)]
    t_alone = time.perf_counter() - start
    engine = Engine(model, **options)
    start = time.perf_counter()
    served = engine.generate(workload.prompts, workload.output_lens)
    t_engine = time.perf_counter() - start
    same = sum(a == b for a, b in zip(served, alone))
    return EngineVsAlone(sum(map(len, served)), t_alone, t_engine, engine.stats.steps, same,
                         len(alone), served, alone)


# each model's greedy runs alone, by (ignore_eos, prompt): alone_outputs' default ``known``
_KNOWN: weakref.WeakKeyDictionary[CityLM, dict[tuple, tuple[int, list[int]]]] = (
    weakref.WeakKeyDictionary())


def alone_outputs(model: CityLM, workload: Workload, *, ignore_eos: bool = False,
                  known: dict[tuple, tuple[int, list[int]]] | None = None) -> list[list[int]]:
    """Each request of ``workload`` generated alone and greedily (``reference_generate``,
    with ``ignore_eos``): the outputs every run must reproduce.

    A prompt that several requests share is generated once, for the longest of them:
    greedy decoding depends on the prompt alone, so a request of m tokens gets the first m
    tokens of that longer run (or all of it, if it ended at eos sooner). CityLM's
    workloads draw their prompts from a few countries and cities, so prompts repeat.

    ``known``: a dict that carries those runs from one call to the next, so a prompt that
    several workloads share is generated again only when a later workload asks for more
    tokens of it (chapter 03's workloads share their prompts: the explorer's eight recur,
    with room to stop at eos, in its last sweep). Left out, the model's own dict is used,
    kept for as long as the model lives, so a page's calls share it without passing it
    around; the model's weights must not change in between (CityLM's never do)."""
    if known is None:
        known = _KNOWN.setdefault(model, {})
    longest: dict[tuple[int, ...], int] = {}
    for prompt, n in zip(workload.prompts, workload.output_lens, strict=True):
        longest[tuple(prompt)] = max(n, longest.get(tuple(prompt), 0))
    for prompt, n in longest.items():
        key = (ignore_eos, prompt)
        if known.get(key, (0, []))[0] < n:  # never generated, or shorter than asked
            known[key] = (n, model.reference_generate(prompt, n, ignore_eos=ignore_eos))
    return [known[ignore_eos, tuple(prompt)][1][:n]
            for prompt, n in zip(workload.prompts, workload.output_lens)]


class Admission(NamedTuple):
    """One admission decision of a budget run, as a ledger: what the pool held and what the
    running requests were still promised when the step's newcomers were chosen, and what
    each waiting request the scheduler looked at asked for."""

    step: int  # index of the step the decision formed
    capacity: int  # slots in the pool
    running: int  # requests running
    held: int  # slots in use: the running requests' tokens (and any cached prefixes)
    remaining: int  # the running requests' remaining max_new_tokens (clipped), summed
    ratio: float  # new_token_ratio in force
    free: int  # slots a newcomer could get (free, plus cached ones nobody uses)
    budget: float  # free less ratio x remaining: what newcomers may claim
    # in queue order, one dict per request looked at: rid, prompt (tokens to prefill), limit
    # (max_new_tokens still allowed, clipped), need, left (budget left before it), admitted
    candidates: list[dict[str, Any]]


class _LedgerAdder(PrefillAdder):
    """A ``PrefillAdder`` that writes each candidate it is asked about into a ledger."""

    def __init__(self, decision: Admission, *args: Any) -> None:
        super().__init__(*args)
        self.decision = decision

    def fits(self, req: Req, fill: int) -> bool:
        self.decision.candidates.append({
            "rid": req.rid, "prompt": fill,
            "limit": min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS),
            "need": self.rule.need(req, fill), "left": self.budget, "admitted": False})
        return super().fits(req, fill)

    def add(self, req: Req, fill: int) -> None:
        super().add(req, fill)
        self.decision.candidates[-1]["admitted"] = True


def record_admissions(engine: Engine) -> list[Admission]:
    """From now on, every admission decision of ``engine``'s budget rule is appended to the
    returned list (the scheduler asks its rule for a ``PrefillAdder`` once per decision)."""
    rule, decisions = engine.scheduler.admission, []

    def adder(running: Sequence[Req], memory: Any, max_running: int) -> PrefillAdder:
        remaining = sum(min(r.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) for r in running)
        budget = rule.budget(running, memory)
        decision = Admission(len(engine.trace), memory.kv.capacity, len(running),
                             memory.kv.capacity - memory.kv.free_count, remaining, rule.ratio,
                             memory.available(), budget, [])
        decisions.append(decision)
        return _LedgerAdder(decision, rule, max_running - len(running), budget)

    rule.adder = adder
    return decisions


class PoolRun(NamedTuple):
    """One pool experiment: the engine after the run and whether outputs matched."""

    engine: Engine
    outputs: list[list[int]]
    identical: int  # requests whose tokens equal the reference
    total: int
    admissions: Sequence[Admission] = ()  # every admission decision, when recorded

    @property
    def check(self) -> str:
        """The sentence every experiment prints."""
        return f"outputs identical to each request alone: {self.identical} of {self.total}"


def run_pool(model: CityLM, workload: Workload, reference: Sequence[Sequence[int]], *,
             capacity: int = 120, ratio: float = 0.7, decay: float = 0.01, max_running: int = 8,
             admission: str = "budget", mode: str = "prefill-first",
             record: bool = False) -> PoolRun:
    """Serve ``workload`` with a pool of ``capacity`` slots and compare with ``reference``;
    ``record``: keep every admission decision's ledger (``record_admissions``)."""
    engine = Engine(model, kv_capacity=capacity, max_running=max_running, mode=mode,
                    admission=admission, new_token_ratio=ratio, ratio_decay=decay,
                    min_ratio=min(ratio, 0.1))
    admissions = record_admissions(engine) if record else []
    outputs = engine.generate(workload.prompts, workload.output_lens)
    same = sum(list(a) == list(b) for a, b in zip(outputs, reference))
    return PoolRun(engine, outputs, same, len(reference), admissions)


def pool_sweep(model: CityLM, workload: Workload, reference: Sequence[Sequence[int]],
               capacities: Sequence[int], ratios: Sequence[float | None], *,
               decay: float = 0.001, max_running: int = 8,
               progress: bool = False) -> tuple[pd.DataFrame, list[list[list[int]]]]:
    """Serve ``workload`` for every capacity and initial ratio (``None``: reserve admission).

    Returns one row per run (steps, mean decode batch, retractions, recomputed tokens) and
    each run's outputs, in the rows' order, for the caller to hold against ``reference``
    (the book counts every such check on its page).
    """
    rows, outputs = [], []
    jobs = [(c, r) for c in capacities for r in ratios]
    for capacity, ratio in tqdm(jobs, desc="pool sweep", leave=False, disable=not progress):
        run = run_pool(model, workload, reference, capacity=capacity,
                       ratio=1.0 if ratio is None else ratio, decay=decay,
                       max_running=max_running,
                       admission="reserve" if ratio is None else "budget")
        decodes = [len(s.decode) for s in run.engine.trace if s.decode]
        stats = run.engine.stats
        rows.append({
            "capacity": capacity,
            "initial ratio": "reserve" if ratio is None else f"{ratio:g}",
            "steps": stats.steps,
            "mean decode batch": round(sum(decodes) / len(decodes), 2),
            "retractions": stats.retractions,
            "recomputed tokens": stats.wasted_tokens,
        })
        outputs.append(run.outputs)
    return pd.DataFrame(rows), outputs
