"""The server chapter's walk of one request, as tables: the server-sent events that carried
its text (``sse_frame``, from ``server.stream_completion``), the radix-tree operations it
caused (``tree_event_frame``) and the nodes, with their KV slots, that hold its tokens after it
finished (``tree_path_frame``). Nodes are named by their text, ``<bos>`` spelled out, and
KV slots are written as runs of consecutive numbers (``slot_ranges``). ``timed_steps`` stamps
the engine's steps by the wall clock, and ``first_token_parts`` sets them beside the events."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pandas as pd

__all__ = ["first_token_parts", "slot_ranges", "sse_frame", "timed_steps", "tree_event_frame",
           "tree_path_frame"]


def slot_ranges(slots: Sequence[int]) -> str:
    """KV slots as runs of consecutive numbers, ``"0-31, 40-49"``: how a request's KV lies
    in the pool (one run per allocation, unless the pool was fragmented)."""
    runs: list[list[int]] = []
    for slot in slots:
        if runs and slot == runs[-1][1] + 1:
            runs[-1][1] = slot
        else:
            runs.append([slot, slot])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def sse_frame(events: Sequence[tuple[float, Any]]) -> pd.DataFrame:
    """``stream_completion``'s events as a table, one row per chunk: its arrival (ms) and its
    text, quoted (``repr``) so that a space or an empty text shows; ``[DONE]`` is left out.

    A chunk without choices (a usage-only chunk) has the empty text."""
    rows = [{"t (ms)": round(t, 1), "text": repr(c["choices"][0]["text"] if c["choices"] else "")}
            for t, c in events if c != "[DONE]"]
    return pd.DataFrame(rows, columns=["t (ms)", "text"])


@contextmanager
def timed_steps(engine: Any) -> Iterator[dict[int, tuple[float, float]]]:
    """While the block runs, stamp each ``engine.step`` by the wall clock: trace index ->
    ``time.perf_counter()`` before and after the step. On CityLM the engine's own clock counts
    steps; these stamps, read in the engine thread of a server in this process, share the
    clock of ``stream_completion``'s ``sent``. Needs ``record_trace`` and the blocking loop
    (one trace record per step)."""
    stamps: dict[int, tuple[float, float]] = {}
    step = engine.step

    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        out = step(*args, **kwargs)
        stamps[engine.trace[-1].index] = (began, time.perf_counter())
        return out

    engine.step = timed  # the engine loop looks the method up at each step
    try:
        yield stamps
    finally:
        del engine.step  # the class's method again


def first_token_parts(sse: Any, stamps: dict[int, tuple[float, float]],
                      steps: Sequence[int]) -> dict[str, float]:
    """Milliseconds of one streamed request's life, from ``stream_completion``'s ``sse`` (its
    ``sent``), ``timed_steps``' ``stamps`` and ``steps``, the trace indices of the steps that
    computed its tokens (the prefill first), one per token event: until the prefill step began
    (the connection, the handler, the engine thread taking the request), the prefill step, from
    its end to the first event's arrival, and for the later tokens the median decode step and
    the median and longest time from a step's end to its event's arrival."""
    events = [t for t, c in sse if c != "[DONE]" and c["choices"] and c["choices"][0]["text"]]
    if len(events) != len(steps) or not set(steps) <= stamps.keys():
        raise ValueError(f"{len(events)} token events, {len(steps)} steps, "
                         f"{len(set(steps) - stamps.keys())} of them unstamped")
    ms = [((stamps[s][0] - sse.sent) * 1e3, (stamps[s][1] - sse.sent) * 1e3) for s in steps]
    lags = [t - end for t, (_, end) in zip(events[1:], ms[1:])]
    return {"to prefill": ms[0][0], "prefill": ms[0][1] - ms[0][0],
            "to first event": events[0] - ms[0][1],
            "decode step": statistics.median(b - a for a, b in ms[1:]),
            "step to event": statistics.median(lags), "step to event, longest": max(lags)}


def _node_text(tree: Any, tok: Any, node_id: int) -> str:
    """A node's tokens as quoted text, special tokens (``<bos>``) spelled out, so that its
    text has as many symbols as a CityLM node has tokens."""
    node = next(n for n in tree.nodes() if n.id == node_id)
    return repr(tok.decode(list(node.key), skip_special=False))


def tree_event_frame(events: Sequence[Any], tree: Any, tok: Any) -> pd.DataFrame:
    """One row per radix-tree operation (``TreeEvent``s from a ``RadixCache.listener``): the
    node it ended at (``path to``, by its text in ``tree`` now), the tokens on the path to it,
    for an insert the tokens it found already cached, and the node it split off and the leaf
    it added (empty where none).

    ``tree`` is read when the table is made: a node split later shows its text after the split."""
    lengths = {n.id: len(n.key) for n in tree.nodes()}

    def text(ids: Sequence[int]) -> str:
        return _node_text(tree, tok, ids[-1]) if ids else ""

    return pd.DataFrame([{"operation": e.op, "path to": text(e.path),
                          "tokens": sum(lengths[n] for n in e.path),
                          "already cached": e.length if e.op == "insert" else "",
                          "split off": text(e.split), "new leaf": text(e.inserted)}
                         for e in events])


def tree_path_frame(path: Sequence[int], tree: Any, tok: Any) -> pd.DataFrame:
    """The nodes of a path of ``tree`` (node ids, root side first), one row each: its id, its
    token count, its text and the KV slots that hold its tokens (``slot_ranges``)."""
    nodes = {n.id: n for n in tree.nodes()}
    return pd.DataFrame([{"node": i, "tokens": len(nodes[i].key),
                          "text": _node_text(tree, tok, i),
                          "KV slots": slot_ranges(nodes[i].value)} for i in path])
