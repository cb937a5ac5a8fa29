"""The server chapter's requests as bars in time: ``request_timelines``' requests, each a bar
from its arrival through the queue, its prefill and its decode (``plot_request_waterfall``).

Split from ``minisrv.viz.server`` by topic: it reads ``minisrv.experiments.server``'s
timelines, not the sweep the explorer there draws.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pandas as pd

from minisrv.viz.style import BookFigure, label_axes, page_figure, styled

__all__ = ["plot_request_waterfall"]

_PHASES = {"queued": "#c8c8c8", "prefill": "#dd8452", "decode": "#4c72b0"}


@styled
def plot_request_waterfall(timelines: pd.DataFrame, rids: Sequence[int]) -> BookFigure:
    """One panel per configuration of ``request_timelines``, one horizontal bar per request
    of ``rids``: queued (arrival to its prefill step), prefill (to its first token, the black
    diamond) and decode (to its last token), each token a white tick, so TTFT is the length
    up to the diamond and the inter-token times are the gaps between ticks. Time counts from
    the first of the shown requests' arrivals. Each panel has its own time axis, from that
    start to its last finish: a configuration that serves them in a fraction of the other's
    time would fill a corner of a shared one."""
    names = list(timelines.index.unique(level=0))
    rows = [timelines.xs(name, level=0).loc[list(rids)] for name in names]
    start = min(float(r["arrival (ms)"].min()) for r in rows)
    fig, axes = page_figure(1.3 + len(names) * (0.45 + 0.28 * len(rids)), rows=len(names),
                            squeeze=False)
    for ax, name, frame in zip(axes[:, 0], names, rows, strict=True):
        for y, (_, req) in enumerate(frame.iterrows()):
            edges = [req["arrival (ms)"], req["admitted (ms)"], req["first token (ms)"],
                     req["finish (ms)"]]
            for (phase, color), (a, b) in zip(_PHASES.items(), itertools.pairwise(edges),
                                              strict=True):
                ax.barh(y, b - a, left=a - start, height=0.7, color=color,
                        label=phase if y == 0 else None)
            ticks = np.array(req["token times (ms)"][1:]) - start
            ax.plot(ticks, [y] * len(ticks), "|", color="white", ms=7, mew=0.8,
                    label="later token" if y == 0 else None)
            ax.plot(edges[2] - start, y, "D", color="black", ms=4,
                    label="first token" if y == 0 else None)
        ttft = frame["first token (ms)"] - frame["arrival (ms)"]
        ax.set_yticks(range(len(frame)), [f"r{rid}" for rid in frame.index])
        ax.set_ylim(len(frame) - 0.5, -0.5)
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlim(0, 1.02 * (float(frame["finish (ms)"].max()) - start))
        ax.set_xlabel("simulated time since the first of them arrived (ms)")
        label_axes(ax, f"{name}: TTFT of these requests {ttft.min():,.0f} to "
                       f"{ttft.max():,.0f} ms")
    handles = dict(zip(*reversed(axes[0, 0].get_legend_handles_labels()), strict=True))
    order = [*_PHASES, "first token", "later token"]  # in the order a request meets them
    # a white tick shows only on its decode bar: its legend entry draws it on the bar's colour
    handles["later token"] = (handles["decode"], handles["later token"])
    fig.legend([handles[k] for k in order], order, loc="outside upper center", ncol=len(order))
    return fig
