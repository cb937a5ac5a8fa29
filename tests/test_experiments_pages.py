"""The pages chapter's measurements: the allocator's empty slots, key runs per tile, and the
two prefix caches at one page size (``minisrv.experiments.pages``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minisrv.experiments import page_pool as pp
from minisrv.experiments import page_preemption as pre
from minisrv.experiments import pages as pg
from minisrv.sim import SimBackend
from minisrv.workloads import Workload, gpu_scale_workload


def test_tile_runs_counts_the_breaks_in_consecutive_slots() -> None:
    assert pg.tile_runs(list(range(64))) == [1, 1]
    assert pg.tile_runs([5, 6, 7, 1, 2, 40], tile=3) == [1, 2]
    assert pg.tile_runs(list(range(0, 64, 2)), tile=32) == [32]


def test_key_runs_has_a_column_per_tile_width() -> None:
    """A run records its tiles per width (``KEY_TILES``); the table averages each width in
    its own column, so the 128-key tile of the Hopper kernels sits beside minisrv's 32."""
    from types import SimpleNamespace

    assert pg.KEY_TILES == (32, 128)
    runs = {1: SimpleNamespace(tile_runs={32: [4, 6], 128: [20]}),
            64: SimpleNamespace(tile_runs={32: [1, 1], 128: [2, 3]})}
    table = pg.key_runs(runs)
    assert list(table.columns) == ["runs per 32-key tile", "runs per 128-key tile",
                                   "128-key tiles in one run (%)"]
    assert table.loc[1].tolist() == [5.0, 20.0, 0.0]
    assert table.loc[64].tolist() == [1.0, 2.5, 0.0]
    runs[128] = SimpleNamespace(tile_runs={32: [1, 1], 128: [1, 1, 1, 2]})
    assert pg.key_runs(runs).loc[128, "128-key tiles in one run (%)"] == pytest.approx(75.0)


def _small_gpu_workload() -> Workload:
    return pg.first_requests(gpu_scale_workload(n=2000, rate=64.0, seed=0), 40)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_empty_slots_read_from_the_allocator_are_the_last_pages_ends(page_size: int) -> None:
    """Every reading of ``page_run`` is slots handed out minus tokens held; with no prefix
    cache that is, per running request, its last page's empty end: 0 at pages of one token,
    and between 0 and P - 1 per request otherwise, about (P - 1) / 2 on average."""
    run = pg.page_run(SimBackend(), _small_gpu_workload(), page_size, kv_capacity=8192,
                      max_running=16)
    assert 0 <= run.wasted_per_request <= page_size - 1
    if page_size == 1:
        assert run.waste == 0.0
    else:
        assert run.wasted_per_request == pytest.approx((page_size - 1) / 2, rel=0.25)
        assert 0 < run.waste < 1


def test_the_block_cache_finds_what_the_tree_finds_at_the_same_page_in_a_roomy_pool() -> None:
    """Prompts sharing a 40-token prefix, served in a pool that holds them all: both caches
    keep whole pages of 16, so both find 32 tokens of every prompt after the first."""
    shared = list(range(1000, 1040))
    prompts = [shared + [2000 + i, 2001 + i] for i in range(6)]
    work = Workload("shared", prompts, [4] * 6, [float(i) for i in range(6)])
    runs = {cache: pg.page_run(SimBackend(), work, 16, cache, kv_capacity=4096, max_running=4)
            for cache in ("radix", "blocks")}
    assert runs["radix"].cached_prompt == runs["blocks"].cached_prompt == [0] + [32] * 5
    tree1 = pg.page_run(SimBackend(), work, 1, "radix", kv_capacity=4096, max_running=4)
    assert tree1.cached_prompt == [0] + [40] * 5


def test_table_sizes_count_an_entry_per_page_and_the_token_table_one_per_token() -> None:
    table = pg.table_sizes(rows=2, page_sizes=(1, 16))
    width = 8192  # LLaMA-3-8B's context
    assert list(table.columns) == ["block list (KiB)"]
    assert table.loc[16, "block list (KiB)"] == 2 * math.ceil(width / 16) * 4 / 1024
    token_table, kv = pg.index_bytes(rows=2)
    assert token_table == 2 * width * 4 == table.loc[1, "block list (KiB)"] * 1024
    assert kv == 2 * width * 128 * 1024  # 128 KiB of 16-bit KV per token


def _two_caches_part() -> tuple[Workload, dict[str, pg.PageRun]]:
    """A's 40-token prompt is cached whole, then B needs 7 slots more than the pool of 64 has
    free: the tree drops A's whole leaf, the block cache A's deepest blocks only (pages of
    one token), so C, A's prompt and two more tokens, finds 0 tokens with the tree and 33
    with the block cache."""
    a, b = list(range(1000, 1040)), list(range(2000, 2030))
    work = Workload("parting", [a, b, a + [3000, 3001]], [2, 2, 2], [0.0, 1.0, 2.0])
    return work, {cache: pg.page_run(SimBackend(), work, 1, cache, kv_capacity=64,
                                     max_running=1) for cache in ("radix", "blocks")}


def test_the_eviction_trace_shows_the_tree_dropping_a_leaf_and_the_queue_single_blocks() -> None:
    work, runs = _two_caches_part()
    assert runs["radix"].admitted == runs["blocks"].admitted == [1, 3, 5]
    trace = pp.eviction_trace(runs["radix"], runs["blocks"], work)
    assert trace.request == 2 and trace.prompt_len == 42
    assert trace.found == {"tree": 0, "block cache": 33}
    assert trace.table.loc[3].tolist() == [7, "0–39", 7, "34–39"]
    assert trace.table.loc[4].tolist() == ["–", "–", 1, "33–33"]
    tree_pieces = trace.evicted["tree"]
    assert [(e.start, len(e.tokens)) for e in tree_pieces] == [(0, 40)]  # A's prompt leaf
    assert all(e.tokens == tuple(work.prompts[2][:len(e.tokens)]) for e in tree_pieces)
    with pytest.raises(ValueError, match="same tokens"):
        pp.eviction_trace(runs["radix"], runs["radix"], work)


def test_hit_table_has_a_row_per_run_and_preemption_table_counts_recomputed_tokens() -> None:
    """The hit table reads the runs it is given, in order; the preemption table names the
    prompts' tokens, the page size all its runs share and what was prefilled beyond the
    prompts, and takes a run already served without a cache, at the same page size, as its
    first row instead of serving it again."""
    work, runs = _two_caches_part()
    keyed = {("parting", cache, 1): run for cache, run in runs.items()}
    table = pg.hit_table(keyed)
    assert table.index.name == "workload" and list(table["cache, page"]) == ["tree, 1",
                                                                           "blocks, 1"]
    assert list(table["hit rate"]) == [f"{runs['radix'].hit_rate:.1%}",
                                       f"{runs['blocks'].hit_rate:.1%}"]
    none = pg.page_run(SimBackend(), work, 1, kv_capacity=64, max_running=1)
    preempt = pre.preemption_runs(SimBackend(), work, (("radix", 1, 0),), no_cache=none,
                                 kv_capacity=64, max_running=1)
    assert list(preempt) == [("none", 1, 0), ("radix", 1, 0)] and preempt["none", 1, 0] is none
    frame = pre.preemption_table(preempt, work)
    assert frame.index.name == "cache, pages of 1 (prompts: 112 tokens)"
    assert list(frame.index) == ["no prefix cache", "radix tree"]
    with pytest.raises(ValueError, match="pages of 1"):  # a baseline at another page size
        pre.preemption_runs(SimBackend(), work, (("radix", 16, 0),), no_cache=none,
                           kv_capacity=64, max_running=1)
    assert frame["recomputed (tokens)"].tolist() == [none.prefill_tokens - 112,
                                                     preempt["radix", 1, 0].prefill_tokens - 112]


def test_the_page_explorer_offers_a_workload_menu_only_for_several_workloads() -> None:
    """A menu of one entry chooses nothing: one workload gives the pool control alone, two
    give both, and each state's numbers are its own pool's runs."""
    pytest.importorskip("matplotlib")
    from minisrv.viz.pages import page_explorer

    prompts = [list(range(1000, 1040)) + [2000 + i, 2001 + i] for i in range(6)]
    work = Workload("shared", prompts, [4] * 6, [float(i) for i in range(6)])
    options = {"sizes": (1, 16), "pools": (256, 4096), "max_running": 4}
    runs: dict = {}
    one = page_explorer(SimBackend(), None, {"shared": work}, runs=runs, **options)
    assert [c.name for c in one.controls] == ["pool"] and one.runs is runs
    state = one.metrics(pool=256)
    assert state["hit rate (tree), pages of 16"] == runs[256]["shared", "radix", 16].hit_rate
    two = page_explorer(SimBackend(), None, {"shared": work, "again": work}, **options)
    assert [c.name for c in two.controls] == ["workload", "pool"]


def test_the_page_explorer_shows_what_each_cache_evicted_from_its_own_log() -> None:
    """Six prompts sharing nothing: a pool of 160 tokens evicts the finished ones, a pool of
    4,096 nothing; the evicted panel's numbers are the sums of each run's eviction log."""
    pytest.importorskip("matplotlib")
    from minisrv.viz.pages import page_explorer

    prompts = [list(range(1000 + 100 * i, 1042 + 100 * i)) for i in range(6)]
    work = Workload("apart", prompts, [4] * 6, [float(i) for i in range(6)])
    runs: dict = {}
    explorer = page_explorer(SimBackend(), None, {"apart": work}, sizes=(1, 16),
                             pools=(160, 4096), runs=runs, max_running=4)
    for pool in (160, 4096):
        for cache, label in (("radix", "tree"), ("blocks", "blocks")):
            log = runs[pool]["apart", cache, 1].evictions
            evicted = explorer.metrics(pool=pool)[f"evicted ({label}), pages of 1"]
            assert evicted == sum(len(e.tokens) - e.start for e in log)
            assert (evicted > 0) == (pool == 160)


def test_the_page_explorer_shows_each_caches_batch_and_empty_slots() -> None:
    """The legend names both caches, so the batch and empty-slot panels draw both: a bar per
    cache and page size, each the height of its own run's mean batch or share of empty
    slots, and the state's numbers name both."""
    pytest.importorskip("matplotlib")
    from minisrv.viz.pages import page_explorer, plot_page_state

    prompts = [list(range(1000 + 100 * i, 1042 + 100 * i)) for i in range(6)]
    work = Workload("apart", prompts, [4] * 6, [float(i) for i in range(6)])
    runs: dict = {}
    explorer = page_explorer(SimBackend(), None, {"apart": work}, sizes=(1, 16),
                             pools=(160,), runs=runs, max_running=4)
    state = explorer.metrics(pool=160)
    mine = {(cache, s): runs[160]["apart", cache, s] for cache in ("radix", "blocks")
            for s in (1, 16)}
    axes = plot_page_state(mine, (1, 16)).axes
    heights = sorted(p.get_height() for p in axes[2].patches)
    assert heights == sorted(run.mean_batch for run in mine.values())
    empty = sorted(p.get_height() for p in axes[3].patches)
    assert empty == sorted(100 * run.waste for run in mine.values()) and max(empty) > 0
    for s in (1, 16):
        assert state[f"mean batch (blocks), pages of {s}"] == mine["blocks", s].mean_batch
        assert state[f"empty slots (tree), pages of {s}"] == mine["radix", s].waste


def test_the_page_explorer_draws_every_pool_on_one_scale_per_panel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool that evicts nothing must not get an axis of its own around zero: every state's
    evicted panel runs from 0 to just above the most any state evicted, and its batch and
    empty-slot panels likewise share one scale, so moving the pool moves the bars, not the
    scale."""
    pytest.importorskip("matplotlib")
    import minisrv.viz.pages as vp

    tops: list[tuple[float, float]] = []
    scales: list[list[tuple[float, float]]] = []  # the batch and empty-slot axes
    draw = vp.plot_page_state

    def spy(*args: object, **kwargs: object) -> object:
        fig = draw(*args, **kwargs)
        tops.append(fig.axes[0].get_ylim())
        scales.append([fig.axes[2].get_ylim(), fig.axes[3].get_ylim()])
        return fig

    monkeypatch.setattr(vp, "plot_page_state", spy)
    prompts = [list(range(1000 + 100 * i, 1042 + 100 * i)) for i in range(6)]
    work = Workload("apart", prompts, [4] * 6, [float(i) for i in range(6)])
    explorer = vp.page_explorer(SimBackend(), None, {"apart": work}, sizes=(1, 16),
                                pools=(160, 4096), max_running=4)
    most = max(explorer.metrics(pool=160)[f"evicted ({c}), pages of {s}"]
               for c in ("tree", "blocks") for s in (1, 16))
    assert most > 0 and len(tops) == 2 and tops[0] == tops[1]
    assert tops[0][0] == 0 and most < tops[0][1] < 1.2 * most
    assert scales[0] == scales[1]
    batches = [explorer.metrics(pool=pool)[f"mean batch ({c}), pages of {s}"]
               for pool in (160, 4096) for c in ("tree", "blocks") for s in (1, 16)]
    assert max(batches) < scales[0][0][1] < 1.2 * max(batches)


def test_empty_slots_by_pool_has_a_row_per_page_size_and_a_column_per_pool() -> None:
    """Each cell is one run's empty share in percent, read from ``waste``; the pools are
    columns in increasing order whatever order the runs came in."""
    from types import SimpleNamespace

    runs = {4096: {("chats", "radix", 16): SimpleNamespace(waste=0.07),
                   ("chats", "radix", 64): SimpleNamespace(waste=0.25)},
            768: {("chats", "radix", 16): SimpleNamespace(waste=0.073),
                  ("chats", "radix", 64): SimpleNamespace(waste=0.265),
                  ("chats", "blocks", 16): SimpleNamespace(waste=0.5)}}
    table = pg.empty_slots_by_pool(runs, "chats", (16, 64))
    assert list(table.columns) == ["pool of 768", "pool of 4,096"]
    assert list(table.index) == [16, 64]
    assert table.loc[64, "pool of 768"] == pytest.approx(26.5)
    assert table.loc[16, "pool of 4,096"] == pytest.approx(7.0)


def test_the_trace_figure_merges_caches_that_found_the_same_tokens() -> None:
    """Each bar has a solid (found) and a pale (computed) part in its own colour, so the
    legend names both parts of every bar, a column per bar; two caches that found the same
    tokens of every request share one bar, named by both."""
    from minisrv.viz.pages import plot_trace_hits

    trace = pg.TraceHits([[1] * 20, [1] * 40],
                         {"tree 1": [0, 19], "tree": [0, 16], "blocks": [0, 16]},
                         {"tree 1": [[], []], "tree": [[], []], "blocks": [[], []]}, 16)
    fig = plot_trace_hits(trace, ["a", "b"])
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == [
        "tree 1: found", "tree 1: computed", "tree = blocks: found", "tree = blocks: computed"]
    assert legend._ncols == 2
    assert len(fig.axes[0].patches) == 2 * 2 * 2  # 2 requests x 2 bars x found/computed


def _pool_snapshot() -> pp.PoolSnapshot:
    """A and B served to the end, then C and D, which share A's 40-token header, five steps
    in: a pool of 16 pages of 16 slots."""
    header = list(range(1000, 1040))
    return pp.pool_snapshot(
        SimBackend(), {"A": (header + [1, 2, 3, 4, 5], 30), "B": (list(range(2000, 2045)), 20)},
        {"C": (header + [6, 7, 8, 9, 10], 10), "D": (header + [11, 12, 13, 14, 15], 10)},
        steps=5, kv_capacity=256, max_running=8)


def test_the_pool_snapshot_reads_shared_blocks_and_the_free_queue_from_the_engine() -> None:
    """C and D read A's two full header blocks (reference count 2 each); the blocks nobody
    references sit in the free queue, B's chain deepest first, then A's blocks past the
    header; every page is free, queued, shared or one running request's."""
    snap = _pool_snapshot()
    assert snap.rows["C"][:2] == snap.rows["D"][:2]
    assert set(snap.rows["C"][2:]).isdisjoint(snap.rows["D"][2:])
    by_page = {block.page: block for block in snap.blocks}
    assert [by_page[p].ref for p in snap.rows["C"][:2]] == [2, 2]
    assert by_page[snap.rows["C"][1]].parent == snap.rows["C"][0]
    cache = snap.engine.scheduler.memory.tree
    assert snap.free_queue == [block.value[0] // 16 for block in cache.free_queue()]
    assert all(by_page[p].ref == 0 for p in snap.free_queue)
    first_blocks = [p for p in snap.free_queue if by_page[p].parent is None]
    assert len(first_blocks) == 1  # B's: A's first block is the shared header's
    assert snap.free_queue.index(first_blocks[0]) == 3  # after B's three deeper blocks
    roles = pp.page_roles(snap)
    assert sorted(roles) == list(range(16))
    assert [roles[p] for p in snap.rows["C"]] == ["shared", "shared", "C", "C"]
    assert sum(role == "free" for role in roles.values()) * 16 == \
        snap.engine.scheduler.memory.kv.free_count


def test_page_roles_refuses_a_page_two_requests_hold_without_the_cache() -> None:
    """A page in two rows that no shared cached block explains, or a page held by nobody, is
    an inconsistency between the table, the cache and the allocator, not a picture."""
    snap = _pool_snapshot()
    bad_rows = {**snap.rows, "D": [*snap.rows["D"][:2], snap.rows["C"][2], snap.rows["D"][3]]}
    with pytest.raises(ValueError, match="also"):
        pp.page_roles(snap._replace(rows=bad_rows))
    with pytest.raises(ValueError, match="nobody"):
        pp.page_roles(snap._replace(free_pages=snap.free_pages[1:]))


def test_the_pool_picture_has_a_legend_entry_per_owner_and_role() -> None:
    from minisrv.viz import pages as pv

    fig = pv.plot_pool_snapshot(_pool_snapshot())
    labels = [text.get_text() for text in fig.legends[0].get_texts()]
    assert labels == ["C's own", "D's own", "shared", "cached, free", "free"]


def test_a_finished_request_leaves_the_snapshot_rows_and_its_partial_page_the_pool() -> None:
    """C stops after 3 tokens (47 with KV: two full header blocks and 15 tokens on a third
    page): the header's counts fall to D's 1, nothing new is cached, and C's partly filled
    page goes back to the allocator, which hands it to D next."""
    header = list(range(1000, 1040))
    snap = pp.pool_snapshot(
        SimBackend(), {"A": (header + [1, 2, 3, 4, 5], 30), "B": (list(range(2000, 2045)), 20)},
        {"C": (header + [6, 7, 8, 9, 10], 3), "D": (header + [11, 12, 13, 14, 15], 10)},
        steps=5, kv_capacity=256, max_running=8)
    assert list(snap.rows) == ["D"] and snap.requests["C"].finished
    by_page = {block.page: block for block in snap.blocks}
    assert [by_page[p].ref for p in snap.rows["D"][:2]] == [1, 1]
    assert snap.free_queue == _pool_snapshot().free_queue
    assert snap.rows["D"][3] == _pool_snapshot().rows["C"][2]


def test_first_chats_keeps_the_first_sessions_and_turns_in_order() -> None:
    """Request ``i`` of a chat of S sessions is turn ``i // S`` of session ``i % S``: the
    first 2 sessions' first 2 turns of a chat of 3 sessions are requests 0, 1, 3 and 4."""
    prompts = [[i] * (i + 1) for i in range(9)]
    chat = Workload("chat", prompts, list(range(9)), [float(i) for i in range(9)])
    kept = pg.first_chats(chat, 3, keep=2, turns=2)
    assert kept.prompts == [prompts[i] for i in (0, 1, 3, 4)]
    assert kept.output_lens == [0, 1, 3, 4] and kept.arrivals == [0.0, 1.0, 3.0, 4.0]


def test_tiles_counted_for_all_rows_at_once_match_each_rows_own_count() -> None:
    """``page_run`` counts every running row's tiles in one call per step: the counts must be
    each row's whole tiles (``tile_runs`` without the partial last one), row by row, with
    rows too short for a tile adding nothing and the seams between rows never read."""
    rng = np.random.default_rng(0)
    rows = [list(range(64)), [5, 6, 7, 1, 2, 40] * 30, list(range(10)),
            [int(s) for s in rng.permutation(600)[:300]], list(range(100, 356)), []]
    tiles: dict[int, list[int]] = {32: [], 128: []}
    pg._count_tiles(rows, tiles)
    for tile, counts in tiles.items():
        assert counts == [c for row in rows for c in pg.tile_runs(row, tile)[:len(row) // tile]]
    assert tiles[32][:2] == [1, 1] and tiles[128][-2:] == [1, 1]
    nothing: dict[int, list[int]] = {32: []}
    pg._count_tiles([[1, 2, 3]], nothing)
    pg._count_tiles([], nothing)
    assert nothing == {32: []}
