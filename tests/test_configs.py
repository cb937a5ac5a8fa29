"""The published configurations and GPU specs the analytic chapters compute with."""

from __future__ import annotations

import pytest

from minisrv.configs import (
    CITYLM,
    DEEPSEEK_V3,
    GPUS,
    H100,
    LLAMA3_8B,
    LLAMA3_70B,
    LLAMA3_70B_MHA,
    LLAMA32_1B,
    MISTRAL_7B,
    MODELS,
    QWEN25_7B,
    SMOLLM2_135M,
    GPUSpec,
    all_heads,
    gpu_by_name,
)


@pytest.mark.parametrize(
    ("cfg", "layers", "q_heads", "kv_heads", "head_dim"),
    [
        (LLAMA3_8B, 32, 32, 8, 128),
        (LLAMA3_70B, 80, 64, 8, 128),
        (LLAMA3_70B_MHA, 80, 64, 64, 128),
        (QWEN25_7B, 28, 28, 4, 128),
        (MISTRAL_7B, 32, 32, 8, 128),
        (LLAMA32_1B, 16, 32, 8, 64),
        (SMOLLM2_135M, 30, 9, 3, 64),
    ],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_published_attention_shapes(cfg, layers, q_heads, kv_heads, head_dim) -> None:
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        layers,
        q_heads,
        kv_heads,
        head_dim,
    )


def test_published_shapes_count_the_published_parameters() -> None:
    """The LLaMA-style shape count agrees with the printed count to 0.5%."""
    for cfg in (LLAMA3_8B, LLAMA3_70B, LLAMA32_1B, MISTRAL_7B, QWEN25_7B):
        counted = cfg.with_(n_params=0.0).param_count
        assert counted == pytest.approx(cfg.n_params, rel=5e-3), cfg.name


def test_smollm2_135m_is_its_hf_config() -> None:
    """The fields of HuggingFaceTB/SmolLM2-135M's config.json, mapped as ``load_model`` maps
    a checkpoint, give exactly ``SMOLLM2_135M``; its shapes count 134,515,008 parameters."""
    from minisrv.model import config_from_hf

    hf = {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
        "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True, "hidden_act": "silu", "_name_or_path": "SmolLM2-135M",
    }
    config, scaling, _ = config_from_hf(hf)
    assert config == SMOLLM2_135M and scaling is None
    assert SMOLLM2_135M.param_count == 134_515_008


def test_llama3_8b_uses_the_books_parameter_count() -> None:
    assert LLAMA3_8B.n_params == 8.03e9


def test_deepseek_v3_is_mla_with_activated_parameters() -> None:
    assert DEEPSEEK_V3.attention == "mla"
    assert (DEEPSEEK_V3.n_layers, DEEPSEEK_V3.kv_lora_rank, DEEPSEEK_V3.qk_rope_head_dim) == (
        61,
        512,
        64,
    )
    assert DEEPSEEK_V3.param_count == 671e9
    assert DEEPSEEK_V3.active_param_count == 37e9
    assert LLAMA3_8B.active_param_count == LLAMA3_8B.param_count  # dense: all of them


def test_matmul_parameters_leave_out_the_untied_embedding_lookup() -> None:
    """The input embedding is looked up, not multiplied: an untied model's FLOP count loses
    it (6.5% of LLaMA-3-8B), a tied one's keeps its one matrix as the output head."""
    assert LLAMA3_8B.matmul_param_count == 8.03e9 - 128256 * 4096
    assert LLAMA32_1B.matmul_param_count == LLAMA32_1B.param_count  # tied
    assert DEEPSEEK_V3.matmul_param_count == 37e9 - 129280 * 7168


def test_all_heads_restores_kv_heads_and_their_projection_weights() -> None:
    assert LLAMA3_70B_MHA.attention == "mha"
    assert LLAMA3_70B_MHA.n_kv_heads * LLAMA3_70B_MHA.head_dim == LLAMA3_70B.d_model
    extra = 2 * 80 * 8192 * 128 * (64 - 8)
    assert LLAMA3_70B_MHA.param_count == LLAMA3_70B.param_count + extra
    assert all_heads(LLAMA3_70B_MHA).n_kv_heads == 64  # idempotent in shape


def test_all_heads_refuses_mla() -> None:
    with pytest.raises(ValueError, match="MLA"):
        all_heads(DEEPSEEK_V3)


def test_registries_list_every_model_and_gpu_by_name() -> None:
    assert {"LLaMA-3-8B", "LLaMA-3-70B", "DeepSeek-V3", "CityLM"} <= set(MODELS)
    assert MODELS["CityLM"] is CITYLM
    assert set(GPUS) == {"H100 SXM", "H200", "A100 80GB", "L4", "T4"}
    assert all(name == spec.name for name, spec in GPUS.items())


@pytest.mark.parametrize(
    ("name", "memory", "bandwidth", "flops"),
    [
        ("H100 SXM", 80e9, 3.35e12, 989e12),
        ("H200", 141e9, 4.8e12, 989e12),
        ("A100 80GB", 80e9, 2.039e12, 312e12),
        ("L4", 24e9, 300e9, 121e12),
        ("T4", 16e9, 320e9, 65e12),
    ],
)
def test_gpu_data_sheet_numbers(name, memory, bandwidth, flops) -> None:
    gpu = GPUS[name]
    assert (gpu.memory_bytes, gpu.bandwidth, gpu.flops) == (memory, bandwidth, flops)


def test_h100_ridge_point() -> None:
    assert H100.ridge_intensity == pytest.approx(295.2, abs=0.1)


@pytest.mark.parametrize("field", ["memory_bytes", "bandwidth", "flops", "host_bandwidth"])
def test_gpu_spec_rejects_non_positive_numbers(field) -> None:
    values = {"memory_bytes": 1e9, "bandwidth": 1e9, "flops": 1e9, "host_bandwidth": 1e9,
              field: 0}
    with pytest.raises(ValueError, match=field):
        GPUSpec("broken", **values)


@pytest.mark.parametrize(
    ("device_name", "spec"),
    [
        ("NVIDIA H200", "H200"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", None),  # 2.0 TB/s, not the SXM's 3.35
        ("NVIDIA H100 NVL", None),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
        ("NVIDIA A100-SXM4-40GB", None),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", None),
        ("Tesla T4", "T4"),
        ("", None),
    ],
)
def test_gpu_by_name_knows_the_listed_cards_only(device_name, spec) -> None:
    found = gpu_by_name(device_name)
    assert (found.name if found else None) == spec
