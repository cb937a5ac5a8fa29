"""The 120 s guard on a notebook cell, for the tests that execute notebooks with nbclient.

A chapter cell runs for tens of seconds at most; one that gives no reply for two minutes is
hung (a kernel waiting on something that will never come), and waiting longer only hides it.
``make book`` (``_config.yml``: ``execute.timeout``) and ``make test`` (pyproject's
``--nbval-cell-timeout``) stop such a cell after the same ``CELL_TIMEOUT``;
``tests/test_notebook_runs.py`` checks that the three agree and that each fails a silent cell.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

CELL_TIMEOUT = 120
"""Seconds a cell may run before the notebook fails; the same in every notebook runner."""


def execute(nb: Any, path: Path, timeout: int = CELL_TIMEOUT,
            timeouts: Mapping[int, int] | None = None, **client: Any) -> None:
    """Execute ``nb`` (read from ``path``) with nbclient, in place. A cell still running after
    ``timeout`` seconds fails the test, naming the notebook, the cell's index and its source.
    ``timeouts`` gives particular cells (by index) their own limit: the Colab check's setup
    cell pip-installs the chapter's extras into a bare runtime, bound by the network, not by
    the chapter. ``client`` goes to ``NotebookClient`` (kernel_name, resources, ...)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError

    limits = dict(timeouts or {})
    started: list[int] = []

    def on_cell_start(cell: Any, cell_index: int) -> None:
        started.append(cell_index)

    def limit(cell: Any) -> int:
        return limits.get(started[-1], timeout)

    runner = NotebookClient(nb, timeout_func=limit, on_cell_start=on_cell_start, **client)
    try:
        runner.execute()  # raises CellExecutionError naming the cell that failed
    except CellTimeoutError:
        index = started[-1]
        pytest.fail(f"{path.name}: cell {index} still ran after {limits.get(index, timeout)} s:"
                    f"\n{nb.cells[index].source}", pytrace=False)
