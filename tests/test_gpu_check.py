"""``make gpu-check`` executes every chapter on a GPU without comparing saved outputs
(``tests/nbval_execute_only.py``): a checked cell whose output differs passes there, and
fails under the plain nbval run of ``make test``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_nbval(folder: Path, *plugin: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
            "--nbval-current-env", *plugin, "-c", str(folder / "pytest.ini"), str(folder)]
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize(("plugin", "outcome"), [((), "1 failed"),
                                                  (("-p", "tests.nbval_execute_only"), "1 passed")])
def test_execute_only_runs_cells_but_compares_nothing(tmp_path: Path, plugin: tuple,
                                                       outcome: str) -> None:
    cell = nbformat.v4.new_code_cell("print(1 + 1)", execution_count=1)
    cell.metadata["tags"] = ["nbval-check-output"]
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="3\n")]  # stale
    nb = nbformat.v4.new_notebook(cells=[cell])
    nbformat.write(nb, tmp_path / "chapter.ipynb")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    result = run_nbval(tmp_path, *plugin)
    assert outcome in result.stdout, result.stdout[-2000:]


def test_execute_only_still_fails_a_cell_that_raises(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 / 0")])
    nbformat.write(nb, tmp_path / "chapter.ipynb")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    result = run_nbval(tmp_path, "-p", "tests.nbval_execute_only")
    assert "1 failed" in result.stdout and "ZeroDivisionError" in result.stdout
