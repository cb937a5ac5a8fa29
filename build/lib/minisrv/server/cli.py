"""``minisrv serve`` and ``minisrv bench`` (also ``python -m minisrv ...``).

``serve`` checks every option before anything is loaded, so ``--policy nope`` or
``--kv-capacity 0`` ends at once with the engine's own message; then uvicorn starts, the
model loads in the background (``/health`` answers 503 until it is ready) and the server
runs until interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser"]


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                       description="Serve a model over OpenAI's HTTP API.")
    p.add_argument("--model", default="citylm",
                   help="'citylm' (embedded, the default) or a local HF Llama folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--kv-capacity", type=int, default=4000, help="KV token slots per engine")
    p.add_argument("--max-running", type=int, default=64, help="cap on the running batch")
    p.add_argument("--policy", default="fcfs", help="waiting-queue order (fcfs, lpm, ...)")
    p.add_argument("--cache", default="radix", help="prefix cache: radix or none")
    p.add_argument("--mode", default="prefill-first", help="step formation (see Engine)")
    p.add_argument("--overlap", action="store_true", help="overlap CPU scheduling with compute")
    p.add_argument("--dp", type=int, default=1, help="data-parallel worker processes")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--engine-process", action="store_true",
                       help="run the engine loop in a worker process of its own (the default: "
                       "no GIL shared with HTTP work; SGLang's layout)")
    where.add_argument("--engine-thread", action="store_true",
                       help="with --dp 1: run the engine loop in a thread of the HTTP process "
                       "instead (one process; its engine can be inspected from the server)")
    p.add_argument("--router-policy", default="cache-aware", help="--dp router policy")
    p.add_argument("--cache-threshold", type=float, default=0.5)
    p.add_argument("--balance-abs-threshold", type=int, default=32)
    p.add_argument("--balance-rel-threshold", type=float, default=1.1)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per engine")
    p.add_argument("--log-level", default="warning")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from minisrv.server.bench import BENCH_WORKLOADS

    p = sub.add_parser("bench", help="load-test an OpenAI-compatible server",
                       description="Replay a workload against /v1/completions and report "
                       "throughput and TTFT / ITL / end-to-end latency.")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:30000")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--workload", default="citylm", choices=BENCH_WORKLOADS)
    p.add_argument("--output-len", type=int, nargs=2, default=(2, 40), metavar=("MIN", "MAX"))
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--output-json", default=None, help="also write the results here")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minisrv", description="minisrv's server and tools")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_bench(sub)
    return parser


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    import uvicorn

    from minisrv.server.app import create_app
    from minisrv.server.loading import load_codec, model_name
    from minisrv.server.workers import (
        DataParallelEngines,
        EngineOptions,
        LocalEngine,
        check_engine_options,
    )

    options = EngineOptions(model=args.model, device=args.device, kv_capacity=args.kv_capacity,
                            max_running=args.max_running, policy=args.policy, cache=args.cache,
                            mode=args.mode, overlap=args.overlap, threads=args.threads)
    try:
        check_engine_options(options)
        codec = load_codec(args.model)
        if args.dp == 1 and args.engine_thread:
            engines = LocalEngine(options)
        else:
            router = dict(policy=args.router_policy, cache_threshold=args.cache_threshold,
                          balance_abs_threshold=args.balance_abs_threshold,
                          balance_rel_threshold=args.balance_rel_threshold)
            engines = DataParallelEngines(options, args.dp, router)
    except (ValueError, ImportError) as exc:
        parser.error(str(exc))
    app = create_app(engines, codec, model_name(args.model))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)


def bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from minisrv.server.bench import bench_requests, run_bench

    try:
        requests = bench_requests(args.workload, args.num_prompts, args.seed,
                                  tuple(args.output_len))
        result = asyncio.run(run_bench(
            args.base_url, requests, request_rate=args.request_rate,
            max_concurrency=args.max_concurrency, model=args.model,
            ignore_eos=not args.disable_ignore_eos, seed=args.seed,
            progress=not args.no_progress))
    except ValueError as exc:
        parser.error(str(exc))
    print(result.table())
    for error in result.errors[:3]:
        print(f"error: {error}", file=sys.stderr)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result.as_dict(), f, indent=2)


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    {"serve": serve, "bench": bench}[args.command](args, parser)
