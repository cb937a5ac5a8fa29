"""Loading models: the trained CityLM shipped inside the package or a local Llama checkpoint
(``load_model``), and where and in which dtype a model runs."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from minisrv.configs import CITYLM, ModelConfig
from minisrv.model.citylm import CityLM
from minisrv.tokenizer import Tokenizer

if TYPE_CHECKING:
    from minisrv.model.hf import HFTokenizer

WEIGHTS_FILE = "citylm.safetensors"
META_FILE = "citylm.json"
CITYLM_NAME = "citylm"  # the name ``load_model`` knows without a path


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a ``torch.device``; ``None`` means CUDA when available, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def available_devices() -> list[str]:
    """The devices this machine can run the model on: ``"cpu"``, then ``"cuda"`` when a GPU is
    visible. Tests and benchmarks loop over it so the GPU path is exercised wherever it exists.
    """
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


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


def default_dtype(device: torch.device) -> torch.dtype:
    """What a checkpoint runs in on ``device``: bf16 on a GPU that has it, else fp16 on a GPU;
    float32 on the CPU, where half-precision matmuls are slow or missing."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


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
    """
    if str(name_or_path) == CITYLM_NAME:
        return load_citylm(device, dtype if dtype is not None else torch.float32)
    folder = Path(name_or_path)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"cannot load {str(name_or_path)!r}: give {CITYLM_NAME!r} or a local folder with a "
            "Hugging Face checkpoint (config.json, *.safetensors, tokenizer files)"
        )
    from minisrv.model.hf import HFTokenizer, from_hf_llama  # hf imports this module

    target = resolve_device(device)
    target_dtype = dtype if dtype is not None else default_dtype(target)
    model = from_hf_llama(folder, dtype=target_dtype, device=target)
    tokenizer = HFTokenizer.from_folder(folder, model.eos_ids)
    model.eos_ids = tokenizer.eos_ids  # the tokenizer's eos ends a generation too
    return model, tokenizer
