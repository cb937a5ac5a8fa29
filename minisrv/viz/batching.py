"""Figures and widgets of the selective-batching chapter: step times, the KV pool over time.

Everything here only draws or drives what the package computes: ``decode_step_seconds``
times a step, the ``Engine`` runs the pool experiments, and each run is checked against
``reference_generate`` before it is drawn.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pandas as pd
from matplotlib.ticker import MaxNLocator

from minisrv.experiments.batching import Admission, PoolRun, run_pool
from minisrv.model import CityLM
from minisrv.viz.explorer import Explorer, Frame, explorer
from minisrv.viz.style import BookFigure, label_axes, legend_below, page_figure, styled
from minisrv.viz.widgets import panel, slider
from minisrv.workloads import Workload

ATTENTION_COLORS = {"padded": "#1f77b4", "loop": "#ff7f0e"}
ATTENTION_LABELS = {"padded": "one padded attention call", "loop": "attention loop per request"}


@styled
def plot_decode_step_times(
    table: Mapping[str, Mapping[int, float]], device: str | None = None
) -> BookFigure:
    """Per-request time of a decode step against batch size, one line per attention kind.

    ``table[attention][batch_size]`` is the step time in seconds (``decode_step_seconds``).
    Left: the whole step on linear axes, the time from 0, so that growth reads as it is
    (linear in the batch for the loop); right: divided by the batch, relative to batch 1,
    on log axes beside the dashed 1/b a step would give if it took no longer than one
    request's, its ticks labelled down to the smallest share. ``device``, if given, is
    named in the left panel's title (a benchmark's report, not the book's page).
    """
    fig, (left, right) = page_figure(height_in=3.8, cols=2)
    for attention, times in table.items():
        sizes = sorted(times)
        color, label = ATTENTION_COLORS.get(attention), ATTENTION_LABELS.get(attention, attention)
        left.plot(sizes, [times[b] * 1e3 for b in sizes], "o-", color=color, label=label)
        base = times[sizes[0]] / sizes[0]
        right.plot(sizes, [times[b] / b / base for b in sizes], "o-", color=color, label=label)
    sizes = sorted({b for times in table.values() for b in times})
    right.plot(sizes, [sizes[0] / b for b in sizes], "--", color="grey", lw=1,
               label="1/b: a step no longer than one request's")
    label_axes(left, "One decode step" + (f" on {device}" if device else ""),
               "batch size (requests)", "step time (ms)")
    left.set_xlim(0, None)
    left.set_ylim(0, None)
    right.set_xscale("log", base=2)
    right.set_xticks(sizes, [str(b) for b in sizes])
    # shares differ by factors: on a log axis 0.07 and 0.10 stay apart
    right.set_yscale("log")
    right.minorticks_off()
    low = min(line.get_ydata().min() for line in right.get_lines())
    ticks = [t for t in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0) if t >= low / 2]
    right.set_yticks(ticks, [f"{t:g}" for t in ticks])
    label_axes(right, "Time per request", "batch size (requests)",
               "time per request (x batch 1)")
    legend_below(fig)
    return fig


@styled
def plot_pool_run(run: PoolRun, title: str | None = None) -> BookFigure:
    """Used slots (top), running requests (middle) and ``new_token_ratio`` (bottom) per step.

    The running requests get their own panel: on the slot axis a count of requests would
    read as a number of slots. Red lines mark the steps before which requests were retracted.
    ``title``: None gives the run's counts (``pool_run_title``); "" none, where a caption
    says them.
    """
    trace, sched = run.engine.trace, run.engine.scheduler
    steps = [s.index for s in trace]
    fig, (top, middle, bottom) = page_figure(height_in=6.2, rows=3, sharex=True,
                                             height_ratios=[2, 1, 1])
    top.plot(steps, [s.kv_used for s in trace], lw=1, color="#1f77b4", label="KV slots used")
    top.axhline(sched.config.kv_capacity, color="black", ls="--", lw=1,
                label=f"pool capacity {sched.config.kv_capacity}")
    top.set_ylabel("KV slots (tokens)")
    top.set_ylim(0, sched.config.kv_capacity * 1.15)
    middle.step(steps, [s.batch_size + len(s.paused) for s in trace], where="post", lw=1,
                color="#2ca02c", label="running requests")
    middle.set_ylabel("running\nrequests")
    middle.set_ylim(0, None)
    middle.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.plot(steps, [s.new_token_ratio for s in trace], lw=1, color="#9467bd",
                label="new_token_ratio")
    label_axes(bottom, None, "step", "new_token_ratio")
    # a little room below 0, so that a ratio of 0 does not vanish into the x-axis
    bottom.set_ylim(-0.05, 1.05)
    retract_steps = [s.index for s in trace if s.retracted]
    for i, x in enumerate(retract_steps):
        for ax in (top, middle, bottom):
            ax.axvline(x, color="#d62728", lw=0.8, alpha=0.7,
                       label="retraction" if i == 0 and ax is bottom else None)
    handles = [h for ax in (top, middle, bottom) for h in ax.get_legend_handles_labels()[0]]
    legend_below(fig, handles, ncol=3)
    label_axes(top, pool_run_title(run.engine.stats) if title is None else title)
    return fig


def pool_run_title(stats: Any) -> str:
    """``plot_pool_run``'s default title: retractions, recomputed tokens and steps."""
    return (f"{stats.retractions} retraction{'s' * (stats.retractions != 1)}, "
            f"{stats.wasted_tokens} tokens recomputed, {stats.steps} steps")


def pool_widget(
    model: CityLM,
    workload: Workload,
    reference: Sequence[Sequence[int]],
    capacity: int = 100,
    ratio: float = 0.7,
    decay: float = 0.01,
    max_running: int = 4,
):
    """Sliders for pool capacity, initial ratio, decay and max running; each change re-serves
    the workload on CityLM (a second or two) and redraws. Needs a live kernel."""
    from IPython.display import display

    smallest = max(len(p) + m for p, m in zip(workload.prompts, workload.output_lens))
    controls = {
        "capacity": slider(capacity, smallest, 600, "pool capacity (tokens)", step=10),
        "ratio": slider(ratio, 0.05, 1.0, "initial new_token_ratio", step=0.05),
        "decay": slider(decay, -4, -1, "decay per decode step", log=True),
        "max_running": slider(max_running, 1, 16, "max running"),
    }

    def redraw(capacity: int, ratio: float, decay: float, max_running: int) -> None:
        run = run_pool(model, workload, reference, capacity=capacity, ratio=ratio, decay=decay,
                       max_running=max_running)
        print(run.check)
        display(plot_pool_run(run))

    return panel(redraw, controls)


POOL_CAPACITIES: tuple[int, ...] = (100, 200)
"""Pools of the explorer, in tokens: one barely above its largest request (92 tokens), where
memory bounds the batch whatever the cap and the ratio decides how often requests are
retracted, and one of 200, short of the eight requests' 334 tokens of prompts and limits,
where from a cap of four the ratio decides how many run together (a pool that holds them
all would leave the ratio nothing to change)."""

POOL_CAPS: tuple[int, ...] = (2, 4, 8)
"""Batch caps of the explorer, doubling up to all eight of its workload (a cap of one, one
request after another, takes a step per token whatever the pool and the ratio). In the tight
pool the steps stop falling at four; in the medium one a cap of two is all that limits."""

POOL_RATIOS: tuple[float, ...] = (0.0, 0.7, 1.0)
"""Initial ``new_token_ratio`` of the explorer: ignore what running requests may still need,
SGLang's default, and count all of it."""

POOL_EXPLORER_REQUESTS = 8
"""Requests per state of the explorer: the chapter's sixteen take about a second a run on a
CPU, eight a third of that, so the page holds its 18 runs within its budget."""


def pool_explorer(
    model: CityLM,
    workload: Workload,
    reference: Sequence[Sequence[int]],
    capacity: int = 100,
    ratio: float = 0.7,
    decay: float = 0.01,
    max_running: int = 4,
    capacities: Sequence[int] = POOL_CAPACITIES,
    caps: Sequence[int] = POOL_CAPS,
    ratios: Sequence[float] = POOL_RATIOS,
    runs: Sequence[PoolRun] = (),
    check: Callable[..., Any] | None = None,
) -> Explorer:
    """``plot_pool_run`` over the pool's capacity, the batch cap and the initial ratio, for
    the page; ``capacity``, ``max_running`` and ``ratio`` pick the state shown first.

    Each state serves ``workload`` on CityLM (``run_pool``, the widget's experiment) and
    checks every request's tokens against ``reference``, each request generated alone (one
    reference serves every state: the pool, cap and ratio change when tokens are computed,
    never which); a state with a difference stops the build. ``decay`` stays fixed; the
    kernel face is ``pool_widget``, which also moves it. ``runs``: runs the chapter has
    already made (``run_pool`` of this workload and decay, checked); each serves the state
    of its pool, cap and initial ratio. ``check``: called as ``check(outputs, reference,
    what=...)`` for every state (the book's ``CHECKS.alone``, so the page counts these
    requests too). A state's caption gives the run in text, in place of its figure's title:
    retractions, recomputed tokens, steps, the mean decode batch and the peak of slots used. Its
    metrics also count the decode steps and those at the cap, which tell two runs of one
    mean apart: one holding the cap, one starting above the mean and dwindling.
    """
    smallest = max(len(p) + m for p, m in zip(workload.prompts, workload.output_lens))
    if min(capacities) < smallest:
        raise ValueError(f"a pool of {min(capacities)} tokens can never hold the largest "
                         f"request ({smallest} tokens): choose capacities >= {smallest}")

    made: dict[tuple[int, int, float], PoolRun] = {}
    for run in runs:
        config = run.engine.config
        if (config.ratio_decay != decay or config.new_token_ratio not in ratios
                or [list(out) for out in run.outputs] != [list(ref) for ref in reference]):
            raise ValueError("a run given to pool_explorer did not serve this workload with "
                             f"decay {decay:g} and an initial ratio among {list(ratios)}")
        made[config.kv_capacity, config.max_running, config.new_token_ratio] = run

    def draw(capacity: int, max_running: int, ratio: float) -> Frame:
        key = (capacity, max_running, ratio)
        run = made[key] if key in made else run_pool(
            model, workload, reference, capacity=capacity, ratio=ratio, decay=decay,
            max_running=max_running)
        where = f"pool {capacity}, cap {max_running}, ratio {ratio:g}"
        if run.identical != run.total:
            raise AssertionError(f"{where}: {run.check}")
        if check is not None:
            check(run.outputs, reference, what=f"pool explorer, {where}")
        stats = run.engine.stats
        peak = max(s.kv_used for s in run.engine.trace)
        decodes = [len(s.decode) for s in run.engine.trace if s.decode]
        mean_batch = sum(decodes) / len(decodes)
        return Frame([plot_pool_run(run, title="")],
                     {"steps": stats.steps, "retractions": stats.retractions,
                      "recomputed_tokens": stats.wasted_tokens,
                      "peak_slots": peak,
                      "peak_running": max(s.batch_size + len(s.paused) for s in run.engine.trace),
                      "mean_decode_batch": mean_batch,
                      "decode_steps": len(decodes),
                      "decode_steps_at_cap": decodes.count(max_running),
                      "requests_checked": run.total},
                     caption=f"{pool_run_title(stats)}; mean decode batch {mean_batch:.2f} "
                             f"requests; peak {peak} of {capacity} slots used.")

    return explorer(draw, [("capacity", "pool capacity (tokens)", list(capacities), capacity),
                           ("max_running", "batch cap", list(caps), max_running),
                           ("ratio", "initial new_token_ratio", list(ratios), ratio)],
                    live=lambda: pool_widget(model, workload, reference, capacity, ratio,
                                             decay, max_running))


def ledger_table(decision: Admission) -> pd.DataFrame:
    """One admission decision as a ledger, a line per term of the budget and per waiting
    request looked at, in slots: what each line takes and what is left for newcomers after
    it. Formatted as text, so that a line with no budget effect stays blank. A waiting request
    is named by its id (``#rid``), so that it can be followed from one step's ledger to the
    next, where a refused request comes first."""
    promised = decision.ratio * decision.remaining
    lines = [
        ("pool", f"{decision.capacity}", "", ""),
        (f"held by the {decision.running} running requests", f"{decision.held}", "", ""),
        ("free", f"{decision.free}", f"{decision.free}", ""),
        (f"promised to them: {decision.ratio:.2f} x {decision.remaining} tokens of"
         " remaining limits",
         f"{promised:.1f}", f"{decision.budget:.1f}", ""),
    ]
    for c in decision.candidates:
        left = c["left"] - c["need"] if c["admitted"] else c["left"]
        verdict = "admitted" if c["admitted"] else f"refused: {c['need']:g} > {c['left']:.1f}"
        lines.append((f"waiting request #{c['rid']}: prompt {c['prompt']} + limit {c['limit']}",
                      f"{c['need']:g}", f"{left:.1f}", verdict))
    frame = pd.DataFrame(lines, columns=["ledger", "slots", "left for newcomers", "decision"])
    return frame.set_index("ledger")
