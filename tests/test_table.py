"""The request-to-token table (``minisrv.kv.table``): it mirrors every running request's
slots, reuses no row a launched step may still read, leaks none; the engine's tokens through
it equal each request generated alone; a step's host copies grow with its new tokens only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from minisrv.core import Batch
from minisrv.engine import Engine
from minisrv.kv import KVManager, ReqToTokenTable, SlotAllocator
from minisrv.kv.table import table_rows
from minisrv.model import ATTENTION_FUNCTIONS, CityLM, FlatBatch
from minisrv.request import Req, ReqState
from minisrv.runner import ModelBackend
from minisrv.runner.attention import make_attention
from minisrv.runner.table_batch import TableBatch
from minisrv.sampling import SamplingParams
from minisrv.tokenizer import Tokenizer

MODEL_SEED = 3
VOCAB = Tokenizer().vocab_size
CAPACITY = 48

op_st = st.one_of(
    st.tuples(st.just("admit"), st.lists(st.integers(0, 2), min_size=1, max_size=7)),
    st.tuples(st.just("decode"), st.just(0)),
    st.tuples(st.just("extend"), st.integers(0, 9), st.integers(1, 3)),  # a check's k + 1
    st.tuples(st.just("truncate"), st.integers(0, 9), st.integers(0, 3)),
    st.tuples(st.just("prefilled"), st.integers(0, 9)),
    st.tuples(st.just("finish"), st.integers(0, 9)),
    st.tuples(st.just("retract"), st.integers(0, 9)),
    st.tuples(st.just("abort"), st.integers(0, 9)),
    st.tuples(st.just("step"), st.just(0)),
)


class Driver:
    """A scheduler's use of ``KVManager`` with one step in flight (overlap) or none: each
    op as the loops make it, and a record of the rows every launched step read, kept apart
    from the table's own bookkeeping."""

    def __init__(self, max_running: int, overlap: bool, page_size: int = 1) -> None:
        self.max_running, self.overlap = max_running, overlap
        self.table = ReqToTokenTable(table_rows(max_running, overlap), CAPACITY, CAPACITY)
        self.memory = KVManager(SlotAllocator(CAPACITY, page_size), "radix", table=self.table)
        self.running: list[Req] = []
        self.flight: list[set[int]] = []  # rows read by each launched, uncompleted step
        self.rid = 0

    def pick(self, i: int) -> Req | None:
        return self.running[i % len(self.running)] if self.running else None

    def admit(self, prompt: list[int]) -> None:
        if len(self.running) >= self.max_running:
            return
        req = Req(rid=self.rid, prompt=prompt, params=SamplingParams(max_new_tokens=64))
        self.rid += 1
        match = self.memory.match(req)
        if not self.memory.allocate(req, match):
            self.memory.drop_match(req, match)
            return
        row = self.table.row(req)
        assert not any(row in rows for rows in self.flight), f"row {row} reused in flight"
        self.running.append(req)

    def grow(self, req: Req, n: int) -> bool:
        fits = (self.memory.growth(req, n) <= self.memory.free_count
                and req.kv_len + n <= CAPACITY)
        if fits:
            req.output.extend([1] * n)
        return fits

    def apply(self, op: tuple) -> None:
        name, *args = op
        if name == "admit":
            self.admit(args[0])
        elif name == "decode":
            if self.memory.room(self.running) <= self.memory.free_count:  # all or none
                self.memory.alloc_decode([r for r in self.running if self.grow(r, 1)])
        elif name == "step":
            self.memory.launched(self.running)
            self.flight.append({self.table.row(r) for r in self.running})
            if not self.overlap or len(self.flight) > 1:  # the oldest completes
                self.flight.pop(0)
                self.memory.completed()
        elif (req := self.pick(args[0])) is None:
            return
        elif name == "extend":
            if self.grow(req, args[1]):
                self.memory.alloc_tokens(req, args[1])
        elif name == "truncate":
            n = min(args[1], req.kv_len - req.cached_len)
            del req.output[len(req.output) - n:]
            self.memory.truncate(req, n)
        elif name == "prefilled":
            self.memory.cache_unfinished(req)
        else:
            self.running.remove(req)
            if name == "finish":
                self.memory.cache_finished(req)
            else:  # a retraction and an abort both free the request's own slots
                self.memory.release(req)

    def check(self) -> None:
        self.memory.check_integrity(self.running)  # the table holds every kv_len
        held = {self.table.row(r) for r in self.running}
        in_flight = set().union(*self.flight) - held
        assert in_flight <= set(self.table.deferred), "a row read in flight was freed"
        assert self.table.used + len(self.table.deferred) <= self.table.rows - 1


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(op_st, max_size=60), max_running=st.integers(1, 4),
       overlap=st.booleans(), page_size=st.sampled_from([1, 4, 16]))
def test_the_table_mirrors_the_slots_and_reuses_no_row_in_flight(ops, max_running, overlap,
                                                                 page_size) -> None:
    """At every page size: each position's slot sits at its offset in its page
    (``check_integrity``), and no row is reused while a step may read it."""
    driver = Driver(max_running, overlap, page_size)
    for op in ops:
        driver.apply(op)
        driver.check()
    for req in list(driver.running):  # everyone leaves, every step completes
        driver.apply(("finish", driver.running.index(req)))
    driver.memory.settle()
    driver.flight.clear()
    driver.check()
    table = driver.table
    assert table.used == 0 and table.deferred == ()  # no row leaked
    assert table.free_count == table.rows - 1


def test_a_row_given_back_in_flight_waits_for_the_step() -> None:
    table = ReqToTokenTable(3, 8, scratch_slot=99)
    a, b = (Req(rid=i, prompt=[1]) for i in range(2))
    assert table.take(a, [4, 5]) == 0
    table.launched([a])
    table.give_back(a)  # the step in flight still reads row 0
    assert table.deferred == (0,)
    assert table.take(b, [6]) == 1  # row 0 is not handed out
    table.completed()
    assert table.deferred == ()
    assert table.tensor[2].tolist() == [99] * 8  # the scratch row
    assert table.take(Req(rid=3, prompt=[1]), [7]) == 0  # free again
    with pytest.raises(ValueError, match="rows are taken"):
        table.take(Req(rid=4, prompt=[1]), [7])
    with pytest.raises(ValueError, match="past the table"):
        table.write(b, 7, [1, 2])


class RowSpy:
    """Around the engine's runner: which rows each step read (from its prepare, on the
    scheduler's thread, to the end of its compute, on the device's), and at every row the
    table hands out, that no step still running read it."""

    def __init__(self, runner: ModelBackend) -> None:
        self.runner, self.running_steps, self.taken = runner, [], 0
        prepare, compute = runner.prepare, runner.compute

        def spy_prepare(batch: Batch):
            step = prepare(batch)
            if runner.table is not None:
                self.running_steps.append({runner.table.row(r) for r in batch.reqs})
            return step

        def spy_compute(step, *args):
            try:
                return compute(step, *args)
            finally:
                if self.running_steps:
                    self.running_steps.pop(0)

        runner.prepare, runner.compute = spy_prepare, spy_compute

    def watch(self, table: ReqToTokenTable) -> None:
        take = table.take

        def spy_take(req, slots):
            row = take(req, slots)
            assert not any(row in rows for rows in self.running_steps), f"row {row} in use"
            self.taken += 1
            return row

        table.take = spy_take


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), overlap=st.booleans(),
       cache=st.sampled_from(["radix", "blocks", "none"]),
       chunk=st.sampled_from([None, 4]), kv_capacity=st.sampled_from([24, 200]),
       max_running=st.integers(1, 3))
def test_engine_tokens_through_the_table_equal_each_request_alone(
        model, data, overlap, cache, chunk, kv_capacity, max_running) -> None:
    n = data.draw(st.integers(1, 6))
    prompts = [[0, *data.draw(st.lists(st.integers(2, VOCAB - 1), max_size=7))]
               for _ in range(n)]
    prompts += [p + [5] for p in prompts[: data.draw(st.integers(0, n))]]  # shared prefixes
    lengths = data.draw(st.lists(st.integers(1, 10), min_size=len(prompts),
                                 max_size=len(prompts)))
    runner = ModelBackend(model)
    spy = RowSpy(runner)
    engine = Engine(runner, overlap=overlap, cache=cache, chunked_prefill_size=chunk,
                    kv_capacity=kv_capacity, max_running=max_running, new_token_ratio=0.1,
                    min_ratio=0.05, debug=True)  # debug: the table checked every step
    assert runner.table is not None and runner.table.rows == table_rows(max_running, overlap)
    spy.watch(runner.table)
    outputs = engine.generate(prompts, lengths)
    assert outputs == [model.reference_generate(p, m) for p, m in zip(prompts, lengths)]
    assert spy.taken >= len(prompts)
    assert runner.table.used == 0  # every row given back


def test_aborted_requests_give_their_rows_back(model) -> None:
    runner = ModelBackend(model)
    engine = Engine(runner, overlap=True, max_running=2, kv_capacity=100, debug=True)
    reqs = [engine.add_request([0, 3 + i, 4], SamplingParams(max_new_tokens=20,
                                                             ignore_eos=True))
            for i in range(4)]
    for _ in range(3):
        engine.step()
    engine.abort(reqs[:3])
    assert all(r.state == ReqState.ABORTED for r in reqs[:3])
    engine.run()
    assert reqs[3].output == model.reference_generate(reqs[3].prompt, 20, ignore_eos=True)
    table = runner.table
    assert table.used == 0 and table.deferred == ()
    engine.scheduler.check_integrity()


@given(spec=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 9)), min_size=1, max_size=6),
       kind=st.sampled_from(["padded", "loop", "flex", "hybrid"]), split=st.booleans())
@settings(max_examples=40, deadline=None)
def test_table_and_slot_lists_give_the_same_attention(spec, kind, split) -> None:
    """Every backend over a ``TableBatch`` (rows out of order) equals its teaching form over
    the ``FlatBatch`` of the same slots (the padded one also with its decodes cut by
    context; the hybrid, whose mixed steps make a call of each kind, the padded form), and
    so does the backend over a table of the slot lists' own (``TableBatch.of_slots``, what a
    runner driven by hand builds)."""
    gen = torch.Generator().manual_seed(len(spec))
    capacity = sum(n + c for n, c in spec)
    order = torch.randperm(capacity, generator=gen).tolist()  # slots out of order
    slot_lists, at = [], 0
    for n, c in spec:
        slot_lists.append(order[at:at + n + c])
        at += n + c
    rows = list(range(len(spec) - 1, -1, -1))  # request r in row B - 1 - r
    table = torch.full((len(spec) + 1, 16), capacity, dtype=torch.int32)
    for row, slots in zip(rows, slot_lists):
        table[row, :len(slots)] = torch.tensor(slots, dtype=torch.int32)
    new_ids = [[1] * n for n, _ in spec]
    flat, tabled = FlatBatch(new_ids, slot_lists), TableBatch(
        new_ids, rows, [len(s) for s in slot_lists], table,
        [s[len(s) - len(ids):] for s, ids in zip(slot_lists, new_ids)])
    assert tabled.write_slots.tolist() == flat.write_slots.tolist()
    assert tabled.positions.tolist() == flat.positions.tolist()
    kv = torch.randn(capacity + 1, 2, 2, 16, generator=gen, dtype=torch.float64)
    q = torch.randn(flat.num_tokens, 4, 16, generator=gen, dtype=torch.float64)
    attn = make_attention(kind, torch.device("cpu"), torch.float64, 16, 2)
    if split:  # cut wherever contexts differ
        getattr(attn, "decode", attn).split_cost = 0.0  # type: ignore[union-attr]
    want = ATTENTION_FUNCTIONS["padded" if kind == "hybrid" else kind](q, flat, kv[:, 0],
                                                                        kv[:, 1])
    torch.testing.assert_close(attn.forward(q, kv, attn.prepare(tabled)), want)
    own = TableBatch.of_slots(new_ids, slot_lists, fill=capacity)
    assert own.table.shape == (len(spec) + 1, max(map(len, slot_lists)))
    assert own.table[-1].eq(capacity).all()  # the scratch row
    torch.testing.assert_close(attn.forward(q, kv, attn.prepare(own)), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_tables_masks_equal_the_slot_lists_past_the_first_windows(dtype) -> None:
    """The table's masks are windows of a vector of zeros then -inf, grown when a longer
    context asks: a step of short contexts, then one past the first 512 columns, then
    the short one again, each mask equal to the one the slot lists build on the host
    (decodes, and a prefill padded beside another)."""
    from minisrv.model.attention_metadata import padded_groups
    from minisrv.runner.attention import padded

    for spec in ([(1, 4), (1, 2)], [(1, 700), (1, 9)], [(3, 600), (1, 40)], [(1, 4), (1, 2)]):
        slot_lists, at = [], 0
        for new, cached in spec:
            slot_lists.append(list(range(at, at + new + cached)))
            at += new + cached
        table = torch.full((len(spec) + 1, 1024), at, dtype=torch.int32)
        for row, slots in enumerate(slot_lists):
            table[row, :len(slots)] = torch.tensor(slots, dtype=torch.int32)
        new_ids = [[1] * new for new, _ in spec]
        tabled = TableBatch(new_ids, list(range(len(spec))), [len(s) for s in slot_lists],
                            table, [s[len(s) - len(i):] for s, i in zip(slot_lists, new_ids)])
        flat = FlatBatch(new_ids, slot_lists)
        for want, got in zip(padded_groups(flat, dtype), padded.padded_groups(tabled, dtype),
                             strict=True):
            assert got.bias.dtype == dtype and torch.equal(got.bias, want.bias), spec
            assert (got.rows is None) == (want.rows is None), spec
            if got.rows is not None:
                assert torch.equal(got.rows, want.rows), spec
        if max(new for new, _ in spec) == 1:  # the decodes cut by context, here reordered
            members = np.array([1, 0])
            want = padded_groups(flat, dtype)[0].bias[torch.from_numpy(members)]
            assert torch.equal(padded.decode_group(tabled, members, 0, dtype).bias, want), spec
    with pytest.raises(ValueError, match="a slot for each"):  # the write slots are the host's
        TableBatch([[1, 2]], [0], [2], table, [[5]])


class HostCopies(TorchDispatchMode):
    """Elements copied from the host to another device (the meta device here)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        src = args[0] if args else None
        if (func.__name__.startswith(("_to_copy", "copy_")) and isinstance(src, torch.Tensor)
                and isinstance(out, torch.Tensor)):
            source = args[1] if func.__name__.startswith("copy_") else src
            if source.device.type == "cpu" and out.device.type != "cpu":
                self.elements += source.numel()
        return out


def decode_copies(context: int, table: bool, batch: int = 16) -> int:
    """Host-to-device elements ``ModelRunner.prepare`` copies for a decode step of
    ``batch`` requests at ``context`` tokens, with the engine's table or slot lists."""
    from minisrv.configs import CITYLM
    with torch.device("meta"):
        model = CityLM(CITYLM.with_(max_seq_len=512)).eval()
    runner = ModelBackend(model, "padded")
    allocator = runner.attach_kv(batch * context)
    kv_table = ReqToTokenTable(batch + 1, 512, allocator.capacity) if table else None
    runner.attach_table(kv_table)
    reqs = []
    for i in range(batch):
        req = Req(rid=i, prompt=list(range(2, context + 1)),
                  params=SamplingParams(max_new_tokens=4))
        req.output.append(7)
        req.kv_slots = allocator.alloc(context)
        if kv_table is not None:
            kv_table.take(req, req.kv_slots)
        reqs.append(req)
    with HostCopies() as counter:
        runner.prepare(Batch.of([], reqs))
    return counter.elements


def test_prepare_copies_grow_with_new_tokens_not_with_the_context() -> None:
    short, long = decode_copies(24, table=True), decode_copies(448, table=True)
    # ids, positions, write slots for 16 tokens; rows, ends, news, mask windows for 16
    assert short == long > 0
    assert long <= 16 * 8
    old_short, old_long = decode_copies(24, table=False), decode_copies(448, table=False)
    assert old_long > 16 * 448 > old_short  # the slot lists: every request's whole context
    # on top of the same inputs, a table of their own: 16 rows and a scratch row of context
    assert (old_short - 17 * 24, old_long - 17 * 448) == (short, long)


def test_the_prepare_benchmark_computes_the_same_tokens_both_ways() -> None:
    from bench_scripts import load

    from minisrv.configs import CITYLM
    bench = load("bench_prepare")
    torch.manual_seed(0)
    model = CityLM(CITYLM.with_(n_layers=1)).eval()
    runner, batch, table = bench.decode_batch(model, 4, 30)
    old, new, same = bench.both_ways(runner, batch, table, repeat=1, runs=1)
    assert same and old > 0 and new > 0
    assert runner.table is table and table.used == 4


@given(spec=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 9)), min_size=1, max_size=6),
       data=st.data())
@settings(max_examples=40, deadline=None)
def test_a_part_of_a_batch_is_the_batch_of_its_requests_alone(spec, data) -> None:
    """``TableBatch.part(lo, hi)`` (the hybrid's prefills or decodes of a mixed step) reads
    the same ids, positions, write slots, lengths and key slots as a batch built of those
    requests alone, and its tokens are the rows ``token_rows`` names."""
    lo = data.draw(st.integers(0, len(spec) - 1))
    hi = data.draw(st.integers(lo + 1, len(spec)))
    slot_lists, at = [], 0
    for n, c in spec:
        slot_lists.append(list(range(at, at + n + c)))
        at += n + c
    new_ids = [[10 * r + t for t in range(n)] for r, (n, _) in enumerate(spec)]
    whole = TableBatch.of_slots(new_ids, slot_lists, fill=at)
    part = whole.part(lo, hi)
    alone = TableBatch.of_slots(new_ids[lo:hi], slot_lists[lo:hi], fill=at)
    for name in ("ids", "positions", "write_slots", "ends", "news"):
        assert getattr(part, name).tolist() == getattr(alone, name).tolist(), name
    for name in ("contexts", "new_lens", "cached_lens", "starts"):
        assert getattr(part, name) == getattr(alone, name), name
    assert part.ragged_key_slots().tolist() == alone.ragged_key_slots().tolist()
    every = slice(0, len(part))
    assert part.key_slots(every).tolist() == alone.key_slots(every).tolist()
    assert part.ids.tolist() == whole.ids[whole.token_rows(lo, hi)].tolist()
    with pytest.raises(ValueError, match="not a part"):
        whole.part(hi, hi)
