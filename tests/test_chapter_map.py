"""The overview chapter's map names modules a reader can open (they had gone stale, issue 22)."""

from __future__ import annotations

from pathlib import Path

from minisrv.viz.overview import CHAPTERS, COMPONENTS

PACKAGE = Path(__file__).resolve().parent.parent / "minisrv"


def test_every_module_the_chapter_map_names_exists() -> None:
    named = [m for chapter in CHAPTERS for m in chapter.modules]
    named += [m for component in COMPONENTS.values() for m in component.modules]
    missing = [m for m in named if not (PACKAGE / m).exists()]
    assert not missing, f"the chapter map names modules that do not exist: {missing}"


def test_the_architecture_draws_each_part_where_sglang_runs_it() -> None:
    """Speculative decoding runs in the model worker (SGLang's ``EAGLEWorker`` wraps the
    target's worker), the host tier is drawn, copying KV to and from the pool, and the pages
    chapter's block-hash cache sits with the other KV bookkeeping, in the scheduler."""
    from minisrv.viz.overview import architecture_diagram

    source = architecture_diagram().source
    worker = source[source.index("subgraph cluster_worker"):]
    scheduler = source[source.index("subgraph cluster_scheduler"):
                       source.index("subgraph cluster_worker")]
    assert "spec" in worker and "spec" not in scheduler
    assert "host" in scheduler and "host -> kvpool" in source
    assert COMPONENTS["host"].chapter == "04a_host_tier"
    assert "blocks" in scheduler and "blocks" not in worker
    assert COMPONENTS["blocks"].chapter == "04b_pages"
