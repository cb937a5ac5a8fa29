"""``minisrv bench``: a load generator for any OpenAI-compatible server.

It replays a workload against ``/v1/completions`` with ``stream=true`` and measures what a
user feels, as ``sglang.bench_serving`` does: time to first token (TTFT), the gaps between
streamed chunks (inter-token latency, ITL) and end-to-end latency, plus request and token
throughput. Requests arrive all at once (``request_rate=inf``) or as a Poisson process,
and at most ``max_concurrency`` are in flight. Prompts are text, and ``ignore_eos`` (an
SGLang/vLLM extension) fixes every output length, so the same run can be pointed at
minisrv, SGLang or vLLM.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["BENCH_WORKLOADS", "BenchRequest", "BenchResult", "bench_requests", "run_bench"]

BENCH_WORKLOADS: tuple[str, ...] = ("citylm", "shared-prompt", "few-shot")


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str = ""
    sent: float = 0.0  # time.perf_counter() when it was sent


@dataclass
class BenchResult:
    """One run's totals and latency statistics (milliseconds) and each request's text."""

    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    latency_ms: dict[str, dict[str, float]]  # "ttft"/"itl"/"e2e" -> mean, median, p99
    goodput: float | None = None  # requests/s meeting every target of ``slo_ms``
    slo_ms: dict[str, float] = field(default_factory=dict)  # "ttft", "tpot", "e2el" -> ms
    texts: list[str] = field(default_factory=list, repr=False)
    errors: list[str] = field(default_factory=list, repr=False)
    # each request's TTFT in the order sent (nan: it failed), which the percentiles summarize
    ttfts_ms: list[float] = field(default_factory=list, repr=False)
    # each request's send time, ``time.perf_counter()`` of the bench's process, in the order
    # sent: on Linux the machine's monotonic clock (CLOCK_MONOTONIC), which every process
    # there reads, so a server on the same machine can set its own stamps beside it
    sent: list[float] = field(default_factory=list, repr=False)

    def as_dict(self, details: bool = False) -> dict[str, Any]:
        """The totals and statistics; with ``details``, also each request's TTFT, send time
        and text, and the errors (``--output-details``, as ``sglang.bench_serving``'s)."""
        per_request = ("texts", "errors", "ttfts_ms", "sent")
        return {k: v for k, v in asdict(self).items() if details or k not in per_request}

    def table(self) -> str:
        """The report, laid out as ``sglang.bench_serving`` prints it."""
        rows = [
            ("Successful requests:", self.completed),
            ("Failed requests:", self.failed),
            ("Benchmark duration (s):", f"{self.duration_s:.2f}"),
            ("Total input tokens:", self.input_tokens),
            ("Total generated tokens:", self.output_tokens),
            ("Request throughput (req/s):", f"{self.request_throughput:.2f}"),
            ("Input token throughput (tok/s):", f"{self.input_throughput:.2f}"),
            ("Output token throughput (tok/s):", f"{self.output_throughput:.2f}"),
        ]
        if self.goodput is not None:
            targets = ", ".join(f"{k} {v:g} ms" for k, v in self.slo_ms.items())
            rows += [("Goodput targets:", targets),
                     ("Request goodput (req/s):", f"{self.goodput:.2f}")]
        lines = [f"{' Serving Benchmark Result ':=^50}"]
        lines += [f"{name:<40}{value:<10}" for name, value in rows]
        titles = {"ttft": ("Time to First Token", "TTFT"), "itl": ("Inter-token Latency", "ITL"),
                  "e2e": ("End-to-End Latency", "E2E Latency")}
        for key, (title, short) in titles.items():
            lines.append(f"{title:-^50}")
            for stat in ("mean", "median", "p99"):
                name = f"{stat.capitalize() if stat != 'p99' else 'P99'} {short} (ms):"
                lines.append(f"{name:<40}{self.latency_ms[key][stat]:<10.2f}")
        lines.append("=" * 50)
        return "\n".join(lines)


def _stats_ms(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ms = np.asarray(values) * 1e3
    return {"mean": float(ms.mean()), "median": float(statistics.median(ms)),
            "p99": float(np.percentile(ms, 99))}


def bench_requests(workload: str, num_prompts: int, seed: int = 0,
                   output_range: tuple[int, int] = (2, 40)) -> list[BenchRequest]:
    """``num_prompts`` text requests of one of ``BENCH_WORKLOADS`` (CityLM's city lines:
    independent prompts, one shared system prompt, or few-shot groups)."""
    from minisrv import workloads as w
    from minisrv.tokenizer import Tokenizer

    if workload not in BENCH_WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(BENCH_WORKLOADS)}")
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"num_prompts must be an int >= 1, got {num_prompts!r}")
    tok = Tokenizer()
    rng = np.random.default_rng(seed)
    lows = rng.integers(output_range[0], output_range[1] + 1, size=num_prompts).tolist()
    if workload == "citylm":
        prompts = w.city_prompts(tok, num_prompts, seed)
    elif workload == "shared-prompt":
        prompts = w.shared_prompt_workload(tok, n_users=num_prompts).prompts
    else:
        groups = max(1, math.ceil(num_prompts / 8))
        prompts = w.few_shot_workload(tok, n_groups=groups, per_group=8).prompts[:num_prompts]
    return [BenchRequest(tok.decode(p), m) for p, m in zip(prompts, lows)]


async def _one(session: Any, url: str, model: str, req: BenchRequest, ignore_eos: bool,
               extra: dict[str, Any]) -> RequestResult:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos, **extra}
    result = RequestResult(ok=False)
    start = last = result.sent = time.perf_counter()
    pieces: list[str] = []
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            async for raw in response.content:  # one line at a time
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    text = choice.get("text") or ""
                    if not text:
                        continue
                    now = time.perf_counter()
                    if not pieces:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                    pieces.append(text)
    except Exception as exc:  # a failed request is counted, not fatal
        result.error = repr(exc)
        return result
    result.e2e = time.perf_counter() - start
    result.text = "".join(pieces)
    result.output_tokens = result.output_tokens or len(pieces)
    result.ok = True
    return result


async def run_bench(base_url: str, requests: Sequence[BenchRequest], *,
                    request_rate: float = math.inf, max_concurrency: int | None = None,
                    model: str | None = None, ignore_eos: bool = True, seed: int = 0,
                    progress: bool = True, extra_body: dict[str, Any] | None = None,
                    slo_ms: dict[str, float] | None = None) -> BenchResult:
    """Send ``requests`` to ``base_url`` (e.g. ``http://127.0.0.1:30000``) and measure.

    The client is aiohttp, as in ``sglang.bench_serving``: its HTTP parser is written in C,
    so on a small machine the load generator takes less CPU away from the server it
    measures (about a third of what a pure-Python client spends per streamed token).
    """
    import aiohttp
    from tqdm.auto import tqdm

    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    base = base_url.rstrip("/")
    limit = max_concurrency or len(requests)
    connector = aiohttp.TCPConnector(limit=limit)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if model is None:
            async with session.get(f"{base}/v1/models") as answer:
                model = (await answer.json())["data"][0]["id"]
        gate = asyncio.Semaphore(limit)
        bar = tqdm(total=len(requests), unit="req", desc="bench", disable=not progress)
        rng = np.random.default_rng(seed)

        async def send(req: BenchRequest) -> RequestResult:
            async with gate:
                out = await _one(session, f"{base}/v1/completions", model, req, ignore_eos,
                                 extra_body or {})
            bar.update(1)
            return out

        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(send(req)))
            if math.isfinite(request_rate):
                await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return _summarize(results, duration, slo_ms)


def meets(result: RequestResult, slo_ms: dict[str, float]) -> bool:
    """Whether a request met every target, as ``vllm bench serve --goodput`` counts: time to
    first token, time per output token after the first, end-to-end latency (ms)."""
    tpot = ((result.e2e - result.ttft) / (result.output_tokens - 1)
            if result.output_tokens > 1 else 0.0)
    measured = {"ttft": result.ttft, "tpot": tpot, "e2el": result.e2e}
    return result.ok and all(measured[k] * 1e3 <= v for k, v in slo_ms.items())


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` as ``{"ttft": 200.0, "tpot": 50.0}`` (vLLM's syntax)."""
    out = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {spec!r}")
        out[name] = float(value)
    return out


def _summarize(results: Sequence[RequestResult], duration: float,
               slo_ms: dict[str, float] | None = None) -> BenchResult:
    ok = [r for r in results if r.ok]
    inputs = sum(r.prompt_tokens for r in ok)
    outputs = sum(r.output_tokens for r in ok)
    return BenchResult(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration,
        input_tokens=inputs,
        output_tokens=outputs,
        request_throughput=len(ok) / duration,
        input_throughput=inputs / duration,
        output_throughput=outputs / duration,
        latency_ms={"ttft": _stats_ms([r.ttft for r in ok]),
                    "itl": _stats_ms([gap for r in ok for gap in r.itls]),
                    "e2e": _stats_ms([r.e2e for r in ok])},
        goodput=(sum(meets(r, slo_ms) for r in ok) / duration) if slo_ms else None,
        slo_ms=dict(slo_ms or {}),
        texts=[r.text for r in results],
        errors=[r.error for r in results if not r.ok],
        ttfts_ms=[r.ttft * 1e3 if r.ok else math.nan for r in results],
        sent=[r.sent for r in results],
    )
