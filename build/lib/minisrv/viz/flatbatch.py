"""Pictures of one flat batch: the token row, the attention mask, and where the KV lives.

Selective batching is easiest to see, not read: the new tokens of every request laid end to
end in one matrix, a mask that lets each token see only its own request (block-diagonal,
causal inside a block, the cached prefix fully visible), and a pool in which each request's
slots are scattered wherever the allocator found room.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from minisrv.model import FlatBatch
from minisrv.viz.style import BookFigure, label_axes, legend_below, page_figure, styled

__all__ = ["attention_mask", "plot_flat_batch"]

PALETTE = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3"]


def attention_mask(batch: FlatBatch) -> np.ndarray:
    """``[new tokens, all keys]``: entry ``(i, j)`` is the request index + 1 when flat token
    ``i`` attends key ``j``, else 0. Keys are every request's slots in request order, so the
    mask is block-diagonal: a prefix block fully visible, then a causal triangle."""
    total_keys = sum(c + n for c, n in zip(batch.cached_lens, batch.new_lens))
    mask = np.zeros((batch.num_tokens, total_keys), dtype=int)
    key0 = 0
    for r, (cached, new, row0) in enumerate(zip(batch.cached_lens, batch.new_lens, batch.starts)):
        for t in range(new):
            mask[row0 + t, key0:key0 + cached + t + 1] = r + 1
        key0 += cached + new
    return mask


@styled
def plot_flat_batch(batch: FlatBatch, capacity: int, names: Sequence[str] | None = None,
                    title: str = "One flat batch") -> BookFigure:
    """Three panels: the flat token row by request, the block-diagonal attention mask over
    every request's keys, and the KV pool's slots by owner (prefix lighter than new tokens)."""
    n = len(batch)
    names = list(names) if names is not None else [f"r{r}" for r in range(n)]
    colors = [PALETTE[r % len(PALETTE)] for r in range(n)]
    cmap = ListedColormap(["#f1f3f5", *colors])
    fig, (top, mid, bottom) = page_figure(height_in=8.0, rows=3, height_ratios=[1, 5, 1.3])

    row = np.concatenate([np.full(k, r + 1) for r, k in enumerate(batch.new_lens)])[None, :]
    top.imshow(row, cmap=cmap, vmin=0, vmax=n, aspect="auto")
    top.set_yticks([])
    top.grid(False)
    label_axes(top, f"{title}: new tokens end to end", f"row of the flat matrix "
               f"({batch.num_tokens} new tokens)")

    mid.imshow(attention_mask(batch), cmap=cmap, vmin=0, vmax=n, aspect="auto",
               interpolation="nearest")
    mid.grid(False)
    label_axes(mid, "Attention mask: block-diagonal, causal in each block",
               "key: each request's cached prefix, then its new tokens", "query (flat row)")

    pool = np.zeros(capacity)
    for r, slots in enumerate(batch.slots):
        cached = batch.cached_lens[r]
        for k, slot in enumerate(slots.tolist()):
            pool[slot] = r + 1 - (0.5 if k < cached else 0)
    shades = ["#f1f3f5"]
    for c in colors:
        shades += [c + "66", c]
    bottom.imshow(np.round(pool * 2).astype(int)[None, :], cmap=ListedColormap(shades),
                  vmin=0, vmax=2 * n, aspect="auto", interpolation="nearest")
    bottom.set_yticks([])
    bottom.grid(False)
    label_axes(bottom, f"Slot mapping: each request's K/V in a pool of {capacity}",
               "KV pool slot (pale: cached prefix; dark: written this step)")
    handles = [Patch(color=c, label=name) for c, name in zip(colors, names, strict=True)]
    legend_below(fig, handles, ncol=min(n, 3))
    return fig
