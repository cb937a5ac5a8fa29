"""The layers of a LLaMA-style decoder: RMSNorm, rotary positions, grouped-query attention,
the SwiGLU MLP, and ``Block``, one layer's step.

RoPE follows the Hugging Face Llama convention (the two halves of each head rotate
together, not interleaved pairs), so a ``LlamaForCausalLM`` checkpoint maps onto these
layers weight for weight (``minisrv.model.hf``).

Each layer runs as few operators as it can, because on a GPU every operator is a kernel
launch the host pays for: q, k and v come out of one matrix product (``qkv_proj``), gate
and up out of another (``gate_up_proj``), and the rotary embedding reads a table built once
per device (``rope_table``). Checkpoints that keep the projections apart (Hugging Face
folders, the shipped CityLM file) are fused when loaded (``UNFUSED_PARTS``). On the CPU
the products themselves go through oneDNN (``Linear``, ``minisrv.model.onednn``), as vLLM's
CPU build does.

``Block.forward`` does not know where keys and values are kept: it hands the new tokens'
q, k, v to an ``attend`` function chosen by the caller. One request's dense cache
(``CityLM.forward``) and a flat batch over a shared KV pool (``CityLM.forward_flat``) are two
such functions around the same layer step, so both compute the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisrv.configs import ModelConfig
from minisrv.model.onednn import Linear

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(q, k, v)`` for one layer: store the new tokens' K/V wherever the caller keeps
them, and return the attention of ``q`` [T, n_heads, head_dim] over every key the tokens may
see, as [T, n_heads * head_dim]."""

LayerAttend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(layer, q, k, v)``: an ``Attend`` for every layer, told which one it serves."""

UNFUSED_PARTS: dict[str, tuple[str, ...]] = {
    "attn.qkv_proj": ("attn.wq", "attn.wk", "attn.wv"),
    "attn.o_proj": ("attn.wo",),
    "mlp.gate_up_proj": ("mlp.w_gate", "mlp.w_up"),
    "mlp.down_proj": ("mlp.w_down",),
}
"""Each weight of a block and the unfused weights it stacks (output rows, in this order),
under the names the shipped CityLM file keeps (``split_fused_weights`` writes them)."""


class RMSNorm(nn.Module):
    """Scale each vector to unit root-mean-square, then by a learned per-channel gain.

    Cheaper than LayerNorm (no mean subtraction, no bias) and what LLaMA uses.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm is x * rsqrt(mean(x^2) + eps) times the gain: the same ATen ops, so the
        # same numbers, as writing them out, in one operator.
        if x.dtype.itemsize < 4:
            return self.low_precision(x)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def low_precision(self, x: torch.Tensor) -> torch.Tensor:
        """bf16/fp16 as HF Llama rounds them: normalised in float32, rounded back to x's
        dtype, then scaled (the gain inside ``F.rms_norm`` would scale before rounding)."""
        normed = F.rms_norm(x.to(torch.float32), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None
) -> torch.Tensor:
    """Rotation speed (radians per position) of each of the ``head_dim / 2`` channel pairs.

    With ``scaling`` of type ``"llama3"`` (LLaMA 3.1's long-context recipe) the slow,
    long-wavelength channels are slowed down by ``factor``, the fast ones are left alone,
    and the ones in between are blended, so short-range behaviour is kept while positions
    far past the original training length stay distinguishable. The table is float32 on
    the CPU; ``rope_table`` turns it into every position's cos and sin on a device.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / theta**exponents
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original_len = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    # 0 for wavelengths longer than original_len / low (fully scaled), 1 for wavelengths
    # shorter than original_len / high (untouched), linear in 1 / wavelength in between.
    blend = ((original_len / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - blend) * inv_freq / factor + blend * inv_freq


def rope_table(
    inv_freq: torch.Tensor, n_positions: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """cos and signed sin of every angle of positions ``0 .. n_positions - 1``:
    [n_positions, 2, 1, head_dim] in ``dtype`` on ``device``.

    Built once per device, so a step selects its tokens' rows with one indexing operator
    instead of computing angles, cos and sin for every step. The angles are float32 (as in
    HF Llama) and computed on ``device``, exactly as a per-step computation would. The sin
    row has its first half negated: HF's ``rotate_half(x) * sin`` is then
    ``x.roll(head_dim // 2) * signed_sin``, one operator fewer (``apply_rope``). The 1 is
    the heads' axis, so rows broadcast over heads as they are. The size is 2 x positions x
    head_dim values: 64 MiB in bf16 for a 131,072-position Llama 3.1 with heads of 128.
    """
    positions = torch.arange(n_positions, device=device).to(torch.float32)
    angles = positions[:, None] * inv_freq.to(device)[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    half = sin.shape[-1] // 2
    sin[:, :half] = -sin[:, :half]
    return torch.stack([cos, sin], dim=1)[:, :, None, :].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of ``x`` [..., T, heads, head_dim] by its token's angles.

    ``cos`` and ``sin`` are [T, 1, head_dim] rows of ``rope_table`` (``sin`` signed). This is
    HF Llama's ``x * cos + rotate_half(x) * sin``, the same numbers in four operators.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` written into ``x`` itself (a view into a projection's output), so the
    rotated keys stay next to their values in that output; returns ``x``."""
    rotated = x.roll(x.shape[-1] // 2, dims=-1).mul_(sin)
    return x.mul_(cos).add_(rotated)


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Scaled dot-product attention where each K/V head serves a group of query heads.

    q: [T, n_heads, head_dim]; k, v: [S, n_kv_heads, head_dim]; mask: [T, S], True where
    query t may attend to key s. Query head h reads K/V head ``h // (n_heads / n_kv_heads)``.
    Returns [T, n_heads * head_dim].
    """
    n_heads, n_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    group = n_heads // n_kv_heads
    k = k.repeat_interleave(group, dim=1)  # [S, n_heads, head_dim]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(head_dim)
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32))
    weights = weights.to(q.dtype)
    out = torch.einsum("hts,shd->thd", weights, v)
    return out.reshape(out.shape[0], n_heads * head_dim)


def causal_mask(n_cached: int, n_new: int, device: torch.device) -> torch.Tensor:
    """[n_new, n_cached + n_new] mask: new token i sees every cached token and new tokens <= i."""
    query_pos = torch.arange(n_cached, n_cached + n_new, device=device)[:, None]
    key_pos = torch.arange(n_cached + n_new, device=device)[None, :]
    return key_pos <= query_pos


def joint_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``k`` and ``v`` [T, n_kv_heads, head_dim] side by side: [T, 2, n_kv_heads, head_dim].

    For the views ``Attention.project_qkv`` returns this is a view of its output (no copy),
    so a KV pool laid out [capacity, 2, n_kv_heads, head_dim] per layer takes a step's new
    keys and values in one write. Other tensors are stacked (a copy). Only shapes, strides
    and addresses are compared: nothing is read from the device.
    """
    row = k.shape[-2] * k.shape[-1]
    adjacent = (
        k.dim() == 3 and k.shape == v.shape and k.stride() == v.stride()
        and k.stride()[1:] == (k.shape[-1], 1) and k.dtype == v.dtype
        and v.storage_offset() == k.storage_offset() + row
        and k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    )
    if not adjacent:
        return torch.stack((k, v), dim=1)
    return k.as_strided((k.shape[0], 2, *k.shape[1:]), (k.stride(0), row, k.shape[-1], 1))


def fused_row_split(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """How many output rows each part of a fused weight of ``config`` has (``UNFUSED_PARTS``
    order): q, k, v for ``attn.qkv_proj``, gate and up for ``mlp.gate_up_proj``."""
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    return {"attn.qkv_proj": (q, kv, kv), "attn.o_proj": (config.d_model,),
            "mlp.gate_up_proj": (config.d_ff, config.d_ff), "mlp.down_proj": (config.d_model,)}


def fuse_weights(state: dict[str, torch.Tensor], prefix: str, scope: str) -> None:
    """Stack, in ``state``, the unfused weights of the module at ``prefix`` (``scope`` its
    name inside a block, ``"attn"`` or ``"mlp"``) into its fused ones, where they are there.

    The load hook of ``Attention`` and ``SwiGLU``: the shipped CityLM file keeps q, k, v
    and gate, up apart, and loads into the fused layers unchanged.
    """
    for fused, parts in UNFUSED_PARTS.items():
        if not fused.startswith(f"{scope}."):
            continue
        names = [prefix + part.removeprefix(f"{scope}.") + ".weight" for part in parts]
        target = prefix + fused.removeprefix(f"{scope}.") + ".weight"
        if target not in state and all(name in state for name in names):
            state[target] = torch.cat([state.pop(name) for name in names])


def split_fused_weights(
    state: Mapping[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """``state`` with every fused weight split back into its ``UNFUSED_PARTS`` (views): the
    layout the shipped CityLM file keeps. Other entries are kept as they are."""
    rows = fused_row_split(config)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        fused = next((f for f in UNFUSED_PARTS if name.endswith(f".{f}.weight")), None)
        if fused is None:
            out[name] = tensor
            continue
        base = name.removesuffix(f"{fused}.weight")
        for part, piece in zip(UNFUSED_PARTS[fused], tensor.split(rows[fused])):
            out[f"{base}{part}.weight"] = piece
    return out


class Attention(nn.Module):
    """Grouped-query attention projections: query heads share ``n_kv_heads`` K/V heads.

    ``qkv_proj`` holds the query, key and value projections stacked (in that order), so
    one matrix product makes all three.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, hd = config.d_model, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, hd
        self.qkv_proj = Linear(d, (config.n_heads + 2 * config.n_kv_heads) * hd)
        self.o_proj = Linear(config.n_heads * hd, d)
        self.register_load_state_dict_pre_hook(
            lambda module, state, prefix, *_: fuse_weights(state, prefix, "attn"))

    def project_qkv(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys (both rotated to their positions) and values for tokens ``h`` [..., T, d].

        Results are [..., T, heads, head_dim] views of one projection: q and k are rotated
        in place there, together, and k, v stay adjacent (``joint_kv``). Leading batch
        dimensions (used in training) share the same positions.
        """
        heads = (self.n_heads, self.n_kv_heads, self.n_kv_heads)
        qkv = self.qkv_proj(h).unflatten(-1, (sum(heads), self.head_dim))
        apply_rope_(qkv[..., : self.n_heads + self.n_kv_heads, :], cos, sin)
        q, k, v = qkv.split(heads, dim=-2)
        return q, k, v


class SwiGLU(nn.Module):
    """The MLP: ``down(silu(gate(x)) * up(x))``, a gated variant of the classic two-layer MLP.

    ``gate_up_proj`` holds gate and up stacked, so one matrix product makes both.
    """

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(d_model, 2 * d_ff)
        self.down_proj = Linear(d_ff, d_model)
        self.register_load_state_dict_pre_hook(
            lambda module, state, prefix, *_: fuse_weights(state, prefix, "mlp"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """One transformer layer: pre-norm attention and pre-norm MLP, each with a skip connection.

    Where the keys and values live is not the layer's business: ``forward`` takes an
    ``attend`` function that stores them and attends (see ``Attend``), so the same layer step
    serves one request's dense cache and a flat batch over a shared KV pool.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.d_ff)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """The residual stream ``x`` [T, d] after this layer; ``cos``, ``sin``: tokens' rows
        of ``rope_table``."""
        q, k, v = self.attn.project_qkv(self.attn_norm(x), cos, sin)
        x = x + self.attn.o_proj(attend(q, k, v))
        return x + self.mlp(self.mlp_norm(x))
