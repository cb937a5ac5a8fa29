"""Hugging Face Llama checkpoints as ``CityLM``: parameter names, config, weights, tokenizer.

Nothing is downloaded: ``from_hf_llama`` takes a ``transformers`` model already in memory or
a local checkpoint folder.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from minisrv.configs import ModelConfig
from minisrv.model.citylm import CityLM
from minisrv.model.device import resolve_device
from minisrv.model.layers import rope_inv_freq
from minisrv.tokenizer import merge_eos_ids, read_json

# Our parameter names and the Hugging Face Llama names they come from; a fused weight of
# ours stacks several of theirs (output rows, in this order).
_HF_NAME_PATTERNS: list[tuple[str, tuple[str, ...]]] = [
    (r"embed\.weight", ("model.embed_tokens.weight",)),
    (r"layers\.(\d+)\.attn_norm\.weight", (r"model.layers.\1.input_layernorm.weight",)),
    (r"layers\.(\d+)\.attn\.qkv_proj\.weight",
     tuple(rf"model.layers.\1.self_attn.{p}_proj.weight" for p in "qkv")),
    (r"layers\.(\d+)\.attn\.o_proj\.weight", (r"model.layers.\1.self_attn.o_proj.weight",)),
    (r"layers\.(\d+)\.mlp_norm\.weight",
     (r"model.layers.\1.post_attention_layernorm.weight",)),
    (r"layers\.(\d+)\.mlp\.gate_up_proj\.weight",
     tuple(rf"model.layers.\1.mlp.{p}_proj.weight" for p in ("gate", "up"))),
    (r"layers\.(\d+)\.mlp\.down_proj\.weight", (r"model.layers.\1.mlp.down_proj.weight",)),
    (r"norm\.weight", ("model.norm.weight",)),
    (r"lm_head\.weight", ("lm_head.weight",)),
]


def hf_names(name: str) -> tuple[str, ...]:
    """The HF Llama state-dict names our parameter ``name`` is made of: one name, or the
    parts a fused weight stacks (``layers.0.attn.qkv_proj.weight``: q, k and v)."""
    for ours, theirs in _HF_NAME_PATTERNS:
        if re.fullmatch(ours, name):
            return tuple(re.sub(ours, part, name) for part in theirs)
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


def config_from_hf(
    hf: Mapping[str, Any],
) -> tuple[ModelConfig, dict[str, Any] | None, tuple[int, ...]]:
    """``ModelConfig``, RoPE scaling and every eos id of an HF Llama config (as a dict).

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
    return config, scaling, merge_eos_ids(hf.get("eos_token_id"))


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
    downloaded. q/k/v and gate/up are fused into one weight each (``hf_names``).
    ``dtype=None`` keeps the checkpoint's dtype. ``device=None`` keeps a model's
    device, and for a folder picks CUDA when available. Every eos id of the config and of
    the generation config ends a generation. Returns the model in eval mode.
    """
    if isinstance(src, (str, Path)):
        hf, state = _read_hf_folder(Path(src))
        generation = read_json(Path(src) / "generation_config.json")
        default_device = resolve_device(None)
    else:
        # Copies, so the converted model shares no memory with ``src``.
        hf = src.config.to_dict()
        state = {name: t.detach().clone() for name, t in src.state_dict().items()}
        gen_config = getattr(src, "generation_config", None)
        generation = gen_config.to_dict() if gen_config is not None else {}
        default_device = next(src.parameters()).device
    config, scaling, config_eos = config_from_hf(hf)
    stop = merge_eos_ids(config_eos, generation.get("eos_token_id"))
    with torch.device("meta"):  # no memory or random init for weights about to be replaced
        model = CityLM(config, rope_scaling=scaling, eos_id=stop)
    ours: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for name in model.state_dict():
        theirs = hf_names("embed.weight" if name == "lm_head.weight" and config.tie_embeddings
                          else name)
        missing = [part for part in theirs if part not in state]
        if missing:
            raise ValueError(f"checkpoint has no tensor {missing[0]!r} (needed for {name!r})")
        # Fused here, once: q/k/v and gate/up become one matrix product each per layer.
        ours[name] = state[theirs[0]] if len(theirs) == 1 else torch.cat(
            [state[part] for part in theirs])
        used.update(theirs, hf_names(name))  # a tied lm_head's own copy counts as used
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


def save_hf_folder(model: Any, tokenizer: Any, folder: str | Path) -> None:
    """Save a transformers model and tokenizer as a checkpoint folder, without the
    "Writing model shards" progress bar (the tests' and the book's tiny offline checkpoints;
    a bar would land in a built page)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
