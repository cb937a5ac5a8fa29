"""Decoding a SmolLM2-135M-shaped model on a GPU, against the roofline of that GPU.

A random model of SmolLM2-135M's shape (``configs.SMOLLM2_135M``; timing does not depend on
weight values, so nothing is downloaded) in bf16 on ``cuda``. Prints, from one process:

1. the decode step time against batch size 1..256 at one context length, for the padded
   attention (one masked SDPA call) and the ragged one (one ``flex_attention`` call), with
   flex/padded and the roofline's step time for the detected GPU (``minisrv.roofline``);
2. the engine's decode throughput (``Engine`` with ``max_running=batch``) for both attention
   kinds, against the throughput the roofline predicts for the same decode steps.

Without CUDA it says that it needs a GPU, runs the same code on a tiny model on the CPU (so
the script cannot rot) and exits 0.

    python benchmarks/bench_gpu.py [--context 512] [--repeats 20] [--prompt 128 --new 64]
                                   [--out DIR]

``--out DIR`` also writes both tables as CSV (``decode_steps.csv``, ``engine_throughput.csv``)
with the GPU and torch version in every row: the GPU appendix draws a recorded run from them.

Check on the first GPU run that the compiled flex kernel is not recompiled step after step (each
step builds a new mask_mod closure; Dynamo should guard on its code, not its identity):
``TORCH_LOGS=recompiles python benchmarks/bench_gpu.py``.

Numbers, 2026-11-30, NVIDIA H200 (driver 580.159.04), torch 2.11.0+cu130, a Firecracker VM
whose CPU ran minisrv's Python about 1.7x slower than the 2-core build machine. Recorded with
``--repeats 10 --out`` (shipped as ``minisrv/measured/h200_*.csv``, drawn by the GPU appendix):

    batch   padded ms   flex ms   roofline H200 ms
        1       28.9      41.0        0.059
        8       43.1      32.0        0.076
       64       48.6     127.9        0.214
      256       50.0     268.9        0.686

    engine decode, prompts of 128, 64 new tokens: batch 64 padded 688 tok/s, flex 1,406;
    batch 256 padded 2,792 tok/s (0.28% of the roofline's 1.01M), flex 2,483.

The host sets the pace: eager PyTorch issues every kernel of the 30 layers one by one (the padded
step barely grows from batch 1 to 256). The flex column paid for building its block mask's layout
in Python lists (131,328 keys at batch 256); that layout is now built with tensor ops (44 -> 3 ms
on the CPU), and greedy sampling takes one argmax per step instead of one sync per request; both
changes are not yet measured on a GPU. The compiled flex kernel recompiled 4 times over the batch
sweep (TORCH_LOGS=recompiles: a new query length or block count), then stayed compiled.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

from minisrv.configs import CITYLM, H200, SMOLLM2_135M, GPUSpec, ModelConfig
from minisrv.experiments.gpu import (
    current_gpu,
    device_label,
    engine_decode_throughput,
    predicted_decode_throughput,
    random_model,
    roofline_step_times,
    step_time_sweep,
)

GPU_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ATTENTIONS = ("padded", "flex")


def step_table(cfg: ModelConfig, model, gpu: GPUSpec, batches, context: int, repeats: int):
    """Measured step times (both attentions) beside the roofline's, one row per batch."""
    measured = step_time_sweep(model, batches, context, ATTENTIONS, repeats=repeats)
    table = measured.pivot(index="batch", columns="attention", values="step_ms")
    table["flex / padded"] = table["flex"] / table["padded"]
    roof = roofline_step_times(cfg, [gpu], batches, context).set_index("batch")
    table[f"roofline {gpu.name} ms"] = roof["step_ms"]
    table["roofline / flex"] = roof["step_ms"] / table["flex"]
    return table.rename(columns={"padded": "padded ms", "flex": "flex ms"})


def throughput_table(cfg: ModelConfig, model, gpu: GPUSpec, batches, prompt: int, new: int):
    """Engine decode tokens/s for both attentions against the roofline's prediction."""
    rows = []
    for batch in batches:
        for attention in ATTENTIONS:
            run = engine_decode_throughput(model, batch, prompt, new, attention=attention)
            predicted = predicted_decode_throughput(cfg, gpu, run)
            rows.append({"batch": batch, "attention": attention, "prompt": prompt, "new": new,
                         "measured tok/s": run.tokens_per_s,
                         f"roofline {gpu.name} tok/s": predicted,
                         "fraction": run.tokens_per_s / predicted})
    return pd.DataFrame(rows).set_index(["batch", "attention"])


def save(table: pd.DataFrame, out: Path, name: str, device: str) -> None:
    """``table`` as ``out/name`` with what produced it in every row (device, torch)."""
    out.mkdir(parents=True, exist_ok=True)
    table.reset_index().assign(device=device_label(device), torch=torch.__version__).to_csv(
        out / name, index=False)


def run(cfg, device, dtype, gpu, batches, context, repeats, engine_batches, prompt, new,
        out: Path | None = None):
    model = random_model(cfg, device, dtype)
    print(f"{cfg.name} (random weights) in {str(dtype)[6:]} on {device_label(device)}, torch "
          f"{torch.__version__}; roofline: {gpu.name}")
    print(f"\nDecode step, every request at context {context} (median of {repeats})")
    table = step_table(cfg, model, gpu, batches, context, repeats)
    print(table.to_string(float_format=lambda x: f"{x:.4g}"))
    print(f"\nEngine decode throughput, prompts of {prompt}, {new} new tokens each")
    throughput = throughput_table(cfg, model, gpu, engine_batches, prompt, new)
    print(throughput.to_string(float_format=lambda x: f"{x:,.3g}"))
    if out is not None:
        save(table.assign(context=context), out, "decode_steps.csv", device)
        save(throughput, out, "engine_throughput.csv", device)
        print(f"\ntables written to {out}/")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="also write the tables as CSV")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA GPU to measure anything; none is visible.\n"
              "Smoke run of the same code on a tiny CityLM-shaped model on the CPU "
              "(numbers meaningless):\n")
        torch.set_num_threads(1)
        tiny = CITYLM.with_(name="tiny", n_layers=2, max_seq_len=64)
        run(tiny, "cpu", torch.float32, H200, (1, 2), 8, 2, (2,), 4, 3, args.out)
        return 0
    gpu = current_gpu()
    if gpu is None:
        print(f"{torch.cuda.get_device_name()} is not in minisrv.configs.GPUS; add its spec "
              "to compare with the roofline. Using the H200's for the table.")
        gpu = H200
    run(SMOLLM2_135M, "cuda", torch.bfloat16, gpu, GPU_BATCHES, args.context, args.repeats,
        (64, 256), args.prompt, args.new, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
