"""The pages chapter's retraction runs: requests pushed out of a pool of pages, served again
with no prefix cache, with the radix tree, and with the tree and a host tier, counting what each
throws away, recomputes and loads back. Kept apart from ``minisrv.experiments.pages`` (one
run per page size, ``page_run``), which it calls."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from minisrv.experiments.pages import BLOCK_SIZE, PageRun, page_run
from minisrv.workloads import Workload

__all__ = ["PREEMPT_SETTINGS", "preemption_runs", "preemption_table"]

PREEMPT_SETTINGS = (("radix", BLOCK_SIZE, 0), ("radix", BLOCK_SIZE, 100_000))
"""(cache, page size, host tier tokens) of the preemption runs: the tree at vLLM's block size,
without and with a host tier of 100,000 tokens."""


def preemption_runs(backend: Any, workload: Workload,
                    settings: Sequence[tuple[str, int, int]] = PREEMPT_SETTINGS,
                    no_cache: PageRun | None = None,
                    **options: Any) -> dict[tuple[str, int, int], PageRun]:
    """``page_run`` of ``workload`` under each (cache, page size, host tier) of ``settings``
    (a pool small enough that requests are retracted, through ``options``), keys counted
    by no tile. ``no_cache``: the run without a prefix cache, served already with the same
    options at a page size of ``settings``; it comes first, as ``("none", its page size, 0)``."""
    runs = {}
    if no_cache is not None:
        if no_cache.page_size not in {size for _, size, _ in settings}:
            raise ValueError(f"the run without a cache is at pages of {no_cache.page_size}, "
                             f"none of the settings' page sizes: {settings}")
        runs["none", no_cache.page_size, 0] = no_cache
    for cache, size, host in settings:
        runs[cache, size, host] = page_run(backend, workload, size, cache, tile_every=0,
                                           host_cache_tokens=host, **options)
    return runs


def preemption_table(runs: Mapping[tuple[str, int, int], PageRun],
                     workload: Workload) -> pd.DataFrame:
    """Retractions, the computed tokens they threw away, tokens prefilled and, of those,
    recomputed (beyond the prompts of ``workload``, named in the index), and tokens loaded
    back from the host tier, one row per (cache, page size, host tier) of ``runs``; a page
    size that every run shares is named once, in the index."""
    names = {"none": "no prefix cache", "radix": "radix tree", "blocks": "block cache"}
    prompts = sum(map(len, workload.prompts))
    sizes = {size for _, size, _ in runs}
    rows = {}
    for (cache, size, host), run in runs.items():
        label = names.get(cache, cache) + ("" if len(sizes) == 1 else f", pages of {size}")
        label += f", host tier of {host:,} tokens" if host else ""
        rows[label] = {"retractions": run.retractions,
                       "thrown away (tokens)": run.wasted_tokens,
                       "prefilled (tokens)": run.prefill_tokens,
                       "recomputed (tokens)": run.prefill_tokens - prompts,
                       "loaded back (tokens)": run.loaded_tokens}
    frame = pd.DataFrame.from_dict(rows, orient="index")
    shared = f", pages of {next(iter(sizes))}" if len(sizes) == 1 else ""
    frame.index.name = f"cache{shared} (prompts: {prompts:,} tokens)"
    return frame
