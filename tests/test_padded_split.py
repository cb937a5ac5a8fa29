"""The padded attention's decodes cut into groups of similar context (``length_cuts``) give
the uncut attention's numbers and every request's own tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minisrv.engine import Engine
from minisrv.model import FlatBatch, flat_attention_loop
from minisrv.runner import ModelRunner, PaddedAttention, length_cuts
from minisrv.runner.table_batch import TableBatch
from minisrv.sampling import SamplingParams

MODEL_SEED = 3


def padded_slots(lengths: np.ndarray, cuts: list[int]) -> int:
    """Slots the groups gather: each run of ascending ``lengths`` padded to its last."""
    bounds = [0, *cuts, len(lengths)]
    return sum((hi - lo) * int(lengths[hi - 1]) for lo, hi in zip(bounds, bounds[1:]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=80), st.floats(0, 2000))
def test_cuts_are_ordered_few_and_never_cost_more_than_none(lengths: list[int],
                                                            split_cost: float) -> None:
    ordered = np.sort(np.asarray(lengths))
    cuts = length_cuts(ordered, split_cost)
    assert cuts == sorted(set(cuts)) and all(0 < c < len(ordered) for c in cuts)
    assert len(cuts) <= 3  # at most four groups
    extra = split_cost * (len(cuts) + 1) if cuts else 0.0  # the groups and the reordering
    assert padded_slots(ordered, cuts) + extra <= padded_slots(ordered, []) + 1e-9


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=80), st.floats(0, 2000))
def test_no_cut_where_the_padding_cannot_pay_for_one(lengths: list[int],
                                                     split_cost: float) -> None:
    """``PaddedAttention.prepare`` skips sorting and ``length_cuts`` when a step's decodes
    pad no more slots than two groups cost: a cut saves at most that padding, so
    ``length_cuts`` would make none there."""
    ordered = np.sort(np.asarray(lengths))
    padding = len(ordered) * int(ordered[-1]) - int(ordered.sum())
    if padding <= 2 * split_cost:
        assert length_cuts(ordered, split_cost) == []


def test_a_step_whose_padding_cannot_pay_for_a_cut_is_not_sorted(monkeypatch) -> None:
    """64 decodes of contexts 30 and one of 40 pad 630 slots, less than two groups cost at
    CityLM's heads (2 x 2048 slots): ``prepare`` neither sorts them nor asks ``length_cuts``
    (the host work of a CPU decode step); a wide spread still gets its cut."""
    from minisrv.runner.attention import padded

    attn = PaddedAttention("cpu", torch.float32, 32, 2)
    asked = []
    monkeypatch.setattr(padded, "length_cuts", lambda *a: asked.append(a) or [])
    for contexts, cut in (([30] * 63 + [40], False), ([2] * 32 + [500] * 32, True)):
        slots = [list(range(i * 512, i * 512 + c)) for i, c in enumerate(contexts)]
        attn.prepare(TableBatch.of_slots([[0]] * len(slots), slots))
        assert bool(asked) == cut, contexts
        asked.clear()


def test_cuts_split_two_clusters_and_leave_equal_lengths_alone() -> None:
    assert length_cuts(np.array([4] * 10 + [90] * 10), split_cost=10) == [10]
    assert length_cuts(np.full(30, 50), split_cost=0) == []


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=4, max_size=24), st.integers(0, 3),
       st.integers(0, 10_000))
def test_cut_decodes_attend_as_one_request_at_a_time(contexts: list[int], n_prefills: int,
                                                     seed: int) -> None:
    """Prefills first, then decodes of random contexts, their slots scattered over the pool:
    the cut groups (cuts forced by a zero split cost) give ``flat_attention_loop``'s output."""
    gen = torch.Generator().manual_seed(seed)
    n_kv, heads, dim = 2, 4, 8
    lens = [[int(n), 1] for n in torch.randint(2, 9, (n_prefills,), generator=gen)]
    lens += [[c, 1] for c in contexts]
    new = [n if i < n_prefills else 1 for i, (n, _) in enumerate(lens)]
    total = sum(n for n, _ in lens)
    order = torch.randperm(total, generator=gen).tolist()
    slots, at = [], 0
    for n, _ in lens:
        slots.append(order[at:at + n])
        at += n
    batch = FlatBatch([[0] * k for k in new], slots)
    tabled = TableBatch.of_slots([[0] * k for k in new], slots)
    kv = torch.randn(total, 2, n_kv, dim, generator=gen, dtype=torch.float64)
    q = torch.randn(batch.num_tokens, heads, dim, generator=gen, dtype=torch.float64)
    attn = PaddedAttention("cpu", torch.float64, dim, n_kv)
    attn.split_cost = 0.0
    step = attn.prepare(tabled)
    if len(set(contexts)) > 1:
        assert step.order is not None and len(step.groups) > 1 + (n_prefills > 0)
    got = attn.forward(q, kv, step)
    want = flat_attention_loop(q, batch, kv[:, 0], kv[:, 1])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["mixed", "prefill-first"])
def test_an_engine_cutting_every_step_gives_each_request_its_own_tokens(model, mode) -> None:
    prompts = [[0, *range(5, 5 + n)] for n in (1, 9, 2, 14, 3, 20, 1, 6, 11, 4)]
    limits = [3, 17, 9, 5, 21, 8, 13, 2, 11, 16]
    runner = ModelRunner(model, "padded")
    runner.attn.split_cost = 0.0  # cut wherever lengths differ
    engine = Engine(runner, kv_capacity=400, max_running=8, mode=mode)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in limits]
    outputs = engine.generate(prompts, sampling=params)
    for prompt, limit, out in zip(prompts, limits, outputs):
        assert out == model.reference_generate(prompt, limit, ignore_eos=True)
    assert engine.scheduler.memory.kv.free_count == 400


def test_the_cost_of_a_cut_scales_with_the_heads_it_gathers_and_a_gpu_never_cuts() -> None:
    small, large = (PaddedAttention("cpu", torch.float32, 32, 2),
                    PaddedAttention("cpu", torch.float32, 64, 4))
    assert small.split_cost == 4 * large.split_cost
    assert PaddedAttention("cuda", torch.float32, 32, 2).split_cost == float("inf")
