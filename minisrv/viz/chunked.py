"""Figures, widget and explorer of the chunked-prefill chapter: the inter-token spike, one
step's budget, and the chunk size's trade-off between inter-token latency and time to first
token."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from minisrv.engine import RunResult
from minisrv.experiments.chunked import (
    CHUNK_SIZES,
    SGLANG_DEFAULT,
    VLLM_SMALL_GPU,
    VLLM_V1_DEFAULT,
    SpikeRun,
    chunk_runs,
    chunk_table,
    long_prompt_workload,
)
from minisrv.metrics import itl_values
from minisrv.scheduler import StepRecord
from minisrv.viz.explorer import Explorer, Frame, explorer
from minisrv.viz.radix import RecordedEvent
from minisrv.viz.style import (
    BookFigure,
    label_axes,
    legend_below,
    one_header_row,
    page_figure,
    plain_log_ticks,
    styled,
)

__all__ = ["EXPLORER_REQUESTS", "EXPLORER_SHARES", "chunk_explorer", "chunk_widget",
           "chunk_handovers", "plot_chunk_choice", "plot_spike", "plot_tradeoff", "share_table",
           "share_title", "step_table", "tradeoff_table"]

COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd")


@styled
def plot_spike(runs: Sequence[SpikeRun], title: str = "") -> BookFigure:
    """Every inter-token gap of the chats as a segment over the time it spans, one colour per
    run (chunk size and mode); the long prompt's arrival marked."""
    fig, ax = page_figure(height_in=3.4)
    # Runs can share a gap's height and span (no chunking and prefill-first both stall the
    # chats for the whole prefill): each later run is drawn wider, paler and below, and the
    # first dashed on top, so all show.
    for i, (run, color) in enumerate(zip(runs, COLORS, strict=False)):
        chats = run.result.requests[:-1]
        times = np.concatenate([r.token_times[1:] for r in chats])
        gaps = np.concatenate([np.diff(r.token_times) for r in chats])
        ax.hlines(1e3 * gaps, times - gaps, times, lw=2.5 + 2 * i, zorder=2 + len(runs) - i,
                  color=color, alpha=1.0 if i == 0 else 0.55,  # each gap over its span
                  linestyles=(0, (3, 1.5)) if i == 0 else "solid",
                  label=f"{run.name}: worst gap {1e3 * run.max_gap:.0f} ms")
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
    return one_header_row(pd.DataFrame(rows).set_index("step"))


def chunk_handovers(events: Sequence[RecordedEvent], rid: int
                    ) -> list[tuple[RecordedEvent, RecordedEvent]]:
    """Each chunk of request ``rid`` in a ``TreeRecorder``'s ``events``: the insert of its KV
    into the tree, and the unlock after it, whose tree shows the request's lock moved onto
    the new leaf (the insert alone still holds the old lock)."""
    tag = f"r{rid}"
    inserts = [i for i, e in enumerate(events) if e.op == "insert" and e.label == tag]
    return [(events[i], next(e for e in events[i:] if e.op == "unlock" and e.label == tag))
            for i in inserts]


def _defaults_at(size: int, mode: str) -> str:
    """Which engines' default budget ``size`` is, in ``mode``: SGLang's runs mixed steps only
    with ``--enable-mixed-chunk``."""
    if mode != "mixed":
        return "SGLang's default" if size == SGLANG_DEFAULT else ""
    names = [name for default, name in ((VLLM_V1_DEFAULT, "vLLM on H100"),
                                        (VLLM_SMALL_GPU, "vLLM, smaller GPUs"),
                                        (SGLANG_DEFAULT, "SGLang mixed")) if size == default]
    return ", ".join(names)


@styled
def plot_tradeoff(sweep: pd.DataFrame, throughput: pd.DataFrame | None = None,
                  prefill_first: pd.DataFrame | None = None) -> BookFigure:
    """The chunk size's trade-off, three panels against the same chunk sizes (``sweep``'s,
    "none" first: no chunking, whose level is also dashed across): the worst and the p99
    inter-token gap, the long prompts' mean TTFT, the throughput (``throughput``'s rows if
    given, else ``sweep``'s). ``prefill_first``'s rows (``chunk_table`` of prefill-first
    runs) are hollow diamonds at their size; a grey line marks each size that is an
    engine's default, named in the legend.

    Every point sits over its chunk size: drawn against the TTFT instead, the p99 line
    doubled back over the worst gap's and only one line's points could be labelled."""
    fig, axes = page_figure(height_in=3.6, cols=3)
    chunked = sweep[sweep["chunk"].notna()]
    whole = sweep[sweep["chunk"].isna()].iloc[0]
    sizes = [int(c) for c in chunked["chunk"]]
    at: dict[int | None, int] = {None: 0} | {size: i + 1 for i, size in enumerate(sizes)}
    first = prefill_first if prefill_first is not None else sweep.iloc[:0]

    def where(chunks: pd.Series) -> list[int]:
        missing = [c for c in chunks if not pd.isna(c) and int(c) not in at]
        if missing:
            raise ValueError(f"chunk sizes {missing} are not among the sweep's {sizes}")
        return [at[None if pd.isna(c) else int(c)] for c in chunks]

    gaps, ttft, rate = axes
    handles = []
    for ax, column, color, name in ((gaps, "max_itl", COLORS[0], "worst gap"),
                                    (gaps, "p99_itl", COLORS[1], "p99 gap"),
                                    (ttft, "mean_ttft_long", COLORS[3], "mean TTFT, long prompts")):
        handles += ax.plot(where(chunked["chunk"]), 1e3 * chunked[column], "o-", color=color,
                           label=name)
        ax.axhline(1e3 * whole[column], color=color, ls="--", lw=1)
        ax.plot([0], [1e3 * whole[column]], "s", color=color, mfc="white")
        ax.plot(where(first["chunk"]), 1e3 * first[column], "D", ms=9, color=color, mfc="none")
    data = throughput if throughput is not None else sweep
    bars = rate.bar(where(data["chunk"]), data["throughput"], color=COLORS[2])
    for text in rate.bar_label(bars, [f"{v:,.0f}" for v in data["throughput"]], rotation=90,
                               padding=2, fontsize=8):
        text.set_bbox({"facecolor": "white", "edgecolor": "none", "pad": 0.5})  # over a line
    handles.append(Line2D([], [], color="#555555", marker="s", mfc="white", ls="--", lw=1,
                          label="no chunking"))
    for size, mode in zip(first["chunk"], first["mode"], strict=True):
        names = _defaults_at(int(size), mode)
        handles.append(Line2D([], [], color="#555555", marker="D", mfc="none", ls="none",
                              label=f"{int(size):,}, {mode}" + (f" ({names})" if names else "")))
    defaults = [(size, names) for size in sizes if (names := _defaults_at(size, "mixed"))]
    for (size, names), style in zip(defaults, ((0, (1, 1.5)), (0, (6, 2, 1, 2)), "-."),
                                    strict=False):
        for ax in axes:
            ax.axvline(at[size], color="#7f7f7f", ls=style, lw=1.5, zorder=0)
        handles.append(Line2D([], [], color="#7f7f7f", ls=style, lw=1.5,
                              label=f"{size:,}: {names}"))
    gaps.set_yscale("log")
    plain_log_ticks(gaps)
    gaps.margins(y=0.1)
    ttft.set_ylim(0, 1.15 * ttft.get_ylim()[1])  # from zero: a cut axis made +14% a cliff
    rate.margins(y=0.3)  # room above the tallest bar for its label
    labels = ["none", *(_size_label(c) for c in sizes)]
    for ax, title, ylabel in ((gaps, "Inter-token gap", "gap (ms)"),
                              (ttft, "Long prompts' TTFT", "mean TTFT (ms)"),
                              (rate, "Throughput", "output tokens / s")):
        ax.set_xticks(range(len(labels)), labels, rotation=60)
        ax.minorticks_off()
        label_axes(ax, title, "chunk size (tokens)", ylabel)
    legend_below(fig, handles, ncol=2)
    return fig


def tradeoff_table(*tables: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``chunk_table`` tables in whole milliseconds: worst and p99 gap, the long
    prompts' mean TTFT; a row named by its chunk size ("none": no chunking) and its mode
    where that is not mixed."""
    rows = pd.concat(tables)
    table = (rows[["max_itl", "p99_itl", "mean_ttft_long"]] * 1e3).round(0).astype(int)
    table.columns = ["worst gap (ms)", "p99 gap (ms)", "mean TTFT long (ms)"]
    table.index = [("none" if pd.isna(size) else str(int(size)))
                   + ("" if mode == "mixed" else f", {mode}")
                   for size, mode in zip(rows["chunk"], rows["mode"], strict=True)]
    return table


def _size_label(size: float) -> str:
    return f"{int(size) // 1024}K" if size >= 1024 else str(int(size))


@styled
def plot_chunk_choice(runs: Mapping[int | None, RunResult], chunk: int,
                      title: str = "") -> BookFigure:
    """One chunk size among the others, on one workload (``runs``: ``chunk_runs`` with
    ``None`` and ``chunk`` among its sizes).

    Left: the worst and the p99 inter-token gap at every chunk size of ``runs``, ``chunk``
    ringed, no chunking as dashed lines. Right: the share of all inter-token gaps longer than
    a given time, at ``chunk`` and without chunking: the tail the budget cuts off.
    """
    if None not in runs or chunk not in runs:
        raise ValueError(f"runs must hold no chunking (None) and chunk {chunk}, "
                         f"got {sorted(runs, key=lambda s: -1 if s is None else s)}")
    table = chunk_table(runs).set_index("chunk", drop=False)
    sizes = table[table["chunk"].notna()]
    whole = table[table["chunk"].isna()].iloc[0]
    fig, (left, right) = page_figure(height_in=3.8, cols=2)
    for column, color, name in (("max_itl", COLORS[0], "worst gap"),
                                ("p99_itl", COLORS[1], "p99 gap")):
        left.plot(sizes["chunk"], 1e3 * sizes[column], "o-", color=color, label=name)
        left.axhline(1e3 * whole[column], color=color, ls="--", lw=1,
                     label=f"{name}, no chunking")
        left.plot([chunk], [1e3 * table.loc[chunk, column]], "o", ms=13, mfc="none",
                  mec="black", mew=1.5)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    # One range for every workload an explorer steps through: its frames share the first
    # frame's layout, so tick labels of another width (a "1000" appearing) would be clipped.
    shown = 1e3 * table[["max_itl", "p99_itl"]].to_numpy()
    left.set_ylim(min(3.0, 0.8 * shown.min()), max(3000.0, 1.25 * shown.max()))
    plain_log_ticks(left)  # before the chunk sizes' own labels, which it would replace
    left.set_xticks(list(sizes["chunk"]), [_size_label(c) for c in sizes["chunk"]])
    left.minorticks_off()
    label_axes(left, f"Chunks of {chunk}: worst gap {1e3 * table.loc[chunk, 'max_itl']:.0f} ms",
               "chunk size (tokens)", "inter-token gap (ms)")
    for size, color, name in ((None, "#7f7f7f", "no chunking"),
                              (chunk, COLORS[3], f"chunks of {chunk}")):
        gaps = np.sort(itl_values(runs[size].requests)) * 1e3
        longer = 1.0 - np.arange(len(gaps)) / len(gaps)
        right.step(gaps, longer, where="post", color=color, lw=1.5, label=name)
    right.set_xscale("log")
    right.set_yscale("log")
    plain_log_ticks(right)  # plain numbers: mathtext labels cost most of an explorer's frame
    label_axes(right, "The tail of the gaps", "inter-token gap (ms)", "share of gaps this long")
    legend_below(fig, ncol=3)
    if title:
        fig.suptitle(title, x=0.02, ha="left")
    return fig


def chunk_widget(n: int = 300, rate: float = 4.0) -> Any:
    """Chunk size and long-prompt share: ``plot_chunk_choice`` and the numbers of that chunk
    size beside no chunking. A new share serves the mix at every chunk size (some seconds);
    a new chunk size only redraws. Needs a live kernel."""
    from IPython.display import display

    from minisrv.viz.widgets import panel, slider

    served: dict[float, dict[int | None, RunResult]] = {}

    def redraw(log2_chunk: int, long_share: float) -> None:
        if long_share not in served:
            work = long_prompt_workload(n=n, long_share=long_share, rate=rate)
            served[long_share] = chunk_runs((None, *CHUNK_SIZES), work)
        runs, size = served[long_share], 2 ** log2_chunk
        display(plot_chunk_choice(runs, size, share_title(long_share, rate)))
        rows = chunk_table({None: runs[None], size: runs[size]})
        rows["chunk"] = ["none", str(size)]
        display(rows.set_index("chunk")[["max_itl", "p99_itl", "mean_ttft",
                                          "mean_ttft_long", "throughput"]].round(3))

    low, high = (int(np.log2(c)) for c in (CHUNK_SIZES[0], CHUNK_SIZES[-1]))
    return panel(redraw, {"log2_chunk": slider(11, low, high, "chunk size (log2)"),
                          "long_share": slider(0.1, 0.0, 0.5, "long-prompt share", 0.05)})


def share_title(share: float, rate: float) -> str:
    """The title of ``plot_chunk_choice`` for a mix: the explorer's, and the chapter's figure
    of its first state."""
    return f"{share:.0%} of the requests bring 4K-32K tokens, arriving at {rate:g} per second"


EXPLORER_SHARES: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.4)
"""Long-prompt shares of the explorer: from one request in twenty to two in five. The worst
gap is the chunk's whatever the share; the p99 gap is not: the more long prompts, the more
steps carry a chunk, and the large chunks that barely touched the p99 at 5% dominate it."""

EXPLORER_REQUESTS = 60
"""Requests per mix of the explorer: each share serves its mix at every chunk size and
without chunking, eight simulations; at the chapter's 300 requests they take seconds per
share, at 60 a fraction of that, with every share's long prompts still arriving among chats."""


def chunk_explorer(
    runs: Mapping[int | None, RunResult] | None = None,
    *,
    chunk: int = 2048,
    long_share: float = 0.1,
    shares: Sequence[float] = EXPLORER_SHARES,
    n: int = EXPLORER_REQUESTS,
    rate: float = 4.0,
) -> Explorer:
    """``plot_chunk_choice`` over the chunk size (``CHUNK_SIZES``) and, given more than one
    of ``shares``, the share of long prompts, for the page.

    Each share's mix (``long_prompt_workload`` of ``n`` requests) is served once at every
    chunk size and without chunking (``chunk_runs``, the chapter's sweep); every chunk size
    of that share is drawn from those runs. ``runs``: the runs of the mix at ``long_share``
    already made (the chapter's figure of the default state), reused when given (checked to
    be that workload's). The kernel face is ``chunk_widget`` on the same ``n`` requests,
    which takes any share.
    """
    served: dict[float, Mapping[int | None, RunResult]] = {}
    if runs is not None:
        work = long_prompt_workload(n=n, long_share=long_share, rate=rate)
        lens = [len(p) for p in work.prompts]
        for size, result in runs.items():
            if ([r.prompt_len for r in result.requests] != lens
                    or [r.arrival for r in result.requests] != list(work.arrivals)):
                raise ValueError(f"the run at chunk {size} did not serve "
                                 f"long_prompt_workload(n={n}, long_share={long_share}, "
                                 f"rate={rate})")
        served[long_share] = runs

    def draw(chunk: int, share: float = long_share) -> Frame:
        if share not in served:
            work = long_prompt_workload(n=n, long_share=share, rate=rate)
            served[share] = chunk_runs((None, *CHUNK_SIZES), work)
        share_runs = served[share]
        whole, chunked = (row for _, row in chunk_table(
            {None: share_runs[None], chunk: share_runs[chunk]}).iterrows())
        return Frame([plot_chunk_choice(share_runs, chunk, share_title(share, rate))],
                     {"max_itl": float(chunked["max_itl"]), "p99_itl": float(chunked["p99_itl"]),
                      "mean_ttft_long": float(chunked["mean_ttft_long"]),
                      "throughput": float(chunked["throughput"]),
                      "max_itl_unchunked": float(whole["max_itl"]),
                      "p99_itl_unchunked": float(whole["p99_itl"]),
                      "mean_ttft_long_unchunked": float(whole["mean_ttft_long"])},
                     caption=f"Chunks of {chunk}: worst gap {1e3 * chunked['max_itl']:.0f} ms "
                             f"against {1e3 * whole['max_itl']:.0f} ms unchunked; long prompts' "
                             f"mean TTFT {1e3 * chunked['mean_ttft_long']:,.0f} ms against "
                             f"{1e3 * whole['mean_ttft_long']:,.0f} ms unchunked.")

    # The page's range steps through the sizes in order (powers of two, as the widget's log2
    # slider does) and shows the size itself.
    controls = [("chunk", "chunk size (tokens)", list(CHUNK_SIZES), chunk)]
    if len(shares) > 1:  # one share needs no control
        controls.append(("share", "long-prompt share", list(shares), long_share))
    elif list(shares) != [long_share]:
        raise ValueError(f"the only share {list(shares)} must be long_share={long_share}")
    return explorer(draw, controls, live=lambda: chunk_widget(n, rate))


METRIC_NAMES = {"max_itl": "worst gap", "p99_itl": "p99 gap",
                "mean_ttft_long": "mean TTFT long"}


def share_table(ex: Explorer, columns: Sequence[tuple[str, int | None]] = (
        ("max_itl", 2048), ("p99_itl", 256), ("p99_itl", 16384), ("p99_itl", None),
        ("mean_ttft_long", 256), ("mean_ttft_long", None)),
        shares: Sequence[float] = EXPLORER_SHARES) -> pd.DataFrame:
    """What ``chunk_explorer``'s states give along the share of long prompts: one row per
    share, one column per (metric, chunk size) of ``columns`` (a size of ``None``: without
    chunking, which every state of a share holds beside its own), in whole milliseconds."""
    def value(metric: str, chunk: int | None, share: float) -> float:
        if chunk is None:
            return ex.metrics(chunk=ex.default["chunk"], share=share)[f"{metric}_unchunked"]
        return ex.metrics(chunk=chunk, share=share)[metric]

    table = {f"{METRIC_NAMES[metric]} {'unchunked' if chunk is None else f'at {chunk:,}'} (ms)":
             [round(1e3 * value(metric, chunk, share)) for share in shares]
             for metric, chunk in columns}
    index = pd.Index([f"{share:.0%}" for share in shares], name="long prompts")
    return one_header_row(pd.DataFrame(table, index=index))
