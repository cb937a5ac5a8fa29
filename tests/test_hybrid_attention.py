"""The hybrid backend (``minisrv.runner.attention.hybrid``): decodes go through the padded
call, prefills through flex's ragged call, a mixed step split between the two on the host
before layer 0; an engine over it gives every request's tokens alone."""

from __future__ import annotations

import pytest

from minisrv.core import Batch, Entry
from minisrv.engine import Engine
from minisrv.model import FLEX_AVAILABLE
from minisrv.request import Req
from minisrv.runner import ModelRunner
from minisrv.runner.attention import FlexAttention, HybridAttention, PaddedAttention
from minisrv.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not FLEX_AVAILABLE, reason="the hybrid's prefills need flex")

PROMPTS = [[0, 5, 6, 7, 8], [0, 5, 6, 9], [0, 12], [0, 5, 6, 7, 8, 14, 15, 16, 17]]
LENGTHS = [7, 3, 9, 5]


def _request(rid: int, prompt: list[int], runner: ModelRunner) -> Req:
    req = Req(rid=rid, prompt=prompt, params=SamplingParams(max_new_tokens=4))
    req.kv_slots = runner.pool.alloc(len(prompt))
    return req


def test_the_steps_kind_picks_the_call(model) -> None:
    """Prefills run flex's ragged call; a step of decodes, however many, the padded call; a
    step of both kinds one of each, the prefills' rows first: the split is made once per
    step, in prepare."""
    runner = ModelRunner(model, "hybrid")
    runner.attach_kv(64)
    first, second = _request(0, [0, 5, 9, 13], runner), _request(1, [0, 7, 3], runner)
    prefill = runner.prepare(Batch.of([first, second], []))
    assert prefill.metadata.calls == ("flex",)
    assert isinstance(prefill.metadata.parts[0].backend, FlexAttention)
    for req, tokens in zip((first, second), runner.compute(prefill).tokens, strict=True):
        req.output.extend(tokens)
        req.kv_slots += runner.pool.alloc(1)
    decodes = runner.prepare(Batch.of([], [first, second]))
    assert decodes.metadata.calls == ("padded",)
    assert isinstance(decodes.metadata.parts[0].backend, PaddedAttention)
    third = _request(2, [0, 8, 8, 8], runner)
    mixed = runner.prepare(Batch((Entry(third, 0, 4), Entry(first, 4, 1)), n_prefill=1))
    assert mixed.metadata.calls == ("flex", "padded")
    assert [p.rows for p in mixed.metadata.parts] == [slice(0, 4), slice(4, 5)]


def test_an_engine_over_the_hybrid_gives_each_requests_tokens_alone(model) -> None:
    """Prefill, mixed and decode-only steps, a shared prefix found in the radix tree: the
    tokens are each request's generated alone, whichever call each step took."""
    engine = Engine(model, attention="hybrid", kv_capacity=200, max_running=3, mode="mixed",
                    cache="radix")
    assert isinstance(engine.backend.attn, HybridAttention)
    assert engine.generate(PROMPTS, max_new_tokens=LENGTHS) == [
        model.reference_generate(p, n) for p, n in zip(PROMPTS, LENGTHS)]
    assert engine.stats.cached_tokens > 0
    engine.scheduler.check_integrity()


def test_the_book_names_the_call_each_step_took(model) -> None:
    """``hybrid_step_calls`` (the GPU appendix's table): a row per step, ``flex`` where the
    step computes more tokens than it has requests and decodes none, ``flex + padded`` where
    a prefill runs beside decodes, ``padded`` where it only decodes or its one prefill is
    one token (request 2, its ``0`` cached); the tokens are each request's alone; any other
    attention is refused."""
    from minisrv.experiments.gpu import hybrid_step_calls

    engine = Engine(model, attention="hybrid", kv_capacity=200, max_running=2, mode="mixed",
                    cache="radix")
    outputs, steps = hybrid_step_calls(engine, PROMPTS, LENGTHS)
    assert outputs == [model.reference_generate(p, n) for p, n in zip(PROMPTS, LENGTHS)]
    assert steps["step"].tolist() == list(range(1, len(engine.trace) + 1))
    ragged = steps["tokens"] > steps["prefills"] + steps["decodes"]
    both = ragged & (steps["decodes"] > 0)
    assert both.any()  # a prefill beside a decode: one call of each
    assert (steps["call"][both] == "flex + padded").all()
    assert (steps["call"][ragged & ~both] == "flex").all()
    assert (~ragged & (steps["prefills"] > 0)).any()  # a one-token prefill: padded
    assert "prepare" not in vars(engine.backend.attn)  # the recording is taken off again
    again = Engine(model, attention="hybrid", kv_capacity=200, max_running=2, mode="mixed",
                   cache="radix")
    _, named = hybrid_step_calls(again, PROMPTS, LENGTHS, names={"flex": "ragged"})
    assert named["call"].tolist() == steps["call"].str.replace("flex", "ragged").tolist()
    with pytest.raises(ValueError, match="not the hybrid"):
        hybrid_step_calls(Engine(model, kv_capacity=200), PROMPTS, 2)
