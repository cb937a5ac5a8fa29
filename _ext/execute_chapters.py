"""Execute chapters into the book's execution cache, one kernel per core, before the build.

``jupyter-book build`` (MyST-NB's ``cache`` mode) executes each notebook when Sphinx reads it,
one after another, and a chapter's kernel keeps about one core busy: its scheduling is Python
and the Makefile gives each kernel one torch thread here. This script executes the chapters
it is given with the same call MyST-NB makes (``jupyter_cache``'s ``single_nb_execution``, in
the chapter's folder, errors not allowed, the same cell timeout) on a pool of processes, and
stores each result in the same cache, under the same key, so the build finds it and executes
only what is not there. The chapters whose printed verdicts time the machine's wall clock are
not given to it (the Makefile's ``TIMED_CHAPTERS``): the build runs them alone afterwards.

    python _ext/execute_chapters.py _build/.jupyter_cache chapters/01.ipynb chapters/02.ipynb ...

A chapter that fails stops the build here with the failing cell's traceback.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parent.parent


def cell_timeout() -> int:
    return int(yaml.safe_load((ROOT / "_config.yml").read_text())["execute"]["timeout"])


def execute(path: str, timeout: int) -> tuple[str, float, str | None, nbformat.NotebookNode]:
    from jupyter_cache.executors.utils import single_nb_execution

    nb = nbformat.read(path, as_version=4)
    result = single_nb_execution(nb, cwd=str(Path(path).resolve().parent), timeout=timeout,
                                 allow_errors=False, meta_override=True)
    return path, result.time, result.exc_string if result.err else None, nb


def main(cache_path: str, paths: list[str]) -> int:
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    cache = get_cache(cache_path)
    timeout = cell_timeout()
    # Largest first: the pool then ends with short chapters instead of one long one alone.
    paths = sorted(paths, key=lambda p: -os.path.getsize(p))
    start, failed = time.time(), []
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = [pool.submit(execute, path, timeout) for path in paths]
        for future in as_completed(futures):
            path, seconds, error, nb = future.result()
            if error:
                failed.append(path)
                print(f"{path} failed after {seconds:.0f} s:\n{error}", file=sys.stderr)
                continue
            record = cache.add_nb_to_project(path)
            cache.cache_notebook_bundle(CacheBundleIn(nb, record.uri,
                                                      data={"execution_seconds": seconds}),
                                        check_validity=False, overwrite=True)
            print(f"executed {path} in {seconds:.0f} s", flush=True)
    print(f"{len(paths) - len(failed)} chapters executed in {time.time() - start:.0f} s "
          f"on {os.cpu_count()} processes")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2:]))
