"""The shared widget panel: what ``redraw`` prints and displays reaches the page, and no
``Output`` widget is involved (nbclient's mimic of one can stall the book's build for a whole
cell time limit; see ``minisrv.viz.widgets.panel``)."""

from __future__ import annotations

import base64
from pathlib import Path

import nbformat
import pytest
from cell_guard import execute

pytest.importorskip("ipywidgets")

from minisrv.viz.widgets import as_html, rendered  # noqa: E402


def test_each_display_becomes_its_richest_html() -> None:
    table = {"text/html": "<table><tr><td>1</td></tr></table>", "text/plain": "1"}
    assert as_html(table, {}) == table["text/html"]
    svg = '<?xml version="1.0"?>\n<!DOCTYPE svg>\n<svg width="10"><g/></svg>'
    assert as_html({"image/svg+xml": svg, "text/plain": "tree"}, {}) == '<svg width="10"><g/></svg>'
    png = b"\x89PNG\r\n\x1a\n-some-bytes"
    encoded = base64.b64encode(png).decode()
    assert as_html({"image/png": png, "text/plain": "<Figure>"}, {"image/png": {"width": 750}}
                   ) == f'<img src="data:image/png;base64,{encoded}" width="750">'
    assert as_html({"image/png": encoded}, {}) == f'<img src="data:image/png;base64,{encoded}">'
    assert as_html({"text/plain": "a < b"}, {}) == "<pre>a &lt; b</pre>"


def test_printed_text_and_errors_are_shown_escaped() -> None:
    assert rendered(lambda n: print("n <", n), {"n": 3}) == "<pre>n &lt; 3\n</pre>"

    def refuses(capacity: int) -> None:
        raise ValueError(f"a pool of {capacity} tokens holds no request")

    shown = rendered(refuses, {"capacity": 8})
    assert shown.startswith("<pre>Traceback") and "a pool of 8 tokens holds no request" in shown


PANEL_CELL = """\
from minisrv.viz.style import page_figure
from minisrv.viz.widgets import panel, slider

def redraw(a):
    print(f"a = {a}")
    fig, ax = page_figure(height_in=2)
    ax.plot([0, 1], [0, a])
    display(fig)

box = panel(redraw, {"a": slider(3, 1, 5, "a")})
box"""


def test_a_panel_in_an_executed_notebook_shows_text_and_figure_without_an_output_widget(
    tmp_path: Path,
) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(PANEL_CELL),
                nbformat.v4.new_code_cell("box.children[0].children[0].value = 4")]
    execute(nb, tmp_path / "panel.ipynb", timeout=60, kernel_name="python3")
    states = [w["state"] for w in
              nb.metadata.widgets["application/vnd.jupyter.widget-state+json"]["state"].values()]
    assert "OutputModel" not in {s["_model_name"] for s in states}
    (view,) = [s for s in states if s["_model_name"] == "HTMLModel"]
    assert view["value"].startswith("<pre>a = 4\n</pre>\n<img src=\"data:image/png;base64,")
    assert view["value"].endswith(' width="750">')  # the figure's width on the page


OUTPUT_WIDGET_NAMES = {"Output", "interactive_output", "interact", "interactive",
                       "interact_manual"}
def test_no_widget_uses_an_output_widget() -> None:
    import ast

    root = Path(__file__).resolve().parent.parent
    using = set()
    for path in sorted((root / "minisrv").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = (node.attr if isinstance(node, ast.Attribute)
                    else node.id if isinstance(node, ast.Name)
                    else None)
            imported = ({alias.name for alias in node.names}
                        if isinstance(node, ast.ImportFrom) else set())
            if name in OUTPUT_WIDGET_NAMES or imported & OUTPUT_WIDGET_NAMES:
                using.add(path.relative_to(root).as_posix())
    assert not using, f"Output widgets (nbclient can stall on them: see panel): {using}"
