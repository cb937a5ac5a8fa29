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
