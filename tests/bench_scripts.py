"""The scripts of ``benchmarks/`` (a folder of scripts, not a package) imported as modules,
for the tests of their parts that run without their competitors or a GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

FOLDER = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, FOLDER / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
