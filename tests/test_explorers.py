"""Explorers in the rendered book: each works opened from disk with no network.

The pages are built by the book's own configuration (``_config.yml``: MyST-NB told to prefer
the explorer's HTML over the kernel widget and to load no widget manager from a CDN) from
the outputs the chapters saved when they were executed, into one small book of a single page,
so the test needs seconds rather than the whole book's build. Chromium then opens that page
with every network request refused, moves each control of each explorer to its ends and its
middle, and checks that the figure changes, that nothing on the page is blank or an error, and
that the state shown carries the numbers the Python side computed for those values.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml
from browser import network_loads, offline_page

from minisrv.viz.explorer import MAX_STATES, Frame, explorer

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
MARK = 'class="minisrv-explorer"'
WIDGET = "application/vnd.jupyter.widget-view+json"


@functools.cache
def explorer_outputs(path: Path) -> list[dict]:
    """The saved outputs of ``path`` that carry an explorer, as the notebook holds them (each
    chapter read once, for its test and for the built page; nothing changes them)."""
    found = []
    for cell in nbformat.read(path, as_version=4).cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else ():
            if MARK in output.get("data", {}).get("text/html", ""):
                found.append(output)
    return found


# ----------------------------------------------------------------------- the mechanism


def _table_frame(a: int, b: str) -> Frame:
    import pandas as pd

    return Frame([pd.DataFrame({"a": [a], "b": [b]}), "a note"], {"sum": a + len(b)},
                 caption=f"a={a}")


def test_every_state_is_computed_once_and_read_back_by_its_values() -> None:
    calls = []

    def draw(a: int, b: str) -> Frame:
        calls.append((a, b))
        return _table_frame(a, b)

    ex = explorer(draw, [("a", "a value", [1, 2, 3], 2), ("b", "a name", ["x", "yy"], "x")])
    assert sorted(calls) == sorted(itertools.product([1, 2, 3], ["x", "yy"]))
    assert ex.metrics(a=3, b="yy") == {"sum": 5}
    assert ex.default == {"a": 2, "b": "x"}
    assert ex.html.count("a note") == 1  # a part every state shares is stored once
    assert "http://" not in ex.html and "https://" not in ex.html
    with pytest.raises(KeyError, match="no state"):
        ex.metrics(a=4, b="x")
    with pytest.raises(ValueError, match="name every control"):
        ex.metrics(a=1)


@pytest.mark.parametrize("controls, message", [
    ([("a", "a", [1, 2], 3)], "default 3 is not one of"),
    ([("a", "a", [], None)], "has no values"),
    ([("a", "a", [1, 1], 1)], "repeats a value"),
    ([("a", "a", [1], 1), ("a", "again", [2], 2)], "names repeat"),
    ([("a", "a", list(range(MAX_STATES + 1)), 0)], "choose fewer values"),
])
def test_bad_controls_are_refused_before_any_run(controls, message) -> None:
    with pytest.raises(ValueError, match=message):
        explorer(lambda **_: pytest.fail("ran an experiment"), controls)


def test_every_frame_takes_the_layout_of_the_first_of_its_shape(monkeypatch) -> None:
    """States of one shape share the default's layout; wider tick labels or a legend of more
    entries get a layout of their own (chapter 06's three-digit ticks and legend of eight
    workers, laid out as its default, lost their y-label and covered their x-label)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.layout_engine import ConstrainedLayoutEngine

    from minisrv.viz.style import label_axes, legend_below, page_figure

    def plot(top: int, lines: int) -> Figure:
        fig, ax = page_figure(height_in=2.0)
        for i in range(lines):
            ax.plot([0, 1], [0, top], label=f"line {i}")
        label_axes(ax, f"state {top}", "x", "y")
        legend_below(fig, ncol=4)
        return fig

    figures, draws = {}, []
    figure_draw = Figure.draw
    monkeypatch.setattr(Figure, "draw", lambda self, r: (draws.append(self), figure_draw(self, r)))

    def draw(top: int, lines: int) -> Frame:
        figures[top, lines] = plot(top, lines)
        return Frame([figures[top, lines]], {"top": top})

    # ticks of two digits up to 40, 60 and 80; of three up to 200, of four up to 4000 (each
    # axis also has a tick of three characters outside its view, "-10" or "-50", before a draw)
    explorer(draw, [("top", "top", [40, 60, 80, 200, 4000], 40), ("lines", "lines", [1, 8], 1)])
    places = {key: fig.axes[0].get_position().bounds for key, fig in figures.items()}
    assert places[40, 1] == places[60, 1] == places[80, 1]
    assert places[40, 8] == places[80, 8] != places[40, 1]
    assert len({places[top, 1] for top in (40, 200, 4000)}) == 3
    assert not any(isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine)
                   for fig in figures.values())  # no solve left for savefig
    # one draw per frame and one solve per shape: savefig draws a figure that keeps any
    # layout engine (even "none"'s placeholder) twice
    assert len(draws) == len(figures) + 6
    alone = plot(40, 1)  # the default's layout is the one it has alone
    alone.draw_without_rendering()
    assert alone.axes[0].get_position().bounds == pytest.approx(places[40, 1])
    for fig in figures.values():  # every label on the figure, clear of the legend
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        renderer = canvas.get_renderer()
        ylabel = fig.axes[0].yaxis.label.get_window_extent(renderer)
        xlabel = fig.axes[0].xaxis.label.get_window_extent(renderer)
        legend = fig.legends[0].get_window_extent(renderer)
        assert ylabel.x0 >= 0 and not xlabel.overlaps(legend)


def test_a_draw_that_returns_no_frame_is_refused() -> None:
    with pytest.raises(TypeError, match="must return a Frame"):
        explorer(lambda a: "a figure", [("a", "a", [1], 1)])


def test_outside_a_kernel_the_output_is_the_html_face() -> None:
    ex = explorer(_table_frame, [("a", "a", [1], 1), ("b", "b", ["x"], "x")],
                  live=lambda: pytest.fail("built a widget without a kernel"))
    bundle = ex._repr_mimebundle_()
    assert MARK in bundle["text/html"] and WIDGET not in bundle


# ------------------------------------------------------------------- the built page


def build_page(outputs: list[dict], where: Path) -> Path:
    """One page holding ``outputs``, built by ``jupyter-book`` with the book's configuration
    (nothing executed); returns the HTML file."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    config["execute"]["execute_notebooks"] = "off"
    config["only_build_toc_files"] = True
    (where / "_config.yml").write_text(yaml.safe_dump(config))
    (where / "_toc.yml").write_text("format: jb-book\nroot: page\n")
    shutil.copy(ROOT / "references.bib", where)
    shutil.copytree(ROOT / "_ext", where / "_ext")
    nb = nbformat.v4.new_notebook()
    # the chapters' language: without it MyST-NB finds no lexer for the second code cell on
    # and warns, which fails the build (-W) as soon as the page holds two explorers
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell("# Explorers")]
    for output in outputs:
        cell = nbformat.v4.new_code_cell("explorer", execution_count=1)
        cell.outputs = [nbformat.from_dict(output)]
        nb.cells.append(cell)
    nbformat.write(nb, where / "page.ipynb")
    jb = Path(sys.executable).with_name("jupyter-book")
    subprocess.run([str(jb), "build", "-W", "-n", "--keep-going", "-q", str(where)],
                   check=True, capture_output=True, text=True)
    return where / "_build" / "html" / "page.html"


SHOWN = """async r => {
    const views = r.querySelectorAll('.mx-view'), v = views[0];
    const images = [...v.querySelectorAll('img')];
    await Promise.all(images.map(i => i.decode().catch(() => null)));  // loaded, or broken
    return {views: views.length, state: r.getAttribute('data-state'),
            metrics: r.getAttribute('data-metrics'), values: r.getAttribute('data-values'),
            inner: v.innerHTML, text: v.innerText,
            drawn: images.every(i => i.complete && i.naturalWidth > 0)};
}"""
"""What an explorer shows, read in one call to the browser (one round trip per state instead
of one per attribute): its view once its images are decoded or have failed."""


def drive(page, root) -> None:
    """Every control to its ends and its middle: the state shown is the one the controls
    name, with the run's numbers, drawn, and each control changes the figure."""
    data = json.loads(root.locator('script[type="application/json"]').text_content())
    controls = data["controls"]
    sizes = [len(c["values"]) for c in controls]
    current = [c["values"].index(v) for c, v in
               zip(controls, json.loads(root.get_attribute("data-values")).values())]
    for k, control in enumerate(controls):
        views = set()
        field = root.locator(f'[data-control="{control["name"]}"]')
        is_select = field.evaluate("e => e.tagName") == "SELECT"
        for i in sorted({0, sizes[k] // 2, sizes[k] - 1}):
            if is_select:
                field.select_option(str(i))
            else:
                field.fill(str(i))
            current[k] = i
            index = 0
            for j, size in zip(current, sizes):
                index = index * size + j
            shown = root.evaluate(SHOWN)
            assert shown["views"] == 1
            assert shown["state"] == str(index)
            state = data["states"][index]
            assert json.loads(shown["metrics"]) == state["metrics"]
            values = json.loads(shown["values"])
            assert values[control["name"]] == control["values"][i]
            inner = shown["inner"]
            assert inner.strip(), f"{control['name']}={control['values'][i]} shows nothing"
            text = shown["text"]
            assert not re.search(r"\b(nan|NaN|Traceback|Error)\b", text), text[:200]
            drawn = shown["drawn"]
            assert drawn, f"an image of {control['name']}={control['values'][i]} did not load"
            views.add(inner)
        if sizes[k] > 1:
            assert len(views) > 1, f"moving {control['name']} never changes the figure"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The page of each chapter's explorers, built once for the module's tests."""
    pages = {}
    for path in CHAPTERS:
        outputs = explorer_outputs(path)
        if outputs:
            pages[path.stem] = outputs
    if not pages:
        pytest.fail("no chapter carries an explorer")
    where = tmp_path_factory.mktemp("explorers")
    flat = [o for outputs in pages.values() for o in outputs]
    return {"page": build_page(flat, where), "count": len(flat)}


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_has_an_explorer(path: Path) -> None:
    outputs = explorer_outputs(path)
    assert outputs, f"{path.name} has no explorer"
    for output in outputs:  # the kernel face rides along for Jupyter and Colab
        assert WIDGET in output["data"], f"{path.name}: an explorer without its kernel widget"


def test_explorers_work_offline_in_chromium(built) -> None:
    html = built["page"].read_text()
    assert "widget-view+json" not in html.split("<article", 1)[-1].split("</article>")[0]
    with offline_page() as (page, tried):
        page.goto(built["page"].as_uri())
        roots = page.locator(".minisrv-explorer").all()
        assert len(roots) == built["count"]
        for root in roots:
            drive(page, root)
        assert not page.errors, page.errors
    assert not tried, f"the page asked the network for {tried[:5]}"


def test_the_built_page_loads_nothing_from_a_network(built) -> None:
    loads = network_loads(built["page"].read_text())
    assert not loads, f"loaded from a network: {loads[:5]}"


# ------------------------------------------------------------------ listings in the book

def test_a_long_listing_line_keeps_its_indentation_and_scrolls_in_chromium() -> None:
    """In the built chunked-prefill chapter every code block keeps one row per source line
    (no wrap) and scrolls sideways where a line is wider than the column. The book's code
    font fits its listings (up to 100 characters at 1280 px), so a line of 200 characters
    is added to the page's widest listing to see the overflow rule act."""
    page_file = ROOT / "_build" / "html" / "chapters" / "03a_chunked_prefill.html"
    if not page_file.is_file():
        pytest.skip("the book is not built: make book")
    with offline_page() as (page, _):
        page.goto(page_file.as_uri())
        blocks = page.evaluate("""() => {
            const pres = [...document.querySelectorAll('div.cell_output pre, div.cell_input pre')];
            const widest = pres.reduce((a, b) => b.textContent.length > a.textContent.length
                                                 ? b : a);
            widest.textContent = widest.textContent.replace(/\\n$/, '') + '\\n    ' +
                                 'x'.repeat(200);
            return pres.map(pre => {
              const style = getComputedStyle(pre);
              const lines = pre.textContent.replace(/\\n$/, '').split('\\n');
              const lineHeight = parseFloat(style.lineHeight) ||
                                 1.2 * parseFloat(style.fontSize);
              return {whiteSpace: style.whiteSpace, overflowX: style.overflowX,
                      longest: Math.max(...lines.map(l => l.length)), lines: lines.length,
                      rows: Math.round((pre.clientHeight - parseFloat(style.paddingTop)
                                        - parseFloat(style.paddingBottom)) / lineHeight),
                      scrolls: pre.scrollWidth > pre.clientWidth};
            });
        }""")
    wide = [b for b in blocks if b["longest"] > 100]
    assert wide, "the widened listing is not on the page"
    for block in blocks:
        assert block["whiteSpace"] == "pre" and block["overflowX"] in ("auto", "scroll"), block
        assert block["rows"] <= block["lines"] + 1, block  # one row per line: nothing wrapped
    for block in wide:
        assert block["scrolls"], block
