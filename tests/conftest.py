"""Shared fixtures: the shipped CityLM, loaded once per test session on the CPU."""

from __future__ import annotations

import pytest
import torch

from minisrv.configs import CITYLM
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


@pytest.fixture(scope="module")
def model(request: pytest.FixtureRequest) -> CityLM:
    """A 2-layer CityLM with random float64 weights, for engine tests.

    The weights are scaled up (std 0.3) so that greedy outputs vary from step to step and
    <eos> sometimes wins: the oracle comparison then covers early stops too. A test module
    picks its own seed with a module-level ``MODEL_SEED``.
    """
    torch.manual_seed(getattr(request.module, "MODEL_SEED", 0))
    cfg = CITYLM.with_(vocab_size=Tokenizer().vocab_size, n_layers=2, d_model=32, n_heads=4,
                       n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=96)
    net = CityLM(cfg).to(torch.float64).eval()
    net.reset_parameters(std=0.3)
    return net
