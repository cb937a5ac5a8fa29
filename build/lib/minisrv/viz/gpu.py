"""The GPU appendix's figure: measured decode step times beside the roofline's lower bounds.

Measured curves are solid with markers, roofline predictions dashed, and every legend entry
names the device it describes, because in the book's CI the measurement comes from a CPU
while the predictions are for GPUs the page was never run on.
"""

from __future__ import annotations

import pandas as pd

from minisrv.viz.style import BookFigure, label_axes, legend_below, page_figure, styled

__all__ = ["plot_step_times_vs_roofline"]


@styled
def plot_step_times_vs_roofline(
    measured: pd.DataFrame, predicted: pd.DataFrame, model_name: str
) -> BookFigure:
    """Decode step time (left) and time per generated token (right) against batch size.

    ``measured``: rows of ``real_model.step_time_sweep`` (device, dtype, attention, batch,
    step_ms, us_per_token); ``predicted``: rows of ``real_model.roofline_step_times``.
    """
    fig, (left, right) = page_figure(5.4, cols=2)
    for (device, dtype, attention), rows in measured.groupby(
        ["device", "dtype", "attention"], sort=False
    ):
        label = f"measured on {device}, {dtype}, {attention} attention"
        for ax, column in ((left, "step_ms"), (right, "us_per_token")):
            ax.plot(rows["batch"], rows[column], "o-", label=label)
    for device, rows in predicted.groupby("device", sort=False):
        label = f"{device}, bf16: lower bound"
        for ax, column in ((left, "step_ms"), (right, "us_per_token")):
            ax.plot(rows["batch"], rows[column], "--", label=label)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (requests)")
        ax.grid(True, which="major", alpha=0.3)
    contexts = sorted(set(measured["context"]) | set(predicted["context"]))
    label_axes(left, "One decode step", ylabel="decode step time (ms)")
    label_axes(right, "Per generated token", ylabel="time per token (µs)")
    fig.suptitle(f"{model_name}, context {', '.join(map(str, contexts))}")
    legend_below(fig, ncol=1)
    return fig
