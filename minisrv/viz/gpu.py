"""The GPU appendix's figure: measured decode step times beside the roofline's lower bounds.

Measured curves are solid with markers, roofline predictions dashed, and every legend entry
names the device it describes, because in the book's CI the measurement comes from a CPU
while the predictions are for GPUs the page was never run on. ``gpu_roofline_widget`` (a
kernel) and ``gpu_roofline_explorer`` (the page) put the roofline's context and batch under
controls, beside the same measurement, with the chosen batch marked on both panels.
``plot_split_decode`` draws the Triton decode kernel's answer to it: one request's context
cut into pieces that run side by side, merged by their log-sum-exp.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
import torch
from matplotlib.patches import Rectangle

from minisrv.configs import H100, H200, SMOLLM2_135M, T4, GPUSpec, ModelConfig
from minisrv.experiments.gpu import roofline_step_times
from minisrv.runner.attention.splits import DECODE_BLOCK_N, kv_splits
from minisrv.viz import marks
from minisrv.viz.explorer import Explorer, Frame, explorer
from minisrv.viz.style import (
    BookFigure,
    label_axes,
    legend_below,
    one_header_row,
    page_figure,
    plain_log_ticks,
    styled,
)

__all__ = ["ATTENTION_LABELS", "GPU_CONTEXTS", "gpu_roofline_explorer",
           "gpu_roofline_table", "gpu_roofline_widget", "plot_split_decode",
           "plot_step_times_vs_roofline", "split_pieces", "split_programs", "step_times_table"]

GPU_CONTEXTS: tuple[int, ...] = (8, 128, 512, 2048, 8192)
"""Contexts the page holds: from 8 tokens, where SmolLM2-135M's step on an H200 turns
compute-bound within the recorded batches (from batch 245), so the explorer shows the bound
flip, to 8K, where each request's cached K/V outweighs the weights' share."""
TABLE_GPUS: tuple[GPUSpec, ...] = (H100, H200, T4)
"""The GPUs the chapter's roofline table compares."""
ATTENTION_LABELS: dict[str, str] = {"flex": "ragged (flex)"}
"""How a legend names an attention backend: the flex_attention call by what it does, as the
page's tables do (other backends by their own names)."""
MARK_COLOR = "#495057"
"""The chosen batch's mark on the step-time figure: a dark gray no curve of it uses."""


@styled
def plot_step_times_vs_roofline(
    measured: pd.DataFrame, predicted: pd.DataFrame, model_name: str,
    mark_batch: int | None = None,
) -> BookFigure:
    """Decode step time (left) and time per generated token (right) against batch size.

    ``measured``: rows of ``experiments.gpu.step_time_sweep`` (device, dtype, attention, batch,
    step_ms, us_per_token); ``predicted``: rows of ``experiments.gpu.roofline_step_times``.
    When the two hold different contexts, every legend entry names its own. ``mark_batch``
    draws a vertical line at that batch on both panels (the kernel widget's chosen batch).
    """
    fig, (left, right) = page_figure(5.4, cols=2)
    contexts = sorted(set(measured["context"]) | set(predicted["context"]))

    def at(rows: pd.DataFrame) -> str:
        return f", context {rows['context'].iloc[0]:,}" if len(contexts) > 1 else ""

    for (device, dtype, attention), rows in measured.groupby(
        ["device", "dtype", "attention"], sort=False
    ):
        name = ATTENTION_LABELS.get(attention, attention)
        label = f"measured on {device}, {dtype}, {name} attention{at(rows)}"
        for ax, column in ((left, "step_ms"), (right, "us_per_token")):
            ax.plot(rows["batch"], rows[column], "o-", label=label)
    for device, rows in predicted.groupby("device", sort=False):
        label = f"{device}, bf16: lower bound{at(rows)}"
        for ax, column in ((left, "step_ms"), (right, "us_per_token")):
            ax.plot(rows["batch"], rows[column], "--", label=label)
    for ax in (left, right):
        if mark_batch is not None:
            ax.axvline(mark_batch, color=MARK_COLOR, linewidth=1.5, alpha=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        plain_log_ticks(ax)
        ax.set_xlabel("batch size (requests)")
        ax.grid(True, which="major", alpha=0.3)
    label_axes(left, "One decode step", ylabel="decode step time (ms)")
    label_axes(right, "Per generated token", ylabel="time per token (µs)")
    if len(contexts) > 1:  # say in the title that the two were drawn at different contexts
        timed = ", ".join(f"{c:,}" for c in sorted(set(measured["context"])))
        drawn = ", ".join(f"{c:,}" for c in sorted(set(predicted["context"])))
        fig.suptitle(f"{model_name}: measured at context {timed}, roofline at context {drawn}")
    else:
        fig.suptitle(f"{model_name}, context {', '.join(f'{c:,}' for c in contexts)}")
    legend_below(fig, ncol=1)
    return fig


def split_programs(cfg: ModelConfig, batch: int, cached: int) -> int:
    """Programs of one layer's split decode call that do work, for ``batch`` decodes with
    ``cached`` tokens each: requests x KV heads x pieces. The pieces are counted over the keys
    a decode attends to, its new one included (``TritonStep.contexts``): 513 keys at 512
    cached tokens, three pieces where 512 would make two."""
    return batch * cfg.n_kv_heads * int(kv_splits(torch.tensor([cached + 1]))[0])


def split_pieces(context: int) -> list[tuple[int, int]]:
    """The key ranges ``[lo, hi)`` of the pieces the decode kernel cuts one request's
    ``context`` keys (its new one included, as ``TritonStep.contexts`` counts them) into:
    ``kv_splits`` pieces of equal length, rounded up to the kernel's block of
    ``DECODE_BLOCK_N`` keys, as ``_decode_piece_kernel`` computes them; a piece
    that would start past the context does no work and is left out."""
    pieces = int(kv_splits(torch.tensor([context]))[0])
    even = -(-context // pieces)  # ceil(context / pieces), as tl.cdiv
    per_piece = -(-even // DECODE_BLOCK_N) * DECODE_BLOCK_N
    return [(lo, min(lo + per_piece, context)) for lo in range(0, pieces * per_piece, per_piece)
            if lo < context]


@styled
def plot_split_decode(context: int) -> BookFigure:
    """One decode's attention as the split-KV kernel runs it: the request's ``context`` keys
    cut into the pieces of ``split_pieces`` (one program per piece and KV head, side by
    side), each piece's partial output and log-sum-exp, and the merge that weights each
    partial output by exp(its log-sum-exp - the total's). The pieces carry the gid
    ``piece``, so a test can read back what was drawn."""
    pieces = split_pieces(context)
    fig, ax = page_figure(3.3)
    colors = ("#74c0fc", "#4dabf7")
    y_keys, y_part, y_merge = 2.6, 1.45, 0.25
    for i, (lo, hi) in enumerate(pieces):
        ax.add_patch(Rectangle((lo, y_keys), hi - lo, 0.6, facecolor=colors[i % 2],
                               edgecolor="white", linewidth=1.5, gid="piece"))
        mid = (lo + hi) / 2
        ax.text(mid, y_keys + 0.3, f"piece {i}\n{lo:,}-{hi:,}", ha="center", va="center",
                fontsize="small")
        ax.annotate("", xy=(mid, y_part + 0.55), xytext=(mid, y_keys),
                    arrowprops={"arrowstyle": "->", "color": "#495057"})
        ax.add_patch(Rectangle((lo + 0.08 * (hi - lo), y_part), 0.84 * (hi - lo), 0.55,
                               facecolor="#ffe8cc", edgecolor="#fd7e14"))
        ax.text(mid, y_part + 0.275, f"$o_{i}$, $lse_{i}$", ha="center", va="center",
                fontsize="small")
        ax.annotate("", xy=(context / 2, y_merge + 0.6), xytext=(mid, y_part),
                    arrowprops={"arrowstyle": "->", "color": "#adb5bd"})
    ax.add_patch(Rectangle((0.1 * context, y_merge), 0.8 * context, 0.6, facecolor="#d3f9d8",
                           edgecolor="#2f9e44"))
    ax.text(context / 2, y_merge + 0.3,
            r"merge: $lse = \log \sum_i e^{lse_i}$,  $o = \sum_i e^{lse_i - lse}\, o_i$",
            ha="center", va="center")
    for y, what in ((y_keys + 0.3, "keys (a program per\npiece and KV head)"),
                    (y_part + 0.275, "partial output,\nlog-sum-exp"),
                    (y_merge + 0.3, "second kernel")):
        ax.text(-0.02 * context, y, what, ha="right", va="center", fontsize="small")
    ax.set_xlim(-0.2 * context, 1.01 * context)
    ax.set_ylim(0, y_keys + 0.7)
    ax.axis("off")
    label_axes(ax, f"One decode over {context:,} keys: {len(pieces)} pieces side by side, "
                   "merged by log-sum-exp")
    return fig


def _with(gpu: GPUSpec) -> tuple[GPUSpec, ...]:
    """The table's GPUs, and ``gpu`` after them when it is not one of them."""
    return TABLE_GPUS if gpu in TABLE_GPUS else (*TABLE_GPUS, gpu)


def gpu_roofline_table(cfg: ModelConfig, batch: int, context: int,
                       gpus: Sequence[GPUSpec] = TABLE_GPUS) -> pd.DataFrame:
    """The roofline's decode step on each of ``gpus`` at one batch and context: its time, the
    resource that bounds it and the throughput, as the chapter's table shows them."""
    rows = roofline_step_times(cfg, gpus, [batch], context)
    return one_header_row(pd.DataFrame({"GPU (roofline)": [g.name for g in gpus],
                         "step (µs)": (rows["step_ms"] * 1e3).round(1).to_list(),
                         "bound by": rows["bound"].to_list(),
                         "tokens/s": (batch / (rows["step_ms"] / 1e3)).round().astype(int)
                         .to_list()}).set_index("GPU (roofline)"))


def _shown(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` as the page prints it: thousands separated, step times to 0.1 µs."""
    return table.assign(**{"step (µs)": table["step (µs)"].map("{:,.1f}".format),
                           "tokens/s": table["tokens/s"].map("{:,}".format)})


def step_times_table(steps: pd.DataFrame) -> pd.DataFrame:
    """A recorded step sweep (``recorded_gpu_run``'s long table) as the page shows it: one
    row per batch, the padded and the ragged step in ms to 0.1, columns named as the
    page's other tables name the two calls."""
    wide = steps.pivot(index="batch", columns="attention", values="step_ms")
    shown = wide[["padded", "flex"]].map("{:.1f}".format).rename_axis(columns=None)
    return one_header_row(shown.rename(columns={
        a: f"{ATTENTION_LABELS.get(a, a)} step (ms)" for a in ("padded", "flex")}))


def _measured_ms(measured: pd.DataFrame, batch: int, attention: str = "padded") -> float | None:
    """The measured step of ``attention`` at ``batch``, if the run timed that batch."""
    rows = measured[(measured["batch"] == batch) & (measured["attention"] == attention)]
    return float(rows["step_ms"].iloc[0]) if len(rows) else None


def _times(ms: float, roof_us: float) -> str:
    """How many times the roofline's step ``roof_us`` a measured step of ``ms`` took, from the
    two values as the caption shows them (0.1 ms, 0.1 µs), so a reader who divides them gets
    it, and to two figures, as the prose rounds it ("about 490 times", never 494)."""
    return f"{float(f'{round(ms, 1) * 1e3 / round(roof_us, 1):.2g}'):,.0f} times"


def _timed_roofline(cfg: ModelConfig, gpu: GPUSpec, measured: pd.DataFrame,
                    batch: int) -> tuple[int, float] | None:
    """The one context ``measured`` timed its steps at and ``gpu``'s roofline step there, in µs
    to 0.1 as the table shows it (None if it timed several): a measured step over the roofline
    means something only at the context both were taken at, whatever context a state shows."""
    timed = set(measured["context"])
    if len(timed) != 1:
        return None
    (at,) = timed
    return at, float(gpu_roofline_table(cfg, batch, at, [gpu]).loc[gpu.name, "step (µs)"])


def _caption(cfg: ModelConfig, gpu: GPUSpec, table: pd.DataFrame, measured: pd.DataFrame,
             batch: int, context: int) -> str:
    roof_us = table.loc[gpu.name, "step (µs)"]
    text = (f"{cfg.name} at batch {batch}, context {context:,}: the {gpu.name}'s roofline step "
            f"is {roof_us:,.1f} µs, {table.loc[gpu.name, 'bound by']}-bound")
    ms = _measured_ms(measured, batch)
    timed = _timed_roofline(cfg, gpu, measured, batch)
    if ms is None or timed is None:
        return text + "."
    at, at_us = timed
    if at == context:
        text += f"; the measured padded step took {ms:,.1f} ms, about {_times(ms, at_us)} that"
    else:
        text += (f"; at context {at:,}, where the run was timed, the measured padded step took "
                 f"{ms:,.1f} ms, about {_times(ms, at_us)} the roofline's step there")
    ragged = _measured_ms(measured, batch, "flex")
    if ragged is not None:
        text += f", the ragged step {ragged:,.1f} ms, about {_times(ragged, at_us)}"
    return text + "."


def gpu_roofline_widget(measured: pd.DataFrame, title: str, batch: int = 16, context: int = 512,
                        cfg: ModelConfig = SMOLLM2_135M, gpu: GPUSpec = H200) -> Any:
    """Sliders for the roofline's context and a batch: the figure of ``measured`` beside
    ``gpu``'s roofline at that context, and the roofline table at that batch. Needs a kernel."""
    import ipywidgets as widgets
    from IPython.display import display

    from minisrv.viz.widgets import panel

    batches = sorted(set(measured["batch"]))

    def redraw(context: int, batch: int) -> None:
        predicted = roofline_step_times(cfg, [gpu], batches, context)
        display(plot_step_times_vs_roofline(measured, predicted, title, mark_batch=batch))
        table = gpu_roofline_table(cfg, batch, context, _with(gpu))
        display(_shown(table))
        print(_caption(cfg, gpu, table, measured, batch, context))

    common = {"style": {"description_width": "initial"}, "continuous_update": False}
    return panel(redraw, {
        "context": widgets.SelectionSlider(options=[(f"{2**k:,}", 2**k) for k in range(3, 16)],
                                           value=context,
                                           description="context (tokens)", **common),
        "batch": widgets.SelectionSlider(options=batches, value=batch,
                                         description="batch (requests)", **common)})


def _batch_marks(fig: BookFigure, batches: Sequence[int]) -> dict[int, str]:
    """For each of ``batches``, the marks laid over ``fig``'s image (in a
    ``marks.figure_box``): a vertical line at that batch on every panel, and the box's end.
    The page's explorer draws the figure once per context; once per context and batch would
    cost five times the drawing."""
    return {batch: "".join([*(marks.vline(fig, ax, batch, MARK_COLOR) for ax in fig.axes),
                            marks.CLOSE])
            for batch in batches}


def gpu_roofline_explorer(measured: pd.DataFrame, title: str, batch: int = 16, context: int = 512,
                          cfg: ModelConfig = SMOLLM2_135M, gpu: GPUSpec = H200,
                          contexts: Sequence[int] = GPU_CONTEXTS,
                          batches: Sequence[int] | None = None) -> Explorer:
    """``gpu_roofline_widget`` for every context and batch of the grid, for the page.

    The figure (the measured run beside ``gpu``'s roofline at the context) depends on the
    context alone and is drawn once per context; the line that marks the batch on it, the
    table and the numbers change with the batch. Each state carries the roofline's step time
    per GPU of the table, the bound on ``gpu``, the measured padded and ragged steps at that
    batch, and each over ``gpu``'s roofline step at the context the run timed (the caption's
    readout, which at another context says where the run was timed).
    ``batches`` must be batches the measurement timed (all of them by default, so every batch
    the page's text quotes can be selected); ``batch`` and ``context`` open the page (batch 16:
    at batch 1, the axis's left end, the batch's line would lie on the y-axis).
    """
    timed = sorted(set(measured["batch"]))
    batches = sorted({*(timed if batches is None else batches), batch})
    missing = sorted(set(batches) - set(timed))
    if missing:
        raise ValueError(f"batches {missing} were not measured; measured: {timed}")
    figures: dict[int, tuple[str, dict[int, str]]] = {}

    def draw(context: int, batch: int) -> Frame:
        if context not in figures:
            predicted = roofline_step_times(cfg, [gpu], timed, context)
            fig = plot_step_times_vs_roofline(measured, predicted, title)
            box = marks.figure_box(fig)  # draws it, laying the axes out
            figures[context] = (box, _batch_marks(fig, batches))
        box, lines = figures[context]
        table = gpu_roofline_table(cfg, batch, context, _with(gpu))
        metrics: dict[str, Any] = {f"step_us {g.name}": float(table.loc[g.name, "step (µs)"])
                                   for g in _with(gpu)}
        metrics["bound"] = str(table.loc[gpu.name, "bound by"])
        metrics["measured_padded_ms"] = _measured_ms(measured, batch)
        metrics["measured_ragged_ms"] = _measured_ms(measured, batch, "flex")
        at = _timed_roofline(cfg, gpu, measured, batch)
        for call in ("padded", "ragged"):  # the caption's readout (every batch here was timed)
            metrics[f"{call}_over_roofline"] = (None if at is None else
                                                metrics[f"measured_{call}_ms"] * 1e3 / at[1])
        return Frame([box, lines[batch], _shown(table)], metrics,
                     caption=_caption(cfg, gpu, table, measured, batch, context))

    return explorer(draw, [("context", "context (tokens)", sorted({*contexts, context}), context,
                            ","),
                           ("batch", "batch (requests)", batches, batch, ",")],
                    live=lambda: gpu_roofline_widget(measured, title, batch, context, cfg, gpu))
