"""Explorers that work in the rendered book: every state precomputed, switched in the page.

The rendered HTML has no kernel, so a slider that calls Python does nothing there. An
explorer therefore runs the chapter's own experiment for every state a reader can reach, when
the notebook executes (the book's build, Colab, nbval), and carries the results in one output
with two faces:

- ``text/html``: plain HTML controls (a range input per numeric control, a select per named
  one), the frames, and a few lines of JavaScript that show the frame of the chosen values.
  Nothing is fetched: frames and script are inlined, so the page works opened from disk
  (``file://`` cannot ``fetch()``) with no network. The book's build prefers this face
  (``nb_mime_priority_overrides`` in ``_config.yml``).
- the kernel widget (Jupyter, Colab), built by the chapter's ``live`` function: it re-runs the
  same experiment for any value, not only the ones the page holds.

Each state is a ``Frame``: what it shows (figures, tables, graphviz drawings, text) and the
numbers the run produced (``metrics``). The numbers ride on the explorer's element as
``data-metrics`` (JSON) next to ``data-values``, so a browser test can check that the state
shown is the run Python computed for those values, and a hidden cell can check the numbers.

Why frames of images rather than a data-driven chart (Vega-Lite, Plotly) or ipywidgets'
``jslink`` with a bundled widget manager: each state must look exactly like the static figure
above it, drawn by the same matplotlib or graphviz code, and several explorers show trees and
tables that no chart grammar draws; frames need no JavaScript library at all. A frame costs
bytes, not code. Measured on chapter 07's overlap timelines at the column's width: a PNG at the
book's 200 dpi takes 102 KB, at 100 dpi 46 KB, the SVG 64 KB, a lossless WebP at 100 dpi 17 KB
(Chromium, Firefox and Safari show WebP). So frames are lossless WebP at ``FRAME_DPI`` shown at
the column's width, and a 25-state explorer weighs about half a megabyte. A part that several
states share (a table one control does not change) is stored once.
"""

from __future__ import annotations

import base64
import html
import io
import itertools
import json
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Explorer", "Frame", "explorer", "FRAME_DPI"]

FRAME_DPI = 100
"""Pixels per inch of a frame: the column's own resolution (``style.SCREEN_DPI``); rendering
dominates an explorer's precompute, and it grows with the pixels."""
WEBP = {"lossless": True, "quality": 20, "method": 2}
"""Lossless, with little effort spent compressing: on chapter 07's figure this encodes in
37 ms to 18 KB, where Pillow's default effort takes 246 ms for 17 KB."""
MAX_STATES = 150
"""More states than this make a page too heavy for a reader: choose a coarser grid."""


@dataclass
class Frame:
    """One state of an explorer: ``parts`` shown top to bottom (a matplotlib Figure, a pandas
    DataFrame, a graphviz graph, an HTML or plain string) and the run's numbers."""

    parts: Sequence[Any]
    metrics: Mapping[str, float | int | str] = field(default_factory=dict)
    caption: str = ""


@dataclass
class Control:
    """A control of the page: the values it holds, the one shown first, its label, and the
    format its values are shown in (``","``: 8,192, as the prose writes it)."""

    name: str
    label: str
    values: list[Any]
    default: Any
    fmt: str = ""

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError(f"control {self.name!r} has no values")
        if len(set(map(repr, self.values))) != len(self.values):
            raise ValueError(f"control {self.name!r} repeats a value: {self.values}")
        if self.default not in self.values:
            raise ValueError(f"control {self.name!r}: default {self.default!r} is not one of "
                             f"its values {self.values}")

    def shown(self, value: Any) -> str:
        """``value`` as the control's label and options write it."""
        return format(value, self.fmt) if self.fmt else _shown(value)

    @property
    def numeric(self) -> bool:
        return all(isinstance(v, int | float) and not isinstance(v, bool) for v in self.values)


class _Layouts:
    """The axes' places of the first figure of each shape, given to the figures after it.

    A constrained layout is solved anew at every draw and took 60% of drawing a frame of
    chapter 03a's two panels. The states of an explorer are one figure drawn with other
    numbers, so the layout of the first (the default state) serves them all: each frame then
    costs one draw, and switching states never shifts an axis under the reader's eye. Other
    numbers can need other margins, though: three-digit ticks after two-digit ones pushed
    chapter 06's y-labels off the figure, and a legend of eight workers in two rows, laid out
    for four in one, covered its x-label. So the shape counts the characters of each axes'
    longest y tick label and the entries of each legend, and a state that differs in them
    gets a layout of its own.
    """

    def __init__(self) -> None:
        self.places: dict[tuple, list[Any]] = {}

    def fix(self, fig: Any) -> None:
        import matplotlib as mpl
        from matplotlib.layout_engine import ConstrainedLayoutEngine

        if not isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine):
            return
        shape = (tuple(fig.get_size_inches()), tuple(type(ax).__name__ for ax in fig.axes),
                 tuple(_ytick_width(ax) for ax in fig.axes),
                 tuple(len(legend.get_texts()) for legend in fig.legends))
        if shape not in self.places:
            fig.draw_without_rendering()  # the one solve of this shape
            self.places[shape] = [ax.get_position() for ax in fig.axes]
        # No engine at all, not "none"'s placeholder: savefig draws a figure that has any
        # engine once more before rendering it (for the layout), and that unrendered draw
        # was a third of a frame's time (chapter 06's: 0.19 s, 0.14 s without, same pixels).
        with mpl.rc_context({"figure.autolayout": False, "figure.constrained_layout.use": False}):
            fig.set_layout_engine(None)
        for ax, place in zip(fig.axes, self.places[shape], strict=True):
            ax.set_position(place)


def _ytick_width(ax: Any) -> int:
    """Characters of the longest y tick label the axes shows. Ticks outside the view count
    for nothing: before a draw the locator also returns one beyond each limit ("-10" under
    0 to 70), which gave a 0-70 axis the width of a 0-200 one and chapter 06's explorer
    the two-digit layout for its three-digit states."""
    low, high = sorted(ax.get_ylim())
    shown = [t for t in ax.get_yticks() if low <= t <= high]
    return max((len(text) for text in ax.yaxis.get_major_formatter().format_ticks(shown)),
               default=0)


def _figure_html(fig: Any, layouts: _Layouts | None = None) -> str:
    """A matplotlib figure as an ``<img>`` of lossless WebP, at the column's width."""
    from minisrv.viz.style import SCREEN_DPI, book_style

    if layouts is not None:
        with book_style():
            layouts.fix(fig)
    buffer = io.BytesIO()
    with book_style():
        fig.savefig(buffer, format="webp", dpi=FRAME_DPI, pil_kwargs=WEBP)
    import matplotlib.pyplot as plt

    plt.close(fig)
    width = round(fig.get_figwidth() * SCREEN_DPI)
    data = base64.b64encode(buffer.getvalue()).decode()
    return (f'<img alt="" style="width:{width}px;max-width:100%" '
            f'src="data:image/webp;base64,{data}">')


def part_html(part: Any, layouts: _Layouts | None = None) -> str:
    """HTML for one part of a frame (what each kind looks like in the page); ``layouts``
    shares the first figure's layout with the figures of the same shape after it."""
    from matplotlib.figure import Figure

    if isinstance(part, Figure):
        return _figure_html(part, layouts)
    if hasattr(part, "to_html") and hasattr(part, "columns"):  # a pandas DataFrame
        return part.to_html(classes="dataframe", border=0)
    if hasattr(part, "pipe") and hasattr(part, "source"):  # a graphviz graph
        svg = part.pipe(format="svg", encoding="utf-8")
        return svg[svg.index("<svg"):]  # without the XML prolog and doctype
    if isinstance(part, str):
        return part if part.lstrip().startswith("<") else f"<p>{html.escape(part)}</p>"
    raise TypeError(f"an explorer frame cannot show a {type(part).__name__}")


_SCRIPT = """
(function () {
  if (window.minisrvExplorer) return;
  window.minisrvExplorer = function (root) {
    var data = JSON.parse(root.querySelector('script[type="application/json"]').textContent);
    var inputs = root.querySelectorAll('[data-control]');
    var view = root.querySelector('.mx-view');
    function show() {
      var index = 0, values = {};
      inputs.forEach(function (input, k) {
        var i = Number(input.value), c = data.controls[k];
        index = index * c.values.length + i;
        values[c.name] = c.values[i];
        var out = root.querySelector('[data-value-of="' + c.name + '"]');
        if (out) out.textContent = c.shown[i];
      });
      var state = data.states[index];
      view.innerHTML = state.parts.map(function (p) { return data.parts[p]; }).join('')
        + (state.caption ? '<p class="mx-caption">' + state.caption + '</p>' : '');
      root.dataset.values = JSON.stringify(values);
      root.dataset.metrics = JSON.stringify(state.metrics);
      root.dataset.state = String(index);
    }
    inputs.forEach(function (input) { input.addEventListener('input', show); });
    show();
  };
})();
"""

_STYLE = """
.minisrv-explorer{border:1px solid #d0d7de;border-radius:6px;padding:.6em .8em;margin:1em 0}
.minisrv-explorer .mx-controls{display:flex;flex-wrap:wrap;gap:.4em 1.6em;margin-bottom:.5em}
.minisrv-explorer label{display:flex;align-items:center;gap:.5em;font-size:.9em}
.minisrv-explorer output{font-variant-numeric:tabular-nums;min-width:4em}
.minisrv-explorer .mx-caption{font-size:.9em;color:#444;margin:.3em 0 0}
.minisrv-explorer .mx-view img{display:block}
.minisrv-explorer .mx-view svg{max-width:100%;height:auto}
"""


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


class Explorer:
    """Precomputed states of an experiment behind HTML controls, plus the kernel widget.

    Build one with ``explorer(...)``. ``states`` maps each tuple of control values (in the
    controls' order) to its ``Frame``'s metrics; ``metrics(**values)`` reads one. ``runs``:
    the runs its states were drawn from, where the code after it reads them too.
    """

    def __init__(self, controls: Sequence[Control], frames: Mapping[tuple, Frame],
                 live: Callable[[], Any] | None = None, title: str = "",
                 runs: Any = None) -> None:
        self.controls = list(controls)
        self.live = live
        self.title = title
        self.runs = runs
        self.states = {key: dict(frame.metrics) for key, frame in frames.items()}
        self.html = self._render(frames)

    def metrics(self, **values: Any) -> dict[str, Any]:
        """The numbers of the state at ``values`` (every control named)."""
        names = [c.name for c in self.controls]
        if sorted(values) != sorted(names):
            raise ValueError(f"name every control once: {names}, got {sorted(values)}")
        key = tuple(values[n] for n in names)
        if key not in self.states:
            raise KeyError(f"the page holds no state at {values}")
        return self.states[key]

    @property
    def default(self) -> dict[str, Any]:
        return {c.name: c.default for c in self.controls}

    def _render(self, frames: Mapping[tuple, Frame]) -> str:
        parts: list[str] = []
        seen: dict[str, int] = {}
        layouts = _Layouts()
        default = tuple(c.default for c in self.controls)
        shown = {default: [part_html(p, layouts) for p in frames[default].parts]}  # its layout
        states = []
        for key in itertools.product(*(c.values for c in self.controls)):
            frame = frames[key]
            refs = []
            for text in shown.pop(key, None) or [part_html(p, layouts) for p in frame.parts]:
                if text not in seen:
                    seen[text] = len(parts)
                    parts.append(text)
                refs.append(seen[text])
            states.append({"parts": refs, "metrics": dict(frame.metrics),
                           "caption": html.escape(frame.caption)})
        data = {"controls": [{"name": c.name, "values": c.values,
                              "shown": [c.shown(v) for v in c.values]} for c in self.controls],
                "states": states, "parts": parts}
        payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
        uid = "mx-" + uuid.uuid4().hex[:12]
        inputs = []
        for c in self.controls:
            start = c.values.index(c.default)
            if c.numeric:
                widget = (f'<input type="range" data-control="{c.name}" min="0" '
                          f'max="{len(c.values) - 1}" step="1" value="{start}">'
                          f'<output data-value-of="{c.name}">{c.shown(c.default)}</output>')
            else:
                options = "".join(
                    f'<option value="{i}"{" selected" if i == start else ""}>'
                    f"{html.escape(c.shown(v))}</option>" for i, v in enumerate(c.values))
                widget = f'<select data-control="{c.name}">{options}</select>'
            inputs.append(f"<label>{html.escape(c.label)} {widget}</label>")
        heading = f'<p class="mx-title"><b>{html.escape(self.title)}</b></p>' if self.title else ""
        return (f'<div class="minisrv-explorer" id="{uid}"><style>{_STYLE}</style>{heading}'
                f'<div class="mx-controls">{"".join(inputs)}</div><div class="mx-view"></div>'
                f'<script type="application/json">{payload}</script>'
                f"<script>{_SCRIPT}window.minisrvExplorer(document.getElementById('{uid}'));"
                f"</script></div>")

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """Both faces in one output: a notebook front end with widgets shows the kernel widget,
        the book's build takes the HTML."""
        names = ", ".join(f"{c.name} ({len(c.values)})" for c in self.controls)
        bundle: dict[str, Any] = {"text/html": self.html,
                                  "text/plain": f"Explorer over {names}: "
                                                f"{len(self.states)} precomputed states"}
        if self.live is not None and _in_kernel():
            bundle.update(_widget_bundle(self.live()))
        return bundle


def _in_kernel() -> bool:
    """A running IPython kernel (Jupyter, Colab): the only place a widget can talk back."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _widget_bundle(widget: Any) -> dict[str, Any]:
    bundle = widget._repr_mimebundle_()
    data = bundle[0] if isinstance(bundle, tuple) else bundle
    return {k: v for k, v in data.items() if k != "text/plain"}


def explorer(draw: Callable[..., Frame], controls: Sequence[tuple[Any, ...]],
             live: Callable[[], Any] | None = None, title: str = "",
             runs: Any = None) -> Explorer:
    """Run ``draw(**values)`` for every combination of the controls' values and return the
    ``Explorer`` that switches between them.

    ``controls``: ``(name, label, values, default)`` per control, in the order they appear,
    with the values' format after them where it is not ``str`` (``","`` for thousands);
    ``draw`` returns a ``Frame`` (the experiment's figure or table and its numbers) and is
    the same code the chapter's static figure and kernel widget run. ``live`` builds the
    kernel widget (called only where a kernel can show it). ``runs``: what ``draw`` reads,
    kept on the explorer (``Explorer.runs``) for the cells after it.
    """
    made = [Control(name, label, list(values), default, *fmt)
            for name, label, values, default, *fmt in controls]
    names = [c.name for c in made]
    if len(set(names)) != len(names):
        raise ValueError(f"control names repeat: {names}")
    count = math.prod(len(c.values) for c in made)
    if count > MAX_STATES:
        raise ValueError(f"{count} states is more than {MAX_STATES}: choose fewer values")
    from minisrv.sim.run import collector_paused

    frames = {}
    # Every frame's runs and figures live until the page is rendered, and the collections
    # meanwhile would only traverse them again (see ``collector_paused``).
    with collector_paused():
        for key in itertools.product(*(c.values for c in made)):
            frame = draw(**dict(zip(names, key)))
            if not isinstance(frame, Frame):
                raise TypeError(f"draw must return a Frame, got {type(frame).__name__}")
            frames[key] = frame
        return Explorer(made, frames, live=live, title=title, runs=runs)
