"""The ragged attention call's block mask, drawn tile by tile (the GPU appendix).

``plot_block_mask`` draws the tiles the ragged call computes for one step, so the page shows
the block mask it counts; ``plot_decode_block_masks`` draws its weak case, decodes sharing
one query tile, with the few scores each request needs drawn over the tiles computed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from matplotlib.colors import ListedColormap
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from minisrv.model.ragged import FLEX_BLOCK_SIZE, ragged_tiles
from minisrv.viz.style import BookFigure, label_axes, legend_below, page_figure, styled

__all__ = ["TILE_COLORS", "plot_block_mask", "plot_decode_block_masks"]

TILE_COLORS: dict[str, str] = {"empty": "#f1f3f5", "partial": "#ffa94d", "full": "#4c6ef5"}
"""The block mask's three kinds of tile: skipped, masked per element, computed without a mask."""


@styled
def plot_block_mask(new_lens: Sequence[int], cached_lens: Sequence[int], title: str,
                    block: int = FLEX_BLOCK_SIZE) -> BookFigure:
    """The query x key matrix of one ragged call, tile by tile, as ``ragged_tiles`` makes it:
    empty tiles (skipped), partial ones (the mask evaluated per element) and full ones
    (computed without a mask), with thin lines where each request's rows and keys begin.

    Axes are in tokens, so a reader sees how much of the matrix each request owns and how
    little of it the call computes; the image holds one pixel per tile (0 empty, 1 partial,
    2 full)."""
    partial, full = ragged_tiles(new_lens, cached_lens, block)
    kinds = partial.int() + 2 * full.int()
    n_q, n_k = kinds.shape
    fig, ax = page_figure(6.4)  # square tiles: the full width keeps the axis labels whole
    ax.imshow(kinds.numpy(), cmap=ListedColormap(list(TILE_COLORS.values())), vmin=0, vmax=2,
              extent=(0, n_k * block, n_q * block, 0), interpolation="nearest")
    rows = cols = 0
    for new, cached in zip(new_lens, cached_lens, strict=True):
        if rows:  # where the next request's rows and keys begin
            ax.axhline(rows, color="black", linewidth=0.4, alpha=0.6)
            ax.axvline(cols, color="black", linewidth=0.4, alpha=0.6)
        rows, cols = rows + new, cols + cached + new
    ax.grid(False)
    label_axes(ax, title, "key position (every request's keys end to end)",
               "query row (new tokens end to end)")
    counts = {"empty": int((kinds == 0).sum()), "partial": int((kinds == 1).sum()),
              "full": int((kinds == 2).sum())}
    legend_below(fig, [Patch(facecolor=color, edgecolor="#adb5bd",
                             label=f"{name}: {counts[name]:,} tiles")
                       for name, color in TILE_COLORS.items()], ncol=3)
    return fig


@styled
def plot_decode_block_masks(steps: Sequence[tuple[str, Sequence[int]]],
                            block: int = FLEX_BLOCK_SIZE) -> BookFigure:
    """Steps of decodes only, one panel each: the tiles of their query tile (as
    ``ragged_tiles`` makes them, ``steps`` giving each panel's title and the decodes' cached
    lengths), and, drawn over them in black, the scores each request needs, its one query row
    against its own keys.

    A decode has one query row, so up to ``block`` decodes share one query tile, and the
    tiles are a strip one tile high; the panels stretch it to the page's width. The black
    staircase against the coloured strip is the ragged call's weak case at a glance: every
    key tile is computed for all the tile's rows while each row needs one request's keys."""
    fig, axes = page_figure(1.9 * len(steps) + 0.6, rows=len(steps), squeeze=False)
    shown = set()  # the tile kinds some strip holds: the legend names only those
    for ax, (title, cached) in zip(axes[:, 0], steps, strict=True):
        partial, full = ragged_tiles([1] * len(cached), cached, block)
        kinds = partial.int() + 2 * full.int()
        shown |= {int(k) for k in kinds.unique()}
        ax.imshow(kinds.numpy(), cmap=ListedColormap(list(TILE_COLORS.values())), vmin=0,
                  vmax=2, extent=(0, kinds.shape[1] * block, kinds.shape[0] * block, 0),
                  interpolation="nearest", aspect="auto")
        starts = [0, *itertools.accumulate(c + 1 for c in cached)]
        longest = max(range(len(cached)), key=lambda r: cached[r])
        alone = len(cached) > 1 and sorted(cached)[-2] < cached[longest]
        # a row on the strip's edge would vanish into the frame: one far longer request's
        # row is drawn thick, over the frame (zorder above the spines)
        widths = [3.5 if alone and row == longest else 1.2 for row in range(len(cached))]
        ax.hlines([row + 0.5 for row in range(len(cached))], starts[:-1], starts[1:],
                  color="black", linewidths=widths, clip_on=False, zorder=3)
        if alone:
            # one request far longer than the rest: its row can sit on the strip's edge; the
            # label ends where its keys begin, inside the axes whichever request is last
            mid = (starts[longest] + starts[longest + 1]) / 2
            ax.annotate(f"the request at context {cached[longest]:,}: "
                        f"{cached[longest] + 1:,} keys needed", xy=(mid, longest + 0.5),
                        xytext=(starts[longest], 0.35 * block), ha="right", va="center",
                        fontsize="small", bbox={"facecolor": "white", "edgecolor": "none"},
                        arrowprops={"arrowstyle": "->", "color": "#868e96",
                                    "linestyle": "--"})  # grey: not a row of scores
        ax.grid(False)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
        counts = f"{int(partial.sum()):,} partial and {int(full.sum()):,} full key tiles"
        label_axes(ax, f"{title}: {counts}", ylabel="query row")
    axes[-1, 0].set_xlabel("key position (every request's keys end to end)")
    kinds_shown = [(name, color) for k, (name, color) in enumerate(TILE_COLORS.items())
                   if k in shown]
    legend_below(fig, [*(Patch(facecolor=color, edgecolor="#adb5bd", label=f"{name} tile")
                         for name, color in kinds_shown),
                       Line2D([], [], color="black", label="scores a request needs")],
                 ncol=len(kinds_shown) + 1)
    return fig
