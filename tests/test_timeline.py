"""The scheduler chapter's tables and charts read the trace faithfully."""

from __future__ import annotations

import numpy as np

from minisrv.engine import Engine
from minisrv.sim import SimBackend
from minisrv.viz import timeline as tl
from minisrv.workloads import Workload


def notes_run() -> tuple[Engine, list]:
    """The notes' three requests, all arriving at once (the simulated clock is in seconds)."""
    engine = Engine(SimBackend(), kv_capacity=1000, max_running=2)
    reqs = engine.make_requests([[5, 6, 7]] * 3, [3, 5, 3])
    engine.serve(reqs)
    return engine, reqs


def test_trace_table_names_who_did_what() -> None:
    engine, reqs = notes_run()
    table = tl.trace_table(engine.trace, reqs)
    assert list(table.columns) == ["prefill", "decode", "paused", "waiting", "finished", "cost"]
    assert table.loc[0, "prefill"] == "r0, r1" and table.loc[0, "waiting"] == "r2"
    assert table.loc[3, "prefill"] == "r2" and table.loc[3, "paused"] == "r1"
    assert table.loc[5, "finished"] == "r1, r2"
    assert (table.columns.name, table.index.name) == ("step", None)  # one header row
    assert table.drop(columns="cost").columns.name == "step"


def test_trace_compare_stacks_each_run_under_its_label_and_step_count() -> None:
    engine = Engine(SimBackend(), kv_capacity=1000, max_running=2)
    run = engine.run_workload(Workload("w", [[5, 6, 7]] * 3, [3, 5, 3], [0.0] * 3))
    table = tl.trace_compare({"prefill-first": run, "again": run})
    label = f"prefill-first, {len(run.trace)} steps"
    assert list(table.index.get_level_values(0).unique()) == [label,
                                                              f"again, {len(run.trace)} steps"]
    assert table.loc[(label, 0), "prefill"] == "r0, r1" and "cost" not in table.columns
    assert table.columns.name == "mode / step"


def test_request_states_cover_every_step_of_every_request() -> None:
    engine, reqs = notes_run()
    states = tl.request_states(engine.trace, reqs)
    assert states[2] == ["waiting", "waiting", "waiting", "prefill", "decode", "decode"]
    assert states[1] == ["prefill", "decode", "decode", "paused", "decode", "decode"]
    assert states[0] == ["prefill", "decode", "decode", "", "", ""]


def test_metrics_table_rounds_each_run() -> None:
    engine = Engine(SimBackend(), kv_capacity=1000, max_running=2, mode="mixed")
    run = engine.run_workload(Workload("w", [[5, 6]] * 2, [2, 4], [0.0, 0.0]))
    table = tl.metrics_table({"mixed": run.metrics})
    assert table.loc["mixed", "steps"] == 4
    assert table.loc["mixed", "mean batch"] == 1.3  # decode steps of 2, 1 and 1 requests
    assert table.loc["mixed", "mean TTFT (s)"] == round(run.metrics.mean_ttft, 1)
    assert isinstance(table.loc["mixed", "throughput (tok/s)"], (int, np.integer))


def test_widgets_share_one_panel_with_the_book_conventions() -> None:
    from minisrv.viz.widgets import panel, slider

    drawn = []
    controls = {"a": slider(3, 1, 5, "a"), "b": slider(0.5, 0.0, 1.0, "b"),
                "c": slider(64.0, 0, 2.5, "c", log=True)}
    box = panel(lambda a, b, c: drawn.append((a, b, c)), controls)
    assert [type(c).__name__ for c in controls.values()] == [
        "IntSlider", "FloatSlider", "FloatLogSlider"]
    assert all(not c.continuous_update for c in controls.values())
    assert len(box.children) == 3  # two rows of controls, then the output
    controls["a"].value = 4
    assert drawn[-1] == (4, 0.5, 64.0)


def test_both_log_axes_of_the_step_time_plot_carry_numbers() -> None:
    from minisrv.sim import simulate
    from minisrv.workloads import gpu_scale_workload

    work = gpu_scale_workload(n=200, rate=64.0, seed=0)
    runs = {m: simulate(work, mode=m, max_running=64, admission="reserve")
            for m in ("prefill-first", "mixed")}
    fig = tl.plot_step_times(runs, window=(1.0, 1.5))
    fig.draw_without_rendering()
    for ax in fig.axes:
        low, high = ax.get_ylim()
        shown = [t.get_text() for t in ax.yaxis.get_ticklabels()
                 if low <= t.get_position()[1] <= high and t.get_text()]
        # a gap axis spans about one decade: powers of ten alone would label one tick or none
        assert len(shown) >= 3, (ax.get_title(), shown, (low, high))
        assert "log scale" in ax.get_ylabel()
