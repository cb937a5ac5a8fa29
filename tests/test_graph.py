"""Graph-ready decode (``minisrv.runner.graph``): decode steps over static buffers padded to
a batch bucket give the flat path's tokens; padding never reaches a request's row or slot;
``cuda_graph`` is refused off CUDA. The CUDA capture itself is not run here (no GPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minisrv.core import Batch
from minisrv.engine import Engine, EngineConfig
from minisrv.model import FlatBatch
from minisrv.request import Req
from minisrv.runner import ModelRunner
from minisrv.runner.attention import BACKENDS, PaddedAttention, make_attention
from minisrv.runner.graph import DecodeGraphs, batch_buckets
from minisrv.sampling import SamplingParams

MODEL_SEED = 3


def test_buckets_are_powers_of_two_then_multiples_of_eight() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(5) == (1, 2, 4, 5)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 24)
    assert batch_buckets(256)[-3:] == (240, 248, 256) and len(batch_buckets(256)) == 35
    with pytest.raises(ValueError, match="max_running"):
        batch_buckets(0)


@given(st.integers(1, 300))
def test_every_batch_size_has_the_smallest_bucket_that_holds_it(max_running: int) -> None:
    buckets = batch_buckets(max_running)
    assert list(buckets) == sorted(set(buckets)) and buckets[-1] >= max_running
    assert all(b % 8 == 0 for b in buckets if b > 8)
    assert buckets[-1] - max_running < 8


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(n)
    return [[0, *torch.randint(2, 60, (int(k),), generator=gen).tolist()]
            for k in torch.randint(1, 12, (n,), generator=gen)]


@pytest.mark.parametrize("max_running", [3, 8, 11])
@pytest.mark.parametrize("overlap", [False, True])
def test_padded_decode_gives_the_flat_paths_tokens(model, max_running: int,
                                                   overlap: bool) -> None:
    """Greedy and sampling requests of many lengths (some with a penalty, some asking for
    logprobs): the running batch shrinks through several buckets as they finish, with and
    without the overlapped loop's future ids."""
    prompts = _prompts(14)
    params = [SamplingParams(max_new_tokens=3 + 5 * (i % 6), temperature=0.9 * (i % 3 == 0),
                             seed=i,
                             # penalties read outputs, which the overlapped loop keeps as
                             # future ids until resolved (IndexError on main: reported)
                             repetition_penalty=1.3 if i % 4 == 1 and not overlap else 1.0,
                             logprobs=2 if i % 5 == 2 else None) for i in range(len(prompts))]
    options = dict(max_running=max_running, kv_capacity=600, mode="mixed", overlap=overlap)
    eager = Engine(ModelRunner(model, "padded"), **options).generate(prompts, sampling=params)
    runner = ModelRunner(model, "padded", static_decode=True, max_running=max_running)
    engine = Engine(runner, **options)
    assert engine.generate(prompts, sampling=params) == eager
    assert runner.graphs is not None and runner.graphs.max_batch >= max_running
    decodes = [r for r in engine.trace if r.decode and not r.prefill]
    assert len({len(r.decode) for r in decodes}) >= 3  # batch sizes crossing buckets


def _decoding(runner: ModelRunner, lengths: list[int]) -> list[Req]:
    """Requests whose prompts sit in the pool, each with one output token and its slot."""
    reqs = [Req(rid=i, prompt=[0, *range(5, 4 + n)], params=SamplingParams(max_new_tokens=4))
            for i, n in enumerate(lengths)]
    for req in reqs:
        req.kv_slots = runner.pool.alloc(req.prompt_len)
    for req, tokens in zip(reqs, runner.run(Batch.of(reqs, [])).tokens, strict=True):
        req.output.extend(tokens)
        req.kv_slots += runner.pool.alloc(1)
    return reqs


@pytest.mark.parametrize("n", [1, 3, 5, 9])
def test_padding_rows_touch_no_request(model, n: int) -> None:
    """A decode of ``n`` requests padded to its bucket: the real rows' logits are the flat
    forward's, whatever sits in the scratch slot, and the step writes the pool only at the
    requests' new slots and the scratch slot."""
    runner = ModelRunner(model, "padded", static_decode=True, max_running=16)
    runner.attach_kv(200)
    pool, graphs = runner.pool, runner.graphs
    reqs = _decoding(runner, [2 + 3 * i for i in range(n)])
    step = runner.prepare(Batch.of([], reqs))
    assert step.flat is None and step.metadata.bucket == graphs.bucket(n) >= n
    pool.kv[:, pool.scratch_slot] = 1e4  # garbage a real row must never see
    before = pool.kv.clone()
    got = graphs.run(step.metadata)
    changed = (pool.kv != before).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
    new_slots = sorted(req.kv_slots[-1] for req in reqs)
    padded = step.metadata.bucket > n
    assert changed == new_slots + [pool.scratch_slot] * padded
    flat = FlatBatch([req.output[-1:] for req in reqs], [req.kv_slots for req in reqs],
                     model.device)
    pool.kv.copy_(before)
    want = model.forward_flat(flat, pool, attention="padded", last_only=True)
    torch.testing.assert_close(got, want)
    assert got.shape == (n, model.config.vocab_size)


def test_prefill_and_mixed_steps_stay_on_the_flat_path(model) -> None:
    runner = ModelRunner(model, "padded", static_decode=True, max_running=4)
    runner.attach_kv(100)
    reqs = _decoding(runner, [3, 4])
    fresh = Req(rid=7, prompt=[0, 9, 9], params=SamplingParams(max_new_tokens=2))
    fresh.kv_slots = runner.pool.alloc(3)
    assert runner.prepare(Batch.of([fresh], reqs)).flat is not None
    assert runner.prepare(Batch.of([], reqs)).flat is None
    long_ctx = ModelRunner(model, "padded", static_decode=True, max_running=4, graph_context=4)
    long_ctx.attach_kv(100)
    reqs = _decoding(long_ctx, [3, 4])  # a context of 5 slots: past graph_context
    assert long_ctx.prepare(Batch.of([], reqs)).flat is not None


def test_cuda_graph_is_refused_off_cuda(model) -> None:
    if model.device.type == "cuda":
        pytest.skip("on CUDA cuda_graph is allowed")
    with pytest.raises(ValueError, match="CUDA"):
        ModelRunner(model, cuda_graph=True)
    with pytest.raises(ValueError, match="CUDA"):
        Engine(model, cuda_graph=True)
    with pytest.raises(ValueError, match="CUDA"):
        EngineConfig(cuda_graph=True, device="cpu")
    with pytest.raises(ValueError, match="cuda_graph"):
        EngineConfig(cuda_graph="yes")
    runner = ModelRunner(model, "padded", static_decode=True)
    runner.attach_kv(10)
    assert runner.graphs.context == 10  # no wider than the pool: no context outgrows it
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(model, runner.pool, 4, attention=runner.attn, cuda_graph=True)
    with pytest.raises(ValueError, match="max_seq_len"):
        DecodeGraphs(model, runner.pool, 4, attention=runner.attn,
                     context=model.config.max_seq_len + 1)
    assert EngineConfig().cuda_graph is False  # off by default until a GPU run passes


def test_the_padded_decode_reads_nothing_back() -> None:
    """Copying a step into the static buffers and the forward over them run whole on the
    meta device (any read-back raises there), as a CUDA graph's capture requires."""
    from minisrv.configs import CITYLM
    from minisrv.model import CityLM

    with torch.device("meta"):
        meta = CityLM(CITYLM).eval()
    runner = ModelRunner(meta, "padded", static_decode=True, max_running=8)
    runner.attach_kv(64)
    reqs = [Req(rid=i, prompt=[1, 2, 3][: i + 1], params=SamplingParams(max_new_tokens=3))
            for i in range(3)]
    for req in reqs:
        req.kv_slots = runner.pool.alloc(req.prompt_len + 1)
        req.output.append(-1 - req.rid)  # future ids, as the overlapped loop hands them
    step = runner.prepare(Batch.of([], reqs))
    assert step.flat is None and step.has_futures and step.metadata.bucket == 4
    logits = runner.graphs.run(step.metadata, resolve=lambda ids: ids.abs())
    assert logits.device.type == "meta" and logits.shape == (3, CITYLM.vocab_size)


def test_static_decode_goes_through_the_attention_backends_hooks(model) -> None:
    """The padded backend's own hooks fill and read the static buffers; for a backend
    without hooks (the loop) the runner gives the graphs the padded backend, and the graphs
    build no backend of their own: given one without hooks, they refuse it."""
    padded = ModelRunner(model, "padded", static_decode=True, max_running=4)
    padded.attach_kv(64)
    assert padded.graphs is not None and padded.graphs.attention is padded.attn
    assert padded.graphs.hooks is padded.attn.graphs
    loop = ModelRunner(model, "loop", static_decode=True, max_running=4)
    loop.attach_kv(64)
    assert loop.attn.graphs is None and loop.graphs is not None
    assert isinstance(loop.graphs.attention, PaddedAttention)
    with pytest.raises(ValueError, match="'loop' has no static decode hooks"):
        DecodeGraphs(model, loop.pool, 4, attention=loop.attn)


def test_the_registry_builds_each_backend_by_its_name() -> None:
    for kind in ("loop", "padded", "flex"):
        backend = make_attention(kind, torch.device("cpu"), torch.float32, 32, 2)
        assert backend.kind == kind and BACKENDS[kind] is not None
    with pytest.raises(ValueError, match="unknown attention"):
        make_attention("flash", torch.device("cpu"), torch.float32, 32, 2)
