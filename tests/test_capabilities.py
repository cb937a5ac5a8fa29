"""A backend declares what it can do; the engine checks that once and never probes it.

Each option that needs more than ``Backend.run`` (the overlapped loop, chunked prefill,
speculative decoding, jump-forward) is refused when the engine is built on a backend that
does not declare it, with a ValueError naming the missing capability and the option; the
step path then calls what it needs without asking (no ``getattr`` on the backend).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from minisrv import Engine
from minisrv.core import Batch, Capability, require
from minisrv.kv.host import make_host_pool
from minisrv.request import Req
from minisrv.runner import ModelRunner, PerRequestBackend
from minisrv.runner.sampler import TokenFollower
from minisrv.scheduler import Scheduler
from minisrv.scheduler.capabilities import needs
from minisrv.scheduler.config import EngineConfig
from minisrv.sim import SimBackend, TimedBackend

PACKAGE = Path(__file__).resolve().parents[1] / "minisrv"
STEP_PATH = [PACKAGE / "engine.py", PACKAGE / "core.py", PACKAGE / "runner" / "device.py",
             PACKAGE / "kv" / "host.py", *sorted((PACKAGE / "scheduler").glob("*.py"))]


class Plain:
    """A backend that computes whole steps and nothing else."""

    time_unit = cost_unit = "step"
    eos_ids: tuple[int, ...] = ()
    max_context = vocab_size = None
    capabilities: frozenset[Capability] = frozenset()

    def attach_kv(self, capacity: int) -> None:
        return None

    def attach_table(self, table: object) -> None:
        pass

    def run(self, batch):  # pragma: no cover - never reached: refused first
        raise AssertionError("a refused backend ran a step")

    def release(self, req) -> None:
        return None


@pytest.mark.parametrize(("options", "missing", "option"), [
    ({"overlap": True}, "prepare() and compute()", "overlap=True"),
    ({"chunked_prefill_size": 64}, "prefill chunks", "chunked_prefill_size"),
    ({"speculative": "ngram"}, "checks drafts", "speculative decoding"),
    ({"jump_forward": True}, "forces (jump-forward)", "jump_forward=True"),
])
def test_an_option_the_backend_cannot_serve_is_refused_when_built(options, missing,
                                                                   option) -> None:
    with pytest.raises(ValueError, match="Plain cannot") as error:
        Engine(Plain(), **options)
    assert missing in str(error.value) and f"{option} needs" in str(error.value)


def test_every_missing_capability_is_named_at_once() -> None:
    with pytest.raises(ValueError) as error:
        Scheduler(Plain(), overlap=True, chunked_prefill_size=64)
    text = str(error.value)
    assert "overlap=True needs" in text and "chunked_prefill_size needs" in text


def test_the_simulated_gpu_declares_what_it_computes() -> None:
    sim = SimBackend()
    assert Capability.SPLITS_STEP in sim.capabilities
    assert Capability.SAMPLES_PROCESSORS not in sim.capabilities
    with pytest.raises(ValueError, match="SimBackend cannot"):
        Engine(sim, jump_forward=True)
    Engine(sim, overlap=True, chunked_prefill_size=64)  # both declared: accepted
    timed = TimedBackend(sim, 0.0)
    assert timed.capabilities == {Capability.SPLITS_STEP, Capability.ENDS_OWN_STEPS,
                                  Capability.COMPUTES_CHUNKS, Capability.TIMES_HOST_COPIES}


def test_a_timed_backend_needs_an_inner_one_that_splits_its_steps(model) -> None:
    with pytest.raises(ValueError, match="inner must be a backend that splits"):
        TimedBackend(PerRequestBackend(model), 0.001)


def test_the_model_runner_declares_all_but_ending_its_own_steps(model) -> None:
    runner = ModelRunner(model)
    assert runner.capabilities == frozenset(Capability) - {Capability.ENDS_OWN_STEPS,
                                                           Capability.TIMES_HOST_COPIES}
    Engine(runner, chunked_prefill_size=64, speculative="ngram")  # accepted


def test_the_host_tier_takes_what_the_backend_declares_and_nothing_else(model) -> None:
    """The device pool the host tier copies and the clock its copies go on come from the
    declared capabilities: an undeclared ``pool`` or ``charge_host_copies`` is not used,
    and a ``TimedBackend`` passes its inner backend's on."""
    config = EngineConfig(cache="radix", host_cache_tokens=64)
    assert make_host_pool(EngineConfig(), SimBackend()) is None  # no tier asked for

    class Undeclared(Plain):
        pool = "a pool nobody declared"

        def charge_host_copies(self, loaded: int, backed_up: int) -> None:
            raise AssertionError("an undeclared clock was charged")

    plain = make_host_pool(config, Undeclared())
    assert plain.device_pool is None and plain.kv is None and plain.on_copy is None

    sim = SimBackend()
    timed = make_host_pool(config, TimedBackend(sim, 0.0))
    assert timed.device_pool is None and timed.on_copy is not None
    timed.on_copy(5, 0)  # the inner simulated GPU's next step pays for the copy
    step = Batch.of([Req(0, [1, 2, 3, 4])], [])
    charged, plain_step = (sim.run(step).elapsed for _ in range(2))
    assert charged - plain_step == pytest.approx(sim.host_copy_seconds(5), rel=1e-9)
    assert sim.host_copy_seconds(5) > 0

    runner = ModelRunner(model)
    runner.attach_kv(32)
    pooled = make_host_pool(config, TimedBackend(runner, 0.0))
    assert pooled.device_pool is runner.pool and pooled.kv is not None
    assert pooled.on_copy is None


def test_grammars_on_a_backend_without_a_sampler_are_refused() -> None:
    with pytest.raises(ValueError, match="simulated GPU"):
        Engine(SimBackend()).grammars()


def test_needs_names_the_option_behind_each_capability() -> None:
    config = EngineConfig(overlap=True, chunked_prefill_size=64)
    assert needs(config) == {Capability.SPLITS_STEP: "overlap=True",
                             Capability.COMPUTES_CHUNKS: "chunked_prefill_size"}
    assert needs(EngineConfig()) == {}
    require(Plain(), {}, "nothing")  # nothing asked: nothing missing


def _backend_probes(path: Path) -> list[str]:
    """``getattr``/``hasattr`` on anything but ``self``, and assignments to an attribute of
    something named ``backend``, in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and node.args
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self")):
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
        if isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and "backend" in ast.unparse(target.value):
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(target)} = ...")
    return found


def test_the_step_path_never_probes_the_backend() -> None:
    assert STEP_PATH[4:], "the scheduler package was not found"
    probes = [probe for path in STEP_PATH for probe in _backend_probes(path)]
    # config.py validates a user's drafter object once, at the boundary (not the backend)
    probes = [p for p in probes if not p.startswith("config.py:") or "spec" not in p]
    assert probes == []


def test_the_probe_finder_finds_a_probe(tmp_path) -> None:
    source = tmp_path / "probe.py"
    source.write_text("def f(backend, self):\n    getattr(backend, 'jump', None)\n"
                      "    getattr(self, 'x')\n    self.backend.jump = 1\n")
    assert sorted(p.split()[0] for p in _backend_probes(source)) == ["probe.py:2", "probe.py:4"]


class Follower(TokenFollower):
    """A token follower that records what the sampler tells it."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.released: list[int] = []

    def __call__(self, logits, reqs):
        return logits

    def accept(self, reqs, tokens) -> None:
        for req, token in zip(reqs, tokens, strict=True):
            self.tokens.setdefault(req.rid, []).append(token)

    def release(self, req) -> None:
        self.released.append(req.rid)


def test_a_token_follower_is_told_every_token_and_every_end(model) -> None:
    """A logits processor declares that it follows tokens by being a ``TokenFollower``; the
    sampler gives it each step's tokens and each request that ends, and no ``hasattr`` on a
    processor decides that in a step."""
    follower = Follower()
    engine = Engine(ModelRunner(model, logits_processors=[follower]), max_running=2)
    out = engine.generate([[0, 5, 9], [0, 7]], 4)
    assert [follower.tokens[rid] for rid in (0, 1)] == out
    assert sorted(follower.released) == [0, 1]
    assert _backend_probes(PACKAGE / "runner" / "sampler.py") == []
