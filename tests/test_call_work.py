"""``minisrv.experiments.call_work``: the GPU appendix's counts of each attention call's
work agree with what the backends build for the same step (the padded groups' masks and
slots, the ragged call's block mask, the hybrid's split), on any step of prefills then
decodes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minisrv.experiments import attention_work, hybrid_work, padded_work, ragged_work
from minisrv.model import FLEX_AVAILABLE
from minisrv.runner.attention import HybridAttention, PaddedAttention
from minisrv.runner.table_batch import TableBatch

prefills = st.lists(st.tuples(st.integers(0, 300), st.integers(2, 300)), max_size=4)
decodes = st.lists(st.tuples(st.integers(0, 600), st.just(1)), max_size=12)


def _batch(step) -> TableBatch:
    slots, at = [], 0
    for cached, new in step:
        slots.append(list(range(at, at + cached + new)))
        at += cached + new
    return TableBatch.of_slots([[0] * n for _, n in step], slots)


def _padded_counts(metadata) -> tuple[int, int]:
    return (sum(g.bias[:, 0].numel() for g in metadata.groups),
            sum(g.key_slots.numel() for g in metadata.groups))


@settings(max_examples=40, deadline=None)
@given(prefills, decodes)
def test_the_counts_are_what_the_padded_backend_builds(pre, dec) -> None:
    """Scores and keys: the padded groups' bias and slots, decodes uncut (as on a GPU)."""
    step = pre + dec
    if not step:
        return
    attn = PaddedAttention("cpu", torch.float32, 16, 2)
    attn.split_cost = math.inf  # a GPU's padded call: decodes in one group
    work = padded_work(step)
    assert (work.scores, work.keys) == _padded_counts(attn.prepare(_batch(step)))
    assert work.walk == 0


@pytest.mark.skipif(not FLEX_AVAILABLE, reason="the block mask needs flex_attention")
@settings(max_examples=40, deadline=None)
@given(prefills, decodes)
def test_the_ragged_and_hybrid_counts_are_what_their_backends_build(pre, dec) -> None:
    """The ragged call's touched tiles and busiest walk are its block mask's; the hybrid
    counts its prefill call's block mask and its decode call's padded group."""
    step = pre + dec
    if not step:
        return
    hybrid = HybridAttention("cpu", torch.float32, 16, 2)
    hybrid.decode.split_cost = math.inf
    parts = hybrid.prepare(_batch(step)).parts
    counted = {"scores": 0, "keys": 0, "walk": 0}
    for part in parts:
        if part.backend.kind == "flex":
            mask = part.metadata.block_mask
            per_row = mask.kv_num_blocks[0, 0] + mask.full_kv_num_blocks[0, 0]
            counted["scores"] += int(per_row.sum()) * 128 * 128
            counted["keys"] += part.metadata.key_slots.numel()
            counted["walk"] += int(per_row.max())
        else:
            scores, keys = _padded_counts(part.metadata)
            counted["scores"] += scores
            counted["keys"] += keys
    assert hybrid_work(step)._asdict() == counted
    if not dec:  # prefills only: the hybrid is the ragged call
        assert hybrid_work(step) == ragged_work(step)
    if not pre:  # decodes only: the padded call
        assert hybrid_work(step) == padded_work(step)


def test_the_appendix_mixed_step() -> None:
    """A prefill of 1,000 beside 127 decodes at context 512: whole, the ragged call's last
    query tile holds 103 decodes and walks their 413 key tiles; split, the prefill's tiles
    walk at most 8, and the hybrid computes fewer scores than either call alone."""
    step = [(0, 1000)] + [(512, 1)] * 127
    work = attention_work(step)
    assert work["key tiles walked, ragged call"] == math.ceil(103 * 513 / 128) == 413
    assert work["key tiles walked, hybrid"] == 8
    assert work["scores, hybrid"] < min(work["scores, padded groups"],
                                        work["scores, ragged tiles"])
    assert work["scores needed"] <= work["scores, hybrid"]
    assert work["keys needed"] == 1000 + 127 * 513


def test_a_key_tiles_cost_is_read_back_from_steps_that_follow_their_walk() -> None:
    """Steps of exactly 0.5 ms a key tile give 0.5; the recorded H200 sweep's ragged steps at
    batches 32 to 128 lie within 5% of the fitted cost times their walk."""
    from minisrv.experiments import ms_per_key_tile, recorded_gpu_run

    walks = {b: ragged_work([(512, 1)] * b).walk for b in (32, 64, 128)}
    assert ms_per_key_tile({b: 0.5 * w for b, w in walks.items()}, 512) == pytest.approx(0.5)
    steps = recorded_gpu_run("h200")[0]
    ragged = steps[steps["attention"] == "flex"].set_index("batch")["step_ms"]
    cost = ms_per_key_tile(ragged, 512)
    for b, walk in walks.items():
        assert ragged[b] == pytest.approx(cost * walk, rel=0.05)
