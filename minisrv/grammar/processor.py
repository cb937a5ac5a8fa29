"""Masking a whole step's logits for every constrained row, in one batched operation."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from minisrv.grammar.state import GrammarState


class GrammarLogitsProcessor:
    """The runner's logits-processor hook for structured output.

    ``processor(logits, states)`` takes the step's logits [rows, vocab] and one entry per
    row: the row's ``GrammarState``, or ``None`` for a free (unconstrained) row. It fills one
    CPU bitmask for the batch (xgrammar's batched fill), copies it to the logits' device once,
    and sets every forbidden logit of the constrained rows to -inf in one
    ``apply_token_bitmask_inplace``; free rows are not touched at all. The bitmask buffer is
    kept between steps and grown when a batch is larger.

    A terminated state (its request already ended) is a ``ValueError``, unless
    ``skip_terminated``: then its row is left free. The overlapped loop needs that, since its
    stop check is one step late and a finished request may sit in the next step, whose token
    is discarded anyway.
    """

    def __init__(self, vocab_size: int, threads: int = 1, skip_terminated: bool = False) -> None:
        self.vocab_size = vocab_size
        self.skip_terminated = skip_terminated
        self.threads = threads  # the fill's CPU threads (xgrammar's own default: half the cores)
        self.batch = xgr.BatchGrammarMatcher(threads)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.dead_ends = 0  # rows that met an empty mask (see GrammarState.mark_dead_end)

    def fill(self, states: Sequence[GrammarState | None]) -> tuple[torch.Tensor, list[int]]:
        """The CPU bitmask [rows, words] for ``states`` and the constrained rows' indices.

        Only the listed rows are filled; the others hold whatever an earlier step left (the
        buffer is reused), which is why the apply passes ``indices``.
        """
        rows = [i for i, s in enumerate(states)
                if s is not None and not (self.skip_terminated and s.is_terminated)]
        if self._bitmask.shape[0] < len(states):
            self._bitmask = xgr.allocate_token_bitmask(len(states), self.vocab_size)
        bitmask = self._bitmask[: len(states)]
        if rows:
            for i in rows:
                if states[i].is_terminated:
                    raise ValueError(f"row {i}'s grammar has terminated: drop it from the batch")
            matchers = [states[i].matcher for i in rows]
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
            empty = ~bitmask[rows].any(dim=1)
            if bool(empty.any()):
                for k in torch.nonzero(empty).flatten().tolist():
                    states[rows[k]].mark_dead_end(bitmask, rows[k])
                    self.dead_ends += 1
        return bitmask, rows

    def __call__(self, logits: torch.Tensor,
                 states: Sequence[GrammarState | None]) -> torch.Tensor:
        """Mask ``logits`` in place (and return it) for the constrained rows of ``states``."""
        self._check(logits, states)
        bitmask, rows = self.fill(states)  # on the CPU, one bit per token and row
        if rows:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                            vocab_size=self.vocab_size, indices=rows,
                                            backend=_kernel(logits))
        return logits

    def _check(self, logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be [rows, vocab] with one state per row, got "
                             f"{tuple(logits.shape)} and {len(states)} states")
        if logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, the grammar vocabulary "
                             f"{self.vocab_size}")


def _kernel(logits: torch.Tensor) -> str:
    """XGrammar's apply kernel for ``logits``: its own choice for the device ("auto": C++ on a
    CPU, Triton on a GPU), except for float64 logits (the tests' float64 CityLM), which the C++
    kernel refuses (float32 and 16-bit floats only); they go to its plain-torch kernel."""
    return "torch_native" if logits.dtype == torch.float64 else "auto"
