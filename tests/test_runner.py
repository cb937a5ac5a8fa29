"""The model runner: the step's tensors built once in ``prepare``, the attention backends
behind one interface giving ``forward_flat``'s logits, and the logits-processor hook."""

from __future__ import annotations

import pytest
import torch

from minisrv.configs import CITYLM
from minisrv.core import Batch, Entry
from minisrv.engine import Engine
from minisrv.kv import KVPool
from minisrv.model import FLEX_AVAILABLE, FlatBatch
from minisrv.model.flat import ATTENTION_FUNCTIONS
from minisrv.request import Req
from minisrv.runner import FlexAttention, LoopAttention, ModelRunner, PaddedAttention
from minisrv.runner.attention import BACKENDS
from minisrv.sampling import SamplingParams


def _runs_here(backend: type) -> bool:
    """Whether a registered backend can run on this CPU (each says so in its constructor:
    Triton only under its interpreter, flex only where this torch has it)."""
    try:
        backend("cpu", torch.float32, CITYLM.head_dim, CITYLM.n_kv_heads)
    except ValueError:
        return False
    return True


KINDS = [kind for kind, backend in BACKENDS.items() if _runs_here(backend)]
"""Every registered backend that runs here: a new one is tested by registering it."""


def _prefilled(model, runner: ModelRunner, prompts: list[list[int]]) -> list[Req]:
    """Requests whose prompts' KV sit in the runner's pool, each with one output token."""
    reqs = []
    for rid, prompt in enumerate(prompts):
        req = Req(rid=rid, prompt=prompt, params=SamplingParams(max_new_tokens=8))
        req.kv_slots = runner.pool.alloc(len(prompt))
        reqs.append(req)
    result = runner.run(Batch.of(reqs, []))
    for req, tokens in zip(reqs, result.tokens, strict=True):
        req.output.extend(tokens)
    return reqs


@pytest.mark.parametrize("kind", KINDS)
def test_runner_logits_equal_forward_flat_for_every_attention(model, kind: str) -> None:
    """A mixed step (a prefill of 4 tokens after a cached prefix, a decode) through the
    runner's attention backend gives ``CityLM.forward_flat``'s logits."""
    runner = ModelRunner(model, kind)
    runner.attach_kv(64)
    decoding = _prefilled(model, runner, [[0, 5, 9, 13]])[0]
    decoding.kv_slots += runner.pool.alloc(1)
    chunk = Req(rid=9, prompt=[0, 7, 7, 3, 4, 20, 21], params=SamplingParams(max_new_tokens=3))
    chunk.kv_slots = runner.pool.alloc(7)
    runner.run(Batch((Entry(chunk, 0, 3, sample=False),)))  # its first 3 tokens: KV only
    batch = Batch((Entry(chunk, 3, 4), Entry(decoding, 4, 1)), n_prefill=1)
    inputs = runner.prepare(batch)
    got = runner.forward(inputs, inputs.flat.ids)
    pool = KVPool.for_model(model, 64)
    pool.k.copy_(runner.pool.k)
    pool.v.copy_(runner.pool.v)
    flat = FlatBatch([chunk.prompt[3:], decoding.output[-1:]],
                     [chunk.kv_slots, decoding.kv_slots], model.device)
    # the teaching function of the same name, or the padded one for a backend without one
    oracle = kind if kind in ATTENTION_FUNCTIONS else "padded"
    want = model.forward_flat(flat, pool, attention=oracle, last_only=True)
    torch.testing.assert_close(got, want)


def test_a_check_before_a_plain_decode_scores_the_plain_row_first(model) -> None:
    """A step of decodes samples every row, but with checks its rows are ordered plain
    entries' first: a check entry before a plain one must still reorder them (the step
    skips the gather only when the rows are already in order)."""
    from minisrv.spec.drafter import Draft

    runner = ModelRunner(model, "padded")
    runner.attach_kv(64)
    checked, plain = _prefilled(model, runner, [[0, 5, 9, 13], [0, 7, 3]])
    guesses = [11, 12]
    checked.kv_slots += runner.pool.alloc(1 + len(guesses))
    plain.kv_slots += runner.pool.alloc(1)
    batch = Batch((Entry(checked, checked.seq_len - 1, 1 + len(guesses)),
                   Entry(plain, plain.seq_len - 1, 1)), drafts=(Draft(guesses), None))
    inputs = runner.prepare(batch)
    assert inputs.sample_rows.tolist() == [3, 0, 1, 2]
    got = runner.forward(inputs, inputs.flat.ids)
    pool = KVPool.for_model(model, 64)
    pool.k.copy_(runner.pool.k)
    pool.v.copy_(runner.pool.v)
    flat = FlatBatch([[checked.output[-1], *guesses], plain.output[-1:]],
                     [checked.kv_slots, plain.kv_slots], model.device)
    want = model.forward_flat(flat, pool, attention="padded")
    torch.testing.assert_close(got, want[[3, 0, 1, 2]])


def test_prepare_builds_the_attention_metadata_before_layer_zero(model) -> None:
    runner = ModelRunner(model, "padded")
    runner.attach_kv(32)
    req = _prefilled(model, runner, [[0, 4, 5]])[0]
    req.kv_slots += runner.pool.alloc(1)
    inputs = runner.prepare(Batch.of([], [req]))
    assert isinstance(runner.attn, PaddedAttention)
    assert inputs.metadata.groups and inputs.metadata.groups[0].bias.dtype == model.dtype
    assert inputs.flat.ids.device == model.device and not inputs.has_futures
    assert isinstance(ModelRunner(model, "loop").attn, LoopAttention)
    if FLEX_AVAILABLE:
        assert isinstance(ModelRunner(model, "flex").attn, FlexAttention)


def test_a_chunk_that_does_not_sample_gets_no_token(model) -> None:
    runner = ModelRunner(model, "padded")
    runner.attach_kv(16)
    req = Req(rid=0, prompt=[0, 5, 9, 13, 2], params=SamplingParams(max_new_tokens=2))
    req.kv_slots = runner.pool.alloc(5)
    first = runner.run(Batch((Entry(req, 0, 3, sample=False),)))
    rest = runner.run(Batch((Entry(req, 3, 2),), n_prefill=1))
    assert first.tokens == [[]] and first.cost == 3.0
    assert rest.tokens == [model.reference_generate(req.prompt, 1)]


def test_logits_processors_see_the_step_and_change_the_tokens(model) -> None:
    """A processor that forbids each request's greedy token changes every token; one that
    returns the logits unchanged changes nothing."""
    prompts = [[0, 5, 9], [0, 7]]
    plain = Engine(model, max_running=2).generate(prompts, 4)
    seen: list[list[int]] = []

    def identity(logits: torch.Tensor, reqs) -> torch.Tensor:
        seen.append([r.rid for r in reqs])
        return logits

    def forbid_best(logits: torch.Tensor, reqs) -> torch.Tensor:
        best = logits.argmax(-1, keepdim=True)
        return logits.scatter(-1, best, float("-inf"))

    same = Engine(ModelRunner(model, logits_processors=[identity]), max_running=2)
    assert same.generate(prompts, 4) == plain
    assert seen[0] == [0, 1] and all(rids for rids in seen)
    banned = Engine(ModelRunner(model, logits_processors=[forbid_best]), max_running=2)
    changed = banned.generate(prompts, 4, sampling=SamplingParams(ignore_eos=True))
    firsts = [model.reference_generate(p, 1, ignore_eos=True)[0] for p in prompts]
    assert [out[0] for out in changed] != firsts
    assert all(out[0] != first for out, first in zip(changed, firsts, strict=True))


def test_attention_and_device_are_engine_options(model) -> None:
    engine = Engine(model, attention="loop", device=str(model.device))
    assert engine.backend.attention == "loop" and engine.backend.device == model.device
    assert engine.generate([[0, 5, 9]], 3) == [model.reference_generate([0, 5, 9], 3)]
    with pytest.raises(ValueError, match="attention"):
        Engine(model, attention="flash")
    with pytest.raises(ValueError, match="device must be"):
        Engine(model, device=0)
