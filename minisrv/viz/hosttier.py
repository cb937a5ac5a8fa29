"""Drawings of the host-tier chapter: the tree coloured by where each node's KV lives, the
simulated H100's TTFT and throughput per host tier, and the explorer over the tier's size."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import graphviz
import pandas as pd

from minisrv.experiments.host_tier import TierRun, sim_tier_run
from minisrv.kv import NodeView
from minisrv.viz.explorer import Explorer, Frame, explorer
from minisrv.viz.radix import edge_text
from minisrv.viz.style import (
    BookFigure,
    graph_attrs,
    label_axes,
    one_header_row,
    page_figure,
    styled,
)
from minisrv.viz.widgets import panel, slider

__all__ = ["TIER_COLORS", "host_size_explorer", "host_size_widget",
           "plot_sim_tiers", "sim_table_view", "tier_graphviz"]

TIER_COLORS = {
    "device": "white",  # on the device only
    "both": "#d3f9d8",  # on the device, with a host copy
    "host": "#e5dbff",  # in host memory only: a match must load it back
}


def tier_graphviz(views: Sequence[NodeView], tokenizer: Any = None,
                  title: str | None = None) -> graphviz.Digraph:
    """A tree snapshot (``HiRadixCache.snapshot()``), each node filled by its tier: white on
    the device only, green on the device with a host copy, violet (dashed) on the host only."""
    dot = graphviz.Digraph(**graph_attrs(rankdir="LR", nodesep="0.15", ranksep="0.3"))
    dot.attr("node", shape="box", style="rounded,filled", fillcolor="white")
    dot.attr("edge", arrowsize="0.6")
    if title:
        dot.attr(label=title, labelloc="b")
    for view in views:
        if view.parent is None:
            dot.node(f"n{view.id}", "root")
            continue
        style = "rounded,filled,dashed" if view.tier == "host" else "rounded,filled"
        dot.node(f"n{view.id}", f"{edge_text(view.key, tokenizer)}\n{len(view.key)} tok · "
                 f"{view.tier}", fillcolor=TIER_COLORS[view.tier], style=style)
        dot.edge(f"n{view.parent}", f"n{view.id}")
    return dot


@styled
def plot_sim_tiers(table: pd.DataFrame, title: str = "") -> BookFigure:
    """Mean TTFT and throughput of each (host tier, policy) row of ``sim_tier_table``, as
    horizontal bars that share one row label ("1M, write_through"; "no tier")."""
    labels = ["no tier" if policy == "-" else f"{size}, {policy}" for size, policy in table.index]
    fig, (left, right) = page_figure(0.9 + 0.32 * len(labels), 1, 2, sharey=True)
    rows = list(range(len(labels)))
    left.barh(rows, table["mean TTFT (s)"], color="#4c6ef5")
    right.barh(rows, table["throughput (tok/s)"], color="#37b24d")
    left.set_yticks(rows, labels)
    left.invert_yaxis()  # the table's order, top down
    label_axes(left, "Mean time to first token", "seconds", None)
    label_axes(right, "Throughput", "output tokens / s", None)
    if title:
        fig.suptitle(title)
    return fig


def sim_table_view(table: pd.DataFrame) -> pd.DataFrame:
    """``sim_tier_table`` as the page shows it: the hit rate in percent, TTFT to a tenth of a
    second, throughput in whole tokens, token counts in millions to two places, one header
    row. The numbers themselves stay in ``table``."""
    shown = pd.DataFrame({
        "hit rate": table["hit rate"].map("{:.1%}".format),
        "mean TTFT (s)": table["mean TTFT (s)"].map("{:.1f}".format),
        "throughput (tok/s)": table["throughput (tok/s)"].round().astype(int),
        "loaded (M tokens)": table["loaded (M tokens)"].map("{:.2f}".format),
        "backed up (M tokens)": table["backed up (M tokens)"].map("{:.2f}".format),
    }, index=table.index)
    return one_header_row(shown)


@styled
def plot_tier_sizes(runs: Mapping[int, TierRun], chosen: int | None = None,
                    history_tokens: int = 0) -> BookFigure:
    """Hit rate and mean time to first token against the host tier's size, one point per run
    of ``runs`` (size -> run), ``chosen`` ringed; ``history_tokens``, when given, marks what
    the chats' histories hold at the end, past which a larger tier has nothing more to keep."""
    sizes = sorted(runs)
    fig, (left, right) = page_figure(3.2, 1, 2)
    k = [size / 1e3 for size in sizes]
    for ax, values, color in ((left, [100 * runs[s].hit_rate for s in sizes], "#4c6ef5"),
                              (right, [runs[s].mean_ttft for s in sizes], "#e8590c")):
        ax.plot(k, values, "o-", color=color)
        if chosen is not None:
            at = sizes.index(chosen)
            ax.plot(k[at], values[at], "o", ms=13, mfc="none", mec="black", mew=1.5,
                    clip_on=False)  # the ring at size 0 sits on the axis
        if history_tokens:
            ax.axvline(history_tokens / 1e3, color="0.4", ls="--", lw=1)
        ax.set_xlim(left=-0.03 * max(k[-1], 1))  # room for the point at size 0
        ax.set_ylim(bottom=0)
    left.set_ylim(0, 100)
    label_axes(left, "Hit rate", "host tier (thousand tokens)", "% of prompt tokens")
    label_axes(right, "Mean time to first token", "host tier (thousand tokens)", "seconds")
    if history_tokens:
        right.text(history_tokens / 1e3, right.get_ylim()[1] * 0.95, " final histories",
                   color="0.3", va="top", fontsize="small")
    return fig


def _frame(size: int, runs: Mapping[int, TierRun], history_tokens: int = 0) -> Frame:
    run = runs[size]
    numbers = {"host tier (tokens)": size, "hit rate": run.hit_rate,
               "mean TTFT (s)": run.mean_ttft, "throughput (tok/s)": run.throughput}
    return Frame([plot_tier_sizes(runs, size, history_tokens)], numbers,
                 caption=f"host tier of {size:,} tokens: {run.hit_rate:.1%} of prompt tokens "
                         f"hit, mean TTFT {run.mean_ttft:.1f} s, "
                         f"{run.throughput:,.0f} tokens/s")


def host_size_explorer(workload: Any, sizes: Sequence[int], runs: Mapping[int, TierRun] | None
                       = None, start: int = 0, history_tokens: int = 0,
                       **options: Any) -> Explorer:
    """The simulated chats (``sim_tier_run``, write-through) for every host tier size of
    ``sizes``: each state draws the hit rate and TTFT of every size (``plot_tier_sizes``) with
    its own ringed. ``runs``: sizes already served (reused); the rest are served first, since
    every frame draws them all."""
    done = dict(runs or {})
    for size in sizes:
        if size not in done:
            done[size] = sim_tier_run(workload, size, **options)
    shown = {size: done[size] for size in sizes}

    def draw(size: int) -> Frame:
        return _frame(size, shown, history_tokens)

    return explorer(draw, [("size", "host tier (tokens)", list(sizes), start)],
                    live=lambda: host_size_widget(workload, start, **options))


def host_size_widget(workload: Any, size: int = 0, **options: Any) -> Any:
    """A slider over the host tier's size; each change serves the chats again (a kernel)."""
    from IPython.display import display

    def redraw(size: int) -> None:
        frame = _frame(size, {size: sim_tier_run(workload, size, **options)})
        display(frame.parts[0])
        print(frame.caption)

    return panel(redraw, {"size": slider(size, 0, 4_000_000, "host tier (tokens)",
                                         step=250_000)})
