"""The one table of attention names (``minisrv.runner.attention.BACKENDS``): a new backend is
one class and one registry entry, and the engine runs it by name; ``auto``'s table and the
teaching forms name only registered backends; a backend that cannot run here says so in
its constructor; the configuration leaves the names to the registry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisrv.engine import Engine, EngineConfig
from minisrv.model import ATTENTION_FUNCTIONS
from minisrv.runner import ModelRunner
from minisrv.runner.attention import BACKENDS, make_attention
from minisrv.runner.attention import flex as flex_module
from minisrv.runner.attention.choice import choose_attention
from minisrv.runner.table_batch import TableBatch
from minisrv.sim import SimBackend

MODEL_SEED = 4  # the random CityLM of conftest's `model` fixture

PROMPTS = [[0, 5, 6], [0, 7], [0, 8, 9, 10, 11, 12, 13], [0, 11], [0, 12, 13, 3]]
LENGTHS = [6, 9, 4, 7, 5]


class ToyAttention:
    """A newcomer's backend, written from the interface alone: one SDPA call per request
    over its row of the table, its query heads given their KV head by repetition."""

    kind = "toy"
    graphs = None

    def __init__(self, device: torch.device, dtype: torch.dtype, head_dim: int,
                 n_kv_heads: int) -> None:
        self.device = device

    def prepare(self, batch: TableBatch) -> list[tuple[slice, torch.Tensor, int]]:
        return [(slice(start, start + n), batch.table[row, :end].long(), end - n)
                for start, n, row, end in zip(batch.starts, batch.new_lens, batch.row_list,
                                              batch.contexts)]

    def forward(self, q: torch.Tensor, kv: torch.Tensor,
                metadata: list[tuple[slice, torch.Tensor, int]]) -> torch.Tensor:
        outs = []
        for rows, slots, cached in metadata:
            keys, values = kv[slots, 0].transpose(0, 1), kv[slots, 1].transpose(0, 1)
            group = q.shape[1] // keys.shape[0]
            n = rows.stop - rows.start
            visible = (torch.arange(len(slots), device=q.device)[None, :]
                       <= cached + torch.arange(n, device=q.device)[:, None])
            out = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1), keys.repeat_interleave(group, 0),
                values.repeat_interleave(group, 0), attn_mask=visible)
            outs.append(out.transpose(0, 1).reshape(n, -1))
        return torch.cat(outs)


def test_a_new_backend_is_one_class_and_one_registry_entry(model, monkeypatch) -> None:
    """Registered under its ``kind``, the toy runs an engine by name (mixed steps, a prefix
    cache) and gives every request's tokens alone; static decode, which it has no hooks
    for, runs the padded backend's beside it."""
    monkeypatch.setitem(BACKENDS, ToyAttention.kind, ToyAttention)
    engine = Engine(model, attention="toy", kv_capacity=200, max_running=3, mode="mixed",
                    cache="radix")
    assert isinstance(engine.backend.attn, ToyAttention)
    outputs = engine.generate(PROMPTS, max_new_tokens=LENGTHS)
    alone = [model.reference_generate(p, n) for p, n in zip(PROMPTS, LENGTHS)]
    assert outputs == alone
    engine.scheduler.check_integrity()
    runner = ModelRunner(model, "toy", static_decode=True, max_running=4)
    runner.attach_kv(64)
    assert runner.graphs is not None and runner.graphs.attention.kind == "padded"


def test_every_name_is_the_registrys() -> None:
    """``auto``'s table only chooses registered backends; the teaching forms of
    ``minisrv.model.flat`` are the oracles of registered backends of the same names; each
    registered class answers to its own name."""
    assert all(kind == backend.kind for kind, backend in BACKENDS.items())
    assert set(ATTENTION_FUNCTIONS) <= set(BACKENDS)
    for device_type, capability in (("cpu", None), ("cuda", (7, 5)), ("cuda", (9, 0))):
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            assert choose_attention(device_type, capability, dtype, 64).backend in BACKENDS


def test_an_unknown_name_is_refused_where_the_runner_is_built(model) -> None:
    """The configuration checks only that the name is one (its choices are the registry's,
    which the scheduler does not import); the runner refuses an unknown one, naming the
    registry's, when the engine is built. A simulated GPU has no attention to name."""
    assert EngineConfig(attention="toy").attention == "toy"
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="attention must be"):
            EngineConfig(attention=bad)
    with pytest.raises(ValueError, match="unknown attention 'toy'.*'padded'.*'auto'"):
        Engine(model, attention="toy")
    Engine(SimBackend(), attention="toy")


def test_a_backend_that_cannot_run_here_says_so_when_built(monkeypatch) -> None:
    monkeypatch.setattr(flex_module, "FLEX_AVAILABLE", False)
    with pytest.raises(ValueError, match="attention='flex' needs .*flex_attention"):
        make_attention("flex", "cpu", torch.float32, 32, 2)
