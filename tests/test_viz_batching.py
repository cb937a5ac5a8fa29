"""The selective-batching chapter's explorer: each state is the pool experiment at its values,
checked against every request generated alone."""

from __future__ import annotations

import pytest

from minisrv.experiments.batching import run_pool
from minisrv.viz import batching as vb
from minisrv.workloads import citylm_workload


@pytest.fixture(scope="module")
def pool_case(citylm):
    model, tok = citylm
    work = citylm_workload(tok, n=5, output_range=(10, 30), seed=0)
    ref = [model.reference_generate(p, m) for p, m in zip(work.prompts, work.output_lens)]
    return model, work, ref


def test_each_state_is_run_pool_at_its_values(pool_case) -> None:
    model, work, ref = pool_case
    smallest = max(len(p) + m for p, m in zip(work.prompts, work.output_lens))
    capacities = (smallest, 3 * smallest)
    ex = vb.pool_explorer(model, work, ref, capacity=smallest, capacities=capacities,
                          ratios=(0.1, 0.7))
    assert ex.default == {"capacity": smallest, "ratio": 0.7}
    for capacity in capacities:
        for ratio in (0.1, 0.7):
            stats = run_pool(model, work, ref, capacity=capacity, ratio=ratio).engine.stats
            state = ex.metrics(capacity=capacity, ratio=ratio)
            assert (state["steps"], state["retractions"], state["recomputed_tokens"]) == (
                stats.steps, stats.retractions, stats.wasted_tokens)
            assert state["requests_checked"] == len(work.prompts)


def test_the_explorer_starts_at_the_chapter_s_figure() -> None:
    import inspect

    figure = inspect.signature(vb.pool_widget).parameters
    page = inspect.signature(vb.pool_explorer).parameters
    for name in ("capacity", "ratio", "decay", "max_running"):
        assert page[name].default == figure[name].default
    assert figure["capacity"].default in vb.POOL_CAPACITIES
    assert figure["ratio"].default in vb.POOL_RATIOS


def test_a_state_whose_tokens_differ_stops_the_build(pool_case) -> None:
    model, work, ref = pool_case
    wrong = [list(r) for r in ref]
    wrong[2][-1] += 1
    smallest = max(len(p) + m for p, m in zip(work.prompts, work.output_lens))
    with pytest.raises(AssertionError, match="identical to each request alone: 4 of 5"):
        vb.pool_explorer(model, work, wrong, capacity=smallest, capacities=(smallest,),
                         ratios=(0.7,))


def test_a_pool_too_small_for_a_request_is_refused_before_any_run(pool_case) -> None:
    model, work, ref = pool_case
    smallest = max(len(p) + m for p, m in zip(work.prompts, work.output_lens))
    with pytest.raises(ValueError, match=f"choose capacities >= {smallest}"):
        vb.pool_explorer(model, work, ref, capacity=smallest - 1,
                         capacities=(smallest - 1, smallest), ratios=(0.7,))
