"""Drawings of the host-tier chapter: the tree coloured by where each node's KV lives, the
simulated H100's table, and the explorer over the tier's size and write policy (hit rate and
tokens copied to the host)."""

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

__all__ = ["POLICY_COLORS", "TIER_COLORS", "host_size_explorer", "host_size_widget",
           "plot_tier_sizes", "sim_table_view", "tier_graphviz"]

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


def sim_table_view(table: pd.DataFrame) -> pd.DataFrame:
    """``sim_tier_table`` as the page shows it: the hit rate in percent, TTFT to a tenth of a
    second, output tokens per second to the whole token, token counts in millions to two
    places, one header row. The numbers themselves stay in ``table``."""
    shown = pd.DataFrame({
        "hit rate": table["hit rate"].map("{:.1%}".format),
        "mean TTFT (s)": table["mean TTFT (s)"].map("{:.1f}".format),
        "output tok/s": table["output tok/s"].round().astype(int),
        "loaded (M tokens)": table["loaded (M tokens)"].map("{:.2f}".format),
        "backed up (M tokens)": table["backed up (M tokens)"].map("{:.2f}".format),
    }, index=table.index)
    return one_header_row(shown)


POLICY_COLORS = {"write_through": "#4c6ef5", "write_through_selective": "#37b24d",
                 "write_back": "#e8590c"}


def _run_at(runs: Mapping[tuple[int, str], TierRun], size: int, policy: str) -> TierRun:
    """The run of (``size``, ``policy``); without a tier the policy means nothing, and
    ``sim_tier_runs`` serves size 0 under one policy only."""
    if size == 0:
        return next(run for (s, _), run in runs.items() if s == 0)
    return runs[size, policy]


@styled
def plot_tier_sizes(runs: Mapping[tuple[int, str], TierRun], sizes: Sequence[int],
                    policies: Sequence[str], chosen: tuple[int, str] | None = None,
                    history_tokens: int = 0) -> BookFigure:
    """Hit rate and tokens copied to the host against the host tier's size, a line per write
    policy (``runs`` keyed (size, policy), as ``sim_tier_runs`` returns them), the chosen
    policy's line bold and its chosen size ringed; ``history_tokens``, when given, marks what
    the chats' histories hold at the end, past which a larger tier has nothing more to keep."""
    fig, (left, right) = page_figure(3.2, 1, 2)
    k = [size / 1e3 for size in sizes]
    for policy in policies:
        on = chosen is None or policy == chosen[1]
        line = {"color": POLICY_COLORS.get(policy, "0.3"), "lw": 2.2 if on else 1.0,
                "alpha": 1.0 if on else 0.45, "ms": 5 if on else 3, "label": policy}
        at = [_run_at(runs, size, policy) for size in sizes]
        left.plot(k, [100 * run.hit_rate for run in at], "o-", **line)
        right.plot(k, [run.backed_up_tokens / 1e6 for run in at], "o-", **line)
    if chosen is not None:
        size, policy = chosen
        run = _run_at(runs, size, policy)
        for ax, value in ((left, 100 * run.hit_rate), (right, run.backed_up_tokens / 1e6)):
            ax.plot(size / 1e3, value, "o", ms=13, mfc="none", mec="black", mew=1.5,
                    clip_on=False)  # the ring at size 0 sits on the axis
    for ax in (left, right):
        if history_tokens:
            ax.axvline(history_tokens / 1e3, color="0.4", ls="--", lw=1)
        ax.set_xlim(left=-0.03 * max(k[-1], 1))  # room for the point at size 0
        ax.set_ylim(bottom=0)
    left.set_ylim(0, 100)
    label_axes(left, "Hit rate", "host tier (thousand tokens)", "% of prompt tokens")
    label_axes(right, "Copied to the host", "host tier (thousand tokens)", "million tokens")
    left.legend(loc="upper left", fontsize="small", frameon=False)
    if history_tokens:
        left.text(history_tokens / 1e3, 4, " final histories", color="0.3", fontsize="small")
    return fig


def _frame(size: int, policy: str, runs: Mapping[tuple[int, str], TierRun],
           sizes: Sequence[int], policies: Sequence[str], history_tokens: int = 0) -> Frame:
    run = _run_at(runs, size, policy)
    numbers = {"host tier (tokens)": size, "policy": policy, "hit rate": run.hit_rate,
               "mean TTFT (s)": run.mean_ttft, "output tok/s": run.throughput,
               "backed up (tokens)": run.backed_up_tokens}
    tier = f"host tier of {size:,} tokens, {policy}" if size else "no host tier"
    return Frame([plot_tier_sizes(runs, sizes, policies, (size, policy), history_tokens)],
                 numbers,
                 caption=f"{tier}: {run.hit_rate:.1%} of prompt tokens hit, "
                         f"{run.backed_up_tokens / 1e6:.2f}M tokens copied to the host, "
                         f"mean TTFT {run.mean_ttft:.1f} s, {run.throughput:,.0f} output tokens/s")


def host_size_explorer(workload: Any, sizes: Sequence[int],
                       policies: Sequence[str] = ("write_through",),
                       runs: Mapping[tuple[int, str], TierRun] | None = None,
                       start: tuple[str, int] | None = None, history_tokens: int = 0,
                       **options: Any) -> Explorer:
    """The simulated chats (``sim_tier_run``) for every write policy of ``policies`` and
    host tier size of ``sizes``: each state draws the hit rate and the tokens copied to the
    host of every (size, policy) (``plot_tier_sizes``), its own ringed. The size control
    counts thousands of tokens (its values are ``size // 1000``). ``runs``: (size, policy)
    pairs already served (reused); the rest are served first, since every frame draws them
    all. ``start``: the (policy, size) shown first (default: the first of each)."""
    done = dict(runs or {})
    for size in sizes:
        for policy in policies[:1] if size == 0 else policies:
            if (size, policy) not in done and not (size == 0 and any(s == 0 for s, _ in done)):
                done[size, policy] = sim_tier_run(workload, size, policy, **options)
    first_policy, first_size = start or (policies[0], sizes[0])

    def draw(size: int, policy: str = first_policy) -> Frame:
        return _frame(size * 1000, policy, done, sizes, policies, history_tokens)

    choose = [("policy", "write policy", list(policies), first_policy)] if len(policies) > 1 else []
    controls = [*choose, ("size", "host tier (thousand tokens)", [s // 1000 for s in sizes],
                          first_size // 1000)]  # a menu of one policy would choose nothing
    return explorer(draw, controls,
                    live=lambda: host_size_widget(workload, first_size, first_policy, **options))


def host_size_widget(workload: Any, size: int = 0, policy: str = "write_through",
                     **options: Any) -> Any:
    """A slider over the host tier's size and a choice of write policy; each change serves
    the chats again (a kernel)."""
    import ipywidgets as widgets
    from IPython.display import display

    from minisrv.kv.host import HOST_POLICIES

    def redraw(size: int, policy: str) -> None:
        runs = {(size, policy): sim_tier_run(workload, size, policy, **options)}
        frame = _frame(size, policy, runs, [size], [policy])
        display(frame.parts[0])
        print(frame.caption)

    return panel(redraw, {"size": slider(size, 0, 4_000_000, "host tier (tokens)",
                                         step=250_000),
                          "policy": widgets.Dropdown(options=list(HOST_POLICIES), value=policy,
                                                     description="write policy")})
