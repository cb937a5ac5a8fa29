"""The scheduler chapter's GPU-scale dashboard and its explorer: each state is the run of its
setting, and the rate sweep's kept runs are the ones the table reads."""

from __future__ import annotations

import inspect

from minisrv.experiments.scheduler import SimSetting, rate_runs, rate_sweep
from minisrv.viz import dashboard


def test_the_sim_explorer_shows_each_setting_s_own_run_and_starts_at_the_chapter_s() -> None:
    made = rate_runs(rates=(8, 64), modes=("static",), n=40)  # reused; prefill-first is not
    ex = dashboard.sim_explorer(made, rates=(8, 64), modes=("static", "prefill-first"), n=40)
    assert ex.default == {"rate": 64.0, "mode": "prefill-first"}  # the chapter's figure
    for rate in (8.0, 64.0):
        for mode in ("static", "prefill-first"):
            m = SimSetting(rate, mode, n=40).run().metrics
            state = ex.metrics(rate=rate, mode=mode)
            assert (state["throughput"], state["mean_latency"], state["steps"]) == (
                m.throughput, m.mean_latency, m.steps)
    assert ex.metrics(rate=64.0, mode="static") != ex.metrics(rate=64.0, mode="prefill-first")


def test_the_sweep_table_reads_one_row_from_each_kept_run() -> None:
    runs = rate_runs(rates=(16, 32), modes=("prefill-first",), n=30)
    assert list(runs) == [SimSetting(16.0, n=30), SimSetting(32.0, n=30)]
    table = rate_sweep(rates=(16, 32), modes=("prefill-first",), n=30)
    assert list(table["rate"]) == [16.0, 32.0]
    assert list(table["throughput"]) == [run.metrics.throughput for run in runs.values()]


def test_the_explorer_s_fixed_values_are_those_of_the_dashboard() -> None:
    page = inspect.signature(dashboard.sim_explorer).parameters
    figure = inspect.signature(dashboard.sim_dashboard).parameters
    for name in ("rate", "mode", "max_running", "output_cv", "n", "seed"):
        assert page[name].default == figure[name].default
    assert page["rate"].default in dashboard.EXPLORER_RATES
