"""Pictures and tables for the scheduler chapter: the loop, traces, Gantt charts, sweeps.

Everything is drawn from what the scheduler recorded (``StepRecord`` traces and the token
times on each ``Req``), so a figure can never disagree with the run it shows. Figures are
``BookFigure`` objects (no pyplot state): a cell that returns one shows it once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import graphviz
import numpy as np
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from minisrv.engine import RunResult
from minisrv.metrics import RunMetrics
from minisrv.request import Req
from minisrv.scheduler import StepRecord
from minisrv.viz.style import (
    FONT_SIZES,
    BookFigure,
    graph_attrs,
    label_axes,
    legend_below,
    one_header_row,
    page_figure,
    plain_log_ticks,
    styled,
)

STATE_COLORS: dict[str, str] = {
    "waiting": "#d9d9d9",
    "prefill": "#d62728",
    "decode": "#1f77b4",
    "paused": "#ff9f1c",
}
"""Colour of each request state in the Gantt charts."""

MODE_COLORS: dict[str, str] = {"static": "#7f7f7f", "prefill-first": "#1f77b4", "mixed": "#2ca02c"}
MODE_LABELS: dict[str, str] = {
    "static": "static (request-level)",
    "prefill-first": "continuous, prefill-first",
    "mixed": "continuous, mixed (ORCA)",
}


# --------------------------------------------------------------------------- the loop
def loop_diagram() -> graphviz.Digraph:
    """The scheduler's main loop as a cycle of its four calls, with the two queues.

    Drawn as a square (two calls per row, the queues between the rows) rather than one long
    row: a row of four boxes is wider than the page and the browser shrinks its text.
    """
    g = graphviz.Digraph("loop", **graph_attrs(rankdir="TB", nodesep="0.5", ranksep="0.35"))
    g.attr("node", shape="box", style="rounded,filled", fillcolor="#eef3fb")
    steps = [
        ("recv", "receive_arrivals()\nnew requests join\nthe waiting queue"),
        ("pick", "get_next_batch_to_run()\nadmit (FCFS, slots, KV)\nprefill and/or decode"),
        ("run", "backend.run(batch)\nCityLM forward, or\nroofline time (sim)"),
        ("post", "process_batch_result()\nappend + stream tokens,\nstop, free finished"),
    ]
    for name, label in steps:
        g.node(name, label)
    g.attr("node", shape="cylinder", fillcolor="#fff4e0")
    g.node("waiting", "waiting queue")
    g.node("running", "running batch")
    for row in (("recv", "pick"), ("waiting", "running"), ("post", "run")):
        with g.subgraph() as same:
            same.attr(rank="same")
            for name in row:
                same.node(name)
    g.edge("recv", "pick", constraint="false")
    g.edge("pick", "run")
    g.edge("run", "post", constraint="false")
    g.edge("post", "recv", label=" next step")
    g.edge("recv", "waiting", style="dashed", arrowhead="none")
    g.edge("pick", "waiting", style="dashed", arrowhead="none")
    g.edge("pick", "running", style="dashed", arrowhead="none")
    g.edge("running", "post", style="dashed", arrowhead="none")
    g.edge("waiting", "running", style="invis")
    return g


# --------------------------------------------------------------------------- traces
def _names(rids: Sequence[int]) -> str:
    return ", ".join(f"r{rid}" for rid in rids) if rids else "-"


def _waiting_ids(trace: Sequence[StepRecord], reqs: Sequence[Req]) -> list[list[int]]:
    """For every step, the requests that had arrived but were not yet admitted."""
    admitted = {rid: i for i, step in enumerate(trace) for rid in step.prefill}
    return [
        [r.rid for r in reqs if r.arrival <= step.start and admitted.get(r.rid, len(trace)) > i]
        for i, step in enumerate(trace)
    ]


def trace_table(
    trace: Sequence[StepRecord], reqs: Sequence[Req] | None = None, cost_label: str = "cost"
) -> pd.DataFrame:
    """One row per step: who prefilled, decoded, sat paused, stayed in the scheduler's
    ``waiting`` queue, and finished.

    With ``reqs`` the waiting column names the requests; without, it counts them.
    """
    waiting = _waiting_ids(trace, reqs) if reqs is not None else None
    rows = []
    for i, step in enumerate(trace):
        rows.append(
            {
                "step": i,
                "prefill": _names(step.prefill),
                "decode": _names(step.decode),
                "paused": _names(step.paused),
                "waiting": _names(waiting[i]) if waiting is not None else step.queued,
                "finished": _names(step.finished),
                cost_label: _plain(step.cost),
            }
        )
    return one_header_row(pd.DataFrame(rows).set_index("step"))  # "step" in the corner


def trace_compare(runs: Mapping[str, RunResult]) -> pd.DataFrame:
    """The trace tables of several runs of the same requests, stacked under each run's label
    and step count, so that what each did at a given step reads off line by line (without
    the costs: the step counts are the comparison)."""
    tables = {f"{label}, {len(run.trace)} steps": trace_table(run.trace, run.requests)
              for label, run in runs.items()}
    return one_header_row(pd.concat(tables, names=["mode", "step"]).drop(columns="cost"))


def _plain(value: float) -> float | int:
    """A whole number as an int (a token count prints 8, not 8.0); anything else as is."""
    return int(value) if float(value).is_integer() else value


def request_states(trace: Sequence[StepRecord], reqs: Sequence[Req]) -> dict[int, list[str]]:
    """For each request, its state at every step of ``trace`` ("" when not present)."""
    states = {r.rid: [""] * len(trace) for r in reqs}
    for i, waiting in enumerate(_waiting_ids(trace, reqs)):
        for rid in waiting:
            states[rid][i] = "waiting"
    for i, step in enumerate(trace):
        for kind in ("prefill", "decode", "paused"):
            for rid in getattr(step, kind):
                if rid in states:
                    states[rid][i] = kind
    return states


def _runs(row: list[str], state: str) -> list[tuple[int, int]]:
    """(start, length) of each run of ``state`` in ``row``, for ``broken_barh``."""
    spans, start = [], None
    for i, value in enumerate([*row, ""]):
        if value == state and start is None:
            start = i
        elif value != state and start is not None:
            spans.append((start, i - start))
            start = None
    return spans


def _draw_gantt(ax, trace: Sequence[StepRecord], reqs: Sequence[Req]) -> None:
    states = request_states(trace, reqs)
    for row, req in enumerate(reqs):
        for state, color in STATE_COLORS.items():
            spans = _runs(states[req.rid], state)
            if spans:
                ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=color, edgecolor="white",
                               linewidth=0.5)
    ax.set_yticks(range(len(reqs)), [f"r{r.rid}" for r in reqs])
    ax.set_ylim(len(reqs) - 0.5, -0.5)
    ax.set_xlim(0, len(trace))
    ax.grid(axis="x", alpha=0.3)


@styled
def gantt(
    trace: Sequence[StepRecord], reqs: Sequence[Req], title: str = "Requests over steps"
) -> BookFigure:
    """One row per request, one column per step, coloured by what the request did."""
    fig, ax = page_figure(height_in=1.6 + 0.3 * len(reqs))
    _draw_gantt(ax, trace, reqs)
    if len(trace) <= 30:
        every = 1 if len(trace) <= 20 else 2
        ticks = np.arange(0, len(trace), every)
        ax.set_xticks(ticks + 0.5, [str(i) for i in ticks])
    label_axes(ax, title, "step", "request")
    _state_legend(fig)
    return fig


def _state_legend(fig) -> None:
    handles = [Patch(facecolor=c, label=s) for s, c in STATE_COLORS.items()]
    legend_below(fig, handles, ncol=len(handles))


@styled
def gantt_compare(runs: Mapping[str, RunResult], title: str = "") -> BookFigure:
    """Gantt charts of several runs of the same requests, stacked on one step axis."""
    n_reqs = max(len(run.requests) for run in runs.values())
    # 0.16 in a row: every request's name fits at the ticks' 10 pt
    fig, axes = page_figure(height_in=1.2 + len(runs) * (0.9 + 0.16 * n_reqs), rows=len(runs),
                            sharex=True, squeeze=False)
    axes = axes[:, 0]
    for ax, (label, run) in zip(axes, runs.items(), strict=True):
        _draw_gantt(ax, run.trace, run.requests)
        label_axes(ax, f"{label}: {len(run.trace)} steps, slot utilisation "
                   f"{run.metrics.slot_utilisation:.0%}", ylabel="request")
    axes[-1].set_xlim(0, max(len(run.trace) for run in runs.values()))
    axes[-1].set_xlabel("step")
    _state_legend(fig)
    if title:
        fig.suptitle(title, x=0.02, ha="left")
    return fig


@styled
def latency_bars(runs: Mapping[str, RunResult], unit: str = "steps") -> BookFigure:
    """Each request's latency (arrival to last token) under each run, side by side."""
    fig, ax = page_figure(height_in=3.4)
    width = 0.8 / len(runs)
    for k, (label, run) in enumerate(runs.items()):
        x = np.arange(len(run.requests)) + (k - (len(runs) - 1) / 2) * width
        color = MODE_COLORS.get(run.mode, None)
        ax.bar(x, [r.latency for r in run.requests], width, label=label, color=color)
    first = next(iter(runs.values()))
    every = 1 if len(first.requests) <= 16 else 2
    ax.set_xticks(range(0, len(first.requests), every),
                  [f"r{r.rid}" for r in first.requests][::every])
    label_axes(ax, "Per-request latency: arrival to last token", "request", f"latency ({unit})")
    legend_below(fig, ncol=len(runs))
    return fig


# --------------------------------------------------------------------------- GPU scale
def metrics_table(runs: Mapping[str, RunMetrics], unit: str = "s") -> pd.DataFrame:
    """The headline numbers of several runs, rounded for printing: whole tokens per second
    (a step count's tokens per step to two digits), latencies to a tenth of their unit."""
    rows = {}
    for label, m in runs.items():
        rows[label] = {
            "steps": m.steps,
            **({"throughput (tok/s)": round(m.throughput)} if unit == "s"
               else {"tokens per step": round(m.throughput, 2)}),
            "mean batch": round(m.mean_batch, 1),
            "slot util.": round(m.slot_utilisation, 2),
            f"mean latency ({unit})": round(m.mean_latency, 1),
            f"p99 latency ({unit})": round(m.p99_latency, 1),
            f"mean TTFT ({unit})": round(m.mean_ttft, 1),
        }
    return pd.DataFrame.from_dict(rows, orient="index")


@styled
def plot_rate_sweep(sweep: pd.DataFrame) -> BookFigure:
    """Throughput, mean batch, latency (mean and p99) and TTFT against arrival rate."""
    fig, axes = page_figure(height_in=6.6, rows=2, cols=2, sharex=True)
    axes = axes.ravel()
    panels = [
        ("throughput", "throughput (output tokens/s)", False),
        ("mean_batch", "mean decode batch (requests)", False),
        ("mean_latency", "latency (s)", True),
        ("mean_ttft", "mean time to first token (s)", True),
    ]
    for ax, (column, ylabel, log) in zip(axes, panels, strict=True):
        for mode, group in sweep.groupby("mode", sort=False):
            color = MODE_COLORS.get(mode)
            ax.plot(group["rate"], group[column], "o-", color=color, label=MODE_LABELS.get(mode))
            if column == "mean_latency":
                ax.plot(group["rate"], group["p99_latency"], "o--", color=color, alpha=0.6)
        label_axes(ax, None, "arrival rate (req/s)" if ax in axes[2:] else None, ylabel)
        if log:
            ax.set_yscale("log")
            plain_log_ticks(ax)  # 0.1, 1, 10 s rather than 10^-1, 10^0, 10^1
    rates = sorted(sweep["rate"].unique())
    for ax in axes:  # the rates double from point to point: equal steps on a log axis
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.minorticks_off()
    axes[2].set_title("solid: mean, dashed: p99", loc="left", fontsize=FONT_SIZES["ticks"])
    legend_below(fig, ncol=3)
    fig.suptitle("Static vs continuous batching, LLaMA-3-8B on a simulated H100", x=0.02,
                 ha="left")
    return fig


@styled
def plot_latency_throughput(sweep: pd.DataFrame, target: float) -> BookFigure:
    """Mean latency against throughput from a rate sweep (``sweep_table``): one curve per mode,
    a point per arrival rate, and a latency ``target`` (seconds). Where a curve crosses the
    target is the throughput its mode sustains at that latency (``throughput_at_latency``),
    the form in which ORCA states its gain; each crossing is marked."""
    from minisrv.experiments.scheduler import throughput_at_latency

    fig, ax = page_figure(height_in=3.8)
    ax.axhline(target, color="black", ls="--", lw=1, label=f"latency target {target:.1f} s")
    # Past its saturation a mode piles its points up at one throughput: a run of points that
    # close together gets one label, its rates as a range ("32–128/s"), at its last point.
    span_x = np.ptp(sweep["throughput"]) or 1.0
    span_y = np.ptp(np.log10(sweep["mean_latency"])) or 1.0
    for mode, group in sweep.groupby("mode", sort=False):
        group = group.sort_values("rate")
        color = MODE_COLORS.get(mode)
        ax.plot(group["throughput"], group["mean_latency"], "o-", color=color,
                label=MODE_LABELS.get(mode, mode))
        runs: list[list[tuple[float, float, float]]] = []
        for rate, x, y in zip(group["rate"], group["throughput"], group["mean_latency"],
                              strict=True):
            if runs and (abs(x - runs[-1][-1][1]) / span_x < 0.06
                         and abs(np.log10(y / runs[-1][-1][2])) / span_y < 0.08):
                runs[-1].append((rate, x, y))
            else:
                runs.append([(rate, x, y)])
        for run in runs:
            rates = f"{run[0][0]:g}–{run[-1][0]:g}" if len(run) > 1 else f"{run[0][0]:g}"
            ax.annotate(f"{rates}/s", run[-1][1:], textcoords="offset points",
                        xytext=(5, -11), fontsize=FONT_SIZES["ticks"], color=color)
        # the crossing's value above the target line and to the left of its mark, where a
        # rising curve leaves room
        at = throughput_at_latency(sweep, mode, target)
        ax.plot([at], [target], "D", ms=8, mfc="white", mec=color, mew=2)
        ax.annotate(f"{at:,.0f} tok/s", (at, target), textcoords="offset points",
                    xytext=(-7, 5), ha="right", fontsize=FONT_SIZES["ticks"], color=color)
    # room on the left for the leftmost crossing's value, and below the lowest point's label
    lo, hi = sweep["throughput"].min(), sweep["throughput"].max()
    ax.set_xlim(lo - 0.2 * (hi - lo), hi + 0.06 * (hi - lo))
    ax.set_ylim(sweep["mean_latency"].min() / 1.5, sweep["mean_latency"].max() * 1.4)
    ax.set_yscale("log")
    plain_log_ticks(ax)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
    label_axes(ax, None, "throughput (output tokens/s)", "mean latency (s)")
    legend_below(fig, ncol=3)
    fig.suptitle("The rate sweep as latency against throughput (a point per arrival rate)",
                 x=0.02, ha="left")
    return fig


def itl_points(run: RunResult) -> tuple[np.ndarray, np.ndarray]:
    """(time of token, gap since the request's previous token) for every decoded token."""
    times, gaps = [], []
    for req in run.requests:
        t = np.asarray(req.token_times)
        times.append(t[1:])
        gaps.append(np.diff(t))
    return np.concatenate(times), np.concatenate(gaps)


@styled
def plot_step_times(
    runs: Mapping[str, RunResult], window: tuple[float, float] = (10.0, 12.0)
) -> BookFigure:
    """Step durations and the inter-token gaps users feel, over a window of simulated time.

    Top: every step's duration (a step that prefills is marked). Bottom: for every token a
    decoding request received in the window, the gap since its previous token.
    """
    fig, (top, bottom) = page_figure(height_in=6.4, rows=2, sharex=True)
    lo, hi = window
    counts: list[str] = []
    for label, run in runs.items():
        color = MODE_COLORS.get(run.mode)
        steps = [s for s in run.trace if lo <= s.start < hi]
        top.step([s.start for s in steps], [s.duration * 1e3 for s in steps], where="post",
                 color=color, lw=1, label=label)
        pre = [s for s in steps if s.prefill]
        top.plot([s.start for s in pre], [s.duration * 1e3 for s in pre], "v", color=color,
                 ms=4, alpha=0.7)
        t, gap = itl_points(run)
        keep = (t >= lo) & (t < hi)
        bottom.plot(t[keep], gap[keep] * 1e3, "o", color=color, ms=3, alpha=0.6)
        # no percentile of the window's gaps: half a second holds too few prefills for its p99
        # to rank two modes the way the whole run's does
        counts.append(f"{label}: {len(steps)} steps in this window")
    label_axes(top, "Step durations (triangles: steps that prefill)", None,
               "step duration (ms, log scale)")
    label_axes(bottom, "Gap before each decoded token", "simulated time (s)",
               "inter-token gap (ms, log scale)")
    for ax in (top, bottom):
        # a log axis labelled at 1, 1.5, 2, 3, 5 and 7 of every decade: the times span about
        # one decade, so ticks at the powers of ten alone would leave a panel unlabelled
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    handles = [Line2D([], [], color=MODE_COLORS.get(run.mode), marker="o", label=text)
               for run, text in zip(runs.values(), counts, strict=True)]
    legend_below(fig, handles, ncol=1)
    return fig
