"""What a serving run achieved, read off its finished requests and its step trace.

Definitions (the chapter quotes these numbers, so they are stated once, here):

* **throughput**: output tokens / (last finish - first arrival), tokens per clock unit.
* **mean batch**: the average number of requests decoding in a step that decodes. It is
  what "batch size" means for decode speed; prefill-only steps are left out so that modes
  which separate prefills from decodes are compared on the same footing.
* **slot utilisation**: tokens produced / (``max_running`` x steps): the share of the
  batch's seats that did useful work, 1.0 when every step computes a full batch.
* **latency**: arrival to last token; **TTFT**: arrival to first token (the end of the
  prefill step); **ITL**: gap between consecutive tokens of one request. All include
  queueing and pauses, because that is what a user waits for.
* **wait** (queueing delay): arrival to first admission (``admitted_at - arrival``). A
  cache-aware policy reorders the queue, so it can make some requests wait far longer than
  FCFS would: the maximum and 99th percentile wait show that starvation, the mean its
  average cost. A retracted request's second wait is not counted: it had already started.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from minisrv.request import Req
from minisrv.scheduler import StepRecord, hit_rate

__all__ = [
    "RunMetrics",
    "summarize",
    "slot_utilisation",
    "mean_decode_batch",
    "itl_values",
    "request_hit_rate",
    "wait_values",
]


@dataclass(frozen=True)
class RunMetrics:
    """Summary of one run; times are in the clock unit of the backend (steps or seconds)."""

    requests: int
    output_tokens: int
    steps: int
    duration: float
    throughput: float
    mean_batch: float
    slot_utilisation: float
    mean_latency: float
    p99_latency: float
    mean_ttft: float
    p99_ttft: float
    mean_itl: float
    p99_itl: float
    max_itl: float
    mean_wait: float
    p99_wait: float
    max_wait: float

    def as_dict(self) -> dict[str, float]:
        """The fields as a plain dict (one row of a comparison table)."""
        return asdict(self)


def slot_utilisation(trace: Sequence[StepRecord], max_running: int) -> float:
    """Tokens produced / (``max_running`` x steps)."""
    if not trace:
        return 0.0
    return sum(step.batch_size for step in trace) / (max_running * len(trace))


def mean_decode_batch(trace: Sequence[StepRecord]) -> float:
    """Average number of decoding requests over the steps that decode anything."""
    sizes = [len(step.decode) for step in trace if step.decode]
    return sum(sizes) / len(sizes) if sizes else 0.0


def itl_values(reqs: Sequence[Req]) -> np.ndarray:
    """Every inter-token gap of every request, as one array."""
    gaps = [np.diff(req.token_times) for req in reqs if len(req.token_times) > 1]
    return np.concatenate(gaps) if gaps else np.zeros(0)


def wait_values(reqs: Sequence[Req]) -> np.ndarray:
    """Each admitted request's queueing delay: first admission minus arrival.

    Requests never admitted (aborted while waiting) have no wait and are left out.
    """
    return np.array([req.admitted_at - req.arrival for req in reqs
                     if req.admitted_at is not None], dtype=float)


def summarize(reqs: Sequence[Req], trace: Sequence[StepRecord], max_running: int) -> RunMetrics:
    """The metrics of a finished run: its requests and the steps that served them."""
    done = [req for req in reqs if req.token_times]
    if not done:
        raise ValueError("no request of this run produced a token: nothing to summarize")
    latency = np.array([req.latency for req in done])
    ttft = np.array([req.ttft for req in done])
    itl = itl_values(done)
    wait = wait_values(done)
    output_tokens = sum(len(req.output) for req in done)
    duration = max(req.finish_time for req in done) - min(req.arrival for req in done)
    return RunMetrics(
        requests=len(done),
        output_tokens=output_tokens,
        steps=len(trace),
        duration=duration,
        throughput=output_tokens / duration if duration > 0 else float("inf"),
        mean_batch=mean_decode_batch(trace),
        slot_utilisation=slot_utilisation(trace, max_running),
        mean_latency=float(latency.mean()),
        p99_latency=float(np.percentile(latency, 99)),
        mean_ttft=float(ttft.mean()),
        p99_ttft=float(np.percentile(ttft, 99)),
        mean_itl=float(itl.mean()) if itl.size else 0.0,
        p99_itl=float(np.percentile(itl, 99)) if itl.size else 0.0,
        max_itl=float(itl.max()) if itl.size else 0.0,
        mean_wait=float(wait.mean()) if wait.size else 0.0,
        p99_wait=float(np.percentile(wait, 99)) if wait.size else 0.0,
        max_wait=float(wait.max()) if wait.size else 0.0,
    )


def request_hit_rate(reqs: Sequence[Req]) -> float:
    """The hit rate of any group of requests (one turn of a chat, one worker's share):
    their cached prompt tokens at first admission over their prompt tokens."""
    return hit_rate(sum(r.cached_prompt_tokens for r in reqs), sum(r.prompt_len for r in reqs))
