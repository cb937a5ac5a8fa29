"""The server chapter's walk of one request, as tables: the server-sent events that carried
its text (``stream_completion`` sends it and times them, ``sse_frame`` tabulates them), the
radix-tree operations it caused (``tree_event_frame``) and the nodes, with their KV slots, that
hold its tokens after it finished (``tree_path_frame``). Nodes are named by their text,
``<bos>`` spelled out, and KV slots are written as runs of consecutive numbers
(``slot_ranges``). ``timed_steps`` stamps the engine's steps by the wall clock; ``ttft_parts``
splits a first token's time by them and by the moment the engine loop took the request
(``first_token_parts`` for the walk, ``ttft_split`` for a load's requests), and
``step_frame`` / ``step_totals`` tabulate a run's steps; ``warm_up`` runs prompts once
untimed; ``first_event_runs`` sends one streamed request again and again and times its first
two events against its steps. ``layout_hit_rates`` feeds data-parallel layouts of engines
outside HTTP and reads their prefix-cache hit rates."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import pandas as pd

__all__ = ["EventStream", "LayoutRuns", "first_event_runs", "open_server", "first_token_parts",
           "layout_hit_rates", "slot_ranges", "sse_frame", "step_frame", "step_totals",
           "stream_completion", "timed_steps", "tree_event_frame", "tree_path_frame",
           "ttft_parts", "ttft_split", "warm_up"]


@contextmanager
def open_server(layout: Any, startup_s: float = 120.0) -> Iterator[tuple[str, Any]]:
    """Serve ``layout`` (a ``server.Layout``: its options name the model) on a free local
    port; yield ``(base URL, engines)`` (a ``LocalEngine``, whose ``loop.engine`` is the engine, or
    ``DataParallelEngines``).
    The server and its workers are always stopped on exit."""
    from minisrv.server.app import create_app
    from minisrv.server.config import check_engine_options, model_name
    from minisrv.server.dataparallel import DataParallelEngines
    from minisrv.server.launch import serving_app
    from minisrv.server.worker import LocalEngine
    from minisrv.sim.served import sim_config, simulated_pace
    from minisrv.tokenizer import load_tokenizer

    options = layout.options
    check_engine_options(options)
    simulated = simulated_pace(options.model) is not None
    if simulated:  # the simulated H100 (minisrv.sim.served)
        options = sim_config(options)
    engines: Any
    if layout.dp == 1 and not layout.engine_process:
        engines = LocalEngine(options)
    else:
        engines = DataParallelEngines(options, layout.dp, {})
    codec = load_tokenizer("citylm" if simulated else options.model)  # sim: CityLM's letters
    app = create_app(engines, codec, model_name(options.model))
    with serving_app(app, startup_s) as url:
        yield url, engines


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


class EventStream(list):
    """``stream_completion``'s events; ``sent`` is the ``time.perf_counter()`` reading when the
    request was sent, so that other clocks of this process (``timed_steps``, ``Req.taken_at``)
    can be set beside the events."""

    sent: float = math.nan


def stream_completion(url: str, body: Mapping[str, Any]) -> EventStream:
    """POST ``body`` (with ``stream: true``) to ``/v1/completions``; return every event's
    arrival in milliseconds after the request was sent, with its parsed chunk (``"[DONE]"``
    for the last event), as an ``EventStream``.

    The clock starts once the client exists: building an ``httpx.Client`` (its TLS context)
    takes tens of milliseconds, a cost of the client that no server-side step explains."""
    import httpx

    events = EventStream()
    with httpx.Client(timeout=60) as client:
        start = events.sent = time.perf_counter()
        with client.stream("POST", f"{url}/v1/completions",
                           json={**body, "stream": True}) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:200]!r}")
            for line in response.iter_lines():
                if line.startswith("data:"):
                    data = line[5:].strip()
                    chunk = data if data == "[DONE]" else json.loads(data)
                    events.append(((time.perf_counter() - start) * 1e3, chunk))
    return events


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


def ttft_parts(req: Any, step: tuple[float, float], sent: float,
               first_event: float) -> dict[str, float]:
    """One request's time to its first token in four parts, in ms, from ``time.perf_counter()``
    readings: ``sent`` (the client sent it), the moment a server's engine loop took it from its
    inbox (``req.taken_at``), its prefill step's start and end (``step``, from
    ``timed_steps``) and ``first_event`` (the client read its first token). To the engine: the
    connection, the handler that encodes the prompt, the hand-off to the engine thread.
    Queued: from there to its prefill step, the steps of other requests that ran meanwhile
    (none, if a running slot was free). The prefill step. To the client: the token handed to
    its handler, written as an event, read. The four add up to the TTFT. ValueError for a
    request no engine loop took."""
    if req.taken_at is None:
        raise ValueError(f"request r{req.rid} was not taken by a server's engine loop "
                         "(Req.taken_at is None)")
    began, ended = step
    return {"to engine": (req.taken_at - sent) * 1e3, "queued": (began - req.taken_at) * 1e3,
            "prefill": (ended - began) * 1e3, "to client": (first_event - ended) * 1e3}


def first_token_parts(sse: Any, stamps: dict[int, tuple[float, float]],
                      steps: Sequence[int], req: Any) -> dict[str, float]:
    """Milliseconds of one streamed request's life, from ``stream_completion``'s ``sse`` (its
    ``sent``), ``timed_steps``' ``stamps``, ``steps`` (the trace indices of the steps that
    computed its tokens, the prefill first, one per token event) and ``req`` (its ``taken_at``):
    its first token's ``ttft_parts``, and for the later tokens the median decode step and
    the median and longest time from a step's end to its event's arrival."""
    events = [t for t, c in sse if c != "[DONE]" and c["choices"] and c["choices"][0]["text"]]
    if len(events) != len(steps) or not set(steps) <= stamps.keys():
        raise ValueError(f"{len(events)} token events, {len(steps)} steps, "
                         f"{len(set(steps) - stamps.keys())} of them unstamped")
    ms = [((stamps[s][0] - sse.sent) * 1e3, (stamps[s][1] - sse.sent) * 1e3) for s in steps]
    lags = [t - end for t, (_, end) in zip(events[1:], ms[1:])]
    return {**ttft_parts(req, stamps[steps[0]], sse.sent, sse.sent + events[0] / 1e3),
            "decode step": statistics.median(b - a for a, b in ms[1:]),
            "step to event": statistics.median(lags), "step to event, longest": max(lags)}


def first_event_runs(layout: Any, body: Mapping[str, Any], runs: int
                     ) -> tuple[pd.DataFrame, list[str]]:
    """Send the streamed completion ``body`` ``runs`` times, one after another, to a server of
    its own (``layout``: one engine, in a thread of this process, with ``record_trace``), after
    one untimed send that puts its prompt in the radix tree, so that every timed run prefills
    the same token. Returns, per run (numbered from 1), in ms after its prefill step ended:
    the arrival of its first event, the end of the next step (its first decode step) and the
    arrival of its second event; and each run's streamed text.

    The first event's way to the client overlaps that next step, in the same process: how long
    it waits there for Python's lock, and so whether it arrives before the step ends or only
    with the second event, varies from run to run."""

    rows, texts = [], []
    with open_server(layout) as (url, engines):
        loop = engines.loop
        stream_completion(url, body)  # untimed: its prompt goes into the tree
        for _ in range(runs):
            with timed_steps(loop.engine) as stamps:
                sse = stream_completion(url, body)
            req = loop.finished[-1]  # the one request in flight, finished with its stream
            steps = [s.index for s in loop.engine.trace if req.rid in s.prefill
                     or req.rid in s.decode]
            events = [t for t, c in sse if c != "[DONE]" and c["choices"]
                      and c["choices"][0]["text"]]
            ended = (stamps[steps[0]][1] - sse.sent) * 1e3  # ms after the request was sent
            rows.append({"first event": events[0] - ended,
                         "next step ends": (stamps[steps[1]][1] - sse.sent) * 1e3 - ended,
                         "second event": events[1] - ended})
            texts.append("".join(c["choices"][0]["text"] for _, c in sse
                                 if c != "[DONE]" and c["choices"]))
    return pd.DataFrame(rows, index=pd.RangeIndex(1, runs + 1, name="run")), texts


def ttft_split(reqs: Sequence[Any], trace: Sequence[Any], stamps: dict[int, tuple[float, float]],
               sent: Sequence[float], first_events: Sequence[float]) -> dict[str, float]:
    """Where the first tokens of a load went: ``ttft_parts`` of each of ``reqs`` (finished
    requests of a CityLM engine, whose clock counts steps, so that a request's prefill step
    is the step of ``trace`` that started at its ``admitted_at``), sent at ``sent[i]`` and its
    first event read at ``first_events[i]``, averaged over the requests; with the mean number
    of requests, and of prompt tokens computed, in their prefill steps. The four parts add
    up to the mean TTFT. Raises ``ValueError`` if a prefill step is unstamped."""
    by_start = {s.start: s for s in trace}
    parts, batch, tokens = [], [], []
    for r, sent_at, read_at in zip(reqs, sent, first_events, strict=True):
        own = by_start[r.admitted_at]  # its prefill step
        if own.index not in stamps:
            raise ValueError(f"request r{r.rid}: its prefill step is unstamped")
        parts.append(ttft_parts(r, stamps[own.index], sent_at, read_at))
        batch.append(len(own.prefill))
        tokens.append(own.prefill_tokens)
    return {**{key: statistics.fmean(p[key] for p in parts) for key in parts[0]},
            "prefill batch": statistics.fmean(batch),
            "prefill tokens": statistics.fmean(tokens)}


def step_frame(trace: Sequence[Any], stamps: dict[int, tuple[float, float]]) -> pd.DataFrame:
    """The steps of ``trace`` that ``stamps`` holds, one row each: the requests it prefilled
    and the prompt tokens it computed for them, the requests it decoded, and its wall-clock
    duration (ms)."""
    return pd.DataFrame([{"step": s.index, "prefilled": len(s.prefill),
                          "prompt tokens": s.prefill_tokens, "decoded": len(s.decode),
                          "ms": (stamps[s.index][1] - stamps[s.index][0]) * 1e3}
                         for s in trace if s.index in stamps],
                        columns=["step", "prefilled", "prompt tokens", "decoded", "ms"]
                        ).set_index("step")


def step_totals(steps: pd.DataFrame) -> dict[str, float]:
    """A ``step_frame`` in a few numbers: its steps; the prompt tokens computed and the ms of
    the steps that prefilled; the steps that only decoded, the requests in each on average
    and their ms. What a run's throughput is made of: where its time went, and how many
    tokens each decode step yielded. Counts are ints, so a table of several runs keeps them
    so."""
    decode = steps[steps["prefilled"] == 0]
    return {"steps": len(steps), "prompt tokens computed": int(steps["prompt tokens"].sum()),
            "prefill steps (ms)": float(steps.loc[steps["prefilled"] > 0, "ms"].sum()),
            "decode steps": len(decode),
            "requests per decode step": float(decode["decoded"].mean()),
            "decode steps (ms)": float(decode["ms"].sum())}


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


class LayoutRuns(NamedTuple):
    """``layout_hit_rates``' result: ``hits``, the share of the prompt tokens found in the
    cache (one row per pattern, one column per layout); ``engines``, each run's engines, and
    ``outputs``, its outputs in request order (for the check against each request alone),
    both by ``(pattern, layout)``."""

    hits: pd.DataFrame
    engines: dict[tuple[str, str], list[Any]]
    outputs: dict[tuple[str, str], list[list[int]]]


def layout_hit_rates(model: Any, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                     layouts: dict[str, tuple[Sequence[Sequence[int]], int]],
                     patterns: dict[str, int], slots_per_place: int = 125) -> LayoutRuns:
    """Feed data-parallel layouts outside HTTP, so that the order requests reach the steps is
    fixed. A layout is ``(parts, places)``: one fresh radix-cache engine per part (the indices
    of the requests its worker receives), each with ``places`` running slots (``max_running``) and
    ``slots_per_place`` KV slots a place. A pattern is a gap: request ``i`` arrives at step
    ``gap * i`` (0, all at once). Returns the hit rates (share of the prompt tokens found in
    the cache over a layout's engines), each run's engines and its outputs (``LayoutRuns``)."""
    from minisrv import Engine

    fed: dict[tuple[str, str], list[Any]] = {}
    served: dict[tuple[str, str], list[list[int]]] = {}
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
            served[pattern, name] = [outputs[i] for i in sorted(outputs)]
    hits = pd.DataFrame({name: [sum(e.stats.cached_prompt_tokens for e in fed[p, name])
                                / sum(e.stats.prompt_tokens for e in fed[p, name])
                                for p in patterns] for name in layouts}, index=list(patterns))
    return LayoutRuns(hits, fed, served)


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
