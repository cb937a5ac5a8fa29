"""Plots for the server chapter: ``minisrv bench`` results of several server layouts, and
an explorer (with its kernel widget) over the chapter's two HTTP comparisons.

Reads the table of ``minisrv.experiments.server.bench_frame`` (one row per run) and the
repeated runs of ``sim_server_runs``; nothing in the serving core imports this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from minisrv.experiments.server import beyond_spread
from minisrv.viz.explorer import Explorer, Frame, explorer, part_html
from minisrv.viz.style import BookFigure, label_axes, page_figure, styled
from minisrv.viz.widgets import panel

__all__ = ["COMPARED_METRICS", "comparison_explorer", "comparison_widget",
           "plot_bench_comparisons", "plot_metric_per_configuration", "plot_spread"]

_LATENCIES = (("ttft", "TTFT"), ("e2e", "end to end"))
_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")


@styled
def plot_bench_comparisons(frame: pd.DataFrame,
                           comparisons: Mapping[str, Sequence[str]]) -> BookFigure:
    """One row of panels per comparison (title -> the runs compared): output throughput on
    the left, median and p99 latencies (TTFT, end to end) on the right."""
    if not comparisons:
        raise ValueError("comparisons is empty; give at least one title -> runs")
    missing = [r for runs in comparisons.values() for r in runs if r not in frame.index]
    if missing:
        raise ValueError(f"runs {missing} are not in the table; it has {list(frame.index)}")
    n = len(comparisons)
    fig, axes = page_figure(2.4 * n + 0.6, rows=n, cols=2,
                            gridspec_kw={"width_ratios": [1, 2]})
    axes = np.asarray(axes).reshape(n, 2)
    for row, (title, runs) in enumerate(comparisons.items()):
        left, right = axes[row]
        colors = [_COLORS[i % len(_COLORS)] for i in range(len(runs))]
        left.bar(range(len(runs)), frame.loc[list(runs), "out tok/s"], color=colors)
        left.set_xticks(range(len(runs)), runs)
        label_axes(left, title, None, "output (tok/s)")
        width = 0.8 / len(runs)
        groups = [(key, stat) for key, _ in _LATENCIES for stat in ("median", "p99")]
        x = np.arange(len(groups))
        for i, run in enumerate(runs):
            values = [frame.loc[run, f"{key} {stat} (ms)"] for key, stat in groups]
            right.bar(x + (i - (len(runs) - 1) / 2) * width, values, width,
                      color=colors[i], label=run)
        names = dict(_LATENCIES)
        right.set_xticks(x, [f"{names[k]}\n{s}" for k, s in groups])
        label_axes(right, None, None, "latency (ms)")
        right.legend(loc="upper left")
    return fig




# ------------------------------------------------------------ the comparisons' explorer
COMPARED_METRICS: tuple[str, ...] = ("ttft median (ms)", "ttft p99 (ms)", "out tok/s",
                                     "e2e median (ms)", "e2e p99 (ms)", "hit rate")
"""The columns of ``bench_frame`` the explorer offers: what a user waits for (TTFT, end to
end), what the server delivers (output tokens per second), and why (the cache's hit rate)."""
CPU_SIDE, SIM_SIDE = "CityLM on the CPU", "simulated H100"
_HIGHLIGHT, _OTHER = "#4c72b0", "#b8c4d6"


def _check_runs(single: pd.DataFrame, repeated: pd.DataFrame, metric: str) -> None:
    for name, frame in (("single", single), ("repeated", repeated)):
        if metric not in frame.columns:
            raise ValueError(f"{metric!r} is not a column of the {name} runs: "
                             f"{list(frame.columns)}")
    if repeated.index.nlevels != 2:
        raise ValueError("the repeated runs must be indexed by (configuration, repeat), as "
                         "sim_server_runs returns them")


@styled
def plot_metric_per_configuration(single: pd.DataFrame, repeated: pd.DataFrame,
                                  metric: str, title: str = "") -> BookFigure:
    """One metric for every configuration of both comparisons: on the left the runs served
    once each (``bench_frame``: CityLM on the CPU), on the right the median of the repeated
    runs (``sim_server_runs``: the simulated H100) with every run as a dot and the spread
    (min to max) as a whisker."""
    _check_runs(single, repeated, metric)
    names = list(repeated.index.unique(level=0))
    fig, (left, right) = page_figure(3.3, cols=2,
                                     gridspec_kw={"width_ratios": [len(single), len(names)]})
    left.bar(range(len(single)), single[metric], color=_HIGHLIGHT)
    left.set_xticks(range(len(single)), list(single.index))
    # Two-line titles: on one line the narrower panel's title ran past its axes and was cut.
    label_axes(left, f"{CPU_SIDE},\none run each", None, metric)
    _spread_bars(right, repeated, metric)
    runs = repeated.groupby(level=0).size().max()
    label_axes(right, f"{SIM_SIDE},\n{runs} runs each", None, None)
    if metric == "hit rate":
        for ax in (left, right):
            ax.set_ylim(0, 1)
    if title:
        fig.suptitle(title, x=0.02, ha="left")
    return fig


def _spread_bars(ax: Any, repeated: pd.DataFrame, metric: str) -> None:
    """Bars at each configuration's median of ``metric``, every run a dot, min to max a
    whisker: the spread a reader needs to judge a difference."""
    names = list(repeated.index.unique(level=0))
    medians = [repeated.xs(n, level=0)[metric].median() for n in names]
    ax.bar(range(len(names)), medians, color=_HIGHLIGHT)
    for x, name in enumerate(names):
        values = repeated.xs(name, level=0)[metric]
        ax.plot([x, x], [values.min(), values.max()], color="black", lw=1.5)
        ax.plot([x] * len(values), values, "o", color="black", ms=4)
    ax.set_xticks(range(len(names)), [n.replace(", ", ",\n") for n in names])


@styled
def plot_spread(repeated: pd.DataFrame, metrics: Mapping[str, str], title: str) -> BookFigure:
    """One panel per metric (column -> axis label) of the repeated runs of
    ``sim_server_runs``: each configuration's median as a bar, every run as a dot and the
    spread (min to max) as a whisker, so a difference can be read against the noise."""
    missing = [m for m in metrics if m not in repeated.columns]
    if missing or repeated.index.nlevels != 2:
        raise ValueError(f"need runs indexed by (configuration, repeat) with columns "
                         f"{list(metrics)}; missing {missing}")
    fig, axes = page_figure(3.3, cols=len(metrics))
    for ax, (metric, label) in zip(np.atleast_1d(axes), metrics.items(), strict=True):
        _spread_bars(ax, repeated, metric)
        label_axes(ax, None, None, label)
        if metric == "hit rate":
            ax.set_ylim(0, 1)
    runs = repeated.groupby(level=0).size().max()
    fig.suptitle(f"{title}\nbars: median of {runs} runs; dots: each run; whiskers: min to max",
                 x=0.02, ha="left")
    return fig


def _configurations(single: pd.DataFrame, repeated: pd.DataFrame) -> dict[str, tuple[str, str]]:
    """Each configuration as the page names it -> (its comparison, its name there)."""
    out = {f"{CPU_SIDE}: {name}": (CPU_SIDE, name) for name in single.index}
    out |= {f"{SIM_SIDE}: {name}": (SIM_SIDE, name)
            for name in repeated.index.unique(level=0)}
    return out


def _number(value: float, metric: str) -> str:
    return f"{value:.0%}" if metric == "hit rate" else f"{value:,.1f}"


def _against(single: pd.DataFrame, repeated: pd.DataFrame, side: str, chosen: str,
             metric: str) -> tuple[pd.DataFrame, dict[str, float | str], str]:
    """The chosen configuration against the others of its comparison on ``metric``: the
    page's table, the state's numbers, and the caption."""
    if side == CPU_SIDE:
        values = single[metric]
        rows = {name: {"value": _number(v, metric)} for name, v in values.items()}
        metrics: dict[str, float | str] = {"value": float(values[chosen])}
        spread = "one run per layout, so no spread to compare with"
    else:
        grouped = repeated.groupby(level=0, sort=False)[metric]
        values, low, high = grouped.median(), grouped.min(), grouped.max()
        rows = {name: {"median": _number(values[name], metric),
                       "min": _number(low[name], metric), "max": _number(high[name], metric)}
                for name in values.index}
        metrics = {"value": float(values[chosen]), "min": float(low[chosen]),
                   "max": float(high[chosen])}
        beyond = []
        for name in values.index:
            verdict = "-"
            if name != chosen:
                verdict = "yes" if beyond_spread(repeated, metric, chosen, name) else "no"
                metrics[f"beyond {name}"] = verdict
                beyond += [name] if verdict == "yes" else []
            rows[name]["beyond the spread"] = verdict
        others = len(values) - 1
        spread = ("beyond the spread of every other configuration" if len(beyond) == others
                  else "within the spread of every other configuration" if not beyond
                  else "beyond the spread of " + " and ".join(f'"{n}"' for n in beyond))
    base = float(values[chosen])
    for name, v in values.items():
        ratio = float(v) / base if base else None
        rows[name][f"relative to {chosen}"] = "-" if ratio is None else f"{ratio:.2f}"
        if ratio is not None and name != chosen:
            metrics[f"ratio {name}"] = ratio
    # One header row: the corner cell names the comparison and the metric (a named index
    # would add a second, half-empty header row that reads as a row of data).
    table = pd.DataFrame.from_dict(rows, orient="index").rename_axis(
        index=None, columns=f"{side}: {metric}")
    caption = f"{chosen} ({side}), {metric}: {_number(base, metric)}; {spread}."
    return table, metrics, caption


def comparison_explorer(single: pd.DataFrame, repeated: pd.DataFrame,
                        metric: str = "ttft median (ms)",
                        configuration: str = f"{SIM_SIDE}: LPM, radix",
                        metrics: Sequence[str] = COMPARED_METRICS) -> Explorer:
    """``plot_metric_per_configuration`` over the metric, and below it the chosen
    configuration against the others of its comparison, for the page.

    ``single``: the chapter's CityLM runs over HTTP (``bench_frame``, one run per layout);
    ``repeated``: its simulated-H100 runs (``sim_server_runs``). Nothing is served again:
    every state is drawn from these runs. The figure depends on the metric alone, so it is
    drawn once per metric; the table gives each configuration's value and its ratio to the
    chosen one and, for the repeated runs, whether the two differ beyond the spread
    (``beyond_spread``). The kernel face is ``comparison_widget``.
    """
    metrics = list(metrics)
    for m in metrics:
        _check_runs(single, repeated, m)
    configurations = _configurations(single, repeated)
    figures = {m: part_html(plot_metric_per_configuration(single, repeated, m))
               for m in metrics}

    def draw(metric: str, configuration: str) -> Frame:
        side, chosen = configurations[configuration]
        table, numbers, caption = _against(single, repeated, side, chosen, metric)
        return Frame([figures[metric], table], numbers, caption=caption)

    return explorer(draw, [("metric", "metric", metrics, metric),
                           ("configuration", "compared with", list(configurations),
                            configuration)],
                    live=lambda: comparison_widget(single, repeated, metric, configuration))


def comparison_widget(single: pd.DataFrame, repeated: pd.DataFrame,
                      metric: str = "ttft median (ms)",
                      configuration: str = f"{SIM_SIDE}: LPM, radix") -> Any:
    """Menus for any column of the runs and any configuration; each change redraws
    ``plot_metric_per_configuration`` and the comparison table from the same runs (nothing
    is served again). Needs a live kernel (draw the static figure first)."""
    import ipywidgets as widgets
    from IPython.display import display

    columns = [c for c in single.columns if c in repeated.columns
               and pd.api.types.is_numeric_dtype(single[c])]
    configurations = _configurations(single, repeated)
    controls = {"metric": widgets.Dropdown(options=columns, value=metric,
                                           description="metric"),
                "configuration": widgets.Dropdown(options=list(configurations),
                                                  value=configuration,
                                                  description="compared with")}

    def redraw(metric: str, configuration: str) -> None:
        display(plot_metric_per_configuration(single, repeated, metric))
        table, _, caption = _against(single, repeated, *configurations[configuration], metric)
        display(table)
        print(caption)

    return panel(redraw, controls)


# ------------------------------------------------------------ one request through the server
REQUEST_LANES: tuple[tuple[str, str], ...] = (
    ("client", "client"),
    ("http", "HTTP process\n(FastAPI handler,\nFrontend)"),
    ("router", "router\n(DataParallel-\nEngines)"),
    ("worker", "worker\nprocess\n(worker_main)"),
    ("engine", "engine thread\n(EngineLoop)"),
)
"""The lanes of ``request_sequence``: who handles a request in ``minisrv serve``, left to right."""
REQUEST_MESSAGES: tuple[tuple[str, str, str], ...] = (
    ("client", "http", "POST\n/v1/completions"),
    ("http", "http", "validate the body,\nencode the prompt"),
    ("http", "router", "submit(key,\nids, params)"),
    ("router", "worker", "Router.route\npicks a worker;\nSubmit into\nits inbox"),
    ("worker", "http", "Taken(key)"),
    ("worker", "engine", "EngineLoop.submit:\na command\nin its queue"),
    ("engine", "engine", "between two steps:\nadd_request,\nthen step()"),
    ("engine", "http", "StepEvents over the\nworker's pipe: every\nnew token, once per step"),
    ("http", "client", "data: {chunk}\nper token\n(detokenized)"),
    ("engine", "http", "the last step's\nevents:\nfinish_reason set"),
    ("http", "client", "last chunk,\nthen\ndata: [DONE]"),
    ("http", "router", "done(key): the\nworker's load\ndrops"),
)
"""The messages of one streamed completion, in order: (from lane, to lane, label); a message
from a lane to itself is work done there."""


def request_sequence(lanes: Sequence[tuple[str, str]] = REQUEST_LANES,
                     messages: Sequence[tuple[str, str, str]] = REQUEST_MESSAGES) -> Any:
    """A sequence diagram (``graphviz.Digraph``): one column per lane of ``lanes`` (key,
    title), time running down, one row per message of ``messages``; a message from a lane to
    itself is a box on its lifeline. ValueError for a message naming an unknown lane."""
    import graphviz

    from minisrv.viz.style import graph_attrs

    keys = [key for key, _ in lanes]
    for src, dst, label in messages:
        if src not in keys or dst not in keys:
            raise ValueError(f"message {label!r} names a lane not in {keys}: {src} -> {dst}")
    # Labels of a few short lines keep the columns narrow: the diagram is 695 pt wide (936
    # with one-line labels), so the page's column shrinks it by a fifth, not by two fifths,
    # and its 12 pt labels read at about 12 px, not 7. ranksep leaves each label its row.
    g = graphviz.Digraph("request", **graph_attrs(rankdir="TB", nodesep="0.2",
                                                  ranksep="0.4", splines="line"))
    g.attr("node", shape="point", width="0.01", height="0.01", label="")
    rows = [[f"{key}_{row}" for key in keys] for row in range(len(messages) + 2)]
    with g.subgraph() as top:
        top.attr(rank="same")
        for key, title in lanes:
            top.node(f"{key}_0", title, shape="box", style="rounded,filled",
                     fillcolor="#eef3fb", width="0", height="0")
    for row, (src, dst, label) in enumerate(messages, start=1):
        with g.subgraph() as same:
            same.attr(rank="same")
            for key in keys:
                if key == src == dst:
                    same.node(f"{key}_{row}", label, shape="box", style="filled",
                              fillcolor="#fff4e0", width="0", height="0", fontsize="12")
                else:
                    same.node(f"{key}_{row}")
        if src != dst:
            g.edge(f"{src}_{row}", f"{dst}_{row}", label=label, constraint="false")
    last = len(messages) + 1
    with g.subgraph() as bottom:
        bottom.attr(rank="same")
        for key in keys:
            bottom.node(f"{key}_{last}")
    for column in range(len(keys)):  # lifelines, which also keep the lanes in columns
        for row in range(last):
            g.edge(rows[row][column], rows[row + 1][column], style="dashed", arrowhead="none",
                   color="#999999", weight="100")
    for row in range(last + 1):  # left to right in every row
        for a, b in zip(rows[row], rows[row][1:]):
            g.edge(a, b, style="invis")
    return g
