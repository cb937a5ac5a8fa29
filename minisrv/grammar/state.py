"""One request's position in its grammar: the mask of its next token, and how it advances."""

from __future__ import annotations

import torch
import xgrammar as xgr

from minisrv.grammar.bits import unpack_mask
from minisrv.grammar.compile import CompiledGrammar


class GrammarState:
    """A request's matcher: create it when the request is admitted, ``fill`` its mask row
    before each step samples it, ``accept`` the token sampled, stop when ``is_terminated``.

    The stop token (eos) is allowed exactly when the grammar is complete, and accepting it
    terminates the state: a finished grammar finishes its request through the ordinary eos
    path. If the model ever reaches a prefix the vocabulary cannot complete (see
    ``spelling``), the mask would be empty; the state then allows the stop tokens only and
    sets ``dead_end``, so the request ends instead of sampling from nothing.
    """

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self.vocab = grammar.vocab
        self.matcher = xgr.GrammarMatcher(grammar.compiled)
        self.dead_end = False
        self._dead_stop = False  # a stop token accepted after a dead end
        self.accepted: list[int] = []  # every token accepted, jump-forward ones included

    def fill(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the next token's mask into ``bitmask[row]`` (an xgrammar CPU bitmask)."""
        if self.is_terminated:
            raise ValueError("the grammar has terminated: it has no next token")
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def mark_dead_end(self, bitmask: torch.Tensor, row: int) -> None:
        """Allow only the stop tokens in ``bitmask[row]``, whose mask was empty."""
        self.dead_end = True
        for stop in self.vocab.stop_ids:
            bitmask[row, stop // 32] |= _bit(stop % 32)

    def allowed_mask(self) -> torch.Tensor:
        """The boolean mask [vocab size] of the next token (True = allowed)."""
        bitmask = xgr.allocate_token_bitmask(1, self.vocab.size)
        self.fill(bitmask)
        if not bitmask.any():
            self.mark_dead_end(bitmask, 0)
        return unpack_mask(bitmask[0], self.vocab.size)

    def accept(self, token: int) -> None:
        """Advance on ``token``; a token the mask forbade is a ``ValueError``, state intact."""
        token = int(token)
        if self.dead_end and token in self.vocab.stop_ids:
            self._dead_stop = True
        elif not self.matcher.accept_token(token):
            raise ValueError(f"token {token} is not allowed by the {self.grammar.kind} here")
        self.accepted.append(token)

    def accept_all(self, tokens: list[int]) -> None:
        """``accept`` each token in turn (jump-forward tokens, or a speculative run)."""
        for token in tokens:
            self.accept(token)

    @property
    def is_terminated(self) -> bool:
        """True once the stop token was accepted: the request is finished."""
        return self.matcher.is_terminated() or self._dead_stop

    @property
    def is_completed(self) -> bool:
        """True when the text so far is a complete match (the stop token is allowed next)."""
        return self.matcher.is_completed()

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (rejected speculative tokens)."""
        if not 0 <= n <= len(self.accepted):
            raise ValueError(f"cannot roll back {n} tokens, {len(self.accepted)} accepted")
        if n == 0:
            return
        undone = self.accepted[-n:]
        if self._dead_stop and undone[-1] in self.vocab.stop_ids:
            self._dead_stop = False
            n -= 1
        if n:
            self.matcher.rollback(n)
        del self.accepted[-len(undone):]

    def jump_forward(self) -> list[int]:
        """The tokens the grammar fixes next, to append without decoding (not yet accepted).

        For CityLM each character is one token; for a BPE vocabulary xgrammar picks the
        longest tokens covering the forced text (possibly not the tokenizer's own split).
        """
        if self.is_terminated:
            return []
        return self.matcher.find_jump_forward_tokens()

    def jump_forward_text(self) -> str:
        """The text the grammar fixes next (``find_jump_forward_string``)."""
        return "" if self.is_terminated else self.matcher.find_jump_forward_string()

    def __repr__(self) -> str:
        return f"GrammarState({self.grammar!r}, accepted={len(self.accepted)})"


def _bit(j: int) -> int:
    """Bit ``j`` of an int32 word as a Python int the int32 tensor stores (bit 31 negative)."""
    return -(1 << 31) if j == 31 else 1 << j
