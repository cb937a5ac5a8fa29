"""The pages chapter's pool, read from the engine's own objects: a block-cache pool mid-run
(``pool_snapshot``: each running request's block table, the pool's pages by holder, the
cached blocks' hash chains and reference counts, the free queue; ``page_roles`` checks that
they agree), and where the radix tree and the block cache part when the pool runs short
(``eviction_trace``, from ``page_run``'s eviction logs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import pandas as pd

from minisrv.engine import Engine
from minisrv.experiments.pages import Eviction, PageRun
from minisrv.sampling import SamplingParams
from minisrv.workloads import Workload

__all__ = ["BlockView", "EvictionTrace", "PoolSnapshot", "eviction_trace", "page_roles",
           "pool_snapshot"]


class BlockView(NamedTuple):
    """One cached block of a ``PoolSnapshot``, as the block cache holds it."""

    page: int  # the pool page its tokens live in
    parent: int | None  # its parent block's page (None for a chain's first block)
    hash: int  # chained from its parent's
    ref: int  # its reference count: the running requests that read it


class PoolSnapshot(NamedTuple):
    """A block-cache engine's KV pool at one step, read from the table (each running
    request's row cut into pages: vLLM's block table), the block cache and the allocator;
    ``engine`` and ``requests`` are the run itself, to check it and to finish it."""

    page_size: int
    n_pages: int
    rows: dict[str, list[int]]  # a running request's label -> the page of each block, in order
    lengths: dict[str, int]  # its tokens with KV
    blocks: list[BlockView]  # every cached block, parents first
    free_queue: list[int]  # pages of unreferenced cached blocks, the next evicted first
    free_pages: list[int]  # pages the allocator has not handed out
    engine: Engine
    requests: dict[str, Any]  # label -> request, those served before and those running


def pool_snapshot(model: Any, before: Mapping[str, tuple[list[int], int]],
                  during: Mapping[str, tuple[list[int], int]], steps: int,
                  page_size: int = 16, **options: Any) -> PoolSnapshot:
    """Serve ``before`` (label -> (prompt, output length)) to the end with
    ``cache="blocks"``, admit ``during``, run ``steps`` steps and read the pool
    (``PoolSnapshot``; its rows are those of the requests still running, a block's page
    named by its first slot). ``options`` are ``EngineConfig``'s."""
    engine = Engine(model, page_size=page_size, cache="blocks", **options)

    def admit(batch: Mapping[str, tuple[list[int], int]]) -> dict[str, Any]:
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n in batch.values()]
        reqs = engine.make_requests([p for p, _ in batch.values()], None, params,
                                    [0.0] * len(batch))
        for req in reqs:
            engine.add_request(req)
        return dict(zip(batch, reqs))

    served = admit(before)
    while engine.step().record is not None:
        pass
    running = admit(during)
    for _ in range(steps):
        engine.step()
    memory = engine.scheduler.memory
    table, cache, kv = memory.table, memory.tree, memory.kv
    rows = {label: [slot // page_size for slot in table.slots(req, 0, req.kv_len)[::page_size]]
            for label, req in running.items() if not req.finished}
    blocks = [BlockView(block.value[0] // page_size,
                        None if block.parent is cache.root else block.parent.value[0] // page_size,
                        block.hash, block.lock_ref) for block in cache.nodes()[1:]]
    return PoolSnapshot(
        page_size, kv.n_pages, rows, {label: running[label].kv_len for label in rows},
        blocks, [block.value[0] // page_size for block in cache.free_queue()],
        [page for page in range(kv.n_pages) if not kv.is_used(page * page_size)],
        engine, {**served, **running})


def page_roles(snapshot: PoolSnapshot) -> dict[int, str]:
    """Each page's holder: ``"free"``, ``"cached, free"`` (in the free queue), ``"shared"``
    (a cached block several running requests read) or the one running request whose row
    holds it; ValueError where the table, the cache and the allocator disagree."""
    roles = {page: "free" for page in snapshot.free_pages}
    roles |= {page: "cached, free" for page in snapshot.free_queue}
    shared = {block.page for block in snapshot.blocks if block.ref > 1}
    roles |= {page: "shared" for page in shared}
    for label, row in snapshot.rows.items():
        for page in (page for page in row if page not in shared):
            if page in roles:
                raise ValueError(f"page {page} of {label}'s row is also {roles[page]!r}")
            roles[page] = label
    if missing := sorted(set(range(snapshot.n_pages)) - set(roles)):
        raise ValueError(f"pages held by nobody: {missing}")
    return roles


class EvictionTrace(NamedTuple):
    """Where two caches' evictions part: the first request whose hit differs between them,
    what each found of its prompt, and each cache's evictions of that prompt's prefix
    before the request was admitted (``table``: a row per step, ranges of positions)."""

    request: int  # its index in the workload
    prompt_len: int
    found: dict[str, int]  # a cache's label -> prompt tokens it found at admission
    evicted: dict[str, list[Eviction]]  # a cache's label -> its evictions of that prefix
    table: pd.DataFrame


def eviction_trace(tree: PageRun, blocks: PageRun, workload: Workload) -> EvictionTrace:
    """The evictions behind the first request of ``workload`` that the radix tree's run and
    the block cache's run (``page_run``'s, same pool and page) find differently: every
    piece of that request's prompt each cache evicted before the request's first prefill.
    A table row per step in which either cache evicted some: the slots the allocation was
    short and the positions evicted (first to last); ValueError where the runs never differ."""
    runs = {"tree": tree, "block cache": blocks}
    differ = [i for i, (a, b) in enumerate(zip(tree.cached_prompt, blocks.cached_prompt))
              if a != b]
    if not differ:
        raise ValueError("the two runs find the same tokens of every prompt")
    i = differ[0]
    prompt = tuple(workload.prompts[i])
    evicted = {label: [e for e in run.evictions if e.step < run.admitted[i]
                       and prompt[:len(e.tokens)] == e.tokens]
               for label, run in runs.items()}
    columns = [f"{label}{part}" for label in runs for part in (": short by", " evicts")]
    steps = sorted({e.step for pieces in evicted.values() for e in pieces})
    rows: dict[int, dict[str, Any]] = {step: dict.fromkeys(columns, "–") for step in steps}
    for label, pieces in evicted.items():
        for step in sorted({e.step for e in pieces}):
            mine = [e for e in pieces if e.step == step]
            rows[step][f"{label}: short by"] = mine[0].short
            rows[step][f"{label} evicts"] = (f"{min(e.start for e in mine)}–"
                                             f"{max(len(e.tokens) for e in mine) - 1}")
    table = pd.DataFrame.from_dict(rows, orient="index", columns=columns)
    table.index.name = "step"
    return EvictionTrace(i, len(prompt), {label: run.cached_prompt[i]
                                          for label, run in runs.items()}, evicted, table)
