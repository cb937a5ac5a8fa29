"""Wall-clock time of one decode step on the real model, for the batching measurements.

Selective batching is worth what it saves per request: a decode step over ``B`` requests
costs some fixed part (reading the weights, launching kernels, Python) plus a part that
grows with ``B``. ``decode_step_seconds`` measures one such step with every request at
the same context length, so the chapter and ``benchmarks/bench_batching.py`` time exactly
the same thing. Timings vary from run to run and machine to machine; nothing that tests
correctness depends on them. ``roofline_decode_step_table`` gives the same table for a
GPU from the roofline model instead, which is the same on every machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from minisrv.configs import GPUSpec, ModelConfig
from minisrv.kv import KVPool
from minisrv.model import CityLM, FlatBatch
from minisrv.sim.roofline import decode_step_time

__all__ = ["LAUNCH_SECONDS", "decode_step_seconds", "decode_step_table",
           "roofline_decode_step_table"]

# What the host pays to start one GPU kernel: a few microseconds without CUDA graphs.
LAUNCH_SECONDS = 5e-6


def _check_context(model: CityLM, context: int) -> None:
    if context + 1 > model.config.max_seq_len:
        raise ValueError(f"context {context} leaves no room below max_seq_len")


def _decode_step(model: CityLM, batch_size: int, context: int, attention: str,
                 seed: int) -> Callable[[], None]:
    """One decode step of ``batch_size`` requests at ``context``, ready to be timed: each
    request's first ``context`` tokens prefilled into a fresh pool, the step computing one
    more token for every request (its ``FlatBatch`` built inside, as the engine does)."""
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

    return step


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
    _check_context(model, context)
    step = _decode_step(model, batch_size, context, attention, seed)
    for _ in range(warmup):
        step()
    times = sorted(_timed(model, step) for _ in range(repeats))
    return times[len(times) // 2]


def _timed(model: CityLM, step: Callable[[], None]) -> float:
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def decode_step_table(
    model: CityLM,
    sizes: Sequence[int],
    attentions: Sequence[str] = ("padded", "loop"),
    context: int = 64,
    *,
    repeats: int = 15,
    warmup: int = 3,
    seed: int = 0,
) -> dict[str, dict[int, float]]:
    """Seconds of one decode step for every attention and batch size: ``[attention][size]``.

    The steps take turns: each of the ``repeats`` rounds times every (attention, size) once,
    and each keeps its fastest time. On a shared machine a timing can only be slowed, never
    sped up, so the least of N is the least disturbed; and a busy stretch falls on every
    point of a round alike rather than on the neighbouring sizes of one curve, which the
    median of consecutive timings, point after point, would draw as a bump.
    """
    if repeats < 1 or not sizes or any(b < 1 for b in sizes) or context < 1:
        raise ValueError("sizes, context and repeats must all be >= 1")
    _check_context(model, context)
    steps = {(a, b): _decode_step(model, b, context, a, seed) for a in attentions for b in sizes}
    for step in steps.values():
        for _ in range(warmup):
            step()
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(repeats):
        for key, step in steps.items():
            best[key] = min(best[key], _timed(model, step))
    return {a: {b: best[a, b] for b in sizes} for a in attentions}


def roofline_decode_step_table(
    cfg: ModelConfig,
    gpu: GPUSpec,
    sizes: Sequence[int],
    attentions: Sequence[str] = ("padded", "loop"),
    context: int = 1024,
    *,
    launch_s: float = LAUNCH_SECONDS,
) -> dict[str, dict[int, float]]:
    """``decode_step_table``'s table for ``cfg`` on ``gpu``, from the roofline.

    ``[attention][size]`` in seconds.

    One padded (or ragged) attention call per layer costs the roofline step time
    (``decode_step_time``): the weight read, the KV read and the arithmetic. The per-request
    loop does the same work but starts ``size - 1`` more attention kernels per layer, each
    ``launch_s`` of host time the GPU waits for; that is all that tells the two apart here.
    """
    if not sizes or any(b < 1 for b in sizes) or launch_s < 0:
        raise ValueError("sizes must be >= 1 and launch_s >= 0")
    extra = {"padded": 0, "loop": 1}
    if unknown := set(attentions) - set(extra):
        raise ValueError(f"unknown attention {sorted(unknown)}")
    return {a: {b: decode_step_time(cfg, gpu, b, context)
                + extra[a] * cfg.n_layers * (b - 1) * launch_s for b in sizes}
            for a in attentions}
