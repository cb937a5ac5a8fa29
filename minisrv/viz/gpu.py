"""The GPU appendix's figure: measured decode step times beside the roofline's lower bounds.

Measured curves are solid with markers, roofline predictions dashed, and every legend entry
names the device it describes, because in the book's CI the measurement comes from a CPU
while the predictions are for GPUs the page was never run on.
"""

from __future__ import annotations

import pandas as pd

from minisrv.viz.roofline import BookFigure

__all__ = ["plot_step_times_vs_roofline"]


def plot_step_times_vs_roofline(
    measured: pd.DataFrame, predicted: pd.DataFrame, model_name: str
) -> BookFigure:
    """Decode step time (left) and time per generated token (right) against batch size.

    ``measured``: rows of ``real_model.step_time_sweep`` (device, dtype, attention, batch,
    step_ms, us_per_token); ``predicted``: rows of ``real_model.roofline_step_times``.
    """
    fig = BookFigure(figsize=(10, 4.8), layout="constrained")
    left, right = fig.subplots(1, 2)
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
        ax.set_xlabel("requests in the decode step (batch size)")
        ax.grid(True, which="major", alpha=0.3)
    contexts = sorted(set(measured["context"]) | set(predicted["context"]))
    left.set_ylabel("decode step time (ms)")
    left.set_title(f"One decode step of {model_name}, context {', '.join(map(str, contexts))}",
                   fontsize=10)
    right.set_ylabel("time per generated token (µs)")
    right.set_title("Step time divided by the tokens it produced", fontsize=10)
    fig.legend(*left.get_legend_handles_labels(), loc="outside lower center", ncols=2,
               fontsize=8)
    return fig
