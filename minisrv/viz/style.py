"""The book's house style for figures: one size, one set of fonts, legends off the data.

The HTML column of the book is about 750 px wide and images are shrunk to fit it, so a
figure drawn 11 inches wide with matplotlib's 10-point defaults reaches the reader with
6-7 px labels. Every figure of ``minisrv.viz`` is therefore drawn at the column's width
(``PAGE_WIDTH_IN`` inches = 750 px at ``SCREEN_DPI``), with the fonts below, rendered at twice
that resolution for sharp text and shown at the column's width. Diagrams drawn with graphviz
take their font sizes from ``GRAPH_FONTS``.

How a drawing function uses it::

    @styled
    def plot_something(...) -> BookFigure:
        fig, ax = page_figure(height_in=3.5)
        ...
        label_axes(ax, "Title", "x (unit)", "y (unit)")
        legend_below(fig)
        return fig
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import matplotlib as mpl
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullLocator

PAGE_WIDTH_IN = 7.5
"""Width of every book figure in inches: the ~750 px text column at ``SCREEN_DPI``."""
SCREEN_DPI = 100
"""Pixels per inch at which a figure is shown: fonts of N points read as N x 100/72 px."""
RENDER_DPI = 200
"""Pixels per inch of the PNG itself: twice the screen, so text stays sharp when scaled."""

FONT_SIZES: dict[str, float] = {"text": 11, "ticks": 10, "legend": 10, "title": 12.5}
"""Points; at page width 10 pt is about 14 px, the smallest size that reads comfortably."""

BOOK_RC: dict[str, Any] = {
    "font.size": FONT_SIZES["text"],
    "axes.titlesize": FONT_SIZES["title"],
    "axes.labelsize": FONT_SIZES["text"],
    "xtick.labelsize": FONT_SIZES["ticks"],
    "ytick.labelsize": FONT_SIZES["ticks"],
    "legend.fontsize": FONT_SIZES["legend"],
    "legend.title_fontsize": FONT_SIZES["legend"],
    "figure.titlesize": FONT_SIZES["title"],
    "lines.linewidth": 2.0,
    "lines.markersize": 7,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.frameon": False,
}
"""matplotlib settings every book figure is drawn and rendered with."""

GRAPH_FONTS: dict[str, str] = {"fontname": "Helvetica", "node": "14", "edge": "12",
                               "cluster": "13"}
"""graphviz font sizes (points) for node labels, edge labels and cluster titles."""

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def book_style() -> Iterator[None]:
    """Draw (or render) inside the house style without touching the global rcParams."""
    with mpl.rc_context(BOOK_RC):
        yield


def styled(draw: F) -> F:
    """Decorator: run a drawing function inside ``book_style()``, so every artist it creates
    (tick labels, legends, annotations) takes the book's font sizes."""

    @functools.wraps(draw)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with book_style():
            return draw(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


class BookFigure(Figure):
    """A matplotlib Figure that Jupyter shows as a PNG when a cell returns it.

    Plain ``Figure`` objects only render once pyplot has switched on the inline backend;
    this one needs no pyplot and no global state, so each figure appears exactly once.
    A figure made by ``page_figure`` renders in the house style at ``RENDER_DPI`` and tells
    Jupyter (and the book) to show it at its width in screen pixels, i.e. the column's width.
    """

    book_styled: bool = False

    def _repr_png_(self) -> bytes | tuple[bytes, dict[str, dict[str, int]]]:
        buffer = io.BytesIO()
        if not self.book_styled:
            self.savefig(buffer, format="png", dpi=SCREEN_DPI)
            return buffer.getvalue()
        with book_style():
            self.savefig(buffer, format="png", dpi=RENDER_DPI)
        width = round(self.get_figwidth() * SCREEN_DPI)
        return buffer.getvalue(), {"width": width}

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
        """IPython asks for the mime bundle before any printer registered for ``Figure``
        (matplotlib's inline backend adds one that draws at screen resolution), so this
        keeps the book's rendering and display width on every page."""
        png = self._repr_png_()
        data, meta = png if isinstance(png, tuple) else (png, None)
        return ({"image/png": data, "text/plain": repr(self)},
                {"image/png": meta} if meta else {})


def _register_png_printer() -> None:
    """Keep ``BookFigure._repr_png_`` in charge inside IPython.

    Once pyplot is imported with the inline backend (ipywidgets' ``interactive_output`` does
    so), IPython gets a PNG printer for every matplotlib ``Figure``, and a printer registered
    for a type wins over ``_repr_png_``: every later figure of the page would come out at
    screen resolution and without its display width. A printer for ``BookFigure`` itself is
    more specific and wins over that one.
    """
    try:
        from IPython import get_ipython
    except ImportError:  # plain Python: _repr_png_ is only called by whoever asks for it
        return
    shell = get_ipython()
    if shell is not None:
        shell.display_formatter.formatters["image/png"].for_type(BookFigure,
                                                                 BookFigure._repr_png_)


_register_png_printer()


def page_figure(
    height_in: float,
    rows: int = 1,
    cols: int = 1,
    width_in: float = PAGE_WIDTH_IN,
    **subplots: Any,
) -> tuple[BookFigure, Any]:
    """A column-wide ``BookFigure`` with a grid of axes (``subplots`` goes to
    ``Figure.subplots``: ``sharex``, ``gridspec_kw`` ...). Returns ``(figure, axes)``.

    ``width_in`` may be smaller than the page for a small figure, never larger: anything
    wider is shrunk by the browser and its text with it.
    """
    if not 0 < width_in <= PAGE_WIDTH_IN:
        raise ValueError(f"width_in must be in (0, {PAGE_WIDTH_IN}], got {width_in}")
    if height_in <= 0:
        raise ValueError(f"height_in must be > 0, got {height_in}")
    with book_style():
        fig = BookFigure(figsize=(width_in, height_in), layout="constrained")
        fig.book_styled = True
        axes = fig.subplots(rows, cols, **{"squeeze": True, **subplots})
    return fig, axes


def label_axes(ax: Any, title: str | None = None, xlabel: str | None = None,
               ylabel: str | None = None) -> None:
    """Title (left-aligned, so a long one is never centred off both edges) and axis labels,
    which should name the quantity and its unit: ``"step time (ms)"``."""
    if title:
        ax.set_title(title, loc="left", fontsize=FONT_SIZES["title"])
    if xlabel:
        ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)


def legend_below(fig: Figure, handles: Sequence[Any] | None = None, ncol: int = 2,
                 **kwargs: Any) -> Any:
    """One legend for the whole figure, under the axes and off the data.

    With ``handles=None`` it gathers every labelled artist of every axes, once per label.
    Needs the constrained layout ``page_figure`` sets up, which makes room for it.
    """
    if handles is None:
        seen: dict[str, Any] = {}
        for ax in fig.axes:
            for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
                seen.setdefault(label, handle)
        handles = [h for h in seen.values()]
        labels = list(seen)
    else:
        labels = [h.get_label() for h in handles]
    return fig.legend(handles, labels, loc="outside lower center", ncol=ncol,
                      fontsize=FONT_SIZES["legend"], **kwargs)


def plain_log_ticks(ax) -> None:
    """Log axes labelled with plain numbers (1, 10, 1,000) at the powers of ten only.

    Matplotlib's default puts mathtext labels ($10^3$) and eight unlabelled minor ticks per
    decade on a log axis; laying those out is most of the cost of drawing a figure, which an
    explorer pays once per state, and plain numbers read faster in any case.
    """
    def plain(value: float, _position: int) -> str:
        return f"{value:,.0f}" if value >= 1 else f"{value:g}"

    for axis in (ax.xaxis, ax.yaxis):
        if axis.get_scale() == "log":
            axis.set_minor_locator(NullLocator())
            axis.set_major_formatter(FuncFormatter(plain))


def one_header_row(frame: Any) -> Any:
    """``frame`` with its index's name moved to the columns' name.

    pandas draws a named index as a second header row under the column names, half empty,
    which reads as a doubled header; as the columns' name it sits in the corner cell of the
    one header row instead (the levels of a row MultiIndex joined by " / "). The rows are
    unchanged (``frame.loc[...]`` works as before)."""
    names = list(frame.index.names)
    if any(name is None for name in names) or frame.columns.nlevels != 1:
        return frame
    out = frame.copy()
    out.columns.name = " / ".join(str(name) for name in names)
    out.index.names = [None] * len(names)
    return out


def graph_attrs(**graph: str) -> dict[str, dict[str, str]]:
    """Keyword arguments for ``graphviz.Digraph`` in the house style: font and sizes for
    nodes and edges, plus any graph attributes given (``rankdir="TB"`` ...)."""
    font = GRAPH_FONTS["fontname"]
    return {
        "graph_attr": {"fontname": font, "fontsize": GRAPH_FONTS["cluster"], **graph},
        "node_attr": {"fontname": font, "fontsize": GRAPH_FONTS["node"]},
        "edge_attr": {"fontname": font, "fontsize": GRAPH_FONTS["edge"]},
    }
