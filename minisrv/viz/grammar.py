"""Drawings of the structured-output chapter: the mask over CityLM's vocabulary step by
step (also as an explorer that steps through it, and its kernel widget), a grammar's
automaton (graphviz), and the mask's cost beside a decode step."""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from itertools import groupby
from typing import Any

import graphviz
import numpy as np
import pandas as pd
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from minisrv.experiments.structured import (
    FULL_STOP,
    THREE_CITIES,
    Automaton,
    MaskRun,
    MaskStep,
    StepProbability,
    served_masks,
)
from minisrv.viz.explorer import FRAME_DPI, WEBP, Explorer, Frame, explorer
from minisrv.viz.style import (
    FONT_SIZES,
    GRAPH_FONTS,
    SCREEN_DPI,
    BookFigure,
    book_style,
    graph_attrs,
    label_axes,
    legend_below,
    one_header_row,
    page_figure,
    styled,
)
from minisrv.viz.widgets import panel, slider

__all__ = ["MASK_GRAMMARS", "draw_automaton", "mask_explorer", "mask_widget",
           "plot_allowed_mass", "plot_mask_cost", "plot_masks", "token_texts"]

ALLOWED, CHOSEN, FORBIDDEN, NOT_YET = "#a5d8ff", "#1c7ed6", "#f1f3f5", "#ffffff"


def _show(text: str) -> str:
    return {"\n": "\\n", " ": "␣", "<bos>": "bos", "<eos>": "eos"}.get(text, text)


_GLYPHS = {"\n": "↵", " ": "␣", "<bos>": "^", "<eos>": "$"}
"""One character for each token whose text is not one visible character: the mask's columns
are one token wide, so a column label must be one character to stay at the book's 10 pt."""
GLYPH_KEY = "^ <bos>, $ <eos>, ↵ newline, ␣ space"


def _glyphs(token_text: Sequence[str]) -> list[str]:
    taken = set(token_text)
    return [g if (g := _GLYPHS.get(t, t)) == t or g not in taken else _show(t)
            for t in token_text]


def _column_labels(token_text: Sequence[str]) -> list[tuple[float, str]]:
    """The mask's column labels as (x, text): a run of letters of one case is one label under
    its middle (``A–Z``), every other token its own glyph. Letter by letter, 61 one-character
    labels on two staggered rows were hard to pair with their columns; the chosen letter is
    the row's label anyway."""
    glyphs = _glyphs(token_text)

    def run_of(i: int) -> str | int:  # a letter's case, or the column itself
        g = glyphs[i]
        return ("upper" if g.isupper() else "lower") if len(g) == 1 and g.isalpha() else i

    labels = []
    for _, group in groupby(range(len(glyphs)), key=run_of):
        run = list(group)
        first, last = run[0], run[-1]
        labels.append(((first + last) / 2,
                       glyphs[first] if len(run) == 1 else f"{glyphs[first]}–{glyphs[last]}"))
    return labels


@styled
def plot_masks(steps: Sequence[MaskStep], token_text: Sequence[str],
               title: str = "The mask, step by step", shown: int | None = None) -> BookFigure:
    """One row per step, one column per token of the vocabulary: the allowed tokens lit,
    the chosen one dark. ``token_text[i]`` is token ``i``'s text (its column label).

    ``shown``: only the first ``shown`` steps drawn, the later rows left blank with their
    labels invisible but still laid out, so that every step of a stepping view has the
    same size and the same place for each row (``mask_explorer`` relies on it)."""
    shown = len(steps) if shown is None else shown
    if not 0 <= shown <= len(steps):
        raise ValueError(f"shown must be in [0, {len(steps)}] (the steps), got {shown}")
    grid = np.full((len(steps), len(token_text)), 3)
    for r, step in enumerate(steps[:shown]):
        grid[r] = 0
        grid[r, step.allowed.numpy()] = 1
        grid[r, step.token] = 2
    fig, ax = page_figure(height_in=1.4 + 0.24 * len(steps))
    ax.imshow(grid, cmap=ListedColormap([FORBIDDEN, ALLOWED, CHOSEN, NOT_YET]), vmin=0,
              vmax=3, aspect="auto", interpolation="nearest")
    # One character per column at the house size, neighbouring columns' labels on two
    # staggered rows so that they never touch, each hung from its column by its tick; the
    # letters' ranges on the upper row, without a tick.
    labels = _column_labels(token_text)
    ones = [label for label in labels if len(label[1]) == 1]
    upper = ones[::2] + [label for label in labels if len(label[1]) > 1]
    lower = ones[1::2]
    ax.set_xticks([x for x, _ in upper], [t for _, t in upper])
    ax.set_xticks([x for x, _ in lower], [t for _, t in lower], minor=True)
    drop = FONT_SIZES["ticks"] * 1.6
    ax.tick_params(axis="x", which="major", length=3, width=0.6)
    ax.tick_params(axis="x", which="minor", length=drop, width=0.6, pad=2)
    for tick in ax.xaxis.get_major_ticks()[len(ones[::2]):]:
        tick.tick1line.set_visible(False)
    ax.set_yticks(range(len(steps)),
                  [f"{r + 1}: {_show(token_text[s.token])}" for r, s in enumerate(steps)])
    for label in ax.get_yticklabels()[shown:]:
        label.set_color("none")
    ax.grid(False)
    ax.tick_params(axis="y", length=0)
    label_axes(ax, title, f"token of the vocabulary ({GLYPH_KEY})", "step: token chosen")
    legend_below(fig, [Patch(color=ALLOWED, label="allowed by the grammar"),
                       Patch(color=CHOSEN, label="chosen (greedy)"),
                       Patch(color=FORBIDDEN, label="masked out")], ncol=3)
    return fig


def draw_automaton(machine: Automaton, title: str | None = None) -> graphviz.Digraph:
    """The automaton left to right: circles for states (double for the accepting ones),
    one arrow per edge labelled with its characters (a chain of them once compressed)."""
    dot = graphviz.Digraph(**graph_attrs(rankdir="LR", nodesep="0.12", ranksep="0.25"))
    dot.attr("node", shape="circle", width="0.3", fixedsize="true", label="")
    dot.attr("edge", arrowsize="0.6")
    if title:
        dot.attr(label=title, labelloc="b")
    for s in range(machine.n_states):
        accepting = s in machine.accepting
        dot.node(str(s), shape="doublecircle" if accepting else "circle",
                 style="filled", fillcolor="#d3f9d8" if s == 0 else "white")
    for a, text, b in machine.edges:
        dot.edge(str(a), str(b), label=_edge_label(text), penwidth="2" if len(text) > 1 else "1")
    return dot


def _edge_label(text: str) -> str:
    """An arrow's characters: a lone space as ␣, as the mask explorer draws it, enlarged
    (graphviz's fonts draw the glyph too small to read at the edge size; quoted, ``' '`` read
    as an empty string); a space inside a chain as ·."""
    if text == " ":
        return f'<<FONT POINT-SIZE="{int(GRAPH_FONTS["edge"]) + 6}">␣</FONT><BR/> >'
    return f" {_show(text) if len(text) == 1 else text.replace(' ', '·')} "


@styled
def plot_mask_cost(step_ms: Mapping[int, float], mask_ms: Mapping[str, Mapping[int, float]],
                   title: str) -> BookFigure:
    """Per batch size, a decode step's time beside each mask cost (bars side by side, a
    log scale: the costs span orders of magnitude)."""
    batches = sorted(step_ms)
    series: list[tuple[str, Mapping[int, float]]] = [("decode step", step_ms),
                                                     *mask_ms.items()]
    fig, ax = page_figure(height_in=3.4)
    width = 0.8 / len(series)
    x = np.arange(len(batches))
    for k, (name, values) in enumerate(series):
        ax.bar(x + (k - (len(series) - 1) / 2) * width, [values[b] for b in batches], width,
               label=name, color=None if k else "#495057")
    ax.set_xticks(x, [str(b) for b in batches])
    ax.set_yscale("log")
    label_axes(ax, title, "requests in the batch", "time per step (ms, log scale)")
    legend_below(fig, ncol=2)  # labels say where each part runs: too long for three columns
    return fig


def token_texts(tokenizer: Any) -> list[str]:
    """Each id's text (``<bos>``/``<eos>`` spelled out), for the mask picture's columns."""
    return [tokenizer.id_to_str(i) for i in range(tokenizer.vocab_size)]


@styled
def plot_allowed_mass(runs: Mapping[str, Sequence[StepProbability]], title: str) -> BookFigure:
    """Per step of each constrained output, the share of the model's probability that the
    mask allowed (log scale): near 1 where grammar and model agree, tiny where the grammar
    overrules the model."""
    fig, ax = page_figure(height_in=3.2)
    for name, steps in runs.items():
        ax.plot(range(1, len(steps) + 1), [s.allowed_mass for s in steps], marker=".",
                label=name)
    ax.set_yscale("log")
    label_axes(ax, title, "step", "probability the mask allows")
    legend_below(fig)
    return fig


# ----------------------------------------------------------------------- the mask explorer
MASK_GRAMMARS: dict[str, str] = {"three cities, commas": THREE_CITIES,
                                 "three cities, full stop": FULL_STOP}
"""The grammars the explorer steps through, both after ``FR:``: the chapter's own, and the
one CityLM disagrees with (its masks part after the third name)."""


def _mask_title(regex: str) -> str:
    # quoted whole: the leading space is part of the regex (the outputs start with one)
    return f'The mask of "{regex}" over CityLM\'s vocabulary'


def _webp_img(pixels: np.ndarray, width_in: float) -> str:
    """An RGBA array as the ``<img>`` an explorer frame shows: lossless WebP, shown at the
    column's width (what ``minisrv.viz.explorer`` does for a figure)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="webp", **WEBP)
    data = base64.b64encode(buffer.getvalue()).decode()
    return (f'<img alt="" style="width:{round(width_in * SCREEN_DPI)}px;max-width:100%" '
            f'src="data:image/webp;base64,{data}">')


def _pixels(fig: Any) -> np.ndarray:
    """The figure rendered as an explorer renders its frames (house style, ``FRAME_DPI``)."""
    import matplotlib.pyplot as plt
    from PIL import Image

    buffer = io.BytesIO()
    with book_style():
        fig.savefig(buffer, format="png", dpi=FRAME_DPI)
    plt.close(fig)
    return np.asarray(Image.open(buffer).convert("RGBA")).copy()


def step_images(steps: Sequence[MaskStep], token_text: Sequence[str], title: str) -> list[str]:
    """``plot_masks(steps, shown=s)`` for s = 1 .. len(steps), as ``<img>`` tags, from two
    renderings instead of one per step.

    ``plot_masks`` lays out every ``shown`` the same way, so the figure at step s is the
    complete one above the line between rows s and s + 1 and the empty one (``shown=0``)
    below it: the rows are cut from those two images (a figure of this many labels costs
    about half a second to draw; a cut, a few milliseconds).
    """
    full_fig = plot_masks(steps, token_text, title)
    ax = full_fig.axes[0]
    full = _pixels(full_fig)  # drawn: the layout (the axes' place) is now fixed
    to_figure = ax.transData + full_fig.transFigure.inverted()
    height = full.shape[0]
    empty = _pixels(plot_masks(steps, token_text, title, shown=0))
    if empty.shape != full.shape:
        raise RuntimeError("the empty and the complete mask figures differ in size")
    images = []
    for s in range(1, len(steps) + 1):
        frame = full.copy()
        if s < len(steps):  # from the line under row s on, the rows are not drawn yet
            y = to_figure.transform((0.0, s - 0.5))[1]
            cut = int(round((1.0 - y) * height))
            frame[cut:] = empty[cut:]
        images.append(_webp_img(frame, full_fig.get_figwidth()))
    return images


def _probability(p: float) -> str:
    """Three decimals (at two significant digits 0.996 reads as 1, as if the mask had
    nothing left to add), or two digits and an exponent below 1%, as the text quotes them."""
    return f"{p:.3f}" if p >= 0.01 else f"{p:.1e}"


def _step_table(run: MaskRun, step: int, token_text: Sequence[str]) -> pd.DataFrame:
    """One row: the token taken at ``step`` (1-based), how many tokens the mask allowed,
    their share of the model's probability, and the token's probability alone and masked."""
    mask, prob = run.steps[step - 1], run.probabilities[step - 1]
    row = {"step": step, "token taken": _show(token_text[mask.token]),
           "tokens allowed": int(mask.allowed.sum()),
           "probability allowed": _probability(prob.allowed_mass),
           "p(token), model alone": _probability(prob.free),
           "p(token), masked": _probability(prob.masked)}
    return one_header_row(pd.DataFrame([row]).set_index("step"))


def _step_metrics(run: MaskRun, step: int, tok: Any) -> dict[str, float | int | str]:
    mask, prob = run.steps[step - 1], run.probabilities[step - 1]
    return {"step": step, "token": tok.id_to_str(mask.token),
            "allowed": int(mask.allowed.sum()), "allowed_mass": prob.allowed_mass,
            "masked": prob.masked, "text": tok.decode(run.tokens[:step])}


def _step_caption(run: MaskRun, step: int, tok: Any) -> str:
    mask, prob = run.steps[step - 1], run.probabilities[step - 1]
    share = f"{prob.allowed_mass:.0%}" if prob.allowed_mass >= 0.01 else \
        f"{prob.allowed_mass:.1e}"
    # a slider shared by grammars of different lengths stays at the shorter one's last step
    last = " (the last)" if step == len(run.steps) else ""
    return (f"Step {step}{last}: {int(mask.allowed.sum())} of {mask.allowed.numel()} tokens "
            f"allowed, {share} of CityLM's probability; it takes "
            f"{_show(tok.id_to_str(mask.token))!r}, the text so far "
            f"{tok.decode(run.tokens[:step])!r}.")


def _checked_runs(model: Any, tok: Any, prompt: str, grammars: Mapping[str, str],
                  max_new_tokens: int) -> dict[str, MaskRun]:
    from minisrv.grammar import citylm_vocabulary

    vocab = citylm_vocabulary(tok, size=model.config.vocab_size)
    runs = served_masks(model, vocab, tok.encode(prompt), dict(grammars), max_new_tokens)
    differ = [name for name, run in runs.items() if not run.identical]
    if differ:
        raise RuntimeError(f"served with the others, {differ} differ from the request "
                           "generated alone")
    return runs


def mask_explorer(model: Any, tok: Any, prompt: str = "FR:",
                  grammars: Mapping[str, str] | None = None, steps: int = 25,
                  max_new_tokens: int = 40) -> Explorer:
    """``plot_masks`` stepped through a greedy generation, for each of ``grammars`` (name ->
    regex; default ``MASK_GRAMMARS``), the first ``steps`` steps of each.

    The requests of all grammars are served together by the engine and each output is
    checked against the request generated alone (``served_masks``; a difference raises).
    Each step's frame is ``plot_masks(..., shown=step)`` cut from two renderings
    (``step_images``), with a row of numbers for the step; the default state, every step of
    the first grammar (its last step, not the slider's end), is the chapter's figure. The
    kernel face is ``mask_widget``.
    """
    grammars = dict(MASK_GRAMMARS if grammars is None else grammars)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    runs = _checked_runs(model, tok, prompt, grammars, max_new_tokens)
    texts = token_texts(tok)
    shown = {name: min(steps, len(run.steps)) for name, run in runs.items()}
    images = {name: step_images(run.steps[:shown[name]], texts, _mask_title(run.regex))
              for name, run in runs.items()}
    first = next(iter(grammars))

    def draw(grammar: str, step: int) -> Frame:
        run, last = runs[grammar], shown[grammar]
        at = min(step, last)  # past its end a shorter generation stays at its last step
        metrics = {**_step_metrics(run, at, tok), "requests_checked": len(runs)}
        return Frame([images[grammar][at - 1], _step_table(run, at, texts)], metrics,
                     caption=_step_caption(run, at, tok))

    return explorer(draw, [("grammar", "grammar", list(grammars), first),
                           ("step", "step", list(range(1, steps + 1)), shown[first])],
                    live=lambda: mask_widget(model, tok, prompt, grammars, max_new_tokens))


def mask_widget(model: Any, tok: Any, prompt: str = "FR:",
                grammars: Mapping[str, str] | None = None, max_new_tokens: int = 40):
    """A grammar menu and a step slider over the greedy generation of ``prompt`` under each
    grammar (served and checked as in ``mask_explorer``); each change redraws
    ``plot_masks`` up to the step. Needs a live kernel (draw the static figure first)."""
    import ipywidgets as widgets
    from IPython.display import display

    grammars = dict(MASK_GRAMMARS if grammars is None else grammars)
    runs = _checked_runs(model, tok, prompt, grammars, max_new_tokens)
    texts = token_texts(tok)
    first = runs[next(iter(grammars))]
    controls = {"grammar": widgets.Dropdown(options=list(grammars), description="grammar"),
                "step": slider(len(first.steps), 1, max_new_tokens, "step")}

    def redraw(grammar: str, step: int) -> None:
        run = runs[grammar]
        at = min(step, len(run.steps))
        display(plot_masks(run.steps, texts, _mask_title(run.regex), shown=at))
        display(_step_table(run, at, texts))
        print(_step_caption(run, at, tok))

    return panel(redraw, controls)
