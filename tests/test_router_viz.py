"""The routing chapter's tables and plots: built from real cluster runs, labelled."""

from __future__ import annotations

import math

import pytest

from minisrv.experiments.routing import simulate_cluster
from minisrv.viz import routing as rv
from minisrv.workloads import prefix_groups_workload


def small_runs():
    wl = prefix_groups_workload(n=40, n_groups=3, prefix_len=50, question_range=(2, 4),
                                mean_output=4, rate=20.0, vocab_size=300)
    return wl, {p: simulate_cluster(wl, n_workers=2, policy=p, kv_capacity=150, max_running=4)
                for p in ("round-robin", "cache-aware")}


def test_table_and_plots_describe_the_runs() -> None:
    _, runs = small_runs()
    table = rv.cluster_table(runs)
    assert list(table.index) == ["round-robin", "cache-aware"]
    assert table.loc["cache-aware", "hit rate (%)"] == round(100 * runs["cache-aware"].hit_rate, 1)
    assert table.loc["round-robin", "requests per worker"] == "20 / 20"
    assert table.loc["round-robin", "request ratio"] == "1.00"  # two decimals, not "1.0"
    assert table.columns.name == "run" and table.index.name is None  # one header row
    for label, run in runs.items():  # whole tokens/s where there are hundreds of them
        shown = table.loc[label, "output tok/s"]
        assert abs(shown - run.throughput) <= (0.5 if run.throughput >= 100 else 0.05)
    fig = rv.plot_policy_comparison(runs, "t")
    assert fig._suptitle.get_text() == "t"
    assert all(ax.get_ylabel() for ax in fig.axes)
    loads = rv.plot_loads_over_time(runs, "loads")
    assert len(loads.axes) == 2 and loads.axes[0].get_ylabel() == "requests in flight"
    png, meta = loads._repr_png_()
    assert png[:4] == b"\x89PNG" and meta == {"width": 750}


def test_threshold_sweep_rows() -> None:
    wl, _ = small_runs()
    sweep = rv.threshold_sweep(wl, [math.inf, 1], n_workers=2, kv_capacity=150, max_running=4)
    assert list(sweep.index) == ["round robin", "cache-aware, abs inf", "cache-aware, abs 1"]
    assert sweep["request ratio"].min() >= 1.0
    fig = rv.plot_threshold_sweep(sweep, "sweep")
    assert len(fig.axes) == 2  # two panels, no twin axis
    assert all(ax.get_xlabel().startswith("balance_abs_threshold") for ax in fig.axes)
    assert [ax.get_ylabel() for ax in fig.axes] == ["output tokens/s", "prefix-cache hit rate (%)"]


def test_hot_group_draws_and_their_spread() -> None:
    draws = []
    for seed in (0, 1):
        wl = prefix_groups_workload(n=40, n_groups=3, prefix_len=50, question_range=(2, 4),
                                    mean_output=4, rate=20.0, hot_share=0.6, vocab_size=300,
                                    seed=seed)
        draws.append((wl, {p: simulate_cluster(wl, n_workers=2, policy=p, kv_capacity=150,
                                                max_running=4)
                           for p in ("round-robin", "cache-aware")}))
    per_draw = rv.hot_group_draws(draws)
    assert list(per_draw.index) == [(d, p) for d in (0, 1) for p in ("round-robin", "cache-aware")]
    assert per_draw.loc[(1, "cache-aware"), "output tok/s"] == draws[1][1]["cache-aware"].throughput
    spread = rv.spread_table(per_draw)
    assert list(spread.columns) == ["round-robin", "cache-aware"]
    assert spread.columns.name == "mean (range) of 2 draws" and spread.index.name is None
    ratios = per_draw.xs("cache-aware", level="run")["request ratio"]
    assert spread.loc["request ratio", "cache-aware"] == (
        f"{ratios.mean():.2f} ({ratios.min():.2f}\u2013{ratios.max():.2f})")


def test_the_routing_explorer_states_are_the_report_of_each_hot_share_workers_and_threshold(
) -> None:
    given = rv.routing_report(60, n_workers=3)
    assert list(given[0].columns) == ["hit rate (%)", "prefixes computed", "output tok/s",
                                      "run length (s)", "mean latency (s)", "request ratio",
                                      "compute per worker (s)"]
    ex = rv.routing_explorer(n=60, hot_shares=(0.0, 0.6), workers=(2, 3), n_workers=3,
                             balance=("off", "32", "8"), reports={(0.0, 3, "32"): given})
    # uniform groups, the policy's default threshold
    assert ex.default == {"hot_share": 0.0, "n_workers": 3, "balance_abs_threshold": "32"}
    for hot_share in (0.0, 0.6):
        for workers in (2, 3):
            for balance, threshold in (("off", math.inf), ("32", 32), ("8", 8)):
                table, _ = rv.routing_report(60, n_workers=workers, hot_share=hot_share or None,
                                             balance_abs_threshold=threshold)
                state = ex.metrics(hot_share=hot_share, n_workers=workers,
                                   balance_abs_threshold=balance)
                for run in ("round robin", "cache-aware"):
                    assert state[f"{run} hit rate"] == table.loc[run, "hit rate (%)"] / 100
                    assert state[f"{run} throughput"] == table.loc[run, "output tok/s"]
                    assert state[f"{run} request ratio"] == float(table.loc[run,
                                                                            "request ratio"])
                    assert state[f"{run} busiest compute"] == float(
                        table.loc[run, "compute per worker (s)"].split("\u2013")[1])
    # a hot group keeps its prefix in every worker's cache, even under round robin
    hot, uniform = ({"hot_share": share, "n_workers": 3, "balance_abs_threshold": "32"}
                    for share in (0.6, 0.0))
    assert ex.metrics(**hot)["round robin hit rate"] > ex.metrics(**uniform)["round robin hit rate"]
    with pytest.raises(ValueError, match="default 0.0 is not one of"):
        rv.routing_explorer(n=60, hot_shares=(0.4, 0.8))


def test_routing_runs_reuses_a_round_robin_run_only_of_the_same_shape() -> None:
    workload, runs = rv.routing_runs(40, n_workers=2, hot_share=0.5)
    again, reused = rv.routing_runs(40, n_workers=2, hot_share=0.5, balance_abs_threshold=8,
                                    round_robin=runs["round robin"])
    assert reused["round robin"] is runs["round robin"] and again.prompts == workload.prompts
    fresh = rv.routing_runs(40, n_workers=2, hot_share=0.5, balance_abs_threshold=8)[1]
    assert fresh["round robin"].workers == runs["round robin"].workers  # thresholds: no effect
    assert fresh["cache-aware"].workers == reused["cache-aware"].workers
    with pytest.raises(ValueError, match="not 40 on 3"):
        rv.routing_runs(40, n_workers=3, round_robin=runs["round robin"])


def test_the_routing_report_counts_prefixes_computed_each_runs_length_and_busiest_worker() -> None:
    table, _ = rv.routing_report(60, n_workers=3, hot_share=0.6, prefix_len=500, seed=1)
    workload = prefix_groups_workload(n=60, rate=300.0, mean_output=32, hot_share=0.6,
                                      prefix_len=500, seed=1)
    runs = {"round robin": simulate_cluster(workload, 3, "round-robin", kv_capacity=10_000,
                                            max_running=16),
            "cache-aware": simulate_cluster(workload, 3, "cache-aware", kv_capacity=10_000,
                                            max_running=16, balance_abs_threshold=32,
                                            balance_rel_threshold=1.1)}
    for name, run in runs.items():
        assert table.loc[name, "prefixes computed"] == run.prefixes_computed(500)
        assert table.loc[name, "run length (s)"] == f"{run.makespan:.2f}"
        idlest, busiest = map(float, table.loc[name, "compute per worker (s)"].split("\u2013"))
        assert busiest == pytest.approx(max(run.worker_busy), abs=0.005)
        assert idlest == pytest.approx(min(run.worker_busy), abs=0.005)
        assert max(run.worker_busy) <= run.makespan + 1e-9  # no worker computes longer than the run
    groups = len({tuple(p[:500]) for p in workload.prompts})  # each group's first computes it
    assert groups <= table.loc["cache-aware", "prefixes computed"]
    arrivals = workload.arrivals
    assert table.attrs["arrivals span (s)"] == pytest.approx(max(arrivals) - min(arrivals))


def test_router_draws_give_each_run_over_its_own_draws_baseline() -> None:
    draws = []
    for seed in (0, 1):
        workload = prefix_groups_workload(n=30, n_groups=3, prefix_len=20, mean_output=4,
                                          rate=20.0, seed=seed)
        draws.append({label: simulate_cluster(workload, n_workers=2, policy=policy,
                                              kv_capacity=200, max_running=4, **opts)
                      for label, policy, opts in (("round robin", "round-robin", {}),
                                                  ("tree", "cache-aware", {}),
                                                  ("caches", "cache-aware",
                                                   {"match_source": "caches"}))})
    per_draw = rv.router_draws(draws)
    assert list(per_draw.index) == [(d, r) for d in (0, 1) for r in ("tree", "caches")]
    for d, runs in enumerate(draws):
        row = per_draw.loc[(d, "caches")]
        assert row["over round robin"] == pytest.approx(
            runs["caches"].throughput / runs["round robin"].throughput)
        assert row["hit rate (%)"] == pytest.approx(100 * runs["caches"].hit_rate)
        assert row["misses"] == runs["caches"].decisions.get("miss", 0)
    spread = rv.spread_table(per_draw, rv.ROUTER_DRAW_COLUMNS)
    assert list(spread.index) == list(rv.ROUTER_DRAW_COLUMNS) and list(spread.columns) == [
        "tree", "caches"]
    over = per_draw.xs("tree", level="run")["over round robin"]
    assert spread.loc["over round robin", "tree"] == (
        f"{over.mean():.2f} ({over.min():.2f}\u2013{over.max():.2f})")

