"""``from_hf_llama``: a random HF Llama and its CityLM conversion compute the same thing."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from minisrv.model import CityLM, from_hf_llama, rope_inv_freq  # noqa: E402

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def hf_llama(**overrides) -> transformers.LlamaForCausalLM:
    """A small random HF Llama (no download); larger init so logits are far from uniform."""
    settings = {
        "vocab_size": 50,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "initializer_range": 0.1,
        "eos_token_id": 2,
        "bos_token_id": 1,
        "pad_token_id": 0,
    }
    settings.update(overrides)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).eval()


def assert_same_model(hf: transformers.LlamaForCausalLM, ours: CityLM) -> None:
    """Equal logits on a 40-token input and equal greedy continuations."""
    ids = torch.randint(3, 50, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    assert torch.max(torch.abs(ours(ids) - expected)) < 1e-5
    prompt = ids[:6]
    generated = hf.generate(
        prompt[None],
        attention_mask=torch.ones(1, 6, dtype=torch.long),
        max_new_tokens=30,
        do_sample=False,
    )[0, 6:].tolist()
    assert ours.reference_generate(prompt.tolist(), 30) == generated


def test_converted_model_matches_hf() -> None:
    hf = hf_llama()
    ours = from_hf_llama(hf)
    assert ours.dtype == torch.float32 and ours.device.type == "cpu" and not ours.training
    assert (ours.config.n_heads, ours.config.n_kv_heads, ours.config.head_dim) == (4, 2, 16)
    assert ours.eos_id == 2
    assert_same_model(hf, ours)


def test_saved_checkpoint_folder_matches_hf(tmp_path) -> None:
    hf = hf_llama()
    hf.save_pretrained(tmp_path)
    assert_same_model(hf, from_hf_llama(tmp_path, device="cpu"))


def test_sharded_checkpoint_folder_matches_hf(tmp_path) -> None:
    hf = hf_llama()
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert_same_model(hf, from_hf_llama(str(tmp_path), device="cpu"))


def test_llama3_rope_scaling_matches_hf() -> None:
    hf = hf_llama(rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0})
    ours = from_hf_llama(hf)
    assert ours.rope_scaling is not None and ours.config.rope_theta == 500000.0
    # the scaling really changes the slow channels, so this test would notice if it were lost
    assert not torch.equal(ours.inv_freq, rope_inv_freq(16, 500000.0))
    assert_same_model(hf, ours)


def test_tied_embeddings_match_hf() -> None:
    hf = hf_llama(tie_word_embeddings=True)
    ours = from_hf_llama(hf)
    assert ours.config.tie_embeddings and ours.lm_head.weight is ours.embed.weight
    assert_same_model(hf, ours)


def test_float64_conversion() -> None:
    ours = from_hf_llama(hf_llama(), dtype=torch.float64)
    assert ours.dtype == torch.float64 and ours.inv_freq.dtype == torch.float32


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "'linear'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_unmappable_features_are_named(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_hf_llama(hf_llama(**overrides))


def test_folder_without_config_is_rejected(tmp_path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        from_hf_llama(tmp_path)


def test_converted_model_shares_no_memory_with_the_source() -> None:
    hf = hf_llama()
    ours = from_hf_llama(hf)
    with torch.no_grad():
        ours.embed.weight.zero_()
    assert hf.model.embed_tokens.weight.abs().sum() > 0
