"""The scheduler composed, not inherited: its parts are objects of their own, the loops use
their public calls, and the one admission loop serves the plain and the budgeted step alike."""

from __future__ import annotations

import ast
import importlib
import inspect
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minisrv
from minisrv.configs import LLAMA3_8B
from minisrv.request import Req
from minisrv.sampling import SamplingParams
from minisrv.scheduler import Scheduler
from minisrv.sim import SimBackend

PACKAGE = minisrv.__file__.rsplit("/", 1)[0]
PARTS = ("loop", "forming", "completing", "queues", "lifecycle", "recorder", "overlap",
         "chunked", "admission", "policy", "wide")


@pytest.mark.parametrize("name", PARTS)
def test_no_part_of_the_scheduler_inherits_from_another(name: str) -> None:
    """A class of the scheduler derives from nothing of the scheduler's: each part is read,
    tested and replaced alone (an ``AdmissionRule``'s rules implement its interface)."""
    module = importlib.import_module(f"minisrv.scheduler.{name}")
    for cls in vars(module).values():
        if not inspect.isclass(cls) or cls.__module__ != module.__name__:
            continue
        inherited = [base for base in cls.__mro__[1:]
                     if base.__module__.startswith("minisrv.scheduler")
                     and not inspect.isabstract(base)]
        assert inherited == [], f"{cls.__name__} inherits {inherited}"


@pytest.mark.parametrize("path", ["scheduler/overlap.py", "engine.py"])
def test_the_loops_touch_no_private_attribute_of_another_object(path: str) -> None:
    """``x._name`` only for ``x`` = ``self``: the overlapped loop and the engine drive the
    scheduler through its parts' public calls."""
    tree = ast.parse(open(f"{PACKAGE}/{path}").read())
    private = [ast.unparse(node) for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr.startswith("_")
               and not node.attr.startswith("__")
               and not (isinstance(node.value, ast.Name) and node.value.id == "self")]
    assert private == []


def test_the_scheduler_forwards_nothing_to_its_parts() -> None:
    """A value has one home: a caller reads ``sched.queues.waiting`` or
    ``sched.recorder.clock``, not a scheduler property that forwards there. Its only
    properties are its own backend (the setter tells the parts that call it) and ``idle``,
    which the overlapped loop has too."""
    properties = {name for name, value in vars(Scheduler).items()
                  if isinstance(value, property)}
    assert properties == {"backend", "idle"}


def _trace(budget: int | None, mode: str, policy: str, lens: list[tuple[int, int]],
           kv_capacity: int) -> list[tuple]:
    sched = Scheduler(SimBackend(LLAMA3_8B), kv_capacity=kv_capacity, max_running=3,
                      mode=mode, policy=policy, cache="radix", seed=7, debug=True,
                      chunked_prefill_size=budget)
    rng = random.Random(len(lens))
    for rid, (n_prompt, n_new) in enumerate(lens):
        prompt = [0, *(rng.randrange(1, 4) for _ in range(n_prompt))]  # shared prefixes
        sched.submit(Req(rid, prompt, SamplingParams(max_new_tokens=n_new, ignore_eos=True),
                         arrival=rid % 3))
    sched.run()
    assert sched.idle
    sched.check_integrity()
    return [(r.prefill, r.decode, r.retracted, r.finished) for r in sched.recorder.trace]


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 8)), min_size=1,
                     max_size=8),
       mode=st.sampled_from(["prefill-first", "mixed"]),
       policy=st.sampled_from(["fcfs", "lpm", "random"]),
       kv_capacity=st.integers(40, 120))
def test_a_budget_no_step_reaches_forms_the_steps_of_no_budget(lens, mode, policy,
                                                                  kv_capacity) -> None:
    """``admit`` and ``admit_chunks`` share one admission loop: under a budget larger than
    any step, the budgeted step admits, decodes, retracts and finishes exactly as the plain
    one (the random policy's draws included)."""
    assert _trace(10**6, mode, policy, lens, kv_capacity) == _trace(
        None, mode, policy, lens, kv_capacity)
