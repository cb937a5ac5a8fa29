"""The oracle of constrained decoding: one request, alone, one token at a time, masked.

As ``CityLM.reference_generate`` is the oracle every serving strategy must match, this is
the one a grammar-constrained engine must match: prefill the prompt, then each step masks the
last position's logits with the request's grammar (``GrammarLogitsProcessor`` on one row),
samples with ``sample_next`` and the request's own generator, and advances the grammar.

With ``jump_forward=True`` the tokens the grammar fixes after a sampled token are appended
at once and fed to the model in the same forward as that token (SGLang's jump-forward
decoding). Each jumped token still consumes one uniform draw of a sampled request's
generator, exactly as the masked step it replaces would have (a forced step draws and can
only land on the one allowed token), so greedy and sampled outputs are the same text as
masking alone, with fewer forwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from minisrv.grammar.compile import CompiledGrammar
from minisrv.grammar.processor import GrammarLogitsProcessor
from minisrv.grammar.state import GrammarState
from minisrv.model import CityLM
from minisrv.sampling import SamplingParams, make_generator, sample_next


class Generation(NamedTuple):
    """A constrained generation: the ids (eos last when the grammar finished), how many
    model forwards produced them (the prefill included), and how many were jumped."""

    tokens: list[int]
    forwards: int
    jumped: int


@torch.inference_mode()
def constrained_generate(
    model: CityLM,
    prompt_ids: Sequence[int],
    grammar: CompiledGrammar,
    params: SamplingParams,
    *,
    jump_forward: bool = False,
) -> Generation:
    """Generate for ONE request under ``grammar`` (see the module docstring).

    Stops when the grammar terminates (its stop token, eos, was sampled: the only token a
    complete grammar with nothing left to add allows) or at ``params.max_new_tokens``.
    """
    prompt = list(prompt_ids)
    if not prompt:
        raise ValueError("prompt_ids is empty: encode at least <bos>")
    if len(prompt) + params.max_new_tokens > model.config.max_seq_len:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens "
                         f"({params.max_new_tokens}) exceeds max_seq_len="
                         f"{model.config.max_seq_len}")
    if grammar.vocab.size != model.config.vocab_size:
        raise ValueError(f"the grammar's vocabulary has {grammar.vocab.size} ids, the model "
                         f"{model.config.vocab_size}")
    generator = make_generator(params)
    state = GrammarState(grammar)
    processor = GrammarLogitsProcessor(grammar.vocab.size)
    cache = model.new_cache()
    feed, out, forwards, jumped = prompt, [], 0, 0
    while True:
        logits = model(torch.tensor(feed, dtype=torch.long, device=model.device), cache)
        forwards += 1
        row = logits[-1:].clone()
        processor(row, [state])
        token = sample_next(row[0], params, generator)
        state.accept(token)
        out.append(token)
        if state.is_terminated or len(out) == params.max_new_tokens:
            break
        feed = [token]
        if jump_forward:
            forced = state.jump_forward()[: params.max_new_tokens - len(out)]
            for _ in forced if generator is not None else ():
                torch.rand((), generator=generator, dtype=torch.float64)  # the skipped draw
            state.accept_all(forced)
            out += forced
            feed += forced
            jumped += len(forced)
            if len(out) == params.max_new_tokens:
                break
    return Generation(out, forwards, jumped)
