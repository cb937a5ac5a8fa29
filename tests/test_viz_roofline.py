"""The chapter's figures and widget must draw for every choice a reader can make."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("ipywidgets")

from minisrv.configs import GPUS, H100, L4, LLAMA3_8B, LLAMA3_70B, MODELS  # noqa: E402
from minisrv.viz import roofline as viz  # noqa: E402
from minisrv.viz import roofline_explorer as explore  # noqa: E402


def test_format_bytes_uses_binary_units() -> None:
    assert viz.format_bytes(131_072) == "128 KiB"
    assert viz.format_bytes(2.5 * 2**20) == "2.5 MiB"
    assert viz.format_bytes(4 * 2**30) == "4 GiB"
    assert viz.format_bytes(512) == "512 B"


def test_kv_table_has_one_row_per_model_and_the_pitfall_ratio() -> None:
    table = viz.kv_table()
    assert list(table.index) == [name.replace("(all heads)", "(all heads, counterfactual)")
                                 for name in MODELS]
    assert table.loc["LLaMA-3-8B", "KV / token"] == "128 KiB"
    assert table.loc["LLaMA-3-70B", viz.ALL_HEADS_COLUMN] == "8x"
    # MLA: 128 heads x (192-wide key + 128-wide value) against the 576-number latent
    assert table.loc["DeepSeek-V3", viz.ALL_HEADS_COLUMN] == "71.1x"
    assert table.loc["LLaMA-3-70B", "heads: query / KV"] == "64 / 8"
    assert table.loc["DeepSeek-V3", "heads: query / KV"] == "128 / latent"
    assert table.loc["LLaMA-3-8B", "KV / 32K tokens"] == "4 GiB"
    assert (table.columns.name, table.index.name) == ("model", None)  # one header row


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("gpu", list(GPUS))
def test_roofline_draws_for_every_model_and_gpu(model, gpu) -> None:
    """Including the combinations where the weights or a single request do not fit."""
    fig = viz.plot_roofline(MODELS[model], GPUS[gpu], contexts=(16, 131072), batch=4096)
    assert len(fig.axes) == 2
    assert explore.summary_line(MODELS[model], GPUS[gpu], 131072, 4096)


def test_roofline_marks_the_memory_wall_at_max_concurrent_requests() -> None:
    fig = viz.plot_roofline(LLAMA3_8B, H100, contexts=(1024,))
    walls = [line.get_xdata()[0] for line in fig.axes[0].lines if line.get_linestyle() == "--"]
    assert walls == [476]


def test_memory_budget_and_intensity_plots_render_to_png() -> None:
    for fig in (viz.plot_memory_budget(LLAMA3_70B, L4, 8192, 64),
                viz.plot_intensity_roofline(LLAMA3_8B, H100)):
        png, meta = fig._repr_png_()
        assert png.startswith(b"\x89PNG") and meta["width"] > 0


def test_summary_fits_the_column() -> None:
    """Printed above the widget's figures: no line may be clipped at the column's edge."""
    for model in MODELS.values():
        for gpu in GPUS.values():
            text = explore.summary_line(model, gpu, 131072, 4096)
            assert max(map(len, text.splitlines())) <= 80, text


def test_widget_offers_every_model_gpu_and_dtype() -> None:
    box = explore.roofline_widget()
    controls = [w for row in box.children[:-1] for w in row.children]  # rows above the view
    options = {c.description: list(c.options) for c in controls}
    assert options["model"] == list(MODELS)
    assert options["GPU"] == list(GPUS)
    assert options["dtype"] == list(viz.DTYPES)
    assert 1024 in options["context"] and 16 in options["batch"]


def test_gpu_appendix_figure_labels_every_curve_with_its_device() -> None:
    import torch

    from minisrv.configs import CITYLM, SMOLLM2_135M, T4
    from minisrv.experiments.gpu import random_model, roofline_step_times, step_time_sweep
    from minisrv.viz.gpu import plot_step_times_vs_roofline

    model = random_model(CITYLM.with_(n_layers=1), "cpu", torch.float32)
    measured = step_time_sweep(model, (1, 2), 4, ("padded",), repeats=1)
    predicted = roofline_step_times(SMOLLM2_135M, [H100, T4], (1, 2), 4)
    fig = plot_step_times_vs_roofline(measured, predicted, "CityLM")
    labels = [text.get_text() for text in fig.legends[0].get_texts()]
    assert labels == ["measured on CPU, float32, padded attention",
                      "H100 SXM (roofline), bf16: lower bound", "T4 (roofline), bf16: lower bound"]
    assert all(ax.get_xlabel() and ax.get_ylabel() and ax.get_title(loc="left") for ax in fig.axes)
    # the flex_attention backend is named as the page's tables name it
    ragged = plot_step_times_vs_roofline(measured.assign(attention="flex"), predicted, "CityLM")
    assert ragged.legends[0].get_texts()[0].get_text() == (
        "measured on CPU, float32, ragged (flex) attention")
    # a roofline drawn at another context than the measurement's says so in its title
    elsewhere = roofline_step_times(SMOLLM2_135M, [H100], (1, 2), 8192)
    title = plot_step_times_vs_roofline(measured, elsewhere, "CityLM")._suptitle.get_text()
    assert title == "CityLM: measured at context 4, roofline at context 8,192"


def test_roofline_explorer_holds_the_roofline_of_every_context_and_batch() -> None:
    from minisrv.sim.roofline import decode_step_cost
    from minisrv.sim.sizing import max_concurrent_requests

    ex = explore.roofline_explorer(contexts=(128, 8192), batches=(1, 64))
    assert ex.default == {"context_len": 1024, "batch": 16}  # the chapter's static figures
    assert sorted(ex.states) == [(c, b) for c in (128, 1024, 8192) for b in (1, 16, 64)]
    for (context, batch), state in ex.states.items():
        fit = max_concurrent_requests(LLAMA3_8B, H100, context)
        runs = min(batch, fit)  # past the wall, the wall's batch runs
        cost = decode_step_cost(LLAMA3_8B, H100, runs, context)
        assert state["step_ms"] == pytest.approx(cost.time_s * 1e3)
        assert state["bound"] == cost.bound
        assert state["tokens_per_s"] == pytest.approx(runs / cost.time_s)
        assert state["requests_fit"] == fit
    assert ex.states[(8192, 64)]["requests_fit"] == 59  # 64 requests of 8K tokens do not fit
    # a roofline with the batch marked and a memory bar, per state
    assert ex.html.count("data:image/webp") == 9 + 9


def test_roofline_explorer_never_reports_more_than_fits() -> None:
    """A batch past the memory wall runs the wall's batch: its throughput is the wall's, never
    above the chapter's ceiling (476 requests of 1,024 tokens), and one request is singular."""
    from minisrv.sim.roofline import decode_step_cost

    ex = explore.roofline_explorer(contexts=(1024,), batches=(1, 1024))
    over = ex.states[(1024, 1024)]
    ceiling = 476 / decode_step_cost(LLAMA3_8B, H100, 476, 1024).time_s
    assert over["batch_run"] == 476 and over["tokens_per_s"] == pytest.approx(ceiling)
    assert all(s["tokens_per_s"] <= ceiling * (1 + 1e-12) for s in ex.states.values())
    assert "1 request of 1,024 tokens fits" in ex.html and "1 requests" not in ex.html
    assert "do not fit: the wall is at 476" in ex.html
    with pytest.raises(ValueError, match="at most 8,192 tokens, not 32,768"):
        explore.roofline_explorer(contexts=(32768,))


def test_contexts_around_stop_at_the_model_s_context() -> None:
    assert explore.contexts_around(1024) == [128, 1024, 8192]
    assert explore.contexts_around(8192, LLAMA3_8B.max_seq_len) == [1024, 8192]


def test_roofline_explorer_refuses_an_unknown_choice_before_drawing() -> None:
    with pytest.raises(ValueError, match="unknown GPU 'H300'"):
        explore.roofline_explorer(gpu="H300")


def test_gpu_explorer_holds_the_roofline_table_beside_the_recorded_run() -> None:
    from minisrv.configs import H200, SMOLLM2_135M, T4
    from minisrv.experiments.gpu import recorded_gpu_run
    from minisrv.sim.roofline import decode_step_cost
    from minisrv.viz.gpu import gpu_roofline_explorer

    steps, _ = recorded_gpu_run("h200")
    ex = gpu_roofline_explorer(steps, "recorded", contexts=(32, 2048), batches=(64,))
    assert ex.default == {"context": 512, "batch": 16}  # the chapter's figure and its text
    assert sorted(ex.states) == [(c, b) for c in (32, 512, 2048) for b in (16, 64)]
    padded = steps[steps["attention"] == "padded"].set_index("batch")["step_ms"]
    for (context, batch), state in ex.states.items():
        for gpu in (H100, H200, T4):
            cost = decode_step_cost(SMOLLM2_135M, gpu, batch, context)
            assert state[f"step_us {gpu.name}"] == pytest.approx(cost.time_s * 1e6, abs=0.05)
        assert state["bound"] == decode_step_cost(SMOLLM2_135M, H200, batch, context).bound
        assert state["measured_padded_ms"] == padded[batch]
    assert ex.html.count("data:image/webp") == 3  # the figure depends on the context alone


def test_gpu_explorer_holds_a_state_that_turns_compute_bound() -> None:
    """The page's contexts include one where the H200's step turns compute-bound within the
    recorded batches, so the "bound by" column flips in one state and not in all of them."""
    from minisrv.configs import H200, SMOLLM2_135M
    from minisrv.experiments.gpu import recorded_gpu_run
    from minisrv.sim.roofline import compute_bound_batch, decode_step_cost
    from minisrv.viz.gpu import GPU_CONTEXTS

    batches = sorted(set(recorded_gpu_run("h200")[0]["batch"]))  # the explorer's batches
    bounds = {(c, b): decode_step_cost(SMOLLM2_135M, H200, b, c).bound
              for c in GPU_CONTEXTS for b in batches}
    assert bounds[(min(GPU_CONTEXTS), 256)] == "compute"
    assert compute_bound_batch(SMOLLM2_135M, H200, min(GPU_CONTEXTS)) <= 256
    assert sum(b == "memory" for b in bounds.values()) == len(bounds) - 1


def test_gpu_explorer_marks_the_chosen_batch_on_both_panels() -> None:
    """Each state lays a line over the context's one image at its batch, on each panel: the
    lines move right with the batch, evenly on the log-2 axis, and no state draws a second
    image for them."""
    import re

    from minisrv.experiments.gpu import recorded_gpu_run
    from minisrv.viz.gpu import gpu_roofline_explorer

    steps, _ = recorded_gpu_run("h200")
    batches = (1, 4, 16)
    ex = gpu_roofline_explorer(steps, "recorded", contexts=(512,), batches=batches)
    assert ex.html.count("data:image/webp") == 1
    lefts = {}
    for batch, (_, payload) in zip(batches, _marks_by_state(ex.html), strict=True):
        found = [float(x) for x in re.findall(r"left:([0-9.]+)%", payload)]
        assert len(found) == 2  # one line per panel
        lefts[batch] = found
    for panel in (0, 1):
        x1, x4, x16 = (lefts[b][panel] for b in batches)
        assert x1 < x4 < x16
        assert x4 - x1 == pytest.approx(x16 - x4, abs=0.02)  # 1, 4, 16 evenly spaced on log 2
    assert max(lefts[16]) < 100 and lefts[1][1] > 50  # the right panel's lines on its right half


def _marks_by_state(page: str) -> list[tuple[int, str]]:
    """Each state's mark part (the one that closes the figure's box), from the page's JSON."""
    import json

    data = json.loads(page.split('<script type="application/json">')[1].split("</script>")[0]
                      .replace("<\\/", "</"))
    return [(i, data["parts"][state["parts"][1]]) for i, state in enumerate(data["states"])]


def test_gpu_explorer_offers_every_recorded_batch_and_both_calls_over_the_roofline() -> None:
    """The page's text quotes batches 2, 8, 32 and 128 (the ragged step's 243.6 ms at 128):
    by default the explorer's batch slider stops at every batch the run timed, and each
    caption at the timed context gives both calls' measured step over the roofline's."""
    from minisrv.configs import H200, SMOLLM2_135M
    from minisrv.experiments.gpu import recorded_gpu_run
    from minisrv.sim.roofline import decode_step_cost
    from minisrv.viz.gpu import gpu_roofline_explorer

    steps, _ = recorded_gpu_run("h200")
    ex = gpu_roofline_explorer(steps, "recorded", contexts=(512,))
    assert sorted(b for _, b in ex.states) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    ragged = steps[steps["attention"] == "flex"].set_index("batch")["step_ms"]
    for (_, batch), state in ex.states.items():
        assert state["measured_ragged_ms"] == ragged[batch]
    roof_us = round(decode_step_cost(SMOLLM2_135M, H200, 128, 512).time_s * 1e6, 1)  # shown
    times = float(f"{ragged[128] * 1e3 / roof_us:.2g}")
    assert f"the ragged step 243.6 ms, about {times:,.0f} times" in ex.html


def test_gpu_explorer_refuses_a_batch_the_run_did_not_time() -> None:
    from minisrv.experiments.gpu import recorded_gpu_run
    from minisrv.viz.gpu import gpu_roofline_explorer

    steps, _ = recorded_gpu_run("h200")
    with pytest.raises(ValueError, match=r"batches \[3\] were not measured"):
        gpu_roofline_explorer(steps, "recorded", batch=3)


def test_gpu_explorer_table_separates_thousands_and_keeps_its_numbers() -> None:
    from minisrv.experiments.gpu import recorded_gpu_run
    from minisrv.viz.gpu import gpu_roofline_explorer

    steps, _ = recorded_gpu_run("h200")
    ex = gpu_roofline_explorer(steps, "recorded", contexts=(512,), batches=(1,))
    assert "11,928" in ex.html and "11928" not in ex.html  # H100 SXM's tokens/s at batch 1
    assert ex.states[(512, 1)]["step_us H200"] == pytest.approx(58.5, abs=0.05)  # still a number


def test_gpu_explorer_caption_rounds_the_gap_as_the_prose_does() -> None:
    """The caption says "about 490 times" (two figures), as the appendix and the overlap
    chapter say it, never the 494 of three figures that contradicts them."""
    from minisrv.experiments.gpu import recorded_gpu_run
    from minisrv.viz.gpu import gpu_roofline_explorer

    steps, _ = recorded_gpu_run("h200")
    ex = gpu_roofline_explorer(steps, "recorded", contexts=(512,), batches=(1, 256))
    assert "took 28.9 ms, about 490 times that, the ragged step 41.0 ms, about 700 times" in ex.html
    assert "took 50.0 ms, about 73 times that" in ex.html  # 72.8 at batch 256
    # the ratio of the values shown: 34.8 ms over 95.4 µs is 365, about 360 (not 370)
    at16 = gpu_roofline_explorer(steps, "recorded", contexts=(512,), batches=(16,)).html
    assert "step is 95.4 " in at16 and "the ragged step 34.8 ms, about 360 times" in at16
    assert "494x" not in ex.html and "494 times" not in ex.html  # the images are base64


def test_gpu_explorer_sets_the_recorded_steps_against_the_roofline_of_their_context() -> None:
    """A measured step over the roofline means something only at the context the run timed
    (512): at context 8,192 and batch 256 the caption still reads out the ratio at 512, says
    so, and gives none against 8,192's roofline (which would read about 5 times)."""
    from minisrv.configs import H200, SMOLLM2_135M
    from minisrv.experiments.gpu import recorded_gpu_run
    from minisrv.sim.roofline import decode_step_cost
    from minisrv.viz.gpu import gpu_roofline_explorer

    steps, _ = recorded_gpu_run("h200")
    ex = gpu_roofline_explorer(steps, "recorded", contexts=(8192,), batches=(256,))
    padded = steps[steps["attention"] == "padded"].set_index("batch")["step_ms"]
    far, timed = ex.states[(8192, 256)], ex.states[(512, 256)]
    roof_us = decode_step_cost(SMOLLM2_135M, H200, 256, 512).time_s * 1e6
    assert timed["padded_over_roofline"] == pytest.approx(padded[256] * 1e3 / roof_us, rel=1e-3)
    assert far["padded_over_roofline"] == timed["padded_over_roofline"]
    caption = _caption_of(ex, 8192, 256)
    assert ("at context 512, where the run was timed, the measured padded step took 50.0 ms, "
            "about 73 times the roofline&#x27;s step there") in caption
    assert "about 5 times" not in caption
    assert "where the run was timed" not in _caption_of(ex, 512, 256)


def _caption_of(ex, context: int, batch: int) -> str:
    """The caption of one state, from the page's JSON."""
    import json

    data = json.loads(ex.html.split('<script type="application/json">')[1].split("</script>")[0]
                      .replace("<\\/", "</"))
    index = sorted(ex.states).index((context, batch))
    return data["states"][index]["caption"]


def test_block_mask_figure_draws_the_tiles_ragged_tiles_makes() -> None:
    from minisrv.model import ragged_tiles
    from minisrv.viz.tiles import plot_block_mask

    new, cached = (300, 1, 1, 140), (0, 200, 90, 20)
    fig = plot_block_mask(new, cached, "a step", block=64)
    partial, full = ragged_tiles(new, cached, 64)
    drawn = fig.axes[0].images[0].get_array()
    assert drawn.shape == partial.shape
    assert ((drawn == 1) == partial.numpy()).all() and ((drawn == 2) == full.numpy()).all()
    assert full.any() and partial.any() and (drawn == 0).any()  # all three kinds appear
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == [f"empty: {int((drawn == 0).sum())} tiles",
                      f"partial: {int(partial.sum())} tiles", f"full: {int(full.sum())} tiles"]


def _curve_colors(fig) -> dict[int, tuple]:
    """Context length -> the RGBA colour of its solid curve on the step-time panel."""
    from matplotlib.colors import to_rgba

    return {int(line.get_label().split()[1].replace(",", "")): to_rgba(line.get_color())
            for line in fig.axes[0].lines if line.get_label().startswith("context ")}


def test_a_context_keeps_its_colour_in_every_figure() -> None:
    """The explorer's states draw other triples of contexts (1,024 -> 128, 1,024, 8,192;
    4,096 -> 512, 4,096, 8,192): a colour must mean one context in all of them, and the
    memory bar's KV the chosen context's colour (issue 50: colours changed with the state)."""
    from matplotlib.colors import to_rgba

    seen: dict[int, tuple] = {}
    for context in explore.EXPLORER_CONTEXTS:
        drawn = explore.contexts_around(context, LLAMA3_8B.max_seq_len)
        colors = _curve_colors(viz.plot_roofline(LLAMA3_8B, H100, drawn, batch=16))
        assert sorted(colors) == drawn and len(set(colors.values())) == len(drawn)
        for ctx, color in colors.items():
            assert seen.setdefault(ctx, color) == color, ctx
        bar = viz.plot_memory_budget(LLAMA3_8B, H100, context, 16)
        kv = [p for p in bar.axes[0].patches if p.get_x() > 0][0]
        assert to_rgba(kv.get_facecolor()) == seen[context]
    assert len(set(seen.values())) == len(seen)  # six contexts, six colours


def test_a_batch_past_the_wall_is_marked_where_the_server_runs() -> None:
    """Past the memory wall the explorer reports the wall's batch (``summary_line``): the
    filled mark sits at the wall, the asked batch hollow beyond it."""
    fig = viz.plot_roofline(LLAMA3_8B, H100, contexts=(4096,), batch=1024)
    marks = [line for line in fig.axes[1].lines if line.get_marker() == "o"
             and line.get_label().startswith("_")]
    filled = [m.get_xdata()[0] for m in marks if m.get_markerfacecolor() != "white"]
    hollow = [m.get_xdata()[0] for m in marks if m.get_markerfacecolor() == "white"]
    assert filled == [explore.running_batch(LLAMA3_8B, H100, 4096, 1024)] == [119]
    assert hollow == [1024]


def test_the_legend_names_a_past_the_wall_mark_only_when_one_is_drawn() -> None:
    """Batch 16 fits at every context of LLaMA-3-8B on an H100, so no hollow mark is drawn and
    the legend must not list one; batch 1,024 fits at none of them, so it lists it."""
    def labels(batch: int) -> list[str]:
        fig = viz.plot_roofline(LLAMA3_8B, H100, batch=batch)
        return [text.get_text() for text in fig.legends[0].get_texts()]

    assert not any("past the wall" in label for label in labels(16))
    assert any("past the wall" in label for label in labels(1024))


def test_decode_block_masks_draw_one_tile_strip_and_each_requests_needed_scores() -> None:
    """The weak-case figure: decodes share one query tile, so each panel is one row of key
    tiles exactly as ragged_tiles makes it, with one black segment per request spanning that
    request's keys (its one query row against its cached tokens and its new one)."""
    from minisrv.model import ragged_tiles
    from minisrv.viz.tiles import plot_decode_block_masks

    steps = [("equal", [100] * 8), ("unequal", [20] * 7 + [300])]
    fig = plot_decode_block_masks(steps, block=64)
    assert len(fig.axes) == 2
    for ax, (_, cached) in zip(fig.axes, steps, strict=True):
        partial, full = ragged_tiles([1] * len(cached), cached, 64)
        drawn = ax.images[0].get_array()
        assert drawn.shape == partial.shape == (1, -(-sum(c + 1 for c in cached) // 64))
        assert ((drawn == 1) == partial.numpy()).all() and ((drawn == 2) == full.numpy()).all()
        segments = ax.collections[0].get_segments()
        spans = [float(seg[1][0] - seg[0][0]) for seg in segments]
        assert spans == [c + 1.0 for c in cached]
        assert f"{int(partial.sum()):,} partial" in ax.get_title(loc="left")
    # the one long request's row sits on the strip's edge: it is named, the equal ones are not
    notes = [[t.get_text() for t in ax.texts] for ax in fig.axes]
    assert notes[0] == [] and notes[1] == ["the request at context 300: 301 keys needed"]
    # and its row, on the strip's bottom edge, is drawn thicker than the rest, over the frame
    equal_w, unequal_w = (list(ax.collections[0].get_linewidths()) for ax in fig.axes)
    assert len(set(equal_w)) == 1 and unequal_w[-1] > 2 * max(unequal_w[:-1])
    assert fig.axes[1].collections[0].get_zorder() > fig.axes[1].spines["bottom"].get_zorder()
    # the legend names only the tile kinds the strips hold (no full tile in a decode strip)
    legend = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert legend == ["partial tile", "scores a request needs"]


@pytest.mark.parametrize("context", [100, 256, 300, 1500, 2000, 8192])
def test_split_decode_figure_draws_the_pieces_kv_splits_makes(context) -> None:
    """The split-KV figure: as many pieces as kv_splits gives the context, end to end over
    its keys, each one the kernel's piece length (rounded up to its block of keys) but the
    last, and one partial output per piece; a figure that cut the context evenly, or drew a
    fixed number of pieces, would fail."""
    import torch

    from minisrv.runner.attention.splits import DECODE_BLOCK_N, kv_splits
    from minisrv.viz.gpu import plot_split_decode

    fig = plot_split_decode(context)
    pieces = sorted((p.get_x(), p.get_x() + p.get_width()) for p in fig.axes[0].patches
                    if p.get_gid() == "piece")
    n = int(kv_splits(torch.tensor([context]))[0])
    assert len(pieces) == n
    assert pieces[0][0] == 0 and pieces[-1][1] == context
    assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
    lengths = {hi - lo for lo, hi in pieces[:-1]}
    assert all(length % DECODE_BLOCK_N == 0 for length in lengths) and len(lengths) <= 1
    assert sum(f"$o_{i}$" in t.get_text() for t in fig.axes[0].texts for i in range(n)) == n
    assert f"{n} pieces" in fig.axes[0].get_title(loc="left")


def test_step_times_table_shows_each_recorded_step_under_the_call_that_took_it() -> None:
    """The appendix's table of the recorded sweep: one row per batch, the padded and the
    ragged step side by side, each the csv's value to 0.1 ms (a swapped column would show
    the ragged call faster at batch 256)."""
    import pandas as pd

    from minisrv.experiments.gpu import RECORDED, recorded_gpu_run
    from minisrv.viz.gpu import step_times_table

    steps, _ = recorded_gpu_run("h200")
    table = step_times_table(steps)
    wide = pd.read_csv(RECORDED / "h200_decode_steps.csv").set_index("batch")
    assert list(table.columns) == ["padded step (ms)", "ragged (flex) step (ms)"]
    assert list(table.index) == list(wide.index)
    for batch, row in table.iterrows():
        assert row["padded step (ms)"] == f"{wide.loc[batch, 'padded ms']:.1f}"
        assert row["ragged (flex) step (ms)"] == f"{wide.loc[batch, 'flex ms']:.1f}"
    assert table.columns.name == "batch"


def test_split_programs_count_the_pieces_of_the_keys_new_one_included() -> None:
    """Chapter 09's programs table: a decode at 512 cached tokens attends over 513 keys
    (``TritonStep.contexts`` counts the new one), which ``kv_splits`` cuts into three pieces,
    so SmolLM2-135M's 3 KV heads give 9 programs per request; counting the 512 cached tokens
    alone gave two pieces and 6 programs."""
    from minisrv.configs import SMOLLM2_135M
    from minisrv.viz.gpu import split_programs

    batches = (1, 4, 16, 64, 128, 256)
    assert [split_programs(SMOLLM2_135M, b, 512) for b in batches] == [
        9, 36, 144, 576, 1152, 2304]
    assert split_programs(SMOLLM2_135M, 1, 255) == 3  # 256 keys: one piece
    assert split_programs(SMOLLM2_135M, 1, 256) == 6  # 257 keys: two
    assert split_programs(SMOLLM2_135M, 1, 8192) == 24  # capped at eight pieces
