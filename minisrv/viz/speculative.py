"""Figures of the speculative-decoding chapter: one request's checks as rows of tokens, the
acceptance by guess position, the rejection rule's histogram, the roofline speed-up, and the
speed-up's explorer (acceptance rate and batch) with its kernel widget.

The numbers come from ``minisrv.experiments.speculative``; nothing is computed here twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import zip_longest
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from minisrv.configs import H100, LLAMA3_8B
from minisrv.experiments.speculative import CONTEXTS, CheckRow, SamplingCheck, speedup_frame
from minisrv.scheduler import StepRecord
from minisrv.sim.sizing import max_concurrent_requests
from minisrv.sim.speedup import expected_tokens_per_check
from minisrv.tokenizer import Tokenizer
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

__all__ = ["TOKEN_COLORS", "breakeven_shown", "check_table", "plot_acceptance", "plot_sampling",
           "plot_speedup", "plot_trace", "speedup_at", "speedup_explorer", "speedup_widget"]

TOKEN_COLORS: dict[str, str] = {"last": "#d9d9d9", "accepted": "#2ca02c",
                                "rejected": "#d62728", "own": "#1f77b4"}
"""The token boxes of the trace: the fed token, kept and rejected guesses, the target's own."""
WORKLOAD_COLORS = ("#1f77b4", "#ff7f0e", "#9467bd", "#2ca02c")


def _show(tok: Tokenizer, token: int) -> str:
    """A token as one visible character: a space as a middle dot, a newline as a return."""
    text = tok.decode([token])
    return {" ": "\u00b7", "\n": "\u21b5", "": "\u2205"}.get(text, text)


def _box(ax, x: float, y: float, kind: str, text: str) -> None:
    ax.add_patch(Rectangle((x, y - 0.4), 0.92, 0.8, color=TOKEN_COLORS[kind]))
    ax.text(x + 0.46, y, text, ha="center", va="center", fontsize=11, family="monospace",
            color="black" if kind == "last" else "white")


@styled
def plot_trace(rows: Sequence[CheckRow], tok: Tokenizer, title: str = "") -> BookFigure:
    """One row per check: the token fed first (grey), the guesses (green kept, red rejected),
    then the target's own token (blue); on the right the tokens gained and the KV slots
    written and freed."""
    fig, ax = page_figure(height_in=0.42 * len(rows) + 1.6)
    width = max(len(r.draft) for r in rows) + 1
    own_x = width + 0.5
    for y, row in enumerate(rows):
        _box(ax, 0, -y, "last", _show(tok, row.last))
        for j, token in enumerate(row.draft):
            _box(ax, 1 + j, -y, "accepted" if j < row.accepted else "rejected",
                 _show(tok, token))
        _box(ax, own_x, -y, "own", _show(tok, row.own))
        gained = f"+{row.accepted + 1} token" + ("s" if row.accepted else "")
        ax.text(own_x + 1.4, -y, f"{gained};  KV {row.written} written, {row.freed} freed",
                va="center", fontsize=10)
    for x, name in ((0.46, "fed"), ((1 + width) / 2, "guesses"), (own_x + 0.46, "target")):
        ax.text(x, 0.75, name, ha="center", va="bottom", fontsize=10)
    ax.set_xlim(-0.2, own_x + 8.5)
    ax.set_ylim(-len(rows) + 0.4, 1.3)
    ax.set_yticks([-y for y in range(len(rows))], [f"check {y + 1}" for y in range(len(rows))])
    ax.set_xticks([])
    ax.grid(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    label_axes(ax, title or "One request's checks: what was guessed, kept and freed")
    handles = [Patch(color=TOKEN_COLORS["last"], label="fed first (the last kept token)"),
               Patch(color=TOKEN_COLORS["accepted"], label="guess kept"),
               Patch(color=TOKEN_COLORS["rejected"], label="guess rejected (its KV freed)"),
               Patch(color=TOKEN_COLORS["own"], label="the target's own next token")]
    legend_below(fig, handles=handles, ncol=2)
    return fig


def breakeven_shown(table: pd.DataFrame) -> pd.DataFrame:
    """``breakeven_table`` as the page shows it: one header row, and "never" where
    speculation pays at every batch that fits in memory (the table's ``<NA>``)."""
    return one_header_row(table.astype(object).where(table.notna(), "never"))


def check_table(record: StepRecord, names: dict[int, str] | None = None) -> pd.DataFrame:
    """One row per check of one engine step: guesses, how many the target kept, the tokens
    the request gained, the KV slots written and freed."""
    names = names or {}
    rows = [{"request": names.get(rid, str(rid)), "guesses": drafted, "kept": accepted,
             "tokens gained": accepted + 1, "KV written": drafted + 1,
             "KV freed": drafted - accepted} for rid, drafted, accepted in record.checks]
    return one_header_row(pd.DataFrame(rows).set_index("request"))


MIN_REACHED = 15
"""The fewest checks behind a rate of ``plot_acceptance``'s left panel: a guess position that
fewer checks examined (an n-gram guess after two kept ones, on the chapter's workloads: 7, 3
and 1 checks on city prompts) is left out, its rate a handful of coin flips; from 15 on, the
standard error of a rate is at most 0.13, and every position of CityDraft's drafts stays."""


@styled
def plot_acceptance(sweep: pd.DataFrame, title: str = "") -> BookFigure:
    """Left: the acceptance of each guess position, given the guesses before it were kept,
    in the sweep's longest drafts, where at least ``MIN_REACHED`` checks examined it; right:
    tokens per check (per target forward) against k,
    and k + 1 if every guess were kept. One colour per workload, solid for CityDraft, dashed
    for n-gram."""
    fig, (left, right) = page_figure(height_in=3.9, cols=2)
    styles = {"CityDraft": "-", "n-gram": "--"}
    k_max = int(sweep["k"].max())
    for (work, color) in zip(sweep["workload"].unique(), WORKLOAD_COLORS, strict=False):
        for name, style in styles.items():
            rows = sweep[(sweep["workload"] == work) & (sweep["draft"] == name)]
            longest = rows[rows["k"] == k_max].iloc[0]
            rates = [rate if n >= MIN_REACHED else np.nan  # too few checks: noise, not a rate
                     for rate, n in zip(longest["by_position"], longest["reached"], strict=True)]
            left.plot(range(1, k_max + 1), rates, style, marker="o", color=color)
            right.plot(rows["k"], rows["tokens_per_check"], style, marker="o", color=color)
    ks = np.arange(0, k_max + 1)
    right.plot(ks, ks + 1, ":", color="black", lw=1)
    left.set_ylim(0, 1.02)
    left.set_xticks(range(1, k_max + 1))
    label_axes(left, title or f"Acceptance by position, k = {k_max}\n"
                             f"(positions examined in {MIN_REACHED}+ checks)",
               "guess position i", "P(guess i kept | 1..i-1 kept)")
    label_axes(right, "Tokens per check", "draft length k (tokens)", "tokens per check")
    handles = [Line2D([], [], color=c, marker="o", label=w)
               for w, c in zip(sweep["workload"].unique(), WORKLOAD_COLORS, strict=False)]
    handles += [Line2D([], [], color="grey", ls=style, label=name)
                for name, style in styles.items()]
    handles.append(Line2D([], [], color="black", ls=":", lw=1, label="every guess kept"))
    legend_below(fig, handles=handles, ncol=4)
    return fig


@styled
def plot_sampling(check: SamplingCheck, tok: Tokenizer, top: int = 16,
                  title: str = "") -> BookFigure:
    """The ``top`` most likely tokens under p: the target's p (bars), the draft's q
    (outlined bars) and how often each token came out of the check (dots): a kept guess or,
    after a rejection, the residual's replacement, so the dots are every draw's token.

    The legend sits under the axes, in the order p, q, dots, one entry a line: the dots'
    entry says what they count, which a short label on the data could not."""
    fig, ax = page_figure(height_in=3.8)
    order = np.argsort(-check.p.numpy())[:top]
    x = np.arange(len(order))
    handles = [
        ax.bar(x - 0.2, check.p.numpy()[order], 0.4, color="#1f77b4",
               label="target p"),
        ax.bar(x + 0.2, check.q.numpy()[order], 0.4, fill=False, ec="#ff7f0e", lw=1.5,
               label="draft q (where the guesses come from)"),
        *ax.plot(x - 0.2, check.frequencies.numpy()[order], "o", color="black", ms=5,
                 label=f"share of the {int(check.counts.sum()):,} draws that emitted the "
                       "token (guess kept or replaced)"),
    ]
    ax.set_xticks(x, [_show(tok, int(i)) for i in order])
    label_axes(ax, title or f"The {len(order)} most likely first letters of a new country line:"
                            " what the check emits", "token", "probability")
    legend_below(fig, handles=handles, ncol=1)
    return fig


@styled
def plot_speedup(frame: pd.DataFrame, acceptance: float, batch: int | None = None,
                 title: str = "") -> BookFigure:
    """One panel per context: the roofline speed-up against the batch, one line per k; the
    break-even line at 1, the formula's batch-1 value, the largest batch that fits, and
    ``batch`` (the explorer's table: its row of every curve) as a dashed line."""
    contexts = sorted(frame["context"].unique())
    fig, axes = page_figure(height_in=3.8, cols=len(contexts), sharey=True)
    axes = np.atleast_1d(axes)
    colors = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")
    for ax, context in zip(axes, contexts, strict=True):
        part = frame[frame["context"] == context]
        for k, color in zip(sorted(part["k"].unique()), colors, strict=False):
            rows = part[part["k"] == k]
            ax.plot(rows["batch"], rows["speedup"], color=color, label=f"k = {k}")
            ax.plot([1], [expected_tokens_per_check(acceptance, int(k))], "o", color=color)
        ax.axhline(1.0, color="black", lw=1)
        fits = max_concurrent_requests(LLAMA3_8B, H100, int(context))
        if fits <= part["batch"].max():
            ax.axvline(fits, color="grey", ls=":", lw=1.5, label="largest batch in 80 GB")
            # batches past it do not fit: a veil over their curves, kept for the trend
            ax.axvspan(fits, part["batch"].max(), color="0.92", alpha=0.75, lw=0, zorder=3,
                       label="does not fit")
        if batch is not None:
            ax.axvline(batch, color="black", ls="--", lw=1, zorder=4, label="the table's batch")
        ax.set_xscale("log", base=2)
        label_axes(ax, f"context {context} tokens", "batch size (requests)",
                   "speed-up (x)" if ax is axes[0] else None)
    fig.suptitle(title or f"Speculation's speed-up, LLaMA-3-8B on an H100, a = {acceptance:g}",
                 x=0.02, ha="left")
    seen: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    lines = [h for label, h in seen.items() if label.startswith("k = ")]
    marks = [h for label, h in seen.items() if not label.startswith("k = ")]
    # the legend fills column by column: interleaved, its first row is the draft lengths
    # and its second the marks, where one row of all seven would be wider than the figure
    handles = [h for pair in zip_longest(lines, marks) for h in pair if h is not None]
    legend_below(fig, handles=handles, ncol=len(lines))
    return fig


# ------------------------------------------------------------------ the speed-up explorer
FIGURE_KS: tuple[int, ...] = (1, 2, 4, 8)
"""The draft lengths the chapter's speed-up figure draws, one line each."""
TABLE_KS: tuple[int, ...] = tuple(range(1, 9))
"""The draft lengths the explorer's table lists at the chosen batch."""
ACCEPTANCE_LABEL = "per-guess acceptance a"
"""The control of ``a``: the chance a guess is kept once the guesses before it were."""
EXPLORER_ACCEPTANCES: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.9)
EXPLORER_BATCHES: tuple[int, ...] = (1, 32, 64, 128, 256, 384, 512, 768)
"""From a lone request to past the batch where k = 1 stops paying at 256 tokens (a = 0.9)."""


def speedup_at(acceptance: float, batch: int, ks: Sequence[int] = TABLE_KS,
               contexts: Sequence[int] = CONTEXTS) -> pd.DataFrame:
    """One batch of ``speedup_frame``, one row per k: the tokens a check yields (the
    acceptance formula, column ``"tokens per check"``) and the roofline speed-up at each
    context (one column per context, named by it), ``NaN`` where that many requests do not
    fit in the H100's memory at that context."""
    frame = speedup_frame(acceptance, ks=ks, batches=(batch,), contexts=contexts)
    table = frame.pivot(index="k", columns="context", values="speedup").rename_axis(
        columns=None)
    for context in contexts:
        if batch > max_concurrent_requests(LLAMA3_8B, H100, int(context)):
            table[context] = np.nan
    table.insert(0, "tokens per check", [expected_tokens_per_check(acceptance, int(k))
                                         for k in table.index])
    return table


def _contexts(table: pd.DataFrame) -> list[int]:
    return [c for c in table.columns if c != "tokens per check"]


def _shown_table(table: pd.DataFrame) -> pd.DataFrame:
    """``speedup_at`` as the page shows it: two decimals, ``x`` after a speed-up, and the
    memory limit spelled out instead of an empty cell."""
    shown = pd.DataFrame(index=table.index)
    shown["tokens per check"] = [f"{v:.2f}" for v in table["tokens per check"]]
    for context in _contexts(table):
        shown[f"speed-up, {context:,} tokens"] = [
            "does not fit" if np.isnan(v) else f"{v:.2f}x" for v in table[context]]
    return one_header_row(shown)


def _speedup_caption(table: pd.DataFrame, batch: int) -> str:
    parts = []
    for context in _contexts(table):
        values = table[context].dropna()
        if values.empty:
            parts.append(f"at {context:,} tokens a batch of {batch} does not fit")
        elif values.max() <= 1:
            parts.append(f"at {context:,} tokens every k loses")
        else:
            parts.append(f"at {context:,} tokens k = {int(values.idxmax())} is best "
                         f"({values.max():.2f}x)")
    return f"A batch of {batch}: " + "; ".join(parts) + "."


def _speedup_metrics(table: pd.DataFrame) -> dict[str, float]:
    metrics = {}
    for k, row in table.iterrows():
        metrics[f"tokens_per_check_k{k}"] = float(row["tokens per check"])
        metrics |= {f"speedup_{c}_k{k}": float(row[c]) for c in _contexts(table)
                    if not np.isnan(row[c])}
    return metrics


def speedup_explorer(acceptance: float = 0.7, batch: int = 1,
                     acceptances: Sequence[float] | None = None,
                     batches: Sequence[int] | None = None) -> Explorer:
    """``plot_speedup`` over the acceptance rate and the batch, with the speed-up of every k
    from 1 to 8 at that batch below it (``speedup_at``), for the page.

    The curves depend on the acceptance rate alone, so they are computed once per rate; each
    state's figure marks its batch, the row its table lists. The grid runs the batch from a
    lone request (the figure's dots: the formula's tokens per check) past the crossings where
    long drafts, then short ones, stop paying at 256 tokens of context. Each state carries
    the tokens per check and the speed-ups of its table; the kernel face is
    ``speedup_widget``, which takes any value.
    """
    acceptances = sorted({*EXPLORER_ACCEPTANCES, acceptance} if acceptances is None
                         else acceptances)
    batches = sorted({*EXPLORER_BATCHES, batch} if batches is None else batches)
    curves: dict[float, pd.DataFrame] = {}

    def draw(acceptance: float, batch: int) -> Frame:
        if acceptance not in curves:
            curves[acceptance] = speedup_frame(acceptance, ks=FIGURE_KS)
        table = speedup_at(acceptance, batch)
        return Frame([plot_speedup(curves[acceptance], acceptance, batch), _shown_table(table)],
                     _speedup_metrics(table), caption=_speedup_caption(table, batch))

    return explorer(draw, [("acceptance", ACCEPTANCE_LABEL, acceptances, acceptance),
                           ("batch", "batch (requests)", batches, batch)],
                    live=lambda: speedup_widget(acceptance, batch))


def speedup_widget(acceptance: float = 0.7, batch: int = 1):
    """Sliders for the acceptance rate and the batch; each change redraws ``plot_speedup``
    and the table of ``speedup_at``. Needs a live kernel (draw the static figure first)."""
    from IPython.display import display

    controls = {"acceptance": slider(acceptance, 0.0, 1.0, ACCEPTANCE_LABEL, step=0.05),
                "batch": slider(batch, 1, 1024, "batch (requests)")}

    def redraw(acceptance: float, batch: int) -> None:
        display(plot_speedup(speedup_frame(acceptance, ks=FIGURE_KS), acceptance, batch))
        table = speedup_at(acceptance, batch)
        display(_shown_table(table))
        print(_speedup_caption(table, batch))

    return panel(redraw, controls)
