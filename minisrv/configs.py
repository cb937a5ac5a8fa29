"""Model and hardware descriptions shared by the real model and the analytic chapters.

One ``ModelConfig`` describes both CityLM (the model we actually run) and the published
models whose KV cache and step time the book computes, so ``kv_bytes_per_token`` works on
``model.config`` exactly as it works on ``LLAMA3_8B``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer.

    Fields a LLaMA-style forward pass needs (``vocab_size``, ``d_ff``, ``rope_theta`` ...)
    sit beside the ones that size its KV cache (``n_layers``, ``n_kv_heads``, ``head_dim``).
    Published configs that we never instantiate may leave the former at their defaults.
    """

    name: str
    n_layers: int
    d_model: int
    n_heads: int  # query heads
    n_kv_heads: int  # heads that store K and V (== n_heads for MHA, 1 for MQA)
    head_dim: int
    n_params: float = 0.0  # total parameters; 0 means "count them from the shapes"
    attention: str = "gqa"  # "mha" | "gqa" | "mqa" | "mla"
    d_ff: int = 0  # SwiGLU hidden size
    vocab_size: int = 0
    max_seq_len: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    kv_lora_rank: int = 0  # MLA only: width of the compressed KV latent per token and layer
    qk_rope_head_dim: int = 0  # MLA only: decoupled RoPE key width per token and layer
    n_active_params: float = 0.0  # mixture-of-experts: parameters one token uses; 0 = all

    def __post_init__(self) -> None:
        for field in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"{self.name}: {field} must be >= 1, got {getattr(self, field)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"{self.name}: n_heads ({self.n_heads}) must be a multiple of "
                f"n_kv_heads ({self.n_kv_heads})"
            )
        if self.attention not in ("mha", "gqa", "mqa", "mla"):
            raise ValueError(f"{self.name}: unknown attention kind {self.attention!r}")

    @property
    def param_count(self) -> float:
        """Published parameter count, or one counted from the LLaMA-style shapes."""
        if self.n_params:
            return self.n_params
        d, hd = self.d_model, self.head_dim
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * d * self.d_ff
        per_layer = attn + mlp + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return float(self.n_layers * per_layer + embed + d)

    @property
    def active_param_count(self) -> float:
        """Parameters one token's forward pass multiplies by (all of them unless MoE).

        Compute scales with this; weight traffic scales with ``param_count``, because a
        batch of tokens routed to different experts ends up reading every expert.
        """
        return self.n_active_params or self.param_count

    @property
    def matmul_param_count(self) -> float:
        """Parameters one token multiplies by: the active ones less the input embedding.

        The embedding is a table lookup (one row copied per token, no arithmetic); the output
        head is a matrix product and stays. Counting the lookup as a matmul, as "FLOPs = 2 x
        parameters" does, adds 6.5% to LLaMA-3-8B's arithmetic. A tied model's one matrix
        serves as the head, so nothing is taken off.
        """
        lookup = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return self.active_param_count - lookup

    def with_(self, **changes) -> ModelConfig:
        """A copy with some fields changed (e.g. the all-heads variant of a GQA model)."""
        return replace(self, **changes)


CITYLM = ModelConfig(
    name="CityLM",
    n_layers=4,
    d_model=128,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    attention="gqa",
    d_ff=384,
    vocab_size=61,  # minisrv.tokenizer: <bos>, <eos> and a 59-character alphabet
    max_seq_len=512,
    rope_theta=10000.0,
    norm_eps=1e-5,
    tie_embeddings=False,
)


def all_heads(cfg: ModelConfig) -> ModelConfig:
    """The same model if every query head kept its own K and V (multi-head attention).

    This is the counterfactual behind the classic "2 x layers x d_model" KV formula: it holds
    only when ``n_kv_heads * head_dim == d_model``. Restoring the missing heads also restores
    their K/V projection weights, so the parameter count grows by
    ``2 * n_layers * d_model * head_dim * (n_heads - n_kv_heads)``.
    """
    if cfg.attention == "mla":
        raise ValueError(f"{cfg.name}: MLA caches a shared latent, not per-head K and V")
    extra = 2 * cfg.n_layers * cfg.d_model * cfg.head_dim * (cfg.n_heads - cfg.n_kv_heads)
    return cfg.with_(
        name=f"{cfg.name} (all heads)",
        n_kv_heads=cfg.n_heads,
        attention="mha",
        n_params=cfg.param_count + extra,
    )


# Published configurations. Shapes are each model's Hugging Face ``config.json``; parameter
# counts are the ones the model cards and reports print. Fields the KV/roofline chapter does
# not need keep what the config says anyway, so a reader can check them against the source.

LLAMA3_8B = ModelConfig(
    # Meta Llama 3 8B: "The Llama 3 Herd of Models" (arXiv:2407.21783), Table 3, and
    # huggingface.co/meta-llama/Meta-Llama-3-8B/config.json. The shapes count 8,030,261,248
    # parameters; the book uses 8.03e9, so 16-bit weights are 16.06 GB.
    name="LLaMA-3-8B",
    n_layers=32,
    d_model=4096,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    n_params=8.03e9,
    attention="gqa",
    d_ff=14336,
    vocab_size=128256,
    max_seq_len=8192,
    rope_theta=500000.0,
)

LLAMA31_8B = LLAMA3_8B.with_(name="LLaMA-3.1-8B", max_seq_len=131072)
"""Meta Llama 3.1 8B (meta-llama/Llama-3.1-8B/config.json): LLaMA-3-8B's shapes with a
131,072-token context (RoPE scaled), so its KV cache per token is the same; the book's
32K-token examples use it, past LLaMA-3-8B's 8,192 tokens."""

LLAMA3_70B = ModelConfig(
    # Meta Llama 3 70B: same report, Table 3, and meta-llama/Meta-Llama-3-70B/config.json
    # (80 layers, d_model 8192, 64 query heads sharing 8 KV heads). 70.6e9 parameters.
    name="LLaMA-3-70B",
    n_layers=80,
    d_model=8192,
    n_heads=64,
    n_kv_heads=8,
    head_dim=128,
    n_params=70.6e9,
    attention="gqa",
    d_ff=28672,
    vocab_size=128256,
    max_seq_len=8192,
    rope_theta=500000.0,
)

LLAMA3_70B_MHA = all_heads(LLAMA3_70B)
"""LLaMA-3-70B counted as if all 64 heads stored K and V, as the lecture slides count it."""

LLAMA32_1B = ModelConfig(
    # Meta Llama 3.2 1B: meta-llama/Llama-3.2-1B/config.json (16 layers, d_model 2048,
    # 32 query / 8 KV heads of 64, tied embeddings); the shapes count 1,235,814,400 params.
    # A model that fits a Colab T4 with room to spare.
    name="LLaMA-3.2-1B",
    n_layers=16,
    d_model=2048,
    n_heads=32,
    n_kv_heads=8,
    head_dim=64,
    n_params=1.24e9,
    attention="gqa",
    d_ff=8192,
    vocab_size=128256,
    max_seq_len=131072,
    rope_theta=500000.0,
    tie_embeddings=True,
)

SMOLLM2_135M = ModelConfig(
    # SmolLM2-135M: Allal et al., "SmolLM2: When Smol Goes Big" (arXiv:2502.02737), and
    # HuggingFaceTB/SmolLM2-135M/config.json (30 layers, hidden 576, 9 query / 3 KV heads of
    # 64, intermediate 1536, vocabulary 49152, tied embeddings, rope_theta 1e5). The shapes
    # count 134,515,008 parameters. A Llama-architecture checkpoint small enough that a
    # decode step on any GPU is dominated by per-step overheads, not by the weights.
    name="SmolLM2-135M",
    n_layers=30,
    d_model=576,
    n_heads=9,
    n_kv_heads=3,
    head_dim=64,
    attention="gqa",
    d_ff=1536,
    vocab_size=49152,
    max_seq_len=8192,
    rope_theta=100000.0,
    tie_embeddings=True,
)

QWEN25_7B = ModelConfig(
    # Qwen2.5-7B: "Qwen2.5 Technical Report" (arXiv:2412.15115), Table 1, and
    # Qwen/Qwen2.5-7B/config.json (28 layers, d_model 3584, 28 query / 4 KV heads of 128).
    # 7.61e9 parameters.
    name="Qwen2.5-7B",
    n_layers=28,
    d_model=3584,
    n_heads=28,
    n_kv_heads=4,
    head_dim=128,
    n_params=7.61e9,
    attention="gqa",
    d_ff=18944,
    vocab_size=152064,
    max_seq_len=131072,
    rope_theta=1000000.0,
    norm_eps=1e-6,
)

MISTRAL_7B = ModelConfig(
    # Mistral-7B-v0.3: mistralai/Mistral-7B-v0.3/config.json (32 layers, d_model 4096, 32 query
    # / 8 KV heads, vocabulary 32,768, "sliding_window": null). The shape is Table 1 of Jiang et
    # al., "Mistral 7B" (arXiv:2310.06825), without v0.1's 4,096-token sliding window: v0.1's
    # rolling buffer would keep at most 4,096 tokens per request, which this config, like every
    # other here, cannot express. 7.25e9 parameters.
    name="Mistral-7B-v0.3",
    n_layers=32,
    d_model=4096,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    n_params=7.25e9,
    attention="gqa",
    d_ff=14336,
    vocab_size=32768,
    max_seq_len=32768,
    rope_theta=1000000.0,
)

DEEPSEEK_V3 = ModelConfig(
    # DeepSeek-V3: "DeepSeek-V3 Technical Report" (arXiv:2412.19437), section 4.2, and
    # deepseek-ai/DeepSeek-V3/config.json. Multi-head latent attention (MLA): each layer caches
    # one compressed latent of kv_lora_rank = 512 numbers plus a decoupled RoPE key of
    # qk_rope_head_dim = 64 numbers per token, shared by all 128 query heads, so the config
    # records it as a single "KV head". head_dim is the per-head value width (128).
    # Mixture of experts: 671e9 parameters in all (the multi-token-prediction module excluded),
    # 37e9 of them activated for each token.
    name="DeepSeek-V3",
    n_layers=61,
    d_model=7168,
    n_heads=128,
    n_kv_heads=1,
    head_dim=128,
    n_params=671e9,
    n_active_params=37e9,
    attention="mla",
    d_ff=18432,
    vocab_size=129280,
    max_seq_len=163840,
    rope_theta=10000.0,
    norm_eps=1e-6,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
)


@dataclass(frozen=True)
class GPUSpec:
    """The three numbers of an accelerator that a roofline model needs, and its host link.

    Units are SI (GB = 1e9 bytes, TB/s = 1e12 bytes/s), the way vendors print them.
    ``flops`` is dense (no 2:4 sparsity) bf16 tensor-core throughput, or fp16 on cards
    without bf16; real kernels reach a fraction of it, so roofline times are lower bounds.
    """

    name: str
    memory_bytes: float  # device memory
    bandwidth: float  # memory bandwidth, bytes/s
    flops: float  # dense bf16 (fp16 where the card has no bf16) FLOP/s
    # host memory -> device over its PCIe link, bytes/s, as copies reach it (about 85% of
    # the link's rate): what loading a prefix back from a host tier costs
    host_bandwidth: float

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "bandwidth", "flops", "host_bandwidth"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{self.name}: {field} must be > 0, got {getattr(self, field)}")

    @property
    def ridge_intensity(self) -> float:
        """FLOPs per byte moved at which compute and memory take equally long.

        Work with fewer FLOPs per byte than this is memory-bound on this card.
        """
        return self.flops / self.bandwidth


# NVIDIA data sheets. H100 SXM5: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s dense BF16.
# Host link: PCIe 5.0 x16, 64 GB/s per direction, about 55 GB/s reached by pinned copies.
H100 = GPUSpec("H100 SXM", memory_bytes=80e9, bandwidth=3.35e12, flops=989e12,
               host_bandwidth=55e9)
# H200 SXM (NVIDIA H200 Tensor Core GPU data sheet): 141 GB HBM3e, 4.8 TB/s; 1,979 TFLOP/s
# BF16 "with sparsity", i.e. 989 dense: the same compute die as the H100 SXM.
# Host link: PCIe 5.0 x16, as the H100's.
H200 = GPUSpec("H200", memory_bytes=141e9, bandwidth=4.8e12, flops=989e12,
               host_bandwidth=55e9)
# A100 80GB SXM: 2,039 GB/s, 312 TFLOP/s dense BF16.
# Host link: PCIe 4.0 x16, 32 GB/s per direction, about 26 GB/s reached.
A100_80GB = GPUSpec("A100 80GB", memory_bytes=80e9, bandwidth=2.039e12, flops=312e12,
                    host_bandwidth=26e9)
# L4 (NVIDIA L4 Tensor Core GPU data sheet): 24 GB GDDR6, 300 GB/s, 242 TFLOP/s BF16 with
# sparsity, so 121 dense. Colab offers it.
# Host link: PCIe 4.0 x16.
L4 = GPUSpec("L4", memory_bytes=24e9, bandwidth=300e9, flops=121e12, host_bandwidth=26e9)
# T4 (NVIDIA T4 Tensor Core GPU data sheet): 16 GB GDDR6, 320 GB/s, 65 TFLOP/s FP16 mixed
# precision on tensor cores (no BF16). Colab's free GPU.
# Host link: PCIe 3.0 x16, 16 GB/s per direction, about 13 GB/s reached.
T4 = GPUSpec("T4", memory_bytes=16e9, bandwidth=320e9, flops=65e12, host_bandwidth=13e9)

MODELS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        LLAMA3_8B,
        LLAMA3_70B,
        LLAMA3_70B_MHA,
        LLAMA32_1B,
        SMOLLM2_135M,
        QWEN25_7B,
        MISTRAL_7B,
        DEEPSEEK_V3,
        CITYLM,
    )
}
"""Every model above by name, e.g. for a widget's drop-down."""

GPUS: dict[str, GPUSpec] = {g.name: g for g in (H100, H200, A100_80GB, L4, T4)}
"""Every accelerator above by name."""


# What torch.cuda.get_device_name() prints for each card above, as patterns. Variants with
# other numbers (H100 PCIe or NVL, A100 40GB, L40S) match none: a wrong roofline is worse
# than none.
_GPU_NAME_PATTERNS: tuple[tuple[str, GPUSpec], ...] = (
    (r"\bH200\b", H200),
    (r"\bH100\b(?!.*\b(PCIE|NVL)\b).*\b(SXM|HBM3)\b", H100),
    (r"\bA100\b.*\b80\s?GB\b", A100_80GB),
    (r"\bL4\b", L4),
    (r"\bT4\b", T4),
)


def gpu_by_name(device_name: str) -> GPUSpec | None:
    """The spec of the card ``torch.cuda.get_device_name()`` calls ``device_name``, if listed.

    ``"NVIDIA H200"`` gives ``H200``, ``"Tesla T4"`` gives ``T4``; an unlisted card (or a
    variant with other memory or clocks) gives None.
    """
    name = device_name.upper()
    for pattern, spec in _GPU_NAME_PATTERNS:
        if re.search(pattern, name):
            return spec
    return None
