"""Which attention backend ``attention="auto"`` runs: a table from what the device declares
(its type and compute capability), the model's dtype and its head size, not a probe at start.

Each row says why, from a recorded run where there is one:

* CPU: ``padded``. flex_attention runs unfused there (it builds the whole score matrix), so
  one padded SDPA call per group is as fast and needs no compiler; Triton only interprets.
* CUDA, compute capability 8.0 and up, 16- or 32-bit weights, heads of at least 16:
  ``hybrid``: decodes through the padded call, prefills through flex's ragged call, a mixed
  step split between the two (``hybrid.py``). The one recorded GPU run is of an H200,
  SmolLM2-135M's shape in bf16, of an earlier eager step. Its decode step sweep
  (``minisrv/measured/h200_decode_steps.csv``, the forward alone at context 512) timed the
  ragged call at 1.5x the padded one's time (geometric mean over batches 1-256; 2.6x at 64,
  5.4x at 256, faster only at 2-16), where the compiled kernel walks one query tile's key
  tiles one after another: the decode half follows it. Its engine run
  (``h200_engine_throughput.csv``) timed decode steps too, and put flex ahead only at batch
  64, where the padded engine spent 44 ms a step outside its forward that the run does not
  account for. No run has timed a step with prefills: prefills take the ragged call because
  it pads nothing, where the padded call pads each request to the step's longest. No run has
  timed the hybrid itself; ``benchmarks/bench_gpu.py`` does. With ``cuda_graph=True`` the
  decode steps run the padded backend's static buffers whatever the backend. The Triton
  backend has not been measured on a GPU, so it is chosen nowhere until a recorded run puts
  it ahead (``tests/test_choice.py`` holds the row to the recorded runs).
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
from minisrv.runner.attention.hybrid import HybridAttention
from minisrv.runner.attention.padded import PaddedAttention

__all__ = ["AttentionChoice", "auto_attention", "choose_attention"]

log = logging.getLogger(__name__)

FLEX_MIN_CAPABILITY = (8, 0)
"""The oldest compute capability PyTorch tunes flex_attention's Triton kernel for (Ampere)."""

FLEX, HYBRID, PADDED = FlexAttention.kind, HybridAttention.kind, PaddedAttention.kind


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
    return AttentionChoice(HYBRID, f"{cc}: hybrid, decodes padded (the recorded step "
                                     f"sweep), prefills flex (it pads nothing); Triton not "
                                     f"yet measured on a GPU")


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
