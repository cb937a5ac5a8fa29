"""The chunked-prefill chapter's explorer: each state is the chunk sweep's run at its chunk
size and share of long prompts, and the chapter's own sweep is reused only for its workload."""

from __future__ import annotations

import html

import pytest

from minisrv.experiments.chunked import (
    CHUNK_SIZES,
    chunk_runs,
    chunk_table,
    long_prompt_workload,
)
from minisrv.viz import chunked as vc

N = 24  # requests per mix: enough for a few long prompts, cheap to serve at 8 sizes


@pytest.fixture(scope="module")
def sweep():
    return chunk_runs(workload=long_prompt_workload(n=N, long_share=0.2))


@pytest.fixture(scope="module")
def other():
    """The runs of the explorer's other mix, served apart from it (to check its 50% states,
    and the gap panel's range across mixes), once for both tests."""
    return chunk_runs(workload=long_prompt_workload(n=N, long_share=0.5))


@pytest.fixture(scope="module")
def explorer(sweep):
    """The explorer over two mixes, built once: its 50% states serve a workload of their own
    (the 20% states are the sweep's runs)."""
    return vc.chunk_explorer(sweep, long_share=0.2, shares=(0.2, 0.5), n=N)


def test_each_state_is_the_sweep_s_run_at_its_values(sweep, other, explorer) -> None:
    ex = explorer
    assert ex.default == {"chunk": 2048, "share": 0.2}
    mine, theirs = (chunk_table(runs).set_index("chunk") for runs in (sweep, other))
    for share, table in ((0.2, mine), (0.5, theirs)):
        for size in CHUNK_SIZES:
            state = ex.metrics(chunk=size, share=share)
            row = table.loc[size]
            assert (state["max_itl"], state["p99_itl"], state["mean_ttft_long"]) == (
                row["max_itl"], row["p99_itl"], row["mean_ttft_long"])
            whole = table[table.index.isna()].iloc[0]
            assert (state["max_itl_unchunked"], state["p99_itl_unchunked"]) == (
                whole["max_itl"], whole["p99_itl"])


def test_the_explorer_starts_at_the_chapter_s_mix_and_the_widget_s_size() -> None:
    import inspect

    page = inspect.signature(vc.chunk_explorer).parameters
    assert page["long_share"].default == inspect.signature(
        long_prompt_workload).parameters["long_share"].default
    # a smaller mix than the chapter's sweep (whose figure the chapter draws above the page)
    assert page["n"].default == vc.EXPLORER_REQUESTS
    assert vc.EXPLORER_REQUESTS < inspect.signature(long_prompt_workload).parameters["n"].default
    assert page["long_share"].default in vc.EXPLORER_SHARES
    assert len(vc.EXPLORER_SHARES) >= 5


def test_the_figure_s_log_axes_read_in_plain_numbers(sweep) -> None:
    fig = vc.plot_chunk_choice(sweep, 2048)
    fig.canvas.draw()
    labels = [t.get_text() for ax in fig.axes for t in (*ax.get_xticklabels(),
                                                        *ax.get_yticklabels())]
    assert labels and not any("$" in t for t in labels)  # no mathtext powers of ten
    assert "2K" in labels  # the chunk sizes keep their own labels


def test_one_share_needs_no_control(sweep) -> None:
    ex = vc.chunk_explorer(sweep, long_share=0.2, shares=(0.2,), n=N)
    assert ex.default == {"chunk": 2048}
    assert ex.metrics(chunk=256)["max_itl"] == chunk_table(sweep).set_index("chunk").loc[
        256, "max_itl"]


def test_runs_of_another_workload_are_refused(sweep) -> None:
    with pytest.raises(ValueError, match="did not serve long_prompt_workload"):
        vc.chunk_explorer(sweep, long_share=0.1, shares=(0.1,), n=N)


def test_the_figure_needs_the_unchunked_run(sweep) -> None:
    with pytest.raises(ValueError, match="no chunking"):
        vc.plot_chunk_choice({2048: sweep[2048]}, 2048)


def test_the_share_table_reads_the_explorer_s_states(explorer, other) -> None:
    ex = explorer
    table = vc.share_table(ex, columns=(("max_itl", 2048), ("p99_itl", 16384),
                                        ("mean_ttft_long", None)), shares=(0.2, 0.5))
    assert list(table.index) == ["20%", "50%"] and table.columns.name == "long prompts"
    assert list(table.columns) == ["worst gap at 2,048 (ms)", "p99 gap at 16,384 (ms)",
                                   "mean TTFT long unchunked (ms)"]
    unchunked = chunk_table({None: other[None]}).iloc[0]
    assert table.loc["50%"].tolist()[-1] == round(1e3 * unchunked["mean_ttft_long"])
    for share, label in ((0.2, "20%"), (0.5, "50%")):
        assert table.loc[label].tolist()[:2] == [
            round(1e3 * ex.metrics(chunk=2048, share=share)["max_itl"]),
            round(1e3 * ex.metrics(chunk=16384, share=share)["p99_itl"])]


def test_the_caption_sets_the_long_prompts_ttft_beside_the_unchunked_one(explorer) -> None:
    state = explorer.metrics(chunk=256, share=0.2)
    assert state["mean_ttft_long_unchunked"] == explorer.metrics(
        chunk=16384, share=0.2)["mean_ttft_long_unchunked"]
    caption = (f"long prompts' mean TTFT {1e3 * state['mean_ttft_long']:,.0f} ms against "
               f"{1e3 * state['mean_ttft_long_unchunked']:,.0f} ms unchunked")
    assert html.escape(caption) in explorer.html


def test_the_tradeoff_names_each_engine_s_default_in_its_mode(sweep) -> None:
    from minisrv.experiments.chunked import SGLANG_DEFAULT

    mixed = chunk_table(sweep)
    first = chunk_table(chunk_runs((SGLANG_DEFAULT,), long_prompt_workload(n=N, long_share=0.2),
                                   mode="prefill-first"))
    table = vc.tradeoff_table(mixed, first)
    assert list(table.index)[0] == "none"
    assert list(table.index)[-1] == f"{SGLANG_DEFAULT}, prefill-first"
    legend = vc.plot_tradeoff(mixed, None, first).legends[0]
    labels = [t.get_text() for t in legend.get_texts()]
    assert f"{SGLANG_DEFAULT:,}, prefill-first (SGLang's default)" in labels
    assert not any("SGLang's default" in t for t in labels if "prefill-first" not in t)
    assert "2,048: vLLM, smaller GPUs" in labels


def test_every_panel_of_the_tradeoff_reads_against_the_same_chunk_sizes(sweep) -> None:
    """The reader finds each point by its chunk size on every panel, "none" first: drawn
    against the TTFT, the p99 line ran back over the worst gap's and its points were not
    named."""
    table = chunk_table(sweep)
    fig = vc.plot_tradeoff(table, table)
    expected = ["none", "256", "512", "1K", "2K", "4K", "8K", "16K"]
    for ax in fig.axes:
        assert [t.get_text() for t in ax.get_xticklabels()] == expected
    gaps, ttft, _ = fig.axes
    for ax, column in ((gaps, "max_itl"), (gaps, "p99_itl"), (ttft, "mean_ttft_long")):
        line = next(line for line in ax.get_lines()
                    if list(line.get_ydata()) == list(1e3 * table[column][1:]))
        assert list(line.get_xdata()) == list(range(1, len(CHUNK_SIZES) + 1))
    with pytest.raises(ValueError, match="not among the sweep"):
        vc.plot_tradeoff(table[table["chunk"] != 8192], None, table[table["chunk"] == 8192])


def test_the_step_table_has_one_header_row() -> None:
    from types import SimpleNamespace

    steps = [SimpleNamespace(index=1, prefill=[2], prefill_tokens=14, decode=[0, 1])]
    table = vc.step_table(steps, 16, {0: "chat JP", 1: "chat DE", 2: "long"})
    assert table.columns.name == "step" and table.index.name is None
    assert table.loc[1].tolist() == ["long", 14, "chat JP, chat DE", "16 / 16"]


def test_the_gap_panel_keeps_one_range_across_mixes(sweep, other) -> None:
    """An explorer's frames share the first frame's axes, so the gap panel's range must not
    follow each mix's worst gap: a tick label of another width ("1000") was clipped."""
    limits = [vc.plot_chunk_choice(runs, 2048).axes[0].get_ylim() for runs in (sweep, other)]
    assert limits[0] == pytest.approx(limits[1])
    worst = max(chunk_table(runs)["max_itl"].max() for runs in (sweep, other))
    assert limits[0][1] > 1e3 * worst


def test_the_spike_figure_names_each_run_by_its_mode() -> None:
    from minisrv.experiments.chunked import spike_run

    mixed, first = spike_run(2048), spike_run(2048, mode="prefill-first")
    assert (mixed.name, first.name) == ("chunks of 2048", "chunks of 2048, prefill-first")
    labels = vc.plot_spike([mixed, first]).axes[0].get_legend_handles_labels()[1]
    assert any(label.startswith("chunks of 2048, prefill-first") for label in labels)
