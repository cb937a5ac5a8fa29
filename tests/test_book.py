"""The book's frame: what readers and CI rely on beyond any one chapter."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import yaml

from minisrv import book

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))


def _toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [entry["file"] for entry in toc["chapters"]]


def test_repository_url_is_kept_in_one_place() -> None:
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["repository"]["url"] == book.REPO_URL
    assert config["launch_buttons"]["colab_url"].startswith("https://colab.research.google.com")


def test_toc_lists_every_chapter_in_reading_order() -> None:
    listed = [f for f in _toc_files() if f.startswith("chapters/")]
    on_disk = [f"chapters/{p.stem}" for p in CHAPTERS]
    assert listed == on_disk
    for entry in _toc_files():
        assert any((ROOT / f"{entry}{ext}").exists() for ext in (".md", ".ipynb")), entry


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_starts_with_the_colab_setup_cell(path: Path) -> None:
    first = nbformat.read(path, as_version=4).cells[0]
    assert first.cell_type == "code"
    assert first.source == book.SETUP_CELL
    assert "remove-cell" in first.metadata.get("tags", [])


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_has_goals_summary_exercises_and_references(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    headings = re.findall(r"^##\s+(.+)$", markdown, flags=re.M)
    for needed in ("Summary", "Exercises", "References"):
        assert needed in headings, f"{path.name} lacks a '## {needed}' section"
    assert "{exercise}" in markdown and "{solution-start}" in markdown


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_is_saved_executed(path: Path) -> None:
    """nbval compares against saved outputs, so every code cell must have run."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    assert all(c.execution_count for c in code), f"{path.name} has unexecuted cells"


def test_every_citation_is_in_the_bibliography() -> None:
    keys = set(re.findall(r"@\w+\{([^,]+),", (ROOT / "references.bib").read_text()))
    texts = [(ROOT / "intro.md").read_text()]
    texts += [c.source for p in CHAPTERS for c in nbformat.read(p, as_version=4).cells]
    cited = {k.strip() for t in texts for group in re.findall(r"\{cite[^}]*\}`([^`]+)`", t)
             for k in group.split(",")}
    assert cited, "the book cites nothing"
    assert cited <= keys, f"unknown citation keys: {sorted(cited - keys)}"


class _Example:
    """A class whose pieces show_source must handle."""

    def method(self) -> int:
        return 1

    @property
    def prop(self) -> int:
        return 2


def test_show_source_handles_functions_methods_classes_and_properties() -> None:
    assert book.source_of(book.glue).startswith("def glue(")
    assert book.source_of(_Example().method).startswith("def method(self)")
    assert book.source_of(_Example.prop).startswith("@property")
    assert book.source_of(_Example).startswith("class _Example:")
    html = book.show_source(_Example.method)._repr_html_()
    assert "<span" in html and "method" in html  # highlighted, not plain text


def test_show_source_refuses_builtins_clearly() -> None:
    with pytest.raises(TypeError, match="cannot show the source"):
        book.source_of(len)


def test_setup_cell_is_valid_python_installing_from_the_repository() -> None:
    compile(book.SETUP_CELL, "<setup>", "exec")
    assert book.REPO_URL in book.SETUP_CELL


def test_chapter_map_and_readme_picture_list_every_chapter() -> None:
    from minisrv.viz.overview import CHAPTERS as MAP

    assert [f"chapters/{c.file}" for c in MAP] == [f"chapters/{p.stem}" for p in CHAPTERS]
    picture = (ROOT / "images" / "chapters.svg").read_text()
    intro = (ROOT / "intro.md").read_text()
    for chapter in MAP:
        assert chapter.title in picture, "regenerate: python -m minisrv.viz.overview"
        assert f"chapters/{chapter.file}.ipynb" in intro, f"intro.md's map lacks {chapter.file}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_checks_the_numbers_it_quotes(path: Path) -> None:
    """Quoted numbers come from cells whose output nbval compares (tag nbval-check-output);
    the markers live in tags, not in comments the reader would see."""
    cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    checked = [c for c in cells if "nbval-check-output" in c.metadata.get("tags", [])]
    assert checked, f"{path.name} checks none of its outputs"
    assert not [c for c in cells if "NBVAL_" in c.source], "use cell tags, not NBVAL_ comments"
