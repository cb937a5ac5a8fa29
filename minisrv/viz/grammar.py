"""Drawings of the structured-output chapter: the mask over CityLM's vocabulary step by
step, a grammar's automaton (graphviz), and the mask's cost beside a decode step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import graphviz
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from minisrv.experiments.structured import Automaton, MaskStep, StepProbability
from minisrv.viz.style import (
    BookFigure,
    graph_attrs,
    label_axes,
    legend_below,
    page_figure,
    styled,
)

__all__ = ["draw_automaton", "plot_allowed_mass", "plot_mask_cost", "plot_masks", "token_texts"]

ALLOWED, CHOSEN, FORBIDDEN = "#a5d8ff", "#1c7ed6", "#f1f3f5"


def _show(text: str) -> str:
    return {"\n": "\\n", " ": "␣", "<bos>": "bos", "<eos>": "eos"}.get(text, text)


@styled
def plot_masks(steps: Sequence[MaskStep], token_text: Sequence[str],
               title: str = "The mask, step by step") -> BookFigure:
    """One row per step, one column per token of the vocabulary: the allowed tokens lit,
    the chosen one dark. ``token_text[i]`` is token ``i``'s text (its column label)."""
    grid = np.zeros((len(steps), len(token_text)))
    for r, step in enumerate(steps):
        grid[r, step.allowed.numpy()] = 1
        grid[r, step.token] = 2
    fig, ax = page_figure(height_in=0.9 + 0.24 * len(steps))
    ax.imshow(grid, cmap=ListedColormap([FORBIDDEN, ALLOWED, CHOSEN]), vmin=0, vmax=2,
              aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(token_text)), [_show(t) for t in token_text], fontsize=7,
                  rotation=90)
    ax.set_yticks(range(len(steps)),
                  [f"{r + 1}: {_show(token_text[s.token])}" for r, s in enumerate(steps)],
                  fontsize=8)
    ax.grid(False)
    ax.tick_params(length=0)
    label_axes(ax, title, "token of the vocabulary", "step: token chosen")
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
        dot.edge(str(a), str(b), label=f" {_show(text) if len(text) == 1 else text} ",
                 penwidth="2" if len(text) > 1 else "1")
    return dot


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
    legend_below(fig, ncol=min(3, len(series)))
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
