"""Figures, tables and a widget for the overlap chapter: the two-lane timeline as a Gantt
chart, blocking above overlapped, and where the real engine's step time goes.

The numbers come from ``minisrv.experiments`` (``timeline``, ``throughput_ratio``,
``time_steps``); nothing is computed here twice. Figures are ``BookFigure`` objects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.patches import Patch

from minisrv.experiments.breakdown import CPU_PARTS, PARTS, time_steps
from minisrv.experiments.lanes import Timeline, throughput_ratio, timeline
from minisrv.viz.explorer import Explorer, Frame, explorer
from minisrv.viz.style import (
    BookFigure,
    label_axes,
    legend_below,
    one_header_row,
    page_figure,
    styled,
)
from minisrv.viz.widgets import panel, slider

__all__ = [
    "LANE_COLORS",
    "PART_COLORS",
    "breakdown_summary",
    "cpu_breakdown",
    "future_trace_frame",
    "plot_cpu_breakdown",
    "plot_timelines",
    "timeline_explorer",
    "timeline_widget",
]

LANE_COLORS: dict[str, str] = {"cpu": "#ff7f0e", "device": "#1f77b4", "idle": "#d9d9d9"}
"""CPU work, device work, and the device's idle time in the Gantt charts."""

PART_COLORS: dict[str, str] = {
    "receive": "#fdd0a2",
    "schedule": "#fd8d3c",
    "prefix match": "#d94801",
    "prepare inputs": "#a1d99b",
    "forward": "#1f77b4",
    "sample": "#6baed6",
    "process results": "#bcbddc",
    "cache insert": "#756bb1",
    "loop other": "#969696",
}
"""One colour per part of a step (``minisrv.experiments.PARTS``): the device's blues for the
forward and the sampling, oranges for scheduling, green for the inputs, purples for the
results."""

_LANES = ("device", "CPU")  # bottom to top


# ----------------------------------------------------------------------------- Gantt
def _draw_lanes(ax: Any, t: Timeline, unit: str, label_steps: bool) -> None:
    """One Gantt panel: CPU lane above, device lane below, the device's idle gaps shaded."""
    height = 0.6
    lanes = {"CPU": (t.cpu, LANE_COLORS["cpu"]), "device": (t.device, LANE_COLORS["device"])}
    for y, name in enumerate(_LANES):
        intervals, color = lanes[name]
        ax.broken_barh([(a, b - a) for a, b in intervals], (y - height / 2, height),
                       facecolors=color, edgecolor="white", linewidth=1)
        if label_steps:
            for i, (a, b) in enumerate(intervals):
                if b - a >= 0.04 * t.total:
                    ax.text((a + b) / 2, y, str(i), ha="center", va="center", fontsize=10,
                            color="white" if name == "device" else "black")
    gaps = t.device_gaps
    ax.broken_barh([(a, b - a) for a, b in gaps], (-height / 2, height), facecolors="none",
                   edgecolor="#7f7f7f", hatch="///", linewidth=0)
    ax.broken_barh([(a, b - a) for a, b in gaps], (-height / 2, height),
                   facecolors=LANE_COLORS["idle"], alpha=0.6, linewidth=0)
    ax.set_yticks(range(len(_LANES)), list(_LANES))
    ax.set_ylim(-0.6, len(_LANES) - 0.4)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", alpha=0.3)


@styled
def plot_timelines(
    gpu_step: float | Sequence[float],
    cpu_step: float | Sequence[float],
    n_steps: int = 6,
    unit: str = "ms",
) -> BookFigure:
    """The blocking loop above the overlapped one, same time axis, for ``n_steps`` steps.

    Bars are numbered by step; hatched grey is the device waiting for the CPU. The title
    gives both totals and ``throughput_ratio``'s steady-state prediction.
    """
    block = timeline(gpu_step, cpu_step, n_steps, overlap=False)
    over = timeline(gpu_step, cpu_step, n_steps, overlap=True)
    fig, axes = page_figure(5.2, rows=2, sharex=True)
    for ax, t, name in zip(axes, (block, over), ("Blocking", "Overlapped")):
        _draw_lanes(ax, t, unit, label_steps=n_steps <= 12)
        label_axes(ax, f"{name}: {n_steps} steps in {t.total:.3g} {unit}, device busy "
                       f"{100 * t.utilisation:.0f}%, idle {t.device_idle:.3g} {unit}")
    axes[0].set_xlabel("")
    axes[1].set_xlim(0, block.total * 1.01)
    title = f"Overlapped: {block.total / over.total:.2f}x faster over {n_steps} steps"
    if np.isscalar(gpu_step) and np.isscalar(cpu_step):
        ratio = throughput_ratio(float(gpu_step), float(cpu_step))
        title = (f"Device {gpu_step:g} {unit}, CPU {cpu_step:g} {unit}: overlap "
                 f"{block.total / over.total:.2f}x over {n_steps} steps, {ratio:.2f}x long run")
    fig.suptitle(title)
    handles = [
        Patch(facecolor=LANE_COLORS["cpu"], label="CPU: schedule, prepare, process results"),
        Patch(facecolor=LANE_COLORS["device"], label="device: forward, sampling"),
        Patch(facecolor=LANE_COLORS["idle"], edgecolor="#7f7f7f", hatch="///",
              label="device idle"),
    ]
    legend_below(fig, handles, ncol=2)
    return fig


def timeline_widget(gpu_step: float = 7.36, cpu_step: float = 3.0, n_steps: int = 6):
    """Sliders for the device's and the CPU's step time (ms) and the number of steps; each
    change redraws ``plot_timelines``. Needs a live kernel (draw the static figure first)."""
    from IPython.display import display

    controls = {
        "gpu_step": slider(gpu_step, 0.5, 20.0, "device step (ms)"),
        "cpu_step": slider(cpu_step, 0.0, 20.0, "CPU step (ms)"),
        "n_steps": slider(n_steps, 1, 20, "steps"),
    }

    def redraw(gpu_step: float, cpu_step: float, n_steps: int) -> None:
        display(plot_timelines(gpu_step, cpu_step, n_steps))

    return panel(redraw, controls, per_row=3)


# ----------------------------------------------------------------------------- breakdown
def cpu_breakdown(
    engine: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]
) -> pd.DataFrame:
    """Serve ``prompts`` on ``engine`` and return one row per step: ms in each of ``PARTS``,
    the step's total, its CPU share (%), batch size and prefill tokens.

    The generated ids are kept in ``frame.attrs["outputs"]``, for the check against
    ``reference_generate`` that every real-model experiment makes.
    """
    timings = time_steps(engine, prompts, max_new_tokens)
    rows = []
    for i, step in enumerate(timings.steps):
        row: dict[str, float | int] = {"step": i}
        row.update({part: 1e3 * step.seconds[part] for part in PARTS})
        row["total"] = 1e3 * step.total
        row["CPU %"] = 100 * step.cpu / step.total if step.total > 0 else 0.0
        row["batch size"] = step.batch_size
        row["prefill tokens"] = step.prefill_tokens
        rows.append(row)
    frame = pd.DataFrame(rows).set_index("step")
    frame.attrs["outputs"] = timings.outputs
    return frame


def breakdown_summary(frames: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per measured run: mean ms per step in each part, the step's mean total, and
    the CPU's share of all the time (%)."""
    rows = {}
    for label, frame in frames.items():
        means = frame[list(PARTS)].mean()
        row = {part: means[part] for part in PARTS}
        row["total"] = frame["total"].mean()
        row["CPU %"] = 100 * frame[list(CPU_PARTS)].to_numpy().sum() / frame["total"].sum()
        row["steps"] = len(frame)
        rows[label] = row
    return pd.DataFrame.from_dict(rows, orient="index").round(3)


@styled
def plot_cpu_breakdown(frames: Mapping[str, pd.DataFrame]) -> BookFigure:
    """Stacked bars of the mean step, one bar per run: the whole step (left) and its CPU
    parts alone, magnified (right), with each run's CPU share above its bar."""
    summary = breakdown_summary(frames)
    labels = list(summary.index)
    x = np.arange(len(labels))
    fig, (whole, cpu_only) = page_figure(5.6, cols=2)
    for ax, parts in ((whole, PARTS), (cpu_only, CPU_PARTS)):
        bottom = np.zeros(len(labels))
        for part in parts:
            values = summary[part].to_numpy()
            ax.bar(x, values, 0.6, bottom=bottom, color=PART_COLORS[part], label=part)
            bottom += values
        ax.set_xticks(x, labels)
        ax.set_ylabel("mean time per step (ms)")
        ax.set_ylim(0, bottom.max() * 1.15)
        ax.grid(axis="y", alpha=0.3)
    for xi, top, share in zip(x, summary["total"], summary["CPU %"]):
        whole.text(xi, top, f"CPU {share:.1f}%", ha="center", va="bottom")
    label_axes(whole, "The whole step")
    label_axes(cpu_only, "The CPU work alone")
    fig.suptitle("Where a step's time goes in the real engine (CityLM)")
    handles = [Patch(facecolor=PART_COLORS[p], label=p) for p in reversed(PARTS)]  # as stacked
    legend_below(fig, handles, ncol=3)
    return fig


# ----------------------------------------------------------------------------- futures
def future_trace_frame(engine: Any, tok: Any = None) -> pd.DataFrame:
    """One row per step of an overlapped engine's run (``record_trace`` on): what the CPU
    wrote, what the device resolved and sampled, and what the late stop check threw away.

    Columns (few and narrow, so the table fits a page): the step's batch; for each decoding
    request the input id the CPU wrote when it formed the step (negative: a future id, since
    the previous step had not sampled it yet) and, after the arrow, the token the device
    resolved it to; the placeholder each request's new token got; the token sampled; who was
    found finished after the step; the tokens discarded (a request that had finished a step
    earlier). Tokens are shown as text when ``tok`` is given.
    """
    steps = engine.loop.future_trace
    records = {record.index: record for record in engine.trace}

    def show(token: int) -> str:
        return repr(tok.id_to_str(token)) if tok is not None and token >= 0 else str(token)

    def cells(pairs: Any) -> str:
        return ", ".join(f"r{rid}:\u00a0{value}" for rid, value in pairs) or "-"  # wraps at ","

    def batch(record: Any) -> str:  # no-break spaces: "decode r0 r1" never wraps in a cell
        parts = [f"{kind}\u00a0" + "\u00a0".join(f"r{rid}" for rid in rids)
                 for kind, rids in (("prefill", record.prefill), ("decode", record.decode))
                 if rids]
        return "; ".join(parts)

    rows, previous = [], {}
    for step in steps:
        record = records[step.index]
        decoding = [(rid, fid) for rid, fid in zip(step.rids, step.inputs) if rid in record.decode]
        sampled = dict(zip(step.rids, step.tokens))
        rows.append({
            "step": step.index,
            "batch": batch(record),
            "decode input → resolved": cells((rid, f"{fid} → {show(previous.get(fid, fid))}")
                                             for rid, fid in decoding),
            "placeholders": cells(zip(step.rids, step.futures)),
            "sampled": cells((rid, show(sampled[rid])) for rid in step.rids),
            "finished": ", ".join(f"r{rid}" for rid in record.finished) or "-",
            "discarded": cells((rid, show(sampled[rid])) for rid in step.discarded),
        })
        previous = dict(zip(step.futures, step.tokens))
    return one_header_row(pd.DataFrame(rows).set_index("step"))


CPU_STEPS_MS = (0.5, 3.0, 5.0, 10.0, 15.0)
"""The CPU step times the page holds: from a tenth of the device's step to twice it."""


def timeline_explorer(gpu_step: float = 7.36, cpu_step: float = 3.0, n_steps: int = 6,
                      gpu_steps: Sequence[float] | None = None) -> Explorer:
    """``plot_timelines`` over the CPU's and the device's step time (ms), for the page.

    The grid crosses the point where the CPU's work outgrows the device's: below it overlap
    hides the CPU entirely, above it the device waits in both loops. Each state carries
    both loops' totals over ``n_steps`` steps and ``throughput_ratio``'s long-run gain; the
    kernel face is ``timeline_widget``, which takes any value.
    """
    gpu_steps = sorted({2.5, 5.0, gpu_step, 10.0, 15.0} if gpu_steps is None else gpu_steps)
    cpu_steps = sorted({*CPU_STEPS_MS, cpu_step})

    def draw(gpu: float, cpu: float) -> Frame:
        block = timeline(gpu, cpu, n_steps, overlap=False)
        over = timeline(gpu, cpu, n_steps, overlap=True)
        gain = throughput_ratio(gpu, cpu)
        return Frame([plot_timelines(gpu, cpu, n_steps)],
                     {"blocking_ms": block.total, "overlapped_ms": over.total,
                      "long_run_gain": gain})  # the figure's title gives the gain

    return explorer(draw, [("gpu", "device step (ms)", gpu_steps, gpu_step),
                           ("cpu", "CPU step (ms)", cpu_steps, cpu_step)],
                    live=lambda: timeline_widget(gpu_step, cpu_step, n_steps))
