"""The pages chapter's runs: what a page of KV costs (slots no token fills), what it buys (a
shorter table, longer runs of consecutive slots for the attention kernel to load), what it
loses (prefix hits cut to whole pages), the radix tree beside vLLM's block-hash cache, with
every piece the prefix cache evicts logged. Retraction at those pages is
``minisrv.experiments.page_preemption``'s; the pool read mid-run and the eviction trace are
``minisrv.experiments.page_pool``'s.

Each function builds fresh engines, serves a workload and returns plain results (named
tuples, DataFrames); ``minisrv.viz.pages`` only draws them. Every CityLM run keeps its
outputs so that the chapter checks each against the request generated alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from minisrv.configs import LLAMA3_8B, ModelConfig
from minisrv.engine import Engine
from minisrv.experiments.radix import chat_workload
from minisrv.kv.blocks import BlockCache
from minisrv.metrics import summarize
from minisrv.runner.attention.splits import DECODE_BLOCK_N
from minisrv.sampling import SamplingParams
from minisrv.workloads import Workload

__all__ = [
    "BLOCK_SIZE", "CACHE_SETTINGS", "Eviction", "KEY_TILE", "KEY_TILES", "PAGE_SIZES",
    "PageRun", "TRACE_SETTINGS", "TraceHits", "empty_slots_by_pool",
    "first_chats", "first_requests", "hit_table", "index_bytes", "key_runs", "occupancy_table",
    "page_run", "served_runs", "table_sizes",
    "tile_runs", "trace_hits",
]

PAGE_SIZES = (1, 4, 16, 64)
"""The page sizes the chapter compares: SGLang's default (1), two between, and the 64 that
SGLang forces for FlashMLA and TRT-LLM's kernels."""

BLOCK_SIZE = 16
"""vLLM's default block: the page size its block-hash prefix cache is compared at."""

KEY_TILE = DECODE_BLOCK_N
"""Key positions the Triton decode kernel loads at a time."""

KEY_TILES = (KEY_TILE, 128)
"""The tiles ``page_run`` counts runs of consecutive slots in: minisrv's decode kernel's, and
the 128 keys of the Hopper attention kernels' tile at head dimension 128."""


class Eviction(NamedTuple):
    """One piece of a cached prefix that the prefix cache dropped for room: a radix-tree node
    or a block, read from the cache just before it went."""

    step: int  # the step (counted from 1) whose allocation needed the room
    short: int  # slots that allocation asked the cache to free
    tokens: tuple[int, ...]  # the cached prefix up to the piece's end
    start: int  # where the piece begins in ``tokens`` (it ends at their end)


class PageRun(NamedTuple):
    """One serving run at one page size, with what the allocator held at every step."""

    page_size: int
    cache: str
    hit_rate: float  # prompt tokens found in the prefix cache at first admission / all
    prefill_tokens: int  # prompt tokens computed (recomputations after retraction included)
    waste: float  # slots handed out that hold no token / slots handed out, over all steps
    wasted_per_request: float  # mean empty slots per running request
    mean_batch: float  # requests computing a token per step, on average
    retractions: int
    wasted_tokens: int  # KV thrown away by retractions
    cached_prompt: list[int]  # per request: prompt tokens found in the cache at admission
    outputs: list[list[int]]  # per request, in workload order
    throughput: float  # output tokens per step (CityLM) or per second (simulated GPU)
    loaded_tokens: int  # host tier: prompt tokens copied back instead of computed
    tile_runs: dict[int, list[int]]  # by tile width: runs of consecutive slots per full tile
    # of key positions (``page_run``'s ``tile_every``)
    evictions: list[Eviction]  # every piece the prefix cache evicted, in order
    admitted: list[int]  # per request: the step (from 1) of its first prefill


def first_requests(workload: Workload, n: int) -> Workload:
    """The first ``n`` requests of ``workload``, arrivals unchanged."""
    return Workload(workload.name, workload.prompts[:n], workload.output_lens[:n],
                    workload.arrivals[:n], f"the first {n} requests of {workload.name}")


def first_chats(chat: Workload, sessions: int, keep: int, turns: int) -> Workload:
    """The first ``turns`` turns of the first ``keep`` sessions of ``chat``, a chat of
    ``sessions`` sessions in ``chat_sessions_workload``'s order (request ``i`` is turn
    ``i // sessions`` of session ``i % sessions``): its answers reused, not generated again."""
    built = {(sessions, len(chat.prompts) // sessions): chat}
    return chat_workload(None, None, keep, turns, built)


def _empty_slots(engine: Engine) -> tuple[int, int]:
    """(slots handed out that hold no token, requests holding KV) right now, read from the
    allocator: every slot it has handed out is a cached prefix's (whole pages, all full) or
    a running request's; what the request's tokens past its cached prefix do not fill is
    the empty end of its last page."""
    memory = engine.scheduler.memory
    holders = [*engine.scheduler.queues.running, *engine.scheduler.queues.finishing]
    own = sum(req.kv_len - req.cached_len for req in holders)
    return memory.kv.used_count - memory.tree.total_size() - own, len(holders)


def _log_evictions(engine: Engine, log: list[Eviction], step: Any) -> None:
    """Record in ``log`` every piece ``engine``'s prefix cache evicts, in the order it goes:
    the cache's own step that drops one piece (the block cache's ``_forget``, the tree's
    ``_remove_leaf``) is wrapped on this instance to read the piece's prefix first, and
    ``evict`` to know how many slots the allocation asked for. ``step()``: the current step."""
    cache = engine.scheduler.memory.tree
    name = "_forget" if isinstance(cache, BlockCache) else "_remove_leaf"
    remove, evict = getattr(cache, name), cache.evict
    short = [0]

    def logged_evict(n_tokens: int, *, tag: str = "") -> int:
        short[0] = n_tokens
        return evict(n_tokens, tag=tag)

    def logged_remove(piece: Any) -> None:
        tokens = cache.prefix_of(piece)
        log.append(Eviction(step(), short[0], tokens, len(tokens) - len(piece.key)))
        remove(piece)

    cache.evict = logged_evict
    setattr(cache, name, logged_remove)


def page_run(backend: Any, workload: Workload, page_size: int, cache: str = "none",
             tile_every: int | None = None, **options: Any) -> PageRun:
    """Serve ``workload`` on ``backend`` (CityLM or a ``SimBackend``) with pages of
    ``page_size`` tokens; ``options`` are ``EngineConfig``'s (``kv_capacity``,
    ``max_running``, ...). After every step the allocator is read (``_empty_slots``), and
    each reading is weighted by the step's duration. Every ``tile_every`` steps (default:
    every step on CityLM, every 16th on the simulated GPU, whose long rows make counting
    costly; 0: never) the table's rows are cut into tiles of ``KEY_TILES`` and their runs
    counted; the table is minisrv's own whatever computes the tokens. Every piece the
    prefix cache evicts is logged (``Eviction``)."""
    engine = Engine(backend, page_size=page_size, cache=cache, **options)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in workload.output_lens]
    reqs = engine.make_requests(workload.prompts, None, params, workload.arrivals)
    for req in reqs:
        engine.add_request(req)
    empty = held = holders = 0.0
    table = engine.scheduler.memory.table
    if tile_every is None:
        tile_every = 1 if getattr(table, "tensor", None) is not None else 16
    tiles: dict[int, list[int]] = {tile: [] for tile in KEY_TILES}
    steps = 0
    evictions: list[Eviction] = []
    if cache != "none":
        _log_evictions(engine, evictions, lambda: steps + 1)
    admitted: dict[int, int] = {}
    while (out := engine.step()).record is not None:
        steps += 1
        for rid in out.record.prefill:
            admitted.setdefault(rid, steps)
        slots, n = _empty_slots(engine)
        weight = out.record.duration
        empty += weight * slots
        held += weight * engine.scheduler.memory.kv.used_count
        holders += weight * n
        if tile_every and steps % tile_every == 0:
            running = engine.scheduler.queues.running
            _count_tiles([table.slots(req, 0, req.kv_len) for req in running], tiles)
    metrics = summarize(reqs, engine.trace, engine.max_running)
    stats = engine.stats
    return PageRun(page_size, cache, stats.hit_rate, stats.prefill_tokens,
                   empty / held if held else 0.0, empty / holders if holders else 0.0,
                   metrics.mean_batch, stats.retractions, stats.wasted_tokens,
                   [req.cached_prompt_tokens for req in reqs], [list(r.output) for r in reqs],
                   metrics.throughput, stats.loaded_tokens, tiles, evictions,
                   [admitted[req.rid] for req in reqs])


def occupancy_table(runs: Mapping[int, PageRun], kv_capacity: int) -> pd.DataFrame:
    """One row per page size: the share of handed-out slots that hold no token, the empty
    slots per running request, the mean batch in a pool of ``kv_capacity`` tokens and the
    throughput (whole tokens per second), from ``page_run``'s readings."""
    rows = {size: {"empty slots (%)": 100 * run.waste,
                   "empty per request": run.wasted_per_request,
                   "mean batch": run.mean_batch,
                   "retractions": run.retractions,
                   "throughput (tok/s)": round(run.throughput)}
            for size, run in sorted(runs.items())}
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = f"page size (pool {kv_capacity:,} tokens)"
    return table


def table_sizes(cfg: ModelConfig = LLAMA3_8B, rows: int = 64,
                page_sizes: Sequence[int] = PAGE_SIZES, entry_bytes: int = 4) -> pd.DataFrame:
    """Bytes of a block list (an entry per page, vLLM's block table) for ``rows`` requests of
    the model's longest context, one row per page size. The request-to-token table (an entry
    per token, SGLang's ``req_to_token``) is the block list at pages of one token, and the KV
    those rows index is the same at every page size: ``index_bytes`` gives both."""
    width = cfg.max_seq_len
    table = {p: {"block list (KiB)": rows * math.ceil(width / p) * entry_bytes / 1024}
             for p in page_sizes}
    frame = pd.DataFrame.from_dict(table, orient="index")
    frame.index.name = "page size"
    return frame


def index_bytes(cfg: ModelConfig = LLAMA3_8B, rows: int = 64,
                entry_bytes: int = 4) -> tuple[int, int]:
    """(bytes of a request-to-token table, bytes of 16-bit KV it indexes) for ``rows``
    requests of the model's longest context: neither depends on the page size."""
    width = cfg.max_seq_len
    kv = rows * width * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2
    return rows * width * entry_bytes, kv


def tile_runs(slots: Sequence[int], tile: int = KEY_TILE) -> list[int]:
    """For each tile of ``tile`` consecutive positions, how many runs of consecutive slots
    its keys sit in: 1 when the tile is one stretch of the pool, ``tile`` when every key is
    somewhere else (a last, partial tile counted too)."""
    if not slots:
        return []
    breaks = _breaks(slots)
    full = len(slots) // tile
    runs = _tile_runs(breaks, full, tile)
    if len(slots) > full * tile:
        runs.append(1 + int(np.count_nonzero(breaks[full * tile:len(slots) - 1])))
    return runs


def _breaks(slots: Sequence[int]) -> np.ndarray:
    """``breaks[i]``: position ``i + 1`` is not the slot after position ``i``'s."""
    return np.diff(np.asarray(slots, dtype=np.int64)) != 1


def _tile_runs(breaks: np.ndarray, tiles: int, tile: int) -> list[int]:
    """Runs of consecutive slots in each of the first ``tiles`` whole tiles, from ``_breaks``
    of the row: one plus the breaks inside the tile (a break at a tile's last position
    separates it from the next tile and is not counted)."""
    inside = np.zeros(tiles * tile, dtype=bool)
    n = min(len(breaks), tiles * tile)
    inside[:n] = breaks[:n]
    inside = inside.reshape(tiles, tile)
    return (1 + np.count_nonzero(inside[:, :-1], axis=1)).tolist()


def _count_tiles(rows: Sequence[Sequence[int]], tiles: dict[int, list[int]]) -> None:
    """Append to ``tiles[tile]`` the runs of consecutive slots in each whole tile of every
    row of ``rows``, row by row (``_tile_runs`` of each row), counted for all rows at once:
    one array of their slots, and the breaks before each position summed, so the breaks in
    a tile are two lookups (one call per step, where a call per row made the counting most
    of the simulated GPU's serving time)."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    if not lengths.any():
        return
    flat = np.concatenate([np.asarray(row, dtype=np.int64) for row in rows])
    before = np.concatenate(([0], np.cumsum(np.diff(flat) != 1)))  # breaks before position i
    offsets = np.cumsum(lengths) - lengths  # each row's first position in ``flat``
    for tile, counts in tiles.items():
        per_row = lengths // tile
        first = np.repeat(offsets - tile * (np.cumsum(per_row) - per_row), per_row)
        starts = first + tile * np.arange(int(per_row.sum()))
        # a break at a tile's last position separates it from the next and is not counted
        counts += (1 + before[starts + tile - 1] - before[starts]).tolist()


def key_runs(runs: Mapping[int, PageRun]) -> pd.DataFrame:
    """One row per page size of ``runs`` (``page_run``'s, by page size), a column per tile of
    ``KEY_TILES``: how many runs of consecutive slots a full tile of that many key positions
    sits in, on average, over the rows of every running request at the steps it counted; and
    for the widest tile the share that lies in one run, which a kernel could fetch as one
    block (a bulk TMA copy needs more: the page itself a multiple of the tile)."""
    rows = {}
    for size, run in sorted(runs.items()):
        rows[size] = {f"runs per {tile}-key tile": float(np.mean(counts))
                      for tile, counts in run.tile_runs.items()}
        wide = max(run.tile_runs)
        counts = np.asarray(run.tile_runs[wide])
        rows[size][f"{wide}-key tiles in one run (%)"] = float(100 * np.mean(counts == 1))
    frame = pd.DataFrame.from_dict(rows, orient="index")
    frame.index.name = "page size"
    return frame


CACHE_SETTINGS = (*(("radix", p) for p in PAGE_SIZES), ("blocks", BLOCK_SIZE))
"""The (cache, page size) pairs the hit table compares: the tree at every page of
``PAGE_SIZES`` against vLLM's blocks of 16."""


def served_runs(model: Any, workloads: Mapping[str, Workload],
                settings: Sequence[tuple[str, int]], runs: dict | None = None,
                **options: Any) -> dict[tuple[str, str, int], PageRun]:
    """``page_run`` of every workload at every (cache, page size) of ``settings`` on CityLM,
    keyed (workload, cache, page size), keys counted by no tile unless ``options`` say
    ``tile_every``. ``runs``: runs already served with the same ``options`` (taken, not
    served again; the new ones are added to it)."""
    runs = {} if runs is None else runs
    for name, workload in workloads.items():
        for cache, size in settings:
            if (name, cache, size) not in runs:
                runs[name, cache, size] = page_run(model, workload, size, cache,
                                                   **{"tile_every": 0, **options})
    return runs


def hit_table(runs: Mapping[tuple[str, str, int], PageRun]) -> pd.DataFrame:
    """Hit rate and prefilled tokens of each run of ``runs`` (``served_runs``'s, keyed
    (workload, cache, page size)), a row per run in their order, indexed by workload."""
    rows = [{"workload": name, "cache, page": f"{'tree' if cache == 'radix' else 'blocks'}, "
             f"{size}", "hit rate": f"{run.hit_rate:.1%}", "prefilled (tokens)":
             run.prefill_tokens} for (name, cache, size), run in runs.items()]
    return pd.DataFrame(rows).set_index("workload")


def empty_slots_by_pool(runs: Mapping[int, Mapping[tuple[str, str, int], PageRun]],
                        workload: str, sizes: Sequence[int],
                        cache: str = "radix") -> pd.DataFrame:
    """The share of handed-out slots that hold no token (%) when ``cache`` serves
    ``workload`` at each page size of ``sizes`` (a row each) in each pool of ``runs`` (a
    column each; ``runs`` keyed by pool, each a ``served_runs`` dict). The empty ends are a
    property of the requests and the page, so the pool should hardly move a row."""
    table = {f"pool of {pool:,}": {size: 100 * by_key[workload, cache, size].waste
                                   for size in sizes}
             for pool, by_key in sorted(runs.items())}
    frame = pd.DataFrame(table)
    frame.index.name = "page size (empty slots, %)"
    return frame


class TraceHits(NamedTuple):
    """One small trace served under several caches: each prompt and what each cache found."""

    prompts: list[list[int]]
    hits: dict[str, list[int]]  # a cache's label -> prompt tokens it found, per request
    outputs: dict[str, list[list[int]]]  # a cache's label -> outputs, per request
    page_size: int  # the larger page of the comparison (where its boundaries are drawn)


TRACE_SETTINGS = (("tree, pages of 1", "radix", 1), ("tree, pages of 16", "radix", 16),
                  ("blocks of 16", "blocks", 16))
"""The caches the trace goes through: the tree at SGLang's default page, the tree at vLLM's
block size, and vLLM's block-hash cache."""


def trace_hits(model: Any, workload: Workload,
               settings: Sequence[tuple[str, str, int]] = TRACE_SETTINGS,
               **options: Any) -> TraceHits:
    """Serve ``workload`` once per (label, cache, page size) of ``settings`` and keep, per
    request, how many prompt tokens the cache found at its admission."""
    hits, outputs = {}, {}
    for label, cache, size in settings:
        run = page_run(model, workload, size, cache, **options)
        hits[label], outputs[label] = run.cached_prompt, run.outputs
    return TraceHits([list(p) for p in workload.prompts], hits, outputs,
                     max(size for _, _, size in settings))
