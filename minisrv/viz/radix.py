"""Graphviz drawings of the radix cache, and a widget that replays its event log.

A ``RadixCache(record=True)`` keeps, for every operation, what it touched and a snapshot
of the tree afterwards (``TreeEvent``). ``to_graphviz`` draws one such state: each box is a
node with its edge's text (decoded when a tokenizer is given), its token count, its lock
count and its last access on the cache's logical clock. The event decides the colours: the
path just matched, nodes just split or inserted, and ghosts of nodes just evicted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import graphviz
import pandas as pd

from minisrv.radix import NodeView, RadixCache, TreeEvent
from minisrv.viz.roofline import BookFigure
from minisrv.workloads import Workload

__all__ = [
    "to_graphviz",
    "edge_text",
    "event_caption",
    "event_widget",
    "COLORS",
    "serve_with_cache",
    "serve_step",
    "ServedRequest",
    "request_hit_rate",
    "cache_comparison",
    "per_turn_hit_rates",
    "capacity_sweep",
    "plot_capacity_sweep",
    "chat_capacity_report",
    "chat_capacity_widget",
]

COLORS = {
    "path": "#cfe2ff",  # walked by the last match or insert
    "split": "#ffd8a8",  # created by cutting an edge
    "inserted": "#c3f0c8",  # new leaf
    "locked": "#495057",  # border of nodes in use by running requests
    "ghost": "#adb5bd",  # just evicted
}
MAX_LINE = 18  # characters per line of a node's text
MAX_LINES = 3


def edge_text(key: Sequence[int], tokenizer: Any = None) -> str:
    """The edge's tokens as readable text: decoded (newlines shown as ⏎) or as ids."""
    if tokenizer is None:
        text = " ".join(str(t) for t in key)
    else:
        text = "".join(tokenizer.id_to_str(t) for t in key).replace("\n", "⏎")
    lines = [text[i:i + MAX_LINE] for i in range(0, len(text), MAX_LINE)] or [""]
    if len(lines) > MAX_LINES:
        lines = lines[:MAX_LINES - 1] + ["…" + lines[-1][-(MAX_LINE - 1):]]
    return "\n".join(lines).replace("\\", "\\\\").replace('"', '\\"')


def _label(view: NodeView, tokenizer: Any) -> str:
    if view.parent is None:
        return "root"
    return (f"{edge_text(view.key, tokenizer)}\n"
            f"{len(view.key)} tok · lock {view.lock_ref} · t={view.last_access}")


def to_graphviz(
    tree: RadixCache | TreeEvent | Sequence[NodeView],
    tokenizer: Any = None,
    event: TreeEvent | None = None,
    title: str | None = None,
    since: int | None = None,
) -> graphviz.Digraph:
    """Draw a radix tree: a live cache, a recorded event's tree, or a snapshot.

    Args:
        tree: a ``RadixCache`` (drawn as it is now, coloured by its last recorded event if
            it keeps a log), a ``TreeEvent`` (the tree right after that operation), or a
            tuple of ``NodeView`` from ``RadixCache.snapshot()``.
        tokenizer: decodes each edge's tokens; without it the token ids are shown.
        event: the operation whose effects to colour (defaults as described above).
        title: caption under the drawing; defaults to ``event_caption(event)``.
        since: with a live ``RadixCache``, colour the effects of every event recorded from
            ``tree.events[since]`` on (e.g. everything one request did), not just the last.

    Returns:
        A ``graphviz.Digraph``; Jupyter renders it as SVG.
    """
    events: Sequence[TreeEvent] = ()
    if isinstance(tree, TreeEvent):
        views: Sequence[NodeView] = tree.tree
        events = (tree if event is None else event,)
    elif isinstance(tree, RadixCache):
        views = tree.snapshot()
        if event is not None:
            events = (event,)
        elif since is not None:
            events = tree.events[since:]
        elif tree.events:
            events = tree.events[-1:]
    else:
        views = tree
        events = () if event is None else (event,)
    path = {i for e in events for i in e.path}
    split = {i for e in events for i in e.split}
    inserted = {i for e in events for i in e.inserted}
    ghosts = [g for e in events for g in e.evicted]
    if title is None and len(events) == 1:
        title = event_caption(events[0])

    dot = graphviz.Digraph(graph_attr={"rankdir": "TB", "fontname": "Helvetica",
                                       "fontsize": "11"},
                           node_attr={"shape": "box", "style": "rounded,filled",
                                      "fillcolor": "white", "fontname": "Helvetica",
                                      "fontsize": "10"},
                           edge_attr={"arrowsize": "0.6"})
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


def event_caption(event: TreeEvent) -> str:
    """One line saying what the operation did, e.g. ``"t=3 · A: insert · 17 cached, +1 leaf"``."""
    who = f"{event.label}: " if event.label else ""
    if event.op == "match":
        what = f"matched {event.length} tokens"
    elif event.op == "insert":
        what = f"{event.length} tokens already cached"
    elif event.op == "evict":
        what = f"freed {event.length} tokens ({len(event.evicted)} nodes)"
    else:
        what = f"{event.length} tokens on the path"
    extras = []
    if event.split:
        extras.append(f"{len(event.split)} split")
    if event.inserted:
        extras.append(f"+{len(event.inserted)} leaf")
    tail = f" ({', '.join(extras)})" if extras else ""
    return f"t={event.step} · {who}{event.op}: {what}{tail}"


def event_widget(events: Sequence[TreeEvent], tokenizer: Any = None, start: int | None = None):
    """A slider over ``events`` that redraws the tree after each one. Needs a live kernel;
    draw ``to_graphviz(events[start])`` above it as the static face."""
    import ipywidgets as widgets
    from IPython.display import display

    if not events:
        raise ValueError("event_widget needs at least one recorded event")
    last = len(events) - 1
    slider = widgets.IntSlider(value=last if start is None else start, min=0, max=last,
                               description="event", continuous_update=False)

    def redraw(i: int) -> None:
        display(to_graphviz(events[i], tokenizer=tokenizer))

    output = widgets.interactive_output(redraw, {"i": slider})
    return widgets.VBox([slider, output])


# ------------------------------------------------------------------------ experiments
def serve_with_cache(model: Any, workload: Workload, cache: str, kv_capacity: int = 4000,
                     max_running: int = 8, policy: str = "fcfs"):
    """Replay ``workload`` on a fresh engine with ``cache`` ("radix" or "none");
    returns ``(engine, RunResult)``."""
    from minisrv.engine import Engine

    engine = Engine(model, kv_capacity=kv_capacity, max_running=max_running, cache=cache,
                    policy=policy)
    return engine, engine.run_workload(workload)


class ServedRequest(NamedTuple):
    """What serving one request did to the cache (for the walk-through's captions)."""

    prompt_len: int  # tokens in its prompt
    cached: int  # of those, found in the cache
    evicted: int  # tokens evicted to make room for it
    output: list[int]  # the generated ids
    first_event: int  # index of its first event in the tree's log


def serve_step(engine: Any, prompt: Sequence[int], max_new_tokens: int) -> ServedRequest:
    """Serve one request alone on ``engine`` (built with ``cache="radix", record_tree=True``)
    and report how much of its prompt hit and how much the cache evicted for it."""
    tree = engine.tree
    first = len(tree.events)
    cached = engine.stats.cached_tokens
    output = engine.generate([list(prompt)], max_new_tokens)[0]
    evicted = sum(e.length for e in tree.events[first:] if e.op == "evict")
    return ServedRequest(len(prompt), engine.stats.cached_tokens - cached, evicted, output,
                         first)


def request_hit_rate(reqs: Sequence[Any]) -> float:
    """Cached prompt tokens over all prompt tokens (the notes' definition)."""
    total = sum(req.prompt_len for req in reqs)
    return sum(req.cached_prompt_tokens for req in reqs) / total if total else 0.0


def cache_comparison(model: Any, workloads: Mapping[str, Workload], kv_capacity: int = 4000,
                     max_running: int = 8) -> pd.DataFrame:
    """Each workload served twice, without and with the radix cache: prompt tokens, tokens
    prefilled each way, the hit rate, and whether every output is the same both ways."""
    rows = []
    for name, workload in workloads.items():
        plain_engine, plain = serve_with_cache(model, workload, "none", kv_capacity,
                                               max_running)
        radix_engine, radix = serve_with_cache(model, workload, "radix", kv_capacity,
                                               max_running)
        same = all(a.output == b.output for a, b in zip(plain.requests, radix.requests))
        prompt_tokens = sum(workload.prompt_lens)
        rows.append({
            "workload": name,
            "requests": len(workload),
            "prompt tokens": prompt_tokens,
            "prefilled, no cache": plain_engine.stats.prefill_tokens,
            "prefilled, radix": radix_engine.stats.prefill_tokens,
            "hit rate": round(request_hit_rate(radix.requests), 3),
            "outputs identical": same,
        })
    return pd.DataFrame(rows).set_index("workload")


def per_turn_hit_rates(reqs: Sequence[Any], n_sessions: int) -> list[float]:
    """Hit rate of each turn of ``chat_sessions_workload`` (request ``i`` is turn
    ``i // n_sessions``)."""
    turns = [reqs[t:t + n_sessions] for t in range(0, len(reqs), n_sessions)]
    return [request_hit_rate(turn) for turn in turns]


def capacity_sweep(model: Any, workload: Workload, capacities: Sequence[int],
                   max_running: int = 8, progress: bool = True) -> pd.DataFrame:
    """Hit rate and tokens prefilled when ``workload`` runs with each KV pool size
    (``progress``: a tqdm bar over the pool sizes)."""
    from tqdm.auto import tqdm

    rows = []
    for capacity in tqdm(capacities, desc="pool sizes", leave=False, disable=not progress):
        engine, run = serve_with_cache(model, workload, "radix", capacity, max_running)
        rows.append({"kv capacity": capacity, "hit rate": round(request_hit_rate(run.requests), 3),
                     "prefilled": engine.stats.prefill_tokens,
                     "retractions": engine.stats.retractions})
    return pd.DataFrame(rows).set_index("kv capacity")


def plot_capacity_sweep(sweep: pd.DataFrame, title: str = "") -> BookFigure:
    """Hit rate against KV pool size (one point per run of ``capacity_sweep``)."""
    fig = BookFigure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    ax.plot(sweep.index, 100 * sweep["hit rate"], marker="o", label="radix cache, LRU")
    ax.set_xlabel("KV pool capacity (tokens)")
    ax.set_ylabel("hit rate (% of prompt tokens)")
    ax.set_ylim(0, 100)
    ax.set_title(title or "Keeping chat history: hit rate against pool size")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def chat_capacity_report(model: Any, tok: Any, capacity: int = 400, sessions: int = 8,
                         turns: int = 4, built: dict | None = None) -> pd.DataFrame:
    """Build ``sessions`` chats of ``turns`` turns, serve them with the radix cache in a pool
    of ``capacity`` tokens, and tabulate the hit rate of each turn and overall.

    ``built`` maps ``(sessions, turns)`` to workloads already built (generating the chats'
    answers is the slow part); new ones are added to it.
    """
    from minisrv.workloads import chat_sessions_workload

    built = {} if built is None else built
    if (sessions, turns) not in built:
        built[sessions, turns] = chat_sessions_workload(model, tok, sessions, turns)
    _, run = serve_with_cache(model, built[sessions, turns], "radix", capacity)
    rates = per_turn_hit_rates(run.requests, sessions) + [request_hit_rate(run.requests)]
    labels = [f"turn {t + 1}" for t in range(turns)] + ["all turns"]
    return pd.DataFrame({"hit rate": [f"{r:.1%}" for r in rates]}, index=labels).T


def chat_capacity_widget(model: Any, tok: Any, capacity: int = 400, sessions: int = 8,
                         turns: int = 4, built: dict | None = None):
    """Sliders for pool size, sessions and turns; each change rebuilds and serves the chats
    and shows ``chat_capacity_report`` (``built``: as there). Needs a live kernel."""
    import ipywidgets as widgets
    from IPython.display import display

    built = {} if built is None else built
    style = {"description_width": "initial"}
    controls = {
        "capacity": widgets.IntSlider(value=capacity, min=250, max=2000, step=50,
                                      description="KV capacity (tokens)", style=style,
                                      continuous_update=False),
        "sessions": widgets.IntSlider(value=sessions, min=1, max=12, description="sessions",
                                      continuous_update=False),
        "turns": widgets.IntSlider(value=turns, min=1, max=5, description="turns",
                                   continuous_update=False),
    }

    def redraw(capacity: int, sessions: int, turns: int) -> None:
        display(chat_capacity_report(model, tok, capacity, sessions, turns, built))

    output = widgets.interactive_output(redraw, controls)
    return widgets.VBox([widgets.HBox(list(controls.values())), output])
