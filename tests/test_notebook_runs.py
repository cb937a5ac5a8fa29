"""How the book's notebooks are run: the 120 s cell guard of every runner, and the execution
times ``make book`` prints at its end.

The guard: ``make book``, ``make test`` and ``make colab-check`` each fail a notebook whose
cell runs on silently, naming the notebook and the cell, instead of waiting for ever. Each
runner is checked twice: its configuration says 120 s, and a notebook whose cell sleeps
longer than a short limit, run through the same runner and configuration, fails with a
message that names the notebook and shows the cell. (The short limit comes in the way each
runner takes an override: the notebook's own ``execution.timeout`` metadata for the book,
a later ``--nbval-cell-timeout`` for nbval, the ``timeout`` argument for the Colab check.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import tomllib
import yaml
from cell_guard import CELL_TIMEOUT, execute

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SHORT = 1
"""The limit the sleeping cell overruns (seconds): the failure comes after this wait, in each
of the three runners, so it is short; the cell before it only prints."""
SLEEPER = "import time\ntime.sleep(60)  # the silent cell"


def notebook(folder: Path, name: str, *sources: str, timeout: int | None = None) -> Path:
    """``folder/name.ipynb``: a title, then one code cell per source."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    if timeout is not None:
        nb.metadata["execution"] = {"timeout": timeout}
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {name}"),
                *(nbformat.v4.new_code_cell(source) for source in sources)]
    path = folder / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


def sleeper(folder: Path, timeout: int | None = None) -> Path:
    """``folder/sleeper.ipynb``: a cell that prints, then the silent cell."""
    return notebook(folder, "sleeper", "print('awake')", SLEEPER, timeout=timeout)


@pytest.fixture(scope="module")
def built_book(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A two-page book built by ``make book``'s command with the project's ``_config.yml``
    (the dummy builder: notebooks are executed when read; no page is written): ``quick``
    runs, ``sleeper`` overruns its limit. Returns the book's folder and the build's log."""
    folder = tmp_path_factory.mktemp("book")
    for name in ("_config.yml", "references.bib", "_ext"):
        source = ROOT / name
        copy = shutil.copytree if source.is_dir() else shutil.copy
        copy(source, folder / name)
    (folder / "_toc.yml").write_text(
        "format: jb-book\nroot: quick\nchapters:\n- file: sleeper\n")
    notebook(folder, "quick", "print(sum(range(10)))")
    sleeper(folder, timeout=SHORT)
    build = subprocess.run(
        [str(BIN / "jupyter-book"), "build", "-W", "-n", "--keep-going",
         "--builder", "custom", "--custom-builder", "dummy", str(folder)],
        capture_output=True, text=True, timeout=300)
    assert build.returncode != 0, "the sleeper must fail the build"
    return folder, build.stdout + build.stderr


def test_every_runner_is_configured_to_120_s() -> None:
    assert CELL_TIMEOUT == 120
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["execute"]["timeout"] == CELL_TIMEOUT  # make book
    assert config["execute"]["show_tb"] is True  # the failure shows the cell, not only its type
    pytest_options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    assert f"--nbval-cell-timeout={CELL_TIMEOUT}" in pytest_options["ini_options"]["addopts"]
    colab = (ROOT / "tests" / "test_colab.py").read_text()
    assert "from cell_guard import execute" in colab and "NotebookClient" not in colab


def test_the_book_build_fails_a_silent_cell_naming_chapter_and_cell(
    built_book: tuple[Path, str],
) -> None:
    _, log = built_book
    assert "sleeper.ipynb: WARNING: Executing notebook failed: CellTimeoutError" in log
    assert f"after {SHORT} seconds" in log and SLEEPER in log
    assert "quick.ipynb: WARNING" not in log


def test_nbval_fails_a_silent_cell_naming_notebook_and_cell(tmp_path: Path) -> None:
    """``make test``'s pytest with the project's options (pyproject's addopts)."""
    path = sleeper(tmp_path)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"),
         "--rootdir", str(tmp_path), "-p", "no:xdist", "-q",
         f"--nbval-cell-timeout={SHORT}", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout[-2000:]
    assert "1 failed, 1 passed" in run.stdout
    assert "sleeper.ipynb::Cell 1" in run.stdout  # nbval counts code cells from 0
    assert f"Timeout of {SHORT} seconds exceeded executing cell" in run.stdout


def test_the_colab_check_fails_a_silent_cell_naming_chapter_and_cell(tmp_path: Path) -> None:
    """``tests/test_colab.py``'s runner (``cell_guard.execute``)."""
    path = sleeper(tmp_path)
    nb = nbformat.read(path, as_version=4)
    with pytest.raises(pytest.fail.Exception) as failed:
        execute(nb, path, timeout=SHORT, kernel_name="python3")
    assert str(failed.value) == f"sleeper.ipynb: cell 2 still ran after {SHORT} s:\n{SLEEPER}"
    assert nb.cells[1].outputs[0]["text"] == "awake\n"  # the cells before it ran


def _execution_times():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "execution_times", ROOT / "_ext" / "execution_times.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_book_ends_with_each_notebooks_execution_time(
    built_book: tuple[Path, str], capsys: pytest.CaptureFixture[str],
) -> None:
    folder, _ = built_book
    times = _execution_times()
    recipe = (ROOT / "Makefile").read_text().split("\nbook:")[1].split("\n\n")[0]
    assert "_ext/execution_times.py _build/.jupyter_cache" in recipe
    rows = times.execution_times(folder / "_build" / ".jupyter_cache")
    assert [(Path(r.notebook).name, r.failed) for r in rows] == [
        ("quick.ipynb", False), ("sleeper.ipynb", True)]
    assert rows[0].seconds > 0 and rows[1].seconds is None
    assert times.main([str(folder / "_build" / ".jupyter_cache"), "--root", str(folder)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"  quick.ipynb   {rows[0].seconds:7.1f} s"
    assert lines[2:] == ["  sleeper.ipynb    failed", f"  total         {rows[0].seconds:7.1f} s"]


def test_execution_times_name_a_missing_cache(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert _execution_times().main([str(tmp_path / "nothing")]) == 1
    assert "no jupyter-cache at" in capsys.readouterr().err


def test_the_timed_chapters_are_chapters_and_get_their_rerun_in_both_checks() -> None:
    """A renamed timed chapter would lose its second run (and its place after the others in
    ``make book``) without a word: the Makefile's list must name chapters that exist, and
    ``make colab-check`` must pass it to ``tests/test_colab.py``."""
    makefile = (ROOT / "Makefile").read_text()
    timed = makefile.split("\nTIMED_CHAPTERS := ")[1].split("\n")[0].split()
    assert timed and all((ROOT / name).is_file() for name in timed), timed
    colab = makefile.split("\ncolab-check:")[1].split("\n\n")[0]
    assert 'MINISRV_TIMED_CHAPTERS="$(TIMED_CHAPTERS)"' in colab
    test = makefile.split("\ntest:")[1].split("\n\n")[0]
    assert test.count("pytest $(TIMED_CHAPTERS)") == 2  # the run, and the run again
