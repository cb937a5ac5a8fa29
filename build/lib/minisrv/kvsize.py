"""How much memory the KV cache takes, and how many requests a GPU can therefore hold.

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

from minisrv.checks import check_int, check_number
from minisrv.configs import GPUSpec, ModelConfig


def check_positive_int(name: str, value: object) -> int:
    """``value`` as an int, or a ValueError naming ``name`` if it is not a positive integer.

    Sizes arrive from widgets, numpy arrays and user code; a zero or negative token count is
    always a caller's mistake, and a silent ``0`` would give nonsense times downstream.
    """
    return check_int(name, value, minimum=1)


def check_dtype_bytes(dtype_bytes: float) -> float:
    """Bytes per stored number must be a positive real (0.5 is int4)."""
    check_number("dtype_bytes", dtype_bytes)
    if not dtype_bytes > 0:
        raise ValueError(f"dtype_bytes must be > 0, got {dtype_bytes}")
    return float(dtype_bytes)


def gb(n_bytes: float) -> str:
    """``n_bytes`` as decimal gigabytes with three significant digits, for error messages."""
    return f"{n_bytes / 1e9:.3g} GB"


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


def kv_bytes_per_request(cfg: ModelConfig, context_len: int, dtype_bytes: float = 2) -> int:
    """Bytes of KV cache a request holds once ``context_len`` tokens are cached.

    LLaMA-3-8B at 32K tokens: 4 GiB; LLaMA-3-70B with all heads at 8K: 20 GiB.
    """
    tokens = check_positive_int("context_len", context_len)
    return tokens * kv_bytes_per_token(cfg, dtype_bytes)


def weight_bytes(cfg: ModelConfig, dtype_bytes: float = 2) -> float:
    """Bytes of the weights: every parameter, including all experts of an MoE model."""
    return cfg.param_count * check_dtype_bytes(dtype_bytes)


def kv_budget_bytes(cfg: ModelConfig, gpu: GPUSpec, dtype_bytes: float = 2) -> float:
    """Device memory left for the KV cache once the weights are loaded.

    Ignores activations, CUDA context and fragmentation: real servers reserve a few GB more,
    so this is an upper bound. Raises ValueError when the weights alone do not fit.
    """
    weights = weight_bytes(cfg, dtype_bytes)
    if weights >= gpu.memory_bytes:
        raise ValueError(
            f"{cfg.name} weights ({gb(weights)}) do not fit on {gpu.name} ({gb(gpu.memory_bytes)})"
        )
    return gpu.memory_bytes - weights


def max_concurrent_requests(
    cfg: ModelConfig, gpu: GPUSpec, context_len: int, dtype_bytes: float = 2
) -> int:
    """How many requests of ``context_len`` tokens fit in memory at once.

    (card memory - weights) // KV per request. This, not compute, caps the decode batch:
    LLaMA-3-8B on an 80 GB H100 holds 476 requests at 1024 tokens, 59 at 8K, 14 at 32K.
    Raises ValueError when the weights do not fit or not even one request does.
    """
    per_request = kv_bytes_per_request(cfg, context_len, dtype_bytes)
    budget = kv_budget_bytes(cfg, gpu, dtype_bytes)
    count = int(budget // per_request)
    if count < 1:
        raise ValueError(
            f"a {context_len}-token request of {cfg.name} needs {gb(per_request)} of KV cache, "
            f"but only {gb(budget)} of {gpu.name} is left after the weights"
        )
    return count
