"""The scheduler chapter's GPU-scale dashboard and its explorer: each state is the run of its
setting, and the rate sweep's kept runs are the ones the table reads."""

from __future__ import annotations

import inspect

from minisrv.experiments.scheduler import SimSetting, rate_runs, rate_sweep
from minisrv.viz import dashboard


def test_the_sim_explorer_shows_each_setting_s_own_run_and_starts_at_the_chapter_s() -> None:
    first = SimSetting(64.0, n=40)
    made = {first: first.run()}  # reused; the other states are simulated
    ex = dashboard.sim_explorer(made, rates=(8, 64), caps=(16, 64), n=40)
    assert ex.default == {"rate": 64.0, "max_running": 64}  # the chapter's figure
    for rate in (8.0, 64.0):
        for cap in (16, 64):
            m = SimSetting(rate, max_running=cap, n=40).run().metrics
            state = ex.metrics(rate=rate, max_running=cap)
            assert (state["throughput"], state["mean_latency"], state["steps"]) == (
                m.throughput, m.mean_latency, m.steps)
    # the cap binds at the higher rate: a quarter of the slots serves fewer tokens per second
    assert ex.metrics(rate=64.0, max_running=16)["throughput"] < ex.metrics(
        rate=64.0, max_running=64)["throughput"]


def test_every_state_of_the_sim_explorer_is_drawn_on_the_same_axes(monkeypatch) -> None:
    """Switching states must move the curves, not the scales: a cap of 16 beside one of 64
    had drawn "running requests" from 0 to 16 in one state and to 70 in the next."""
    seen = []
    real = dashboard.plot_sim_run

    def spy(run, setting, same_axes_as=()):
        fig = real(run, setting, same_axes_as)
        seen.append([(ax.get_xlim(), ax.get_ylim()) for ax in fig.axes])
        return fig

    monkeypatch.setattr(dashboard, "plot_sim_run", spy)
    ex = dashboard.sim_explorer(rates=(8, 64), caps=(16, 64), n=40)
    assert len(seen) == 4 and all(limits == seen[0] for limits in seen)
    # each state's own numbers say whether its queue ever stood
    run = SimSetting(64.0, max_running=16, n=40).run()
    bound = ex.metrics(rate=64.0, max_running=16)
    assert bound["peak_waiting"] == max(step.queued for step in run.trace) > 0
    assert bound["peak_running"] == 16 and 0 < bound["waiting_share"] < 1
    assert ex.metrics(rate=8.0, max_running=64)["waiting_share"] == 0


def test_a_state_whose_smaller_cap_never_held_anyone_back_is_that_run_exactly() -> None:
    """The explorer takes such states from the smaller cap's run instead of simulating
    them: they must equal a fresh simulation in every step, request and metric."""
    low = SimSetting(8.0, max_running=32, n=60)
    runs = {low: low.run()}
    assert all(step.queued == 0 for step in runs[low].trace)  # nobody ever waited
    for cap in (64, 128):
        setting = low._replace(max_running=cap)
        taken, fresh = dashboard.unhindered_run(runs, setting), setting.run()
        assert taken is not None and taken.max_running == cap
        assert taken.metrics == fresh.metrics and taken.trace == fresh.trace
        assert [r.output for r in taken.requests] == [r.output for r in fresh.requests]
    # a run whose cap bound (requests left waiting) serves no larger cap
    busy = SimSetting(64.0, max_running=16, n=60)
    bound = {busy: busy.run()}
    assert any(step.queued for step in bound[busy].trace)
    assert dashboard.unhindered_run(bound, busy._replace(max_running=64)) is None
    assert dashboard.unhindered_run(runs, low._replace(rate=16.0, max_running=64)) is None


def test_the_sim_explorer_takes_the_mode_as_a_third_control() -> None:
    ex = dashboard.sim_explorer(rates=(64,), caps=(64,), modes=("static", "prefill-first"),
                                n=40)
    assert ex.default == {"rate": 64.0, "max_running": 64, "mode": "prefill-first"}
    assert ex.metrics(rate=64.0, max_running=64, mode="static") != ex.metrics(
        rate=64.0, max_running=64, mode="prefill-first")


def test_two_dashboards_drawn_beside_each_other_share_their_axes() -> None:
    static, first = (SimSetting(64.0, mode, n=60) for mode in ("static", "prefill-first"))
    runs = {s: s.run() for s in (static, first)}
    figures = [dashboard.plot_sim_run(runs[s], s, same_axes_as=list(runs.values()))
               for s in (static, first)]
    limits = [[(ax.get_xlim(), ax.get_ylim()) for ax in fig.axes] for fig in figures]
    assert limits[0] == limits[1]
    alone = dashboard.plot_sim_run(runs[first], first)  # static batching takes longer
    assert alone.axes[0].get_xlim()[1] < figures[1].axes[0].get_xlim()[1]


def test_the_sweep_table_reads_one_row_from_each_kept_run() -> None:
    runs = rate_runs(rates=(16, 32), modes=("prefill-first",), n=30)
    assert list(runs) == [SimSetting(16.0, n=30), SimSetting(32.0, n=30)]
    table = rate_sweep(rates=(16, 32), modes=("prefill-first",), n=30)
    assert list(table["rate"]) == [16.0, 32.0]
    assert list(table["throughput"]) == [run.metrics.throughput for run in runs.values()]


def test_rate_runs_reuse_the_runs_they_are_given_and_simulate_only_the_rest() -> None:
    made = SimSetting(16.0, n=30).run()
    runs = rate_runs(rates=(16, 32), modes=("prefill-first",), n=30,
                     runs={SimSetting(16.0, n=30): made,
                           SimSetting(16.0, n=31): None})  # another setting: not taken
    assert runs[SimSetting(16.0, n=30)] is made  # found by its setting, not run again
    fresh = runs[SimSetting(32.0, n=30)]
    assert fresh.metrics.throughput == SimSetting(32.0, n=30).run().metrics.throughput
    assert list(runs) == [SimSetting(16.0, n=30), SimSetting(32.0, n=30)]


def test_the_explorer_s_fixed_values_are_those_of_the_dashboard() -> None:
    page = inspect.signature(dashboard.sim_explorer).parameters
    figure = inspect.signature(dashboard.sim_dashboard).parameters
    for name in ("rate", "mode", "max_running", "output_cv", "seed"):
        assert page[name].default == figure[name].default
    assert page["rate"].default in dashboard.EXPLORER_RATES
    assert page["max_running"].default in dashboard.EXPLORER_CAPS
    assert page["n"].default == dashboard.EXPLORER_REQUESTS


def test_a_state_laid_out_as_the_first_keeps_its_y_labels_on_the_figure() -> None:
    """The explorer lays every state out as its first: a cap of 256 (three-digit ticks) after
    a first state with two-digit ones had pushed "running requests" off the left edge."""
    from minisrv.viz.explorer import _Layouts

    layouts = _Layouts()
    figures = []
    for cap in (16, 256):
        setting = SimSetting(rate=8.0, max_running=cap, n=40)
        fig = dashboard.plot_sim_run(setting.run(), setting)
        layouts.fix(fig)  # the second takes the first's places
        figures.append(fig)
    fig = figures[-1]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    width = fig.bbox.width
    for ax in fig.axes:
        label = ax.yaxis.label
        if label.get_text():
            box = label.get_window_extent(renderer)
            ticks = [t.get_window_extent(renderer) for t in ax.get_yticklabels() if t.get_text()]
            assert 0 <= box.x0 and box.x1 <= width, label.get_text()
            assert all(box.x1 <= t.x0 or box.x0 >= t.x1 for t in ticks), label.get_text()


def test_the_sim_run_title_gives_a_short_time_to_first_token_in_ms() -> None:
    """At a low rate the mean TTFT is tens of ms: "0.0 s" would hide it."""
    setting = SimSetting(8.0, "prefill-first", n=20)
    run = setting.run()
    assert run.metrics.mean_ttft < 1
    title = dashboard.plot_sim_run(run, setting)._suptitle.get_text()
    assert title.endswith(f"mean time to first token {run.metrics.mean_ttft * 1e3:.0f} ms")


def test_the_rate_sweep_draws_the_doubling_rates_on_a_log2_axis() -> None:
    from minisrv.viz.timeline import plot_rate_sweep

    fig = plot_rate_sweep(rate_sweep(rates=(8, 16, 32), modes=("prefill-first",), n=30))
    assert all(ax.get_xscale() == "log" for ax in fig.axes)
    assert [t.get_text() for t in fig.axes[2].get_xticklabels()] == ["8", "16", "32"]


def test_throughput_at_latency_reads_between_the_rates_that_enclose_the_target() -> None:
    """Interpolated in the logarithm of the latency: halfway (geometrically) from 1 s to
    4 s is 2 s, so 2 s reads halfway between the two throughputs."""
    import pandas as pd
    import pytest

    from minisrv.experiments.scheduler import throughput_at_latency

    sweep = pd.DataFrame({"rate": [32.0, 8.0, 16.0], "mode": ["m"] * 3,
                          "mean_latency": [16.0, 1.0, 4.0],
                          "throughput": [3000.0, 1000.0, 2000.0]})
    assert throughput_at_latency(sweep, "m", 2.0) == pytest.approx(1500.0)
    assert throughput_at_latency(sweep, "m", 8.0) == pytest.approx(2500.0)
    assert throughput_at_latency(sweep, "m", 1.0) == pytest.approx(1000.0)
    assert throughput_at_latency(sweep, "m", 100.0) == 3000.0  # never reached: the last
    with pytest.raises(ValueError):
        throughput_at_latency(sweep, "m", 0.5)  # even the lowest rate waits longer


def test_the_latency_throughput_figure_marks_each_mode_where_it_meets_the_target() -> None:
    import pandas as pd

    from minisrv.experiments.scheduler import throughput_at_latency
    from minisrv.viz.timeline import plot_latency_throughput

    sweep = pd.DataFrame({"rate": [8.0, 16.0, 8.0, 16.0], "mode": ["static"] * 2 + ["mixed"] * 2,
                          "mean_latency": [4.0, 30.0, 1.0, 9.0],
                          "throughput": [1500.0, 2200.0, 1600.0, 3100.0]})
    fig = plot_latency_throughput(sweep, 4.0)
    marks = [line for line in fig.axes[0].lines if line.get_marker() == "D"]
    assert [tuple(m.get_xydata()[0]) for m in marks] == [
        (throughput_at_latency(sweep, mode, 4.0), 4.0) for mode in ("static", "mixed")]
