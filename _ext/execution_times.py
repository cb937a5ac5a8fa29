"""How long each chapter took to execute in the last book build, read from jupyter-cache.

``make book`` runs it after ``jupyter-book build`` (also when the build failed):

    python _ext/execution_times.py _build/.jupyter_cache

myst-nb executes every notebook through jupyter-cache (``execute_notebooks: cache``) and
records, per notebook, the seconds its execution took (``execution_seconds`` of the cache
record) or, when it failed, its traceback (on the project record). The table lists every
notebook of the project in the order the build executed them; a slow chapter shows here
before it reaches the 120 s cell limit (``_config.yml``), and a stalled one stands out.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NamedTuple


class Execution(NamedTuple):
    notebook: str
    """The notebook's path, as the build gave it to jupyter-cache (absolute)."""
    seconds: float | None
    """How long its execution took; ``None`` when it failed or has not run as it is now."""
    failed: bool
    """Its last execution raised (a cell's error or the cell time limit)."""


def execution_times(cache_path: Path) -> list[Execution]:
    """Every notebook jupyter-cache knows, in the order they were added (the build's order)."""
    from jupyter_cache import get_cache

    if not (cache_path / "global.db").is_file():
        raise FileNotFoundError(f"no jupyter-cache at {cache_path} (did the build execute?)")
    cache = get_cache(cache_path)
    rows = []
    for record in sorted(cache.list_project_records(), key=lambda r: r.pk):
        cached = cache.get_cached_project_nb(record.pk)
        seconds = (cached.data or {}).get("execution_seconds") if cached else None
        rows.append(Execution(record.uri, seconds, bool(record.traceback)))
    return rows


def table(rows: list[Execution], root: Path) -> str:
    """The rows as aligned text: the notebook relative to ``root``, its seconds (or why it
    has none), then the total of the executed ones."""
    names = [os.path.relpath(row.notebook, root) for row in rows]
    width = max([len(n) for n in names] + [len("total")])
    lines = ["Execution time per notebook (jupyter-cache):"]
    for name, row in zip(names, rows):
        if row.failed:
            shown = "   failed"
        elif row.seconds is None:
            shown = "   not executed"
        else:
            shown = f"{row.seconds:7.1f} s"
        lines.append(f"  {name:<{width}} {shown}")
    total = sum(row.seconds for row in rows if row.seconds is not None)
    lines.append(f"  {'total':<{width}} {total:7.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", type=Path, help="the jupyter-cache folder (_build/.jupyter_cache)")
    parser.add_argument("--root", type=Path, default=Path.cwd(),
                        help="notebooks are shown relative to this folder (default: here)")
    args = parser.parse_args(argv)
    try:
        rows = execution_times(args.cache)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(table(rows, args.root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
