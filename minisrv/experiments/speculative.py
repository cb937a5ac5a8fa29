"""The speculative-decoding chapter's runs: how often the drafts guess right on CityLM's
workloads, one request's checks traced, the rejection rule's distribution checked, and the
roofline speed-up of LLaMA-3-8B on an H100 against k and the batch size.

The acceptance sweep serves each draft length's requests together, through the engine's
speculation (``Engine(speculative=..., num_draft_tokens=k)``), and reads each request's checks
from the engine's trace: greedy, they are exactly the checks of ``speculative_generate`` (one
request with the target's dense forward, which ``check_trace`` runs; the tests compare the
two). Every output is compared, token for token, with ``reference_generate``'s (remembered
per model, ``alone_outputs``): greedy speculation must give exactly what decoding alone gives.
The GPU numbers are the roofline's (``minisrv.sim.speedup``); nothing here is timed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple

import pandas as pd
import torch

from minisrv.checks import check_int, check_number
from minisrv.configs import H100, LLAMA3_8B, GPUSpec, ModelConfig
from minisrv.engine import Engine
from minisrv.experiments.batching import alone_outputs
from minisrv.model import CityLM
from minisrv.request import Req
from minisrv.sampling import SamplingParams, nucleus_probs
from minisrv.sim.speedup import (
    acceptance_by_position,
    breakeven_batch,
    conditional_acceptance,
    max_speculative_requests,
    positions_reached,
    speculative_speedup,
)
from minisrv.spec import (
    Draft,
    Drafter,
    DraftModelDrafter,
    NgramDrafter,
    SpecResult,
    rejection_accept,
    sample_probs,
    speculative_generate,
)
from minisrv.tokenizer import Tokenizer
from minisrv.workloads import Workload, chat_turns, city_prompts, shared_system_prompt

__all__ = [
    "CONTEXTS",
    "KS",
    "CheckRow",
    "EngineRun",
    "SamplingCheck",
    "acceptance_sweep",
    "breakeven_table",
    "check_trace",
    "chi2_critical",
    "drafters",
    "engine_table",
    "outputs_alone",
    "sampling_check",
    "serve_speculative",
    "spec_workloads",
    "speedup_frame",
]

KS: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
"""The draft lengths the chapter sweeps on CityLM: every k from 1 to 6."""

CONTEXTS: tuple[int, ...] = (256, 1024)
"""Tokens each request holds in the roofline runs: a short chat, and a longer one."""


def drafters(draft_model: CityLM | None = None) -> dict[str, Drafter]:
    """The chapter's two drafts: prompt lookup (``NgramDrafter()``, no model) and the
    shipped CityDraft (``DraftModelDrafter``, or ``draft_model`` if given)."""
    return {"n-gram": NgramDrafter(), "CityDraft": DraftModelDrafter(draft_model)}


def spec_workloads(model: CityLM, tok: Tokenizer) -> dict[str, list[list[int]]]:
    """Four CityLM workloads, by name, as prompts.

    - ``city prompts``: 14 country lines cut after 0-2 cities (``city_prompts``);
    - ``shared system prompt``: 4 users asking new countries after one few-shot prompt;
    - ``chat turns``: 4 turns of one chat, each resending the conversation so far;
    - ``answer in the prompt``: the chat's history, then a country already answered in it,
      where the answer's first cities can be copied from the prompt.
    """
    prompts, answers = chat_turns(model, tok, 4)
    history = prompts[-1] + answers[-1]
    again = [history + tok.encode(f"{code}:", bos=False) for code in ("FR", "DE", "IT", "JP")]
    return {"city prompts": city_prompts(tok, 14), "shared system prompt":
            shared_system_prompt(tok, 4), "chat turns": prompts, "answer in the prompt": again}


def outputs_alone(model: CityLM, prompts: Sequence[Sequence[int]],
                  max_new_tokens: int = 40) -> list[list[int]]:
    """Each prompt generated alone and greedily (``reference_generate``), the outputs every
    run must equal: through ``alone_outputs``, which remembers them per model, so the page's
    runs and checks of the same prompts generate each one once."""
    prompts = [list(p) for p in prompts]
    workload = Workload("alone", prompts, [max_new_tokens] * len(prompts), [0.0] * len(prompts))
    return alone_outputs(model, workload)


class _GuessesOnce(Drafter):
    """A greedy drafter whose guesses after each token list are computed once for every k.

    A greedy draft depends only on the tokens it continues, and its k guesses are the first
    k of its guesses for any larger k (both drafts stop at the same eos, or where the
    prompt lookup's match runs out); the sweep asks the same lists again at k = 1..6."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self._known: dict[tuple[int, ...], tuple[int, list[int]]] = {}  # tokens -> (k, guesses)

    def propose(self, tokens: Sequence[int], k: int, *, key: Hashable = None) -> list[int]:
        asked, guesses = self._known.get(tuple(tokens), (0, []))
        if k > asked and len(guesses) == asked:  # never asked this many, nor stopped short
            guesses = self.drafter.propose(tokens, k, key=key)
            self._known[tuple(tokens)] = (k, guesses)
        return guesses[:k]

    def draft(self, tokens: Sequence[int], k: int, params: SamplingParams,
              generator: torch.Generator | None, *, key: Hashable = None) -> Draft:
        if not params.greedy:
            raise ValueError("_GuessesOnce remembers greedy guesses only")
        return Draft(self.propose(tokens, k, key=key))

    def release(self, key: Hashable) -> None:
        self.drafter.release(key)


def _served_checks(model: CityLM, prompts: Sequence[Sequence[int]], drafter: Drafter, k: int,
                   max_new_tokens: int) -> list[SpecResult]:
    """Each prompt's tokens and checks, all served at once by the speculative engine.

    Every request is admitted in the first step and never retracted (the pool holds them
    all with their guesses), so each one's checks are those of it alone: greedy, a check's
    guesses and kept tokens follow from the request's tokens only."""
    capacity = sum(len(p) + max_new_tokens + k for p in prompts)
    engine = Engine(model, kv_capacity=capacity, max_running=len(prompts),
                    speculative=drafter, num_draft_tokens=k)
    requests = [engine.add_request(list(p), SamplingParams(max_new_tokens=max_new_tokens))
                for p in prompts]
    engine.run()
    if engine.stats.retractions:
        raise RuntimeError("a request was retracted: its checks are not those of it alone")
    results = {r.rid: SpecResult(list(r.output)) for r in requests}
    for record in engine.trace:
        for rid, drafted, accepted in record.checks:
            results[rid].drafted.append(drafted)
            results[rid].accepted.append(accepted)
    return [results[r.rid] for r in requests]


def acceptance_sweep(
    model: CityLM, workloads: Mapping[str, Sequence[Sequence[int]]],
    drafts: Mapping[str, Drafter], ks: Sequence[int] = KS, max_new_tokens: int = 40,
) -> pd.DataFrame:
    """One row per (workload, draft, k): ``acceptance``, the per-guess rate the formula takes
    (kept guesses over the guesses the checks reached, ``conditional_acceptance``);
    ``by_position``, that rate for each guess position 1..k given the guesses before it were
    kept, and ``reached``, how many checks examined each position (the rate's sample);
    ``kept_share``, kept guesses over drafted ones; tokens per check (target forwards),
    ``outputs`` (each request's tokens, for a page's own check) and whether they all equal
    ``reference_generate``'s.

    For each draft and k, every workload's requests are served together by the engine
    (``_served_checks``: each request's checks are ``speculative_generate``'s); a draft's
    guesses are computed once for all k (``_GuessesOnce``), the longest k first, so each of
    ``drafts`` must guess greedily, its k guesses the first k of its guesses for any larger
    k (as both of ``drafters`` do)."""
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
    prompts = [list(p) for ps in workloads.values() for p in ps]
    alone = outputs_alone(model, prompts, max_new_tokens)
    served: dict[tuple[str, int], list[SpecResult]] = {}
    for name, drafter in drafts.items():
        once = _GuessesOnce(drafter)
        for k in sorted(set(ks), reverse=True):
            served[name, k] = _served_checks(model, prompts, once, k, max_new_tokens)
    rows, first = [], 0
    for work, work_prompts in workloads.items():
        mine = slice(first, first + len(work_prompts))
        first = mine.stop
        plain = sum(len(a) for a in alone[mine])
        for name in drafts:
            for k in ks:
                runs = served[name, k][mine]
                each_drafted = [d for r in runs for d in r.drafted]
                each_accepted = [a for r in runs for a in r.accepted]
                drafted, accepted = sum(each_drafted), sum(each_accepted)
                checks = len(each_accepted)
                by_position = acceptance_by_position(each_drafted, each_accepted, k)
                rows.append({"workload": work, "draft": name, "k": k,
                             "acceptance": conditional_acceptance(each_drafted, each_accepted),
                             "by_position": by_position,
                             "reached": positions_reached(each_drafted, each_accepted, k),
                             "kept_share": accepted / drafted if drafted else 0.0,
                             "tokens_per_check": (accepted + checks) / checks,
                             "forwards": checks + len(runs),  # a prefill each, then checks
                             "plain_forwards": plain,
                             "outputs": [r.tokens for r in runs],
                             "identical": [r.tokens for r in runs] == alone[mine]})
    return pd.DataFrame(rows)


class CheckRow(NamedTuple):
    """One check of one request, as the trace figure draws it."""

    last: int  # the token the check feeds first (its KV is written by this check)
    draft: list[int]  # the guesses
    accepted: int  # how many guesses the target kept
    own: int  # the target's own token after the accepted run
    cached: int  # tokens whose KV the request held before the check

    @property
    def written(self) -> int:
        """KV slots the check writes: the last token and every guess."""
        return len(self.draft) + 1

    @property
    def freed(self) -> int:
        """KV slots of rejected guesses, freed after the check."""
        return len(self.draft) - self.accepted


def check_trace(model: CityLM, drafter: Drafter, prompt: Sequence[int], max_new_tokens: int,
                k: int) -> list[CheckRow]:
    """The checks of one greedy request, with the guesses each one tested.

    Runs ``speculative_generate`` and asks ``drafter`` again, before each check, for the
    guesses it made there: a greedy draft depends only on the tokens it continues, so the
    repeat is exact (checked against the recorded draft lengths).
    """
    result = speculative_generate(model, drafter, prompt, max_new_tokens, k)
    tokens, rows = list(prompt) + result.tokens[:1], []
    for drafted, accepted in zip(result.drafted, result.accepted, strict=True):
        room = max_new_tokens - (len(tokens) - len(prompt))
        guesses = drafter.propose(tokens, min(k, room - 1), key="trace")
        if len(guesses) != drafted:
            raise RuntimeError("the drafter is not deterministic: its guesses changed")
        kept = result.tokens[len(tokens) - len(prompt):][: accepted + 1]
        if kept[:accepted] != guesses[:accepted]:
            raise RuntimeError("the accepted tokens differ from the repeated guesses")
        rows.append(CheckRow(tokens[-1], guesses, accepted, kept[-1], len(tokens) - 1))
        tokens += kept
    drafter.release("trace")
    return rows


def chi2_critical(dof: int, z: float = 3.0902) -> float:
    """The chi-square quantile for ``dof`` degrees of freedom at the normal quantile ``z``
    (3.0902: the 0.1% upper tail), by the Wilson-Hilferty cube (within 2% from 5 dof,
    1% from 10)."""
    dof = check_int("dof", dof, minimum=1)
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


class SamplingCheck(NamedTuple):
    """Many draws of one position through the rejection rule, against the target's p."""

    p: torch.Tensor  # the target's distribution [vocab]
    q: torch.Tensor  # the draft's distribution [vocab], what the guesses are drawn from
    counts: torch.Tensor  # how often each token came out of the check [vocab]
    accepted: int  # draws whose guess was kept (the rest were resampled from the residual)

    @property
    def frequencies(self) -> torch.Tensor:
        return self.counts / self.counts.sum()

    def distance(self, dist: torch.Tensor) -> float:
        """Total variation distance between the observed frequencies and ``dist``."""
        return float((self.frequencies - dist).abs().sum() / 2)

    def chi2(self) -> tuple[float, int]:
        """(statistic, degrees of freedom) against p, tokens expected under 5 times pooled."""
        n = float(self.counts.sum())
        expected = self.p * n
        big = expected >= 5
        obs = [*self.counts[big].tolist(), float(self.counts[~big].sum())]
        exp = [*expected[big].tolist(), float(expected[~big].sum())]
        pairs = [(o, e) for o, e in zip(obs, exp) if e > 0]
        return sum((o - e) ** 2 / e for o, e in pairs), len(pairs) - 1


@torch.inference_mode()
def sampling_check(model: CityLM, draft: CityLM, prompt: Sequence[int], n: int = 40_000,
                   temperature: float = 1.0, seed: int = 0) -> SamplingCheck:
    """Draw ``n`` first tokens after ``prompt`` the speculative way: a guess from the
    draft's q, then ``rejection_accept`` against the target's p. The kept token should be
    distributed as p, whatever q is."""
    n = check_int("n", n, minimum=1)
    temperature = check_number("temperature", temperature, 1e-6, None)
    ids = torch.tensor(list(prompt), dtype=torch.long)
    logits = model(ids)[-1].to(torch.float64)
    p = nucleus_probs(logits, temperature, 1.0)
    q = nucleus_probs(draft(ids)[-1].to(torch.float64), temperature, 1.0)
    rows = torch.stack([logits, logits])  # row 1 only draws the bonus token, unused here
    params = SamplingParams(max_new_tokens=2, temperature=temperature, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros_like(p)
    accepted = 0
    for _ in range(n):
        guess = sample_probs(q, generator)
        kept = rejection_accept(rows, Draft([guess], q.unsqueeze(0)), params, generator)
        accepted += len(kept) == 2
        counts[kept[0]] += 1
    return SamplingCheck(p, q, counts, accepted)


def speedup_frame(acceptance: float, ks: Sequence[int] = (1, 2, 4, 8),
                  batches: Sequence[int] = tuple(range(1, 1025)),
                  contexts: Sequence[int] = CONTEXTS, draft: ModelConfig | None = None,
                  cfg: ModelConfig = LLAMA3_8B, gpu: GPUSpec = H100) -> pd.DataFrame:
    """Roofline speed-up (tokens/s with speculation over without) per context, k and batch,
    with free guesses (``draft=None``, n-gram) or a draft model costing k decode steps."""
    rows = [{"context": c, "k": k, "batch": b,
             "speedup": speculative_speedup(cfg, gpu, b, c, k, acceptance, draft)}
            for c in contexts for k in ks for b in batches]
    return pd.DataFrame(rows)


def breakeven_table(acceptance: float, ks: Sequence[int] = (1, 2, 4, 8),
                    contexts: Sequence[int] = CONTEXTS,
                    drafts: Mapping[str, ModelConfig | None] | None = None,
                    cfg: ModelConfig = LLAMA3_8B, gpu: GPUSpec = H100) -> pd.DataFrame:
    """The smallest batch at which speculation no longer pays, one row per (draft, context),
    one column per k; ``<NA>`` where it still pays at every batch that fits in memory
    (``max_speculative_requests``: a draft model's weights and KV take their share), 0 where
    it never pays. The last column is that limit."""
    drafts = drafts if drafts is not None else {"free guesses": None}
    rows = {}
    for name, d in drafts.items():
        for c in contexts:
            fits = max_speculative_requests(cfg, gpu, c, d)
            row: dict[str, int | None] = {}
            for k in ks:
                if speculative_speedup(cfg, gpu, 1, c, k, acceptance, d) <= 1:
                    row[f"k = {k}"] = 0
                else:
                    found = breakeven_batch(cfg, gpu, c, k, acceptance, d, max_batch=fits)
                    row[f"k = {k}"] = found
            row["fits in memory"] = fits
            rows[(name, c)] = row
    frame = pd.DataFrame(rows).T.astype("Int64")
    frame.index.names = ["draft", "context"]
    return frame


class EngineRun(NamedTuple):
    """One workload served by the engine, with or without speculation."""

    engine: Engine
    requests: list[Req]
    identical: bool  # every request's tokens equal reference_generate's
    seconds: float  # wall-clock time of engine.run(), the comparison with reference excluded


def serve_speculative(model: CityLM, prompts: Sequence[Sequence[int]],
                      speculative: Drafter | str | None, k: int = 4, max_new_tokens: int = 40,
                      max_running: int = 16, kv_capacity: int = 4000) -> EngineRun:
    """Serve ``prompts`` greedily, all arriving at once, with ``Engine(speculative=...,
    num_draft_tokens=k)`` (``None``: plain decoding), and compare with each request alone."""
    extra = {} if speculative is None else {"speculative": speculative, "num_draft_tokens": k}
    engine = Engine(model, kv_capacity=kv_capacity, max_running=max_running, **extra)
    requests = [engine.add_request(list(p), SamplingParams(max_new_tokens=max_new_tokens))
                for p in prompts]
    start = time.perf_counter()
    engine.run()
    seconds = time.perf_counter() - start
    alone = outputs_alone(model, prompts, max_new_tokens)
    return EngineRun(engine, requests, [r.output for r in requests] == alone, seconds)


def engine_table(runs: Mapping[str, EngineRun]) -> pd.DataFrame:
    """One row per run: engine steps, output tokens per step, guesses checked and kept, KV
    slots freed after the checks, and whether the tokens equal each request alone."""
    rows = {}
    for name, run in runs.items():
        s = run.engine.stats
        rows[name] = {"steps": s.steps, "tokens": s.generated_tokens,
                      "tokens / step": round(s.generated_tokens / s.steps, 1),
                      "guesses": s.draft_tokens, "kept": s.accepted_tokens,
                      "KV freed": s.rejected_tokens, "equals alone": run.identical}
    return pd.DataFrame(rows).T
