"""How many bytes of KV cache one token takes: the one computation of it.

The server sizes its pool with it (``server/config.py``), the simulated GPU and the book's
sweeps (``minisrv.sim.sizing``: per request, the weights, how many requests fit) build on it.

Conventions used throughout:

* A "token's KV" is everything the cache stores for one token across *all* layers.
* ``dtype_bytes`` is bytes per stored number: 2 for fp16/bf16, 1 for fp8, 0.5 for int4.
  The same width is used for weights and cache unless a function says otherwise.
* Memory is in bytes. GB means 1e9 bytes (how GPU memory is sold); GiB means 2**30.
* Multi-head, grouped-query and multi-query attention (MHA/GQA/MQA) store one K and one V
  vector of ``head_dim`` numbers per KV head, per layer, per token. Multi-head latent
  attention (MLA, DeepSeek-V2/V3) stores one compressed latent of ``kv_lora_rank`` numbers
  plus a shared RoPE key of ``qk_rope_head_dim`` numbers per layer and token; K and V are
  both reconstructed from that latent, so there is no factor 2.
"""

from __future__ import annotations

import math

from minisrv.checks import check_number
from minisrv.configs import ModelConfig

__all__ = ["all_heads_numbers_per_token_per_layer", "check_dtype_bytes", "kv_bytes_per_token",
           "kv_numbers_per_token_per_layer"]


def check_dtype_bytes(dtype_bytes: float) -> float:
    """Bytes per stored number must be a positive real (0.5 is int4)."""
    check_number("dtype_bytes", dtype_bytes)
    if not dtype_bytes > 0:
        raise ValueError(f"dtype_bytes must be > 0, got {dtype_bytes}")
    return float(dtype_bytes)


def all_heads_numbers_per_token_per_layer(cfg: ModelConfig) -> int:
    """How many numbers one layer would cache for one token if every query head kept its own
    K and V: the multi-head counterfactual that GQA, MQA and MLA shrink.

    MHA/GQA/MQA: ``2 * n_heads * head_dim`` (the classic ``2 x d_model`` when
    ``n_heads * head_dim == d_model``). MLA: each head's key is its ``head_dim`` no-RoPE part
    plus the ``qk_rope_head_dim`` RoPE part, its value ``head_dim`` wide (DeepSeek-V3's
    ``qk_nope_head_dim`` and ``v_head_dim`` are both 128): 128 x (192 + 128) = 40,960, about
    71 times the 576-number latent, where ``2 x d_model`` would say 25.
    """
    if cfg.attention == "mla":
        return cfg.n_heads * (cfg.head_dim + cfg.qk_rope_head_dim + cfg.head_dim)
    return 2 * cfg.n_heads * cfg.head_dim


def kv_numbers_per_token_per_layer(cfg: ModelConfig) -> int:
    """How many numbers one layer caches for one token.

    MHA/GQA/MQA: a K and a V vector per KV head, ``2 * n_kv_heads * head_dim``.
    MLA: the latent plus the decoupled RoPE key, ``kv_lora_rank + qk_rope_head_dim``
    (DeepSeek-V3: 512 + 64 = 576).
    """
    if cfg.attention == "mla":
        if cfg.kv_lora_rank < 1:
            raise ValueError(f"{cfg.name}: an MLA model needs kv_lora_rank >= 1")
        return cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return 2 * cfg.n_kv_heads * cfg.head_dim


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: float = 2) -> int:
    """Bytes of KV cache one token occupies, summed over all layers.

    ``2 x n_layers x n_kv_heads x head_dim x dtype_bytes`` for MHA/GQA/MQA; for MLA
    ``n_layers x (kv_lora_rank + qk_rope_head_dim) x dtype_bytes``. Rounded up to whole
    bytes (only matters for sub-byte dtypes). LLaMA-3-8B in 16 bits: 131,072 B = 128 KiB.
    """
    per_number = check_dtype_bytes(dtype_bytes)
    return math.ceil(cfg.n_layers * kv_numbers_per_token_per_layer(cfg) * per_number)
