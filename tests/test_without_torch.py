"""The scheduler, the KV layer and the simulated GPU are plain Python: they run without torch.

A run on the simulated GPU computes no tensor, so nothing on its path may import torch at
module level (torch is imported where a tensor is made: a KV pool, a table, a sampler).
Each test runs in a fresh interpreter whose import system refuses torch (and the book's
table and progress-bar libraries, pandas and tqdm, which a run needs no more than it needs
torch), so an import that slips back in fails here, wherever in the chain it hides.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

BLOCKED = ("torch", "pandas", "tqdm")

PRELUDE = f"""
import sys
from importlib.abc import MetaPathFinder

BLOCKED = {BLOCKED!r}


class Unimportable(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
        return None


sys.meta_path.insert(0, Unimportable())
"""

EPILOGUE = """
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert loaded == [], loaded
"""


def run_without_torch(body: str) -> str:
    """Run ``body`` in a fresh interpreter where torch, pandas and tqdm cannot be imported;
    its stdout (the test fails with the traceback if it raised)."""
    code = PRELUDE + textwrap.dedent(body) + EPILOGUE
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_blocker_blocks() -> None:
    """The prelude makes torch unimportable, so the tests below can fail."""
    with pytest.raises(AssertionError, match="No module named 'torch'"):
        run_without_torch("import torch")


@pytest.mark.parametrize("module", [
    "minisrv.core", "minisrv.scheduler", "minisrv.kv", "minisrv.sim", "minisrv.engine",
    "minisrv.experiments.routing", "minisrv.experiments.scheduler",
])
def test_the_simulation_path_imports_without_torch(module: str) -> None:
    run_without_torch(f"import {module}")


def test_a_gpu_scale_run_on_the_simulated_gpu() -> None:
    out = run_without_torch("""
        from minisrv.experiments.scheduler import SimSetting

        run = SimSetting(rate=32.0, n=80).run()
        assert len(run.requests) == 80 and all(r.finished for r in run.requests)
        print(run.metrics.steps, sum(len(r.output) for r in run.requests))
    """)
    steps, tokens = map(int, out.split())
    assert 0 < steps <= tokens


def test_the_cluster_simulation() -> None:
    out = run_without_torch("""
        from minisrv.experiments import simulate_cluster
        from minisrv.workloads import prefix_groups_workload

        result = simulate_cluster(prefix_groups_workload(n=60, n_groups=4, prefix_len=300),
                                  n_workers=2)
        assert sum(result.worker_requests) == 60
        print(result.hit_rate)
    """)
    assert float(out) > 0.5  # four 300-token prefixes shared by 60 requests


def test_the_radix_tree_standalone() -> None:
    out = run_without_torch("""
        from minisrv.kv import RadixCache

        cache = RadixCache()
        cache.insert([1, 2, 3, 4])
        cache.insert([1, 2, 5])
        print(cache.match_prefix([1, 2, 3, 9]).length, cache.match_prefix([7]).length)
    """)
    assert out.split() == ["3", "0"]


def test_the_block_cache_standalone() -> None:
    out = run_without_torch("""
        from minisrv.kv import BlockCache

        cache = BlockCache(page_size=2)
        cache.insert([1, 2, 3, 4, 5])
        print(cache.match_prefix([1, 2, 3, 9]).length, cache.match_prefix([1, 2, 3, 4]).length)
    """)
    assert out.split() == ["2", "4"]
