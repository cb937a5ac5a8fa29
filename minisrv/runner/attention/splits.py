"""How many pieces the split-KV decode kernel cuts each request's context into.

Kept apart from ``triton_ops`` (which imports triton) so that a page can count the kernel's
programs where triton is absent: a CPU-only torch, as the Colab check installs, has none.
"""

from __future__ import annotations

import torch

__all__ = ["DECODE_BLOCK_N", "DEFAULT_MAX_SPLITS", "SPLIT_TOKENS", "kv_splits"]

DEFAULT_MAX_SPLITS = 8
"""The most pieces a decode's context is cut into (SGLang's default ``max_kv_splits``)."""

SPLIT_TOKENS = 256
"""Context tokens per decode piece before another piece is worth its merge: a context of
up to 256 tokens is one piece, 2,048 tokens are eight."""

DECODE_BLOCK_N = 32
"""Keys a decode piece loads per inner step (SGLang's grouped kernel): a piece's length is
rounded up to a multiple of it."""


def kv_splits(contexts: torch.Tensor, max_splits: int = DEFAULT_MAX_SPLITS) -> torch.Tensor:
    """Pieces per decode request: one per ``SPLIT_TOKENS`` of context, 1..``max_splits``."""
    return torch.clamp((contexts + SPLIT_TOKENS - 1) // SPLIT_TOKENS, 1, max_splits).to(
        torch.int32)
