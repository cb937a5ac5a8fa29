"""The structured-output chapter's runs: grammars as token masks, on CityLM and on a tiny
JSON-capable Llama folder.

``mask_trace`` replays a constrained generation and keeps each step's mask, for the picture
of the vocabulary lit step by step; ``served_masks`` serves several grammars' requests in one
engine batch, checks each against the request alone, and traces their masks. ``automaton``
explores a grammar with a finite language through xgrammar's matcher and merges prefixes
with the same completions into states: the minimal automaton the mask walks, drawn
character by character or compressed into chains (SGLang's compressed finite-state
machine). ``step_probabilities`` compares the model's own probability of each chosen token
with the renormalised one under the mask. ``json_runs`` samples a JSON schema over seeds and
temperatures and validates every output.
The mask's timings (``mask_cost_us``, ``fill_cost_us``, ``gpu_mask_ms``) live in
``mask_cost.py`` and are re-exported here, so the chapter reaches every run through one name.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from minisrv.checks import check_int
from minisrv.engine import Engine
from minisrv.experiments.mask_cost import (  # noqa: F401  (the chapter's ``st.`` names)
    decode_step_ms,
    fill_cost_us,
    gpu_mask_ms,
    mask_cost_us,
    synthetic_vocabulary,
)
from minisrv.grammar import (
    CompiledGrammar,
    GrammarState,
    Vocabulary,
    compile_grammar,
)
from minisrv.grammar.reference import constrained_generate
from minisrv.sampling import SamplingParams

__all__ = [
    "CITY_SCHEMA",
    "FULL_STOP",
    "PICK",
    "RECORDS",
    "THREE_CITIES",
    "Automaton",
    "MaskRun",
    "MaskStep",
    "StepProbability",
    "automaton",
    "in_process_server",
    "json_runs",
    "mask_trace",
    "served_masks",
    "step_probabilities",
]

THREE_CITIES = r"( [A-Z][a-z]+,){3}"
"""Three city names, each after a space and before a comma: what a program splits on ``,``."""

FULL_STOP = r" [A-Z][a-z]+, [A-Z][a-z]+, [A-Z][a-z]+\."
"""Three cities then a full stop: a grammar CityLM's habits disagree with (see the chapter)."""

RECORDS = r"""root ::= record record
record ::= code ": " city ", " city ", " city "\n"
code ::= [A-Z] [A-Z]
city ::= [A-Z] [a-z]+ ("-" [A-Za-z] [a-z]+)*
"""
"""Two ``Country: City, City, City`` records in xgrammar's EBNF (rule ``root``)."""

PICK = r" (Paris|Lyon|Lille|Nice|Rome|Riga)\."
"""A regex with a finite language, small enough to draw its automaton."""

CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]},
        "rank": {"type": "integer", "minimum": 1, "maximum": 99},
    },
    "required": ["city", "rank"],
    "additionalProperties": False,
}
"""A JSON answer a program can parse: a city of a fixed list and its rank."""


@dataclass(frozen=True)
class MaskStep:
    """One decoding step: the tokens the grammar allowed, and the one chosen."""

    allowed: torch.Tensor  # bool [vocab]
    token: int


def mask_trace(grammar: CompiledGrammar, tokens: Sequence[int]) -> list[MaskStep]:
    """The mask before each of ``tokens`` (a constrained output) and the token taken."""
    state = GrammarState(grammar)
    steps = []
    for token in tokens:
        steps.append(MaskStep(state.allowed_mask(), int(token)))
        state.accept(token)
    return steps


@dataclass(frozen=True)
class Automaton:
    """A minimal automaton: states ``0..n-1`` (0 the start), ``edges`` (from, text, to),
    ``accepting`` the states where the text may end."""

    n_states: int
    edges: tuple[tuple[int, str, int], ...]
    accepting: frozenset[int]

    def compressed(self) -> Automaton:
        """Chains of states with one way out merged into one edge of many characters: the
        compressed finite-state machine. Along such an edge the grammar fixes every
        character, which is what jump-forward appends without a decoding step."""
        out: dict[int, list[tuple[str, int]]] = {s: [] for s in range(self.n_states)}
        indegree = dict.fromkeys(range(self.n_states), 0)
        for a, text, b in self.edges:
            out[a].append((text, b))
            indegree[b] += 1

        def passable(s: int) -> bool:  # a state inside a chain: one way in, one way out
            return len(out[s]) == 1 and indegree[s] == 1 and s not in self.accepting and s

        kept = [s for s in range(self.n_states) if not passable(s)]
        ids = {s: i for i, s in enumerate(kept)}
        edges = []
        for a in kept:
            for text, b in out[a]:
                while passable(b):
                    more, b = out[b][0]
                    text += more
                edges.append((ids[a], text, ids[b]))
        return Automaton(len(kept), tuple(edges), frozenset(ids[s] for s in self.accepting))


def automaton(grammar: CompiledGrammar, max_states: int = 200) -> Automaton:
    """The minimal automaton of ``grammar``'s language, found through its matcher.

    Every prefix the mask allows is visited depth first (accept a token, recurse, roll
    back); two prefixes are one state when they allow the same completions. That only ends
    for a finite language (no ``+`` or ``*``): ``ValueError`` past ``max_states`` prefixes.
    """
    vocab = grammar.vocab
    state = GrammarState(grammar)
    ids: dict[frozenset[str], int] = {}
    edges: set[tuple[int, str, int]] = set()
    accepting: set[int] = set()
    visited = 0

    def visit() -> frozenset[str]:
        nonlocal visited
        visited += 1
        if visited > max_states:
            raise ValueError(f"more than {max_states} prefixes: draw a finite grammar")
        allowed = torch.nonzero(state.allowed_mask()).flatten().tolist()
        completions = {""} if state.is_completed else set()
        moves = []
        for token in allowed:
            if token in vocab.stop_ids:
                continue
            text = vocab.token_bytes[token].decode()
            state.accept(token)
            rest = visit()
            state.rollback(1)
            completions |= {text + tail for tail in rest}
            moves.append((text, rest))
        key = frozenset(completions)
        here = ids.setdefault(key, len(ids))
        if state.is_completed:
            accepting.add(here)
        for text, rest in moves:
            edges.add((here, text, ids[rest]))
        return key

    start = ids[visit()]
    # Renumber breadth first from the start, so state 0 is the start and numbers grow
    # along the text.
    order, queue = [start], [start]
    while queue:
        a = queue.pop(0)
        for _, _, b in sorted(e for e in edges if e[0] == a):
            if b not in order:
                order.append(b)
                queue.append(b)
    new = {s: i for i, s in enumerate(order)}
    return Automaton(len(order), tuple(sorted((new[a], t, new[b]) for a, t, b in edges)),
                     frozenset(new[s] for s in accepting))


@dataclass(frozen=True)
class StepProbability:
    """One step of a constrained output: the token, its probability under the model alone
    (``free``), under the mask (``masked``, renormalised over the allowed tokens), the share
    of the model's probability the mask allowed (``allowed_mass``), and the forbidden token
    the model rated highest (``forbidden``, its text; "" where the mask forbade nothing):
    where the allowed share is small, what the model wanted instead."""

    text: str
    free: float
    masked: float
    allowed_mass: float
    forbidden: str


@torch.inference_mode()
def step_probabilities(model: Any, prompt: Sequence[int], grammar: CompiledGrammar,
                       tokens: Sequence[int]) -> list[StepProbability]:
    """The model's and the mask's probability of each of ``tokens`` after ``prompt``
    (temperature 1: the softmax of the logits, then of the masked logits)."""
    ids = torch.tensor([*prompt, *tokens], dtype=torch.long, device=model.device)
    logits = model(ids, model.new_cache())[len(prompt) - 1: len(ids) - 1].float()
    state = GrammarState(grammar)
    text_of = [t.decode("utf-8", "replace") for t in grammar.vocab.token_bytes]
    rows = []
    for row, token in zip(logits, tokens):
        free = torch.softmax(row, -1)
        allowed = state.allowed_mask().to(row.device)
        masked = torch.softmax(row.masked_fill(~allowed, float("-inf")), -1)
        wanted = int(free.masked_fill(allowed, -1.0).argmax())  # the likeliest forbidden one
        rows.append(StepProbability(text_of[token], free[token].item(), masked[token].item(),
                                    free[allowed].sum().item(),
                                    "" if bool(allowed.all()) else text_of[wanted]))
        state.accept(token)
    return rows


def json_runs(model: Any, tokenizer: Any, grammar: CompiledGrammar, schema: dict[str, Any],
              seeds: Iterable[int], temperatures: Iterable[float], prompt: str = "",
              max_new_tokens: int = 80, jump_forward: bool = False) -> pd.DataFrame:
    """One sampled output per (temperature, seed): its text, whether it parses and
    validates against ``schema`` (jsonschema), its tokens and the model forwards it took."""
    import jsonschema

    rows = []
    for temperature in temperatures:
        for seed in seeds:
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                    seed=seed)
            run = constrained_generate(model, tokenizer.encode(prompt), grammar, params,
                                       jump_forward=jump_forward)
            text = tokenizer.decode(run.tokens)
            try:  # strict: no raw control character in a string (RFC 8259)
                jsonschema.validate(json.loads(text), schema)
                valid = True
            except (json.JSONDecodeError, jsonschema.ValidationError):
                valid = False
            rows.append({"temperature": temperature, "seed": seed, "text": text,
                         "valid": valid, "tokens": len(run.tokens), "forwards": run.forwards,
                         "jumped": run.jumped})
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class MaskRun:
    """One constrained request served by the engine: its tokens (``<eos>`` last when the
    grammar ended), the mask before each (``mask_trace``), each token's probabilities
    (``step_probabilities``), and whether the tokens equal the request generated alone."""

    regex: str
    tokens: list[int]
    steps: list[MaskStep]
    probabilities: list[StepProbability]
    identical: bool


def served_masks(model: Any, vocab: Vocabulary, prompt: Sequence[int],
                 regexes: dict[str, str], max_new_tokens: int = 40) -> dict[str, MaskRun]:
    """One greedy request per regex of ``regexes`` (name -> regex), all after ``prompt`` and
    served together in one engine batch; each output is compared with ``constrained_generate``
    (the request alone, the same mask), then its masks and probabilities are traced."""
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
    if not regexes:
        raise ValueError("regexes is empty: give at least one name -> regex")
    prompt = list(prompt)
    params = {name: SamplingParams(max_new_tokens=max_new_tokens, regex=regex)
              for name, regex in regexes.items()}
    engine = Engine(model, kv_capacity=len(params) * (len(prompt) + max_new_tokens) + 64,
                    max_running=len(params))
    engine.grammars(vocab)
    outs = engine.generate([prompt] * len(params), sampling=list(params.values()))
    runs = {}
    for (name, p), out in zip(params.items(), outs, strict=True):
        grammar = compile_grammar(vocab, regex=regexes[name])
        alone = constrained_generate(model, prompt, grammar, p).tokens
        runs[name] = MaskRun(regexes[name], list(out), mask_trace(grammar, out),
                             step_probabilities(model, prompt, grammar, out), out == alone)
    return runs


@contextmanager
def in_process_server(model: str, startup_s: float = 60.0) -> Iterator[Any]:
    """``minisrv serve --model MODEL`` inside this process: its HTTP app behind a test
    client (requests go to the app directly, no socket), ready when the model is loaded."""
    from starlette.testclient import TestClient

    from minisrv.model import load_tokenizer
    from minisrv.server.app import create_app
    from minisrv.server.config import EngineOptions, model_name
    from minisrv.server.worker import LocalEngine

    options = EngineOptions(model=model, device="cpu", kv_capacity=400, max_running=4)
    with TestClient(create_app(LocalEngine(options), load_tokenizer(model),
                               model_name(model))) as client:
        deadline = time.monotonic() + startup_s
        while client.get("/health").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server for {model} did not become healthy")
            time.sleep(0.05)
        yield client
