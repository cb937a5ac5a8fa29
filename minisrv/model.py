"""CityLM: a small LLaMA-style decoder, written plainly, and the one-request reference decoder.

The architecture is LLaMA's: token embedding, then ``n_layers`` blocks of
(RMSNorm -> grouped-query attention with rotary positions -> residual;
RMSNorm -> SwiGLU MLP -> residual), a final RMSNorm and an LM head. RoPE follows the
Hugging Face Llama convention (``rotate_half`` on the two halves of each head, not
interleaved pairs), so a ``LlamaForCausalLM`` checkpoint maps onto ``CityLM`` weight for
weight (``from_hf_llama``).

``CityLM.forward`` processes new tokens of ONE request against that request's
``DenseKVCache``. The pieces it is made of (``project_qkv``, ``grouped_attention``,
``rope_cos_sin`` ...) are public so that the serving engine can run the same layers over a
flat batch of many requests with its own KV layout, and get the same numbers:
``CityLM.forward_flat`` is that forward (selective batching over a shared ``KVPool``).

``reference_generate`` decodes one request alone. It is the correctness oracle of the book:
every batched, cached, retracted or overlapped run is compared with it token by token.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from minisrv.configs import CITYLM, ModelConfig
from minisrv.sampling import SamplingParams, make_generator, sample_next
from minisrv.tokenizer import EOS_ID, Tokenizer

if TYPE_CHECKING:
    from minisrv.kvpool import KVPool

WEIGHTS_FILE = "citylm.safetensors"
META_FILE = "citylm.json"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a ``torch.device``; ``None`` means CUDA when available, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# ----------------------------------------------------------------------------- KV cache


class DenseKVCache:
    """The keys and values of one request, one growing tensor per layer.

    This is the plainest possible layout: each ``update`` concatenates the new tokens'
    K/V to what is stored. Every append copies the whole history, and memory is reserved
    per request rather than pooled; the later chapters replace it with a token-slot pool.
    Keys are stored after RoPE, so they never need recomputing.
    """

    def __init__(self, n_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers

    def __len__(self) -> int:
        """Tokens stored (the number of positions already processed)."""
        first = self.keys[0]
        return 0 if first is None else first.shape[0]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``/``v`` ([T, n_kv_heads, head_dim]) to ``layer``; return all K/V stored."""
        old_k, old_v = self.keys[layer], self.values[layer]
        self.keys[layer] = k if old_k is None else torch.cat([old_k, k], dim=0)
        self.values[layer] = v if old_v is None else torch.cat([old_v, v], dim=0)
        return self.keys[layer], self.values[layer]

    @property
    def nbytes(self) -> int:
        """Bytes held by the stored K and V tensors."""
        tensors = [t for t in (*self.keys, *self.values) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def __repr__(self) -> str:
        return f"DenseKVCache(tokens={len(self)}, layers={len(self.keys)})"


# ----------------------------------------------------------------------------- layers


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
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rms_inv = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * (xf * rms_inv).to(x.dtype)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None
) -> torch.Tensor:
    """Rotation speed (radians per position) of each of the ``head_dim / 2`` channel pairs.

    With ``scaling`` of type ``"llama3"`` (LLaMA 3.1's long-context recipe) the slow,
    long-wavelength channels are slowed down by ``factor``, the fast ones are left alone,
    and the ones in between are blended, so short-range behaviour is kept while positions
    far past the original training length stay distinguishable.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
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
    """One transformer layer's weights: pre-norm attention and pre-norm MLP.

    Its forward pass is spelled out in ``CityLM.forward`` instead, because the attention
    step needs the request's KV cache between the projections and the output.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.d_ff)


# ----------------------------------------------------------------------------- flat batch

ATTENTION_KINDS: tuple[str, ...] = ("loop", "padded")
"""How ``CityLM.forward_flat`` attends: one call per request, or one padded call for all."""


class FlatBatch:
    """The new tokens of many requests laid end to end, with where their KV lives.

    ``new_ids[r]`` are request r's tokens to compute this step (a whole prompt for a prefill,
    one token for a decode, anything in between for a chunk). ``slots[r]`` lists ALL of
    request r's KV slots in position order: the first ``len(slots[r]) - len(new_ids[r])``
    already hold its prefix, the last ``len(new_ids[r])`` receive the new tokens' K/V. So a
    token's position is its index in ``slots[r]``, which is what RoPE needs.

    Everything the forward needs (flat ids, positions, write slots, and the index tensors of
    the padded attention) is computed here once per step and shared by all layers.
    """

    def __init__(
        self,
        new_ids: Sequence[Sequence[int]],
        slots: Sequence[Sequence[int]],
        device: str | torch.device = "cpu",
    ) -> None:
        if len(new_ids) != len(slots):
            raise ValueError(f"{len(new_ids)} requests' ids but {len(slots)} slot lists")
        if not new_ids:
            raise ValueError("a flat batch needs at least one request")
        self.device = torch.device(device)
        self.new_lens: list[int] = []
        self.cached_lens: list[int] = []
        write: list[int] = []
        positions: list[int] = []
        for r, (ids, req_slots) in enumerate(zip(new_ids, slots)):
            n_new, n_all = len(ids), len(req_slots)
            if n_new == 0:
                raise ValueError(f"request {r} of the batch has no new tokens")
            if n_all < n_new:
                raise ValueError(f"request {r}: {n_new} new tokens but only {n_all} slots")
            self.new_lens.append(n_new)
            self.cached_lens.append(n_all - n_new)
            write.extend(req_slots[n_all - n_new :])
            positions.extend(range(n_all - n_new, n_all))
        if len(set(write)) != len(write):
            raise ValueError("two new tokens of the batch are written to the same KV slot")
        self.max_slot = max(max(s) for s in slots)  # checked against the pool by the forward
        if min(min(s) for s in slots) < 0:
            raise ValueError("KV slot indices must be >= 0")
        flat_ids = [int(t) for ids in new_ids for t in ids]
        self.ids = torch.tensor(flat_ids, dtype=torch.long, device=self.device)
        self.positions = torch.tensor(positions, dtype=torch.long, device=self.device)
        self.write_slots = torch.tensor(write, dtype=torch.long, device=self.device)
        self.slots = [torch.tensor(list(s), dtype=torch.long, device=self.device) for s in slots]
        ends = list(itertools.accumulate(self.new_lens))
        self.starts = [end - n for end, n in zip(ends, self.new_lens)]
        self.last_rows = torch.tensor([end - 1 for end in ends], device=self.device)
        self._padded: tuple[torch.Tensor, ...] | None = None

    def __len__(self) -> int:
        """Requests in the batch."""
        return len(self.new_lens)

    @property
    def num_tokens(self) -> int:
        """New tokens in all (the rows of the flat matrix)."""
        return int(self.ids.shape[0])

    def padded_index(self) -> tuple[torch.Tensor, ...]:
        """Index tensors of the padded attention, built on first use.

        Returns ``(row_b, row_t, key_slots, mask)``: flat token i sits at row ``row_t[i]`` of
        request ``row_b[i]``'s padded block; ``key_slots`` [B, S_max] are every request's
        slots padded with slot 0; ``mask`` [B, 1, T_max, S_max] lets query t of request b
        see keys at positions <= its own. Padding rows see the request's last real position
        (never an empty row, so softmax gives no NaN); their outputs are dropped.
        """
        if self._padded is None:
            dev = self.device
            n_b = len(self.new_lens)
            t_max = max(self.new_lens)
            s_max = max(len(s) for s in self.slots)
            row_b = torch.repeat_interleave(
                torch.arange(n_b, device=dev), torch.tensor(self.new_lens, device=dev)
            )
            row_t = torch.cat([torch.arange(n, device=dev) for n in self.new_lens])
            key_slots = torch.zeros(n_b, s_max, dtype=torch.long, device=dev)
            for b, s in enumerate(self.slots):
                key_slots[b, : s.shape[0]] = s
            cached = torch.tensor(self.cached_lens, device=dev)[:, None]
            last = torch.tensor(self.new_lens, device=dev)[:, None] - 1
            t = torch.arange(t_max, device=dev)[None, :]
            query_pos = cached + torch.minimum(t, last)  # [B, T_max]
            key_pos = torch.arange(s_max, device=dev)
            mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, T_max, S_max]
            self._padded = (row_b, row_t, key_slots, mask[:, None])
        return self._padded

    def __repr__(self) -> str:
        return f"FlatBatch(requests={len(self)}, tokens={self.num_tokens})"


def flat_attention_loop(
    q: torch.Tensor, batch: FlatBatch, k_layer: torch.Tensor, v_layer: torch.Tensor
) -> torch.Tensor:
    """Attention of a flat batch, one request at a time: the plain, obviously right version.

    ``q`` [T, n_heads, head_dim]; ``k_layer``/``v_layer`` [capacity, n_kv_heads, head_dim]
    are one layer of the pool, already holding this step's new K/V. Request r's queries see
    its own slots only: all of its prefix, and its new tokens causally. Returns
    [T, n_heads * head_dim]. Costs one small attention call per request per layer.
    """
    outs = []
    for start, n_new, n_cached, slots in zip(
        batch.starts, batch.new_lens, batch.cached_lens, batch.slots
    ):
        mask = causal_mask(n_cached, n_new, q.device)
        outs.append(
            grouped_attention(q[start : start + n_new], k_layer[slots], v_layer[slots], mask)
        )
    return torch.cat(outs, dim=0)


def flat_attention_padded(
    q: torch.Tensor, batch: FlatBatch, k_layer: torch.Tensor, v_layer: torch.Tensor
) -> torch.Tensor:
    """The same attention as ``flat_attention_loop`` in ONE call for the whole batch.

    Requests are padded to the longest new-token run (T_max) and the longest context
    (S_max) and a boolean mask hides what each query must not see; PyTorch's
    ``scaled_dot_product_attention`` then runs once per layer whatever the batch size. The
    price is wasted work on padding when lengths differ a lot (a long prefill beside many
    decodes); ragged kernels (FlashInfer, ``flex_attention``) avoid it on a GPU.
    """
    row_b, row_t, key_slots, mask = batch.padded_index()
    n_b, t_max = key_slots.shape[0], mask.shape[2]
    n_heads, head_dim = q.shape[1], q.shape[2]
    group = n_heads // k_layer.shape[1]
    q_pad = q.new_zeros(n_b, t_max, n_heads, head_dim)
    q_pad[row_b, row_t] = q
    k = k_layer[key_slots].repeat_interleave(group, dim=2)  # [B, S_max, n_heads, head_dim]
    v = v_layer[key_slots].repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    )  # [B, n_heads, T_max, head_dim]
    out = out.transpose(1, 2)[row_b, row_t]  # [T, n_heads, head_dim]
    return out.reshape(out.shape[0], n_heads * head_dim)


# ----------------------------------------------------------------------------- model


class CityLM(nn.Module):
    """A LLaMA-style decoder-only language model (CityLM, or any small Llama checkpoint).

    ``rope_scaling`` is ``None`` or a dict of HF's ``"llama3"`` RoPE parameters; it is kept
    beside the config because ``ModelConfig`` describes shapes, not position encodings.
    ``eos_id`` is the token that ends a generation (``None``: none does); CityLM's is the
    tokenizer's ``<eos>``.
    """

    def __init__(
        self,
        config: ModelConfig = CITYLM,
        rope_scaling: Mapping[str, Any] | None = None,
        eos_id: int | None = EOS_ID,
    ) -> None:
        super().__init__()
        for field in ("vocab_size", "d_ff", "max_seq_len"):
            if getattr(config, field) < 1:
                raise ValueError(f"{config.name}: {field} must be >= 1 to build a model")
        if config.head_dim % 2:
            raise ValueError(
                f"{config.name}: head_dim must be even for RoPE, got {config.head_dim}"
            )
        self.config = config
        self.rope_scaling = dict(rope_scaling) if rope_scaling is not None else None
        self.eos_id = eos_id
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # Not a buffer: module.to(dtype) would round it to the weights' dtype, and RoPE
        # angles must stay float32 (as in HF Llama) even for a bf16 model.
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, self.rope_scaling)
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init: normal(0, std) for matrices, ones for norm gains.

        Output projections (``wo``, ``w_down``) are scaled by 1/sqrt(2 * n_layers) so the
        residual stream does not grow with depth (GPT-2's recipe).
        """
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            elif name.endswith(("wo.weight", "w_down.weight")):
                nn.init.normal_(param, 0.0, out_std)
            else:
                nn.init.normal_(param, 0.0, std)

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' floating-point type (float32 unless converted)."""
        return self.embed.weight.dtype

    def new_cache(self) -> DenseKVCache:
        """An empty KV cache for one request."""
        return DenseKVCache(self.config.n_layers)

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every rotation angle for ``positions`` [T]: two [T, head_dim] tensors."""
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:  # first use on this device: copy the float32 table there once
            inv_freq = self._inv_freq_on[positions.device] = self.inv_freq.to(positions.device)
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def check_ids(self, ids: torch.Tensor) -> None:
        """Raise ValueError unless ``ids`` is a non-empty 1-D tensor of in-vocabulary ids."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"ids must be a 1-D tensor of token ids, got {shape}")
        if ids.numel() == 0:
            raise ValueError("ids is empty: forward needs at least one new token")
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids must be an integer tensor, got dtype {ids.dtype}")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.config.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(
                f"token id {bad} is outside the vocabulary (0..{self.config.vocab_size - 1})"
            )

    def forward(self, ids: torch.Tensor, cache: DenseKVCache | None = None) -> torch.Tensor:
        """Logits [T, vocab] for ``ids`` [T], the next tokens of one request.

        The new tokens take positions ``len(cache) .. len(cache) + T - 1`` and attend
        causally to everything cached plus each other; their K/V are appended to
        ``cache`` when one is given. Prefill is one call with the whole prompt, each decode
        step one call with a single token. Errors are raised before the cache is touched.
        """
        self.check_ids(ids)
        n_cached, n_new = (len(cache) if cache is not None else 0), ids.shape[0]
        if n_cached + n_new > self.config.max_seq_len:
            raise ValueError(
                f"sequence too long: {n_cached} cached + {n_new} new tokens exceeds "
                f"max_seq_len={self.config.max_seq_len}"
            )
        ids = ids.to(self.device)
        positions = torch.arange(n_cached, n_cached + n_new, device=self.device)
        cos, sin = self.rope_cos_sin(positions)
        mask = causal_mask(n_cached, n_new, self.device)
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.attn.project_qkv(layer.attn_norm(x), cos, sin)
            if cache is not None:
                k, v = cache.update(i, k, v)
            x = x + layer.attn.wo(grouped_attention(q, k, v, mask))
            x = x + layer.mlp(layer.mlp_norm(x))
        return self.lm_head(self.norm(x))

    @torch.inference_mode()
    def forward_flat(
        self,
        batch: FlatBatch,
        pool: KVPool,
        *,
        attention: str = "padded",
        last_only: bool = False,
    ) -> torch.Tensor:
        """Selective batching (ORCA): one forward over the new tokens of many requests.

        All new tokens form one [T_total, d] matrix, so embeddings, norms, projections, the
        MLP and the LM head each run once for the whole step. Only attention is per request:
        each token is rotated by its own position, its K/V are written to its request's
        slot in ``pool``, and it attends to its own request's slots (``attention="loop"``:
        one call per request; ``"padded"``: one masked call for all). Returns logits
        [T_total, vocab], or [requests, vocab] for each request's last token with
        ``last_only`` (all a decoder needs). Checks run before the pool is written.
        """
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention {attention!r}; choose from {ATTENTION_KINDS}")
        cfg = self.config
        want = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
        have = (pool.k.shape[0], pool.k.shape[2], pool.k.shape[3])
        if have != want:
            raise ValueError(f"pool shaped for (layers, kv_heads, head_dim)={have}, model {want}")
        if pool.k.dtype != self.dtype or pool.k.device != self.device:
            raise ValueError(
                f"pool is {pool.k.dtype} on {pool.k.device}, model {self.dtype} on {self.device}"
            )
        if batch.max_slot >= pool.capacity:
            raise ValueError(f"slot {batch.max_slot} is outside the pool (0..{pool.capacity - 1})")
        longest = max(c + n for c, n in zip(batch.cached_lens, batch.new_lens))
        if longest > cfg.max_seq_len:
            raise ValueError(f"a request reaches {longest} tokens, max_seq_len={cfg.max_seq_len}")
        ids = batch.ids.to(self.device)
        self.check_ids(ids)
        attend = flat_attention_loop if attention == "loop" else flat_attention_padded
        positions, write = batch.positions.to(self.device), batch.write_slots.to(self.device)
        cos, sin = self.rope_cos_sin(positions)
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.attn.project_qkv(layer.attn_norm(x), cos, sin)
            pool.k[i, write] = k
            pool.v[i, write] = v
            x = x + layer.attn.wo(attend(q, batch, pool.k[i], pool.v[i]))
            x = x + layer.mlp(layer.mlp_norm(x))
        if last_only:
            x = x[batch.last_rows.to(self.device)]
        return self.lm_head(self.norm(x))

    @torch.inference_mode()
    def reference_generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
    ) -> list[int]:
        """Generate for ONE request, alone: the oracle every serving strategy must match.

        Prefill the prompt, then feed back one token at a time through a private KV cache.
        Returns the generated ids only. A generated ``<eos>`` is included as the last id and
        ends generation, unless ``ignore_eos``. Sampling goes through ``sample_next`` with
        the request's own generator, exactly as the batched engine does.
        """
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            ignore_eos=ignore_eos,
        )
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("prompt_ids is empty: encode at least <bos>")
        if len(prompt) + max_new_tokens > self.config.max_seq_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"max_seq_len={self.config.max_seq_len}"
            )
        generator = make_generator(params)
        cache = self.new_cache()
        logits = self(torch.tensor(prompt, dtype=torch.long), cache)
        out: list[int] = []
        while True:
            token = sample_next(logits[-1], params, generator)
            out.append(token)
            if token == self.eos_id and not ignore_eos:
                break
            if len(out) == max_new_tokens:
                break
            logits = self(torch.tensor([token], dtype=torch.long), cache)
        return out


# ----------------------------------------------------------------------------- loading


def load_citylm(
    device: str | torch.device | None = None, dtype: torch.dtype = torch.float32
) -> tuple[CityLM, Tokenizer]:
    """The trained CityLM shipped inside the package, in eval mode, and its tokenizer.

    ``device=None`` picks CUDA when available. The weights are read through
    ``importlib.resources`` so this works from a wheel, an editable install or Colab.
    """
    from safetensors.torch import load as load_safetensors

    weights_dir = resources.files("minisrv") / "weights"
    meta = json.loads((weights_dir / META_FILE).read_text(encoding="utf-8"))
    tokenizer = Tokenizer()
    if meta["tokenizer"]["alphabet"] != tokenizer.alphabet:
        raise ValueError("shipped weights were trained with a different tokenizer alphabet")
    # Only fields ModelConfig still has, so older or newer records keep loading.
    known = {field.name for field in dataclasses.fields(ModelConfig)}
    config = CITYLM.with_(**{k: v for k, v in meta["config"].items() if k in known})
    model = CityLM(config)
    state = load_safetensors((weights_dir / WEIGHTS_FILE).read_bytes())
    model.load_state_dict(state)
    model = model.to(device=resolve_device(device), dtype=dtype).eval()
    return model, tokenizer


# ----------------------------------------------------------------------------- HF Llama

# Our parameter names and the Hugging Face Llama names they come from.
_HF_NAME_PATTERNS: list[tuple[str, str]] = [
    (r"embed\.weight", "model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.attn\.w([qkvo])\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
    (r"layers\.(\d+)\.mlp_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.mlp\.w_(gate|up|down)\.weight", r"model.layers.\1.mlp.\2_proj.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
]


def hf_name(name: str) -> str:
    """The HF Llama state-dict name of our parameter ``name`` (e.g. ``layers.0.attn.wq.weight``)."""
    for ours, theirs in _HF_NAME_PATTERNS:
        if re.fullmatch(ours, name):
            return re.sub(ours, theirs, name)
    raise ValueError(f"no Hugging Face Llama name for parameter {name!r}")


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and scaling from an HF config dict (transformers 4.x or 5.x layout)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("cannot map partial_rotary_factor != 1 (RoPE on part of each head)")
    if kind in (None, "default"):
        return theta, None
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor")
        scaling = {key: float(rope[key]) for key in keys}
        original = rope.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
        scaling["original_max_position_embeddings"] = int(original)
        return theta, scaling
    raise ValueError(f"unsupported rope_scaling type {kind!r}: only None and 'llama3' are mapped")


def config_from_hf(hf: Mapping[str, Any]) -> tuple[ModelConfig, dict[str, Any] | None, int | None]:
    """``ModelConfig``, RoPE scaling and eos id for an HF Llama config (as a dict).

    Raises ValueError for features CityLM's layers do not have (biases, another activation).
    """
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"cannot map {flag}=True: CityLM's linear layers have no bias")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"cannot map hidden_act={hf['hidden_act']!r}: the SwiGLU MLP uses silu")
    theta, scaling = _rope_from_hf(hf)
    n_heads = int(hf["num_attention_heads"])
    n_kv_heads = int(hf.get("num_key_value_heads") or n_heads)
    config = ModelConfig(
        name=str(hf.get("_name_or_path") or hf.get("model_type") or "llama"),
        n_layers=int(hf["num_hidden_layers"]),
        d_model=int(hf["hidden_size"]),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // n_heads),
        attention="mha" if n_kv_heads == n_heads else "mqa" if n_kv_heads == 1 else "gqa",
        d_ff=int(hf["intermediate_size"]),
        vocab_size=int(hf["vocab_size"]),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        rope_theta=theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):  # several stop ids: CityLM's oracle stops on the first only
        eos = eos[0] if eos else None
    return config, scaling, eos


def _read_hf_folder(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Config dict and tensors of a local checkpoint: config.json + one or more .safetensors."""
    from safetensors.torch import load_file

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder} has no config.json: not a Hugging Face checkpoint folder")
    hf = json.loads(config_path.read_text(encoding="utf-8"))
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():  # sharded: the index names the file holding each tensor
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(folder / file)))
    return hf, state


def from_hf_llama(
    src: Any, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None
) -> CityLM:
    """A ``CityLM`` with the weights of a Hugging Face Llama-family model.

    ``src`` is a ``transformers`` ``LlamaForCausalLM`` (or any model with a Llama config and
    state dict) or the path of a local checkpoint folder (``config.json`` plus
    ``*.safetensors``, possibly sharded with ``model.safetensors.index.json``); nothing is
    downloaded. ``dtype=None`` keeps the checkpoint's dtype. ``device=None`` keeps a model's
    device, and for a folder picks CUDA when available. Returns the model in eval mode.
    """
    if isinstance(src, (str, Path)):
        hf, state = _read_hf_folder(Path(src))
        default_device = resolve_device(None)
    else:
        # Copies, so the converted model shares no memory with ``src``.
        hf = src.config.to_dict()
        state = {name: t.detach().clone() for name, t in src.state_dict().items()}
        default_device = next(src.parameters()).device
    config, scaling, eos_id = config_from_hf(hf)
    with torch.device("meta"):  # no memory or random init for weights about to be replaced
        model = CityLM(config, rope_scaling=scaling, eos_id=eos_id)
    ours: dict[str, torch.Tensor] = {}
    for name in model.state_dict():
        theirs = hf_name(name)
        if name == "lm_head.weight" and config.tie_embeddings:
            theirs = hf_name("embed.weight")
        if theirs not in state:
            raise ValueError(f"checkpoint has no tensor {theirs!r} (needed for {name!r})")
        ours[name] = state[theirs]
    used = {hf_name(name) for name in ours}
    unused = sorted(k for k in state if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(f"checkpoint tensors CityLM cannot map: {', '.join(unused[:5])}")
    model.load_state_dict(ours, assign=True)
    if config.tie_embeddings:  # assign=True loaded two tensors; share one again
        model.lm_head.weight = model.embed.weight
    model.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, scaling)  # off meta
    target_dtype = dtype if dtype is not None else model.embed.weight.dtype
    target_device = resolve_device(device) if device is not None else default_device
    return model.to(device=target_device, dtype=target_dtype).eval()
