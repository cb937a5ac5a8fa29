"""Plots, tables and a widget for the routing chapter (many workers behind one router).

Everything here reads ``ClusterResult`` objects from ``minisrv.router``; nothing in the
serving core imports this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.patches import Patch

from minisrv.experiments.routing import ClusterResult, hot_group_latency, simulate_cluster
from minisrv.viz.explorer import Explorer, Frame, explorer
from minisrv.viz.style import (
    BookFigure,
    label_axes,
    legend_below,
    one_header_row,
    page_figure,
    styled,
)
from minisrv.viz.widgets import panel
from minisrv.workloads import Workload, prefix_groups_workload

__all__ = [
    "cluster_table",
    "plot_policy_comparison",
    "plot_loads_over_time",
    "plot_threshold_sweep",
    "threshold_sweep",
    "hot_group_draws",
    "spread_table",
    "router_draws",
    "ROUTER_DRAW_COLUMNS",
    "routing_report",
    "routing_runs",
    "runs_report",
    "routing_widget",
    "routing_explorer",
]


def cluster_table(results: Mapping[str, ClusterResult]) -> pd.DataFrame:
    """One row per labelled run: hit rate (percent, one decimal), throughput, latency, load
    ratio, requests per worker. Units are the cluster's clock unit (seconds for simulated GPUs,
    steps for CityLM). The throughput column is labelled "output" since it counts generated
    tokens only, not the prompt tokens some benchmarks add. Latency and request ratio are text
    with two decimals: as numbers, pandas shows a column of 1.0 and 1.1 with one."""
    rows = []
    for label, r in results.items():
        rows.append({
            "run": label,
            "hit rate (%)": round(100 * r.hit_rate, 1),
            f"output tok/{r.time_unit}": _tokens_per_unit(r.throughput),
            f"mean latency ({r.time_unit})": f"{r.mean_latency:.2f}",
            "request ratio": f"{r.request_ratio:.2f}",
            "requests per worker": " / ".join(str(n) for n in r.worker_requests),
        })
    return one_header_row(pd.DataFrame(rows).set_index("run"))


def _tokens_per_unit(throughput: float) -> float | int:
    """Whole tokens where there are hundreds per unit (per simulated second), a tenth
    where there are few (per CityLM step)."""
    return round(throughput) if throughput >= 100 else round(throughput, 1)


@styled
def plot_policy_comparison(results: Mapping[str, ClusterResult], title: str) -> BookFigure:
    """Hit rate and throughput of each labelled run, side by side."""
    fig, (ax_hit, ax_tput) = page_figure(height_in=3.6, cols=2)
    labels = list(results)
    colors = [f"C{i}" for i in range(len(labels))]
    hits = [100 * results[k].hit_rate for k in labels]
    tputs = [results[k].throughput for k in labels]
    unit = next(iter(results.values())).time_unit if results else "s"
    x = np.arange(len(labels))
    for ax, values, name, ylabel, fmt in (
            (ax_hit, hits, "Hit rate", "prefix-cache hit rate (%)", "{:.0f}%"),
            (ax_tput, tputs, "Throughput", f"output tokens/{unit}", "{:,.0f}")):
        bars = ax.bar(x, values, color=colors)
        ax.bar_label(bars, [fmt.format(v) for v in values], padding=2)
        ax.set_xticks([])
        ax.margins(y=0.15)
        label_axes(ax, name, None, ylabel)
    handles = [Patch(color=c, label=k) for c, k in zip(colors, labels, strict=True)]
    legend_below(fig, handles, ncol=min(len(labels), 3))
    fig.suptitle(title, x=0.02, ha="left")
    return fig


@styled
def plot_loads_over_time(results: Mapping[str, ClusterResult], title: str) -> BookFigure:
    """Requests in flight on each worker over time, one panel per labelled run, on one y
    scale (a panel scaled to its own peak made a run with twice the queue look alike)."""
    n = len(results)
    fig, axes = page_figure(height_in=1.4 + 2.2 * n, rows=n, sharex=True, sharey=True,
                            squeeze=False)
    axes = axes[:, 0]
    for ax, (label, r) in zip(axes, results.items(), strict=True):
        for w in range(r.n_workers):
            ax.step(r.load_times, r.load_trace[:, w], where="post", lw=1, color=f"C{w}",
                    label=f"worker {w}")
        counts = ", ".join(str(k) for k in r.worker_requests)
        label_axes(ax, f"{label}: request ratio {r.request_ratio:.2f}; requests {counts}",
                   None, "requests in flight")
    axes[-1].set_xlabel(f"time ({next(iter(results.values())).time_unit})")
    # One row of up to six workers; eight in one row ran past the figure's edges and lost
    # workers 0 and 7, so more than six take two rows.
    workers = max(r.n_workers for r in results.values())
    legend_below(fig, ncol=workers if workers <= 6 else (workers + 1) // 2)
    fig.suptitle(title, x=0.02, ha="left")
    return fig


def threshold_sweep(workload: Any, thresholds: Sequence[float], *, n_workers: int = 4,
                    kv_capacity: int = 10_000, max_running: int = 16,
                    balance_rel_threshold: float = 1.1) -> pd.DataFrame:
    """Cache-aware routing at each ``balance_abs_threshold``, plus round robin; one row each.
    ``inf`` switches balancing off."""
    rows = []
    runs = [("round robin", "round-robin", {})] + [
        (f"cache-aware, abs {t:g}", "cache-aware",
         {"balance_abs_threshold": t, "balance_rel_threshold": balance_rel_threshold})
        for t in thresholds]
    for label, policy, opts in runs:
        r = simulate_cluster(workload, n_workers=n_workers, policy=policy,
                             kv_capacity=kv_capacity, max_running=max_running, **opts)
        rows.append({"run": label, "abs threshold": opts.get("balance_abs_threshold", np.nan),
                     "hit rate": r.hit_rate, "throughput (tok/s)": r.throughput,
                     "mean latency (s)": r.mean_latency, "request ratio": r.request_ratio})
    return pd.DataFrame(rows).set_index("run")


HOT_GROUP_COLUMNS: dict[str, str] = {
    "request ratio": "{:.2f}", "requests balanced": "{:.0f}", "widest gap in flight": "{:.0f}",
    "output tok/s": "{:,.0f}", "hot group's latency (s)": "{:.2f}",
    "other groups' latency (s)": "{:.2f}", "mean latency (s)": "{:.2f}"}
"""The quantities of ``hot_group_draws`` and how ``spread_table`` writes them."""


def hot_group_draws(draws: Sequence[tuple[Workload, Mapping[str, ClusterResult]]],
                    ) -> pd.DataFrame:
    """One row per draw and labelled run (index ``draw``, ``run``): the ``HOT_GROUP_COLUMNS``,
    the requests the balance branch routed and the widest gap in flight (what the absolute
    threshold is compared with) beside the hot group's and the other groups' mean latency by
    ``hot_group_latency``. ``draws``:
    each a workload and its runs, under the same labels in every draw."""
    rows = []
    for draw, (workload, runs) in enumerate(draws):
        for label, r in runs.items():
            hot, others = hot_group_latency(r, workload)
            values = (r.request_ratio, r.decisions.get("balance", 0), r.widest_gap,
                      r.throughput, hot, others, r.mean_latency)
            rows.append({"draw": draw, "run": label, **dict(zip(HOT_GROUP_COLUMNS, values))})
    return pd.DataFrame(rows).set_index(["draw", "run"])


ROUTER_DRAW_COLUMNS: dict[str, str] = {
    "hit rate (%)": "{:.1f}", "misses": "{:.0f}", "over round robin": "{:.2f}"}
"""The quantities of ``router_draws`` and how ``spread_table`` writes them."""


def router_draws(draws: Sequence[Mapping[str, ClusterResult]],
                 baseline: str = "round robin") -> pd.DataFrame:
    """One row per draw and labelled run (index ``draw``, ``run``; the ``baseline`` run left
    out): the ``ROUTER_DRAW_COLUMNS``, the throughput as a multiple of the same draw's
    ``baseline`` run. One draw of arrivals can put two routers either way round; the
    frame's ``spread_table`` shows by how much they move."""
    rows = []
    for draw, runs in enumerate(draws):
        base = runs[baseline].throughput
        for label, r in runs.items():
            if label != baseline:
                values = (100 * r.hit_rate, r.decisions.get("miss", 0), r.throughput / base)
                rows.append({"draw": draw, "run": label,
                             **dict(zip(ROUTER_DRAW_COLUMNS, values))})
    return pd.DataFrame(rows).set_index(["draw", "run"])


def spread_table(per_draw: pd.DataFrame,
                 formats: Mapping[str, str] = HOT_GROUP_COLUMNS) -> pd.DataFrame:
    """``hot_group_draws``' (or, with ``ROUTER_DRAW_COLUMNS``, ``router_draws``') frame summed
    up: for each run (a column) and quantity (a row), the mean over the draws and, in brackets,
    the range (joined by an en dash), so that a reader sees how far one draw is from another.
    Runs as columns keep each cell on one line."""
    runs = list(dict.fromkeys(per_draw.index.get_level_values("run")))
    columns = {}
    for run in runs:
        values = per_draw.xs(run, level="run")
        columns[run] = {quantity: f"{fmt.format(values[quantity].mean())} "
                                  f"({fmt.format(values[quantity].min())}\u2013"
                                  f"{fmt.format(values[quantity].max())})"
                        for quantity, fmt in formats.items()}
    draws = per_draw.index.get_level_values("draw").nunique()
    table = pd.DataFrame(columns).rename_axis(f"mean (range) of {draws} draws")
    return one_header_row(table)


@styled
def plot_threshold_sweep(table: pd.DataFrame, title: str) -> BookFigure:
    """Throughput and hit rate of cache-aware routing against the absolute balance
    threshold, in two panels (not one with two y axes, whose scales would invite comparing
    the heights of two different quantities), with round robin as a dashed line in each."""
    fig, (ax_tput, ax_hit) = page_figure(height_in=3.6, cols=2, sharex=True)
    aware = table[table["abs threshold"].notna()]
    xs = np.arange(len(aware))
    for ax, column, scale, name, ylabel in (
            (ax_tput, "throughput (tok/s)", 1.0, "Throughput", "output tokens/s"),
            (ax_hit, "hit rate", 100.0, "Hit rate", "prefix-cache hit rate (%)")):
        ax.plot(xs, scale * aware[column], "o-", color="C1", label="cache-aware")
        ax.axhline(scale * table.loc["round robin", column], color="C0", ls="--",
                   label="round robin")
        ax.set_xticks(xs, [f"{t:g}" for t in aware["abs threshold"]])
        ax.set_ylim(0, 100 if scale == 100.0 else None)
        label_axes(ax, name, "balance_abs_threshold (inf: off)", ylabel)
    legend_below(fig, ax_tput.get_legend_handles_labels()[0], ncol=2)
    fig.suptitle(title, x=0.02, ha="left")
    return fig


def routing_runs(n: int = 1000, n_workers: int = 4, hot_share: float | None = None,
                 kv_capacity: int = 10_000, rate: float = 300.0, cache_threshold: float = 0.5,
                 balance_abs_threshold: float = 32, balance_rel_threshold: float = 1.1,
                 seed: int = 0, prefix_len: int = 2000,
                 round_robin: ClusterResult | None = None,
                 ) -> tuple[Workload, dict[str, ClusterResult]]:
    """Round robin and cache-aware routing on ``n`` requests of 16 groups of ``prefix_len``-
    token prefixes (``hot_share``: group 0's share, ``None`` for uniform): the workload and the
    two runs. ``round_robin``: this workload's round-robin run, already made, used instead of
    simulating it again (the thresholds do not change where round robin sends a request)."""
    workload = prefix_groups_workload(n=n, rate=rate, mean_output=32, hot_share=hot_share,
                                      prefix_len=prefix_len, seed=seed)
    if round_robin is None:
        round_robin = simulate_cluster(workload, n_workers, "round-robin",
                                       kv_capacity=kv_capacity, max_running=16)
    elif len(round_robin.requests) != n or round_robin.n_workers != n_workers:
        raise ValueError(f"round_robin ran {len(round_robin.requests)} requests on "
                         f"{round_robin.n_workers} workers, not {n} on {n_workers}")
    aware = simulate_cluster(
        workload, n_workers, "cache-aware", kv_capacity=kv_capacity, max_running=16,
        cache_threshold=cache_threshold, balance_abs_threshold=balance_abs_threshold,
        balance_rel_threshold=balance_rel_threshold)
    return workload, {"round robin": round_robin, "cache-aware": aware}


def runs_report(workload: Workload, results: Mapping[str, ClusterResult], title: str,
                prefix_len: int = 2000) -> tuple[pd.DataFrame, BookFigure]:
    """``routing_runs``' runs as a table and their loads over time.

    The table counts the prefixes each run computed again (two runs can find the same share
    cached with their misses on different workers) and each run's length, from the first
    arrival to the last finish: the throughput is the same output tokens over that time, so a
    run of a few hundred requests gains or loses with its last, longest answers. The table's
    ``attrs["arrivals span (s)"]`` is the time from the first arrival to the last. The requests
    per worker are in the figure's panel titles. The request ratio counts requests, not work: a
    hot group's requests are cheap hits, so the worker that limits the run may be another; the
    range of compute time over the workers shows how uneven the work is, and its top is the
    worker that does."""
    table = cluster_table(results).drop(columns="requests per worker")
    table.insert(1, "prefixes computed",
                 [run.prefixes_computed(prefix_len) for run in results.values()])
    table.insert(3, "run length (s)", [f"{run.makespan:.2f}" for run in results.values()])
    table["compute per worker (s)"] = [f"{min(run.worker_busy):.2f}\u2013{max(run.worker_busy):.2f}"
                                       for run in results.values()]
    table.attrs["arrivals span (s)"] = max(workload.arrivals) - min(workload.arrivals)
    return table, plot_loads_over_time(results, title)


def routing_report(n: int = 1000, n_workers: int = 4, hot_share: float | None = None,
                   rate: float = 300.0, prefix_len: int = 2000,
                   **settings: Any) -> tuple[pd.DataFrame, BookFigure]:
    """``routing_runs`` (``settings``: its cache, thresholds and seed) drawn by
    ``runs_report``: what the widget draws for each setting."""
    workload, results = routing_runs(n, n_workers, hot_share, rate=rate, prefix_len=prefix_len,
                                     **settings)
    skew = "uniform groups" if hot_share is None else f"hot group {hot_share:.0%}"
    title = f"{n} requests, {n_workers} workers, {skew}, {rate:g} req/s"
    return runs_report(workload, results, title, prefix_len)


def routing_widget(n: int = 1000, seed: int = 0):
    """Sliders for workers, skew, cache capacity, arrival rate and the three thresholds;
    each change re-simulates ``routing_report`` and redraws. Needs a live kernel."""
    import ipywidgets as widgets
    from IPython.display import display

    style = {"description_width": "initial"}

    def slider(kind, **kw):
        return kind(style=style, continuous_update=False, **kw)

    controls = {
        "n_workers": slider(widgets.IntSlider, value=4, min=1, max=8, description="workers"),
        "hot_share": slider(widgets.FloatSlider, value=0.0, min=0.0, max=0.95, step=0.05,
                            description="hot group's share (0: uniform)"),
        "kv_capacity": slider(widgets.IntSlider, value=10_000, min=4000, max=40_000, step=2000,
                              description="KV cache per worker (tokens)"),
        "rate": slider(widgets.FloatSlider, value=300, min=20, max=600, step=20,
                       description="arrivals (req/s)"),
        "cache_threshold": slider(widgets.FloatSlider, value=0.5, min=0.0, max=1.0, step=0.05,
                                  description="cache_threshold"),
        "balance_abs_threshold": slider(widgets.IntSlider, value=32, min=0, max=512, step=8,
                                        description="balance_abs_threshold"),
        "balance_rel_threshold": slider(widgets.FloatSlider, value=1.1, min=1.0, max=3.0,
                                        step=0.1, description="balance_rel_threshold"),
    }

    def redraw(hot_share: float, **settings: Any) -> None:
        table, fig = routing_report(n, hot_share=hot_share or None, seed=seed, **settings)
        display(table)
        display(fig)

    return panel(redraw, controls, per_row=4)


ROUTING_HOT_SHARES = (0.0, 0.2, 0.4, 0.6, 0.8)
"""Hot shares of the explorer (0: uniform groups): from sixteen equal groups, where following
the cache nearly doubles throughput, through the 40% of the chapter's section on hot prefixes,
to 80%, where round robin keeps the hot prefix in every worker's cache and nearly catches up."""
ROUTING_WORKERS = (2, 3, 4, 6, 8)
"""Workers of the explorer: round robin spreads each group over all of them, so every cache
holds the same few groups at a time and its hit rate stays flat as they multiply, while
cache-aware routing keeps each group on one and gains a cache with every worker."""
ROUTING_BALANCE = ("off", "32", "8")
"""Absolute balance thresholds of the explorer, from following the cache alone ("off") through
the policy's default (32) to balancing at the first small gap (8), which gives locality up."""


def routing_explorer(n: int = 300, seed: int = 0,
                     hot_shares: Sequence[float] = ROUTING_HOT_SHARES,
                     workers: Sequence[int] = ROUTING_WORKERS, n_workers: int = 4,
                     balance: Sequence[str] = ROUTING_BALANCE, default_balance: str = "32",
                     reports: Mapping[tuple[float, int, str], tuple[pd.DataFrame, Any]]
                     | None = None) -> Explorer:
    """``routing_widget`` for the page: ``routing_report`` (round robin against cache-aware
    routing with the widget's default cache and relative threshold) for each hot group's share
    of ``hot_shares`` (0: uniform groups, the default state), each number of ``workers`` and
    each ``balance_abs_threshold`` of ``balance`` ("off": never balance).

    A state simulates ``n`` requests with cache-aware routing, beside the round-robin run of
    its share and workers (made once for all thresholds); 300 keep 75 states within seconds of
    CPU and still show every effect of the chapter's 1,000 or 2,000. ``reports``: reports the
    chapter has already made, by ``(hot_share, n_workers, balance)``, drawn instead of
    simulated again."""
    reports = {} if reports is None else reports
    round_robin: dict[tuple[float, int], ClusterResult] = {}

    def report(hot_share: float, n_workers: int, threshold: str) -> tuple[pd.DataFrame, Any]:
        if (hot_share, n_workers, threshold) in reports:
            return reports[(hot_share, n_workers, threshold)]
        workload, results = routing_runs(
            n, n_workers, hot_share or None, seed=seed,
            balance_abs_threshold=float("inf") if threshold == "off" else float(threshold),
            round_robin=round_robin.get((hot_share, n_workers)))
        round_robin[(hot_share, n_workers)] = results["round robin"]
        skew = "uniform groups" if not hot_share else f"hot group {hot_share:.0%}"
        return runs_report(workload, results, f"{n} requests, {n_workers} workers, {skew}, "
                                              f"balance_abs_threshold {threshold}")

    def draw(hot_share: float, n_workers: int, balance_abs_threshold: str) -> Frame:
        table, figure = report(hot_share, n_workers, balance_abs_threshold)
        tput = next(c for c in table.columns if c.startswith("output tok"))
        numbers = {f"{run} {name}": float(table.loc[run, column]) / scale
                   for run in table.index
                   for name, column, scale in (("hit rate", "hit rate (%)", 100),
                                               ("throughput", tput, 1),
                                               ("request ratio", "request ratio", 1),
                                               ("run length", "run length (s)", 1))}
        for run in table.index:  # the busiest worker's compute: the top of the range
            numbers[f"{run} busiest compute"] = float(
                table.loc[run, "compute per worker (s)"].split("\u2013")[1])
        gain = table.loc["cache-aware", tput] / table.loc["round robin", tput]
        hits = {run: numbers[f"{run} hit rate"] for run in ("cache-aware", "round robin")}
        computed = {run: int(table.loc[run, "prefixes computed"]) for run in hits}
        if f"{hits['cache-aware']:.0%}" == f"{hits['round robin']:.0%}":
            ca, rr = computed["cache-aware"], computed["round robin"]
            each = f"each computes {ca}" if ca == rr else f"they compute {ca} and {rr}"
            found = (f"Both routers find {hits['cache-aware']:.0%} of prompt tokens cached: "
                     f"{each} prefixes again, on different workers. Cache-aware routing's")
        else:
            found = (f"Cache-aware routing finds {hits['cache-aware']:.0%} of prompt tokens "
                     f"cached, round robin {hits['round robin']:.0%}. Its")
        length = {run: float(table.loc[run, "run length (s)"]) for run in hits}
        return Frame([table, figure], numbers,
                     caption=f"{found} throughput is {gain:.2f} times "
                             f"round robin's: the same output tokens in a run of "
                             f"{length['cache-aware']:.1f} s against "
                             f"{length['round robin']:.1f} s.")

    return explorer(draw, [("hot_share", "hot group's share (0%: uniform)", sorted(hot_shares),
                            0.0, ".0%"),
                           ("n_workers", "workers", sorted(workers), n_workers),
                           ("balance_abs_threshold", "balance_abs_threshold", list(balance),
                            default_balance)],
                    live=lambda: routing_widget(n, seed))
