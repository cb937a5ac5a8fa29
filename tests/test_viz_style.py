"""The house style: every book figure is drawn at the column's width with legible text."""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("matplotlib")

from matplotlib.text import Text  # noqa: E402

from minisrv.configs import DEEPSEEK_V3, H100, LLAMA3_8B, LLAMA3_70B, T4  # noqa: E402
from minisrv.kvsize import kv_bytes_per_token, kv_numbers_per_token_per_layer  # noqa: E402
from minisrv.viz import kvlayout, overview, roofline, style  # noqa: E402


@functools.cache
def _figures():
    """Drawn once, when a test first needs them: not at collection, where every test
    process (one per core) would draw them all."""
    return {
        "roofline": roofline.plot_roofline(LLAMA3_8B, H100, batch=16),
        "roofline, weights do not fit": roofline.plot_roofline(LLAMA3_70B, T4, batch=16),
        "memory budget": roofline.plot_memory_budget(LLAMA3_8B, H100, 1024, 476),
        "intensity roofline": roofline.plot_intensity_roofline(LLAMA3_8B, H100),
        "kv layouts": kvlayout.plot_kv_layouts(),
        "training": overview.plot_training(overview.training_record()),
        **_scheduler_figures(),
    }


def _scheduler_figures():
    """The scheduler chapters' figures, drawn from small simulated runs."""
    from minisrv.sim import simulate
    from minisrv.viz import dashboard, timeline
    from minisrv.workloads import gpu_scale_workload

    work = gpu_scale_workload(n=60, rate=64.0, seed=0)
    runs = {mode: simulate(work, mode=mode, max_running=16, admission="reserve")
            for mode in ("static", "prefill-first", "mixed")}
    first = runs["prefill-first"]
    some = first.trace[:12]
    return {
        "gantt": timeline.gantt(some, first.requests[:6]),
        "gantt compare": timeline.gantt_compare(runs),
        "latency bars": timeline.latency_bars(runs, unit="s"),
        "step times": timeline.plot_step_times(
            {m: runs[m] for m in ("prefill-first", "mixed")}, window=(0.0, 2.0)),
        "dashboard": dashboard.sim_dashboard(n=60),
    }


FIGURE_NAMES = ["roofline", "roofline, weights do not fit", "memory budget",
                "intensity roofline", "kv layouts", "training", "gantt", "gantt compare",
                "latency bars", "step times", "dashboard"]


@functools.cache
def _shown(name: str) -> tuple[bytes, dict]:
    """``name``'s figure as a page shows it (``_repr_png_``), rendered once for the two tests
    below: the render also lays out the tick labels the legibility test reads."""
    return _figures()[name]._repr_png_()


def test_the_figure_names_are_those_drawn() -> None:
    assert list(_figures()) == FIGURE_NAMES


@pytest.mark.parametrize("name", FIGURE_NAMES)
def test_figure_fills_the_column_and_is_shown_at_its_width(name) -> None:
    fig = _figures()[name]
    png, meta = _shown(name)
    assert png.startswith(b"\x89PNG")
    assert fig.get_figwidth() == style.PAGE_WIDTH_IN
    assert meta == {"width": round(style.PAGE_WIDTH_IN * style.SCREEN_DPI)}


@pytest.mark.parametrize("name", FIGURE_NAMES)
def test_every_text_of_a_figure_is_legible_at_page_width(name) -> None:
    fig = _figures()[name]
    _shown(name)  # drawn, so that tick labels exist
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    assert texts
    small = {t.get_text(): t.get_fontsize() for t in texts
             if t.get_fontsize() < min(style.FONT_SIZES.values())}
    assert not small, f"text below {min(style.FONT_SIZES.values())} pt: {small}"


@pytest.mark.parametrize("name", FIGURE_NAMES)
def test_legends_sit_outside_the_axes(name) -> None:
    fig = _figures()[name]
    assert not [ax for ax in fig.axes if ax.get_legend() is not None]


def test_style_does_not_leak_into_global_matplotlib_settings() -> None:
    import matplotlib as mpl

    before = mpl.rcParams["font.size"]
    roofline.plot_memory_budget(LLAMA3_8B, H100, 1024, 16)
    assert mpl.rcParams["font.size"] == before


def test_page_figure_refuses_sizes_wider_than_the_page() -> None:
    with pytest.raises(ValueError, match="width_in"):
        style.page_figure(3, width_in=11)
    with pytest.raises(ValueError, match="height_in"):
        style.page_figure(0)


def test_graph_attrs_apply_the_graph_font_sizes() -> None:
    source = overview.architecture_diagram().source
    assert f'fontsize={style.GRAPH_FONTS["node"]}' in source
    assert f'fontsize={style.GRAPH_FONTS["edge"]}' in source


def test_architecture_labels_read_at_10_points_or_more_on_the_page() -> None:
    """The book shows an SVG at its own width or shrunk to the column (7.5 in = 540 pt),
    its text shrunk with it: the smallest label, after that shrinking, must stay >= 10 pt
    (issue 38: the first drawing was 1040 pt wide, its labels about 7 pt on the page)."""
    import re

    svg = overview.architecture_diagram().pipe(format="svg").decode()
    width_pt = float(re.search(r'<svg width="([0-9.]+)pt"', svg).group(1))
    sizes = [float(size) for size in re.findall(r'font-size="([0-9.]+)"', svg)]
    shrink = min(1.0, style.PAGE_WIDTH_IN * 72 / width_pt)
    assert sizes and min(sizes) * shrink >= 10, (width_pt, min(sizes))


def test_bookfigure_is_still_importable_from_roofline() -> None:
    from minisrv.viz.roofline import BookFigure

    assert BookFigure is style.BookFigure


def test_kv_layouts_label_each_design_with_its_computed_size() -> None:
    fig = kvlayout.plot_kv_layouts()
    texts = " ".join(t.get_text() for t in fig.findobj(Text))
    for cfg in kvlayout.layout_models():
        assert cfg.attention.upper() in texts
        assert f"{kv_numbers_per_token_per_layer(cfg):,} numbers per layer" in texts
        assert roofline.format_bytes(kv_bytes_per_token(cfg)) in texts


def test_kv_layout_bars_are_drawn_to_one_scale() -> None:
    """The cached bar of each row is as long as its numbers per layer / the largest row's."""
    models = kvlayout.layout_models()
    fig = kvlayout.plot_kv_layouts(models)
    ax = fig.axes[0]
    bars: dict[float, float] = {}
    for patch in ax.patches:
        y = round(patch.get_y() % 1.3, 3)
        if y == 0.05:  # the lower strip of a row
            row = round(patch.get_y() // 1.3)
            bars[row] = bars.get(row, 0.0) + patch.get_width()
    largest = max(kv_numbers_per_token_per_layer(cfg) for cfg in models)
    for row, cfg in enumerate(reversed(models)):
        assert bars[row] == pytest.approx(kv_numbers_per_token_per_layer(cfg) / largest)


def test_one_kv_head_refuses_mla_and_keeps_the_query_heads() -> None:
    mqa = kvlayout.one_kv_head(LLAMA3_70B)
    assert (mqa.n_heads, mqa.n_kv_heads, mqa.attention) == (64, 1, "mqa")
    with pytest.raises(ValueError, match="MLA"):
        kvlayout.one_kv_head(DEEPSEEK_V3)
    with pytest.raises(ValueError, match="at least one model"):
        kvlayout.plot_kv_layouts(())


def test_one_header_row_moves_the_index_name_into_the_corner() -> None:
    """A named index draws a second, half-empty header row (issue 38's doubled headers)."""
    import pandas as pd

    frame = pd.DataFrame({"a": [1, 2]}, index=pd.Index(["x", "y"], name="step"))
    once = style.one_header_row(frame)
    assert once.columns.name == "step" and once.index.name is None
    assert once.to_html().count("<tr") == frame.to_html().count("<tr") - 1
    assert once.loc["y", "a"] == 2 and frame.index.name == "step"  # a copy; rows unchanged
    plain = pd.DataFrame({"a": [1]})
    assert style.one_header_row(plain) is plain


def test_one_header_row_joins_a_multiindex_s_names_in_the_corner() -> None:
    """A (draft, context) index draws its names as a second header row too."""
    import pandas as pd

    index = pd.MultiIndex.from_tuples([("free", 256), ("1B", 1024)], names=["draft", "context"])
    frame = pd.DataFrame({"k = 1": [521, 408]}, index=index)
    once = style.one_header_row(frame)
    assert once.columns.name == "draft / context" and list(once.index.names) == [None, None]
    assert once.to_html().count("<tr") == frame.to_html().count("<tr") - 1
    assert once.loc[("1B", 1024), "k = 1"] == 408
