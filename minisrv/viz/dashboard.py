"""The scheduler chapter's GPU-scale dashboard: one simulated run of 2000 requests drawn
(requests holding a slot and waiting over time, the latencies), the widget that re-simulates
it for any rate, cap, spread and mode, and the explorer that carries its states into the page.

The runs are ``SimSetting.run`` (``minisrv.experiments.scheduler``), the same ones the
chapter's rate sweep makes. The explorer's states serve 300 of the requests rather than 2,000
(a run then takes a fraction of a second, not seconds), so its 25 rates and caps fit the
page's budget; the queue's growth past the knee and the cap's diminishing returns show as
well at that size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
from matplotlib.ticker import MaxNLocator

from minisrv.engine import RunResult
from minisrv.experiments.scheduler import SimSetting
from minisrv.metrics import summarize
from minisrv.scheduler import MODES
from minisrv.viz.explorer import Explorer, Frame, explorer
from minisrv.viz.style import BookFigure, label_axes, legend_below, page_figure, styled
from minisrv.viz.timeline import MODE_COLORS, MODE_LABELS
from minisrv.viz.widgets import panel, slider
from minisrv.workloads import GPU_SCALE_BATCH_CAP, GPU_SCALE_REQUESTS

__all__ = ["EXPLORER_CAPS", "EXPLORER_RATES", "EXPLORER_REQUESTS", "RunAxes", "plot_sim_run",
           "sim_dashboard", "sim_explorer", "sim_widget"]


LATENCY_BINS = 40
"""Bars of the latency histogram, over the span the shared axes give it."""


class RunAxes(NamedTuple):
    """The axis spans that fit every one of a set of runs (``RunAxes.of``): figures drawn with
    the same ``RunAxes`` compare at a glance instead of by their tick labels."""

    duration: float  # simulated seconds until the last step ends
    holding: int  # requests holding a slot (the largest cap counts too)
    queued: int  # requests waiting
    latency: float  # the longest latency
    tallest: int  # the tallest bar of a latency histogram

    @classmethod
    def of(cls, runs: Sequence[RunResult]) -> RunAxes:
        """The spans that fit all of ``runs`` (each trace read once)."""
        longest = max(q.latency for r in runs for q in r.requests)
        return cls(
            duration=max(r.trace[-1].start + r.trace[-1].duration for r in runs),
            holding=max(max([r.max_running, *(s.batch_size + len(s.paused) for s in r.trace)])
                        for r in runs),
            queued=max(1, *(s.queued for r in runs for s in r.trace)),
            latency=longest,
            tallest=max(int(np.histogram([q.latency for q in r.requests], bins=LATENCY_BINS,
                                         range=(0, longest))[0].max()) for r in runs))


@styled
def plot_sim_run(run: RunResult, setting: SimSetting,
                 same_axes_as: Sequence[RunResult] | RunAxes = ()) -> BookFigure:
    """One GPU-scale run: requests holding a slot and requests waiting over time (left), the
    latencies (right); ``setting`` is what produced ``run`` (its rate and spread label it).

    ``same_axes_as``: other runs to be set beside this one, or the ``RunAxes`` of a set of runs
    already worked out (the explorer's 25 states share one); every axis then spans what all
    of them need, so two modes' figures compare at a glance instead of by their tick labels.
    """
    m, mode, cap = run.metrics, run.mode, run.max_running
    spans = (same_axes_as if isinstance(same_axes_as, RunAxes)
             else RunAxes.of([run, *same_axes_as]))
    fig, (left, right) = page_figure(height_in=4.4, cols=2, width_ratios=[1.5, 1])
    times = [s.start for s in run.trace]
    holding = [s.batch_size + len(s.paused) for s in run.trace]
    color = MODE_COLORS.get(mode)
    # Filled, so static batching's thousands of teeth (each batch starts full and drains to
    # its last straggler) read as a sawtooth of slots in use, not as a comb of lines.
    left.fill_between(times, holding, step="post", color=color, alpha=0.35, lw=0)
    left.step(times, holding, where="post", lw=0.6, color=color, label="running")
    left.axhline(cap, color="black", ls="--", lw=1, label=f"batch cap {cap}")
    label_axes(left, f"{setting.rate:g} req/s, output cv {setting.output_cv:g}",
               "simulated time (s)", "running requests")
    queue = left.twinx()
    queue.plot(times, [s.queued for s in run.trace], lw=0.8, color="#d62728", label="waiting")
    queue.set_ylabel("waiting requests", color="#d62728")
    queue.grid(False)
    # Both counts start at zero with headroom above their peaks, so neither curve runs into
    # the frame (a twin axis otherwise autoscales its peak onto the top edge).
    left.set_ylim(0, spans.holding * 1.1)
    queue.set_ylim(0, spans.queued * 1.1)
    for axis in (left.yaxis, queue.yaxis):
        axis.set_major_locator(MaxNLocator(integer=True))  # counts of requests
    # The y-labels sit at fixed distances from their axes, room enough for three-digit
    # ticks: an explorer lays every state out as its first, and a cap of 256 beside a first
    # state's cap of 64 had pushed "running requests" off the figure's edge.
    left.yaxis.set_label_coords(-0.11, 0.5)
    # four-digit queues (static batching's) need a step further out than three-digit ones
    queue.yaxis.set_label_coords(1.11 if spans.queued * 1.1 < 1000 else 1.14, 0.5)
    left.set_xlim(0, spans.duration * 1.02)
    latency = np.array([r.latency for r in run.requests])
    right.hist(latency, bins=LATENCY_BINS, range=(0, spans.latency), color=color)
    right.axvline(m.mean_latency, color="black", lw=1, label=f"mean {m.mean_latency:.1f} s")
    right.axvline(m.p99_latency, color="black", ls="--", lw=1, label=f"p99 {m.p99_latency:.1f} s")
    right.set_xlim(0, spans.latency * 1.02)
    right.set_ylim(0, spans.tallest * 1.05)
    right.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of requests
    right.yaxis.set_label_coords(-0.16, 0.5)
    label_axes(right, f"{m.throughput:,.0f} tok/s", "latency (s)", "requests")
    handles = [*left.get_legend_handles_labels()[0], *queue.get_legend_handles_labels()[0],
               *right.get_legend_handles_labels()[0]]
    legend_below(fig, handles, ncol=3)
    fig.suptitle(f"{MODE_LABELS.get(mode, mode)}: mean batch {m.mean_batch:.1f}, "
                 f"mean time to first token {_seconds(m.mean_ttft)}", x=0.02, ha="left")
    return fig


def _seconds(value: float) -> str:
    """A duration as a reader takes it in: milliseconds below a second, else seconds."""
    return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.1f} s"


def sim_dashboard(
    rate: float = 64.0,
    max_running: int = GPU_SCALE_BATCH_CAP,
    output_cv: float = 1.0,
    mode: str = "prefill-first",
    n: int = GPU_SCALE_REQUESTS,
    seed: int = 0,
) -> BookFigure:
    """Simulate one configuration and draw its batch size over time and its latencies."""
    setting = SimSetting(rate, mode, max_running, output_cv, n, seed)
    return plot_sim_run(setting.run(), setting)


def sim_widget(
    rate: float = 64.0,
    max_running: int = GPU_SCALE_BATCH_CAP,
    output_cv: float = 1.0,
    mode: str = "prefill-first",
    n: int = GPU_SCALE_REQUESTS,
):
    """Sliders for arrival rate, batch cap, output-length spread and mode; each change
    re-simulates the ``n`` requests (2,000: some seconds) and redraws. Needs a live kernel."""
    import ipywidgets as widgets
    from IPython.display import display

    controls = {
        "rate": slider(rate, 0.0, 2.5, "arrival rate (req/s)", log=True),
        "max_running": slider(max_running, 4, 256, "batch cap", step=4),
        "output_cv": slider(output_cv, 0.0, 2.0, "output spread (cv)", step=0.25),
        "mode": widgets.Dropdown(options=list(MODES), value=mode, description="mode"),
    }

    def redraw(rate: float, max_running: int, output_cv: float, mode: str) -> None:
        display(sim_dashboard(rate, max_running, output_cv, mode, n))

    return panel(redraw, controls)


EXPLORER_RATES: tuple[float, ...] = (8.0, 16.0, 32.0, 64.0, 128.0)
"""Arrival rates of the explorer: from a load continuous batching keeps up with at any cap to
one that swamps it at every cap."""
EXPLORER_CAPS: tuple[int, ...] = (16, 32, 64, 128, 256)
"""Batch caps of the explorer: from a quarter of the chapter's 64, where the cap is the
bottleneck at every rate but the lowest, to four times it, where throughput stops growing."""
EXPLORER_REQUESTS = 300
"""Requests per state of the explorer: a state then simulates in a fraction of a second, so
the page holds 25 (the 2,000 of the chapter's runs take seconds each)."""


def unhindered_run(runs: Mapping[SimSetting, RunResult], setting: SimSetting
                   ) -> RunResult | None:
    """The run of ``setting`` taken from a run at a smaller batch cap that never held anyone
    back, or None.

    If every step's admission took in every waiting request (the trace's ``queued`` is 0
    after each step), neither the cap nor the memory ever refused a request, so a larger cap
    (whose automatic pool is no smaller) makes the same decisions and the same steps: only
    the cap in the result and the metrics that divide by it (slot utilisation) change. At
    low rates most of the explorer's states are such runs, and they are its longest ones."""
    for other, run in runs.items():
        if (other._replace(max_running=setting.max_running) == setting
                and other.max_running < setting.max_running
                and all(step.queued == 0 for step in run.trace)):
            return RunResult(run.mode, setting.max_running, run.requests, run.trace,
                             summarize(run.requests, run.trace, setting.max_running))
    return None


def sim_explorer(
    runs: Mapping[SimSetting, RunResult] | None = None,
    *,
    rate: float = 64.0,
    mode: str = "prefill-first",
    max_running: int = GPU_SCALE_BATCH_CAP,
    output_cv: float = 1.0,
    rates: Sequence[float] = EXPLORER_RATES,
    caps: Sequence[int] = EXPLORER_CAPS,
    modes: Sequence[str] | None = None,
    n: int = EXPLORER_REQUESTS,
    seed: int = 0,
) -> Explorer:
    """``sim_dashboard`` over arrival rate and batch cap (and, given ``modes``, the batching
    mode), for the page.

    Each state is one run of ``n`` requests (``SimSetting.run``, the code of the dashboard
    and of ``sim_widget``) at the output spread given. ``runs``: runs already made (the
    chapter's figure of the default state), found by their setting; any other state is
    simulated here. All states share their axes (``RunAxes``). Each state's numbers add the
    most requests that held a slot and that waited at once, and the share of its steps' time
    after which someone still waited: what tells a cap that binds from one that does not.
    The kernel face is ``sim_widget``, which also moves the spread and the mode and serves
    the chapter's 2,000 requests.
    """
    runs = {} if runs is None else runs
    modes = [mode] if modes is None else list(modes)

    # Every state is simulated before any is drawn, so that all of them share their axes
    # (RunAxes): switching states then moves the curves, never the scales under them.
    made = dict(runs)
    for each_mode in modes:
        for cap in sorted(caps):  # a smaller cap's unhindered run serves the larger ones
            for each_rate in rates:
                setting = SimSetting(float(each_rate), each_mode, int(cap), output_cv, n, seed)
                if setting not in made:
                    made[setting] = unhindered_run(made, setting) or setting.run()
    spans = RunAxes.of([made[SimSetting(float(r), md, int(c), output_cv, n, seed)]
                        for md in modes for c in caps for r in rates])

    def draw(rate: float, max_running: int, mode: str = mode) -> Frame:
        setting = SimSetting(rate, mode, max_running, output_cv, n, seed)
        run = made[setting]
        m, label = run.metrics, MODE_LABELS.get(mode, mode)
        queued = [step.queued for step in run.trace]
        queued_time = sum(step.duration for step in run.trace if step.queued)
        return Frame([plot_sim_run(run, setting, same_axes_as=spans)],
                     {"throughput": m.throughput, "mean_batch": m.mean_batch,
                      "mean_latency": m.mean_latency, "p99_latency": m.p99_latency,
                      "mean_ttft": m.mean_ttft, "steps": m.steps,
                      "peak_running": max(s.batch_size + len(s.paused) for s in run.trace),
                      "peak_waiting": max(queued),
                      "waiting_share": queued_time / sum(s.duration for s in run.trace)},
                     caption=f"{label[0].upper()}{label[1:]} at {rate:g} requests/s, batch cap "
                             f"{max_running}: {m.throughput:,.0f} tokens/s, mean latency "
                             f"{m.mean_latency:.1f} s.")

    controls = [("rate", "arrival rate (req/s)", [float(r) for r in rates], float(rate)),
                ("max_running", "batch cap", [int(c) for c in caps], int(max_running))]
    if len(modes) > 1:  # one mode needs no control
        controls.append(("mode", "batching", modes, mode))
    elif modes != [mode]:
        raise ValueError(f"the only mode {modes} must be mode={mode!r}")
    return explorer(draw, controls, live=lambda: sim_widget(rate, max_running, output_cv, mode, n))
