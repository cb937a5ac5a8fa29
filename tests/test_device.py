"""Device discipline: every tensor the model creates is on the model's device, and
``MINISRV_DEVICE`` picks the chapters' device.

A CPU-only machine cannot run CUDA, but it can catch a tensor created without ``device=``:
inside ``with torch.device("meta")`` such a tensor lands on the meta device, and mixing it
with the CPU model's tensors fails (or leaves meta data that cannot be read back).
"""

from __future__ import annotations

import pytest
import torch

from minisrv.book import default_device
from minisrv.kv import KVPool
from minisrv.model import ATTENTION_FUNCTIONS, CityLM, FlatBatch


def run_everything(model: CityLM) -> dict[str, torch.Tensor | list[int]]:
    """Every path the engine uses: both forwards, every flat attention, the pool, the oracle."""
    out: dict[str, torch.Tensor | list[int]] = {}
    cache = model.new_cache()
    ids = torch.tensor([0, 5, 9, 13, 7, 21], dtype=torch.long, device=model.device)
    out["prefill"] = model(ids[:4], cache)
    out["decode"] = model(ids[4:], cache)
    out["generate"] = model.reference_generate([0, 5, 9], 12, ignore_eos=True)
    for kind in ATTENTION_FUNCTIONS:
        pool = KVPool.for_model(model, 32)
        a, b = pool.alloc(5), pool.alloc(3)
        prefill = FlatBatch([[0, 4, 8, 12, 16], [0, 7, 3]], [a, b], model.device)
        out[f"flat_prefill_{kind}"] = model.forward_flat(prefill, pool, attention=kind)
        a, b = a + pool.alloc(1), b + pool.alloc(1)
        decode = FlatBatch([[20], [30]], [a, b], model.device)
        out[f"flat_decode_{kind}"] = model.forward_flat(
            decode, pool, attention=kind, last_only=True
        )
    return out


def test_no_tensor_is_created_off_the_models_device(model: CityLM) -> None:
    """``model``: conftest's random float64 CityLM on the CPU."""
    expected = run_everything(model)
    with torch.device("meta"):  # the default device for any tensor made without device=
        got = run_everything(model)
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[name].device == model.device, name
            assert torch.equal(got[name], value), name
        else:
            assert got[name] == value, name


def test_default_device_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MINISRV_DEVICE", raising=False)
    assert default_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("MINISRV_DEVICE", "  ")
    assert default_device() == ("cuda" if torch.cuda.is_available() else "cpu")


def test_minisrv_device_overrides_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISRV_DEVICE", "cpu")
    assert default_device() == "cpu"
    monkeypatch.setenv("MINISRV_DEVICE", "meta")  # any torch device, not only cpu/cuda
    assert default_device() == "meta"


def test_minisrv_device_that_is_not_a_device_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISRV_DEVICE", "gpu0")
    with pytest.raises(ValueError, match="MINISRV_DEVICE='gpu0' is not a torch device"):
        default_device()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_minisrv_device_cuda_without_a_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISRV_DEVICE", "cuda")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        default_device()


def test_a_batch_built_for_the_cpu_runs_where_the_model_is(model: CityLM) -> None:
    """``FlatBatch`` defaults to the CPU; ``forward_flat`` moves it to the model's device
    (the block mask of the ragged call included), so the same cell runs on a GPU."""
    pool = KVPool.for_model(model, 40)
    ids, slots = [[1, 2, 3], [4, 5]], [pool.alloc(3), pool.alloc(2)]
    on_cpu = FlatBatch(ids, slots)
    assert on_cpu.to("cpu") is on_cpu
    moved = on_cpu.to("meta")
    assert moved.device == torch.device("meta") and on_cpu.device == torch.device("cpu")
    assert all(t.device.type == "meta" for t in (moved.ids, moved.positions, *moved.slots))
    for attention in ("padded", "flex"):
        here = model.forward_flat(FlatBatch(ids, slots, model.device), pool, attention=attention)
        there = model.forward_flat(on_cpu, pool, attention=attention)
        assert there.device == model.device
        assert torch.equal(here, there)
