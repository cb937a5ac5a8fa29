"""Constrained requests in the engine: each one's grammar state, masked and advanced per step.

``GrammarSampling`` is one of the runner's logits processors (``Sampler``): before a step's
tokens are drawn it masks the rows of requests whose ``SamplingParams`` carry a grammar, and
after they are drawn it advances each of those states by its token. Both happen in the
sampler, one step after the other on the same thread, so the overlapped loop needs nothing
more: step i+1's mask is filled after step i's token was accepted. A request found finished
one step late (the overlapped loop's discarded token) has a terminated state; its row is
left free and its token not accepted.

A grammar is compiled once per text (the vocabulary's cache) when the request is added
(``prepare``), so a grammar the vocabulary cannot spell is a ``ValueError`` at the door,
never a dead end mid-generation. A request that ends with its grammar ends with ``<eos>``:
the mask allows only the stop tokens once the text is complete.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minisrv.grammar.compile import CompiledGrammar, compile_grammar
from minisrv.grammar.processor import GrammarLogitsProcessor
from minisrv.grammar.state import GrammarState
from minisrv.grammar.vocab import Vocabulary
from minisrv.request import Req
from minisrv.runner.sampler import TokenFollower
from minisrv.sampling import SamplingParams

__all__ = ["GrammarSampling"]


class GrammarSampling(TokenFollower):
    """The grammar masks of one engine, over the vocabulary of the model it serves (a
    ``TokenFollower``: the sampler gives it each step's tokens and each request that ends)."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.vocab = vocab
        self.processor = GrammarLogitsProcessor(vocab.size, skip_terminated=True)
        self.states: dict[Req, GrammarState] = {}

    def prepare(self, params: SamplingParams) -> CompiledGrammar | None:
        """Compile ``params``' grammar (cached); ValueError if it is invalid or unspellable."""
        if params.grammar is None:
            return None
        kind, text = params.grammar
        return compile_grammar(self.vocab, **{kind: text})

    def __call__(self, logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
        """Mask the constrained rows of a step's logits (the free rows are not touched)."""
        states = [self._state(req) for req in reqs]
        if any(state is not None for state in states):
            self.processor(logits, states)
        return logits

    def accept(self, reqs: Sequence[Req], tokens: Sequence[int]) -> None:
        """Advance each constrained request's state by the token it was given."""
        for req, token in zip(reqs, tokens):
            state = self.states.get(req)
            if state is not None and not state.is_terminated:
                state.accept(token)

    def jump(self, reqs: Sequence[Req],
             generators: Sequence[torch.Generator | None]) -> list[list[int]]:
        """Jump-forward: per row, the tokens each constrained request's grammar forces after
        the token it was just given (accepted already), cut to what its ``max_new_tokens``
        leaves; they are accepted into its state here. A sampled request skips one uniform
        draw per forced token, as the masked steps they replace would have drawn
        (``minisrv.grammar.reference``), so its text equals masking alone."""
        out: list[list[int]] = []
        for req, gen in zip(reqs, generators, strict=True):
            state = self.states.get(req)
            room = req.params.max_new_tokens - len(req.output) - 1
            if state is None or state.is_terminated or room <= 0:
                out.append([])
                continue
            forced = state.jump_forward()[:room]
            for _ in forced if gen is not None else ():
                torch.rand((), generator=gen, dtype=torch.float64)  # the skipped draw
            state.accept_all(forced)
            req.jump_forward_tokens += len(forced)
            out.append(forced)
        return out

    def release(self, req: Req) -> None:
        """Forget a finished or aborted request's state."""
        self.states.pop(req, None)

    def _state(self, req: Req) -> GrammarState | None:
        if req.params.grammar is None:
            return None
        state = self.states.get(req)
        if state is None:  # first sampled token: the grammar was compiled when it was added
            grammar = self.prepare(req.params)
            state = self.states[req] = GrammarState(grammar)
        return state
