"""Shared fixtures: the shipped CityLM (loaded once per session on the CPU), and a random
CityLM on every available device (``DEVICES``) for the engine tests."""

from __future__ import annotations

import pytest
import torch

from minisrv.configs import CITYLM
from minisrv.model import CityLM, available_devices, load_citylm
from minisrv.tokenizer import Tokenizer

DEVICES: list[str] = available_devices()
"""Devices the engine tests run on: the CPU always, CUDA when a GPU is visible."""

LONGEST_FIRST = (
    "02_scheduler.ipynb", "06_routing.ipynb", "05_cache_aware.ipynb",
    "03_selective_batching.ipynb", "03a_chunked_prefill.ipynb", "09_gpu_appendix.ipynb",
    "test_server_faults.py", "04a_host_tier.ipynb", "test_server.py", "04b_pages.ipynb",
    "07a_speculative_decoding.ipynb", "08a_structured_output.ipynb", "04_radix_attention.ipynb",
    "test_server_watchdog.py", "test_spec_engine.py", "test_spec_reference.py", "test_grammar.py",
    "test_explorers.py", "test_notebook_runs.py", "test_server_experiments.py",
    "01_kv_cache.ipynb")
"""The files that take about ten seconds or more of a worker in ``make test``
(``--durations``, two workers, 2026-12-07; 09 moved up when its step-mix explorer made it
about as long as 03a), longest first; the rest follow in collection
order, all shorter.

``make test`` hands files to its workers whole (``--dist loadfile``), in collection order
(``--no-loadscope-reorder``): longest first, so that short files fill both workers' ends.
By xdist's default order (most tests first) the two server files of 17 s and 5 s came
last and left the other worker idle."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the session's files as ``LONGEST_FIRST`` says (a stable sort: each file's tests
    keep their order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def citylm() -> tuple[CityLM, Tokenizer]:
    """The trained model and its tokenizer, as ``load_citylm("cpu")`` returns them."""
    return load_citylm("cpu")


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    """Keep torch to one thread: the tests are small and the CPU is shared."""
    torch.set_num_threads(1)


@pytest.fixture(scope="module", params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Each device of ``DEVICES`` in turn: a test using it (or ``model``) runs once per device."""
    return request.param


@pytest.fixture(scope="module")
def model(request: pytest.FixtureRequest, device: str) -> CityLM:
    """A 2-layer CityLM with random float64 weights on ``device``, for engine tests.

    The weights are scaled up (std 0.3) so that greedy outputs vary from step to step and
    <eos> sometimes wins: the oracle comparison then covers early stops too. A test module
    picks its own seed with a module-level ``MODEL_SEED``. The weights are drawn on the CPU
    and then moved, so every device serves the same model.
    """
    torch.manual_seed(getattr(request.module, "MODEL_SEED", 0))
    cfg = CITYLM.with_(vocab_size=Tokenizer().vocab_size, n_layers=2, d_model=32, n_heads=4,
                       n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=96)
    net = CityLM(cfg).to(torch.float64).eval()
    net.reset_parameters(std=0.3)
    return net.to(device)
