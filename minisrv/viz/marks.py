"""Marks laid over a figure's image in an explorer's frame: the chosen value of a control that
does not change the figure.

An explorer precomputes one frame per state (``minisrv.viz.explorer``). Where a control only
moves a marker (the chosen batch on a step-time curve, the chosen rate on a latency curve),
drawing the figure once per state would multiply the drawing by that control's values; the
figure is drawn once and each value's marks are HTML laid over its image. They are placed in
percent of the image from the axes' positions, so they scale with the image at any width.

``figure_box`` opens a box holding the image (saving it lays the axes out, so call it before
placing marks); ``vline`` and ``ring`` are marks; ``CLOSE`` ends the box.
"""

from __future__ import annotations

from typing import Any

from minisrv.viz.explorer import part_html

__all__ = ["CLOSE", "figure_box", "ring", "vline"]

CLOSE = "</div>"
"""Ends the box ``figure_box`` opened, after the marks laid over it."""


def figure_box(fig: Any) -> str:
    """``fig``'s image inside an open box that marks are laid over (``CLOSE`` ends it): the
    frame's parts are joined into one string before the page parses them."""
    return '<div style="position:relative;width:fit-content;max-width:100%">' + part_html(fig)


def _place(fig: Any, ax: Any, x: float, y: float) -> tuple[float, float]:
    """Where the data point (``x``, ``y``) of ``ax`` lies, in percent of ``fig``'s image from
    its left and top edges."""
    px, py = ax.transData.transform((x, y))
    return 100 * px / fig.bbox.width, 100 * (1 - py / fig.bbox.height)


def vline(fig: Any, ax: Any, x: float, color: str) -> str:
    """A vertical line at data ``x`` over the whole height of ``ax``."""
    left, _ = _place(fig, ax, x, 1.0)  # 1.0: a y that a log axis also takes
    box = ax.get_position()
    return (f'<div style="position:absolute;left:{left:.2f}%;top:{100 * (1 - box.y1):.2f}%;'
            f'height:{100 * box.height:.2f}%;border-left:2px solid {color};opacity:.8"></div>')


def ring(fig: Any, ax: Any, x: float, y: float, color: str) -> str:
    """A thin ring round the data point (``x``, ``y``) of ``ax``, wider than a marker and
    hollow, so that the point, and a neighbour's, still show through it (a 2 px border hid
    the points of a crowded curve)."""
    left, top = _place(fig, ax, x, y)
    return (f'<div style="position:absolute;left:{left:.2f}%;top:{top:.2f}%;width:18px;'
            f'height:18px;margin:-10px 0 0 -10px;border:1px solid {color};'
            f'border-radius:50%"></div>')
