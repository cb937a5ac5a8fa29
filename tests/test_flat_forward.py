"""Selective batching: one flat forward over many requests equals each request run alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minisrv.configs import CITYLM
from minisrv.kv import KVPool
from minisrv.model import CityLM, FlatBatch, padded_groups

SMALL = CITYLM.with_(name="small", n_layers=2, d_model=32, head_dim=8, d_ff=64, max_seq_len=64)


def random_model() -> CityLM:
    torch.manual_seed(0)
    model = CityLM(SMALL)
    model.reset_parameters(std=0.3)
    return model.to(torch.float64).eval()


MODEL = random_model()

# One request of a mix: (prefix already in the pool, new tokens this step). A prefix of 0
# is a prefill, a single new token after a prefix is a decode, more is a chunk.
request = st.tuples(st.integers(0, 20), st.integers(1, 12))


def run_mix(
    mix: list[tuple[int, int]], attention: str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat-forward logits for the mix, and the same rows from each request run alone."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, SMALL.vocab_size, (p + n,), generator=gen).tolist() for p, n in mix]
    pool = KVPool.for_model(MODEL, 40 * len(mix) + 8)
    pool.alloc(3)  # so request slots do not start at 0
    slots = []
    for (p, n), seq in zip(mix, seqs):
        slots.append(pool.alloc(p + n))
        if p:  # fill the prefix as an earlier step would have
            MODEL.forward_flat(FlatBatch([seq[:p]], [slots[-1][:p]]), pool, attention=attention)
    new_ids = [seq[p:] for (p, _), seq in zip(mix, seqs)]
    got = MODEL.forward_flat(FlatBatch(new_ids, slots), pool, attention=attention)
    with torch.no_grad():
        want = torch.cat([MODEL(torch.tensor(seq))[p:] for (p, _), seq in zip(mix, seqs)])
    return got, want


@settings(max_examples=30, deadline=None)
@given(st.lists(request, min_size=1, max_size=6), st.sampled_from(["loop", "padded"]))
def test_flat_forward_equals_separate_runs(mix: list[tuple[int, int]], attention: str) -> None:
    got, want = run_mix(mix, attention)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-12


@settings(max_examples=20, deadline=None)
@given(st.lists(request, min_size=1, max_size=6))
def test_padded_attention_equals_the_loop(mix: list[tuple[int, int]]) -> None:
    loop, _ = run_mix(mix, "loop", seed=1)
    padded, _ = run_mix(mix, "padded", seed=1)
    assert (loop - padded).abs().max().item() < 1e-12


def test_two_prefills_and_three_decodes_match_the_dense_cache_forward() -> None:
    got, want = run_mix([(0, 9), (0, 7), (5, 1), (12, 1), (3, 1)], "padded")
    assert got.shape == (19, SMALL.vocab_size)
    assert (got - want).abs().max().item() < 1e-12


def test_last_only_returns_each_requests_last_row() -> None:
    pool = KVPool.for_model(MODEL, 30)
    ids = [[1, 5, 7], [2], [3, 4]]
    slots = [pool.alloc(3), pool.alloc(1), pool.alloc(2)]
    full = MODEL.forward_flat(FlatBatch(ids, slots), pool)
    last = MODEL.forward_flat(FlatBatch(ids, slots), pool, last_only=True)
    assert (last - full[[2, 3, 5]]).abs().max().item() < 1e-12


def test_a_flat_forward_touches_only_its_write_slots() -> None:
    pool = KVPool.for_model(MODEL, 12)
    before = pool.k.clone()
    slots = pool.alloc(4)
    MODEL.forward_flat(FlatBatch([[1, 2], [3]], [slots[:2], slots[3:]]), pool)
    changed = (pool.k != before).flatten(2).any(-1).any(0)
    assert changed.nonzero().flatten().tolist() == [0, 1, 3]


@pytest.mark.parametrize(
    ("ids", "slots", "match"),
    [
        ([[1, 2]], [[0]], "only 1 slots"),
        ([[]], [[0]], "no new tokens"),
        ([[1], [2]], [[0]], "slot lists"),
        ([[1], [2]], [[0], [0]], "same KV slot"),
        ([[1]], [[-1]], ">= 0"),
    ],
)
def test_malformed_batches_are_rejected(ids: list, slots: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FlatBatch(ids, slots)


def test_bad_inputs_raise_before_the_pool_is_written() -> None:
    pool = KVPool.for_model(MODEL, 8)
    before = pool.k.clone()
    with pytest.raises(ValueError, match="outside the pool"):
        MODEL.forward_flat(FlatBatch([[1]], [[8]]), pool)
    with pytest.raises(ValueError, match="vocabulary"):
        MODEL.forward_flat(FlatBatch([[999]], [[0]]), pool)
    with pytest.raises(ValueError, match="unknown attention"):
        MODEL.forward_flat(FlatBatch([[1]], [[0]]), pool, attention="flash")
    other = KVPool(SMALL, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="float32"):
        MODEL.forward_flat(FlatBatch([[1]], [[0]]), other)
    assert torch.equal(pool.k, before)


def test_decodes_are_padded_apart_from_the_prefills_before_them() -> None:
    """A mixed step (prefills, then decodes) makes two padded calls, so one long prompt does
    not pad every decode to its length; each group is a slice of the flat rows."""
    lens = [(0, 9), (0, 7), (5, 1), (12, 1), (3, 1)]
    slots, start = [], 0
    for p, n in lens:
        slots.append(list(range(start, start + p + n)))
        start += p + n
    batch = FlatBatch([[2] * n for _, n in lens], slots)
    prefills, decodes = padded_groups(batch, torch.float64)
    assert (prefills.tokens, decodes.tokens) == (slice(0, 16), slice(16, 19))
    assert prefills.bias.shape == (2, 1, 9, 9) and decodes.bias.shape == (3, 1, 1, 13)
    assert prefills.bias.dtype == decodes.bias.dtype == torch.float64
    assert prefills.rows is not None and prefills.rows.tolist() == [*range(9), *range(9, 16)]
    assert decodes.rows is None  # every decode has exactly T_max = 1 new token: no padding
    # a decode may see its whole context and nothing past it
    assert (decodes.bias[0, 0, 0, :6] == 0).all() and (decodes.bias[0, 0, 0, 6:] < 0).all()


def test_a_batch_whose_kinds_alternate_is_padded_as_one_group() -> None:
    batch = FlatBatch([[2], [2, 3, 4], [2]], [[0, 1], [2, 3, 4], [5, 6, 7]])
    (group,) = padded_groups(batch)
    assert group.tokens == slice(0, 5) and group.bias.shape == (3, 1, 3, 3)


def test_the_padded_groups_are_built_once_per_batch_and_dtype() -> None:
    """Every layer asks for the groups; the first ask builds them, an ask in another dtype
    gets its own."""
    batch = FlatBatch([[2], [2, 3]], [[0, 1], [2, 3, 4]])
    first = padded_groups(batch)
    assert padded_groups(batch) is first
    doubles = padded_groups(batch, torch.float64)
    assert doubles is not first and doubles[0].bias.dtype == torch.float64
    assert torch.equal(doubles[0].bias.float(), first[0].bias)
