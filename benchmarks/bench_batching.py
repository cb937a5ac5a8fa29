"""Selective batching on CityLM: what one flat forward per step buys, measured side by side.

Prints, from one process on the same machine:

1. the per-request time of a decode step at batch sizes 1..64, for the padded single-call
   attention and the per-request attention loop, as a ratio to batch 1 (goal: batch 16 at
   most 0.35x per request);
2. the engine's tokens/s on 64 mixed CityLM requests against generating the same requests
   one after another with ``reference_generate`` (goal: at least 5x), and whether the
   outputs are identical.

    python benchmarks/bench_batching.py [--threads 1] [--context 64] [--requests 64]
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm.auto import tqdm

from minisrv import Engine, load_citylm
from minisrv.sim.steptime import decode_step_seconds
from minisrv.workloads import citylm_workload

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
GOAL_BATCH16 = 0.35
GOAL_ENGINE = 5.0


def step_table(model, context: int, repeats: int) -> dict[str, dict[int, float]]:
    """Median decode-step seconds per batch size, for both attention implementations."""
    table: dict[str, dict[int, float]] = {}
    jobs = [(a, b) for a in ("padded", "loop") for b in BATCH_SIZES]
    for attention, b in tqdm(jobs, desc="decode steps"):
        t = decode_step_seconds(model, b, context, attention=attention, repeats=repeats)
        table.setdefault(attention, {})[b] = t
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--context", type=int, default=64, help="tokens per request")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if any)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_citylm(args.device)
    threads = torch.get_num_threads()
    print(f"CityLM on {model.device}, {threads} thread(s), torch {torch.__version__}")

    table = step_table(model, args.context, args.repeats)
    print(f"\nDecode step, every request at context {args.context} (median of {args.repeats})")
    print(f"{'batch':>5} | {'padded ms':>9} {'per req':>8} {'vs b=1':>7} | "
          f"{'loop ms':>8} {'per req':>8} {'vs b=1':>7}")
    for b in BATCH_SIZES:
        cells = []
        for attention in ("padded", "loop"):
            t = table[attention][b]
            ratio = t / b / table[attention][1]
            cells.append(f"{t * 1e3:9.2f} {t / b * 1e3:8.3f} {ratio:7.3f}")
        print(f"{b:>5} | {cells[0]} | {cells[1]}")
    ratio16 = table["padded"][16] / 16 / table["padded"][1]
    verdict = "met" if ratio16 <= GOAL_BATCH16 else f"MISSED by {ratio16 / GOAL_BATCH16:.2f}x"
    print(f"batch 16 per-request cost: {ratio16:.3f}x of batch 1 "
          f"(goal <= {GOAL_BATCH16}): {verdict}")

    work = citylm_workload(tok, n=args.requests, output_range=(2, 40), seed=0)
    lens = [len(p) for p in work.prompts]
    print(f"\n{work.description}; prompts {min(lens)}-{max(lens)} tokens")
    start = time.perf_counter()
    alone = [model.reference_generate(p, m) for p, m in zip(work.prompts, work.output_lens)]
    t_seq = time.perf_counter() - start
    engine = Engine(model, kv_capacity=8000, max_running=args.requests, mode="mixed")
    start = time.perf_counter()
    served = engine.generate(work.prompts, work.output_lens)
    t_eng = time.perf_counter() - start
    tokens = sum(len(o) for o in served)
    print(f"sequential reference_generate: {t_seq:6.2f} s, {tokens / t_seq:8.0f} tok/s")
    print(f"engine (mixed, flat forward):  {t_eng:6.2f} s, {tokens / t_eng:8.0f} tok/s, "
          f"{engine.stats.steps} steps")
    speedup = t_seq / t_eng
    verdict = "met" if speedup >= GOAL_ENGINE else f"MISSED by {GOAL_ENGINE / speedup:.2f}x"
    print(f"engine speed-up: {speedup:.1f}x (goal >= {GOAL_ENGINE}): {verdict}")
    same = sum(a == b for a, b in zip(served, alone))
    print(f"outputs identical to each request alone: {same} of {len(alone)}")


if __name__ == "__main__":
    main()
