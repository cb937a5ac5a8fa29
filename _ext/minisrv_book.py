"""Sphinx extension for the minisrv book: per-chapter numbering and author-year references.

Loaded by ``_config.yml`` (``sphinx: local_extensions: {minisrv_book: _ext}``).

1. Exercises (and any other numbered element: figures, tables, code blocks) are numbered
   per chapter: each document starts again at 1. Sphinx numbers them across the whole book
   when the table of contents is not numbered, so chapter 01 began at "Exercise 3".
2. The bibliography labels its entries by author and year, and the text cites by that label
   (``bibtex_reference_style: authoryear``): "[Zheng et al., 2024]" in the text links to the
   entry labelled "Zheng et al., 2024", sorted by author and year, instead of one labelled
   "[3]"; two works of one first author and year read "2024a" and "2024b" in both places.
   Several works in one citation are separated by semicolons, since every label holds a comma.
3. Each entry of the bibliography page ends with the pages that cite it, each a link to its
   first citation there: sphinxcontrib-bibtex draws back-references only within one page,
   and the book cites from its chapters into one references page.
"""

from __future__ import annotations

import codecs
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import latexcodec  # noqa: F401  (registers the "ulatex" codec used to read names)
from pybtex.plugin import register_plugin
from pybtex.style.formatting.plain import Style as PlainStyle
from pybtex.style.labels import BaseLabelStyle
from pybtex.style.sorting.author_year_title import SortingStyle as AuthorYearTitleSorting
from sphinxcontrib.bibtex.plugin import register_plugin as register_bibtex_plugin
from sphinxcontrib.bibtex.style.referencing import BracketStyle
from sphinxcontrib.bibtex.style.referencing.label import LabelReferenceStyle

STYLE_NAME = "authoryear"
"""Name of the pybtex formatting (and label) style, ``bibtex_default_style`` in _config.yml,
and of the citation style in the text, ``bibtex_reference_style``."""


def _plain(name: str) -> str:
    """A BibTeX name as the reader sees it: ``{DeepSeek-AI}`` -> DeepSeek-AI, ``{\\'o}`` -> o."""
    return codecs.decode(name, "ulatex").replace("{", "").replace("}", "")


def author_year_label(entry: Any) -> str:
    """"Li, 2026", "Zhang and Sennrich, 2019", "Zheng et al., 2024": the same names and
    separators sphinxcontrib-bibtex's author_year style prints in the text."""
    persons = entry.persons.get("author") or entry.persons.get("editor") or []
    names = [_plain(" ".join(p.prelast_names + p.last_names)) for p in persons]
    if not names:
        who = _plain(entry.fields.get("title", entry.key))
    elif len(names) == 1:
        who = names[0]
    elif len(names) == 2:
        who = f"{names[0]} and {names[1]}"
    else:
        who = f"{names[0]} et al."
    return f"{who}, {entry.fields.get('year', 'n.d.')}"


class AuthorYearLabelStyle(BaseLabelStyle):
    """Author-year labels; two works with the same label get a, b, ... after the year."""

    def format_labels(self, sorted_entries: Iterable[Any]) -> Iterator[str]:
        labels = [author_year_label(entry) for entry in sorted_entries]
        counts, seen = Counter(labels), Counter()
        for label in labels:
            if counts[label] > 1:
                seen[label] += 1
                yield f"{label}{'abcdefghijklmnopqrstuvwxyz'[seen[label] - 1]}"
            else:
                yield label


MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
"""Month field prefixes in calendar order (pybtex expands ``nov`` to "November")."""


def _month(entry: Any) -> int:
    """The entry's month, 1 to 12, or 13 without one (after every dated work of its year)."""
    month = entry.fields.get("month", "").strip().lower()[:3]
    return MONTHS.index(month) + 1 if month in MONTHS else 13


class AuthorYearSorting(AuthorYearTitleSorting):
    """By the label the text cites ("Agrawal et al., 2023" before "Agrawal et al., 2024",
    whoever the co-authors), then author, year, month and title, with names read as printed:
    ``{DeepSeek-AI}`` sorts under D, not after Z (a brace sorts after every letter). The
    month puts two works of one label in the order they appeared, so "2024a" is the earlier
    (EAGLE before EAGLE-2), which the title alone would reverse."""

    def sorting_key(self, entry: Any) -> tuple[str, str, str, int, str]:
        author, year, title = super().sorting_key(entry)
        return (_plain(author_year_label(entry)).lower(), _plain(author).lower(), year,
                _month(entry), title)


class AuthorYearStyle(PlainStyle):
    """pybtex's ``plain`` entries, sorted by author and year, under author-year labels. A
    ``@misc`` entry with a ``kind`` field (blog, repository, lecture, ...) shows it after its
    title, "(blog)", so a reader tells a blog post or a code folder from a paper at a glance."""

    default_label_style = STYLE_NAME
    default_sorting_style = STYLE_NAME

    def get_misc_template(self, e: Any) -> Any:
        from pybtex.style.formatting import toplevel
        from pybtex.style.formatting.unsrt import date
        from pybtex.style.template import field, join, optional, optional_field, sentence

        return toplevel[
            optional[sentence[self.format_names("author")]],
            sentence[join(sep=" ")[
                optional[self.format_title(e, "title", as_sentence=False)],
                optional[join["(", field("kind"), ")"]],
            ]],
            sentence[optional[field("howpublished")], optional[date]],
            sentence[optional_field("note")],
            self.format_web_refs(e),
        ]


register_plugin("pybtex.style.labels", STYLE_NAME, AuthorYearLabelStyle)
register_plugin("pybtex.style.sorting", STYLE_NAME, AuthorYearSorting)
register_plugin("pybtex.style.formatting", STYLE_NAME, AuthorYearStyle)


def _semicolon_brackets() -> BracketStyle:
    return BracketStyle(sep="; ")


@dataclass
class AuthorYearReferenceStyle(LabelReferenceStyle):
    """Cites by the bibliography's label, several works apart by semicolons: "[DeepSeek-AI,
    2024b; Lepikhin et al., 2021]". sphinxcontrib-bibtex's ``label`` style joins them with
    commas, and every author-year label holds one, so the reader could not tell where one
    work ends."""

    bracket_parenthetical: BracketStyle = field(default_factory=_semicolon_brackets)
    bracket_textual: BracketStyle = field(default_factory=_semicolon_brackets)


register_bibtex_plugin("sphinxcontrib.bibtex.style.referencing", STYLE_NAME,
                       AuthorYearReferenceStyle)


def number_per_document(app: Any, env: Any) -> list[str]:
    """Renumber every numbered element from 1 within its document, in document order.

    Runs after Sphinx's own ``assign_figure_numbers`` (same event, later priority), which
    left one counter running through the book. Returns the documents whose numbers changed,
    so that Sphinx rewrites them.
    """
    changed = []
    for docname, by_type in env.toc_fignumbers.items():
        renumbered = {figtype: {node_id: (i,) for i, node_id in enumerate(numbers, start=1)}
                      for figtype, numbers in by_type.items()}
        if renumbered != by_type:
            env.toc_fignumbers[docname] = renumbered
            changed.append(docname)
    return changed


def one_copy_of_each_script(app: Any, pagename: str, templatename: str, context: dict,
                            doctree: Any) -> None:
    """Each script once per page. sphinx-thebe adds its configuration script (``const
    THEBE_JS_URL = ...``) at every ``env-before-read-docs``, which a build fires more than
    once; the second copy throws "Identifier 'THEBE_JS_URL' has already been declared" in
    every page's console."""
    seen: set[tuple[str, str]] = set()
    kept = []
    for script in context.get("script_files", []):
        key = (getattr(script, "filename", script) or "",  # a body script: None or ""
               repr(sorted(getattr(script, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            kept.append(script)
    context["script_files"] = kept


def full_link_text(app: Any, config: Any) -> None:
    """Print links as written. The pydata theme under sphinx-book-theme shortens a GitHub
    URL shown as its own text to "owner/repo" behind an icon, so the bibliography's
    sgl-router entry (a folder of the sglang repository) read as a bare icon and a link
    to the wrong place."""
    config.html_theme_options = {**(config.html_theme_options or {}), "shorten_urls": False}


REPOSITORY_URL = "{{ repository_url }}"
"""Written in a page's source (``intro.md``'s ``git clone``), replaced by the repository URL of
``_config.yml`` when the page is read, code blocks included (MyST substitutions skip those)."""


def fill_repository_url(app: Any, docname: str, source: list[str]) -> None:
    """Put the configured repository URL where a page writes ``REPOSITORY_URL``, so the
    repository is named once, in ``_config.yml`` (jupyter-book passes it to the theme)."""
    if REPOSITORY_URL in source[0]:
        url = (app.config.html_theme_options or {}).get("repository_url")
        if not url:
            raise ValueError(f"{docname} names the repository but _config.yml has no "
                             "repository: url")
        source[0] = source[0].replace(REPOSITORY_URL, url)


def cited_in(app: Any, doctree: Any, docname: str) -> None:
    """Append "Cited in: <page>, <page>" to every bibliography entry of ``docname``, each page a
    link to its first citation of the entry, in reading order (the table of contents')."""
    from docutils import nodes

    domain = app.env.get_domain("cite")
    keys = {citation.citation_id: citation.key for citation in domain.citations
            if citation.bibliography_key.docname == docname}
    if not keys:
        return
    order = {name: i for i, name in enumerate(_reading_order(app.env))}
    for entry in doctree.findall(nodes.citation):
        key = next((keys[i] for i in entry["ids"] if i in keys), None)
        if key is None:
            continue
        first: dict[str, str] = {}
        for ref in domain.citation_refs:
            if ref.docname != docname and key in {t.key for t in ref.targets}:
                first.setdefault(ref.docname, ref.citation_ref_id)
        if not first:
            continue
        para = nodes.paragraph(classes=["cited-in"])
        para += nodes.Text("Cited in: ")
        for k, citing in enumerate(sorted(first, key=lambda d: order.get(d, len(order)))):
            if k:
                para += nodes.Text(", ")
            uri = app.builder.get_relative_uri(docname, citing) + "#" + first[citing]
            title = app.env.titles[citing].astext() if citing in app.env.titles else citing
            if citing == app.config.root_doc:  # the book's own title would read as a self-citation
                title = "Introduction"
            number = app.env.toc_secnumbers.get(citing, {}).get("")
            if number:  # the chapter's number, as the sidebar shows it
                title = ".".join(map(str, number)) + ". " + title
            para += nodes.reference("", title, refuri=uri, internal=True)
        entry += para


def bibliography_pages(app: Any, env: Any, added: set, changed: set, removed: set) -> list[str]:
    """The pages holding a bibliography, read again whenever another page changed: their
    "Cited in" lines depend on every chapter's citations, not on their own source."""
    if not (added or changed or removed):
        return []
    domain = env.get_domain("cite")
    return sorted({key.docname for key in domain.bibliographies} - set(removed))


def _reading_order(env: Any) -> list[str]:
    """Documents in the order of the table of contents (the root, then its tree)."""
    order: list[str] = []

    def walk(doc: str) -> None:
        if doc in order:
            return
        order.append(doc)
        for child in env.toctree_includes.get(doc, []):
            walk(child)

    walk(env.config.root_doc)
    return order


def setup(app: Any) -> dict[str, Any]:
    app.connect("config-inited", full_link_text)
    app.connect("source-read", fill_repository_url)
    app.connect("env-get-updated", number_per_document, priority=900)
    app.connect("html-page-context", one_copy_of_each_script)
    app.connect("doctree-resolved", cited_in)
    app.connect("env-get-outdated", bibliography_pages)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
