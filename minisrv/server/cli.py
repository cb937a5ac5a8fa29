"""``minisrv serve`` and ``minisrv bench`` (also ``python -m minisrv ...``).

``serve`` checks every option before anything is loaded, so ``--policy nope`` or
``--kv-capacity 0`` ends at once with the engine's own message; then uvicorn starts, the
model loads in the background (``/health`` answers 503 until it is ready) and the server
runs until interrupted. The flags' defaults are ``ServerConfig``'s (declared once there).

SIGTERM (or a first Ctrl-C) drains the server (``DrainingServer``): new requests get 503,
the requests in flight get ``--shutdown-timeout`` seconds to finish, what is still running
then ends with an error event and ``[DONE]`` (a 503 if nothing was sent yet), and only then
does the server close its connections. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "build_parser"]


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from minisrv.scheduler.config import ADMISSION_ORDERS
    from minisrv.server.config import SERVER_ENGINE, ServerConfig

    d, e = ServerConfig(), SERVER_ENGINE
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                       description="Serve a model over OpenAI's HTTP API.")
    p.add_argument("--model", default="citylm",
                   help="'citylm' (embedded, the default) or a local HF Llama folder "
                        "(a simulated H100: python -m minisrv.sim.served)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--kv-capacity", type=int, default=None,
                   help="KV token slots per engine (default: room for --max-running requests "
                   "at the full context, within a share of the free memory)")
    p.add_argument("--max-running", type=int, default=e.max_running,
                   help="cap on the running batch")
    p.add_argument("--policy", default=e.policy, help="waiting-queue order (fcfs, lpm, ...)")
    p.add_argument("--cache", default=e.cache,
                   help="prefix cache: radix (SGLang's tree), blocks (vLLM's block hashes) "
                        "or none")
    p.add_argument("--mode", default=e.mode, help="step formation (see Engine)")
    p.add_argument("--admission-order", default=e.admission_order, choices=ADMISSION_ORDERS,
                   help="when a step's admissions get their KV: each as it is admitted "
                   "(the default; chunked prefill needs it), or after the whole round has "
                   "locked its cached prefixes, as SGLang does (more prefixes survive a full "
                   "pool)")
    p.add_argument("--overlap", action="store_true", help="overlap CPU scheduling with compute")
    p.add_argument("--chunked-prefill-size", type=int, default=e.chunked_prefill_size,
                   help="at most this many new tokens a step; long prompts go in chunks")
    p.add_argument("--page-size", type=int, default=e.page_size,
                   help="KV slots per page: the allocator's and the prefix cache's unit")
    p.add_argument("--host-cache-tokens", type=int, default=e.host_cache_tokens,
                   help="token slots of the KV host tier (evicted prefixes kept in host "
                        "memory; each --dp worker has its own); 0: none")
    p.add_argument("--host-cache-policy", default=e.host_cache_policy,
                   help="when the host tier gets a copy: write_through, "
                        "write_through_selective or write_back")
    p.add_argument("--speculative", default=e.speculative, choices=("ngram", "draft"),
                   help="speculative decoding: prompt lookup or the shipped draft model")
    p.add_argument("--num-draft-tokens", type=int, default=e.num_draft_tokens,
                   help="with --speculative: guesses per request and step (1..16)")
    p.add_argument("--jump-forward", action="store_true",
                   help="constrained requests append the tokens their grammar forces at once")
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
    p.add_argument("--device", default=d.device,
                   help="cpu or cuda (default: cuda if available)")
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads per engine")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="largest request body (default: from the model's context, >= 1 MiB); "
                   "a larger one is a 413 before it is read")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help="seconds a client may take to send its request body (then 408)")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--restart-backoff", type=float, default=d.restart_backoff,
                   help="seconds before a dead worker is restarted (doubling to 10 s while "
                   "it keeps dying)")
    p.add_argument("--worker-timeout", type=float, default=d.worker_timeout,
                   help="seconds a worker with requests in flight may go without progress "
                   "before it is killed and restarted, its requests failed (an engine thread "
                   "is abandoned and a new one built; 0: never)")
    p.add_argument("--api-key", default=d.api_key,
                   help="require 'Authorization: Bearer KEY' on /v1/ (401 without)")
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
    p.add_argument("--output-details", action="store_true",
                   help="with --output-json: each request's TTFT, send time and text too")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="count requests meeting these targets, e.g. ttft:200 tpot:50")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minisrv", description="minisrv's server and tools")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_bench(sub)
    return parser


def server_config(args: argparse.Namespace) -> Any:
    """The ``ServerConfig`` the flags describe (ValueError for a bad value)."""
    from minisrv.server.config import EngineOptions

    engine = dict(max_running=args.max_running, policy=args.policy, cache=args.cache,
                  mode=args.mode, admission_order=args.admission_order, overlap=args.overlap,
                  chunked_prefill_size=args.chunked_prefill_size,
                  speculative=args.speculative, num_draft_tokens=args.num_draft_tokens,
                  jump_forward=args.jump_forward, host_cache_tokens=args.host_cache_tokens,
                  host_cache_policy=args.host_cache_policy, page_size=args.page_size)
    if args.kv_capacity is not None:
        engine["kv_capacity"] = args.kv_capacity
    config = EngineOptions(model=args.model, device=args.device, threads=args.threads,
                           **engine)
    return dataclasses.replace(config, max_request_bytes=args.max_request_bytes,
                               body_timeout=args.body_timeout,
                               shutdown_timeout=args.shutdown_timeout, api_key=args.api_key,
                               restart_backoff=args.restart_backoff,
                               worker_timeout=args.worker_timeout)


def raise_open_files() -> None:
    """Lift the soft limit on open files to the hard one: a thousand streams are a thousand
    sockets, past the usual soft limit of 1024 (SGLang raises it the same way)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):  # not on this platform, or not allowed
        pass


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser,
          builder: Any = None, codec: Any = None) -> None:
    """``minisrv serve``; ``builder`` and ``codec`` serve an engine that loads no model (the
    book's simulated H100: ``python -m minisrv.sim.served``) with that tokenizer."""
    import uvicorn

    from minisrv.server.app import create_app
    from minisrv.server.config import model_name
    from minisrv.server.dataparallel import DataParallelEngines
    from minisrv.server.shutdown import DrainingServer
    from minisrv.server.worker import LocalEngine
    from minisrv.tokenizer import load_tokenizer

    try:
        config = server_config(args)
        if builder is not None:
            config = dataclasses.replace(config, builder=builder)
        codec = codec if codec is not None else load_tokenizer(args.model)
        engines: Any
        if args.dp == 1 and args.engine_thread:
            engines = LocalEngine(config)
        else:
            router = dict(policy=args.router_policy, cache_threshold=args.cache_threshold,
                          balance_abs_threshold=args.balance_abs_threshold,
                          balance_rel_threshold=args.balance_rel_threshold)
            engines = DataParallelEngines(config, args.dp, router)
    except (ValueError, ImportError) as exc:
        parser.error(str(exc))
    raise_open_files()
    app = create_app(engines, codec, model_name(args.model), config)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level,
                                           timeout_graceful_shutdown=5),
                            app.state.frontend, config.shutdown_timeout)
    server.run()


def bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from minisrv.server.bench import bench_requests, parse_goodput, run_bench

    raise_open_files()
    try:
        requests = bench_requests(args.workload, args.num_prompts, args.seed,
                                  tuple(args.output_len))
        result = asyncio.run(run_bench(
            args.base_url, requests, request_rate=args.request_rate,
            max_concurrency=args.max_concurrency, model=args.model,
            ignore_eos=not args.disable_ignore_eos, seed=args.seed,
            progress=not args.no_progress,
            slo_ms=parse_goodput(args.goodput) if args.goodput else None))
    except ValueError as exc:
        parser.error(str(exc))
    print(result.table())
    for error in result.errors[:3]:
        print(f"error: {error}", file=sys.stderr)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result.as_dict(details=args.output_details), f, indent=2)


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    {"serve": serve, "bench": bench}[args.command](args, parser)
