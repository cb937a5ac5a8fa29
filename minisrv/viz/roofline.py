"""Tables, plots and widgets for the KV-cache and roofline chapter.

Everything here is drawn from ``minisrv.kvsize`` and ``minisrv.sim.roofline``; no number is
computed twice. Figures are ``BookFigure`` objects built without pyplot's global state, so
a cell that returns one shows it exactly once, and a widget can redraw it freely. Sizes,
fonts and legends follow the house style of ``minisrv.viz.style``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.ticker import LogLocator

from minisrv.configs import MODELS, GPUSpec, ModelConfig
from minisrv.kvsize import (
    all_heads_numbers_per_token_per_layer,
    kv_bytes_per_token,
    kv_numbers_per_token_per_layer,
)
from minisrv.sim.roofline import decode_step_cost
from minisrv.sim.sizing import (
    gb,
    kv_bytes_per_request,
    max_concurrent_requests,
    weight_bytes,
)

# BookFigure lives in style.py; it is imported here too because the other viz modules
# (timeline, batching, radix) import it from this module.
from minisrv.viz.style import (
    BookFigure,
    label_axes,
    legend_below,
    one_header_row,
    page_figure,
    plain_log_ticks,
    styled,
)

KIB, MIB, GIB = 2**10, 2**20, 2**30

DTYPES: dict[str, float] = {"fp32": 4, "bf16 / fp16": 2, "fp8": 1, "int4": 0.5}
"""Bytes per stored number for the dtypes a reader can pick (weights and KV alike)."""

CONTEXT_CHOICES: tuple[int, ...] = tuple(2**k for k in range(7, 18))  # 128 ... 131072 tokens
BATCH_CHOICES: tuple[int, ...] = tuple(2**k for k in range(0, 13))  # 1 ... 4096 requests


def format_bytes(n_bytes: float) -> str:
    """Binary units (KiB, MiB, GiB) with up to three significant digits: 131072 -> '128 KiB'."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n_bytes >= size:
            return f"{n_bytes / size:.3g} {unit}"
    return f"{n_bytes:.3g} B"


def _heads(cfg: ModelConfig) -> str:
    """Query heads / heads that store K and V ("latent" for MLA), for the comparison table."""
    return f"{cfg.n_heads} / {'latent' if cfg.attention == 'mla' else cfg.n_kv_heads}"


def _tokens(n: int) -> str:
    """Token counts as the text names them: 32768 -> '32K', 1000 -> '1,000'."""
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


ALL_HEADS_COLUMN = "all heads ÷ actual"
"""``kv_table``'s last column: the cache if every query head kept its own K and V, over the
cache the model really keeps (the saving GQA, MQA or MLA buys)."""


def kv_table(
    models: Sequence[ModelConfig] | None = None, context_len: int = 32768, dtype_bytes: float = 2
) -> pd.DataFrame:
    """One row per model: attention kind, heads, KV numbers per layer, per token, per request.

    Few, short columns so that the table fits the book's column. The last one compares with
    every query head keeping its own K and V (``all_heads_numbers_per_token_per_layer``; the
    classic 2 x layers x d_model where heads x head_dim = d_model): the saving GQA/MQA/MLA buy.
    """
    rows = []
    for cfg in models or list(MODELS.values()):
        per_token = kv_bytes_per_token(cfg, dtype_bytes)
        every_head = (all_heads_numbers_per_token_per_layer(cfg)
                      / kv_numbers_per_token_per_layer(cfg))
        counterfactual = cfg.name.endswith("(all heads)")  # built by configs.all_heads
        rows.append(
            {
                "model": f"{cfg.name[:-1]}, counterfactual)" if counterfactual else cfg.name,
                "attention": cfg.attention.upper(),
                "layers": cfg.n_layers,
                "heads: query / KV": _heads(cfg),
                "numbers / layer": kv_numbers_per_token_per_layer(cfg),
                "KV / token": format_bytes(per_token),
                f"KV / {_tokens(context_len)} tokens": format_bytes(
                    kv_bytes_per_request(cfg, context_len, dtype_bytes)
                ),
                ALL_HEADS_COLUMN: f"{every_head:.3g}x",
            }
        )
    return one_header_row(pd.DataFrame(rows).set_index("model"))  # "model" in the corner


_CONTEXT_COLORS: dict[int, str] = {
    16: "C4", 32: "C9", 64: "C6", 128: "C0", 256: "C8", 512: "C5", 1024: "C1", 2048: "C3",
    4096: "C3", 8192: "C2", 16384: "C6", 32768: "C4", 65536: "C8", 131072: "C5"}
"""A context length's colour, the same in every figure, every state of the explorer and the
memory bar (grey and black are the roofs and the weights). The six contexts the chapter's
explorer draws have six colours, and any three contexts one figure draws
(``contexts_around``: an eighth, the context, eight times it) three; contexts that never
meet on one page or figure may share one."""


def context_color(context_len: int) -> str:
    """The colour of ``context_len`` in every figure of the chapter (``_CONTEXT_COLORS``)."""
    return _CONTEXT_COLORS.get(context_len, "C9")


def _batch_grid(limit: int) -> np.ndarray:
    """Batch sizes from 1 to ``limit``, spaced evenly on a log axis."""
    return np.unique(np.geomspace(1, max(limit, 2), 160).round().astype(int))


def memory_wall(cfg: ModelConfig, gpu: GPUSpec, context_len: int, dtype_bytes: float) -> int:
    """Requests that fit, or 0 when not even one does (the plots show that, not raise)."""
    try:
        return max_concurrent_requests(cfg, gpu, context_len, dtype_bytes)
    except ValueError:
        return 0


def _weights_fit(cfg: ModelConfig, gpu: GPUSpec, dtype_bytes: float) -> bool:
    return weight_bytes(cfg, dtype_bytes) < gpu.memory_bytes


def _decode_curves(
    cfg: ModelConfig, gpu: GPUSpec, context_len: int, batches: np.ndarray, dtype_bytes: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step time (ms), throughput (tokens/s) and a compute-bound flag for each batch size."""
    costs = [decode_step_cost(cfg, gpu, int(b), context_len, dtype_bytes) for b in batches]
    time_ms = np.array([c.time_s for c in costs]) * 1e3
    compute_bound = np.array([c.bound == "compute" for c in costs])
    return time_ms, batches / (time_ms / 1e3), compute_bound


def _draw_context(
    axes: Sequence, batches: np.ndarray, series: Sequence[np.ndarray], compute_bound: np.ndarray,
    wall: int, color: str, label: str,
) -> None:
    """One context length on both panels: solid while it fits, dotted past the memory wall,
    highlighted where compute sets the step time, and the wall itself as a dashed line."""
    fits = batches <= wall
    for ax, y in zip(axes, series, strict=True):
        ax.plot(batches[fits], y[fits], color=color, lw=2.2, label=label)
        beyond = batches >= (batches[fits][-1] if fits.any() else 0)
        ax.plot(batches[beyond], y[beyond], color=color, lw=1.6, ls=":", alpha=0.7)
        hot = compute_bound
        if hot.any():
            ax.plot(batches[hot], y[hot], color=color, lw=7, alpha=0.25, solid_capstyle="butt")
        if wall:
            ax.axvline(wall, color=color, ls="--", lw=1.2)


@styled
def plot_roofline(
    cfg: ModelConfig,
    gpu: GPUSpec,
    contexts: Sequence[int] = (128, 1024, 8192),
    dtype_bytes: float = 2,
    batch: int | None = None,
    max_batch: int | None = None,
) -> BookFigure:
    """Decode step time (top) and throughput (bottom) against batch size, one curve per
    context length; the panels are stacked so that each keeps the column's full width.

    Solid: batches that fit in memory; dotted: batches that would not (past the memory wall,
    drawn dashed at ``max_concurrent_requests``). A pale band marks compute-bound batches;
    everything else is memory-bound. The grey lines are the two roofs: reading the weights
    alone (the floor of every step) and the arithmetic alone. ``batch`` marks one batch size.
    Without ``max_batch`` the batch axis ends at a power of ten, so its last label sits at
    the edge in every figure (an explorer lays all its states out as its first one).
    """
    fig, (ax_time, ax_tput) = page_figure(height_in=7.6, rows=2, sharex=True)
    title = f"{cfg.name} decoding on {gpu.name}, {dtype_bytes:g} bytes per number"
    if not _weights_fit(cfg, gpu, dtype_bytes):
        title += f"\nweights ({gb(weight_bytes(cfg, dtype_bytes))}) do not fit"
    walls = {c: memory_wall(cfg, gpu, c, dtype_bytes) for c in contexts}
    limit = max_batch or 10 ** int(np.ceil(np.log10(max(256, 2 * max(walls.values(), default=0),
                                                         batch or 1))))
    batches = _batch_grid(limit)
    for context in contexts:
        color = context_color(context)
        time_ms, tput, hot = _decode_curves(cfg, gpu, context, batches, dtype_bytes)
        fit_text = f"{walls[context]:,} fit" if walls[context] else "none fits"
        label = f"context {context:,} ({fit_text})"
        _draw_context((ax_time, ax_tput), batches, (time_ms, tput), hot, walls[context], color,
                      label)
        if batch:
            # filled: the batch the server runs, the wall's when the chosen one does not fit
            # (as summary_line reports it); hollow: a chosen batch past the wall
            runs = min(batch, walls[context])
            marks = [(runs, color)] if runs else []
            if batch > runs:
                marks.append((batch, "white"))
            for at, face in marks:
                point = decode_step_cost(cfg, gpu, at, context, dtype_bytes)
                ax_time.plot(at, point.time_s * 1e3, "o", color=color, mfc=face, ms=8)
                ax_tput.plot(at, at / point.time_s, "o", color=color, mfc=face, ms=8)
    weights_ms = weight_bytes(cfg, dtype_bytes) / gpu.bandwidth * 1e3
    compute_ms = 2 * cfg.matmul_param_count * batches / gpu.flops * 1e3
    ax_time.axhline(weights_ms, color="grey", lw=1.5, label="read weights once")
    ax_time.plot(batches, compute_ms, color="black", lw=1.5, ls="-.",
                 label="arithmetic only, 2·params·batch (lookup excluded)")
    for ax in (ax_time, ax_tput):
        ax.set(xscale="log", yscale="log", xlim=(1, batches[-1]))
        ax.grid(True, which="major", alpha=0.3)
        plain_log_ticks(ax)
    # throughput spans few decades: 20,000 and 50,000 labelled, so a plateau can be read off
    ax_tput.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    label_axes(ax_time, f"Step time: {title}", ylabel="decode step time (ms)")
    label_axes(ax_tput, "Throughput", "batch size (requests decoding together)",
               "throughput (tokens/s)")
    style = [
        Line2D([], [], color="grey", ls="--", lw=1, label="memory wall (most requests that fit)"),
        Line2D([], [], color="grey", ls=":", lw=1.5, label="would not fit in memory"),
        Line2D([], [], color="grey", lw=7, alpha=0.25, label="compute-bound (else memory-bound)"),
    ]
    if batch:
        past = any(batch > wall for wall in walls.values())  # a hollow mark is drawn
        style.append(Line2D([], [], color="grey", ls="", marker="o", ms=8,
                            label=f"batch {batch:,}" + (" (at the wall if past it)" if past
                                                         else "")))
        if past:  # the legend names only marks the figure draws
            style.append(Line2D([], [], color="grey", ls="", marker="o", mfc="white", ms=8,
                                label=f"batch {batch:,}: past the wall"))
    curves = list(dict(zip(*reversed(ax_time.get_legend_handles_labels()), strict=True)).values())
    legend_below(fig, handles=curves + style, ncol=2)
    return fig


@styled
def plot_memory_budget(
    cfg: ModelConfig, gpu: GPUSpec, context_len: int, batch: int, dtype_bytes: float = 2
) -> BookFigure:
    """Where the card's memory goes: weights, the KV cache of ``batch`` requests, and what is
    left. A KV bar that runs past the card's capacity is a batch that cannot be served."""
    weights = weight_bytes(cfg, dtype_bytes) / 1e9
    kv = batch * kv_bytes_per_request(cfg, context_len, dtype_bytes) / 1e9
    capacity = gpu.memory_bytes / 1e9
    fig, ax = page_figure(height_in=2.2)
    ax.barh(0, weights, color="0.55", label=f"weights {gb(weights * 1e9)}")
    overflow = weights + kv > capacity
    kv_label = f"KV cache, {batch:,} requests x {context_len:,} tokens each: {gb(kv * 1e9)}"
    color = context_color(context_len)  # the context's colour in the roofline figure
    fits = min(kv, max(capacity - weights, 0))
    ax.barh(0, fits, left=weights, color=color, label=kv_label)
    if overflow:  # the same colour, hatched: the part of the cache past the card
        ax.barh(0, kv - fits, left=weights + fits, color=color, alpha=0.35, hatch="//",
                edgecolor=color, label=f"past the capacity: {gb((weights + kv - capacity) * 1e9)}")
    free = capacity - weights - kv
    if free > 0:
        left = gb(free * 1e9) if free >= 1 else f"{free * 1e3:.0f} MB"  # not "0.0524 GB"
        ax.barh(0, free, left=weights + kv, color="0.9", label=f"free {left}")
    ax.axvline(capacity, color="black", lw=2.5, label=f"{gpu.name} capacity {gb(capacity * 1e9)}")
    ax.set(yticks=[], xlim=(0, max(capacity, weights + kv) * 1.02))
    ax.grid(False, axis="y")
    verdict = "do not fit" if overflow else "fit"
    label_axes(ax, f"{cfg.name} on {gpu.name}: {batch:,} requests of {context_len:,} tokens "
               f"{verdict}", "memory (GB)")
    legend_below(fig, ncol=2)
    return fig


@styled
def plot_intensity_roofline(
    cfg: ModelConfig,
    gpu: GPUSpec,
    context_len: int = 1024,
    batches: Sequence[int] = (1, 16, 64, 256),
    prefill_tokens: Sequence[int] = (512, 4096),
    dtype_bytes: float = 2,
) -> BookFigure:
    """The classic roofline: attainable FLOP/s against FLOPs per byte moved.

    Decode steps (one point per batch size) sit on the slanted memory roof; a long prefill
    lands on the flat compute roof. The ridge is where the two roofs meet.
    """
    from minisrv.sim.roofline import batch_step_cost

    fig, ax = page_figure(height_in=5.0)
    intensity = np.geomspace(0.1, 1e4, 200)
    attainable = np.minimum(gpu.flops, intensity * gpu.bandwidth) / 1e12
    ax.plot(intensity, attainable, color="black", lw=2.5, label=f"{gpu.name} roof")
    ax.axvline(gpu.ridge_intensity, color="grey", ls="--", lw=1.5,
               label=f"ridge: {gpu.ridge_intensity:.0f} FLOP/byte")
    for b in batches:
        cost = decode_step_cost(cfg, gpu, b, context_len, dtype_bytes)
        ax.plot(cost.intensity, cost.flops / cost.time_s / 1e12, "o", color="C0")
        ax.annotate(f"decode x{b}", (cost.intensity, cost.flops / cost.time_s / 1e12),
                    textcoords="offset points", xytext=(6, -14))
    for n in prefill_tokens:
        cost = batch_step_cost(cfg, gpu, prefill=[(n, 0)], dtype_bytes=dtype_bytes)
        ax.plot(cost.intensity, cost.flops / cost.time_s / 1e12, "s", color="C1")
        ax.annotate(f"prefill {n:,}", (cost.intensity, cost.flops / cost.time_s / 1e12),
                    textcoords="offset points", xytext=(-30, 8))
    ax.plot([], [], "o", color="C0", label=f"decode steps, context {context_len:,}")
    ax.plot([], [], "s", color="C1", label="one prefill")
    ax.set(xscale="log", yscale="log")
    plain_log_ticks(ax)  # 0.1, 1, 10, 1,000 rather than 10^-1 ... 10^3
    ax.set_ylim(top=gpu.flops / 1e12 * 4)  # room for the labels above the flat roof
    ax.grid(True, which="major", alpha=0.3)
    ax.grid(False, which="minor")
    label_axes(ax, f"Roofline of {cfg.name} on {gpu.name}",
               "arithmetic intensity (FLOPs per byte moved)", "attainable throughput (TFLOP/s)")
    legend_below(fig, ncol=2)
    return fig
