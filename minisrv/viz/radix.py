"""Graphviz drawings of the radix cache, the recorder they are drawn from, and a widget.

The cache reports each operation to a listener (``RadixCache.listener``). ``TreeRecorder``
is that listener for the book: for every operation it keeps what the tree reported and a
snapshot of the tree afterwards (``RecordedEvent``). ``to_graphviz`` draws one such state:
each box is a node with its edge's text (decoded when a tokenizer is given), its token
count, its lock count and its last access on the cache's logical clock. The event decides
the colours: the path just matched, nodes just split or inserted, ghosts of nodes evicted.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import graphviz
import pandas as pd

from minisrv.experiments.radix import chat_capacity_run, chat_workload
from minisrv.kv import NodeView, RadixCache, TreeEvent
from minisrv.viz.explorer import Explorer, Frame, explorer
from minisrv.viz.style import (
    PAGE_WIDTH_IN,
    BookFigure,
    graph_attrs,
    label_axes,
    legend_below,
    page_figure,
    styled,
)
from minisrv.viz.widgets import panel, slider

__all__ = [
    "COLORS",
    "RecordedEvent",
    "TreeRecorder",
    "to_graphviz",
    "edge_text",
    "event_caption",
    "event_widget",
    "event_explorer",
    "event_numbers",
    "plot_capacity_sweep",
    "chat_capacity_widget",
    "chat_capacity_explorer",
]

COLORS = {
    "path": "#cfe2ff",  # walked by the last match or insert
    "split": "#ffd8a8",  # created by cutting an edge
    "inserted": "#c3f0c8",  # new leaf
    "locked": "#495057",  # border of nodes in use by running requests
    "ghost": "#adb5bd",  # just evicted
}
MAX_LINE = 15  # characters per line of a node's text: narrow boxes keep deep trees on the page
MAX_LINES = 3


class RecordedEvent(NamedTuple):
    """One operation as the recorder saw it: the tree's report and the tree afterwards."""

    step: int  # the cache's logical clock when the operation ran
    op: str  # "match", "insert", "lock", "unlock" or "evict"
    label: str  # the tag the caller gave (e.g. "r3" for request 3)
    length: int  # tokens matched, already cached, locked/unlocked, or freed
    path: tuple[int, ...]  # ids of the nodes walked, root excluded, in order
    split: tuple[int, ...]  # ids of nodes created by splitting an edge
    inserted: tuple[int, ...]  # ids of new leaves
    evicted: tuple[NodeView, ...]  # nodes removed, as they were just before
    tree: tuple[NodeView, ...]  # the whole tree after the operation


class TreeRecorder:
    """Listens to a ``RadixCache`` and keeps every operation with a snapshot of the tree.

    ``TreeRecorder(cache)`` attaches itself as ``cache.listener``; ``events`` then grows by
    one ``RecordedEvent`` per operation. Each snapshot copies the tree, so record only small
    trees (the book's walk-throughs), never a long simulation.
    """

    def __init__(self, cache: RadixCache) -> None:
        if not isinstance(cache, RadixCache):
            raise ValueError(f"only a RadixCache reports operations, got {cache!r} "
                             "(build the engine with cache='radix')")
        self.cache = cache
        self.events: list[RecordedEvent] = []
        cache.listener = self

    def __call__(self, tree: RadixCache, event: TreeEvent) -> None:
        self.events.append(RecordedEvent(tree.clock, event.op, event.tag, event.length,
                                         event.path, event.split, event.inserted,
                                         event.evicted, tree.snapshot()))

    def __len__(self) -> int:
        return len(self.events)


def edge_text(key: Sequence[int], tokenizer: Any = None) -> str:
    """The edge's tokens as text: ids, or decoded with every token visible (⏎ newline, ␣ space)."""
    if tokenizer is None:
        text = " ".join(str(t) for t in key)
    else:
        text = "".join(tokenizer.id_to_str(t) for t in key).replace("\n", "⏎").replace(" ", "␣")
    lines = _wrap_words(text, MAX_LINE) or [""]
    if len(lines) > MAX_LINES:
        lines = lines[:MAX_LINES - 1] + ["…" + lines[-1][-(MAX_LINE - 1):]]
    return "\n".join(lines).replace("\\", "\\\\").replace('"', '\\"')


def _wrap_words(text: str, width: int) -> list[str]:
    """Lines of at most ``width`` characters, broken after a space or ␣ where there is one, so
    that a city's name is not cut in two ("R" / "ome"); only a word longer than a line is split.
    Every character is kept, spaces included: the lines joined give back ``text``."""
    lines: list[str] = []
    while len(text) > width:
        cut = max(text.rfind(" ", 0, width), text.rfind("␣", 0, width)) + 1  # 0: none fits
        cut = cut if cut > 0 else width
        lines.append(text[:cut])
        text = text[cut:]
    if text:
        lines.append(text)
    return lines


def _label(view: NodeView, tokenizer: Any) -> str:
    if view.parent is None:
        return "root"
    return (f"{edge_text(view.key, tokenizer)}\n"
            f"{len(view.key)} tok · lock {view.lock_ref}\nt={view.last_access}")


def to_graphviz(
    tree: TreeRecorder | RecordedEvent | RadixCache | Sequence[NodeView],
    tokenizer: Any = None,
    event: RecordedEvent | None = None,
    title: str | None = None,
    since: int | None = None,
    rankdir: str | None = None,
) -> graphviz.Digraph:
    """Draw a radix tree: a live cache, a recorded event's tree, or a snapshot.

    Args:
        tree: a ``TreeRecorder`` (its cache drawn as it is now, coloured by the last
            recorded event), a ``RecordedEvent`` (the tree right after that operation), a
            ``RadixCache`` (as it is now, uncoloured), or ``RadixCache.snapshot()``.
        tokenizer: decodes each edge's tokens; without it the token ids are shown.
        event: the operation whose effects to colour (defaults as described above).
        title: caption under the drawing; defaults to ``event_caption(event)``.
        since: with a ``TreeRecorder``, colour the effects of every event recorded from
            ``tree.events[since]`` on (e.g. everything one request did), not just the last.
        rankdir: ``"TB"`` or ``"LR"`` to pin the orientation (an explorer's frames keep
            one); by default top-down when it fits the page, else the narrower of the two.

    Returns:
        A ``graphviz.Digraph``; Jupyter renders it as SVG.
    """
    events: Sequence[RecordedEvent] = ()
    if isinstance(tree, RecordedEvent):
        views: Sequence[NodeView] = tree.tree
        events = (tree if event is None else event,)
    elif isinstance(tree, TreeRecorder):
        views = tree.cache.snapshot()
        if event is not None:
            events = (event,)
        elif since is not None:
            events = tree.events[since:]
        else:
            events = tree.events[-1:]
    elif isinstance(tree, RadixCache):
        views = tree.snapshot()
        events = () if event is None else (event,)
    else:
        views = tree
        events = () if event is None else (event,)
    path = {i for e in events for i in e.path}
    split = {i for e in events for i in e.split}
    inserted = {i for e in events for i in e.inserted}
    ghosts = [g for e in events for g in e.evicted]
    if title is None and len(events) == 1:
        title = event_caption(events[0])

    # A bushy tree drawn top-down is wider than the page and shrinks to unreadable boxes;
    # drawn left to right it grows downwards instead. Top-down reads best, so it is kept
    # whenever it fits the page; otherwise the narrower of the two is drawn.
    def build(rankdir: str) -> graphviz.Digraph:
        dot = graphviz.Digraph(**graph_attrs(rankdir=rankdir, nodesep="0.15", ranksep="0.3"))
        dot.attr("node", shape="box", style="rounded,filled", fillcolor="white")
        dot.attr("edge", arrowsize="0.6")
        if title:
            dot.attr(label=title, labelloc="b")
        for view in views:
            attrs = {}
            if view.id in inserted:
                attrs["fillcolor"] = COLORS["inserted"]
            elif view.id in split:
                attrs["fillcolor"] = COLORS["split"]
            elif view.id in path:
                attrs["fillcolor"] = COLORS["path"]
            if view.lock_ref > 0:
                attrs.update(penwidth="2.5", color=COLORS["locked"])
            dot.node(f"n{view.id}", _label(view, tokenizer), **attrs)
            if view.parent is not None:
                bold = view.id in path
                dot.edge(f"n{view.parent}", f"n{view.id}",
                         **({"penwidth": "2", "color": "#1c7ed6"} if bold else {}))
        known = {view.id for view in views} | {ghost.id for ghost in ghosts}
        for ghost in ghosts:
            dot.node(f"n{ghost.id}", _label(ghost, tokenizer) + "\n(evicted)",
                     style="rounded,dashed", color=COLORS["ghost"], fontcolor=COLORS["ghost"])
            parent = ghost.parent if ghost.parent in known else 0
            dot.edge(f"n{parent}", f"n{ghost.id}", style="dashed", color=COLORS["ghost"])
        return dot

    if rankdir is not None:
        return build(rankdir)
    top_down = build("TB")
    if _width_pt(top_down) <= PAGE_WIDTH_IN * 72:
        return top_down
    left_right = build("LR")
    return min(top_down, left_right, key=_width_pt)


def _width_pt(dot: graphviz.Digraph) -> float:
    """Width of the laid-out drawing in points (graphviz's own layout, no rendering)."""
    svg = dot.pipe(format="svg").decode()
    match = re.search(r'<svg width="([\d.]+)pt"', svg)
    return float(match.group(1)) if match else float("inf")


def event_caption(event: RecordedEvent) -> str:
    """One line saying what the operation did, e.g. ``"t=3 · A: insert · 17 cached, +1 leaf"``."""
    who = f"{event.label}: " if event.label else ""
    if event.op == "match":
        what = f"matched {event.length} tokens" if event.length else "no cached prefix"
    elif event.op == "insert":
        what = f"{event.length} tokens already cached"
    elif event.op == "evict":
        n = len(event.evicted)
        what = f"freed {event.length} tokens ({n} node{'s' * (n != 1)})"
    else:  # lock, unlock: a request with no cached prefix holds only the root
        what = f"{event.length} tokens on the path" if event.length else "only the root"
    extras = []
    if event.split:
        extras.append(f"{len(event.split)} split")
    if event.inserted:
        extras.append(f"+{len(event.inserted)} leaf")
    tail = f" ({', '.join(extras)})" if extras else ""
    return f"t={event.step} · {who}{event.op}: {what}{tail}"


def event_widget(events: Sequence[RecordedEvent], tokenizer: Any = None, start: int | None = None):
    """A slider over ``events`` that redraws the tree after each one. Needs a live kernel;
    draw ``to_graphviz(events[start])`` above it as the static face."""
    import ipywidgets as widgets
    from IPython.display import display

    start = _event_index(events, start)
    slider = widgets.IntSlider(value=start, min=0, max=len(events) - 1,
                               description="event", continuous_update=False)

    def redraw(i: int) -> None:
        display(to_graphviz(events[i], tokenizer=tokenizer))

    return panel(redraw, {"i": slider}, per_row=1)


def _event_index(events: Sequence[RecordedEvent], start: int | None) -> int:
    """``start`` checked against ``events`` (``None``: the last event)."""
    if not events:
        raise ValueError("an event slider needs at least one recorded event")
    if start is None:
        return len(events) - 1
    if not 0 <= start < len(events):
        raise ValueError(f"start must be an event index in 0..{len(events) - 1}, got {start}")
    return start


def event_numbers(event: RecordedEvent) -> dict[str, int | str]:
    """What one recorded operation did and the tree it left: the operation, its request's
    tag, its length (as ``event_caption`` reads it), and the tree's nodes (root excluded),
    cached tokens and locked nodes afterwards."""
    nodes = [view for view in event.tree if view.parent is not None]
    return {"op": event.op, "request": event.label, "length": event.length,
            "nodes": len(nodes), "cached tokens": sum(len(view.key) for view in nodes),
            "locked nodes": sum(view.lock_ref > 0 for view in nodes)}


def event_explorer(events: Sequence[RecordedEvent], tokenizer: Any = None,
                   start: int | None = None) -> Explorer:
    """``event_widget`` for the page: the tree after every one of ``events``, drawn by
    ``to_graphviz`` and coloured by that event, behind one control over the event index
    (``start``, the last event by default, is shown first).

    A recorded event holds its tree's snapshot, so every state is a drawing of what the
    cache really held; each state's numbers are ``event_numbers``.
    """
    start = _event_index(events, start)
    # One orientation for every frame: top-down if every tree fits the page that way, else
    # left to right, so that stepping through the events never flips the drawing.
    fits = all(_width_pt(to_graphviz(e, tokenizer, rankdir="TB")) <= PAGE_WIDTH_IN * 72
               for e in events)
    rankdir = "TB" if fits else "LR"

    def draw(event: int) -> Frame:
        recorded = events[event]
        numbers = event_numbers(recorded)
        return Frame([to_graphviz(recorded, tokenizer, rankdir=rankdir)], numbers,
                     caption=f"Afterwards the cache holds {numbers['cached tokens']} tokens "
                             f"in {numbers['nodes']} node{'s' * (numbers['nodes'] != 1)}, "
                             f"{numbers['locked nodes']} of them locked.")

    return explorer(draw, [("event", "event", list(range(len(events))), start)],
                    live=lambda: event_widget(events, tokenizer, start))


# ------------------------------------------------------------------------ figures of runs
@styled
def plot_capacity_sweep(sweep: pd.DataFrame, title: str = "") -> BookFigure:
    """Hit rate against KV pool size (one point per run of ``capacity_sweep``)."""
    fig, ax = page_figure(height_in=3.6)
    ax.plot(sweep.index, 100 * sweep["hit rate"], marker="o", label="radix cache, LRU")
    ax.set_xscale("log")
    ax.set_xticks(list(sweep.index), [str(c) for c in sweep.index])
    ax.minorticks_off()
    ax.set_ylim(0, 100)
    label_axes(ax, title or "Keeping chat history: hit rate against pool size",
               "KV pool capacity (tokens, log scale)", "hit rate (% of prompt tokens)")
    legend_below(fig)
    return fig


def _checked_chat_run(model: Any, tok: Any, capacity: int, sessions: int, turns: int,
                      built: dict, served: dict | None):
    """``chat_capacity_run``, stopped by an error when an output differs from its request
    generated alone: a page or widget shows hit rates only of runs that served right."""
    run = chat_capacity_run(model, tok, capacity, sessions, turns, built, served=served)
    if run.identical != run.requests:
        differ = run.requests - run.identical
        raise AssertionError(f"pool {capacity}, {sessions} sessions: {differ} outputs differ")
    return run


def chat_capacity_widget(model: Any, tok: Any, capacity: int = 400, sessions: int = 8,
                         turns: int = 4, built: dict | None = None):
    """Sliders for pool size, sessions and turns; each change rebuilds and serves the chats
    (``chat_capacity_run``, every output checked against the request generated alone) and
    shows the hit rate of each turn. ``built``: chats already built. Needs a live kernel."""
    from IPython.display import display

    built = {} if built is None else built
    controls = {
        "capacity": slider(capacity, 250, 2000, "KV capacity (tokens)", step=50),
        "sessions": slider(sessions, 1, 12, "sessions"),
        "turns": slider(turns, 1, 5, "turns"),
    }

    def redraw(capacity: int, sessions: int, turns: int) -> None:
        run = _checked_chat_run(model, tok, capacity, sessions, turns, built, None)
        display(run.table)

    return panel(redraw, controls, per_row=3)


CHAT_CAPACITIES = (300, 400, 500, 600, 800)
"""Pools of the chat explorer: from one where eight sessions evict each other's history before
nearly every turn to one that keeps all eight conversations of four turns."""
CHAT_SESSIONS = (1, 2, 4, 6, 8)
"""Sessions of the chat explorer: the pool a conversation needs grows with their number."""


def chat_capacity_explorer(model: Any, tok: Any, capacity: int = 400, sessions: int = 8,
                           turns: int = 4, built: dict | None = None, served: dict | None = None,
                           capacities: Sequence[int] = CHAT_CAPACITIES,
                           session_counts: Sequence[int] = CHAT_SESSIONS) -> Explorer:
    """``chat_capacity_widget`` for the page: chats of ``turns`` turns served by
    ``chat_capacity_run`` in each pool of ``capacities`` for each number of sessions of
    ``session_counts``: the hit rate of each turn. Every output of every state is checked
    against the request generated alone, and a state that differs stops the build.

    All states serve parts of one chat (``chat_workload``: the largest one, from ``built``
    when it is there), so the answers are generated once, and each request is generated
    alone once however many states serve it; ``served``: as ``serve_with_cache`` takes it.
    """
    built = {} if built is None else built
    counts = sorted(session_counts)
    chat_workload(model, tok, counts[-1], turns, built)  # every state is a part of this one

    def draw(capacity: int, sessions: int) -> Frame:
        run = _checked_chat_run(model, tok, capacity, sessions, turns, built, served)
        numbers = dict(zip(run.table.columns, run.hit_rates))
        return Frame([run.table], {**numbers, "requests checked": run.requests},
                     caption=f"{sessions} session{'s' * (sessions != 1)} x {turns} turns "
                             f"({run.requests} requests) in {capacity} tokens: "
                             f"{run.hit_rates[-1]:.1%} of prompt tokens hit.")

    return explorer(draw, [("capacity", "KV capacity (tokens)", sorted(capacities), capacity),
                           ("sessions", "sessions", counts, sessions)],
                    live=lambda: chat_capacity_widget(model, tok, capacity, sessions, turns,
                                                      built))
