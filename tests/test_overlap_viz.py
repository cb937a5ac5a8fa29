"""The overlap chapter's figures and tables: drawn from the model and the measurement,
labelled, legible, and checked against the run they show."""

from __future__ import annotations

import pytest

from minisrv.engine import Engine
from minisrv.experiments.breakdown import CPU_PARTS, PARTS
from minisrv.experiments.lanes import timeline
from minisrv.tokenizer import Tokenizer
from minisrv.viz.overlap import (
    breakdown_summary,
    cpu_breakdown,
    plot_cpu_breakdown,
    plot_timelines,
    timeline_widget,
)
from minisrv.viz.style import PAGE_WIDTH_IN

MODEL_SEED = 5


def _texts(fig) -> list:
    return [t for ax in fig.axes for t in (ax.title, ax.xaxis.label, ax.yaxis.label)]


def test_timeline_figure_shows_both_loops_with_their_totals() -> None:
    fig = plot_timelines(7.36, 3.0, 6)
    top, bottom = fig.axes
    block, over = timeline(7.36, 3.0, 6, False), timeline(7.36, 3.0, 6, True)
    assert top.get_title(loc="left").startswith("Blocking")
    assert f"{block.total:.3g} ms" in top.get_title(loc="left")
    assert f"{over.total:.3g} ms" in bottom.get_title(loc="left")
    assert "1.41x" in fig.get_suptitle()  # (7.36 + 3) / 7.36
    assert bottom.get_xlabel() == "time (ms)"
    assert [t.get_text() for t in bottom.get_yticklabels()] == ["device", "CPU"]
    assert len(fig.legends) == 1 and len(fig.legends[0].get_texts()) == 3
    # blocking: 6 CPU bars, 6 device bars, the 6 idle gaps drawn twice (hatch and fill)
    assert [len(c.get_paths()) for c in top.collections] == [6, 6, 6, 6]
    assert [len(c.get_paths()) for c in bottom.collections] == [6, 6, 1, 1]
    assert all(t.get_fontsize() >= 10 for t in fig.legends[0].get_texts())
    assert fig.get_figwidth() == PAGE_WIDTH_IN  # the house style: page width, text >= 10 pt


def test_timeline_figure_with_varying_steps_and_no_idle() -> None:
    fig = plot_timelines([4, 1, 4], [0, 0, 0], 3)
    assert "1.00x faster" in fig.get_suptitle()
    assert "idle 0 ms" in fig.axes[1].get_title(loc="left")


def test_timeline_widget_builds() -> None:
    pytest.importorskip("ipywidgets")
    box = timeline_widget()
    sliders = box.children[0].children
    assert [s.description for s in sliders] == ["device step (ms)", "CPU step (ms)", "steps"]
    assert sliders[0].value == 7.36


def test_cpu_breakdown_table_and_plot(model) -> None:
    tok = Tokenizer()
    prompts = [tok.encode(p) for p in ("FR:Paris,", "FR:Paris,Ly", "JP:", "FR:Paris,Ni")]
    lengths = [4, 6, 5, 3]
    frames = {}
    for cache in ("none", "radix"):
        engine = Engine(model, kv_capacity=200, max_running=2, cache=cache)
        frame = cpu_breakdown(engine, prompts, lengths)
        assert frame.attrs["outputs"] == [
            model.reference_generate(p, m) for p, m in zip(prompts, lengths)
        ]
        assert len(frame) == engine.stats.steps
        assert frame["total"].to_numpy() == pytest.approx(frame[list(PARTS)].sum(axis=1))
        assert list(frame["batch size"]) == [r.batch_size for r in engine.trace]
        assert ((frame["CPU %"] > 0) & (frame["CPU %"] < 100)).all()
        frames[f"FCFS, cache={cache}"] = frame
    summary = breakdown_summary(frames)
    assert list(summary.index) == list(frames)
    assert summary.loc["FCFS, cache=none", "steps"] == len(frames["FCFS, cache=none"])
    assert summary["CPU %"].between(0, 100).all()
    fig = plot_cpu_breakdown(frames)
    whole, cpu_only = fig.axes
    assert whole.get_ylabel() == cpu_only.get_ylabel() == "mean time per step (ms)"
    assert whole.get_title(loc="left") and cpu_only.get_title(loc="left") and fig.get_suptitle()
    assert len(whole.patches) == 2 * len(PARTS) and len(cpu_only.patches) == 2 * len(CPU_PARTS)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == list(reversed(PARTS))
    shares = [t.get_text() for t in whole.texts]
    assert shares == [f"CPU {s:.1f}%" for s in summary["CPU %"]]
