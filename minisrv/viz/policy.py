"""Figures and widgets of the cache-aware scheduling chapter.

The numbers come from ``minisrv.experiments.cache_aware`` (DataFrames); these functions only
draw them.
Figures follow the house style of ``minisrv.viz.style``: page width, legends below the axes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
from matplotlib.patches import Patch

from minisrv.experiments.cache_aware import (
    PolicyRun,
    few_shot_experiment,
    interleaved_groups,
    policy_row,
    reference_outputs,
)
from minisrv.scheduler.policy import WAITING_QUEUE_PREFIX_MATCH_MAX
from minisrv.viz.explorer import Explorer, Frame, explorer
from minisrv.viz.style import BookFigure, label_axes, legend_below, page_figure, styled
from minisrv.viz.widgets import panel, slider

__all__ = [
    "plot_forest_sweep",
    "plot_capacity_table",
    "plot_scheduling_cost",
    "plot_policy_comparison",
    "policy_widget",
    "policy_explorer",
]

COLORS = {"fcfs": "tab:gray", "fcfs-lock": "tab:brown", "random": "tab:orange",
          "lpm": "tab:blue", "dfs-weight": "tab:green", "hrrn": "tab:red", "lof": "tab:purple",
          "optimal": "black"}
NAMES = {"fcfs": "FCFS", "fcfs-lock": "FCFS, SGLang's admission order (lock-round-first)",
         "random": "random", "lpm": "LPM", "dfs-weight": "DFS-weight", "hrrn": "HRRN",
         "lof": "LOF", "optimal": "optimum 1 - distinct/total"}
"""Colours and legend names by policy; ``fcfs-lock`` is FCFS under
``admission_order="lock-round-first"``, a column a chapter adds to ``capacity_table``'s."""


@styled
def plot_forest_sweep(table: pd.DataFrame, longest: int, title: str = "") -> BookFigure:
    """Hit rate against cache capacity per policy (``forest_sweep``), the optimum as a
    horizontal line and ``longest``, the smallest pool that runs every request (its longest
    prompt and one output token), as a vertical one; log capacity axis."""
    fig, ax = page_figure(height_in=4.4)
    markers = {"fcfs": "s", "random": "^", "lpm": "o", "dfs-weight": "x"}
    for policy in table.columns:
        if policy == "optimal":
            ax.axhline(100 * table[policy].iloc[0], color="black", ls="--", lw=1.2,
                       label=NAMES[policy])
            continue
        ax.plot(table.index, 100 * table[policy], marker=markers.get(policy, "."),
                ms=8 if policy == "dfs-weight" else 6, color=COLORS.get(policy),
                label=NAMES.get(policy, policy), lw=1.5)
    ax.axvline(longest, color="tab:red", ls=":", lw=1.5,
               label=f"longest prompt + output token ({longest})")
    ax.set_xscale("log")
    ax.set_ylim(0, 100)
    label_axes(ax, title or "Serving order and cache size: hit rate of a prefix forest",
           "cache capacity (tokens, log scale)", "hit rate (% of prompt tokens)")
    legend_below(fig, ncol=3)
    return fig


@styled
def plot_capacity_table(table: pd.DataFrame, title: str = "") -> BookFigure:
    """Hit rate and prefill tokens against pool size per policy (``capacity_table``)."""
    fig, (left, right) = page_figure(height_in=4.0, cols=2)
    policies = table["hit rate"].columns
    for policy in policies:
        kw = {"marker": "o", "color": COLORS.get(policy), "label": NAMES.get(policy, policy)}
        if policy == "fcfs-lock":  # dashed and hollow: where both FCFS orders agree, FCFS shows
            kw |= {"ls": "--", "mfc": "none", "ms": 9, "zorder": 1}
        left.plot(table.index, 100 * table["hit rate"][policy], **kw)
        right.plot(table.index, table["prefill tokens"][policy], **kw)
    label_axes(left, "Hit rate", "KV pool capacity (tokens)", "hit rate (% of prompt tokens)")
    left.set_ylim(0, 100)
    label_axes(right, "Tokens prefilled", "KV pool capacity (tokens)",
               "prefill tokens (recomputed included)")
    right.set_ylim(0, None)
    legend_below(fig, ncol=len(policies))
    fig.suptitle(title or "Interleaved few-shot groups: FCFS against LPM", x=0.02, ha="left")
    return fig


@styled
def plot_scheduling_cost(table: pd.DataFrame, title: str = "") -> BookFigure:
    """CPU time of one scheduling round against the number of waiting requests
    (``scheduling_cost``), log-log, with SGLang's matching limit marked. Past the limit LPM
    takes FCFS's time: its line goes on dashed, with hollow markers around FCFS's, and FCFS
    is drawn on top, so that neither hides the other."""
    fig, ax = page_figure(height_in=4.0)
    for policy in table.columns:
        style = {"marker": "o", "color": COLORS.get(policy), "label": NAMES.get(policy, policy),
                 "zorder": 3 if policy == "fcfs" else 2}
        times = table[policy]
        capped = int((table.index <= WAITING_QUEUE_PREFIX_MATCH_MAX).sum())
        if policy == "lpm" and 0 < capped < len(times):
            ax.plot(times.index[capped - 1:], times.iloc[capped - 1:], ls="--", ms=10,
                    mfc="none", mew=1.5, markevery=slice(1, None),
                    **{**style, "label": f"LPM past {WAITING_QUEUE_PREFIX_MATCH_MAX} "
                                         "(no matching, FCFS's time)"})
            times = times.iloc[:capped]
        ax.plot(times.index, times, **style)
    ax.axvline(WAITING_QUEUE_PREFIX_MATCH_MAX, color="tab:red", ls=":",
               label=f"{WAITING_QUEUE_PREFIX_MATCH_MAX} waiting: LPM stops matching")
    ax.set_xscale("log")
    ax.set_yscale("log")
    label_axes(ax, title or "What a scheduling round costs", "waiting requests (log scale)",
           "CPU time per round (ms, log scale)")
    legend_below(fig, ncol=2)
    return fig


@styled
def plot_policy_comparison(table: pd.DataFrame, title: str = "",
                           tops: tuple[float, float] | None = None) -> BookFigure:
    """Hit rate, prefill tokens and waits (mean and max, in steps) per policy: one bar per
    row of a ``policy_table``/``few_shot_experiment`` table. ``tops``: the largest prefill
    tokens and wait to scale for (an explorer's over all its states, so that moving a control
    changes the bars, not the axes); ``None`` scales to this table."""
    fig, axes = page_figure(height_in=3.8, cols=3)
    labels = list(table.index)
    colors = [COLORS.get(label, "tab:blue") for label in labels]
    names = [NAMES.get(label, label) for label in labels]
    x = range(len(labels))
    axes[0].bar(x, 100 * table["hit rate"], color=colors)
    label_axes(axes[0], "Hit rate", "policy", "hit rate (% of prompt tokens)")
    axes[0].set_ylim(0, 100)
    axes[1].bar(x, table["prefill tokens"], color=colors)
    label_axes(axes[1], "Tokens prefilled", "policy", "prefill tokens")
    width = 0.4
    axes[2].bar([i - width / 2 for i in x], table["mean wait (steps)"], width, color=colors,
                alpha=0.55, label="mean")
    axes[2].bar([i + width / 2 for i in x], table["max wait (steps)"], width, color=colors,
                hatch="//", edgecolor="white", label="max")
    label_axes(axes[2], "Queueing delay", "policy", "wait (steps)")
    if tops is not None:
        axes[1].set_ylim(0, 1.05 * tops[0])
        axes[2].set_ylim(0, 1.05 * tops[1])
    for ax in axes:
        ax.set_xticks(list(x), names, rotation=40, ha="right", rotation_mode="anchor")
    legend_below(fig, [Patch(facecolor="#999999", alpha=0.55, label="mean wait"),
                       Patch(facecolor="#999999", hatch="//", edgecolor="white",
                             label="max wait")])
    fig.suptitle(title or "Policies compared", x=0.02, ha="left")
    return fig


WIDGET_POLICIES = ("lpm", "dfs-weight", "hrrn", "random", "lof")
"""The policies the widget and the explorer compare with FCFS."""


def _comparison_title(groups: int, capacity: int, gap: float) -> str:
    every = "step" if gap == 1 else f"{gap:g} steps"
    return f"{groups} few-shot groups, pool {capacity} tokens, a wave every {every}"


def policy_widget(model: Any, tok: Any, policies: Sequence[str] = WIDGET_POLICIES,
                  kv_capacity: int = 180, arrival_every: float = 1.0, n_groups: int = 4):
    """A policy to compare with FCFS, the pool size, the arrival gap and the number of
    few-shot groups; each change serves the interleaved groups again (tokens checked against
    the reference) and redraws ``plot_policy_comparison``. Needs a live kernel."""
    import ipywidgets as widgets
    from IPython.display import display

    controls = {
        "policy": widgets.Dropdown(options=list(policies), value=policies[0],
                                   description="policy vs FCFS",
                                   style={"description_width": "initial"}),
        "capacity": slider(kv_capacity, 100, 1000, "KV capacity (tokens)", step=20),
        "gap": slider(arrival_every, 0.0, 8.0, "steps between waves", step=0.5),
        "groups": slider(n_groups, 2, 5, "groups"),
    }

    def redraw(policy: str, capacity: int, gap: float, groups: int) -> None:
        try:
            table = few_shot_experiment(model, tok, ("fcfs", policy), kv_capacity=capacity,
                                        arrival_every=gap, n_groups=groups)
        except ValueError as err:  # e.g. a pool smaller than one request
            print(err)
            return
        display(plot_policy_comparison(table, _comparison_title(groups, capacity, gap)))
        display(table.round(3))

    return panel(redraw, controls)


POLICY_CAPACITIES = (180, 220, 250, 300, 400)
"""Pools of the explorer: the tight ones where LPM wins (180, 220), the middling ones where it
loses (250, 300) and one that holds every header, where the order no longer matters."""
POLICY_GAPS = (1.0, 2.0, 4.0, 8.0)
"""Steps between waves in the explorer: the chapter's one wave a step, and waves far enough
apart (4, 8) that few requests wait when the next arrive. LPM reorders the waiting queue, so
its loss in the middling pools fades as the queue shortens, while its win in the tight ones
stays. All 32 requests at once (a gap of 0) is left to the widget: in every pool of
``POLICY_CAPACITIES`` it hits within 0.1 points of one wave a step, for ten more runs."""
PAGE_POLICIES = ("lpm",)
"""The policies the explorer's page holds against FCFS. DFS-weight, random and LOF are left
to the live widget: each policy multiplies the page's 20 pools and gaps, and each state costs
two CityLM runs of a quarter to half a second of CPU time."""


def _hit_finding(name: str, hit: float, fcfs: float) -> str:
    """The explorer's caption: what the policy hit beside FCFS, said as a finding. The
    explorer's FCFS admits in minisrv's default order, which on a tight pool hits far less
    than SGLang's (the page's capacity table has both), so the caption names it, and says
    beside a lead of LPM's that SGLang's order can narrow it."""
    if round(100 * hit, 1) == round(100 * fcfs, 1):
        return f"{name} and FCFS hit the same share of prompt tokens, {hit:.1%}."
    more = "more" if hit > fcfs else "fewer"
    finding = (f"{name} hits {hit:.1%} of prompt tokens, FCFS (minisrv's admission order) "
               f"{fcfs:.1%}: {abs(100 * (hit - fcfs)):.1f} points {more}.")
    if hit < fcfs:
        return finding
    return (f"{finding} In SGLang's order, which locks a round's prefixes first, FCFS can hit "
            "far more in a tight pool (the capacity table has both orders).")


def policy_explorer(model: Any, tok: Any, policies: Sequence[str] = PAGE_POLICIES,
                    kv_capacity: int = 180, arrival_every: float = 1.0, n_groups: int = 4,
                    capacities: Sequence[int] = POLICY_CAPACITIES,
                    gaps: Sequence[float] = POLICY_GAPS,
                    reference: Sequence[Sequence[int]] | None = None,
                    runs: Mapping[tuple[str, int], PolicyRun] | None = None) -> Explorer:
    """``policy_widget`` for the page: each policy of ``policies`` against FCFS
    (``few_shot_experiment``, drawn by ``plot_policy_comparison``) in each pool of
    ``capacities`` and with each gap between waves of ``gaps``, the groups fixed; the first
    state is ``policies[0]`` in a pool of ``kv_capacity`` with waves ``arrival_every`` apart.
    A single policy needs no control.

    Every run checks every request's tokens against it generated alone, and a state with a
    difference stops the build. ``reference``: those outputs when the caller has them (the
    ``reference_outputs`` of ``interleaved_groups``); the gap moves only the arrivals, so one
    reference serves every gap. FCFS runs once per pool and gap, since its row is the same
    beside every policy. The kernel face is ``policy_widget`` with all of
    ``WIDGET_POLICIES``. ``runs``: runs the chapter has already made of this workload with
    waves ``arrival_every`` apart, by ``(policy, capacity)`` (``capacity_table``'s), drawn
    instead of served again; each must hold every request as it was generated alone.
    """
    if not policies or "fcfs" in policies:
        raise ValueError(f"name the policies to compare with FCFS (not FCFS itself), got "
                         f"{list(policies)}")
    gaps = sorted(float(g) for g in gaps)
    work = interleaved_groups(tok, n_groups, arrival_every=arrival_every)
    reference = reference_outputs(model, work) if reference is None else reference
    if len(reference) != len(work):
        raise ValueError(f"reference holds {len(reference)} outputs for {len(work)} requests")
    rows: dict[tuple[str, int, float], pd.DataFrame] = {}
    prompts = [list(p) for p in work.prompts]
    for (policy, capacity), run in (runs or {}).items():
        served = run.result.requests
        if ([list(r.prompt) for r in served] != prompts or run.identical != len(work)
                or [r.arrival for r in served] != list(work.arrivals)):
            raise ValueError(f"the run of {policy} at {capacity} given to policy_explorer did "
                             f"not serve interleaved_groups({n_groups}, arrival_every="
                             f"{arrival_every:g}) with every output as alone")
        rows[policy, capacity, float(arrival_every)] = policy_row(run, policy)

    def row(policy: str, capacity: int, gap: float) -> pd.DataFrame:
        if (policy, capacity, gap) not in rows:
            if [list(p) for p in interleaved_groups(tok, n_groups, arrival_every=gap)
                    .prompts] != prompts:
                raise AssertionError(f"a gap of {gap:g} changed the prompts, not only arrivals")
            rows[policy, capacity, gap] = few_shot_experiment(
                model, tok, (policy,), kv_capacity=capacity, arrival_every=gap,
                n_groups=n_groups, reference=reference)
        return rows[policy, capacity, gap]

    tables = [row(policy, capacity, gap) for policy in ("fcfs", *policies)
              for capacity in capacities for gap in gaps]
    tops = (max(t["prefill tokens"].max() for t in tables),
            max(t["max wait (steps)"].max() for t in tables))  # one scale for every state

    def draw(capacity: int, gap: float, policy: str = policies[0]) -> Frame:
        table = pd.concat([row("fcfs", capacity, gap), row(policy, capacity, gap)])
        everyone = f"{len(work)}/{len(work)}"
        if (table["outputs identical"] != everyone).any():
            raise AssertionError(f"{policy} in a pool of {capacity}, gap {gap:g}: outputs "
                                 f"differ from the requests generated alone "
                                 f"({list(table['outputs identical'])})")
        numbers = {f"{side} {name}": float(table.loc[row_name, name])
                   for side, row_name in (("FCFS", "fcfs"), ("policy", policy))
                   for name in ("hit rate", "prefill tokens", "mean wait (steps)",
                                "max wait (steps)")}
        return Frame([plot_policy_comparison(table, _comparison_title(n_groups, capacity, gap),
                                             tops),
                      table.drop(columns="outputs identical").round(3)],  # checked above
                     {**numbers, "requests checked": 2 * len(work)},
                     caption=_hit_finding(NAMES.get(policy, policy),
                                          float(table.loc[policy, "hit rate"]),
                                          float(table.loc["fcfs", "hit rate"])))

    controls = [("capacity", "KV capacity (tokens)", sorted(capacities), kv_capacity),
                ("gap", "steps between waves", gaps, float(arrival_every))]
    if len(policies) > 1:  # one policy needs no control
        controls.insert(0, ("policy", "policy vs FCFS", list(policies), policies[0]))
    return explorer(draw, controls,
                    live=lambda: policy_widget(model, tok, WIDGET_POLICIES, kv_capacity,
                                               arrival_every, n_groups))
