"""The package's layout rules: no import cycle, small modules, a small top level, and the
serving runtime apart from the book side.

The import walk reads every module's ast (nothing is imported), resolves each ``minisrv.*``
import to the module it names and sorts it by where it runs: at module level, inside a
function (run on first call), or under ``if TYPE_CHECKING:`` (never run). Only module-level
imports can form a cycle that breaks loading; the others are listed separately.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

import minisrv

PACKAGE = Path(minisrv.__file__).parent
ROOT = PACKAGE.parent
MAX_LINES = 400
MAX_TOP_LEVEL = 12
# The book side: what the chapters use to explain and measure the runtime. ``train`` holds
# the city language the model is trained on and the workloads are written in.
BOOK_SIDE = ("minisrv.workloads", "minisrv.experiments", "minisrv.viz", "minisrv.sim",
             "minisrv.book", "minisrv.train")
HEAVY = ("pandas", "matplotlib", "ipywidgets", "graphviz")
# The serving runtime: subpackages and top-level modules that import nothing from the book.
RUNTIME = ("core", "scheduler", "kv", "model", "runner", "spec", "grammar", "router", "server",
           "engine", "request", "sampling", "tokenizer", "checks", "configs", "kvsize", "metrics")
UNTIL_RUNTIME = "until the runtime branch lands"
RUNTIME_NOT_YET: dict[str, str] = {}
# The load generator of ``minisrv bench`` is a client, not part of what serves: it draws its
# requests from the book's workloads, inside the function that builds them. The server's
# process never loads it (``test_the_runtime_loads_nothing_of_the_book``).
CLIENTS = {"minisrv.server.bench"}


class Import(NamedTuple):
    source: str  # the importing module
    target: str  # the minisrv module it names
    kind: str  # "module", "function" or "type-checking"
    line: int


def module_name(path: Path) -> str:
    """``minisrv/a/b.py`` -> ``minisrv.a.b``; a package's ``__init__.py`` -> the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = package_modules()


def _resolve(name: str) -> str:
    """The deepest existing module that ``name`` names (``minisrv.x.Obj`` -> ``minisrv.x``)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str, tree: ast.Module, is_package: bool = False) -> list[Import]:
    """The ``minisrv`` imports of one module's ``tree``, each with where it runs."""
    found: list[Import] = []

    def absolute(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = source.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        return ".".join([*base, *([node.module] if node.module else [])])

    def visit(node: ast.AST, kind: str) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "minisrv":
                    found.append(Import(source, _resolve(alias.name), kind, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            module = absolute(node)
            if module.split(".")[0] == "minisrv":
                for alias in node.names:
                    found.append(Import(source, _resolve(f"{module}.{alias.name}"), kind,
                                        node.lineno))
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, "type-checking")
            for child in node.orelse:
                visit(child, kind)
            return
        inner = "function" if isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) else kind
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, "module")
    return found


def all_imports() -> list[Import]:
    """Every ``minisrv`` import in the package (self-imports of a package left out)."""
    out = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        out += [i for i in imports_of(name, tree, path.name == "__init__.py")
                if i.target != i.source]
    return out


IMPORTS = all_imports()


def cycles(edges: list[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def on_book_side(name: str) -> bool:
    return any(name == b or name.startswith(b + ".") for b in BOOK_SIDE)


# ----------------------------------------------------------------------------- the walk
def test_the_walk_sorts_imports_by_where_they_run() -> None:
    code = (
        "from typing import TYPE_CHECKING\n"
        "import minisrv.engine\n"
        "from minisrv.scheduler import Scheduler\n"
        "if TYPE_CHECKING:\n"
        "    from minisrv.request import Req\n"
        "class A:\n"
        "    from minisrv import sampling\n"
        "    def f(self):\n"
        "        from minisrv.server.app import create_app\n"
        "g = lambda: __import__('os')\n"
        "from . import checks\n"
    )
    found = imports_of("minisrv.x", ast.parse(code))
    assert [(i.target, i.kind) for i in found] == [
        ("minisrv.engine", "module"),
        ("minisrv.scheduler", "module"),
        ("minisrv.request", "type-checking"),
        ("minisrv.sampling", "module"),
        ("minisrv.server.app", "function"),
        ("minisrv.checks", "module"),
    ]


def test_cycles_are_found() -> None:
    assert cycles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [["a", "b", "c"]]
    assert cycles([("a", "b"), ("b", "c")]) == []


def test_the_walk_reads_the_whole_package() -> None:
    assert {"minisrv.engine", "minisrv.workloads", "minisrv.experiments.routing"} <= set(MODULES)
    kinds = {i.kind for i in IMPORTS}
    assert kinds == {"module", "function", "type-checking"}
    assert all(i.target in MODULES for i in IMPORTS)


# ----------------------------------------------------------------------------- the rules
def test_no_import_cycle_among_module_level_imports() -> None:
    edges = [(i.source, i.target) for i in IMPORTS if i.kind == "module"]
    assert cycles(edges) == []


def _cycles_counting_deferred_imports() -> list[list[str]]:
    """Cycles when an import inside a function counts as much as one at module level: a
    deferred import hides a cycle from the loader, not from the reader."""
    return cycles([(i.source, i.target) for i in IMPORTS if i.kind != "type-checking"])


def test_no_import_cycle_at_all() -> None:
    assert _cycles_counting_deferred_imports() == []


def _module_files() -> Iterator[object]:
    for path in MODULES.values():
        rel = path.relative_to(PACKAGE).as_posix()
        yield pytest.param(path, id=rel)


@pytest.mark.parametrize("path", list(_module_files()))
def test_no_module_over_400_lines(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines"


def test_the_top_level_holds_at_most_12_modules() -> None:
    """The package's own ``__init__`` and ``__main__`` are entry points and not counted."""
    top = sorted(p.name for p in PACKAGE.glob("*.py")
                 if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= MAX_TOP_LEVEL, top


def _loads(module: str) -> list[str]:
    """Book-side and heavy modules a fresh interpreter has after ``import module``."""
    code = (
        f"import sys, {module}\n"
        f"book = {BOOK_SIDE!r}\n"
        f"heavy = {HEAVY!r}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy\n"
        "             or any(m == b or m.startswith(b + '.') for b in book)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return ast.literal_eval(out.stdout.strip())


@pytest.mark.parametrize("module", [
    "minisrv.engine",
    "minisrv.server.app",
    "minisrv.scheduler.overlap",  # the overlapped loop, without the chapter's lanes
])
def test_the_runtime_loads_nothing_of_the_book(module: str) -> None:
    assert _loads(module) == []


def _runtime_params() -> Iterator[object]:
    for name in RUNTIME:
        marks = [pytest.mark.xfail(strict=False, reason=f"{UNTIL_RUNTIME}: {why}")
                 for key, why in RUNTIME_NOT_YET.items() if key == name]
        yield pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("part", list(_runtime_params()))
def test_the_runtime_imports_nothing_of_the_book(part: str) -> None:
    """Static: no import of the book side anywhere in ``part``, run or deferred (imports
    under ``TYPE_CHECKING`` load nothing and are allowed)."""
    name = f"minisrv.{part}"
    if name not in MODULES:
        pytest.fail(f"{name} does not exist")
    inside = [i for i in IMPORTS if (i.source == name or i.source.startswith(name + "."))
              and i.source not in CLIENTS]
    bad = [f"{i.source}:{i.line} -> {i.target} ({i.kind})" for i in inside
           if i.kind != "type-checking" and on_book_side(i.target)]
    assert bad == []


# The layers of the step: its contract (``core.py``: Entry, Batch, BatchResult, Backend,
# Capability) sits below the scheduler, the runner and the simulated GPU, and none of those
# three imports another for it; the engine, which drives the scheduler over a backend, is
# where they meet. Every import counts, run, deferred or for types only: each is a
# dependency a reader has to follow.
LAYERS = {
    "minisrv.core": ("minisrv.scheduler", "minisrv.runner", "minisrv.sim", "minisrv.engine"),
    "minisrv.scheduler": ("minisrv.runner", "minisrv.sim"),
    "minisrv.runner": ("minisrv.scheduler", "minisrv.sim"),
    "minisrv.sim": ("minisrv.scheduler",),
}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def layer_violations(imports: list[Import]) -> list[str]:
    """Each import in ``imports`` that crosses ``LAYERS`` the wrong way."""
    return [f"{i.source}:{i.line} -> {i.target} ({i.kind})" for i in imports
            for part, below in LAYERS.items()
            if _within(i.source, part) and any(_within(i.target, b) for b in below)]


def test_a_layer_violation_is_found_wherever_it_hides() -> None:
    code = ("from typing import TYPE_CHECKING\n"
            "from minisrv.core import Batch\n"
            "if TYPE_CHECKING:\n"
            "    from minisrv.scheduler.records import StepRecord\n"
            "def f():\n"
            "    import minisrv.scheduler.loop\n")
    found = layer_violations(imports_of("minisrv.runner.x", ast.parse(code)))
    assert found == ["minisrv.runner.x:4 -> minisrv.scheduler.records (type-checking)",
                     "minisrv.runner.x:6 -> minisrv.scheduler.loop (function)"]


def test_the_contract_sits_below_the_scheduler_the_runner_and_the_simulated_gpu() -> None:
    assert "minisrv.core" in MODULES
    assert layer_violations(IMPORTS) == []


# ----------------------------------------------------------------------------- the names
def test_every_experiment_is_importable_from_the_package() -> None:
    import importlib

    import minisrv.experiments as experiments

    modules = [n.removeprefix("minisrv.experiments.") for n in MODULES
               if n.startswith("minisrv.experiments.")]
    expected = {name: mod for mod in modules
                for name in importlib.import_module(f"minisrv.experiments.{mod}").__all__}
    assert experiments._PUBLIC == expected
    assert experiments.rate_sweep is importlib.import_module(
        "minisrv.experiments.scheduler").rate_sweep
    with pytest.raises(AttributeError):
        experiments.no_such_experiment  # noqa: B018


def test_the_package_names_the_overlap_chapters_lanes() -> None:
    """The overlap model from ``minisrv`` (the design's public names), its parts from
    ``minisrv.experiments``, where they live: there is no forwarding package."""
    from minisrv.experiments import PARTS, breakdown, lanes

    assert (minisrv.timeline, minisrv.throughput_ratio, PARTS) == (
        lanes.timeline, lanes.throughput_ratio, breakdown.PARTS)
    assert not (PACKAGE / "overlap").exists()


def test_the_public_names_of_the_design_resolve() -> None:
    for name in ("Engine", "EngineConfig", "Router", "load_citylm", "load_model", "RadixCache",
                 "calc_priority", "optimal_hit_rate", "simulate", "simulate_cluster",
                 "timeline", "throughput_ratio"):
        assert callable(getattr(minisrv, name))


def _packages() -> list[str]:
    return sorted("minisrv" + ("." + ".".join(p.parent.relative_to(PACKAGE).parts)
                               if p.parent != PACKAGE else "")
                  for p in PACKAGE.rglob("__init__.py"))


@pytest.mark.parametrize("package", _packages())
def test_every_name_a_package_exports_exists(package: str) -> None:
    """``from package import *`` works: each name in ``__all__`` is there."""
    namespace: dict = {}
    exec(f"from {package} import *", namespace)  # noqa: S102 - the import under test
    exported = getattr(__import__(package, fromlist=["_"]), "__all__", [])
    assert set(exported) <= set(namespace), package


# ----------------------------------------------------------------------------- the map
WALKED = ("scheduler", "kv", "model", "runner", "router", "server")


def test_contributing_walks_one_request_through_every_runtime_module_once() -> None:
    """CONTRIBUTING.md's map names each module of the serving path once: a module added to
    the runtime without a place in the walk fails here, as does one named twice."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    walk = text[text.index("## The map"):text.index("## A chapter notebook")]
    modules = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
               if p.name != "__init__.py" and p.parts[len(PACKAGE.parts)] in WALKED]
    modules += [f"{name}.py" for name in RUNTIME if (PACKAGE / f"{name}.py").exists()]
    counts = {m: len(re.findall(rf"`{re.escape(m)}`", walk)) for m in modules}
    assert {m: n for m, n in counts.items() if n != 1} == {}


def test_the_longest_first_order_names_files_that_exist() -> None:
    """``make test`` hands out the files of ``conftest.LONGEST_FIRST`` first; a renamed file
    would silently drop back to the end of the run."""
    from conftest import LONGEST_FIRST

    files = {p.name for p in (*ROOT.glob("tests/*.py"), *ROOT.glob("chapters/*.ipynb"))}
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert set(LONGEST_FIRST) <= files, set(LONGEST_FIRST) - files
