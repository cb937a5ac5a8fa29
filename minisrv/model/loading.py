"""Loading models: the trained CityLM shipped inside the package, and where a model runs."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

import torch

from minisrv.configs import CITYLM, ModelConfig
from minisrv.model.citylm import CityLM
from minisrv.tokenizer import Tokenizer

WEIGHTS_FILE = "citylm.safetensors"
META_FILE = "citylm.json"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a ``torch.device``; ``None`` means CUDA when available, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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
