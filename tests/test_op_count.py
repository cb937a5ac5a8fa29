"""What one decode step costs the host: the operators it dispatches, and zero read-backs.

On a GPU every operator is a kernel launch the host pays for, and every read-back makes the
host wait for the device; on the CPU both are countable. ``count_ops`` counts the ATen
operators a call dispatches (views, which launch nothing, are left out) with a
``TorchDispatchMode``; the bounds below are what the model reaches today, so the count
cannot creep back. Run ``python tests/test_op_count.py`` for the breakdown per operator.

Issue 23's goal is 16 operators per layer and 12 per step (76 for CityLM's 4 layers). The
step is counted through the runner's real entry point, ``ModelRunner.prepare`` then
``compute`` on a batch of 64 decodes (padded attention, greedy sampling). Before the fused
layers a step took 157 by this count (39 per layer). Today it takes 75 (78 before the new
K/V's slots came from the host, the mask from windows of one vector, and a step that
samples every row stopped gathering them):

* per layer, 17: the model's 14 (attention norm, the qkv product, the rotary embedding in
  four in-place operators on the q and k views of that product, the o product, the
  residual add, the MLP norm, the gate_up product, silu, the gate product, the down product,
  the residual add) and the attention over the pool's 3 (one ``index_put_`` writes the new
  K and V together, one ``index_select`` gathers every request's history of keys and values
  together, one SDPA call);
* per step, 7: the model's 5 (the embedding, the rotary table's rows, the final norm, the
  LM head, the greedy argmax: every row of a step of decodes is sampled, so none is
  gathered before the final norm) and the request-to-token table's 2, which every step
  reads, the engine's or the one a runner driven by hand builds (the key slots gathered
  from the table, one ``index_select``, and the mask's rows, one indexing of a vector of
  zeros then -inf, each query's window of it counted on the host); the new K/V's slots
  are not gathered: the host allocated them and copies them with the step's other
  inputs. Building the step's inputs in ``prepare`` dispatches no other counted operator
  on the CPU (its tensors are made from host lists and numpy arrays).

The last operator over 16 per layer is the rotary embedding's: ``addcmul_`` would fold its
multiply and add into one but rounds once instead of twice (a fused multiply-add), which
changes logits in their last bit; fusing the residual add into the o product (oneDNN's
binary post-op) would change ``Block.forward``, which chapter 00 prints.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minisrv.configs import CITYLM
from minisrv.core import Batch
from minisrv.kv import KVPool, ReqToTokenTable
from minisrv.model import CityLM, FlatBatch, load_citylm
from minisrv.request import Req
from minisrv.runner import ModelRunner
from minisrv.sampling import SamplingParams

BATCH, CONTEXT = 64, 20

# What the runner reaches (see the module's docstring): 17 per layer, 7 per step, 75 in all,
# within issue 23's total of 76 (16 per layer + 12 per step).
MAX_PER_LAYER = 17
MAX_PER_STEP = 7
MAX_TOTAL = 4 * MAX_PER_LAYER + MAX_PER_STEP


def _storages(values: Any) -> list[int]:
    leaves = values if isinstance(values, (list, tuple)) else [values]
    found = []
    for leaf in leaves:
        if isinstance(leaf, (list, tuple)):
            found.extend(_storages(leaf))
        elif isinstance(leaf, torch.Tensor) and not leaf.is_mkldnn:  # a packed weight: opaque
            found.append(leaf.untyped_storage().data_ptr())
    return found


class OpCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched inside it, by name, views left out.

    A view is an operator that writes nothing and whose every output tensor lives in an
    input's memory (``view``, ``transpose``, a ``to`` that changes nothing): it launches no
    kernel. Decided on what happened, not on schemas, so a dtype cast (``to`` that copies)
    or a ``reshape`` that must copy is counted. Operators that return no tensor are counted
    when they read one (``item``: a read-back). CPU tensors only (the meta device has no
    addresses to compare).

    Under ``torch.inference_mode`` (where ``forward_flat`` runs) the mode sees composite
    operators whole: ``linear``, ``rms_norm`` or ``scaled_dot_product_attention`` count
    once, as the one call the host makes for each.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs, outputs = _storages(list(args) + list((kwargs or {}).values())), _storages(out)
        if func._schema.is_mutable or (not outputs and inputs) or not set(outputs) <= set(inputs):
            self.ops[func.overloadpacket.__name__] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def count_ops(call: Callable[[], Any]) -> OpCounter:
    """The operators ``call()`` dispatches."""
    with OpCounter() as counter:
        call()
    return counter


def decode_batch(model: CityLM, table: bool = False) -> tuple[ModelRunner, Batch]:
    """A runner and its batch of ``BATCH`` decodes at context ``CONTEXT`` (padded
    attention); with ``table`` as the engine runs it, each request's slots read through its
    row of the request-to-token table."""
    runner = ModelRunner(model, "padded")
    allocator = runner.attach_kv(BATCH * (CONTEXT + 1))
    kv_table = ReqToTokenTable(BATCH + 1, CONTEXT, allocator.capacity) if table else None
    runner.attach_table(kv_table)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (BATCH, CONTEXT - 1), generator=gen)
    reqs = [Req(rid=i, prompt=p, params=SamplingParams(max_new_tokens=4, ignore_eos=True))
            for i, p in enumerate(prompts.tolist())]
    for req in reqs:
        req.kv_slots = runner.pool.alloc(CONTEXT - 1)
        if kv_table is not None:
            kv_table.take(req, req.kv_slots)
    for req, tokens in zip(reqs, runner.run(Batch.of(reqs, [])).tokens, strict=True):
        req.output.extend(tokens)
        req.kv_slots += runner.pool.alloc(1)
    if kv_table is not None:
        kv_table.append(reqs, [req.kv_slots[-1] for req in reqs])
    return runner, Batch.of([], reqs)


def decode_step(model: CityLM, table: bool = False) -> Callable[[], Any]:
    """One decode step of ``decode_batch``: ``ModelRunner.prepare`` on the scheduler's
    batch, then ``compute`` (the flat forward with padded attention over the pool, greedy
    sampling, the tokens back as one list)."""
    runner, batch = decode_batch(model, table)
    return lambda: runner.compute(runner.prepare(batch))


@pytest.fixture(scope="module")
def citylm() -> CityLM:
    return load_citylm("cpu")[0]


def per_layer_and_step(model: CityLM) -> tuple[int, int, OpCounter]:
    """(operators per layer, per step outside the layers, the full model's count), from
    the model and a copy of it with one layer less."""
    full = count_ops(decode_step(model))
    fewer = CityLM(model.config.with_(n_layers=model.config.n_layers - 1)).eval()
    per_layer = full.total - count_ops(decode_step(fewer)).total
    return per_layer, full.total - model.config.n_layers * per_layer, full


def test_a_citylm_decode_step_stays_within_its_operator_budget(citylm: CityLM) -> None:
    per_layer, per_step, full = per_layer_and_step(citylm)
    assert per_layer <= MAX_PER_LAYER, dict(full.ops)
    assert per_step <= MAX_PER_STEP, dict(full.ops)
    assert full.total <= MAX_TOTAL, dict(full.ops)
    # the fused layers: one matrix product each for qkv, o, gate_up, down; one for the head
    products = full.ops["linear"] + full.ops["_linear_pointwise"]  # F.linear or oneDNN's
    assert products == 4 * CITYLM.n_layers + 1
    assert "item" not in full.ops  # no read-back


def test_a_runner_driven_by_hand_dispatches_the_engines_operators(citylm: CityLM) -> None:
    """Without the scheduler's table a runner builds one of its own from the slot lists on
    the host (``slot_table``), and the device then does what it does for the engine: the
    same operators, the table's 2 per step among them (the key slots' gather, and the
    mask's rows: an ``index_select`` beside the rotary table's; no compare, no select)."""
    plain, tabled = count_ops(decode_step(citylm)), count_ops(decode_step(citylm, True))
    assert plain.ops == tabled.ops
    # each layer's keys and values, the key slots, the mask's rows, the rotary rows
    assert tabled.ops["index_select"] == CITYLM.n_layers + 3 and "index" not in tabled.ops
    assert "lt" not in tabled.ops and "where" not in tabled.ops
    assert tabled.ops["scaled_dot_product_attention"] == CITYLM.n_layers
    assert "item" not in tabled.ops  # no read-back


def test_a_step_of_decodes_moves_no_sample_rows(citylm: CityLM) -> None:
    """Every row of a step of decodes is sampled, in order: ``prepare`` builds no tensor of
    rows to pick (on a GPU, one copy less per step), and ``forward`` picks none."""
    runner, batch = decode_batch(citylm, True)
    assert runner.prepare(batch).sample_rows is None


def test_the_counter_counts_copies_and_skips_views() -> None:
    x = torch.randn(4, 6)
    with torch.inference_mode():
        counted = count_ops(lambda: (x.view(6, 4), x.t(), x.to(torch.float32), x[1:], x + 1,
                                     x.to(torch.float64), x.t().reshape(24), x.sum().item()))
    assert dict(counted.ops) == {"add": 1, "to": 1, "reshape": 1, "sum": 1, "item": 1}


def meta_model() -> CityLM:
    with torch.device("meta"):
        return CityLM(CITYLM).eval()


@pytest.mark.parametrize("attention", ["padded", "loop"])
def test_the_flat_forward_reads_nothing_back(attention: str) -> None:
    """On the meta device any read-back (``.item()``, ``.tolist()``, ``int(t)``) raises: the
    step's forward, given its inputs, runs there whole."""
    model = meta_model()
    pool = KVPool.for_model(model, 64)
    slots = [list(range(0, 9)), list(range(9, 10)), list(range(20, 26))]
    batch = FlatBatch([[3, 4, 5], [7], [1, 2, 3, 4, 5, 6]], slots, "meta")
    logits = model.forward_flat(batch, pool, attention=attention, last_only=True)
    assert logits.device.type == "meta" and logits.shape == (3, CITYLM.vocab_size)
    with torch.inference_mode():
        rows = model.forward_tokens(batch.ids, batch.positions,
                                    lambda layer, q, k, v: q.flatten(1))
    assert rows.shape == (10, CITYLM.vocab_size)


def test_the_runners_decode_forward_reads_nothing_back() -> None:
    """``ModelRunner.forward`` of a prepared decode batch (with one prefill beside it) runs
    whole on the meta device: no read-back anywhere in the step's device work."""
    runner = ModelRunner(meta_model(), "padded")
    runner.attach_kv(64)
    reqs = [Req(rid=i, prompt=[1, 2, 3, 4][: i + 2], params=SamplingParams(max_new_tokens=3))
            for i in range(3)]
    for req in reqs:
        req.kv_slots = runner.pool.alloc(req.prompt_len + 1)
        req.output.append(7)
    fresh = Req(rid=9, prompt=[5, 6, 7], params=SamplingParams(max_new_tokens=2))
    fresh.kv_slots = runner.pool.alloc(3)
    for batch in (Batch.of([], reqs), Batch.of([fresh], reqs)):
        step = runner.prepare(batch)
        assert step.flat.ids.device.type == "meta"
        logits = runner.forward(step, step.flat.ids)
        assert logits.device.type == "meta" and logits.shape == (len(batch.entries),
                                                                 CITYLM.vocab_size)


class HostReads(torch.Tensor):
    """A tensor that counts the reads of its values by the host (``tolist``, ``item``,
    ``cpu``, ``numpy``, ``int``/``float``/``bool``); what such a read returns is a plain
    tensor, so work on the host afterwards is not counted."""

    READS = frozenset({torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu,
                       torch.Tensor.numpy, torch.Tensor.__int__, torch.Tensor.__float__,
                       torch.Tensor.__bool__, torch.Tensor.__index__})
    count = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func in cls.READS:
            HostReads.count += 1
            return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out
        return out


@pytest.mark.parametrize("temperatures", [[0.0] * 5, [0.0, 0.8, 0.0, 1.2, 0.5], [0.9] * 3])
def test_a_steps_tokens_come_back_in_one_read(temperatures: list[float]) -> None:
    """Greedy and sampling rows together: the host reads the device once, and the tokens
    are each row's ``sample_next``."""
    from minisrv.sampling import make_generator, sample_batch, sample_next

    logits = torch.randn(len(temperatures), 50, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate(temperatures)]
    HostReads.count = 0
    tokens = sample_batch(logits.as_subclass(HostReads), params,
                          [make_generator(p) for p in params])
    assert HostReads.count == 1
    assert tokens == [sample_next(row, p, make_generator(p)) for row, p in zip(logits, params)]


def test_meta_catches_a_read_back() -> None:
    """The oracle's forward checks its ids on the device; on meta that read-back raises, so
    the test above would notice one in the flat forward."""
    with pytest.raises((RuntimeError, NotImplementedError)):
        meta_model()(torch.tensor([1, 2, 3], device="meta"))


if __name__ == "__main__":
    layer_ops, step_ops, counted = per_layer_and_step(load_citylm("cpu")[0])
    print(f"{counted.total} operators: {layer_ops} per layer, {step_ops} per step")
    for name, n in counted.ops.most_common():
        print(f"  {name:32s} {n}")
