"""The layers of a LLaMA-style decoder: RMSNorm, rotary positions, grouped-query attention,
the SwiGLU MLP, and ``Block``, one layer's step.

RoPE follows the Hugging Face Llama convention (``rotate_half`` on the two halves of each
head, not interleaved pairs), so a ``LlamaForCausalLM`` checkpoint maps onto these layers
weight for weight (``minisrv.model.hf``).

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

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(q, k, v)`` for one layer: store the new tokens' K/V wherever the caller keeps
them, and return the attention of ``q`` [T, n_heads, head_dim] over every key the tokens may
see, as [T, n_heads * head_dim]."""

LayerAttend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(layer, q, k, v)``: an ``Attend`` for every layer, told which one it serves."""


class RMSNorm(nn.Module):
    """Scale each vector to unit root-mean-square, then by a learned per-channel gain.

    Cheaper than LayerNorm (no mean subtraction, no bias) and what LLaMA uses.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Low-precision inputs (bf16/fp16) are normalised in float32, as HF Llama does.
        # F.rms_norm is x * rsqrt(mean(x^2) + eps): the same ATen ops, so the same numbers, as
        # x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps), in one call from Python.
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * F.rms_norm(xf, xf.shape[-1:], eps=self.eps).to(x.dtype)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None
) -> torch.Tensor:
    """Rotation speed (radians per position) of each of the ``head_dim / 2`` channel pairs.

    With ``scaling`` of type ``"llama3"`` (LLaMA 3.1's long-context recipe) the slow,
    long-wavelength channels are slowed down by ``factor``, the fast ones are left alone,
    and the ones in between are blended, so short-range behaviour is kept while positions
    far past the original training length stay distinguishable. The table is float32 on
    the CPU; ``CityLM.rope_cos_sin`` copies it once to each device it runs on.
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension (HF Llama's convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of ``x`` [..., T, heads, head_dim] by its token's angles.

    ``cos`` and ``sin`` are [T, head_dim], one row per position (see ``CityLM.rope_cos_sin``).
    """
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


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


class Attention(nn.Module):
    """Grouped-query attention projections: query heads share ``n_kv_heads`` K/V heads."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, hd = config.d_model, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, hd
        self.wq = nn.Linear(d, config.n_heads * hd, bias=False)
        self.wk = nn.Linear(d, config.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, config.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(config.n_heads * hd, d, bias=False)

    def project_qkv(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys (both rotated to their positions) and values for tokens ``h`` [..., T, d].

        Results are [..., T, heads, head_dim]; leading batch dimensions (used in training)
        share the same positions.
        """
        lead = h.shape[:-1]
        q = self.wq(h).view(*lead, self.n_heads, self.head_dim)
        k = self.wk(h).view(*lead, self.n_kv_heads, self.head_dim)
        v = self.wv(h).view(*lead, self.n_kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class SwiGLU(nn.Module):
    """The MLP: ``down(silu(gate(x)) * up(x))``, a gated variant of the classic two-layer MLP."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


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
        """The residual stream ``x`` [T, d] after this layer; ``cos``, ``sin``: tokens' angles."""
        q, k, v = self.attn.project_qkv(self.attn_norm(x), cos, sin)
        x = x + self.attn.wo(attend(q, k, v))
        return x + self.mlp(self.mlp_norm(x))
