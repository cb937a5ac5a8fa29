"""Matrix products on the CPU through oneDNN, with each weight reordered once.

In float32 on one thread, oneDNN's product (``torch.ops.mkldnn._linear_pointwise``) runs
the serving shapes (tens of rows of width 512) two to three times faster than ``F.linear``
(MKL). Handed a weight already in oneDNN's own blocked layout (``_reorder_linear_weight``),
it skips the reorder it otherwise does inside every call: another 10-40% at 7-64 rows, with
the same numbers. vLLM's CPU build packs its weights the same way. ``Linear`` keeps the
ordinary weight (what training, ``state_dict`` and other devices see) and a packed copy
beside it, made on first use and made again whenever the weight changes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ONEDNN_LINEAR", "ONEDNN_REORDER", "Linear"]


def _onednn_linear() -> Callable[..., torch.Tensor] | None:
    """oneDNN's matrix product (``torch.ops.mkldnn._linear_pointwise``) if this torch has it
    and it computes ``F.linear`` here (checked once on a small product), else ``None``."""
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return None
    cpu = torch.device("cpu")  # explicit: a default device set by the caller must not apply
    x = torch.linspace(-1, 1, 24, device=cpu).reshape(2, 3, 4)
    w = torch.linspace(-2, 2, 20, device=cpu).reshape(5, 4)
    try:
        with torch.inference_mode():
            works = torch.allclose(op(x, w, None, "none", [], ""), F.linear(x, w), atol=1e-5)
    except (RuntimeError, TypeError):  # pragma: no cover - depends on the torch build
        return None
    return op if works else None


def _onednn_reorder() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """oneDNN's weight reorder if this torch has it and a product with a reordered weight
    gives the plain weight's numbers (checked once), else ``None``: then ``Linear`` hands
    oneDNN the plain weight."""
    reorder = getattr(getattr(torch.ops, "mkldnn", None), "_reorder_linear_weight", None)
    if reorder is None or ONEDNN_LINEAR is None:
        return None
    cpu = torch.device("cpu")
    x = torch.linspace(-1, 1, 32, device=cpu).reshape(8, 4)
    w = torch.linspace(-2, 2, 20, device=cpu).reshape(5, 4)
    try:
        with torch.inference_mode():
            packed = ONEDNN_LINEAR(x, reorder(w), None, "none", [], "")
            works = torch.allclose(packed, ONEDNN_LINEAR(x, w, None, "none", [], ""), atol=1e-6)
    except (RuntimeError, TypeError):  # pragma: no cover - depends on the torch build
        return None
    return reorder if works else None


ONEDNN_LINEAR = _onednn_linear()
"""oneDNN's matrix product, or ``None`` where this torch lacks it."""

ONEDNN_REORDER = _onednn_reorder()
"""oneDNN's weight reorder, or ``None`` where this torch lacks it."""


class Linear(nn.Linear):
    """``nn.Linear`` without bias whose inference product on the CPU in float32 is oneDNN's,
    with the weight packed once (``packed``).

    The same product up to rounding (another summation order: a few 1e-6 relative);
    training (gradients on), other devices and dtypes use ``F.linear``.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        # ((the weight's storage address, its version counter), its packed copy)
        self._packed: tuple[tuple[int, int], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn_fits(x):
            return ONEDNN_LINEAR(x, self.packed(), None, "none", [], "")
        return F.linear(x, self.weight)

    def onednn_fits(self, x: torch.Tensor) -> bool:
        """Whether oneDNN takes this product: CPU, float32, no gradient to record."""
        return (ONEDNN_LINEAR is not None and x.device.type == "cpu"
                and x.dtype == torch.float32 and not torch.is_grad_enabled())

    def packed(self) -> torch.Tensor:
        """The weight in oneDNN's blocked layout, packed on first use and again after any
        change to it (an optimizer step or ``load_state_dict`` bumps its version counter;
        ``to`` gives it new storage); the weight itself where no reorder is available or
        its changes cannot be seen (a tensor made under ``inference_mode`` keeps no
        version counter)."""
        weight = self.weight
        if ONEDNN_REORDER is None or weight.is_inference():
            return weight
        key = (weight.data_ptr(), weight._version)
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, ONEDNN_REORDER(weight.detach()))
        return self._packed[1]

    def __getstate__(self) -> dict:
        """The module without its packed copy, which can be neither copied nor saved (an
        opaque oneDNN tensor): a copy packs its own on first use."""
        state = self.__dict__.copy()
        state["_packed"] = None
        return state
