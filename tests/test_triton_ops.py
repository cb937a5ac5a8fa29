"""The Triton kernels that read the KV pool in place
(``minisrv.runner.attention.triton_ops``) and their backend
(``minisrv.runner.attention.triton``), against plain torch and the padded backend.

Without CUDA the kernels run under Triton's interpreter, which must be switched on before
triton is first imported, and this file's conftest already imports it (``minisrv.model``
imports torch's compiler, which imports triton). So the file runs as its own pytest
invocation with ``TRITON_INTERPRET=1`` in the environment (``make test``:
``TRITON_INTERPRET=1 python -m pytest tests/test_triton_ops.py``), and skips itself, saying
so, where triton was imported compiled on a machine without CUDA. On a GPU the same tests
run compiled, in CUDA tensors.

Tolerances: float32 outputs within 2e-5 of a float64 reference (measured under the
interpreter: at most 9.4e-7 at these shapes); float16 within 4e-3 (measured: at most
1.1e-3; float16's step at 1 is 1e-3, and the probabilities are rounded to it before the
second product). bfloat16 runs only on a GPU: Triton 3.9's
interpreter multiplies bfloat16 operands of ``tl.dot`` wrongly (a 16 x 16 product off by
1e10), so on the CPU the bfloat16 case is skipped. The interpreter of Triton 3.6 (the GPU
machine's) cannot run these tests on the CPU at all: with numpy 2 it fails on any loop
bounded by a loaded scalar ("only 0-dimensional arrays can be converted"), as every kernel
of this kind has; compiled, 3.6 builds every kernel (``tests/test_triton_compile.py``).
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton; the test extra has it)",
                allow_module_level=True)

from minisrv.engine import Engine  # noqa: E402
from minisrv.model.flat import FlatBatch  # noqa: E402
from minisrv.runner import ModelRunner  # noqa: E402
from minisrv.runner.attention import LoopAttention, PaddedAttention, write_kv  # noqa: E402
from minisrv.runner.attention.triton import TritonAttention, TritonStep, kernels  # noqa: E402
from minisrv.runner.table_batch import TableBatch  # noqa: E402

CUDA = torch.cuda.is_available()
ops = kernels()
if not CUDA and not ops.INTERPRETED:
    pytest.skip("no CUDA, and triton was imported without its interpreter: run "
                "TRITON_INTERPRET=1 python -m pytest tests/test_triton_ops.py",
                allow_module_level=True)

DEVICE = "cuda" if CUDA else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
SHAPES = [(32, 1, 2), (32, 2, 2), (64, 3, 3), (128, 4, 1)]  # head dim, GQA group, KV heads
"""CityLM's heads (32, group 2), SmolLM2's group of 3, Llama-3's group of 4 at 128, MHA."""


def cases() -> list:
    """(head dim, group, KV heads, dtype): every shape in float32; float16 and bfloat16 at
    CityLM's shape and at 128 x group 4 (bfloat16 on a GPU only)."""
    bf16 = pytest.mark.skipif(not CUDA, reason="the interpreter's bfloat16 tl.dot is wrong")
    out = [(*shape, torch.float32) for shape in SHAPES]
    for shape in (SHAPES[1], SHAPES[3]):
        out.append((*shape, torch.float16))
        out.append(pytest.param(*shape, torch.bfloat16, marks=bf16))
    return out


class Ragged:
    """A random ragged batch over a pool layer: request b has ``contexts[b]`` slots drawn
    at random from the pool, its last ``news[b]`` being the step's new tokens, and sits in
    a random row of a table wider than any context."""

    def __init__(self, contexts: list[int], news: list[int], head_dim: int, group: int,
                 n_kv: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.contexts, self.news = contexts, news
        n_slots = sum(contexts) + 7
        self.kv = torch.randn(n_slots, 2, n_kv, head_dim, generator=gen).to(DEVICE, dtype)
        order = torch.randperm(n_slots, generator=gen)
        self.slot_lists, used = [], 0
        for c in contexts:
            self.slot_lists.append(order[used:used + c].tolist())
            used += c
        n_rows = len(contexts) + 2
        table = torch.randint(0, n_slots, (n_rows, max(contexts) + 5), generator=gen)
        rows = torch.randperm(n_rows, generator=gen)[:len(contexts)]
        for row, slots in zip(rows.tolist(), self.slot_lists):
            table[row, :len(slots)] = torch.tensor(slots)
        self.table = table.to(DEVICE, torch.int32)
        self.rows = rows.to(DEVICE, torch.int32)
        self.q = torch.randn(sum(news), group * n_kv, head_dim, generator=gen).to(DEVICE, dtype)

    def step(self, max_splits: int = 8) -> TritonStep:
        as_ints = [torch.tensor(x, dtype=torch.int32, device=DEVICE)
                   for x in (self.contexts, self.news)]
        return TritonStep.of(self.table, self.rows, *as_ints, max(self.news), max_splits)

    def flat(self) -> FlatBatch:
        return FlatBatch([[1] * n for n in self.news], self.slot_lists, DEVICE)

    def tabled(self) -> TableBatch:
        """The batch as the runner hands it to a backend: through its rows of the table."""
        return TableBatch([[1] * n for n in self.news], self.rows.tolist(), self.contexts,
                          self.table, [s[len(s) - n:] for s, n in zip(self.slot_lists, self.news)])

    def reference(self) -> torch.Tensor:
        """Plain attention in float64, request by request: [T, heads, head_dim]."""
        outs, start = [], 0
        group = self.q.shape[1] // self.kv.shape[2]
        for slots, n in zip(self.slot_lists, self.news):
            keys = self.kv[slots].double().repeat_interleave(group, dim=2)
            q = self.q[start:start + n].double()
            scores = torch.einsum("thd,shd->hts", q, keys[:, 0]) / q.shape[-1] ** 0.5
            context = len(slots)
            seen = torch.arange(context)[None, :] <= torch.arange(context - n, context)[:, None]
            scores = scores.masked_fill(~seen.to(scores.device), float("-inf"))
            outs.append(torch.einsum("hts,shd->thd", scores.softmax(-1), keys[:, 1]))
            start += n
        return torch.cat(outs)


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest error of ``out``, asserted within the dtype's tolerance."""
    err = (out.double() - ref.double()).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max error {err:.3g} > {TOLERANCE[dtype]:.3g}"
    return err


@pytest.mark.parametrize("head_dim,group,n_kv,dtype", cases())
def test_decode_matches_plain_attention(head_dim, group, n_kv, dtype) -> None:
    """One query per request over contexts from 1 to past two pieces (split and merged)."""
    batch = Ragged([1, 2, 33, 70, 257, 600], [1] * 6, head_dim, group, n_kv, dtype, seed=1)
    step = batch.step()
    assert step.decode and step.splits.tolist() == [1, 1, 1, 1, 2, 3]
    out = ops.decode_attention(batch.q, batch.kv[:, 0], batch.kv[:, 1], step.table, step.rows,
                               step.contexts, step.splits, 8)
    close(out, batch.reference(), dtype)


def test_decode_over_2048_tokens_in_every_split_count() -> None:
    """Contexts up to 2,048 (the issue's longest), cut into 1..8 pieces: the same output."""
    batch = Ragged([2048, 1500, 900], [1, 1, 1], 32, 2, 1, seed=2)
    ref = batch.reference()
    for max_splits in (1, 3, 8):
        step = batch.step(max_splits)
        assert step.splits.max().item() == max_splits
        out = ops.decode_attention(batch.q, batch.kv[:, 0], batch.kv[:, 1], step.table,
                                   step.rows, step.contexts, step.splits, max_splits)
        close(out, ref, torch.float32)


@pytest.mark.parametrize("head_dim,group,n_kv,dtype", cases())
def test_extend_matches_plain_attention(head_dim, group, n_kv, dtype) -> None:
    """New tokens after cached prefixes and without one (whole prompts), causally; one
    decode among them; runs longer than a block of new tokens."""
    contexts = [5, 40, 41, 100, 3]
    news = [5, 17, 1, 40, 3]  # prefixes 0, 23, 40, 60, 0
    batch = Ragged(contexts, news, head_dim, group, n_kv, dtype, seed=3)
    step = batch.step()
    assert not step.decode and step.starts.tolist() == [0, 5, 22, 23, 63]
    out = ops.extend_attention(batch.q, batch.kv[:, 0], batch.kv[:, 1], step.table,
                               step.rows, step.contexts, step.news, step.starts, step.max_new)
    close(out, batch.reference(), dtype)


def test_extend_after_a_long_cached_prefix() -> None:
    """Eight new tokens after a 2,040-token prefix, beside a fresh prompt."""
    batch = Ragged([2048, 20], [8, 20], 64, 3, 1, seed=4)
    step = batch.step()
    out = ops.extend_attention(batch.q, batch.kv[:, 0], batch.kv[:, 1], step.table,
                               step.rows, step.contexts, step.news, step.starts, step.max_new)
    close(out, batch.reference(), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_puts_each_new_token_where_write_kv_does(dtype) -> None:
    batch = Ragged([4, 30, 1, 19], [4, 20, 1, 1], 32, 2, 2, dtype, seed=5)
    gen = torch.Generator().manual_seed(6)
    new_kv = torch.randn(sum(batch.news), 2, 2, 32, generator=gen).to(DEVICE, dtype)
    expected = batch.kv.clone()
    write_kv(expected, batch.flat().write_slots, new_kv[:, 0], new_kv[:, 1])
    ops.write_kv_table(batch.kv[:, 0], batch.kv[:, 1], new_kv[:, 0], new_kv[:, 1],
                       *batch.step()[:5], max(batch.news))
    assert torch.equal(batch.kv, expected)  # moved, never computed: exactly equal


@pytest.mark.parametrize("news", [[1] * 5, [9, 1, 1, 30, 1], [12, 7, 3, 5, 1]])
def test_backend_gives_the_padded_and_loop_backends_numbers(news) -> None:
    """``TritonAttention`` over a step's ``TableBatch`` (decodes only, mixed, prefills), its
    requests in random rows of the table, against the padded and loop backends."""
    batch = Ragged([12, 60, 9, 130, 5], news, 32, 2, 2, seed=7)
    tabled = batch.tabled()
    shape = (DEVICE, torch.float32, 32, 2)
    triton = TritonAttention(*shape)
    step = triton.prepare(tabled)
    assert step.decode == all(n == 1 for n in news)
    out = triton.forward(batch.q, batch.kv, step)
    for other in (PaddedAttention(*shape), LoopAttention(*shape)):
        close(out, other.forward(batch.q, batch.kv, other.prepare(tabled)), torch.float32)
    close(out, batch.reference().reshape(out.shape), torch.float32)

    new_kv = torch.randn(sum(news), 2, 2, 32, device=DEVICE)
    expected = batch.kv.clone()
    write_kv(expected, batch.flat().write_slots, new_kv[:, 0], new_kv[:, 1])
    triton.write(batch.kv, new_kv[:, 0], new_kv[:, 1], step)
    assert torch.equal(batch.kv, expected)


def test_bad_input_is_a_value_error() -> None:
    batch = Ragged([4], [1], 32, 2, 1)
    step = batch.step()
    with pytest.raises(ValueError, match="int32"):
        ops.decode_attention(batch.q, batch.kv[:, 0], batch.kv[:, 1], step.table.long(),
                             step.rows, step.contexts, step.splits)
    with pytest.raises(ValueError, match="query heads"):
        ops.decode_attention(batch.q[:, :1], batch.kv[:, 0, :, :16].contiguous(),
                             batch.kv[:, 1, :, :16].contiguous(), step.table, step.rows,
                             step.contexts, step.splits)
    with pytest.raises(ValueError, match="differ"):
        ops.extend_attention(batch.q.double(), batch.kv[:, 0], batch.kv[:, 1], step.table,
                             step.rows, step.contexts, step.news, step.starts, 1)
    with pytest.raises(ValueError, match="max_splits"):
        TritonAttention(DEVICE, torch.float32, 32, 2, max_splits=0)


def test_engine_tokens_equal_each_request_alone(citylm) -> None:
    """``Engine(attention="triton")`` on the shipped CityLM, every request's tokens equal to
    it generated alone: prompts whose prefix the radix cache holds from an earlier call
    (extends after a cached prefix), prefilled in chunks of 8 (chunks extending their own
    prefix) in mixed steps beside decodes."""
    model, tok = citylm
    model = copy.deepcopy(model).to(DEVICE)  # the session's CPU model stays where it is
    first, *later = [tok.encode(text) for text in
                     ("FR:Paris, DE:Berlin", "FR:Paris, DE:Bonn", "FR:Paris, IT:Roma", "DE:Ulm")]
    engine = Engine(model, attention="triton", kv_capacity=300, max_running=3, cache="radix",
                    chunked_prefill_size=8, mode="mixed")
    assert engine.backend.attention == "triton"
    assert engine.generate([first], max_new_tokens=8) == [model.reference_generate(first, 8)]
    assert engine.generate(later, max_new_tokens=8) == [
        model.reference_generate(p, 8) for p in later]
    assert engine.stats.cached_tokens >= 2 * len("FR:Paris, ")  # two later prompts hit


def test_static_decode_through_the_triton_hooks_equals_each_request_alone(citylm) -> None:
    """Decode steps over the static buffers the Triton backend's hooks own (its table of the
    bucket, rows, contexts, pieces), beside the flat path's prefills: the tokens of each
    request generated alone."""
    model, tok = citylm
    model = copy.deepcopy(model).to(DEVICE)
    runner = ModelRunner(model, "triton", static_decode=True, max_running=3)
    engine = Engine(runner, kv_capacity=300, max_running=3, mode="mixed")
    assert runner.graphs is not None and runner.graphs.hooks is runner.attn.graphs
    prompts = [tok.encode(text) for text in ("FR:Paris", "DE:Berlin, FR:", "IT:")]
    assert engine.generate(prompts, max_new_tokens=6) == [
        model.reference_generate(p, 6) for p in prompts]
    assert any(not record.prefill and record.decode for record in engine.trace)
