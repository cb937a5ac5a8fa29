"""``Linear``'s oneDNN product with a packed weight: the plain product's numbers, and never a
stale packed copy after the weight changes."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

from minisrv.model import Linear, onednn

pytestmark = pytest.mark.skipif(onednn.ONEDNN_REORDER is None,
                                reason="this torch has no oneDNN weight reorder")


def layer(seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    return Linear(48, 80)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_the_packed_product_equals_the_plain_one(rows: int) -> None:
    lin, x = layer(), torch.randn(rows, 48)
    with torch.inference_mode():
        packed = lin(x)
    assert lin.packed() is not lin.weight  # the packed path ran
    torch.testing.assert_close(packed, F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)


def test_a_changed_weight_is_packed_again() -> None:
    lin, x = layer(), torch.randn(5, 48)
    with torch.inference_mode():
        before = lin(x)
    with torch.no_grad():
        lin.weight.mul_(2)  # an optimizer step changes the weight in place like this
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), 2 * before, rtol=1e-5, atol=1e-5)
    lin.load_state_dict(layer(seed=1).state_dict())
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, layer(seed=1).weight), rtol=1e-5,
                                   atol=1e-5)


def test_a_used_layer_deep_copies_saves_and_trains() -> None:
    lin, x = layer(), torch.randn(3, 48)
    with torch.inference_mode():
        lin(x)
    twin = copy.deepcopy(lin)
    with torch.inference_mode():
        torch.testing.assert_close(twin(x), lin(x))
    torch.save(lin, io.BytesIO())  # the packed copy is not saved with the module
    twin(x).sum().backward()  # gradients on: F.linear, the packed copy untouched
    assert twin.weight.grad is not None


def test_a_weight_made_under_inference_mode_is_used_as_it_is() -> None:
    with torch.inference_mode():
        lin = layer()
        x = torch.randn(4, 48)
        assert lin.packed() is lin.weight
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
