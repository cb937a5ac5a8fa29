"""Seeded request mixes: who arrives when, with how long a prompt, wanting how many tokens.

A ``Workload`` is plain data (prompts, output lengths, arrival times) so that the same mix
can be replayed against every scheduling mode and both backends. Every generator takes a
``seed`` and draws from its own ``numpy.random.Generator``: the same call always returns
the same workload, on any machine.

Arrival processes (``ARRIVALS``):

* ``"poisson"``: independent arrivals at ``rate`` per unit of time (exponential gaps), the
  usual model of many users acting independently; the first request arrives at time 0.
* ``"fixed"``: exactly one request every ``1 / rate``.
* ``"all-at-once"``: everything arrives at time 0 (an offline batch job).

Output lengths (``output_lengths``) follow a gamma distribution with a chosen mean and
coefficient of variation (standard deviation / mean): ``cv = 0`` gives identical lengths,
``cv = 1`` the exponential distribution (many short answers, a few very long ones), which is
the default of the GPU-scale workload because the spread of output lengths is exactly what
request-level batching suffers from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from minisrv.checks import check_int, check_number
from minisrv.train.data import SHOWCASE_COUNTRIES, country_line

if TYPE_CHECKING:
    from minisrv.tokenizer import Tokenizer

__all__ = [
    "ARRIVALS",
    "Workload",
    "arrival_times",
    "output_lengths",
    "gpu_scale_workload",
    "city_prompts",
    "citylm_workload",
    "lecture_trace_workload",
    "summarize_lengths",
    "check_workload_args",
]

ARRIVALS: tuple[str, ...] = ("poisson", "fixed", "all-at-once")

# The GPU-scale workload of the lecture: 2000 requests, prompts 100-1000 tokens,
# outputs averaging about 200 tokens, Poisson arrivals; served with a batch cap of 64.
GPU_SCALE_REQUESTS = 2000
GPU_SCALE_PROMPT_RANGE = (100, 1000)
GPU_SCALE_MEAN_OUTPUT = 200
GPU_SCALE_MAX_OUTPUT = 2000
GPU_SCALE_BATCH_CAP = 64


@dataclass(frozen=True)
class Workload:
    """A replayable list of requests.

    ``output_lens[i]`` is request ``i``'s ``max_new_tokens``; ``arrivals[i]`` its arrival on
    the serving clock (simulated seconds for the GPU simulator, steps for the real model).
    """

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]
    description: str = ""

    def __post_init__(self) -> None:
        n = len(self.prompts)
        if len(self.output_lens) != n or len(self.arrivals) != n:
            raise ValueError(
                f"workload {self.name!r}: {n} prompts, {len(self.output_lens)} output lengths "
                f"and {len(self.arrivals)} arrivals; they must match"
            )

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def prompt_lens(self) -> list[int]:
        """Tokens in each prompt."""
        return [len(p) for p in self.prompts]

    @property
    def total_output_tokens(self) -> int:
        """Tokens the whole workload asks to generate."""
        return int(sum(self.output_lens))

    @property
    def mean_output(self) -> float:
        """Average requested output length."""
        return self.total_output_tokens / len(self) if len(self) else 0.0


def arrival_times(
    n: int, rate: float, kind: str = "poisson", rng: np.random.Generator | None = None
) -> list[float]:
    """``n`` non-decreasing arrival times starting at 0 for the process ``kind``.

    ``rate`` is arrivals per unit of time (ignored by ``"all-at-once"``).
    """
    if kind not in ARRIVALS:
        raise ValueError(f"unknown arrival process {kind!r}; supported: {', '.join(ARRIVALS)}")
    check_workload_args(n)
    if kind == "all-at-once":
        return [0.0] * n
    if not rate > 0:
        raise ValueError(f"arrival rate must be > 0, got {rate}")
    if kind == "fixed":
        return [i / rate for i in range(n)]
    rng = rng if rng is not None else np.random.default_rng(0)
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[:1] = 0.0  # the first request opens the run
    return np.cumsum(gaps).tolist()


def output_lengths(
    n: int,
    mean: float,
    cv: float = 1.0,
    max_len: int | None = None,
    rng: np.random.Generator | None = None,
) -> list[int]:
    """``n`` output lengths from a gamma distribution with ``mean`` and spread ``cv``.

    Lengths are rounded up to whole tokens (at least 1) and capped at ``max_len``. The cap
    keeps every request's KV reservation bounded; it trims the mean slightly when ``cv`` is
    large, so report the workload's ``mean_output`` rather than ``mean``.
    """
    check_workload_args(n)
    if not mean >= 1:
        raise ValueError(f"mean output length must be >= 1, got {mean}")
    if not cv >= 0:
        raise ValueError(f"cv must be >= 0, got {cv}")
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if cv == 0:
        lengths = np.full(n, float(mean))
    else:
        rng = rng if rng is not None else np.random.default_rng(0)
        shape = 1.0 / cv**2
        lengths = rng.gamma(shape, mean / shape, size=n)
    lengths = np.maximum(np.ceil(lengths), 1)
    if max_len is not None:
        lengths = np.minimum(lengths, max_len)
    return lengths.astype(int).tolist()


def gpu_scale_workload(
    n: int = GPU_SCALE_REQUESTS,
    rate: float = 64.0,
    arrival: str = "poisson",
    prompt_range: tuple[int, int] = GPU_SCALE_PROMPT_RANGE,
    mean_output: float = GPU_SCALE_MEAN_OUTPUT,
    output_cv: float = 1.0,
    max_output: int = GPU_SCALE_MAX_OUTPUT,
    vocab_size: int = 128256,
    seed: int = 0,
) -> Workload:
    """The lecture's GPU-scale mix: prompts uniform in ``prompt_range`` (inclusive), outputs
    gamma-distributed with ``mean_output`` and ``output_cv`` (exponential by default,
    capped at ``max_output``), arrivals from ``arrival`` at ``rate`` requests per second.

    Prompt tokens are random ids, distinct across requests, so no two prompts share a prefix
    (prefix caching has nothing to find here; ``groups`` builds workloads that share).
    """
    low, high = prompt_range
    if not 1 <= low <= high:
        raise ValueError(f"prompt_range must satisfy 1 <= low <= high, got {prompt_range}")
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(low, high + 1, size=n)
    outputs = output_lengths(n, mean_output, output_cv, max_output, rng)
    arrivals = arrival_times(n, rate, arrival, rng)
    tokens = rng.integers(2, vocab_size, size=int(prompt_lens.sum())).tolist()
    bounds = np.concatenate([[0], np.cumsum(prompt_lens)]).tolist()
    prompts = [tokens[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    description = (
        f"{n} requests, prompts uniform {low}-{high} tokens, outputs gamma(mean "
        f"{mean_output:g}, cv {output_cv:g}) capped at {max_output}, {arrival} arrivals"
        + ("" if arrival == "all-at-once" else f" at {rate:g}/s")
        + f", seed {seed}"
    )
    return Workload("gpu-scale", prompts, outputs, arrivals, description)


def city_prompts(tok: Tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` CityLM prompts: a showcase country's line cut after 0-2 cities, e.g. ``"FR:"``
    or ``"JP: Tokyo, Yokohama,"``, so the model continues with more cities.
    """
    check_workload_args(n)
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(n):
        code = SHOWCASE_COUNTRIES[i % len(SHOWCASE_COUNTRIES)]
        n_cities = int(rng.integers(0, 3))
        text = f"{code}:" if n_cities == 0 else country_line(code, n_cities) + ","
        prompts.append(tok.encode(text))
    return prompts


def citylm_workload(
    tok: Tokenizer,
    n: int = 16,
    output_range: tuple[int, int] = (2, 40),
    arrival_every: float = 0.0,
    seed: int = 0,
) -> Workload:
    """``n`` CityLM requests with ``max_new_tokens`` uniform in ``output_range``
    (inclusive); request ``i`` arrives at step ``i * arrival_every`` (0: all at once).
    """
    low, high = output_range
    if not 1 <= low <= high:
        raise ValueError(f"output_range must satisfy 1 <= low <= high, got {output_range}")
    if not arrival_every >= 0:
        raise ValueError(f"arrival_every must be >= 0, got {arrival_every}")
    rng = np.random.default_rng(seed)
    outputs = rng.integers(low, high + 1, size=n).tolist()
    prompts = city_prompts(tok, n, seed)
    arrivals = [i * arrival_every for i in range(n)]
    description = f"{n} CityLM requests, max_new_tokens uniform {low}-{high}"
    if arrival_every:
        description += f", one arriving every {arrival_every:g} steps"
    return Workload("citylm", prompts, outputs, arrivals, description)


def lecture_trace_workload(tok: Tokenizer) -> Workload:
    """The three requests of the lecture's trace: ``max_new_tokens`` 3, 5 and 3; the first two
    arrive at step 0, the third at step 2 (serve them with at most 2 running).
    """
    prompts = [tok.encode(text) for text in ("FR:", "JP:", "BR:")]
    return Workload(
        "lecture-trace", prompts, [3, 5, 3], [0.0, 0.0, 2.0], "3 requests, max 2 running"
    )


def summarize_lengths(values: Sequence[int]) -> str:
    """``"mean 201.3, median 139, max 1490"``: a one-line description for chapter prose."""
    arr = np.asarray(values)
    return f"mean {arr.mean():.1f}, median {np.median(arr):g}, max {arr.max()}"


def check_workload_args(n: int, output_len: int = 1, gap: float = 0.0) -> None:
    """``ValueError`` unless ``n`` requests >= 0, an output length >= 1 and a gap >= 0."""
    check_int("number of requests", n, minimum=0)
    check_int("output length", output_len, minimum=1)
    check_number("arrival gap", gap, low=0.0)
