"""Wall-clock time of one decode step on the real model, for the batching measurements.

Selective batching is worth what it saves per request: a decode step over ``B`` requests
costs some fixed part (reading the weights, launching kernels, Python) plus a part that
grows with ``B``. ``decode_step_seconds`` measures one such step with every request at
the same context length, so the chapter and ``benchmarks/bench_batching.py`` time exactly
the same thing. Timings vary from run to run and machine to machine; nothing that tests
correctness depends on them.
"""

from __future__ import annotations

import time

import torch

from minisrv.kv import KVPool
from minisrv.model import CityLM, FlatBatch

__all__ = ["decode_step_seconds"]


def decode_step_seconds(
    model: CityLM,
    batch_size: int,
    context: int = 64,
    *,
    attention: str = "padded",
    repeats: int = 20,
    warmup: int = 3,
    seed: int = 0,
) -> float:
    """Median seconds of one decode step for ``batch_size`` requests of ``context`` tokens.

    Each request's first ``context`` tokens are prefilled into a fresh pool once; the timed
    step then computes one more token for every request (building its ``FlatBatch``
    included, as the engine does every step). The median of ``repeats`` timings resists
    the odd slow run on a shared machine.
    """
    if batch_size < 1 or context < 1 or repeats < 1:
        raise ValueError("batch_size, context and repeats must all be >= 1")
    if context + 1 > model.config.max_seq_len:
        raise ValueError(f"context {context} leaves no room below max_seq_len")
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    seqs = [
        torch.randint(0, vocab, (context + 1,), generator=gen).tolist() for _ in range(batch_size)
    ]
    pool = KVPool.for_model(model, batch_size * (context + 1))
    slots = [pool.alloc(context + 1) for _ in range(batch_size)]
    prefix = FlatBatch([s[:context] for s in seqs], [s[:context] for s in slots], model.device)
    model.forward_flat(prefix, pool, attention=attention, last_only=True)  # only its KV matters
    last = [s[context:] for s in seqs]

    def step() -> None:
        flat = FlatBatch(last, slots, model.device)
        model.forward_flat(flat, pool, attention=attention, last_only=True)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]
