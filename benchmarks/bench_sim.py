"""How fast the GPU simulator runs: the notes' 2000-request workload under every mode.

The scheduler chapter's widget re-simulates 2000 requests on every slider move, so one run
must take well under 2 seconds on one CPU core. This script times each mode (best of
``--repeats``), prints requests simulated per second of wall time, and, for the record,
the simulated throughput of each mode relative to static batching.

    python benchmarks/bench_sim.py [--requests 2000] [--rate 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

from minisrv.scheduler import MODES
from minisrv.sim import simulate
from minisrv.workloads import GPU_SCALE_BATCH_CAP, Workload, gpu_scale_workload

BUDGET_S = 2.0


def time_mode(workload: Workload, mode: str, repeats: int) -> tuple[float, float, int]:
    """(best wall seconds, simulated throughput in tok/s, steps) for one mode."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run = simulate(workload, mode=mode, max_running=GPU_SCALE_BATCH_CAP)
        best = min(best, time.perf_counter() - start)
    return best, run.metrics.throughput, run.metrics.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=64.0, help="arrivals per second")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    start = time.perf_counter()
    workload = gpu_scale_workload(n=args.requests, rate=args.rate)
    print(f"workload: {workload.description} (built in {time.perf_counter() - start:.2f} s)")
    header = ("mode", "wall s", "req/s", "steps", "sim tok/s", "vs static")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (14, 8, 9, 7, 10, 9), strict=True)))
    results = {mode: time_mode(workload, mode, args.repeats) for mode in MODES}
    static_throughput = results["static"][1]
    for mode, (wall, throughput, steps) in results.items():
        print(
            f"{mode:>14} {wall:8.2f} {len(workload) / wall:9.0f} {steps:7d} "
            f"{throughput:10.0f} {throughput / static_throughput:8.2f}x"
        )
    slowest = max(wall for wall, _, _ in results.values())
    verdict = "within" if slowest < BUDGET_S else "OVER"
    print(f"slowest mode: {slowest:.2f} s, {verdict} the {BUDGET_S:.0f} s budget")


if __name__ == "__main__":
    main()
