"""The overview's step-by-step run and its explorer: every step is the engine's own, drawn
as it was, and the run's tokens are those each request gets alone."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from minisrv.experiments.overview import ROLES, step_by_step  # noqa: E402
from minisrv.viz import steps as viz  # noqa: E402

QUESTIONS, LENGTHS = ("FR:", "JP:", "IT:"), (5, 3, 4)


@pytest.fixture(scope="module")
def run(citylm):
    model, tok = citylm
    return step_by_step(model, [tok.encode(q) for q in QUESTIONS], LENGTHS, kv_capacity=24,
                        max_running=2)


def test_every_step_is_one_the_engine_ran_and_the_tokens_are_those_alone(run) -> None:
    assert run.identical == len(QUESTIONS) and run.outputs == run.alone
    assert [view.record.index for view in run.steps] == list(range(len(run.steps)))
    assert [len(out) for out in run.outputs] == list(LENGTHS)
    for view in run.steps:
        held = [slot for req in view.requests for slot in req.slots]
        assert len(held) == len(set(held)) and all(0 <= s < run.kv_capacity for s in held)
        for req in view.requests:
            assert req.role in ROLES
            if req.slots:  # a running request holds its prompt and all but its newest token
                assert len(req.slots) == len(run.prompts[req.rid]) + len(req.output) - 1
    last = run.steps[-1].requests
    assert all(req.finished and req.slots == () for req in last)


def test_a_request_waits_then_runs_then_is_done(run) -> None:
    """With two places in the batch the third request waits until one finishes."""
    for rid in range(len(QUESTIONS)):
        roles = [view.requests[rid].role for view in run.steps]
        first = roles.index("prefill")
        assert set(roles[:first]) <= {"waiting"}
        assert roles.count("prefill") == 1
        finish = next(i for i, view in enumerate(run.steps) if view.requests[rid].finished)
        assert set(roles[first + 1:finish + 1]) <= {"decode", "paused"}
        assert set(roles[finish + 1:]) <= {"done"}
    assert run.steps[0].requests[2].role == "waiting"


def test_explorer_holds_every_step_with_the_runs_numbers(citylm, run) -> None:
    model, tok = citylm
    ex = viz.step_explorer(model, tok, QUESTIONS, LENGTHS, step=1, kv_capacity=24,
                           max_running=2)
    assert ex.default == {"step": 1}
    assert sorted(ex.states) == [(i,) for i in range(len(run.steps))]
    for (step,), state in ex.states.items():
        view = run.steps[step]
        assert state["slots_held"] == view.slots_held
        assert state["kv_used"] == view.record.kv_used
        assert state["batch"] == view.record.batch_size
        assert state["tokens_out"] == sum(len(req.output) for req in view.requests)
        assert state["requests_checked"] == len(QUESTIONS)


def test_the_step_table_says_what_each_request_did(citylm, run) -> None:
    _, tok = citylm
    table = viz.step_table(run, 0, tok)
    assert list(table.index) == ["r0", "r1", "r2"]
    assert table.loc["r0", "in this step"].startswith("prefill: 4 tokens")
    assert table.loc["r2", "in this step"] == "waits for a place"
    assert table.loc["r0", "KV slots (in token order)"] == "0-3"
    summary = viz.trace_summary(run)
    assert summary.loc[0, "prefill"] == "r0, r1" and summary.loc[0, "waiting"] == "r2"


def test_the_table_and_caption_name_a_token_and_a_state_as_the_grid_and_trace_do(citylm,
                                                                                 run) -> None:
    """A space is ␣ in the pool's cells, so the table spells it ␣ too (not ``' '``); a request
    the trace calls paused is "paused" in the caption, not "waits" (that is the queue's word)."""
    _, tok = citylm
    outputs = [text for step in range(len(run.steps))
               for text in viz.step_table(run, step, tok)["output so far"]]
    assert any("␣" in text for text in outputs) and not any(" " in text for text in outputs)
    paused = [i for i, view in enumerate(run.steps) if view.record.paused]
    assert paused
    for step in paused:
        caption = viz.step_frame(run, step, tok).caption
        assert "paused" in caption and "wait" not in caption


def test_a_run_that_changed_the_tokens_is_refused(citylm, run) -> None:
    _, tok = citylm
    wrong = run._replace(alone=[[*run.alone[0][:-1], 1], *run.alone[1:]])
    with pytest.raises(RuntimeError, match="only 2 of 3 requests"):
        viz.step_frame(wrong, 0, tok)
    with pytest.raises(ValueError, match="step must be in"):
        viz.step_frame(run, len(run.steps), tok)


def test_the_pool_legend_swatch_is_the_colour_of_the_request_s_held_slots(citylm, run) -> None:
    """A reader matches a legend entry to cells by colour, so each request's swatch is drawn
    exactly as its held (not just written) slots are: same face colour, same alpha."""
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Rectangle

    _, tok = citylm
    fig = viz.plot_kv_pool(run, 1, tok)
    cells = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    white = to_rgba("white", viz.HELD_ALPHA)  # a free slot
    held = {to_rgba(p.get_facecolor()) for p in cells if p.get_alpha() == viz.HELD_ALPHA} - {white}
    swatches = fig.legends[0].get_patches()
    colors = {to_rgba(p.get_facecolor()) for p in swatches[:-1]}  # the last: "written"
    assert held and held <= colors
    assert all(p.get_alpha() == viz.HELD_ALPHA for p in swatches[:-1])
    written = {to_rgba(p.get_facecolor()) for p in cells if p.get_alpha() == viz.WRITTEN_ALPHA}
    assert len(written) == 2  # step 1 writes a slot of r0 and one of r1, each in its colour,
    red, green, blue, alpha = to_rgba(swatches[-1].get_facecolor())  # so "darker" is grey
    assert red == green == blue and alpha == viz.WRITTEN_ALPHA
