"""A picture of what MHA, GQA, MQA and MLA cache for one token in one layer.

The table of the KV chapter gives the numbers; this figure shows *which* heads store K and V.
Each row is one attention design: the query heads on top, coloured by the KV head they read,
and under them what the layer caches, drawn to scale (so the bar's length is the cache's
size). Every count comes from ``minisrv.configs`` and ``minisrv.kvsize``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.patches import Patch, Rectangle

from minisrv.configs import DEEPSEEK_V3, LLAMA3_70B, ModelConfig, all_heads
from minisrv.kvsize import kv_bytes_per_token, kv_numbers_per_token_per_layer
from minisrv.viz.roofline import format_bytes
from minisrv.viz.style import FONT_SIZES, BookFigure, label_axes, legend_below, page_figure, styled


def one_kv_head(cfg: ModelConfig) -> ModelConfig:
    """The same model with multi-query attention: all query heads share one K and one V head.

    Only the cache is meant to be compared, so the parameter count is left as it was.
    """
    if cfg.attention == "mla":
        raise ValueError(f"{cfg.name}: MLA caches a shared latent, not per-head K and V")
    return cfg.with_(name=f"{cfg.name} (one KV head)", n_kv_heads=1, attention="mqa")


def layout_models() -> tuple[ModelConfig, ...]:
    """The four designs the chapter compares: LLaMA-3-70B with all heads (MHA), as released
    (GQA), with a single KV head (MQA), and DeepSeek-V3 (MLA)."""
    return (all_heads(LLAMA3_70B), LLAMA3_70B, one_kv_head(LLAMA3_70B), DEEPSEEK_V3)


def _group_colors(n: int) -> list:
    """One colour per KV head, never repeated: a repeated colour would say that two query
    heads read one KV head. The ten distinct colours of ``tab10`` for up to 10 heads, ``n``
    shades along a continuous map beyond (MHA's 64)."""
    from matplotlib import colormaps

    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    return [colormaps["turbo"](x) for x in np.linspace(0.05, 0.95, n)]


def _cache_segments(cfg: ModelConfig) -> list[tuple[str, int, int | None]]:
    """What one layer caches per token, as (name, numbers, KV head or None) in drawing order:
    K then V of each KV head in turn, or MLA's latent and rope key."""
    if cfg.attention == "mla":
        return [("latent", cfg.kv_lora_rank, None), ("rope key", cfg.qk_rope_head_dim, None)]
    return [(part, cfg.head_dim, h) for h in range(cfg.n_kv_heads) for part in ("K", "V")]


_MLA_COLORS = {"latent": "0.35", "rope key": "C1"}


def _draw_row(ax, cfg: ModelConfig, y: float, scale: float, dtype_bytes: float) -> None:
    """Query heads (top strip) and the cached numbers to scale (bottom strip) of one design."""
    colors = _group_colors(cfg.n_kv_heads)
    group = cfg.n_heads // cfg.n_kv_heads
    width = 1.0 / cfg.n_heads
    edge = "white" if cfg.n_heads <= 64 else "none"
    for h in range(cfg.n_heads):
        color = "0.6" if cfg.attention == "mla" else colors[h // group]
        ax.add_patch(Rectangle((h * width, y + 0.5), width, 0.3, fc=color, ec=edge, lw=0.5))
    x = 0.0
    for name, numbers, head in _cache_segments(cfg):
        length = numbers * scale
        color = _MLA_COLORS[name] if head is None else colors[head]
        ax.add_patch(Rectangle((x, y + 0.05), length, 0.3, fc=color, lw=0,
                               alpha=0.5 if name == "V" else 1.0))
        x += length
    if cfg.attention == "mla":
        shared = f"{cfg.n_heads} query heads, one shared latent"
    else:
        plural = "s" if cfg.n_kv_heads > 1 else ""
        shared = f"{cfg.n_heads} query heads, {cfg.n_kv_heads} KV head{plural}"
    ax.text(0, y + 0.86, f"{cfg.attention.upper()} · {cfg.name}", va="bottom",
            fontsize=FONT_SIZES["text"], weight="bold")
    ax.text(1, y + 0.86, shared, ha="right", va="bottom", fontsize=FONT_SIZES["ticks"])
    numbers = kv_numbers_per_token_per_layer(cfg)
    per_token = format_bytes(kv_bytes_per_token(cfg, dtype_bytes))
    size = f"{numbers:,} numbers per layer = {per_token} per token"
    if x < 0.55:  # room after the bar
        ax.text(x + 0.012, y + 0.2, size, va="center", fontsize=FONT_SIZES["ticks"])
    else:  # over the bar's end, on a white box
        ax.text(0.99, y + 0.2, size, ha="right", va="center", fontsize=FONT_SIZES["ticks"],
                bbox={"fc": "white", "ec": "none", "alpha": 0.9, "pad": 2})


@styled
def plot_kv_layouts(models: Sequence[ModelConfig] | None = None,
                    dtype_bytes: float = 2) -> BookFigure:
    """One row per attention design: which query heads share which cached K/V (colours),
    and what a layer stores per token, to one common scale (K solid, V lighter).

    The scale is the largest design's cache, so the rows' bar lengths compare directly;
    the KiB per token on the right use ``dtype_bytes`` per number and all the model's layers.
    """
    models = layout_models() if models is None else tuple(models)
    if not models:
        raise ValueError("plot_kv_layouts needs at least one model")
    largest = max(kv_numbers_per_token_per_layer(cfg) for cfg in models)
    scale = 1.0 / largest
    fig, ax = page_figure(height_in=1.15 * len(models) + 1.4)
    for row, cfg in enumerate(models):
        _draw_row(ax, cfg, y=(len(models) - 1 - row) * 1.3, scale=scale,
                  dtype_bytes=dtype_bytes)
    ax.set(xlim=(0, 1), ylim=(-0.05, 1.3 * len(models) - 0.1), yticks=[])
    ticks = np.linspace(0, 1, 5)
    ax.set_xticks(ticks, [f"{t * largest:,.0f}" for t in ticks])
    ax.grid(False)
    ax.spines["left"].set_visible(False)
    label_axes(ax, "What one layer caches for one token",
               "numbers cached per token and layer (lower bars, to scale)")
    legend_below(fig, ncol=2, handles=[
        Patch(fc="C0", label="query head (colour: the KV head it reads)"),
        Patch(fc="C0", alpha=0.5, label="cached V (solid: cached K)"),
        Patch(fc=_MLA_COLORS["latent"], label="MLA latent, shared by K and V"),
        Patch(fc=_MLA_COLORS["rope key"], label="MLA rope key"),
    ])
    return fig
