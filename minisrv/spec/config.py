"""The draft model's shape and where its weights live inside the package.

The draft is CityLM-shaped (the same layers, tokenizer and positions), only much smaller,
so it runs through the same ``CityLM`` class and the same forwards; speculative decoding
needs nothing of it but next-token logits that often agree with CityLM's.
"""

from __future__ import annotations

from minisrv.configs import CITYLM, ModelConfig

CITYDRAFT = CITYLM.with_(
    name="CityDraft",
    n_layers=1,
    d_model=64,
    n_heads=2,
    n_kv_heads=1,
    head_dim=32,
    d_ff=192,
)
DRAFT_WEIGHTS_FILE = "citydraft.safetensors"
DRAFT_META_FILE = "citydraft.json"


def draft_config(vocab_size: int) -> ModelConfig:
    """``CITYDRAFT`` for a tokenizer of ``vocab_size`` ids (CityLM's tokenizer: 61)."""
    return CITYDRAFT.with_(vocab_size=vocab_size)
