"""Reading xgrammar's packed bitmask: bit j of int32 word w allows token 32 * w + j."""

from __future__ import annotations

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_mask(bitmask_row: torch.Tensor, size: int) -> torch.Tensor:
    """The boolean mask [size] of one packed bitmask row (True = the token is allowed)."""
    row = bitmask_row.to("cpu", torch.int32)
    bits = (row[:, None] >> _SHIFTS) & 1
    return bits.reshape(-1)[:size].bool()


def allowed_ids(bitmask_row: torch.Tensor, size: int) -> list[int]:
    """The ids one packed bitmask row allows, in increasing order."""
    return torch.nonzero(unpack_mask(bitmask_row, size)).flatten().tolist()
