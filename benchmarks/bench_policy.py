"""What a scheduling round costs: FCFS, LPM and DFS-weight against queue length.

Cache-aware policies match every waiting prompt against the radix tree each round, so their
cost grows with the queue; FCFS costs nothing. This is why SGLang's LPM stops matching past
``WAITING_QUEUE_PREFIX_MATCH_MAX`` (128) waiting requests, while DFS-weight keeps paying.

The prompts are 1,000-token requests of a prefix forest (system prompts x example sets x
questions); the tree already holds the first ``--cached`` of them, so matches are long, as
on a warm server. Each policy orders the next ``n`` requests for ``n`` from 10 to 2,000; the
script prints the CPU time of a round (fastest of ``--repeats``) and its ratio to FCFS,
then one LPM round over 128 waiting requests (the goal: under 2 ms on one core), warm and
with a cold tree.

    python benchmarks/bench_policy.py [--repeats 9] [--cached 512] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

from minisrv.kv import RadixCache
from minisrv.scheduler.policy import WAITING_QUEUE_PREFIX_MATCH_MAX, calc_priority
from minisrv.workloads import prefix_forest_workload

QUEUE_LENGTHS = (10, 30, 100, 128, 129, 300, 1000, 2000)
SHAPE = (8, 8, 48)  # 3,072 prompts
LENGTHS = (600, 300, 100)  # 1,000 tokens each
POLICIES = ("fcfs", "lpm", "dfs-weight")


def round_time(policy: str, tree: RadixCache, queue: list[list[int]], repeats: int) -> float:
    """Fastest of ``repeats`` rounds of ``calc_priority``, in CPU seconds of this process.

    CPU time, not wall time: the machine may be shared, and a round is single-threaded, so
    CPU time is what one core spends. The minimum is the least disturbed measurement. One
    warm-up round first makes the node splits that matching causes, as a scheduler's first
    round would.
    """
    calc_priority(policy, tree, queue)
    times = []
    for _ in range(repeats):
        start = time.process_time()
        calc_priority(policy, tree, queue)
        times.append(time.process_time() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--cached", type=int, default=512, help="prompts already in the tree")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    prompts = prefix_forest_workload(SHAPE, LENGTHS, seed=args.seed).prompts
    tree = RadixCache()
    for prompt in prompts[: args.cached]:
        tree.insert(prompt)
    waiting = prompts[args.cached:]
    print(f"{len(prompts)} prompts of {sum(LENGTHS)} tokens; the tree holds {args.cached} "
          f"({tree.total_size():,} tokens, {tree.n_nodes} nodes)")
    print(f"{'waiting':>8} " + " ".join(f"{p + ' ms':>14}" for p in POLICIES)
          + f" {'lpm/fcfs':>9} {'dfs/fcfs':>9}")
    for n in QUEUE_LENGTHS:
        queue = waiting[:n]
        ms = {p: 1e3 * round_time(p, tree, queue, args.repeats) for p in POLICIES}
        note = "  (LPM falls back to FCFS)" if n > WAITING_QUEUE_PREFIX_MATCH_MAX else ""
        print(f"{n:>8} " + " ".join(f"{ms[p]:>14.3f}" for p in POLICIES)
              + f" {ms['lpm'] / ms['fcfs']:>9.0f} {ms['dfs-weight'] / ms['fcfs']:>9.0f}{note}")

    queue = waiting[:WAITING_QUEUE_PREFIX_MATCH_MAX]
    warm = 1e3 * round_time("lpm", tree, queue, 5 * args.repeats)
    cold = 1e3 * round_time("lpm", RadixCache(), queue, 5 * args.repeats)
    print(f"one LPM round, {len(queue)} waiting x {sum(LENGTHS)} tokens: {warm:.2f} ms warm "
          f"tree, {cold:.2f} ms empty tree (every request in the in-batch check); goal < 2 ms")


if __name__ == "__main__":
    main()
