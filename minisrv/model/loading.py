"""Loading models: the trained CityLM shipped inside the package or a local Llama checkpoint
(``load_model``); the tokenizer of either alone (``load_tokenizer``, what a server's
HTTP process needs) lives in ``minisrv.tokenizer``, which imports no torch. Both give a
tokenizer that also serves the server (its chat template, stop ids, whether decoding is
prefix-stable). Devices and dtypes live in ``device``."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

import torch

from minisrv.configs import CITYLM, ModelConfig
from minisrv.model.citylm import CityLM
from minisrv.model.device import available_devices, default_dtype, resolve_device
from minisrv.model.hf import from_hf_llama
from minisrv.tokenizer import HFTokenizer, Tokenizer, checkpoint_folder, load_tokenizer

__all__ = ["CITYLM_NAME", "META_FILE", "WEIGHTS_FILE", "available_devices", "default_dtype",
           "load_citylm", "load_model", "load_shipped", "load_tokenizer", "resolve_device"]

WEIGHTS_FILE = "citylm.safetensors"
META_FILE = "citylm.json"
CITYLM_NAME = "citylm"  # the name ``load_model`` knows without a path


def load_citylm(
    device: str | torch.device | None = None, dtype: torch.dtype = torch.float32
) -> tuple[CityLM, Tokenizer]:
    """The trained CityLM shipped inside the package, in eval mode, and its tokenizer.

    ``device=None`` picks CUDA when available. The model carries the tokenizer
    (``model.tokenizer``: what structured output spells with). The weights are read through
    ``importlib.resources`` so this works from a wheel, an editable install or Colab.
    """
    return load_shipped(WEIGHTS_FILE, META_FILE, CITYLM, device, dtype)


def load_shipped(
    weights_file: str, meta_file: str, base: ModelConfig,
    device: str | torch.device | None = None, dtype: torch.dtype = torch.float32,
) -> tuple[CityLM, Tokenizer]:
    """A model shipped in ``minisrv/weights`` (CityLM, or the speculative-decoding draft):
    its record's config over ``base``, its weights, in eval mode, with CityLM's tokenizer
    (also carried as ``model.tokenizer``)."""
    from safetensors.torch import load as load_safetensors

    weights_dir = resources.files("minisrv") / "weights"
    meta = json.loads((weights_dir / meta_file).read_text(encoding="utf-8"))
    tokenizer = Tokenizer()
    if meta["tokenizer"]["alphabet"] != tokenizer.alphabet:
        raise ValueError(f"{weights_file} was trained with a different tokenizer alphabet")
    # Only fields ModelConfig still has, so older or newer records keep loading.
    known = {field.name for field in dataclasses.fields(ModelConfig)}
    config = base.with_(**{k: v for k, v in meta["config"].items() if k in known})
    model = CityLM(config)
    model.load_state_dict(load_safetensors((weights_dir / weights_file).read_bytes()))
    model.tokenizer = tokenizer
    return model.to(device=resolve_device(device), dtype=dtype).eval(), tokenizer


def load_model(
    name_or_path: str | Path = CITYLM_NAME,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[CityLM, Tokenizer | HFTokenizer]:
    """The model to serve and its tokenizer: the shipped CityLM or a local Llama checkpoint.

    ``"citylm"`` gives ``load_citylm`` (float32 unless ``dtype``). A folder holding a
    Llama-architecture checkpoint (``config.json``, ``*.safetensors`` and the tokenizer's
    files) gives that model through ``from_hf_llama``, in ``default_dtype`` unless
    ``dtype``, with its tokenizer as an ``HFTokenizer``; every eos id the checkpoint names
    (config, generation config, tokenizer) ends a generation. ``device=None`` picks CUDA
    when available. Nothing is downloaded: fetch a hub checkpoint first (e.g. with
    ``huggingface_hub.snapshot_download``) and pass its folder.

    The model carries its tokenizer (``model.tokenizer``), so ``Engine(model)`` serves a
    ``regex``, ``json_schema`` or ``ebnf`` request over this tokenizer's vocabulary with no
    further call (built on the first such request; the ``grammar`` extra is needed then,
    not to load).
    """
    if str(name_or_path) == CITYLM_NAME:
        return load_citylm(device, dtype if dtype is not None else torch.float32)
    folder = checkpoint_folder(name_or_path)
    target = resolve_device(device)
    target_dtype = dtype if dtype is not None else default_dtype(target)
    model = from_hf_llama(folder, dtype=target_dtype, device=target)
    tokenizer = HFTokenizer.from_folder(folder, model.eos_ids)
    model.eos_ids = tokenizer.eos_ids  # the tokenizer's eos ends a generation too
    model.tokenizer = tokenizer  # what the engine's grammar vocabulary is built from
    return model, tokenizer


