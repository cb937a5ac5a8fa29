"""The runner on a CUDA GPU: decode steps with and without CUDA graphs, nano-vllm's workload,
the overlapped loop, and graphs-vs-eager token identity (issue 23's GPU measurements).

Needs a CUDA GPU: without one it says so and exits 1 (a CPU run would measure nothing). The
models are random (timing does not depend on weight values; nothing is downloaded), in
bf16, built on the GPU. Four tables, each written as CSV to ``--out`` (default
``minisrv/measured/``, file names prefixed by the GPU's short name) with the GPU and the
torch and Triton versions in every row:

1. ``decode_steps_graphs.csv``: a SmolLM2-135M-shaped decode step (``ModelRunner.prepare``
   + ``compute``, every request at ``--context``) against batch 1..256: the padded
   attention eager and with CUDA graphs (``cuda_graph=True``), and the Triton backend
   (``attention="triton"``, reading the pool in place; eager: the graph buffers of
   ``minisrv.runner.graph`` attend with the padded call), median of ``--repeats``;
2. ``nanovllm_workload.csv``: nano-vllm's benchmark (256 sequences, prompt and output
   lengths uniform in 100..1024, ``ignore_eos``, random prompts) on a Llama-3.2-1B-shaped
   model: output tokens per second of the whole run, padded with graphs off and on, Triton,
   and beside them Hugging Face ``generate`` in static batches of ``HF_BATCH`` on random
   weights of the same shape (at most ``HF_SEQS`` sequences of the workload: a rate, so
   comparable; each sequence credited with its own output length only);
3. ``overlap_gain.csv``: the blocking against the overlapped loop at the first batch whose
   host share of a step is >= 30% (``time_steps``), with ``throughput_ratio``'s prediction;
4. ``graph_tokens.csv``: greedy tokens with graphs against without, request by request;

and, in the full run only, the two tables the GPU appendix draws (``decode_steps.csv``,
``engine_throughput.csv``, read by ``minisrv.experiments.gpu.recorded_gpu_run``): the padded
against the ragged (flex) attention's decode step beside the roofline, and the engine's
decode throughput for both and for the hybrid (decodes padded, prefills flex: ``auto``'s
pick from compute capability 8.0 on); and ``mixed_steps.csv``: the GPU appendix's mixed
step (a prefill of ``MIXED_PREFILL`` new tokens beside decodes at ``--context``) with each
of the three, which says whether splitting a mixed step (the hybrid) beats sending it whole
to the ragged call, as the appendix's tile count predicts.

    python benchmarks/bench_gpu.py [--quick] [--context 512] [--repeats 20] [--out DIR]

``--quick`` (a minute or two): fewer batches and repeats, 32 sequences of 100..256 tokens.
On a lent GPU machine without network, ``benchmarks/gpu_run.sh`` runs the GPU tests, then
``--quick``, then the full run if time remains.
``make gpu-bench`` runs ``--quick`` first, then the full script (within 8 minutes on an
H200 is the aim). Nothing here has run on a GPU yet: the first run is the test of the
CUDA graph path (``minisrv.runner.graph``), and ``cuda_graph`` stays off by default until
it and ``make gpu-check`` pass with graphs on.

The attention tables as recorded before issue 23 (2026-11-30, NVIDIA H200, torch
2.11.0+cu130, ``minisrv/measured/h200_*.csv``): a padded decode step took 28.9 ms at batch
1 and 50.0 ms at batch 256 where the roofline says 0.059 and 0.686 ms; the engine decoded
2,792 tok/s at batch 256 (0.28% of the roofline). The host set the pace.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch

from minisrv.configs import LLAMA32_1B, SMOLLM2_135M, ModelConfig
from minisrv.core import Batch, Entry
from minisrv.engine import Engine
from minisrv.request import Req
from minisrv.runner import ModelRunner
from minisrv.sampling import SamplingParams

MEASURED = Path(__file__).resolve().parents[1] / "minisrv" / "measured"
STEP_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUICK_BATCHES = (1, 8, 64, 256)
OVERLAP_BATCHES = (1, 4, 16, 64)
HOST_SHARE = 0.3  # the overlap comparison's batch: the first whose host share reaches this
HF_BATCH = 32  # Hugging Face generate's static batch in the workload table
HF_SEQS = 64  # the most workload sequences HF generate runs (at ~1 batch a minute)
MIXED_PREFILL, MIXED_DECODES = 1000, (15, 63, 127)
STEP_VARIANTS = (("padded", False), ("padded", True), ("triton", False))
"""(attention, CUDA graphs) of the step table; Triton graphs wait for the backends' hooks."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module's docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (a minute or two)")
    parser.add_argument("--context", type=int, default=512, help="decode steps' context")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per point")
    parser.add_argument("--seqs", type=int, default=None, help="nano-vllm workload size")
    parser.add_argument("--out", type=Path, default=MEASURED, help="folder for the CSVs")
    args = parser.parse_args(argv)
    for name in ("context", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.seqs is None:
        args.seqs = 32 if args.quick else 256
    if args.quick:
        args.repeats = min(args.repeats, 5)
    return args


def require_cuda() -> str | None:
    """Why this script cannot run here (no CUDA GPU visible), or None when it can."""
    if torch.cuda.is_available():
        return None
    return (f"bench_gpu.py needs a CUDA GPU and torch {torch.__version__} sees none "
            f"(torch.cuda.is_available() is False); nothing was measured.")


def triton_version() -> str:
    """The installed Triton's version, or "none" (the Triton rows then fail to build)."""
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def gpu_label() -> dict[str, str]:
    """What every row records: the GPU's name, the torch (and CUDA) and Triton versions."""
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda": str(torch.version.cuda), "triton": triton_version()}


def gpu_prefix() -> str:
    """The CSV files' prefix: the GPU's short name (``h200_``), as the recorded runs have."""
    name = torch.cuda.get_device_name().lower()
    match = re.search(r"\b([a-z]+\d+[a-z]*)\b", name.replace("nvidia", ""))
    return f"{match.group(1) if match else 'gpu'}_"


def random_bf16(cfg: ModelConfig, seed: int = 0):
    """A model of ``cfg``'s shape with random bf16 weights drawn on the GPU, no eos."""
    from minisrv.experiments.gpu import random_model

    return random_model(cfg, "cuda", torch.bfloat16, seed)


def runner_for(model, graphs: bool, max_running: int, context: int,
               attention: str = "padded") -> ModelRunner:
    """A runner of ``attention``, with or without CUDA graphs (the same static buffers)."""
    return ModelRunner(model, attention, cuda_graph=graphs, max_running=max_running,
                       graph_context=min(context, model.config.max_seq_len))


def decode_batch(runner: ModelRunner, batch: int, context: int, seed: int = 0) -> Batch:
    """``batch`` requests at ``context`` tokens each, their prefixes prefilled in the
    runner's pool, as one decode batch."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, runner.model.config.vocab_size, (batch, context - 1),
                            generator=gen).tolist()
    reqs = [Req(rid=i, prompt=p, params=SamplingParams(max_new_tokens=2, ignore_eos=True))
            for i, p in enumerate(prompts)]
    for req in reqs:
        req.kv_slots = runner.pool.alloc(context - 1)
    for start in range(0, batch, 16):  # prefill in groups: bounded activation memory
        group = reqs[start:start + 16]
        for req, tokens in zip(group, runner.run(Batch.of(group, [])).tokens, strict=True):
            req.output.extend(tokens)
    for req in reqs:
        req.kv_slots += runner.pool.alloc(1)
    return Batch.of([], reqs)


def mixed_batch(runner: ModelRunner, decodes: int, context: int, prefill: int,
                seed: int = 0) -> Batch:
    """A prompt of ``prefill`` tokens, none cached, beside ``decode_batch``'s ``decodes``
    requests: one mixed step, its prefill first, as the scheduler lists one."""
    step = decode_batch(runner, decodes, context, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, runner.model.config.vocab_size, (prefill,), generator=gen)
    req = Req(rid=decodes, prompt=prompt.tolist(),
              params=SamplingParams(max_new_tokens=2, ignore_eos=True))
    req.kv_slots = runner.pool.alloc(prefill)
    return Batch((Entry(req, 0, prefill), *step.entries), n_prefill=1)


def mixed_table(context: int, repeats: int) -> pd.DataFrame:
    """Table 6: the mixed step against its decodes, with each attention of the hybrid."""
    model, rows = random_bf16(SMOLLM2_135M), []
    for attention in ("padded", "flex", "hybrid"):
        runner = runner_for(model, False, max(MIXED_DECODES) + 1, context, attention)
        runner.attach_kv(max(MIXED_DECODES) * (context + 1) + MIXED_PREFILL)
        for decodes in MIXED_DECODES:
            step = mixed_batch(runner, decodes, context, MIXED_PREFILL)
            ms = step_ms(runner, step, repeats)
            runner.pool.free([s for entry in step.entries for s in entry.req.kv_slots])
            rows.append({"model": SMOLLM2_135M.name, "dtype": "bfloat16", "context": context,
                         "prefill": MIXED_PREFILL, "decodes": decodes, "attention": attention,
                         "step_ms": ms})
            print(f"  prefill {MIXED_PREFILL} + {decodes:3d} decodes {attention:6s} {ms:8.3f} ms")
        del runner
        torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def step_ms(runner: ModelRunner, batch: Batch, repeats: int) -> float:
    """Median milliseconds of one step (prepare + compute, tokens on the host)."""
    times = []
    for i in range(repeats + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        runner.compute(runner.prepare(batch))
        torch.cuda.synchronize()
        if i >= 3:  # warm-up steps left out
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def step_table(batches: Sequence[int], context: int, repeats: int) -> pd.DataFrame:
    """Table 1: SmolLM2-135M decode step time against batch, for each ``STEP_VARIANTS``."""
    model, rows = random_bf16(SMOLLM2_135M), []
    for attention, graphs in STEP_VARIANTS:
        runner = runner_for(model, graphs, max(batches), context, attention)
        runner.attach_kv(max(batches) * (context + 1))
        for batch in batches:
            step = decode_batch(runner, batch, context)
            ms = step_ms(runner, step, repeats)
            runner.pool.free([s for entry in step.entries for s in entry.req.kv_slots])
            rows.append({"model": SMOLLM2_135M.name, "dtype": "bfloat16", "context": context,
                         "batch": batch, "attention": attention, "cuda_graph": graphs,
                         "step_ms": ms, "tok_per_s": batch / ms * 1e3})
            print(f"  batch {batch:4d} {attention:6s} graphs {'on ' if graphs else 'off'}  "
                  f"{ms:8.3f} ms")
        del runner
        torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def nanovllm_workload(n: int, low: int, high: int, vocab: int, seed: int = 0):
    """nano-vllm's bench.py workload: ``n`` random prompts and output lengths, each uniform
    in ``low .. high``; every request ignores eos."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]
    params = [SamplingParams(max_new_tokens=rng.randint(low, high), ignore_eos=True)
              for _ in range(n)]
    return prompts, params


def workload_table(seqs: int, low: int, high: int) -> pd.DataFrame:
    """Table 2: the nano-vllm workload on a Llama-3.2-1B-shaped model, output tok/s, for
    each ``STEP_VARIANTS``, then Hugging Face ``generate`` (``hf_generate_row``)."""
    model, rows = random_bf16(LLAMA32_1B), []
    prompts, params = nanovllm_workload(seqs, low, high, LLAMA32_1B.vocab_size)
    slots = sum(len(p) + s.max_new_tokens for p, s in zip(prompts, params)) + seqs
    for attention, graphs in STEP_VARIANTS:
        runner = runner_for(model, graphs, seqs, 2 * high, attention)
        engine = Engine(runner, kv_capacity=slots, max_running=seqs, record_trace=False)
        engine.generate(prompts[:2], max_new_tokens=4)  # warm-up (kernels, allocator)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate(prompts, sampling=params)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = sum(map(len, out))
        rows.append({"model": LLAMA32_1B.name, "dtype": "bfloat16", "seqs": seqs,
                     "lengths": f"{low}..{high}", "engine": "minisrv", "attention": attention,
                     "cuda_graph": graphs, "output_tokens": tokens, "seconds": seconds,
                     "output_tok_per_s": tokens / seconds})
        print(f"  {attention:6s} graphs {'on ' if graphs else 'off'}: {tokens} tokens in "
              f"{seconds:.2f} s = {tokens / seconds:,.0f} tok/s")
        del engine, runner
        torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    rows.append(hf_generate_row(prompts[:HF_SEQS], params[:HF_SEQS], low, high))
    return pd.DataFrame(rows)


def hf_llama_config(cfg: ModelConfig):
    """A ``transformers.LlamaConfig`` of ``cfg``'s shape, no token ending a generation."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len, rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)


def hf_static_batches(prompts: list[list[int]], batch: int):
    """The prompts in static batches of ``batch``, each left-padded with 0 to its longest:
    (first index, ids [b, L], attention mask [b, L]) on the CPU."""
    for lo in range(0, len(prompts), batch):
        group = prompts[lo:lo + batch]
        width = max(map(len, group))
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(group):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        yield lo, ids, mask


def hf_generate_row(prompts, params, low: int, high: int) -> dict:
    """Hugging Face ``generate`` on the workload: static batches of ``HF_BATCH``, each run
    to its longest requested output (``min_new_tokens`` too: nothing ends early), greedy,
    bf16 random weights of Llama-3.2-1B's shape; credited with the requested outputs only."""
    import transformers

    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM(hf_llama_config(LLAMA32_1B))
    hf = hf.to(torch.bfloat16).eval()
    warm = torch.tensor([prompts[0][:8]], device="cuda")
    hf.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for lo, ids, mask in hf_static_batches(prompts, HF_BATCH):
        new = max(s.max_new_tokens for s in params[lo:lo + HF_BATCH])
        with torch.inference_mode():
            hf.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=new,
                        min_new_tokens=new, do_sample=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(s.max_new_tokens for s in params)
    print(f"  HF generate (b={HF_BATCH}, {len(prompts)} seqs): {tokens} tokens in "
          f"{seconds:.2f} s = {tokens / seconds:,.0f} tok/s")
    del hf
    torch.cuda.empty_cache()
    return {"model": LLAMA32_1B.name, "dtype": "bfloat16", "seqs": len(prompts),
            "lengths": f"{low}..{high}", "engine": f"hf generate b={HF_BATCH}",
            "attention": "sdpa", "cuda_graph": False, "output_tokens": tokens,
            "seconds": seconds, "output_tok_per_s": tokens / seconds}


def overlap_table(prompt: int, new: int) -> pd.DataFrame:
    """Table 3: blocking vs overlapped loop at the first batch whose host share of a step
    is >= ``HOST_SHARE``, with the gain ``throughput_ratio`` predicts from the timings."""
    from minisrv.experiments.breakdown import time_steps
    from minisrv.experiments.lanes import throughput_ratio

    model = random_bf16(SMOLLM2_135M)
    rows = []
    for batch in OVERLAP_BATCHES:
        prompts = [[(7 * i + j) % 1000 for j in range(prompt)] for i in range(batch)]
        options = dict(kv_capacity=batch * (prompt + new + 2), max_running=batch,
                       attention="padded")
        timings = time_steps(Engine(model, **options), prompts, new)
        decodes = [s for s in timings.steps if s.prefill_tokens == 0 and s.batch_size > 0]
        cpu = statistics.mean(s.cpu for s in decodes)
        device = statistics.mean(s.device for s in decodes)
        share = cpu / (cpu + device)
        print(f"  batch {batch}: host share {share:.0%}")
        if share < HOST_SHARE and batch != OVERLAP_BATCHES[-1]:
            continue
        speeds = {}
        for overlap in (False, True):
            engine = Engine(model, overlap=overlap, **options)
            engine.generate(prompts, max_new_tokens=4)  # warm-up
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = engine.generate(prompts, max_new_tokens=new)
            speeds[overlap] = sum(map(len, out)) / (time.perf_counter() - start)
        predicted = throughput_ratio(device, cpu)  # length finishes skip the late step
        rows.append({"model": SMOLLM2_135M.name, "batch": batch, "prompt": prompt, "new": new,
                     "host_share": share, "blocking_tok_per_s": speeds[False],
                     "overlap_tok_per_s": speeds[True], "gain": speeds[True] / speeds[False],
                     "predicted_gain": predicted,
                     "within_15pct": abs(speeds[True] / speeds[False] / predicted - 1) <= 0.15})
        break
    return pd.DataFrame(rows)


def identity_table(seqs: int) -> pd.DataFrame:
    """Table 4: greedy tokens with CUDA graphs equal the eager runner's, request by request."""
    model = random_bf16(SMOLLM2_135M, seed=1)
    prompts, params = nanovllm_workload(seqs, 4, 64, SMOLLM2_135M.vocab_size, seed=1)
    slots = sum(len(p) + s.max_new_tokens for p, s in zip(prompts, params)) + seqs
    outs = {}
    for graphs in (False, True):
        runner = runner_for(model, graphs, min(seqs, 64), 128)
        outs[graphs] = Engine(runner, kv_capacity=slots, max_running=min(seqs, 64),
                              mode="mixed").generate(prompts, sampling=params)
    rows = [{"request": i, "tokens": len(a), "identical": a == b,
             "first_difference": next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), -1)}
            for i, (a, b) in enumerate(zip(outs[False], outs[True]))]
    same = sum(r["identical"] for r in rows)
    print(f"  {same} of {len(rows)} requests identical with graphs on")
    return pd.DataFrame(rows)


def attention_tables(context: int, repeats: int) -> dict[str, pd.DataFrame]:
    """The appendix's two tables, in the format ``recorded_gpu_run`` reads (a ``device``
    and a ``torch`` column): padded vs flex decode steps beside the roofline, and the
    engine's decode throughput for both against the roofline's."""
    from minisrv.configs import H200
    from minisrv.experiments.gpu import (
        current_gpu,
        device_label,
        engine_decode_throughput,
        predicted_decode_throughput,
        roofline_step_times,
        step_time_sweep,
    )

    gpu, model, kinds = current_gpu() or H200, random_bf16(SMOLLM2_135M), ("padded", "flex")
    measured = step_time_sweep(model, STEP_BATCHES, context, kinds, repeats=repeats)
    steps = measured.pivot(index="batch", columns="attention", values="step_ms")
    steps["flex / padded"] = steps["flex"] / steps["padded"]
    roof = roofline_step_times(SMOLLM2_135M, [gpu], STEP_BATCHES, context).set_index("batch")
    steps[f"roofline {gpu.name} ms"] = roof["step_ms"]
    steps["roofline / flex"] = roof["step_ms"] / steps["flex"]
    steps = steps.rename(columns={"padded": "padded ms", "flex": "flex ms"}).reset_index()
    rows = []
    for batch in (64, 256):
        for attention in (*kinds, "hybrid"):  # auto's pick from 8.0 on, untimed until now
            run = engine_decode_throughput(model, batch, 128, 64, attention=attention)
            predicted = predicted_decode_throughput(SMOLLM2_135M, gpu, run)
            rows.append({"batch": batch, "attention": attention, "prompt": 128, "new": 64,
                         "measured tok/s": run.tokens_per_s,
                         f"roofline {gpu.name} tok/s": predicted,
                         "fraction": run.tokens_per_s / predicted})
    print(steps.to_string(float_format=lambda x: f"{x:.4g}"))
    device = {"device": device_label("cuda")}
    return {"decode_steps.csv": steps.assign(context=context, **device),
            "engine_throughput.csv": pd.DataFrame(rows).assign(**device)}


def save(table: pd.DataFrame, out: Path, name: str) -> Path:
    """``table`` as CSV in ``out`` under the GPU's prefix, the GPU and torch in every row."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{gpu_prefix()}{name}"
    table.assign(**gpu_label()).to_csv(path, index=False)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    refusal = require_cuda()
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 1
    label = gpu_label()
    print(f"{label['gpu']}, torch {label['torch']} (CUDA {label['cuda']}), "
          f"triton {label['triton']}"
          f"{', quick run' if args.quick else ''}")
    high = 256 if args.quick else 1024
    print(f"\n1. {SMOLLM2_135M.name} decode step, context {args.context}")
    tables = {"decode_steps_graphs.csv": step_table(
        QUICK_BATCHES if args.quick else STEP_BATCHES, args.context, args.repeats)}
    print(f"\n2. nano-vllm workload, {args.seqs} seqs of 100..{high}, {LLAMA32_1B.name}")
    tables["nanovllm_workload.csv"] = workload_table(args.seqs, 100, high)
    print("\n3. blocking vs overlapped loop")
    tables["overlap_gain.csv"] = overlap_table(32, 16 if args.quick else 64)
    print("\n4. graphs vs eager greedy tokens")
    tables["graph_tokens.csv"] = identity_table(16 if args.quick else 64)
    if not args.quick:
        print("\n5. padded vs flex attention (the GPU appendix's tables)")
        tables.update(attention_tables(args.context, args.repeats))
        print("\n6. a mixed step: padded, flex, hybrid")
        tables["mixed_steps.csv"] = mixed_table(args.context, args.repeats)
    for name, table in tables.items():
        print("wrote", save(table, args.out, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
