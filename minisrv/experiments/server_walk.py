"""The server chapter's walk of one request, as tables: the server-sent events that carried
its text (``sse_frame``, from ``server.stream_completion``), the radix-tree operations it
caused (``tree_event_frame``) and the nodes, with their KV slots, that hold its tokens after it
finished (``tree_path_frame``). Nodes are named by their text, ``<bos>`` spelled out, and
KV slots are written as runs of consecutive numbers (``slot_ranges``). ``timed_steps`` stamps
the engine's steps by the wall clock, ``first_token_parts`` sets them beside the events and
``queue_and_prefill`` splits a load's first tokens by them; ``warm_up`` runs prompts once
untimed. ``layout_hit_rates`` feeds data-parallel layouts of engines outside HTTP and reads
their prefix-cache hit rates."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pandas as pd

__all__ = ["first_token_parts", "layout_hit_rates", "queue_and_prefill", "slot_ranges",
           "sse_frame", "timed_steps", "tree_event_frame", "tree_path_frame", "warm_up"]


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


def queue_and_prefill(reqs: Sequence[Any], trace: Sequence[Any],
                      stamps: dict[int, tuple[float, float]]) -> dict[str, float]:
    """Where the first tokens of a load went, by ``timed_steps``' stamps: for each of ``reqs``
    (finished requests of a CityLM engine, whose clock counts steps) the wall-clock time of the
    steps that ran while it waited in the queue (from the start of the step its arrival is
    stamped with, the one running when it arrived or the next, to the start of its prefill
    step) and that of its prefill step, both in ms and averaged over the requests; with the
    mean number of requests, and of prompt tokens computed, in those prefill steps. What a TTFT
    holds besides these is the way in and out of the engine: the connection, the encoding, the
    event's way back (less the part of a running step before the request arrived, which the
    queue time counts). Raises ``ValueError`` if a step the requests waited through is unstamped."""
    by_start = {s.start: s for s in trace}
    queue, prefill, batch, tokens = [], [], [], []
    for r in reqs:
        own = by_start[r.admitted_at]  # its prefill step
        waited = [s for s in trace if r.arrival <= s.start < r.admitted_at]
        if not {s.index for s in (*waited, own)} <= stamps.keys():
            raise ValueError(f"request r{r.rid}: a step it waited through is unstamped")
        began = stamps[waited[0].index][0] if waited else stamps[own.index][0]
        queue.append((stamps[own.index][0] - began) * 1e3)
        prefill.append((stamps[own.index][1] - stamps[own.index][0]) * 1e3)
        batch.append(len(own.prefill))
        tokens.append(own.prefill_tokens)
    return {"queue": statistics.fmean(queue), "prefill": statistics.fmean(prefill),
            "prefill batch": statistics.fmean(batch),
            "prefill tokens": statistics.fmean(tokens)}


def warm_up(model: Any, prompts: Sequence[Sequence[int]], **engine_kwargs: Any) -> Any:
    """Generate one token for each of ``prompts``, the second arriving a step after the first
    (as a request that finds the first's prefix cached), on an engine of its own with a radix
    cache: oneDNN prepares a kernel for each new matrix shape on its first use, so a later
    timed run of the same prompts times steady-state steps. Returns the engine."""
    from minisrv import Engine

    engine = Engine(model, cache="radix", **{"kv_capacity": 2000, "max_running": 8,
                                             **engine_kwargs})
    engine.generate([list(p) for p in prompts], [1] * len(prompts),
                    arrival_steps=list(range(len(prompts))))
    return engine


def layout_hit_rates(model: Any, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                     layouts: dict[str, tuple[Sequence[Sequence[int]], int]],
                     patterns: dict[str, int], slots_per_place: int = 125,
                     served: dict[tuple[str, str], list[list[int]]] | None = None,
                     ) -> tuple[pd.DataFrame, dict[tuple[str, str], list[Any]]]:
    """Feed data-parallel layouts outside HTTP, so that the order requests reach the steps is
    fixed. A layout is ``(parts, places)``: one fresh radix-cache engine per part (the indices
    of the requests its worker receives), each with ``places`` running slots (``max_running``) and
    ``slots_per_place`` KV slots a place. A pattern is a gap: request ``i`` arrives at step
    ``gap * i`` (0, all at once). Returns the hit rates (share of the prompt tokens found in
    the cache over a layout's engines; one row per pattern, one column per layout) and the
    engines, by ``(pattern, layout)``. ``served``, if given, receives each run's outputs in
    request order, by ``(pattern, layout)``, for the check against each request alone."""
    from minisrv import Engine

    fed: dict[tuple[str, str], list[Any]] = {}
    for pattern, gap in patterns.items():
        for name, (parts, places) in layouts.items():
            engines = [Engine(model, kv_capacity=slots_per_place * places, max_running=places,
                              cache="radix") for _ in parts]
            outputs: dict[int, list[int]] = {}
            for engine, indices in zip(engines, parts):
                got = engine.generate([list(prompts[i]) for i in indices],
                                      [max_tokens[i] for i in indices],
                                      arrival_steps=[gap * i for i in indices])
                outputs.update(zip(indices, got))
            fed[pattern, name] = engines
            if served is not None:
                served[pattern, name] = [outputs[i] for i in sorted(outputs)]
    hits = pd.DataFrame({name: [sum(e.stats.cached_prompt_tokens for e in fed[p, name])
                                / sum(e.stats.prompt_tokens for e in fed[p, name])
                                for p in patterns] for name in layouts}, index=list(patterns))
    return hits, fed


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
