"""minisrv's engine against Hugging Face ``generate`` with static, padded batches.

Many users serve a small model by collecting requests into fixed batches, left-padding the
prompts and calling ``model.generate`` until the longest request of the batch is done.
This script runs that and minisrv's engine (continuous batching, one flat forward per step)
in one process on the same weights, a random HF Llama of CityLM's shape converted with
``minisrv.model.from_hf_llama``, and the same mixed requests, and prints the tokens per
second of each and their ratio (goal: at least 3x; the median over ``--repeats`` runs that
alternate the two, since other processes on a shared machine move both). The engine runs in
each of ``--modes``; the goal is judged on the first, ``mixed`` (newcomers' prefills join
the running requests' decodes in one step, as vLLM schedules), and ``prefill-first`` (the
engine's default, SGLang's) is printed beside it. Every request's greedy tokens must be
identical in every mode and in HF, and equal to ``reference_generate`` of the request alone.
``--batch-size`` is HF's static batch, ``--max-running`` minisrv's cap (give both 64 to
compare at equal batch limits).

    python benchmarks/bench_hf_generate.py [--requests 256] [--batch-size 32] [--threads 1]

Numbers (2026-11-30, the 2-core build machine, torch 2.13 CPU, transformers 5.24, 1 thread,
median of 5): mixed 3.39x and 3.44x in two runs (single runs 3.08-4.72x), prefill-first 3.08x
and 3.03x (2.92-4.19x); HF static b=32 2.1-3.9 s, minisrv mixed 0.62-1.13 s; 256/256 requests
identical across modes, to HF and to each request alone. What changed since the previous
numbers (prefill-first medians 3.15x, 3.04x and 2.87x, mixed slower than prefill-first): the
padded attention pads a step's decodes apart from its prefills (a mixed step used to pad every
decode to its longest prompt), adds a float mask built once per step (SDPA turned the boolean
mask into one in every layer) and skips the padding copies when no request is padded; RMSNorm
goes through ``F.rms_norm`` (the same numbers in one call). Mixed now takes 118 steps where
prefill-first takes 172, and about 15% less time.

2026-12-01, after the fused layers (q/k/v and gate/up one product each, the rotary table,
oneDNN products on the CPU; same machine and versions, median of 3): mixed 3.44x (runs
2.44-3.45x), prefill-first 2.90x (2.83-3.03x); HF static b=32 1.05-1.18 s, minisrv mixed
0.30-0.48 s; 256/256 requests identical across modes, to HF and to each request alone.

2026-12-07, with one untimed pass of each side first (same machine, torch 2.13, transformers
5.25, nothing else running, median of 5): mixed 3.15x (runs 2.42-3.26x), prefill-first 2.64x;
HF static b=32 2.00-2.36 s, minisrv mixed 0.65-0.83 s. Beside two other processes the same
script gave 2.98x and 2.83x: the ratio moves with load by more than its margin over the goal.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm.auto import tqdm

from minisrv import Engine
from minisrv.configs import CITYLM
from minisrv.model import from_hf_llama
from minisrv.tokenizer import Tokenizer
from minisrv.workloads import citylm_workload

GOAL = 3.0


def random_hf_citylm(seed: int = 0, init: float = 0.1):
    """A randomly initialised ``LlamaForCausalLM`` with CityLM's shape (no download).

    A larger init than HF's 0.02 keeps logits far from uniform, so greedy choices are not
    near-ties that rounding differences between batch layouts could flip.
    """
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=CITYLM.vocab_size, hidden_size=CITYLM.d_model,
        intermediate_size=CITYLM.d_ff, num_hidden_layers=CITYLM.n_layers,
        num_attention_heads=CITYLM.n_heads, num_key_value_heads=CITYLM.n_kv_heads,
        head_dim=CITYLM.head_dim, max_position_embeddings=CITYLM.max_seq_len,
        rope_theta=CITYLM.rope_theta, rms_norm_eps=CITYLM.norm_eps,
        tie_word_embeddings=False, initializer_range=init,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def trim(ids: list[int], limit: int, eos: int) -> list[int]:
    """What one request asked for: at most ``limit`` tokens, ending at its first ``<eos>``."""
    ids = ids[:limit]
    return ids[: ids.index(eos) + 1] if eos in ids else ids


@torch.inference_mode()
def hf_static_batches(hf, prompts: list[list[int]], limits: list[int], batch_size: int,
                      eos: int, progress: bool = True) -> list[list[int]]:
    """Requests in arrival order, ``batch_size`` at a time, left-padded; each batch decodes
    until its longest request is done (finished rows keep computing padding)."""
    out: list[list[int]] = []
    starts = range(0, len(prompts), batch_size)
    for start in tqdm(starts, desc="HF generate", unit="batch", disable=not progress):
        batch, lims = prompts[start:start + batch_size], limits[start:start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), eos, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        gen = hf.generate(ids, attention_mask=mask, max_new_tokens=max(lims), do_sample=False,
                          pad_token_id=eos, eos_token_id=eos)
        out += [trim(row[width:].tolist(), lim, eos) for row, lim in zip(gen, lims)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32, help="HF static batch size")
    parser.add_argument("--max-running", type=int, default=64, help="minisrv batch cap")
    parser.add_argument("--modes", nargs="+", default=["mixed", "prefill-first"],
                        help="minisrv step formations to run; the goal is judged on the first "
                             "(mixed: prefills join the decodes' step, as vLLM schedules)")
    parser.add_argument("--output-range", type=int, nargs=2, default=(2, 64))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the check against reference_generate")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    tok = Tokenizer()
    hf = random_hf_citylm()
    ours = from_hf_llama(hf)
    eos = tok.eos_id
    work = citylm_workload(tok, n=args.requests, output_range=tuple(args.output_range), seed=0)
    prompts, limits = work.prompts, work.output_lens
    print(f"random Llama of CityLM's shape, {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"{work.description}; prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
          "tokens")

    engines = {mode: Engine(ours, kv_capacity=20000, max_running=args.max_running, mode=mode)
               for mode in args.modes}
    ratios: dict[str, list[float]] = {mode: [] for mode in args.modes}
    outputs: dict[str, list[list[int]]] = {}
    # one untimed pass of each side first: the first call of either pays one-time costs
    # (oneDNN packs minisrv's weights, HF builds its generation config and caches) that
    # are not serving speed
    hf_static_batches(hf, prompts[:args.batch_size], limits[:args.batch_size],
                      args.batch_size, eos, progress=False)
    for engine in engines.values():
        engine.generate(prompts[:args.max_running], limits[:args.max_running])
    for repeat in range(args.repeats):  # alternate, so that load changes hit both sides
        start = time.perf_counter()
        theirs = hf_static_batches(hf, prompts, limits, args.batch_size, eos, progress=False)
        t_hf = time.perf_counter() - start
        line = (f"run {repeat + 1}: HF generate (static b={args.batch_size}) {t_hf:5.2f} s "
                f"{sum(map(len, theirs)) / t_hf:6.0f} tok/s")
        for mode, engine in engines.items():
            start = time.perf_counter()
            outputs[mode] = engine.generate(prompts, limits)
            t_ours = time.perf_counter() - start
            ratios[mode].append(t_hf / t_ours)
            line += (f"; minisrv {mode} {t_ours:5.2f} s "
                     f"{sum(map(len, outputs[mode])) / t_ours:6.0f} tok/s ({t_hf / t_ours:.2f}x)")
        print(line)
    for mode in args.modes:
        ratio = statistics.median(ratios[mode])
        line = f"minisrv ({mode}) / HF tokens per second, median of {args.repeats}: {ratio:.2f}x"
        if mode == args.modes[0]:
            verdict = "met" if ratio >= GOAL else f"MISSED by {GOAL / ratio:.2f}x"
            line += f" (goal >= {GOAL}x): {verdict}"
        print(line)
    served = outputs[args.modes[0]]
    for mode in args.modes[1:]:
        same_modes = sum(a == b for a, b in zip(outputs[mode], served))
        print(f"identical greedy tokens, minisrv {mode} vs {args.modes[0]}: "
              f"{same_modes}/{len(served)} requests")
    same = sum(a == b for a, b in zip(served, theirs))
    print(f"identical greedy tokens, minisrv {args.modes[0]} vs HF: {same}/{len(served)} "
          "requests")
    if not args.no_reference:
        alone = [ours.reference_generate(p, m) for p, m in zip(prompts, limits)]
        ok = sum(a == b for a, b in zip(served, alone))
        print(f"identical to reference_generate (each request alone): {ok}/{len(served)}")


if __name__ == "__main__":
    main()
