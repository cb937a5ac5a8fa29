"""Plots for the server chapter: ``minisrv bench`` results of several server layouts.

Reads the table of ``minisrv.server.experiments.bench_frame`` (one row per run); nothing in
the serving core imports this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from minisrv.viz.style import BookFigure, label_axes, page_figure, styled

__all__ = ["plot_bench_comparisons"]

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
        right.legend(loc="upper left", fontsize="small")
    return fig


