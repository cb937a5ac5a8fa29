"""Speculative decoding: a cheap draft guesses k tokens, the target checks them in one forward.

- ``drafter``: ``Drafter`` (the interface), ``Draft`` (guesses and their q), ``NgramDrafter``
  (prompt lookup);
- ``draft_model``: ``DraftModelDrafter`` (a small CityLM-shaped model with per-request KV
  that it rolls back itself) and ``load_draft`` (the shipped weights);
- ``verify``: ``verify_batch`` (greedy prefix match, or the rejection rule of Leviathan et
  al. / Chen et al. for sampled rows), ``greedy_accept``, ``rejection_accept``;
- ``reference``: ``speculative_generate``, one request alone, the oracle.

What speculation buys on a GPU (expected tokens per check, the roofline speed-up against k
and batch) is the book's analysis: ``minisrv.sim.speedup``.

The draft's weights are trained on the book side: ``python -m minisrv.train --draft``.
"""

from __future__ import annotations

from minisrv.spec.config import CITYDRAFT, DRAFT_META_FILE, DRAFT_WEIGHTS_FILE
from minisrv.spec.draft_model import DraftModelDrafter, load_draft, truncate_dense
from minisrv.spec.drafter import Draft, Drafter, NgramDrafter
from minisrv.spec.reference import SpecResult, speculative_generate
from minisrv.spec.verify import greedy_accept, rejection_accept, sample_probs, verify_batch

__all__ = [
    "CITYDRAFT",
    "DRAFT_META_FILE",
    "DRAFT_WEIGHTS_FILE",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "NgramDrafter",
    "SpecResult",
    "greedy_accept",
    "load_draft",
    "rejection_accept",
    "sample_probs",
    "speculative_generate",
    "truncate_dense",
    "verify_batch",
]
