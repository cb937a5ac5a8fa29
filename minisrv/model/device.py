"""Where a model runs and in which dtype: the device a ``None`` means, the devices this
machine has, and the dtype a checkpoint runs in on each. A module of its own, so that the
loaders (``loading``, ``hf``) both read it and neither imports the other's caller."""

from __future__ import annotations

import torch

__all__ = ["available_devices", "default_dtype", "resolve_device"]


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


def default_dtype(device: torch.device) -> torch.dtype:
    """What a checkpoint runs in on ``device``: bf16 on a GPU that has it, else fp16 on a GPU;
    float32 on the CPU, where half-precision matmuls are slow or missing."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
