"""Which attention backend ``attention="auto"`` runs: a table from what the device declares
(its type and compute capability), the model's dtype and its head size, not a probe at start.

Each row says why, from a recorded run where there is one:

* CPU: ``padded``. flex_attention runs unfused there (it builds the whole score matrix), so
  one padded SDPA call per group is as fast and needs no compiler; Triton only interprets.
* CUDA, compute capability 8.0 and up, 16- or 32-bit weights, heads of at least 16:
  ``flex``. The one recorded GPU run (``minisrv/measured/h200_engine_throughput.csv``,
  an H200, SmolLM2-135M's shape in bf16) decoded 2.0x faster with flex than padded at batch
  64 and 0.89x at batch 256 (geometric mean 1.35x), a provisional choice; its step sweep
  favoured padded at large batches, where the compiled flex kernel walks one query tile's
  key tiles one after another (the GPU appendix reads that from the record). With
  ``cuda_graph=True`` those decode-only steps take the padded call anyway (flex has no graph
  hooks, so ``ModelRunner`` decodes through the padded backend's buffers), and the row decides
  the steps with prefills. The Triton backend has not been measured on a GPU, so it is chosen
  nowhere until a recorded run puts it ahead (``tests/test_choice.py`` checks this row against
  the recorded runs).
* CUDA below 8.0 (Colab's T4 is 7.5, float16 only): ``padded``. PyTorch tunes
  flex_attention's Triton kernel only from 8.0 on (below it ``get_flex_attn_fwd_configs``,
  ``torch/_inductor/template_heuristics/triton.py``, falls back to one generic tile shape),
  and no run has timed flex there; the padded call runs on every GPU.
* Anything else (float64, heads under 16, another device): ``padded``.

``choose_attention`` is the table; ``auto_attention`` reads the device's capability and
logs the choice once per distinct (device, capability, dtype, head dim). The table names
backends by their registry names (each backend class's ``kind``), and what flex needs of
dtype and head size is ``minisrv.model.ragged``'s (``flex_compiles``), so neither is
spelled twice.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from minisrv.model.ragged import FLEX_DTYPES, FLEX_MIN_HEAD_DIM
from minisrv.runner.attention.flex import FlexAttention
from minisrv.runner.attention.padded import PaddedAttention

__all__ = ["AttentionChoice", "auto_attention", "choose_attention"]

log = logging.getLogger(__name__)

FLEX_MIN_CAPABILITY = (8, 0)
"""The oldest compute capability PyTorch tunes flex_attention's Triton kernel for (Ampere)."""

FLEX, PADDED = FlexAttention.kind, PaddedAttention.kind


class AttentionChoice(NamedTuple):
    """A backend and the reason the table gives for it."""

    backend: str
    why: str


def choose_attention(device_type: str, capability: tuple[int, int] | None,
                     dtype: torch.dtype, head_dim: int) -> AttentionChoice:
    """The table: the backend for a device of ``device_type`` ("cpu", "cuda", ...) with
    compute ``capability`` (CUDA only; None elsewhere), weights of ``dtype`` and heads of
    ``head_dim``."""
    if device_type != "cuda":
        return AttentionChoice(PADDED, f"{device_type}: padded SDPA (flex runs unfused "
                                         f"off a GPU)")
    if capability is None:
        raise ValueError("a CUDA device's choice needs its compute capability")
    cc = f"compute capability {capability[0]}.{capability[1]}"
    if tuple(capability) < FLEX_MIN_CAPABILITY:
        return AttentionChoice(PADDED, f"{cc}: below 8.0 flex_attention's kernel is untuned "
                                         f"and untimed; padded runs everywhere")
    if dtype not in FLEX_DTYPES or head_dim < FLEX_MIN_HEAD_DIM:
        return AttentionChoice(PADDED, f"{cc}: the compiled flex kernel takes 16/32-bit "
                                         f"heads of >= 16, not {dtype} x {head_dim}")
    return AttentionChoice(FLEX, f"{cc}: flex, fastest in the recorded H200 engine run "
                                   f"(Triton not yet measured on a GPU)")


_logged: set[tuple[str, tuple[int, int] | None, torch.dtype, int]] = set()


def auto_attention(device: str | torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """``choose_attention`` for ``device`` (its capability read from CUDA, which every CUDA
    device declares), logged the first time each distinct choice is made."""
    device = torch.device(device)
    capability = (tuple(torch.cuda.get_device_capability(device))
                  if device.type == "cuda" else None)
    choice = choose_attention(device.type, capability, dtype, head_dim)
    key = (device.type, capability, dtype, head_dim)
    if key not in _logged:
        _logged.add(key)
        log.info("attention='auto' -> %s (%s)", choice.backend, choice.why)
    return choice.backend
