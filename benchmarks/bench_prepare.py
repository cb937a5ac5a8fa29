"""The host half of a decode step, ``ModelRunner.prepare``, with and without the table.

A batch of CityLM decodes (64 requests by default) at a short and a long context is
prepared two ways on one runner over one KV pool: through each request's slot list (the
runner without the scheduler's request-to-token table builds one of its own each step,
``slot_table``, copying every request's whole context to the device), and through the
scheduler's table (the new tokens, a row and a length per request). Either way the batch is
a ``TableBatch`` whose key slots and mask are gathered on the device. Both steps are then
computed and must give the same tokens. The script prints the median time of each (of
``--runs`` medians of ``--repeat`` calls: the machine is noisy), and how each grows from the
short context to the long one; the table's should stay flat (within 1.5x), the slot lists'
grows with it.

    python benchmarks/bench_prepare.py [--batch 64] [--contexts 24 448] [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minisrv.configs import CITYLM
from minisrv.core import Batch
from minisrv.kv import ReqToTokenTable
from minisrv.model import CityLM
from minisrv.request import Req
from minisrv.runner import ModelRunner
from minisrv.sampling import SamplingParams


def decode_batch(model: CityLM, batch: int, context: int) -> tuple[ModelRunner, Batch,
                                                                    ReqToTokenTable]:
    """A runner over a pool holding ``batch`` requests of ``context`` tokens each (their
    last one to decode now), their slots scattered over the pool as a running server's
    are, and the table holding the same slots."""
    runner = ModelRunner(model, "padded")
    allocator = runner.attach_kv(batch * context + 64)
    table = ReqToTokenTable(batch + 1, min(model.config.max_seq_len, allocator.capacity),
                            allocator.capacity)
    gen = torch.Generator().manual_seed(context)
    order = torch.randperm(allocator.capacity, generator=gen).tolist()  # scattered slots
    allocator.alloc(allocator.capacity)
    allocator.free(order)
    vocab = model.config.vocab_size
    reqs = []
    for i in range(batch):
        prompt = torch.randint(2, vocab, (context - 1,), generator=gen).tolist()
        req = Req(rid=i, prompt=prompt, params=SamplingParams(max_new_tokens=4))
        req.output.append(int(torch.randint(2, vocab, (1,), generator=gen)))
        req.kv_slots = allocator.alloc(context)
        table.take(req, req.kv_slots)
        reqs.append(req)
    assert runner.pool is not None
    runner.pool.kv.normal_(generator=gen)  # some history to attend over
    return runner, Batch.of([], reqs), table


def median_ms(call, repeat: int, runs: int) -> float:
    """The median over ``runs`` of each run's median time of ``call`` (milliseconds)."""
    medians = []
    for _ in range(runs):
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return 1e3 * statistics.median(medians)


def both_ways(runner: ModelRunner, batch: Batch, table: ReqToTokenTable, repeat: int,
              runs: int) -> tuple[float, float, bool]:
    """(slot lists' ms, table's ms, whether both steps sample the same tokens)."""
    runner.attach_table(None)
    old = median_ms(lambda: runner.prepare(batch), repeat, runs)
    old_tokens = runner.compute(runner.prepare(batch)).next_tokens
    runner.attach_table(table)
    new = median_ms(lambda: runner.prepare(batch), repeat, runs)
    new_tokens = runner.compute(runner.prepare(batch)).next_tokens
    return old, new, old_tokens == new_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--contexts", type=int, nargs=2, default=[24, 448])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = CityLM(CITYLM).eval()
    rows = {}
    for context in args.contexts:
        runner, batch, table = decode_batch(model, args.batch, context)
        rows[context] = both_ways(runner, batch, table, args.repeat, args.runs)
    print(f"prepare of a batch-{args.batch} CityLM decode step (median ms)")
    print(f"{'context':>8} {'slot lists':>11} {'table':>8} {'table/slots':>12} {'tokens':>7}")
    for context, (old, new, same) in rows.items():
        print(f"{context:>8} {old:>11.3f} {new:>8.3f} {new / old:>12.2f} "
              f"{'same' if same else 'DIFFER':>7}")
    short, long = args.contexts
    grow_old, grow_new = rows[long][0] / rows[short][0], rows[long][1] / rows[short][1]
    print(f"context {short} -> {long}: slot lists x{grow_old:.2f}, table x{grow_new:.2f} "
          f"(goal: table <= x1.5: {'met' if grow_new <= 1.5 else 'NOT met'})")


if __name__ == "__main__":
    main()
