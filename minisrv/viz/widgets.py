"""The few lines every widget of the book shares: labelled sliders and a redraw panel.

Each chapter's widget is a handful of controls and a function that redraws a figure from
their values. ``slider`` builds a control with the book's conventions (the label shown in
full, no redraw while dragging: each redraw re-runs an experiment), and ``panel`` lays the
controls out in rows above a view of what ``redraw`` prints and displays.
"""

from __future__ import annotations

import base64
import html
import traceback
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["as_html", "panel", "rendered", "slider"]


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
    """``controls`` in rows of ``per_row`` above a view that shows what ``redraw(**values)``
    prints and displays, redrawn whenever a control changes (and once now). Needs a live
    kernel to react.

    The view is an ``HTML`` widget whose value is rewritten, not an ``Output`` widget
    (``interactive_output``). nbclient (``make book``, ``make colab-check``) mimics an Output
    widget by sending its new outputs back to the kernel, a ``comm_msg`` on the shell socket
    it is polling for the cell's ``execute_reply``; jupyter_client sends it through a
    synchronous shadow of that asyncio socket, which can swallow the wake-up of a reply that
    just arrived. The kernel is idle, the reply sits in the socket, and the cell ends only
    when nbclient's cell timeout runs out (jupyter/nbclient#312). Measured on one cell
    executed repeatedly by nbclient: an Output widget showing a large figure stalled 20 of
    60 times (21 of 60 with ipykernel 6; a small figure 3 of 140); this view 0 of 60, as
    nothing is sent back. Text printed by ``redraw`` comes first, then what it displays.
    """
    import ipywidgets as widgets

    boxes = list(controls.values())
    rows = [widgets.HBox(boxes[i:i + per_row]) for i in range(0, len(boxes), per_row)]
    view = widgets.HTML()

    def update(change: Any = None) -> None:
        view.value = rendered(redraw, {name: c.value for name, c in controls.items()})

    for control in boxes:
        control.observe(update, names="value")
    update()
    return widgets.VBox([*rows, view])


def rendered(redraw: Callable[..., None], values: Mapping[str, Any]) -> str:
    """What ``redraw(**values)`` prints (stdout, then stderr) and displays, as one HTML
    fragment; an exception is shown as its traceback (a control set to a value the
    experiment refuses must say why, not leave the old figure up)."""
    from IPython.utils.capture import capture_output

    with capture_output() as captured:
        try:
            redraw(**values)
        except Exception:
            print(traceback.format_exc())
    text = captured.stdout + captured.stderr
    parts = [f"<pre>{html.escape(text)}</pre>"] if text else []
    parts += [as_html(out.data, out.metadata) for out in captured.outputs]
    return "\n".join(parts)


def as_html(data: Mapping[str, Any], metadata: Mapping[str, Any]) -> str:
    """The richest HTML form of one display's mime bundle (a DataFrame's table, a graphviz
    SVG, a figure's PNG at the width it asks for, else its text)."""
    if "text/html" in data:
        return data["text/html"]
    if "image/svg+xml" in data:
        svg = data["image/svg+xml"]
        return svg[svg.find("<svg"):]  # no XML prolog inside a page
    if "image/png" in data:
        png = data["image/png"]
        encoded = base64.b64encode(png).decode() if isinstance(png, bytes) else png
        width = (metadata.get("image/png") or {}).get("width")
        size = f' width="{width}"' if width else ""
        return f'<img src="data:image/png;base64,{encoded}"{size}>'
    return f"<pre>{html.escape(data.get('text/plain', ''))}</pre>"
