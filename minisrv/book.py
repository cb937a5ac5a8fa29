"""Helpers for the chapters: show a component's source, pick a device, glue numbers into prose.

The chapters import these so that a notebook stays a few lines of glue around the package.
Nothing in the serving core imports this module.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any

# The repository is named here and nowhere else in the package (Colab installs from it before
# any book file is at hand). `python -m minisrv.book` writes it into `_config.yml` (the
# repository button, and `intro.md`'s `{{ repository_url }}`, filled in at build time by
# `_ext/minisrv_book.py`) and into every chapter's saved Colab setup cell, so publishing the
# book under another URL is one edit and one command; `tests/test_book.py` checks they agree.
REPO_URL = "https://github.com/minisrv/minisrv"

# What a chapter needs beyond the package itself, as the extras of pyproject.toml: every
# chapter draws (viz); the server chapter starts `minisrv serve` and talks HTTP to it; the GPU
# appendix loads a Hugging Face Llama folder; the structured-output chapter masks with xgrammar,
# validates with jsonschema, writes a tiny Llama folder and serves it in-process. A chapter not
# listed needs ("viz",).
CHAPTER_EXTRAS: dict[str, tuple[str, ...]] = {
    "08_server": ("viz", "serve"),
    "08a_structured_output": ("viz", "grammar", "hf", "serve"),
    "09_gpu_appendix": ("viz", "hf"),
}
# One importable module per package of each extra: the setup cell installs when any is missing.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "viz": ("ipywidgets", "matplotlib", "graphviz", "pandas"),
    "serve": ("fastapi", "uvicorn", "prometheus_client", "httpx", "aiohttp", "openai"),
    "hf": ("transformers", "tokenizers", "huggingface_hub"),
    "grammar": ("xgrammar", "jsonschema"),
}


def chapter_extras(chapter: str) -> tuple[str, ...]:
    """The extras chapter ``chapter`` (a notebook's stem, e.g. ``"08_server"``) installs."""
    return CHAPTER_EXTRAS.get(chapter, ("viz",))


def setup_cell(chapter: str, repo_url: str = REPO_URL) -> str:
    """The source of a chapter's first cell (tagged ``remove-cell``, so the HTML hides it).

    On Colab it installs minisrv from the repository with the chapter's extras, keeping
    Colab's own torch (the package never pins torch) and every package Colab already ships;
    where the modules are already importable (a local checkout, the book build) it installs
    nothing. Then it sets ``DEVICE`` (``cuda`` when a GPU is visible). The check looks for
    each extra's modules, not only for minisrv, so a Colab runtime that ran an earlier chapter
    still gets what this one needs.
    """
    extras = chapter_extras(chapter)
    modules = ("minisrv",) + tuple(m for extra in extras for m in EXTRA_MODULES[extra])
    spec = f"minisrv[{','.join(extras)}] @ git+{repo_url}"
    # The install line within the 100 columns of ruff: ``check=True`` on a line of its own
    # when the chapter's extras make it longer.
    ending = ", check=True)" if len(spec) <= 64 else ",\n                   check=True)"
    names = textwrap.fill(", ".join(f'"{m}"' for m in modules), width=84,
                          initial_indent="    ", subsequent_indent="    ")
    return f'''\
# Colab: install minisrv (weights included) and what this chapter needs; harmless elsewhere.
import importlib
import importlib.util
import subprocess
import sys

NEEDED = (
{names},
)
if any(importlib.util.find_spec(name) is None for name in NEEDED):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "{spec}"]{ending}
    importlib.invalidate_caches()

from minisrv.book import default_device  # noqa: E402  (importable only after the install)

DEVICE = default_device()'''


def publish_repository_url(root: Any, repo_url: str = REPO_URL) -> list[str]:
    """Write ``repo_url`` wherever the book spells out its repository: the ``url`` of
    ``_config.yml``'s ``repository`` entry and the first (Colab setup) cell of every chapter
    under ``root``. Returns the files it changed; a second call changes nothing.

    The saved setup cells must hold the URL itself (Colab runs the notebook as saved), so they
    are regenerated from ``setup_cell`` rather than edited by hand.
    """
    import re
    from pathlib import Path

    import nbformat

    if not re.fullmatch(r"https://[^\s\"']+", repo_url):
        raise ValueError(f"repo_url must be an https:// URL, got {repo_url!r}")
    root = Path(root)
    changed = []
    config = root / "_config.yml"
    text = config.read_text()
    new, n = re.subn(r"(?m)^(repository:\n  url: ).*$", lambda m: m.group(1) + repo_url, text)
    if n != 1:
        raise ValueError(f"{config} has no 'repository:' entry whose first key is 'url'")
    if new != text:
        config.write_text(new)
        changed.append(str(config))
    for path in sorted((root / "chapters").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        wanted = setup_cell(path.stem, repo_url)
        if nb.cells and nb.cells[0].source != wanted:
            nb.cells[0].source = wanted
            nbformat.write(nb, path)
            changed.append(str(path))
    return changed


def default_device() -> str:
    """``$MINISRV_DEVICE`` when set, else ``"cuda"`` when a GPU is visible (e.g. on Colab),
    else ``"cpu"``.

    The variable lets a GPU box run every chapter on ``cuda`` and a test force ``cpu``. A
    value that is not a torch device, or CUDA where there is none, raises ValueError rather
    than silently running the chapters somewhere else.
    """
    import os

    import torch

    wanted = os.environ.get("MINISRV_DEVICE", "").strip()
    if not wanted:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(wanted)
    except RuntimeError as err:
        raise ValueError(
            f"MINISRV_DEVICE={wanted!r} is not a torch device; use e.g. 'cpu', 'cuda', 'cuda:1'"
        ) from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"MINISRV_DEVICE={wanted!r} but no CUDA GPU is visible; use 'cpu'")
    return wanted


def source_of(obj: Any) -> str:
    """The dedented source text of a function, method, class or module."""
    target = getattr(obj, "__func__", obj)  # bound/class methods -> the function
    if isinstance(target, property):
        target = target.fget
    try:
        return textwrap.dedent(inspect.getsource(target))
    except (OSError, TypeError) as err:
        raise TypeError(f"cannot show the source of {obj!r}: {err}") from err


def show_source(obj: Any) -> Any:
    """Display ``obj``'s source with syntax highlighting, the way chapters present a component.

    Returns an IPython ``Code`` object, so it renders as highlighted HTML in Jupyter and in
    the built book, and as plain text in a terminal.
    """
    from IPython.display import Code

    return Code(source_of(obj), language="python")


def glue(name: str, value: Any, display: bool = True) -> None:
    """Make ``value`` quotable in the prose as ``{glue:text}`name:FORMAT```.

    Glue numbers, not strings, and format them in the role (``{glue:text}`share:.1%```): a
    glued string renders in quote marks. NumPy scalars become Python numbers here, because
    myst-nb applies the format spec to the value's ``repr``, which for NumPy 2 reads
    ``np.float64(...)``. Uses myst-nb's ``glue`` when it is installed (the book build);
    elsewhere (Colab) it just shows the value, so the same notebook runs in both places.
    """
    if hasattr(value, "item") and getattr(value, "shape", None) == ():
        value = value.item()  # numpy scalar -> int / float
    try:
        from myst_nb import glue as _glue
    except ImportError:
        if display:
            from IPython.display import display as _display

            _display(value)
        return
    _glue(name, value, display=display)


class PageChecks:
    """What one page checked, counted, so that the page can say it once in a sentence.

    The checks themselves stay in hidden cells (a reader is not shown a test log); each hidden
    check adds to the page's count, and the chapter glues the totals (``glue("checked_requests",
    CHECKS.requests)``) into the one sentence that says what every result was checked against.
    A failed check raises, which fails the cell under nbval and the build.
    """

    def __init__(self) -> None:
        self.requests = 0  # outputs compared with their request generated alone
        self.tokens = 0  # the tokens of those outputs

    def alone(self, outputs: Any, alone: Any, what: str = "outputs") -> int:
        """Assert each of ``outputs`` equals the request generated alone, in order; count them.

        Returns how many were compared. ``what`` names them in the error (which request,
        first differing position), the only time a reader would see this check."""
        outputs, alone = [list(o) for o in outputs], [list(a) for a in alone]
        if len(outputs) != len(alone):
            raise AssertionError(f"{what}: {len(outputs)} outputs for {len(alone)} references")
        for i, (got, want) in enumerate(zip(outputs, alone)):
            if got != want:
                at = next((j for j, (g, w) in enumerate(zip(got, want)) if g != w),
                          min(len(got), len(want)))
                raise AssertionError(f"{what}: request {i} differs from the request generated "
                                     f"alone at token {at} ({len(got)} vs {len(want)} tokens)")
        self.requests += len(outputs)
        self.tokens += sum(len(o) for o in outputs)
        return len(outputs)


CHECKS = PageChecks()  # one per kernel, so one per executed page


if __name__ == "__main__":  # python -m minisrv.book: write REPO_URL wherever the book needs it
    from pathlib import Path

    for changed in publish_repository_url(Path(__file__).resolve().parent.parent) or [
            "nothing to change"]:
        print(changed)
