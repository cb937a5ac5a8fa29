"""What a step's grammar mask costs: the structured-output chapter's timings.

``synthetic_vocabulary`` builds a vocabulary of a real tokenizer's size, so that the mask has
a realistic width; ``mask_cost_us`` times one step's fill and apply as minisrv computes them,
``fill_cost_us`` the fill alone, ``gpu_mask_ms`` prices on the simulated H100 the part
servers move to the GPU (the bitmask's copy and the apply), and ``decode_step_ms`` the step
the mask must hide behind. Kept apart from ``structured.py``, which holds the chapter's
grammar runs, because these are measurements of time.
"""

from __future__ import annotations

import random
import string
import time
from collections.abc import Callable
from typing import Any

import torch

from minisrv.grammar import (
    GrammarLogitsProcessor,
    GrammarState,
    Vocabulary,
    compile_grammar,
)

__all__ = [
    "decode_step_ms",
    "fill_cost_us",
    "gpu_mask_ms",
    "mask_cost_us",
    "states_in_flight",
    "synthetic_vocabulary",
]


def synthetic_vocabulary(size: int = 32_000, seed: int = 0) -> Vocabulary:
    """A vocabulary of a real tokenizer's size: printable ASCII plus random letter strings
    (a third with a leading space, as in BPE vocabularies), eos first."""
    import xgrammar as xgr

    rng = random.Random(seed)
    tokens = ["</s>", *string.printable]
    seen = set(tokens)
    while len(tokens) < size:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8)))
        word = (" " + word) if rng.random() < 0.33 else word
        if word not in seen:
            seen.add(word)
            tokens.append(word)
    info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, stop_token_ids=[0])
    return Vocabulary(info, f"synthetic-{size // 1000}k")


def states_in_flight(grammar: Any, vocab: Vocabulary, batch: int, seed: int = 0,
                     most: int = 6) -> list[GrammarState]:
    """``batch`` matchers of ``grammar``, each 0 to ``most`` random allowed tokens in (seeded
    by ``seed``), as the rows of a step find them mid-answer."""
    rng = random.Random(seed)
    states = []
    for _ in range(batch):
        state = GrammarState(grammar)
        for _ in range(rng.randint(0, most)):
            allowed = [i for i in torch.nonzero(state.allowed_mask()).flatten().tolist()
                       if i not in vocab.stop_ids]
            if not allowed:
                break
            state.accept(rng.choice(allowed))
        states.append(state)
    return states


def _median_us(run: Callable[..., Any], repeats: int, fresh: Callable[[], tuple] = tuple) -> float:
    """Median microseconds of ``run(*fresh())``; ``fresh`` makes each call's arguments (a
    copy of what ``run`` changes in place) outside the timing."""
    times = []
    for _ in range(repeats):
        args = fresh()
        start = time.perf_counter()
        run(*args)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


def mask_cost_us(vocab: Vocabulary, batch: int, repeats: int = 20, *, regex: str | None = None,
                 json_schema: dict[str, Any] | None = None) -> float:
    """Median microseconds of one step's mask as minisrv computes it (``GrammarLogitsProcessor``:
    XGrammar's batched fill, then its apply on CPU float32 logits) for ``batch`` constrained
    rows, each a few random allowed tokens into its grammar. Each call masks a fresh copy of
    the logits, copied outside the timing."""
    grammar = compile_grammar(vocab, regex=regex, json_schema=json_schema)
    states = states_in_flight(grammar, vocab, batch)
    processor = GrammarLogitsProcessor(vocab.size)
    logits = torch.randn(batch, vocab.size)
    return _median_us(processor, repeats, lambda: (logits.clone(), states))


def fill_cost_us(vocab: Vocabulary, batch: int, repeats: int = 20, *,
                 regex: str | None = None, json_schema: dict[str, Any] | None = None) -> float:
    """Median microseconds of the fill alone over the same rows as ``mask_cost_us``
    (``GrammarLogitsProcessor.fill``: XGrammar's batched fill, every row's bitmask in one
    call), so that ``mask_cost_us`` minus it is the apply on the logits."""
    grammar = compile_grammar(vocab, regex=regex, json_schema=json_schema)
    states = states_in_flight(grammar, vocab, batch)
    processor = GrammarLogitsProcessor(vocab.size)
    return _median_us(processor.fill, repeats, lambda: (states,))


def gpu_mask_ms(batch: int, vocab_size: int) -> float:
    """Milliseconds on the simulated H100 for the part of a step's mask that servers run on
    the GPU: copying ``batch`` rows of the bitmask (one bit per token) over the host link,
    then one kernel that reads them and the float32 logits and writes the logits back.
    Roofline times without the kernel's launch, so a lower bound; beside ``fill_cost_us`` it
    prices the mask as a server pays it, where ``mask_cost_us`` applies it on the CPU."""
    from minisrv.configs import H100

    bitmask = batch * -(-vocab_size // 32) * 4  # int32 words of 32 tokens
    logits = batch * vocab_size * 4
    return (bitmask / H100.host_bandwidth + (bitmask + 2 * logits) / H100.bandwidth) * 1e3


def decode_step_ms(batch: int, context: int = 1000) -> float:
    """A decode step's time on the simulated H100 (roofline) for LLaMA-3-8B in bf16:
    ``batch`` requests each at ``context`` tokens."""
    from minisrv.configs import H100, LLAMA3_8B
    from minisrv.sim.roofline import step_cost_from_totals

    cost = step_cost_from_totals(LLAMA3_8B, H100, batch, batch * (context + 1),
                                 batch * context, 2)
    return cost.time_s * 1e3
