"""The server's overhead: tokens/s through HTTP against ``Engine.generate`` in-process.

Starts ``minisrv serve`` (CityLM) as a subprocess, sends the same requests through
``minisrv bench``'s load generator with 64 concurrent streams, and then runs them through
``Engine.generate`` in this process with the same engine options. Prints both tokens per
second and their ratio (goal: at least 0.7x), and checks that every streamed reply is the
text the engine produced for that request (greedy; each also equals
``reference_generate``, which the server tests check).

    python benchmarks/bench_server.py [--requests 256] [--concurrency 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from minisrv import Engine, load_citylm
from minisrv.server.bench import BenchRequest, run_bench
from minisrv.workloads import citylm_workload

GOAL = 0.7
ROOT = Path(__file__).resolve().parents[1]


LAYOUTS = {"thread": [], "process": ["--engine-process"]}


def start_server(port: int, args: argparse.Namespace, layout: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "minisrv", "serve", "--port", str(port), "--threads",
           str(args.threads), "--kv-capacity", str(args.kv_capacity), "--max-running",
           str(args.max_running), "--mode", args.mode, "--cache", args.cache, *LAYOUTS[layout]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit("the server exited while starting")
        time.sleep(0.1)
    proc.terminate()
    raise SystemExit("the server did not become healthy within 60 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--output-range", type=int, nargs=2, default=(16, 64))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--kv-capacity", type=int, default=8000)
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--mode", default="mixed")
    parser.add_argument("--cache", default="radix")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS),
                        help="engine in a thread of the HTTP process, or in its own process")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_citylm("cpu")
    work = citylm_workload(tok, n=args.requests, output_range=tuple(args.output_range), seed=0)
    requests = [BenchRequest(tok.decode(p), m) for p, m in zip(work.prompts, work.output_lens)]
    print(f"CityLM on cpu, {torch.get_num_threads()} thread(s); {work.description}")

    results = {}
    for layout in args.layouts:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = start_server(port, args, layout)
        try:
            results[layout] = asyncio.run(run_bench(
                f"http://127.0.0.1:{port}", requests, max_concurrency=args.concurrency,
                ignore_eos=False))
        finally:
            proc.terminate()
            proc.wait(15)
        print(f"engine in a {layout}:")
        print(results[layout].table())

    engine = Engine(model, kv_capacity=args.kv_capacity, max_running=args.max_running,
                    mode=args.mode, cache=args.cache)
    start = time.perf_counter()
    served = engine.generate(work.prompts, work.output_lens)
    t_engine = time.perf_counter() - start
    engine_tps = sum(map(len, served)) / t_engine
    print(f"\n{'':44}{'tokens/s':>10}{'ratio':>8}  identical replies")
    print(f"{'Engine.generate, in-process':44}{engine_tps:10.1f}")
    for layout, result in results.items():
        same = sum(tok.decode(ids) == text for ids, text in zip(served, result.texts))
        ratio = result.output_throughput / engine_tps
        verdict = "met" if ratio >= GOAL else "MISSED"
        name = f"HTTP, {args.concurrency} streams, engine in a {layout}"
        print(f"{name:44}{result.output_throughput:10.1f}{ratio:7.2f}x  {same}/{len(served)}"
              f"  (goal >= {GOAL}x: {verdict})")


if __name__ == "__main__":
    main()
