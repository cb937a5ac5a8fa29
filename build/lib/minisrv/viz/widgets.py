"""The few lines every widget of the book shares: labelled sliders and a redraw panel.

Each chapter's widget is a handful of controls and a function that redraws a figure from
their values. ``slider`` builds a control with the book's conventions (the label shown in
full, no redraw while dragging: each redraw re-runs an experiment), and ``panel`` lays the
controls out in rows above the output that ``redraw`` fills.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["panel", "slider"]


def slider(value: float, low: float, high: float, label: str, step: float | None = None,
           log: bool = False) -> Any:
    """An int slider when ``value``, ``low`` and ``high`` are ints and ``step`` is an int or
    ``None``; else a float slider. With ``log``, ``low`` and ``high`` are base-10 exponents
    and ``value`` the value itself (ipywidgets' ``FloatLogSlider``)."""
    import ipywidgets as widgets

    common = {"description": label, "style": {"description_width": "initial"},
              "continuous_update": False}
    if log:
        return widgets.FloatLogSlider(value=value, base=10, min=low, max=high,
                                      step=step or 0.25, **common)
    ints = all(isinstance(x, int) for x in (value, low, high)) and isinstance(step, int | None)
    if ints:
        return widgets.IntSlider(value=value, min=low, max=high, step=step or 1, **common)
    return widgets.FloatSlider(value=value, min=low, max=high, step=step or 0.01, **common)


def panel(redraw: Callable[..., None], controls: Mapping[str, Any], per_row: int = 2) -> Any:
    """``controls`` in rows of ``per_row`` above an output area that ``redraw(**values)``
    fills whenever a control changes (and once now). Needs a live kernel to react."""
    import ipywidgets as widgets

    boxes = list(controls.values())
    rows = [widgets.HBox(boxes[i:i + per_row]) for i in range(0, len(boxes), per_row)]
    output = widgets.interactive_output(redraw, dict(controls))
    return widgets.VBox([*rows, output])
