"""The chunked-prefill chapter's runs: the inter-token spike a long prompt causes, and the
trade-off of the chunk size (inter-token latency against time to first token).

Everything runs on the simulated GPU (LLaMA-3.1-8B on an H100: LLaMA-3-8B's shapes with a
128K context, so that prompts of 4K-32K tokens are allowed) through the same ``Scheduler``
as the real model. ``spike_run`` is the opening experiment: chats decoding, then one long
prompt arrives. ``chunk_sweep`` serves a mix of short chats and long prompts at each chunk
size, ``None`` meaning no chunking (``chunk_runs`` keeps the runs, ``chunk_table`` reads
their numbers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from minisrv.configs import LLAMA31_8B
from minisrv.engine import RunResult
from minisrv.metrics import itl_values
from minisrv.sim import simulate
from minisrv.workloads import Workload, output_lengths

if TYPE_CHECKING:  # imported where a table is made: the runs need no pandas
    import pandas as pd

__all__ = [
    "CHUNK_SIZES",
    "SGLANG_DEFAULT",
    "VLLM_SMALL_GPU",
    "VLLM_V1_DEFAULT",
    "SpikeRun",
    "chunk_runs",
    "chunk_sweep",
    "chunk_table",
    "long_prompt_workload",
    "spike_run",
    "spike_workload",
]

CHUNK_SIZES: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192, 16384)
"""The chunk sizes the chapter sweeps."""

SGLANG_DEFAULT = 8192
"""SGLang 0.5.23's ``chunked_prefill_size`` on an H100 (``handle_gpu_memory_settings`` in
``srt/arg_groups/memory_hook.py``: 8192 from 60 to 160 GB). Its steps are prefill-first
unless ``--enable-mixed-chunk`` (off by default)."""

VLLM_V1_DEFAULT = 8192
"""vLLM V1's ``max_num_batched_tokens`` for its OpenAI server on an H100 (2048 on smaller
GPUs, 16384 for the offline ``LLM`` class); its steps always put decodes first."""

VLLM_SMALL_GPU = 2048
"""vLLM V1's ``max_num_batched_tokens`` for its OpenAI server on GPUs under 70 GiB (and A100s)."""

MAX_RUNNING = 64  # the GPU-scale batch cap of the scheduler chapter


def long_prompt_workload(n: int = 300, long_share: float = 0.1,
                         long_range: tuple[int, int] = (4096, 32768),
                         chat_range: tuple[int, int] = (100, 1000), mean_output: float = 200,
                         rate: float = 4.0, vocab_size: int = 128256,
                         seed: int = 0) -> Workload:
    """Short chats (prompts uniform in ``chat_range``) with a ``long_share`` of long prompts
    (uniform in ``long_range``, e.g. a document to summarize); outputs gamma-distributed
    around ``mean_output`` (capped at 1000), Poisson arrivals at ``rate`` per second."""
    if not 0.0 <= long_share <= 1.0:
        raise ValueError(f"long_share must be in [0, 1], got {long_share}")
    rng = np.random.default_rng(seed)
    long = rng.random(n) < long_share
    lens = np.where(long, rng.integers(*long_range, size=n, endpoint=True),
                    rng.integers(*chat_range, size=n, endpoint=True))
    outputs = output_lengths(n, mean_output, 1.0, 1000, rng)
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    prompts = [rng.integers(2, vocab_size, size=int(k)).tolist() for k in lens]
    description = (f"{n} requests, {long_share:.0%} with prompts of {long_range[0]}-"
                   f"{long_range[1]} tokens, the rest {chat_range[0]}-{chat_range[1]}, "
                   f"Poisson arrivals at {rate:g}/s, seed {seed}")
    return Workload("long-prompts", prompts, outputs, np.cumsum(gaps).tolist(), description)


def spike_workload(n_chats: int = 16, long_prompt: int = 32768, arrival: float = 0.5,
                   chat_output: int = 200) -> Workload:
    """``n_chats`` chats (prompts of 500 tokens) start at time 0 and decode; one prompt of
    ``long_prompt`` tokens arrives at ``arrival`` seconds among them."""
    prompts = [[2 + (i % 1000)] * 500 for i in range(n_chats)] + [[7] * long_prompt]
    return Workload("spike", prompts, [chat_output] * n_chats + [16],
                    [0.0] * n_chats + [arrival], "chats decoding, one long prompt arriving")


class SpikeRun(NamedTuple):
    """The opening experiment at one chunk size."""

    chunk: int | None
    result: RunResult
    max_gap: float  # the chats' worst inter-token gap (s)
    long_ttft: float  # the long prompt's time to first token (s)
    mode: str = "mixed"

    @property
    def name(self) -> str:
        """``no chunking``, ``chunks of N``, the mode added when it is not ``mixed``."""
        name = "no chunking" if self.chunk is None else f"chunks of {self.chunk}"
        return name if self.mode == "mixed" else f"{name}, {self.mode}"


def spike_run(chunk: int | None = None, mode: str = "mixed", **workload_args) -> SpikeRun:
    """Serve ``spike_workload`` with ``chunked_prefill_size=chunk``; the chats' worst gap
    and the long prompt's TTFT."""
    result = simulate(spike_workload(**workload_args), cfg=LLAMA31_8B, mode=mode,
                      max_running=MAX_RUNNING, chunked_prefill_size=chunk)
    chats, long = result.requests[:-1], result.requests[-1]
    return SpikeRun(chunk, result, float(itl_values(chats).max()), long.ttft, mode)


def chunk_runs(sizes: Sequence[int | None] = (None, *CHUNK_SIZES),
               workload: Workload | None = None,
               mode: str = "mixed") -> dict[int | None, RunResult]:
    """``workload`` (``long_prompt_workload()`` by default) served at each chunk size, by
    size; ``None``: no chunking. The runs keep their traces and token times for figures."""
    workload = workload if workload is not None else long_prompt_workload()
    return {size: simulate(workload, cfg=LLAMA31_8B, mode=mode, max_running=MAX_RUNNING,
                           chunked_prefill_size=size) for size in sizes}


def chunk_table(runs: Mapping[int | None, RunResult], long_from: int = 4096) -> pd.DataFrame:
    """One row per run of ``chunk_runs``: its step mode, inter-token latency (p99, max), TTFT
    (mean; p99 of the short chats; mean of the long prompts, those of ``long_from`` tokens or
    more), throughput and steps."""
    import pandas as pd

    rows = []
    for size, result in runs.items():
        m = result.metrics
        long = [r for r in result.requests if r.prompt_len >= long_from]
        short = [r for r in result.requests if r.prompt_len < long_from]
        rows.append({
            "chunk": size, "mode": result.mode, "p99_itl": m.p99_itl, "max_itl": m.max_itl,
            "mean_ttft": m.mean_ttft,
            "p99_ttft_short": float(np.percentile([r.ttft for r in short], 99)) if short else 0.0,
            "mean_ttft_long": float(np.mean([r.ttft for r in long])) if long else 0.0,
            "throughput": m.throughput, "steps": m.steps,
        })
    return pd.DataFrame(rows)


def chunk_sweep(sizes: Sequence[int | None] = (None, *CHUNK_SIZES),
                workload: Workload | None = None, mode: str = "mixed",
                long_from: int = 4096) -> pd.DataFrame:
    """One row per chunk size (``chunk_table`` of ``chunk_runs``): inter-token latency (p99,
    max), TTFT (mean; p99 of the short chats; mean of the long prompts), throughput.
    ``None``: no chunking."""
    return chunk_table(chunk_runs(sizes, workload, mode), long_from)
