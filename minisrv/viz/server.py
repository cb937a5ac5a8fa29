"""Plots for the server chapter: the repeated runs of ``sim_server_runs`` with their spread,
the latency-throughput curves and goodput of ``policy_rate_sweep``, and an explorer (with its kernel
widget) over the request rate and the TTFT target (the requests as bars in time are in
``minisrv.viz.server_waterfall``).

Reads the tables of ``minisrv.experiments.server``; nothing in the serving core imports this
module. The sequence diagram of one request (``request_sequence``) is drawn here too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from minisrv.experiments.server_sweep import completion_rate, goodput, slo_attainment
from minisrv.viz import marks
from minisrv.viz.explorer import Explorer, Frame, explorer
from minisrv.viz.server_labels import LABEL_PLACES, place_labels
from minisrv.viz.style import BookFigure, label_axes, page_figure, styled
from minisrv.viz.widgets import panel

__all__ = ["plot_policy_rate_sweep", "plot_spread", "rate_explorer", "rate_widget"]

_HIGHLIGHT = "#4c72b0"
_COLORS = {"LPM": "#4c72b0", "FCFS allocate-each": "#dd8452",
           "FCFS lock-first (SGLang)": "#55a868", "FCFS no-cache": "#7f7f7f"}
_MARKERS = {"LPM": "o", "FCFS allocate-each": "s", "FCFS lock-first (SGLang)": "^",
            "FCFS no-cache": "D"}
"""A marker shape per configuration: where curves' points coincide (the lowest rate), the
shapes still tell them apart."""


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


# ------------------------------------------------------------ the request-rate explorer
def _color(name: str) -> str:
    return _COLORS.get(name, "#8172b3")


def _marker(name: str, names: Sequence[str]) -> str:
    """``name``'s marker: its own, or for a configuration not in ``_MARKERS`` one by its
    place in ``names`` that no named configuration uses."""
    spare = [m for m in "ovPXp*h" if m not in _MARKERS.values()]
    return _MARKERS.get(name, spare[list(names).index(name) % len(spare)])


@styled
def plot_policy_rate_sweep(sweep: pd.DataFrame, ttft_slo_ms: float) -> BookFigure:
    """Left: each configuration's TTFT p99 against its output throughput, one point per
    request rate of ``policy_rate_sweep`` (the latency-throughput curve), the points of the
    lowest, the middle and the highest rate labelled with it (``_labelled_rates``; one grey
    label where several curves' points of a rate coincide), the target dashed; right: its
    goodput at that TTFT target against the rate offered, beside the rate itself (every request
    meets the target). Each configuration has its own colour and marker shape (``_MARKERS``),
    so that points that coincide stay apart. One legend above both panels, where no curve or
    target line runs."""
    _check_sweep(sweep)
    good = goodput(sweep, ttft_slo_ms)
    fig, (left, right) = page_figure(3.6, cols=2)
    labelled = _labelled_rates(sweep.index.unique(level=1))
    names = list(sweep.index.unique(level=0))
    for name in names:
        rows = sweep.xs(name, level=0)
        marker = _marker(name, names)
        left.plot(rows["out tok/s"], rows["ttft p99 (ms)"], "-", marker=marker, mfc="none",
                  color=_color(name))
        for rate, x, y in zip(rows.index, rows["out tok/s"], rows["ttft p99 (ms)"],
                              strict=True):
            if rate not in labelled:
                continue
            left.annotate(f"{rate:g}", (x, y), textcoords="offset points",
                          xytext=LABEL_PLACES[0], fontsize=8, color=_color(name))
        right.plot(rows.index, good.xs(name, level=0), "-", marker=marker, mfc="none",
                   color=_color(name), label=name)
    left.axhline(ttft_slo_ms, color="black", ls="--", lw=1)
    left.set_yscale("log")
    left.margins(x=0.08, y=0.1)  # room for the labels of the first and last points
    label_axes(left, "latency against throughput", "output (tok/s); labels: req/s offered",
               "TTFT p99 (ms)")
    rates = sweep.index.unique(level=1)
    right.plot(rates, rates, ":", color="gray", label="offered")
    label_axes(right, f"goodput, TTFT <= {ttft_slo_ms:g} ms", "requests offered per second",
               "requests per second meeting it")
    handles, labels = right.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncol=len(handles))
    place_labels(fig, left.texts)
    return fig


def _labelled_rates(rates: Sequence[float]) -> set[float]:
    """The rates labelled: lowest, middle, highest. Seven labels a curve stood in columns and
    under the chosen rate's ring; the ring and the table name the other rates."""
    ordered = sorted(rates)
    return {ordered[0], ordered[len(ordered) // 2], ordered[-1]}


def _check_sweep(sweep: pd.DataFrame) -> None:
    need = {"out tok/s", "ttft median (ms)", "ttft p99 (ms)", "hit rate", "ttfts (ms)",
            "duration (s)"}
    if sweep.index.nlevels != 2 or not need <= set(sweep.columns):
        raise ValueError(f"need policy_rate_sweep's table, indexed by (configuration, rate) with "
                         f"columns {sorted(need)}; got {list(sweep.columns)}")


def _rate_table(sweep: pd.DataFrame, rate: float, ttft_slo_ms: float) -> str:
    """Per configuration, its row at the chosen ``rate`` of the sweep, as HTML: the requests it
    completed per second, its goodput at ``ttft_slo_ms`` and the share of its requests that met
    that target, TTFT median and p99 and hit rate (the figure has the throughput): what the
    table under the explorer's figure shows. Completed beside goodput, so a reader can tell a
    server that falls behind the rate offered from one that keeps up but misses the target.
    The chosen rate's rows alone: every rate's, the chosen one highlighted, made a table of 21
    rows that a reader scanned for three."""
    if rate not in sweep.index.unique(level=1):
        raise ValueError(f"{rate:g} requests/s is not a rate of the sweep")
    table = pd.DataFrame({
        "completed (req/s)": completion_rate(sweep).map("{:.1f}".format),
        f"goodput (req/s), TTFT <= {ttft_slo_ms:g} ms":
            goodput(sweep, ttft_slo_ms).map("{:.1f}".format),
        "met the target": slo_attainment(sweep, ttft_slo_ms).map("{:.0%}".format),
        "TTFT median (ms)": sweep["ttft median (ms)"].map("{:,.0f}".format),
        "TTFT p99 (ms)": sweep["ttft p99 (ms)"].map("{:,.0f}".format),
        "hit rate": sweep["hit rate"].map("{:.2f}".format)}).reindex(sweep.index)
    at = table.xs(rate, level=1)  # the rate names the header's corner: one header row
    return at.rename_axis(index=None, columns=f"at {rate:g} req/s offered").to_html(border=0)


MARK_COLOR = "#212529"
"""The chosen rate's marks on the explorer's figure: near black, a color no curve uses."""


def _rate_marks(fig: BookFigure, sweep: pd.DataFrame) -> dict[float, str]:
    """For each rate of ``sweep``, the marks laid over ``fig``'s image
    (``plot_policy_rate_sweep``, in a ``marks.figure_box``) that show the rate, and the box's
    end: a ring round each configuration's point of that rate on the latency curve (left), the
    rate written once beside the highest ring where the figure does not label it (a label per
    ring stacked up where the rings lie close), a vertical line at the rate on the goodput
    panel (right). The explorer draws the figure once per target; once per target and rate
    would cost seven times the drawing."""
    left, right = fig.axes
    labelled = _labelled_rates(sweep.index.unique(level=1))
    out = {}
    for rate in sweep.index.unique(level=1):
        points = list(sweep.xs(rate, level=1)[["out tok/s", "ttft p99 (ms)"]]
                      .itertuples(index=False))
        rings = [marks.ring(fig, left, x, y, MARK_COLOR) for x, y in points]
        top = max(points, key=lambda p: p[1])  # the highest ring: its label is clear of the others
        label = "" if rate in labelled else _ring_label(fig, left, *top, rate)
        out[rate] = "".join([*rings, label, marks.vline(fig, right, rate, MARK_COLOR),
                             marks.CLOSE])
    return out


def _ring_label(fig: BookFigure, ax: Any, x: float, y: float, rate: float) -> str:
    """The rate written beside a ring, above and to the left, where the figure labels
    only the lowest, middle and highest rates (``_labelled_rates``): the curves run up and
    to the right, so the upper left of a point is where they are not."""
    left, top = marks._place(fig, ax, x, y)
    return (f'<div style="position:absolute;left:{left:.2f}%;top:{top:.2f}%;margin:-26px 0 0 '
            f'-30px;width:20px;text-align:right;font:bold 11px sans-serif;'
            f'color:{MARK_COLOR}">{rate:g}</div>')


def _verdict(goodputs: pd.Series) -> str:
    """Which configurations of ``goodputs`` (name -> requests per second meeting the target, as
    the caption prints them) serve the most: those within 5% of the highest serve alike, so
    46.6 against 45.6 reads as a tie, not as a winner."""
    near = [name for name, v in goodputs.items() if v >= 0.95 * goodputs.max()]
    if len(near) == len(goodputs):
        return f"{'both' if len(near) == 2 else 'all'} serve alike (within 5%)"
    if len(near) == 1:
        return f"{near[0]} serves the most"
    return f"{' and '.join(near)} serve alike (within 5%), the most"


def rate_explorer(sweep: pd.DataFrame, slos_ms: Sequence[float], rate: float,
                  ttft_slo_ms: float) -> Explorer:
    """``plot_policy_rate_sweep`` for each TTFT target of ``slos_ms``, the chosen rate marked
    on both panels, and under it every configuration's goodput, TTFT and hit rate at that
    rate, drawn from ``policy_rate_sweep``'s table (nothing is simulated again). The figure
    depends on the target alone, so it is drawn once per target, not once per state; the
    rate's marks are laid over it. The kernel face is ``rate_widget``."""
    _check_sweep(sweep)
    rates = list(sweep.index.unique(level=1))
    figures = {}
    for slo in slos_ms:
        fig = plot_policy_rate_sweep(sweep, slo)
        box = marks.figure_box(fig)  # draws it, laying the axes out
        figures[slo] = (box, _rate_marks(fig, sweep))

    def draw(rate: float, ttft_slo_ms: float) -> Frame:
        good = goodput(sweep, ttft_slo_ms).xs(rate, level=1)
        numbers = {f"goodput {name}": float(v) for name, v in good.items()}
        numbers |= {f"ttft p99 {name}": float(v)
                    for name, v in sweep.xs(rate, level=1)["ttft p99 (ms)"].items()}
        shown = good.map("{:.1f}".format)  # as the caption prints them: ties read as ties
        verdict = _verdict(shown.astype(float))
        caption = (f"{rate:g} requests/s offered, TTFT target {ttft_slo_ms:g} ms: "
                   + ", ".join(f"{name} {v}" for name, v in shown.items())
                   + f" requests/s meet it; {verdict}.")
        box, marks = figures[ttft_slo_ms]
        return Frame([box, marks[rate], _rate_table(sweep, rate, ttft_slo_ms)], numbers,
                     caption=caption)

    return explorer(draw, [("rate", "requests/s", rates, rate),
                           ("ttft_slo_ms", "TTFT target (ms)", list(slos_ms), ttft_slo_ms)],
                    live=lambda: rate_widget(sweep, rate, ttft_slo_ms))


def rate_widget(sweep: pd.DataFrame, rate: float, ttft_slo_ms: float) -> Any:
    """A menu of the sweep's rates and a slider for any TTFT target; each change redraws
    ``plot_policy_rate_sweep``, the rate marked on both panels, and the table from the same
    runs. Needs a live kernel."""
    import ipywidgets as widgets
    from IPython.display import HTML, display

    controls = {"rate": widgets.Dropdown(options=list(sweep.index.unique(level=1)),
                                         value=rate, description="requests/s"),
                "ttft_slo_ms": widgets.FloatLogSlider(value=ttft_slo_ms, base=10, min=1,
                                                      max=3.5, description="TTFT target")}

    def redraw(rate: float, ttft_slo_ms: float) -> None:
        fig = plot_policy_rate_sweep(sweep, ttft_slo_ms)
        left, right = fig.axes  # the rate marked as the page's explorer marks it
        at = sweep.xs(rate, level=1)
        left.plot(at["out tok/s"], at["ttft p99 (ms)"], "o", ms=13, mfc="none", mew=2,
                  color=MARK_COLOR)
        right.axvline(rate, color=MARK_COLOR, lw=2, alpha=0.8)
        display(fig)
        display(HTML(_rate_table(sweep, rate, ttft_slo_ms)))

    return panel(redraw, controls)


# ------------------------------------------------------------ one request through the server
REQUEST_LANES: tuple[tuple[str, str], ...] = (
    ("client", "client"),
    ("http", "HTTP process:\nFastAPI handler,\nFrontend"),
    ("router", "HTTP process:\nrouter and pipes\n(DataParallelEngines)"),
    ("worker", "worker\nprocess\n(worker_main)"),
    ("engine", "engine thread\n(EngineLoop)"),
)
"""The lanes of ``request_sequence``: who handles a request in ``minisrv serve``, left to right
(the router and the workers' pipes are read in the HTTP process, by ``DataParallelEngines``)."""
REQUEST_MESSAGES: tuple[tuple[str, str, str], ...] = (
    ("client", "http", "POST\n/v1/completions"),
    ("http", "http", "validate the body,\nencode the prompt"),
    ("http", "router", "submit(key,\nids, params)"),
    ("router", "worker",
     "Submit into the\nworker's inbox\n(--dp ≥ 2: the one\nRouter.route picks)"),
    ("worker", "router", "Taken(key)"),
    ("worker", "engine", "EngineLoop.submit:\na command\nin its queue"),
    ("engine", "engine", "between two steps:\nadd_request,\nthen step()"),
    ("engine", "router", "StepEvents over the\nworker's pipe: every\nnew token, once per step"),
    ("router", "http", "each token\nto its handler"),
    ("http", "client", "data: {chunk}\nper token\n(detokenized)"),
    ("engine", "router", "the last step's\nevents:\nfinish_reason set"),
    ("router", "http", "to its handler"),
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
            # One segment per pair of neighbouring lanes, labelled and pointed at the last: a
            # labelled edge that skips a lane is drawn kinked at its label, a chain stays straight.
            a, b = keys.index(src), keys.index(dst)
            path = keys[a:b + 1] if a < b else keys[b:a + 1][::-1]
            for u, v in zip(path, path[1:]):
                g.edge(f"{u}_{row}", f"{v}_{row}", label=label if v == dst else "",
                       arrowhead="normal" if v == dst else "none", constraint="false")
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
