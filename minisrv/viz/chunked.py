"""Figures and the widget of the chunked-prefill chapter: the inter-token spike, one step's
budget, and the chunk size's trade-off between inter-token latency and time to first token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from minisrv.experiments.chunked import (
    SGLANG_DEFAULT,
    VLLM_SMALL_GPU,
    SpikeRun,
    chunk_sweep,
    long_prompt_workload,
)
from minisrv.scheduler import StepRecord
from minisrv.viz.style import BookFigure, label_axes, legend_below, page_figure, styled

__all__ = ["chunk_widget", "plot_spike", "plot_tradeoff", "step_table"]

COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd")


@styled
def plot_spike(runs: Sequence[SpikeRun], title: str = "") -> BookFigure:
    """Every inter-token gap of the chats as a segment over the time it spans, one colour per
    chunk size; the long prompt's arrival marked."""
    fig, ax = page_figure(height_in=3.4)
    for run, color in zip(runs, COLORS, strict=False):
        chats = run.result.requests[:-1]
        times = np.concatenate([r.token_times[1:] for r in chats])
        gaps = np.concatenate([np.diff(r.token_times) for r in chats])
        name = "no chunking" if run.chunk is None else f"chunks of {run.chunk}"
        ax.hlines(1e3 * gaps, times - gaps, times, lw=2, color=color,  # each gap over its span
                  label=f"{name}: worst gap {1e3 * run.max_gap:.0f} ms")
    arrival = runs[0].result.requests[-1].arrival
    ax.axvline(arrival, color="black", ls="--", lw=1, label="the long prompt arrives")
    ax.set_yscale("log")
    ax.set_xlim(0, None)
    label_axes(ax, title or "Chats' inter-token gaps when a 32K-token prompt arrives",
               "time (s)", "gap between tokens (ms)")
    legend_below(fig, ncol=2)
    return fig


def step_table(trace: Sequence[StepRecord], budget: int, rid_names: dict[int, str]
               ) -> pd.DataFrame:
    """One row per step: who computes a chunk (and how many tokens), who decodes, the
    budget used."""
    rows = []
    for s in trace:
        decodes = [rid_names.get(r, str(r)) for r in s.decode]
        rows.append({"step": s.index,
                     "prefill or chunk": ", ".join(rid_names.get(r, str(r)) for r in s.prefill),
                     "prefill tokens": s.prefill_tokens,
                     "decodes": ", ".join(decodes) or "-",
                     "budget used": f"{s.prefill_tokens + len(decodes)} / {budget}"})
    return pd.DataFrame(rows).set_index("step")


@styled
def plot_tradeoff(sweep: pd.DataFrame, throughput: pd.DataFrame | None = None,
                  title: str = "") -> BookFigure:
    """Left: worst and p99 inter-token gap against the long prompts' mean TTFT, one point
    per chunk size (no chunking marked apart). Right: throughput per chunk size."""
    fig, (left, right) = page_figure(height_in=3.8, cols=2, width_ratios=[3, 2])
    chunked = sweep[sweep["chunk"].notna()]
    whole = sweep[sweep["chunk"].isna()]
    for column, color, name in (("max_itl", COLORS[0], "worst gap"),
                                ("p99_itl", COLORS[1], "p99 gap")):
        left.plot(chunked["mean_ttft_long"], 1e3 * chunked[column], "o-", color=color,
                  label=f"{name}, chunked")
        left.plot(whole["mean_ttft_long"], 1e3 * whole[column], "s", color=color, mfc="white",
                  label=f"{name}, no chunking")
    for _, row in chunked.iterrows():
        size = int(row["chunk"])
        mark = {SGLANG_DEFAULT: " (SGLang, vLLM on H100)",
                VLLM_SMALL_GPU: " (vLLM, smaller GPUs)"}.get(size, "")
        left.annotate(f"{size}{mark}", (row["mean_ttft_long"], 1e3 * row["max_itl"]),
                      textcoords="offset points", xytext=(4, 4), fontsize=9)
    left.set_yscale("log")
    label_axes(left, title or "Inter-token gap against TTFT", "mean TTFT, long prompts (s)",
               "inter-token gap (ms)")
    data = throughput if throughput is not None else sweep
    labels = ["none" if pd.isna(c) else f"{int(c) // 1024}K" if c >= 1024 else str(int(c))
              for c in data["chunk"]]
    right.bar(labels, data["throughput"], color=COLORS[2])
    right.tick_params(axis="x", rotation=60)
    label_axes(right, "Throughput", "chunk size (tokens)", "output tokens / s")
    legend_below(fig, ncol=2)
    return fig


def chunk_widget(n: int = 200, rate: float = 4.0) -> Any:
    """Chunk size and long-prompt share: the chats' worst gap and p99 gap, and the TTFTs."""
    from IPython.display import display

    from minisrv.viz.widgets import panel, slider

    def redraw(log2_chunk: int, long_share: float) -> None:
        work = long_prompt_workload(n=n, long_share=long_share, rate=rate)
        size = 2 ** log2_chunk
        rows = chunk_sweep((None, size), work)
        rows["chunk"] = ["none", str(size)]
        display(rows.set_index("chunk")[["max_itl", "p99_itl", "mean_ttft",
                                          "mean_ttft_long", "throughput"]].round(3))

    return panel(redraw, {"log2_chunk": slider(11, 8, 14, "chunk size (log2)"),
                          "long_share": slider(0.1, 0.0, 0.5, "long-prompt share", 0.05)})
