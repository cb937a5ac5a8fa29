"""The book's KV sizing: a request's KV, the weights, and how many requests a GPU holds.

Built on the runtime's one per-token computation (``minisrv.kvsize.kv_bytes_per_token``);
the conventions (``dtype_bytes``, GB = 1e9 bytes) are those of ``minisrv.kvsize``.
"""

from __future__ import annotations

from minisrv.checks import check_int
from minisrv.configs import GPUSpec, ModelConfig
from minisrv.kvsize import check_dtype_bytes, kv_bytes_per_token

__all__ = ["check_positive_int", "gb", "kv_budget_bytes", "kv_bytes_per_request",
           "max_concurrent_requests", "running_batch", "weight_bytes"]


def check_positive_int(name: str, value: object) -> int:
    """``value`` as an int, or a ValueError naming ``name`` if it is not a positive integer.

    Sizes arrive from widgets, numpy arrays and user code; a zero or negative token count is
    always a caller's mistake, and a silent ``0`` would give nonsense times downstream.
    """
    return check_int(name, value, minimum=1)


def gb(n_bytes: float) -> str:
    """``n_bytes`` as decimal gigabytes with three significant digits, for messages and
    labels; whole gigabytes from 1,000 up ("1,342 GB", where ``.3g`` would print 1.34e+03)."""
    n_gb = n_bytes / 1e9
    return f"{n_gb:,.0f} GB" if n_gb >= 999.5 else f"{n_gb:.3g} GB"


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
    LLaMA-3-8B on an 80 GB H100 holds 476 requests at 1024 tokens, 59 at 8K (its longest
    context); LLaMA-3.1-8B, the same shape, 14 at 32K.
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


def running_batch(cfg: ModelConfig, gpu: GPUSpec, context_len: int, batch: int,
                  dtype_bytes: float = 2) -> int:
    """The batch a server runs when ``batch`` requests of ``context_len`` tokens ask: all of
    them if they fit, else as many as fit (the rest wait), 0 if not one does. A throughput
    quoted for more requests than fit would pass the memory wall's own ceiling."""
    try:
        return min(batch, max_concurrent_requests(cfg, gpu, context_len, dtype_bytes))
    except ValueError:  # not one request fits
        return 0
