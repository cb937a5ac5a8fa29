"""Shared fixtures: the shipped CityLM, loaded once per test session on the CPU."""

from __future__ import annotations

import pytest
import torch

from minisrv.model import CityLM, load_citylm
from minisrv.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def citylm() -> tuple[CityLM, Tokenizer]:
    """The trained model and its tokenizer, as ``load_citylm("cpu")`` returns them."""
    return load_citylm("cpu")


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    """Keep torch to one thread: the tests are small and the CPU is shared."""
    torch.set_num_threads(1)
