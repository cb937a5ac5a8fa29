"""Every chapter runs as on Colab: a bare Python with torch, then the chapter's own first cell.

A Colab runtime has torch, a Jupyter kernel and nothing of ours. The chapter's first cell
(``minisrv.book.setup_cell``) must install everything the chapter imports; a chapter that
forgets an extra stops at its first import there, while the book build, which has every
extra installed, never notices. So this test builds such a runtime: a fresh venv with only
torch (the version of this environment, so nothing is downloaded twice) and ``ipykernel``,
and executes each chapter outside the repository with its setup cell pointed at a copy of
this checkout instead of the repository URL. Chapters that install the same extras share one
venv, as one Colab runtime would serve them; a chapter with other extras gets a fresh one.

It takes minutes (three venvs, every chapter executed), so ``make test`` skips it and
``make colab-check`` (run by CI) runs it: ``MINISRV_COLAB_CHECK=1 pytest tests/test_colab.py``.

The chapters whose verdicts compare wall-clock runs (the Makefile's ``TIMED_CHAPTERS``, passed
as ``MINISRV_TIMED_CHAPTERS``) get one more run when a cell fails, as ``make test`` gives
them: one stall of a shared machine can fail a comparison that holds on every other run (08's
bench median gap against one streamed request's failed so once), and a real regression fails
both runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from cell_guard import execute
from nbclient.exceptions import CellExecutionError

from minisrv import book

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
KERNEL = "minisrv-colab"
INSTALL_TIMEOUT = 600
"""Seconds for a chapter's setup cell in a bare runtime: pip downloads and installs its extras."""

TIMED = {Path(name).stem for name in os.environ.get("MINISRV_TIMED_CHAPTERS", "").split()}
"""Chapters with wall-clock verdicts, run a second time if the first run fails."""

pytestmark = pytest.mark.skipif(
    os.environ.get("MINISRV_COLAB_CHECK") != "1",
    reason="minutes long: `make colab-check` runs it (MINISRV_COLAB_CHECK=1)",
)


def bare_runtime(where: Path) -> Path:
    """A venv with torch and a Jupyter kernel only, its kernelspec under ``where/share``."""
    import torch

    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    torch_version = torch.__version__.split("+")[0]
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, f"torch=={torch_version}", "ipykernel"], check=True)
    subprocess.run([str(python), "-m", "ipykernel", "install", "--prefix", str(where),
                    "--name", KERNEL], check=True, capture_output=True)
    return where


class Runtimes(dict):
    """Bare runtimes by the extras their chapters install, each made when first asked for."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.factory = factory

    def __missing__(self, extras: tuple[str, ...]) -> Path:
        self[extras] = bare_runtime(self.factory.mktemp("colab-" + "-".join(extras)))
        return self[extras]


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory: pytest.TempPathFactory) -> Runtimes:
    return Runtimes(tmp_path_factory)


# What a clone of the repository would not hold: environments, builds, caches.
NOT_IN_A_CLONE = (".git", ".venv", "_build", "build", "*.egg-info", "__pycache__",
                  ".hypothesis", ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints")


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of this checkout as a clone would hold it, for pip to build from.

    pip builds a local directory in place, leaving ``build/`` behind, and setuptools packs
    whatever ``build/lib`` still holds from an earlier build: a copy keeps both away.
    """
    copy = tmp_path_factory.mktemp("checkout") / "minisrv"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(*NOT_IN_A_CLONE))
    return copy


def pointed_at(cell: str, checkout: Path) -> str:
    """The setup cell with the repository URL replaced by ``checkout`` (as a pip URL)."""
    remote = f"git+{book.REPO_URL}"
    assert remote in cell, "the setup cell must install from the repository"
    return cell.replace(remote, checkout.as_uri())


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_runs_in_a_bare_colab_like_runtime(
    path: Path, runtimes: Runtimes, checkout: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runtime = runtimes[book.chapter_extras(path.stem)]
    for variable in ("PYTHONPATH", "MINISRV_DEVICE", "VIRTUAL_ENV"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("JUPYTER_PATH", str(runtime / "share" / "jupyter"))
    monkeypatch.setenv("PATH", f"{runtime / 'venv' / 'bin'}{os.pathsep}{os.environ['PATH']}")

    def run() -> None:
        nb = nbformat.read(path, as_version=4)
        nb.cells[0].source = pointed_at(nb.cells[0].source, checkout)
        # A cell silent for 120 s fails, naming the chapter and the cell (tests/cell_guard.py);
        # the setup cell, which pip-installs the chapter's extras here, gets INSTALL_TIMEOUT.
        execute(nb, path, timeouts={0: INSTALL_TIMEOUT}, kernel_name=KERNEL,
                resources={"metadata": {"path": str(tmp_path)}})

    try:
        run()
    except CellExecutionError as first:
        if path.stem not in TIMED:
            raise
        print(f"{path.stem}: run again after\n{first}")
        run()
    probe = subprocess.run(
        [str(runtime / "venv" / "bin" / "python"), "-c", "import minisrv; print(minisrv.__file__)"],
        cwd=tmp_path, check=True, capture_output=True, text=True,
    )
    assert str(ROOT) not in probe.stdout and str(checkout) not in probe.stdout  # installed
