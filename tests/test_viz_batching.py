"""The selective-batching chapter's explorer: each state is the pool experiment at its values,
checked against every request generated alone."""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import pytest

from minisrv.experiments.batching import Admission, PoolRun, run_pool
from minisrv.viz import batching as vb
from minisrv.viz.explorer import Explorer
from minisrv.workloads import citylm_workload


@pytest.fixture(scope="module")
def pool_case(citylm):
    model, tok = citylm
    work = citylm_workload(tok, n=5, output_range=(10, 30), seed=0)
    ref = [model.reference_generate(p, m) for p, m in zip(work.prompts, work.output_lens)]
    return model, work, ref


class PoolStates(NamedTuple):
    """An explorer of twelve states and what building it did: the runs it made itself, by
    their values, with the arguments it made each with, and every state its check saw."""

    explorer: Explorer
    smallest: int  # the tight pool: the largest request's prompt plus limit
    capacities: tuple[int, int]
    ratios: tuple[float, float]
    kept: PoolRun  # the chapter's figure, handed to the explorer
    made: dict[tuple[int, int, float], tuple[tuple, dict, PoolRun]]
    seen: list[str]


CAPS = (1, 2, 5)


@pytest.fixture(scope="module")
def pool_states(pool_case) -> PoolStates:
    """Built once for the module: each state's run is compared with the very run the
    explorer made for it (recorded as ``run_pool`` returned it, with the arguments it was
    called with), where a second ``run_pool`` per state would only repeat a deterministic
    run; the states' checks are recorded by the same build."""
    model, work, ref = pool_case
    smallest = max(len(p) + m for p, m in zip(work.prompts, work.output_lens))
    capacities, ratios = (smallest, 3 * smallest), (0.0, 0.7)
    kept = run_pool(model, work, ref, capacity=smallest, max_running=2)  # the chapter's figure
    made: dict[tuple[int, int, float], tuple[tuple, dict, PoolRun]] = {}
    seen: list[str] = []

    def recorded(*args, **kwargs):
        run = run_pool(*args, **kwargs)
        made[kwargs["capacity"], kwargs["max_running"], kwargs["ratio"]] = (args, kwargs, run)
        return run

    def check(outputs, reference, what):
        assert [list(o) for o in outputs] == [list(r) for r in reference]
        seen.append(what)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vb, "run_pool", recorded)
        ex = vb.pool_explorer(model, work, ref, capacity=smallest, capacities=capacities,
                              caps=CAPS, max_running=2, ratios=ratios, runs=[kept],
                              check=check)
    return PoolStates(ex, smallest, capacities, ratios, kept, made, seen)


def test_each_state_is_run_pool_at_its_values(pool_case, pool_states) -> None:
    """Every state but the kept one is the run ``run_pool`` gave for exactly its values (the
    workload, its reference, the state's pool, cap and ratio, the default decay); the kept
    run serves its own state and is not run again. The state's numbers are that run's."""
    model, work, ref = pool_case
    ex, smallest, kept = pool_states.explorer, pool_states.smallest, pool_states.kept
    assert ex.default == {"capacity": smallest, "max_running": 2, "ratio": 0.7}
    made = dict(pool_states.made)
    assert (smallest, 2, 0.7) not in made  # the chapter's run serves its state
    assert len(made) == len(pool_states.capacities) * len(CAPS) * len(pool_states.ratios) - 1
    for capacity in pool_states.capacities:
        for cap in CAPS:
            for ratio in pool_states.ratios:
                if (capacity, cap, ratio) == (smallest, 2, 0.7):
                    run = kept
                else:
                    args, kwargs, run = made[capacity, cap, ratio]
                    assert args[0] is model and args[1:] == (work, ref)
                    assert kwargs == {"capacity": capacity, "max_running": cap, "ratio": ratio,
                                      "decay": 0.01}
                    assert run.engine.config.ratio_decay == 0.01  # run_pool's own default
                stats = run.engine.stats
                state = ex.metrics(capacity=capacity, max_running=cap, ratio=ratio)
                assert (state["steps"], state["retractions"], state["recomputed_tokens"]) == (
                    stats.steps, stats.retractions, stats.wasted_tokens)
                assert state["requests_checked"] == len(work.prompts)
                assert state["peak_running"] <= cap
                decodes = [len(s.decode) for s in run.engine.trace if s.decode]
                assert state["mean_decode_batch"] == pytest.approx(sum(decodes) / len(decodes))
                assert 1 <= state["mean_decode_batch"] <= cap
                assert state["decode_steps"] == len(decodes)
                assert state["decode_steps_at_cap"] == sum(d == cap for d in decodes)
    # one at a time takes a step per token; a roomy pool with room for all takes fewer
    assert (ex.metrics(capacity=3 * smallest, max_running=5, ratio=0.7)["steps"]
            < ex.metrics(capacity=3 * smallest, max_running=1, ratio=0.7)["steps"])
    # the tight pool at a ratio of 0 admits more boldly and retracts at least as often
    tight = {r: ex.metrics(capacity=smallest, max_running=5, ratio=r) for r in pool_states.ratios}
    assert tight[0.0]["retractions"] >= tight[0.7]["retractions"]


def test_a_run_of_another_ratio_or_decay_is_refused(pool_case) -> None:
    model, work, ref = pool_case
    smallest = max(len(p) + m for p, m in zip(work.prompts, work.output_lens))
    for other in (run_pool(model, work, ref, capacity=smallest, ratio=0.1),
                  run_pool(model, work, ref, capacity=smallest, decay=0.001)):
        with pytest.raises(ValueError, match=r"decay 0.01 and an initial ratio among \[0.7\]"):
            vb.pool_explorer(model, work, ref, capacity=smallest, capacities=(smallest,),
                             caps=(8,), ratios=(0.7,), runs=[other])


def test_the_explorer_and_its_widget_start_at_the_same_state() -> None:
    import inspect

    figure = inspect.signature(vb.pool_widget).parameters
    page = inspect.signature(vb.pool_explorer).parameters
    for name in ("capacity", "ratio", "decay", "max_running"):
        assert page[name].default == figure[name].default
    assert figure["capacity"].default in vb.POOL_CAPACITIES
    assert figure["max_running"].default in vb.POOL_CAPS
    assert figure["ratio"].default in vb.POOL_RATIOS


def test_a_state_whose_tokens_differ_stops_the_build(pool_case) -> None:
    model, work, ref = pool_case
    wrong = [list(r) for r in ref]
    wrong[2][-1] += 1
    smallest = max(len(p) + m for p, m in zip(work.prompts, work.output_lens))
    with pytest.raises(AssertionError, match="identical to each request alone: 4 of 5"):
        vb.pool_explorer(model, work, wrong, capacity=smallest, capacities=(smallest,),
                         caps=(8,), max_running=8, ratios=(0.7,))


def test_a_pool_too_small_for_a_request_is_refused_before_any_run(pool_case) -> None:
    model, work, ref = pool_case
    smallest = max(len(p) + m for p, m in zip(work.prompts, work.output_lens))
    with pytest.raises(ValueError, match=f"choose capacities >= {smallest}"):
        vb.pool_explorer(model, work, ref, capacity=smallest - 1,
                         capacities=(smallest - 1, smallest), caps=(8,), max_running=8)


def test_figure_titles_name_no_machine_and_count_in_the_singular(pool_case) -> None:
    model, work, ref = pool_case
    steps = {"padded": {1: 0.002, 2: 0.003}, "loop": {1: 0.002, 2: 0.004}}
    assert vb.plot_decode_step_times(steps).axes[0].get_title("left") == "One decode step"
    named = vb.plot_decode_step_times(steps, device="cuda").axes[0].get_title("left")
    assert named == "One decode step on cuda"  # a benchmark's report may name it
    # per-request shares differ by factors, so they are read on a log axis
    assert vb.plot_decode_step_times(steps).axes[1].get_yscale() == "log"
    # the step's growth on linear axes; the shares beside the 1/b of a step that stays flat
    left, right = vb.plot_decode_step_times(steps).axes
    assert left.get_xscale() == "linear"
    assert [list(line.get_ydata()) for line in right.get_lines()
            if line.get_label().startswith("1/b")] == [[1.0, 0.5]]
    one = SimpleNamespace(retractions=1, wasted_tokens=34, steps=151)
    assert vb.pool_run_title(one) == "1 retraction, 34 tokens recomputed, 151 steps"
    run = run_pool(model, work, ref, capacity=400, max_running=2)
    assert vb.plot_pool_run(run).axes[0].get_title("left") == vb.pool_run_title(
        run.engine.stats)
    assert vb.pool_run_title(run.engine.stats).startswith("0 retractions, ")
    assert vb.plot_pool_run(run, title="").axes[0].get_title("left") == ""  # a caption says it
    # a ratio of 0 is drawn above the x-axis, not on it
    assert vb.plot_pool_run(run).axes[2].get_ylim()[0] < 0


def test_every_state_goes_through_the_pages_check_and_captions_show_values(
        pool_states) -> None:
    """The page counts the explorer's requests (``check=CHECKS.alone``): every state's
    outputs reach ``check`` with the reference, the kept run's too; a caption shows the
    run's numbers only."""
    ex, smallest = pool_states.explorer, pool_states.smallest
    assert sorted(pool_states.seen) == sorted(
        f"pool explorer, pool {p}, cap {c}, ratio {r:g}"
        for p in pool_states.capacities for c in CAPS for r in pool_states.ratios)
    assert "identical" not in ex.html and " of 5" not in ex.html
    # the caption gives the run's retractions, recomputed tokens and steps (its figure's
    # title), then its mean decode batch and peak of slots
    for cap in (1, 2):
        state = ex.metrics(capacity=smallest, max_running=cap, ratio=0.7)
        retractions = f"{state['retractions']} retraction{'s' * (state['retractions'] != 1)}"
        assert (f"{retractions}, {state['recomputed_tokens']} tokens recomputed, "
                f"{state['steps']} steps; mean decode batch {state['mean_decode_batch']:.2f} "
                f"requests; peak {state['peak_slots']} of {smallest} slots used.") in ex.html


def test_the_ledger_table_shows_each_term_and_what_is_left_after_it() -> None:
    """A decision of 3 running requests at ratio 0.1: the budget line is free less the
    promise, each admitted request takes its need from what is left, and the refused one
    leaves it as it was and says by how much it missed."""
    cands = [{"rid": 7, "prompt": 4, "limit": 31, "need": 35, "left": 80.3, "admitted": True},
             {"rid": 8, "prompt": 4, "limit": 50, "need": 54, "left": 45.3, "admitted": False}]
    decision = Admission(72, 120, 3, 27, 127, 0.1, 93, 93 - 12.7, cands)
    table = vb.ledger_table(decision)
    assert list(table["slots"]) == ["120", "27", "93", "12.7", "35", "54"]
    assert list(table["left for newcomers"]) == ["", "", "93", "80.3", "45.3", "45.3"]
    assert list(table["decision"][-2:]) == ["admitted", "refused: 54 > 45.3"]
    assert table.index[1] == "held by the 3 running requests"
    assert table.index[-1] == "waiting request #8: prompt 4 + limit 50"  # by id, step to step
