"""One step's attention work under each call, for any mix of a prefill and decodes (the GPU
appendix's step-mix explorer).

The appendix's work table counts four fixed steps; here a reader sets a prefill's length,
how many decodes run beside it, their context and whether one of them runs far longer (the
table's unequal decodes), and sees what each call computes
(scores), copies (keys) and walks (the key tiles its busiest query tile visits one after
another, which set the ragged call's time in the recorded decode steps), with the walk
priced at the recorded cost of a key tile. The counts are ``minisrv.experiments.call_work``'s.
"""

from __future__ import annotations

import math
from typing import Any

from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

from minisrv.experiments.call_work import hybrid_work, needed_work, padded_work, ragged_work
from minisrv.viz.explorer import Explorer, Frame, explorer
from minisrv.viz.gpu import ATTENTION_LABELS
from minisrv.viz.style import (
    FONT_SIZES,
    BookFigure,
    label_axes,
    page_figure,
    styled,
)

__all__ = ["STEP_MIX_CONTROLS", "plot_step_mix", "step_mix_caption", "step_mix_explorer",
           "step_mix_metrics", "step_mix_widget"]

LONG_CONTEXT = 8000
"""The one decode that may run far longer than the rest (the work table's unequal decodes)."""
AS_THE_OTHERS = "as the others"
STEP_MIX_CONTROLS: tuple[tuple[Any, ...], ...] = (
    ("prefill", "prefill (new tokens)", [0, 100, 1000, 4000], 1000, ","),
    ("decodes", "decodes beside it", [1, 64, 127, 256], 127, ","),
    ("context", "decodes' context (tokens)", [128, 512, 2048], 512, ","),
    ("longest", "one decode's context", [AS_THE_OTHERS, f"{LONG_CONTEXT:,}"], AS_THE_OTHERS),
)
"""The page's states: the work table's mixed step (1,000 beside 127 at 512) at first; one
decode at 8,000 makes the padded call copy every decode's keys up to it."""
CALLS: tuple[tuple[str, str], ...] = (("padded", "#868e96"), (ATTENTION_LABELS["flex"], "#f76707"),
                                      ("hybrid", "#1c7ed6"))


def _step(prefill: int, decodes: int, context: int, longest: int | None) -> list[tuple[int, int]]:
    """The prefill first, then the decodes, the last of them at ``longest`` if given."""
    contexts = [context] * decodes
    if longest is not None and decodes:
        contexts[-1] = longest
    return ([(0, prefill)] if prefill else []) + [(c, 1) for c in contexts]


def step_mix_metrics(prefill: int, decodes: int, context: int,
                     longest: int | None = None) -> dict[str, int]:
    """Each call's scores, keys copied and busiest walk, and what the requests need."""
    step = _step(prefill, decodes, context, longest)
    works = {"padded": padded_work(step), "ragged": ragged_work(step),
             "hybrid": hybrid_work(step)}
    metrics = {f"{what}_{call}": getattr(work, what)
               for call, work in works.items() for what in ("scores", "keys", "walk")}
    needed = needed_work(step)
    metrics["scores_needed"], metrics["keys_needed"] = needed.scores, needed.keys
    return metrics


_SUPERSCRIPTS = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def _decade(value: float, _: Any) -> str:
    """A power of ten as 10⁶, in plain text (mathtext's parser costs more than the bars)."""
    return "10" + str(round(math.log10(value))).translate(_SUPERSCRIPTS)


@styled
def plot_step_mix(metrics: dict[str, float], title: str, ms_per_tile: float) -> BookFigure:
    """Three panels of bars, one bar per call: scores computed and keys copied (log scale,
    a dashed line at what the requests need), and the busiest query tile's walk in key
    tiles, with its time at ``ms_per_tile``."""
    fig, axes = page_figure(2.7, cols=3)
    names = [name for name, _ in CALLS]
    panels = (("scores", "scores computed"), ("keys", "keys copied"),
              ("walk", "key tiles walked in turn"))
    for ax, (what, label) in zip(axes, panels, strict=True):
        values = [metrics[f"{what}_{key}"] for key in ("padded", "ragged", "hybrid")]
        ax.barh(names, values, color=[color for _, color in CALLS])
        if what == "walk":
            texts = [f"{v:,} ({v * ms_per_tile:,.0f} ms)" if v else "none" for v in values]
            ax.set_xlim(0, 2.5 * max(max(values), 1))  # room for the longest label
            ax.set_xlabel(f"at {ms_per_tile:.2f} ms a tile")
        else:
            texts = [f"{v:,}" for v in values]
            needed = metrics[f"{what}_needed"]
            ax.axvline(needed, color="black", linestyle="--", linewidth=1)
            ax.set_xscale("log")
            ax.set_xlim(min(*values, needed) / 3, max(values) * 80)  # room for the labels
            ax.xaxis.set_major_locator(LogLocator(base=10, numticks=4))  # sparse decades
            ax.xaxis.set_major_formatter(FuncFormatter(_decade))  # plain text: no mathtext
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xlabel("log scale; dashed: needed")
        for y, (v, text) in enumerate(zip(values, texts, strict=True)):
            ax.annotate(text, (v, y), xytext=(3, 0), textcoords="offset points",
                        va="center", fontsize=FONT_SIZES["legend"])
        ax.invert_yaxis()
        label_axes(ax, label)
        if ax is not axes[0]:
            ax.tick_params(axis="y", labelleft=False)
    fig.suptitle(title, x=0.01, ha="left", fontsize=FONT_SIZES["title"])
    # fixed margins: every state has the same labels, and the constrained layout would cost
    # 60% of drawing each of the explorer's frames
    fig.set_layout_engine("none")
    for k, ax in enumerate(axes):  # three equal panels, the call names left of the first
        ax.set_position((0.155 + k * 0.285, 0.2, 0.255, 0.6))
    return fig


def step_mix_caption(prefill: int, decodes: int, context: int, metrics: dict[str, int],
                     ms_per_tile: float) -> str:
    """The state in words: the two walks priced at ``ms_per_tile``, and the scores."""
    whole, split = metrics["walk_ragged"], metrics["walk_hybrid"]
    text = (f"Whole to the ragged call, the busiest query tile walks {whole:,} key tiles, "
            f"about {whole * ms_per_tile:,.1f} ms at {ms_per_tile:.2f} ms a tile")
    if prefill:
        text += (f"; the hybrid's prefill call walks {split:,} (at most "
                 f"{split * ms_per_tile:,.1f} ms: some of a prefill's tiles are full, which "
                 f"skip the mask the decodes' tiles were timed with) and its {decodes:,} "
                 f"decode{'s' * (decodes != 1)} take{'s' * (decodes == 1)} the padded call")
    else:
        text += "; with no prefill the hybrid is the padded call"
    return (text + f". Scores: padded {metrics['scores_padded']:,}, ragged "
            f"{metrics['scores_ragged']:,}, hybrid {metrics['scores_hybrid']:,}, "
            f"{metrics['scores_needed']:,} needed; keys copied: padded "
            f"{metrics['keys_padded']:,}, hybrid {metrics['keys_hybrid']:,}, ragged "
            f"{metrics['keys_ragged']:,} (each needed key once).")


def _title(prefill: int, decodes: int, context: int, longest: int | None) -> str:
    first = f"a prefill of {prefill:,} beside " if prefill else ""
    if longest is not None and decodes > 1:
        return f"{first}{decodes - 1:,} decodes at context {context:,}, one at {longest:,}"
    at = context if longest is None else longest
    return f"{first}{decodes:,} decode{'s' * (decodes != 1)} at context {at:,}"


def step_mix_explorer(ms_per_tile: float) -> Explorer:
    """Every state of ``STEP_MIX_CONTROLS``: the bars, the caption and the counts."""
    def draw(prefill: int, decodes: int, context: int, longest: str) -> Frame:
        long = None if longest == AS_THE_OTHERS else LONG_CONTEXT
        metrics = step_mix_metrics(prefill, decodes, context, long)
        title = _title(prefill, decodes, context, long)
        return Frame([plot_step_mix(metrics, title, ms_per_tile)],
                     {**metrics, "walk_ragged_ms": metrics["walk_ragged"] * ms_per_tile},
                     caption=step_mix_caption(prefill, decodes, context, metrics,
                                              ms_per_tile))

    return explorer(draw, STEP_MIX_CONTROLS, live=lambda: step_mix_widget(ms_per_tile))


def step_mix_widget(ms_per_tile: float) -> Any:
    """Sliders for any prefill, decode count, context and one longer decode (a kernel
    redraws)."""
    from IPython.display import display

    from minisrv.viz.widgets import panel, slider

    def redraw(prefill: int, decodes: int, context: int, longest: int) -> None:
        if prefill + decodes == 0:
            raise ValueError("a step needs a prefill or a decode")
        long = longest if longest > context else None
        metrics = step_mix_metrics(prefill, decodes, context, long)
        display(plot_step_mix(metrics, _title(prefill, decodes, context, long), ms_per_tile))
        print(step_mix_caption(prefill, decodes, context, metrics, ms_per_tile))

    return panel(redraw, {"prefill": slider(1000, 0, 8000, "prefill (new tokens)", 100),
                          "decodes": slider(127, 0, 512, "decodes beside it"),
                          "context": slider(512, 16, 8192, "decodes' context (tokens)", 16),
                          "longest": slider(512, 16, 32768, "one decode's context (tokens)",
                                            16)})
