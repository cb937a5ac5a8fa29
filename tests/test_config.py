"""One configuration for every entry point, the library's invariant check, import hygiene."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys

import pytest

from minisrv.engine import Engine, EngineConfig
from minisrv.scheduler import Scheduler
from minisrv.sim import SimBackend, simulate
from minisrv.workloads import gpu_scale_workload


def test_one_default_per_option_shared_by_engine_scheduler_and_simulate() -> None:
    engine = Engine(SimBackend())
    assert engine.config == EngineConfig()
    assert Scheduler(SimBackend()).config == EngineConfig()
    run = simulate(gpu_scale_workload(n=20, rate=8.0, seed=0), max_running=4)
    assert run.max_running == 4 and run.mode == EngineConfig().mode


def test_a_config_and_options_combine_and_the_config_is_frozen() -> None:
    base = EngineConfig(max_running=4, cache="radix")
    engine = Engine(SimBackend(), base, kv_capacity=500)
    assert (engine.max_running, engine.cache, engine.kv_capacity) == (4, "radix", 500)
    with pytest.raises(AttributeError):
        base.max_running = 8  # type: ignore[misc]


def test_an_unknown_option_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown option max_runing; valid options: kv_capacity"):
        Engine(SimBackend(), max_runing=4)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"new_token_ratio": 1.5}, r"new_token_ratio must be in \[0.0, 1.0\]"),
        ({"min_ratio": 0.9}, r"min_ratio must be in \[0.0, 0.7\]"),
        ({"ratio_decay": -1}, "ratio_decay must be in"),
        ({"max_running": True}, "max_running must be an integer"),
        ({"admission": "greedy"}, "unknown admission 'greedy'; supported values: reserve, budget"),
        ({"debug": 1}, "debug must be True or False"),
    ],
)
def test_bad_values_are_refused_once_with_a_clear_message(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_check_integrity_finds_a_leaked_slot_and_a_stray_lock() -> None:
    engine = Engine(SimBackend(), kv_capacity=100, max_running=2, cache="radix")
    prompts = [[5] * 10 + [6], [5] * 10 + [7]]
    engine.generate(prompts, 3)
    sched = engine.scheduler
    sched.check_integrity()
    leaked = sched.memory.kv.alloc(1)
    with pytest.raises(AssertionError, match="slots leaked"):
        sched.check_integrity()
    sched.memory.kv.free(leaked)
    node = sched.memory.tree.match_prefix(prompts[0]).node
    sched.memory.tree.lock(node)
    with pytest.raises(AssertionError, match="running requests use it"):
        sched.check_integrity()
    sched.memory.tree.unlock(node)
    sched.check_integrity()


def test_debug_mode_checks_every_step() -> None:
    engine = Engine(SimBackend(), kv_capacity=100, max_running=2, debug=True)
    original = engine.scheduler.check_integrity
    calls = []

    def counting() -> None:
        calls.append(1)
        original()

    engine.scheduler.check_integrity = counting  # type: ignore[method-assign]
    engine.generate([[5, 6, 7]], 4)
    assert len(calls) == engine.stats.steps == 4


def imported_by(code: str, *unwanted: str) -> list[str]:
    """The modules that running ``code`` in a fresh interpreter imported and for which each
    expression of ``unwanted`` (of ``m``, a module's name) holds: one printed sorted list per
    expression, all from the one interpreter."""
    checks = "".join(f"print(sorted(m for m in sys.modules if {u}))\n" for u in unwanted)
    probe = f"{code}\nimport sys\n{checks}"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    return out.stdout.strip().splitlines()


# The library as a chapter kernel uses it: every experiments module imported, then a CPU
# engine on CityLM serving a request. One fresh interpreter runs it for the two tests below
# (an interpreter and torch's import cost about 2 s of CPU each time); each test checks
# every module imported by all of it, so each sees at least what it saw alone.
LIBRARY = (
    "import pkgutil, importlib, minisrv.engine, minisrv.experiments\n"
    "for m in pkgutil.iter_modules(minisrv.experiments.__path__):\n"
    "    importlib.import_module('minisrv.experiments.' + m.name)\n"
    "from minisrv.engine import Engine\n"
    "from minisrv.model import load_model\n"
    "model, _ = load_model('citylm', 'cpu')\n"
    "Engine(model, kv_capacity=64, max_running=2).generate([[0, 2]], 3)"
)
DRAWING = ("m.startswith('minisrv.viz') or "
           "m.split('.')[0] in ('matplotlib', 'ipywidgets', 'graphviz')")
COMPILER = "m.startswith(('torch._dynamo', 'torch._inductor'))"


@functools.cache
def library_modules() -> tuple[str, str]:
    """The drawing modules and the compiler's modules that ``LIBRARY`` imported."""
    drawing, compiler = imported_by(LIBRARY, DRAWING, COMPILER)
    return drawing, compiler


def test_the_serving_core_imports_no_drawing_code() -> None:
    assert library_modules()[0] == "[]"


def test_a_cpu_engine_serves_without_importing_the_compiler() -> None:
    """``torch._dynamo`` takes about 2 s to import; every server worker, restarted worker and
    chapter kernel would pay it at start, and a CPU engine on its default attention never
    compiles (eager flex attention on a CPU imports it from torch's side, when first called)."""
    assert library_modules()[1] == "[]"


# What ``minisrv serve`` runs in its HTTP process, up to serving: the flags, the tokenizer,
# the engines' handle (whose workers start with the server) and the app; ``run`` is stubbed.
HTTP_PROCESS = (
    "import minisrv.server.shutdown as shutdown\n"
    "shutdown.DrainingServer.run = lambda self: None\n"
    "from minisrv.server.cli import main\n"
    "main(['serve', '--kv-capacity', '480'])"
)


@functools.cache
def http_process_modules() -> list[str]:
    """The modules of ``minisrv`` and torch that the HTTP process imports (one fresh
    interpreter for both tests below)."""
    [modules] = imported_by(HTTP_PROCESS, "m.startswith(('minisrv', 'torch'))")
    return ast.literal_eval(modules)


def test_the_http_process_of_a_server_imports_no_model_code() -> None:
    """The HTTP process encodes, decodes and routes; the model lives in the workers (a fork
    server imports it once for all of them). Importing the model here would bring torch into
    a process that runs no tensor op, on every server start and restart."""
    model_code = ("minisrv.model", "minisrv.runner", "minisrv.engine")
    assert [m for m in http_process_modules() if m.startswith(model_code)] == []


def test_the_http_process_of_a_server_imports_no_torch() -> None:
    """torch's import is about 1 s of CPU on every server start, and the HTTP process needs
    none of it (see the test above): the scheduler, the KV layer and the sampling parameters
    import it only where a tensor is made."""
    assert [m for m in http_process_modules() if m.split(".")[0] == "torch"] == []
