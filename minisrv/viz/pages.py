"""Drawings of the pages chapter: what the allocator held per page size, one trace through
the radix tree and the block cache, and the explorer over page size and workload."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.colors import to_rgba
from matplotlib.patches import Patch, Rectangle

from minisrv.experiments.page_pool import PoolSnapshot, page_roles
from minisrv.experiments.pages import PAGE_SIZES, PageRun, TraceHits, page_run, served_runs
from minisrv.viz.explorer import Explorer, Frame, explorer
from minisrv.viz.style import (
    FONT_SIZES,
    BookFigure,
    label_axes,
    legend_below,
    page_figure,
    styled,
)
from minisrv.viz.widgets import panel, slider

__all__ = ["CACHE_COLORS", "page_explorer", "page_widget", "plot_page_state",
           "plot_pool_snapshot", "plot_trace_hits"]

CACHE_COLORS = {"radix": "#4c6ef5", "blocks": "#e8590c"}
"""The tree in blue, vLLM's block cache in orange, in every figure of the chapter."""
TRACE_COLORS = ("#4c6ef5", "#74c0fc", "#e8590c")
"""The trace's three caches: the tree at pages of 1, at pages of 16, the blocks of 16."""


def _page_axis(ax: Any, sizes: Sequence[int], chosen: int | None = None) -> None:
    ax.set_xticks(range(len(sizes)), [str(s) for s in sizes])
    ax.set_xlim(-0.6, len(sizes) - 0.4)
    if chosen is not None:
        at = list(sizes).index(chosen)
        ax.axvspan(at - 0.45, at + 0.45, color="#fff3bf", zorder=0)


@styled
def plot_trace_hits(trace: TraceHits, labels: Sequence[str]) -> BookFigure:
    """One group of bars per request of ``trace`` (named by ``labels``), one bar per cache:
    the solid part is the prompt the cache found, the pale part what it computed. Caches
    that found the same tokens of every request share one bar, named by all of them. Dotted
    lines mark the boundaries of ``trace.page_size``."""
    merged: dict[tuple[int, ...], list[str]] = {}  # the hits of every request -> caches
    for cache, hits in trace.hits.items():
        merged.setdefault(tuple(hits), []).append(cache)
    bars = [(" = ".join(caches), list(hits)) for hits, caches in merged.items()]
    n = len(trace.prompts)
    fig, ax = page_figure(0.55 + 0.62 * n)
    height = 0.8 / len(bars)
    for i, prompt in enumerate(trace.prompts):
        for k, (_, hits) in enumerate(bars):
            y = i + (k - (len(bars) - 1) / 2) * height
            color = TRACE_COLORS[k % len(TRACE_COLORS)]
            ax.barh(y, hits[i], height * 0.9, color=color)
            ax.barh(y, len(prompt) - hits[i], height * 0.9, left=hits[i], color=color,
                    alpha=0.18)
    longest = max(map(len, trace.prompts))
    for boundary in range(trace.page_size, longest + 1, trace.page_size):
        ax.axvline(boundary, color="0.35", ls=":", lw=1)
    ax.set_yticks(range(n), list(labels))
    ax.invert_yaxis()
    ax.set_xlim(0, longest + 1)
    ax.grid(axis="y", visible=False)
    label_axes(ax, None, "prompt tokens", None)
    handles = []  # each bar's two parts, its found and its computed (pale) part
    for k, (name, _) in enumerate(bars):
        color = TRACE_COLORS[k % len(TRACE_COLORS)]
        handles += [Patch(color=color, label=f"{name}: found"),
                    Patch(color=color, alpha=0.18, label=f"{name}: computed")]
    legend_below(fig, handles, ncol=len(bars))  # a column per bar
    return fig


def _evicted(run: PageRun) -> int:
    """Cached tokens the run's prefix cache evicted for room (its eviction log)."""
    return sum(len(e.tokens) - e.start for e in run.evictions)


@styled
def plot_page_state(runs: Mapping[tuple[str, int], PageRun], sizes: Sequence[int],
                    chosen: int | None = None, title: str = "",
                    evicted_top: float | None = None, empty_top: float | None = None,
                    batch_top: float | None = None) -> BookFigure:
    """Four panels over ``sizes`` for one workload's runs (keyed (cache, page size)): the
    cached tokens each cache evicted for room, the hit rate, the mean batch and the share of
    slots left empty, of the tree and of the block cache; ``chosen`` shaded. ``evicted_top``:
    the top of the evicted panel's axis, so that the states of an explorer share one scale
    (a run that evicted nothing would otherwise get an axis around zero); ``empty_top`` and
    ``batch_top`` likewise for the empty slots (%) and the mean batch, so a smaller batch
    shows as lower bars, not as a rescaled axis."""
    fig, axes = page_figure(2.9, 1, 4)
    x = list(range(len(sizes)))
    width = 0.38
    for k, cache in enumerate(("radix", "blocks")):
        at = [i + (k - 0.5) * width for i in x]
        label = "radix tree" if k == 0 else "block cache"
        axes[0].bar(at, [_evicted(runs[cache, s]) for s in sizes], width,
                    color=CACHE_COLORS[cache])
        axes[1].bar(at, [100 * runs[cache, s].hit_rate for s in sizes], width,
                    color=CACHE_COLORS[cache], label=label)
        axes[2].bar(at, [runs[cache, s].mean_batch for s in sizes], width,
                    color=CACHE_COLORS[cache])
        axes[3].bar(at, [100 * runs[cache, s].waste for s in sizes], width,
                    color=CACHE_COLORS[cache])
    for ax in axes:
        _page_axis(ax, sizes, chosen)
    axes[1].set_ylim(0, 100)
    if evicted_top is not None:
        axes[0].set_ylim(0, evicted_top)
    if empty_top is not None:
        axes[3].set_ylim(0, empty_top)
    if batch_top is not None:
        axes[2].set_ylim(0, batch_top)
    label_axes(axes[0], "Evicted", "page size", "cached tokens")
    label_axes(axes[1], "Hit rate", "page size", "% of prompt tokens")
    label_axes(axes[2], "Batch", "page size", "requests per step")
    label_axes(axes[3], "Empty slots", "page size", "% of slots held")
    legend_below(fig, ncol=2)
    if title:
        fig.suptitle(title, x=0.02, ha="left")
    return fig


def _state_numbers(runs: Mapping[tuple[str, int], PageRun],
                   sizes: Sequence[int]) -> dict[str, float]:
    numbers: dict[str, float] = {}
    for s in sizes:
        tree, blocks = runs["radix", s], runs["blocks", s]
        numbers |= {f"evicted (tree), pages of {s}": _evicted(tree),
                    f"evicted (blocks), pages of {s}": _evicted(blocks),
                    f"hit rate (tree), pages of {s}": tree.hit_rate,
                    f"hit rate (blocks), pages of {s}": blocks.hit_rate,
                    f"mean batch (tree), pages of {s}": tree.mean_batch,
                    f"mean batch (blocks), pages of {s}": blocks.mean_batch,
                    f"empty slots (tree), pages of {s}": tree.waste,
                    f"empty slots (blocks), pages of {s}": blocks.waste}
    return numbers


def page_explorer(model: Any, tok: Any, workloads: Mapping[str, Any],
                  sizes: Sequence[int] = PAGE_SIZES, pools: Sequence[int] = (768,),
                  start: tuple[str, int] | None = None,
                  runs: dict[int, dict] | None = None, **options: Any) -> Explorer:
    """Every workload of ``workloads`` served by the radix tree and the block cache at every
    page size of ``sizes`` in a pool of each of ``pools`` tokens (``served_runs`` with
    ``options``); a state, (workload, pool), draws that workload's runs at every page size
    (``plot_page_state``, every state on one scale per panel), so moving the pool shows what
    eviction takes at each page size.
    ``runs``: runs by pool, each a ``served_runs`` dict (reused, the new runs added to it);
    the explorer keeps them as its ``runs``.
    ``start``: the first state, (workload, pool). A single workload gets no control (a
    menu of one entry chooses nothing)."""
    settings = [(cache, s) for s in sizes for cache in ("radix", "blocks")]
    runs = {} if runs is None else runs
    for pool in pools:
        runs[pool] = served_runs(model, workloads, settings, runs.get(pool),
                                 **{**options, "kv_capacity": pool})
    names = list(workloads)
    first = start or (names[0], pools[0])
    every_run = [runs[pool][name, cache, s] for pool in pools for name in names
                 for cache, s in settings]
    evicted_top = 1.08 * max(max(map(_evicted, every_run)), 1)  # one scale for every state
    empty_top = 108 * max(max(run.waste for run in every_run), 0.01)
    batch_top = 1.08 * max(max(run.mean_batch for run in every_run), 1)

    def draw(pool: int, workload: str = first[0]) -> Frame:
        mine = {(cache, s): runs[pool][workload, cache, s] for cache, s in settings}
        numbers = _state_numbers(mine, sizes)
        hits = {cache: ", ".join(f"{numbers[f'hit rate ({cache}), pages of {s}']:.1%}"
                                 for s in sizes) for cache in ("tree", "blocks")}
        evicted = {cache: ", ".join(f"{numbers[f'evicted ({cache}), pages of {s}']:,}"
                                    for s in sizes) for cache in ("tree", "blocks")}
        batch = {cache: ", ".join(f"{numbers[f'mean batch ({cache}), pages of {s}']:.1f}"
                                  for s in sizes) for cache in ("tree", "blocks")}
        empty = {cache: ", ".join(f"{numbers[f'empty slots ({cache}), pages of {s}']:.1%}"
                                  for s in sizes) for cache in ("tree", "blocks")}
        return Frame([plot_page_state(mine, sizes, None, f"{workload}, pool {pool:,} tokens",
                                      evicted_top, empty_top, batch_top)],
                     numbers,
                     caption=f"{workload}, pool of {pool:,} tokens, pages of "
                             f"{', '.join(map(str, sizes))}: the tree evicts {evicted['tree']} "
                             f"cached tokens, hits {hits['tree']} of prompt tokens, runs "
                             f"{batch['tree']} requests per step and leaves {empty['tree']} "
                             f"of its slots empty; the block cache evicts {evicted['blocks']}, "
                             f"hits {hits['blocks']}, runs {batch['blocks']} and leaves "
                             f"{empty['blocks']} empty")

    choose = [("workload", "workload", names, first[0])] if len(names) > 1 else []
    return explorer(draw, [*choose, ("pool", "pool (tokens)", list(pools), first[1])],
                    live=lambda: page_widget(model, workloads, 16,
                                             **{**options, "kv_capacity": first[1]}),
                    runs=runs)


def page_widget(model: Any, workloads: Mapping[str, Any], size: int = 16,
                **options: Any) -> Any:
    """A workload, any page size and pool: each change serves the workload with the tree
    and with the block cache again and prints their numbers (a kernel)."""
    import ipywidgets as widgets

    controls = {
        "workload": widgets.Dropdown(options=list(workloads), description="workload"),
        "size": slider(size, 1, 128, "page size (tokens)"),
        "capacity": slider(options.get("kv_capacity", 512), 128, 4096, "pool (tokens)",
                           step=64),
    }
    rest = {k: v for k, v in options.items() if k != "kv_capacity"}

    def redraw(workload: str, size: int, capacity: int) -> None:
        for cache in ("radix", "blocks"):
            run = page_run(model, workloads[workload], size, cache, kv_capacity=capacity,
                           **rest)
            print(f"{cache:>6}: hit rate {run.hit_rate:.1%}, {run.prefill_tokens} tokens "
                  f"prefilled, {run.waste:.1%} of slots empty, mean batch "
                  f"{run.mean_batch:.2f}, {run.retractions} retractions")

    return panel(redraw, controls, per_row=3)


ROLE_COLORS = {"shared": "#f59f00", "cached, free": "#ced4da", "free": "white"}
"""Pages in the pool picture: shared cached blocks gold, cached blocks in the free queue
grey, free pages white; each running request's own pages in a colour of ``OWNER_COLORS``."""
OWNER_COLORS = ("#74c0fc", "#b2f2bb", "#eebefa")


def _cell(ax: Any, x: float, y: float, color: str, text: str, w: float = 0.9,
          h: float = 0.8, fill: float = 1.0, **text_kw: Any) -> None:
    """A box coloured from its left edge over ``fill`` of its width (a page's share of
    tokens), a pale tint of the colour beyond (still the holder's), ``text`` centred on it."""
    left, bottom = x - w / 2, y - h / 2
    ax.add_patch(Rectangle((left, bottom), w, h, facecolor=to_rgba(color, 0.4),
                           edgecolor="none"))
    ax.add_patch(Rectangle((left, bottom), w * fill, h, facecolor=color, edgecolor="none"))
    ax.add_patch(Rectangle((left, bottom), w, h, facecolor="none", edgecolor="0.3", lw=0.8))
    ax.text(x, y, text, ha="center", va="center", **{"fontsize": FONT_SIZES["ticks"],
                                                      **text_kw})


def _bare(ax: Any, title: str) -> None:
    ax.set_axis_off()
    ax.set_title(title, loc="left", fontsize=FONT_SIZES["text"])


@styled
def plot_pool_snapshot(snapshot: PoolSnapshot) -> BookFigure:
    """The pool of ``snapshot`` in three panels: each running request's block table (the
    page of each of its blocks), the pool's pages coloured by who holds them (the free
    queue's order on its pages), and the cached blocks as chains of hashes, each block's
    hash taken over its parent's (last four hex digits), with its reference count. A
    request's pages are coloured as far as its tokens fill them."""
    roles = page_roles(snapshot)
    owners = list(snapshot.rows)
    colors = {**ROLE_COLORS, **{o: OWNER_COLORS[i % len(OWNER_COLORS)]
                                for i, o in enumerate(owners)}}
    blocks = {b.page: b for b in snapshot.blocks}
    children: dict[int | None, list[int]] = {}
    for b in snapshot.blocks:
        children.setdefault(b.parent, []).append(b.page)
    chain_rows: dict[int, int] = {}  # each block's row in the chain panel: one per leaf

    def place(parent: int | None, row: int) -> int:
        for page in sorted(children.get(parent, [])):
            chain_rows[page] = row
            row = place(page, row) if page in children else row + 1
        return row

    n_chains = place(None, 0)
    longest = max(map(len, snapshot.rows.values()))
    half = -(-snapshot.n_pages // 2)
    fig, axes = page_figure(1.2 + 0.42 * (len(owners) + 2 + n_chains), 3, 1,
                            gridspec_kw={"height_ratios": [len(owners), 2, n_chains]})
    table_ax, pool_ax, chain_ax = axes
    ps = snapshot.page_size
    fill = {page: 1.0 for page in roles}  # cached blocks are full, free pages white anyway
    for i, (label, row) in enumerate(snapshot.rows.items()):
        for k, page in enumerate(row):
            if roles[page] == label:
                fill[page] = min(ps, snapshot.lengths[label] - ps * k) / ps
            _cell(table_ax, k, i, colors[roles[page]], f"page {page}", fill=fill[page])
        table_ax.text(-0.6, i, f"{label} ({snapshot.lengths[label]} tokens)", ha="right",
                      va="center", fontsize=FONT_SIZES["ticks"])
    _bare(table_ax, f"Block tables: block k of a request holds its tokens {ps}k to "
                    f"{ps}k + {ps - 1}")
    queue = {page: k + 1 for k, page in enumerate(snapshot.free_queue)}
    for page in range(snapshot.n_pages):
        text = f"{page}" + (f"\nq{queue[page]}" if page in queue else "")
        _cell(pool_ax, page % half, page // half, colors[roles[page]], text, fill=fill[page])
    _bare(pool_ax, "The pool's pages (qN: N-th in the free queue, q1 evicted first)")
    step, w = 2.0, 1.7  # a block's distance from its parent's, a block's width
    seed_row = (n_chains - 1) / 2
    _cell(chain_ax, 0.1, seed_row, "white", "seed", w=0.7)
    for page, row in chain_rows.items():
        b, depth = blocks[page], _depth(blocks, page)
        x = step * (depth + 1)
        _cell(chain_ax, x, row, colors[roles[page]],
              f"page {page}  #{b.hash & 0xFFFF:04x}\nref {b.ref}", w=w, h=0.86, fontsize=9)
        tail = (0.45, seed_row) if b.parent is None else (x - step + w / 2, chain_rows[b.parent])
        chain_ax.annotate("", (x - w / 2, row), tail,
                          arrowprops={"arrowstyle": "->", "color": "0.3", "lw": 0.8})
    _bare(chain_ax, "Cached blocks: hash of (parent's hash, the block's tokens), reference count")
    table_ax.set_xlim(-0.55, max(longest, half) - 0.45)
    pool_ax.set_xlim(-0.55, half - 0.45)
    deepest = max(_depth(blocks, page) for page in chain_rows)
    chain_ax.set_xlim(-0.3, max(step * (deepest + 1) + w / 2 + 0.05, 8.5))
    for ax, rows in ((table_ax, len(owners)), (pool_ax, 2), (chain_ax, n_chains)):
        ax.set_ylim(rows - 0.5, -0.5)
    handles = [Patch(facecolor=colors[o], edgecolor="0.3", label=f"{o}'s own") for o in owners]
    handles += [Patch(facecolor=ROLE_COLORS[r], edgecolor="0.3", label=r)
                for r in ("shared", "cached, free", "free")]
    legend_below(fig, handles, ncol=len(handles))
    return fig


def _depth(blocks: Mapping[int, Any], page: int) -> int:
    """Blocks before ``page``'s in its chain."""
    depth, parent = 0, blocks[page].parent
    while parent is not None:
        depth, parent = depth + 1, blocks[parent].parent
    return depth
