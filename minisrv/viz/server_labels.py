"""The rate labels of the server chapter's latency-throughput figure, laid out so that none
covers another label or a data point (``place_labels``).

Split from ``minisrv.viz.server``: the layout of the labels is its own problem, and the
figure's module stays within the package's size per file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.transforms import Bbox

from minisrv.viz.style import BookFigure

__all__ = ["LABEL_PLACES", "SHARED_LABEL", "place_labels"]


LABEL_PLACES: tuple[tuple[int, int], ...] = (
    (5, -10), (-5, -10), (5, 3), (-5, 3), (9, -4), (-9, -4), (5, -19), (-5, -19), (5, 12),
    (-5, 12), (12, -4), (-12, -4), (8, -24), (-8, -24), (8, 18), (-8, 18))
"""Where a rate label may sit, in points from its point, in the order tried."""

SHARED_LABEL = "#495057"
"""The color (dark grey) of a rate label that stands for the coinciding points of curves."""

_SAME_POINT_PX = 12.0
"""Points of one rate closer than this (in pixels) share one label."""


def place_labels(fig: BookFigure, labels: Sequence[Any]) -> None:
    """Lay out the rate labels of ``labels`` (in the order drawn) so that none covers another.

    A label whose rate another curve's label already writes within ``_SAME_POINT_PX`` of its
    point is hidden, that label turning ``SHARED_LABEL`` grey (at low rates the configurations'
    points coincide). Every other label takes the first place of ``LABEL_PLACES`` where it
    covers no label placed before it and no data point of its axes (a saturated curve's last
    points nearly coincide too, and a label on a point hid it)."""
    fig.draw_without_rendering()  # lays the figure out: the labels' boxes are where they will be
    placed: list[tuple[Any, Any]] = []  # (label, its box)
    points = _point_boxes(fig, {label.axes for label in labels})
    for label in labels:
        at = label.axes.transData.transform(label.xy)
        twin = next((other for other, _ in placed if other.get_text() == label.get_text()
                     and np.hypot(*(other.axes.transData.transform(other.xy) - at))
                     < _SAME_POINT_PX), None)
        if twin is not None:
            label.set_visible(False)
            twin.set_color(SHARED_LABEL)
            continue
        for dx, dy in LABEL_PLACES:
            label.xyann = (dx, dy)
            label.set_horizontalalignment("left" if dx > 0 else "right")
            box = label.get_window_extent()
            if not any(box.overlaps(other) for other in (*(b for _, b in placed), *points)):
                break
        else:  # nowhere free: the first place, as before
            label.xyann = LABEL_PLACES[0]
            label.set_horizontalalignment("left")
            box = label.get_window_extent()
        placed.append((label, box))


def _point_boxes(fig: BookFigure, axes: set[Any]) -> list[Any]:
    """The display boxes of every marker drawn on ``axes``, a marker's size wide."""
    boxes = []
    for ax in axes:
        for line in ax.lines:
            if line.get_marker() in (None, "None", ""):
                continue
            half = line.get_markersize() * fig.dpi / 72 / 2
            for px, py in ax.transData.transform(line.get_xydata()):
                boxes.append(Bbox.from_extents(px - half, py - half, px + half, py + half))
    return boxes
