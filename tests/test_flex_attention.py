"""Ragged attention: one flex_attention call over the flat batch, without padding, computes
what the padded call computes, and the engine generates the same tokens with it.

On the CPU flex_attention runs eagerly (its unfused reference implementation); on CUDA
(``DEVICES``) it is compiled to one Triton kernel, so the same tests check the real kernel
there.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisrv.backends import ModelBackend
from minisrv.configs import CITYLM
from minisrv.engine import Engine
from minisrv.kvpool import KVPool
from minisrv.model import (
    FLEX_AVAILABLE,
    CityLM,
    FlatBatch,
    available_devices,
    resolve_attention,
)
from minisrv.model.flat import FLEX_BLOCK_SIZE
from minisrv.tokenizer import Tokenizer

DEVICES = available_devices()  # cpu always, cuda when a GPU is visible

pytestmark = pytest.mark.skipif(not FLEX_AVAILABLE, reason="torch has no flex_attention (< 2.5)")

CFG = CITYLM.with_(name="flex-test", vocab_size=Tokenizer().vocab_size, n_layers=2,
                   d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=320)


def random_model(dtype: torch.dtype, device: str = "cpu") -> CityLM:
    torch.manual_seed(0)
    model = CityLM(CFG)
    model.reset_parameters(std=0.3)
    return model.to(device=device, dtype=dtype).eval()


MODELS: dict[tuple[torch.dtype, str], CityLM] = {}


def model_for(dtype: torch.dtype, device: str) -> CityLM:
    if (dtype, device) not in MODELS:
        MODELS[dtype, device] = random_model(dtype, device)
    return MODELS[dtype, device]


def step_logits(
    model: CityLM, mix: list[tuple[int, int]], attention: str, seed: int = 0
) -> torch.Tensor:
    """Logits of one flat step over ``mix`` ((cached prefix, new tokens) per request).

    Each prefix is first written to the pool by a padded step, as earlier steps would have,
    so the attention under test reads every request's cached KV from the pool.
    """
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, CFG.vocab_size, (p + n,), generator=gen).tolist() for p, n in mix]
    pool = KVPool.for_model(model, sum(p + n for p, n in mix) + 5)
    pool.alloc(5)  # so request slots do not start at 0
    slots = [pool.alloc(p + n) for p, n in mix]
    for (p, _), seq, s in zip(mix, seqs, slots):
        if p:
            model.forward_flat(FlatBatch([seq[:p]], [s[:p]], model.device), pool,
                               attention="padded")
    new_ids = [seq[p:] for (p, _), seq in zip(mix, seqs)]
    return model.forward_flat(FlatBatch(new_ids, slots, model.device), pool, attention=attention)


def expected_mask(mix: list[tuple[int, int]]) -> torch.Tensor:
    """The [T, S_total] mask spelled out: request r's new token at position p sees request
    r's keys at positions 0..p, nothing of any other request."""
    total = sum(p + n for p, n in mix)
    rows = []
    key_start = 0
    for p, n in mix:
        for pos in range(p, p + n):
            row = torch.zeros(total, dtype=torch.bool)
            row[key_start : key_start + pos + 1] = True
            rows.append(row)
        key_start += p + n
    return torch.stack(rows)


request = st.tuples(st.integers(0, 20), st.integers(1, 12))  # (cached prefix, new tokens)


@settings(max_examples=25, deadline=None)
@given(st.lists(request, min_size=1, max_size=6))
def test_mask_mod_is_the_padded_rule_on_the_ragged_layout(mix: list[tuple[int, int]]) -> None:
    from torch.nn.attention.flex_attention import create_mask

    slots, start = [], 0
    for p, n in mix:
        slots.append(list(range(start, start + p + n)))
        start += p + n
    batch = FlatBatch([[1] * n for _, n in mix], slots)
    key_slots, _, _, _, _ = batch.flex_layout()
    assert key_slots.tolist() == [s for req in slots for s in req]  # no padding
    dense = create_mask(batch.flex_mask_mod(), None, None, batch.num_tokens, start)
    assert torch.equal(dense[0, 0], expected_mask(mix))


def test_block_mask_skips_the_tiles_no_request_sees() -> None:
    """Two prefills longer than a tile: the tiles pairing one's queries with the other's
    keys are empty, and the block mask marks exactly the tiles the element mask touches."""
    mix = [(0, 150), (40, 140)]
    slots = [list(range(150)), list(range(150, 330))]
    batch = FlatBatch([[1] * n for _, n in mix], slots)
    _, block_mask = batch.flex_index()
    mask = expected_mask(mix)
    b = FLEX_BLOCK_SIZE
    n_q, n_k = -(-mask.shape[0] // b), -(-mask.shape[1] // b)
    tiles = torch.tensor([[bool(mask[i * b:(i + 1) * b, j * b:(j + 1) * b].any())
                           for j in range(n_k)] for i in range(n_q)])
    assert torch.equal(block_mask.to_dense()[0, 0].bool(), tiles)
    assert not tiles.all()  # some tiles are skipped: the point of a ragged kernel


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=st.lists(request, min_size=1, max_size=6))
def test_flex_equals_padded_in_float32(device: str, mix: list[tuple[int, int]]) -> None:
    model = model_for(torch.float32, device)
    flex = step_logits(model, mix, "flex", seed=1)
    padded = step_logits(model, mix, "padded", seed=1)
    assert flex.shape == padded.shape
    assert (flex - padded).abs().max().item() < 1e-5


def test_flex_equals_each_request_alone_in_float64() -> None:
    """A long prefill beside decodes and a chunk, past one tile, against the dense cache."""
    model = model_for(torch.float64, "cpu")
    mix = [(0, 140), (30, 1), (100, 1), (9, 20), (0, 1)]
    got = step_logits(model, mix, "flex", seed=2)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, CFG.vocab_size, (p + n,), generator=gen) for p, n in mix]
    with torch.no_grad():
        want = torch.cat([model(seq)[p:] for (p, _), seq in zip(mix, seqs)])
    assert (got - want).abs().max().item() < 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_engine_with_flex_generates_the_reference_tokens(device: str) -> None:
    """Greedy outputs through ``Engine`` with the radix cache: flex, padded and each request
    alone give the same tokens (shared prefixes make later prefills read cached KV)."""
    model = model_for(torch.float32, device)
    shared = [0, 5, 9, 13, 7, 21, 30, 2, 44]
    prompts = [shared + [3, 4], shared + [8], [0, 11, 12], shared + [3, 4, 50, 6], [0, 60]]
    lengths = [12, 20, 7, 15, 9]
    outputs = {}
    for attention in ("flex", "padded"):
        engine = Engine(ModelBackend(model, attention=attention), kv_capacity=400,
                        max_running=3, cache="radix")
        outputs[attention] = engine.generate(prompts, max_new_tokens=lengths)
        assert engine.stats.cached_tokens > 0
        engine.scheduler.check_integrity()
    alone = [model.reference_generate(p, n) for p, n in zip(prompts, lengths)]
    assert outputs["flex"] == outputs["padded"] == alone


def test_auto_is_flex_on_cuda_and_padded_on_the_cpu() -> None:
    assert resolve_attention("auto", "cpu", torch.float32) == "padded"
    assert resolve_attention("auto", torch.device("cuda"), torch.bfloat16) == "flex"
    assert resolve_attention("auto", "cuda:0", torch.float32) == "flex"
    assert resolve_attention("auto", "cuda", torch.float64) == "padded"  # no Triton fp64
    assert resolve_attention("flex", "cpu", torch.float32) == "flex"  # asked for: obeyed
    assert ModelBackend(model_for(torch.float32, "cpu")).attention == "padded"


def test_unknown_attention_is_named() -> None:
    with pytest.raises(ValueError, match="unknown attention 'ragged'.*'flex'.*'auto'"):
        resolve_attention("ragged", "cpu", torch.float32)
    with pytest.raises(ValueError, match="unknown attention"):
        ModelBackend(model_for(torch.float32, "cpu"), attention="flash")
