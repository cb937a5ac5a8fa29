"""``attention="auto"``'s table (``minisrv.runner.attention.choice``): by device type, compute
capability, dtype and head dim, with mocked capabilities (a T4's 7.5, an A100's 8.0, an
H100/H200's 9.0), logged once, and its GPU row checked against the recorded runs."""

from __future__ import annotations

import csv
import logging
import math
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from minisrv.runner.attention import BACKENDS, make_attention
from minisrv.runner.attention import choice as attention_choice
from minisrv.runner.attention.choice import auto_attention, choose_attention

MEASURED = Path(attention_choice.__file__).resolve().parents[2] / "measured"


@pytest.mark.parametrize("capability,dtype,head_dim,backend", [
    ((7, 5), torch.float16, 64, "padded"),  # the T4: flex untuned and untimed below 8.0
    ((7, 5), torch.float32, 32, "padded"),
    ((8, 0), torch.bfloat16, 64, "hybrid"),
    ((8, 0), torch.float16, 128, "hybrid"),
    ((9, 0), torch.bfloat16, 64, "hybrid"),
    ((9, 0), torch.float32, 32, "hybrid"),
    ((9, 0), torch.float64, 64, "padded"),  # no Triton float64 flex kernel
    ((9, 0), torch.bfloat16, 8, "padded"),  # heads narrower than the compiled kernel takes
])
def test_cuda_rows(capability, dtype, head_dim, backend) -> None:
    choice = choose_attention("cuda", capability, dtype, head_dim)
    assert choice.backend == backend
    assert f"{capability[0]}.{capability[1]}" in choice.why


def test_the_cpu_stays_padded_and_cuda_needs_a_capability() -> None:
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        assert choose_attention("cpu", None, dtype, 32).backend == "padded"
    assert make_attention("auto", torch.device("cpu"), torch.float32, 32).kind == "padded"
    with pytest.raises(ValueError, match="capability"):
        choose_attention("cuda", None, torch.float16, 64)


@pytest.mark.parametrize("capability,backend", [((7, 5), "padded"), ((8, 0), "hybrid"),
                                                ((9, 0), "hybrid")])
def test_auto_reads_the_capability_and_logs_once(monkeypatch, caplog, capability,
                                                 backend) -> None:
    """What ``make_attention("auto")`` resolves on a mocked GPU (no GPU needed: the table
    only reads the capability), logged the first time only."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(attention_choice, "_logged", set())
    with caplog.at_level(logging.INFO, logger=attention_choice.__name__):
        for _ in range(3):
            assert auto_attention("cuda", torch.float16, 64) == backend
    lines = [r.getMessage() for r in caplog.records if r.name == attention_choice.__name__]
    assert len(lines) == 1 and lines[0].startswith(f"attention='auto' -> {backend}")


def _fastest(path: Path, times: dict[str, str] | None = None) -> tuple[str, str, set[str]]:
    """The backend with the best geometric mean over a recorded CSV's batches, the device
    and the backends timed: by ``measured tok/s`` (an engine run), or by the step times of
    ``times``' columns (a step sweep: backend -> column, lower is better)."""
    logs: dict[str, list[float]] = defaultdict(list)
    with path.open() as f:
        for row in csv.DictReader(f):
            device = row["device"]
            if times is None:
                logs[row["attention"]].append(math.log(float(row["measured tok/s"])))
            else:
                for backend, column in times.items():
                    logs[backend].append(-math.log(float(row[column])))
    return max(logs, key=lambda k: math.fsum(logs[k])), device, set(logs)


CAPABILITIES = {"NVIDIA H200": (9, 0), "NVIDIA H100": (9, 0), "NVIDIA A100": (8, 0)}


def test_the_gpu_row_follows_the_recorded_runs() -> None:
    """The GPU row is the hybrid. Its decode half is what the recorded step sweeps timed
    fastest (geometric mean over their batches: the forward alone, which is what the choice
    of call changes). Its half for steps with prefills is flex by construction (the ragged
    call pads nothing), since no recorded run has timed a step with prefills. The one engine
    run recorded before the hybrid existed timed decode steps of an older eager step, its
    ragged lead from one batch whose padded steps spent time outside the forward that the
    run does not account for (the GPU appendix); every later engine run
    (``benchmarks/bench_gpu.py`` times the hybrid beside padded and flex) must find the row's
    backend fastest, or the row changes. The Triton backend joins once a recorded run has
    measured it, and wins only by measuring ahead."""
    sweeps = sorted(MEASURED.glob("*_decode_steps.csv"))
    runs = sorted(MEASURED.glob("*_engine_throughput.csv"))
    assert sweeps and runs, "no recorded GPU run"
    before_hybrid = []
    for path in runs + sweeps:
        times = None if path in runs else {"flex": "flex ms", "padded": "padded ms"}
        fastest, device, timed = _fastest(path, times)
        cc = next(cc for name, cc in CAPABILITIES.items() if device.startswith(name))
        row = choose_attention("cuda", cc, torch.bfloat16, 64).backend
        assert BACKENDS[row].prefill_backend.kind == "flex"
        if path in sweeps:
            assert BACKENDS[row].decode_backend.kind == fastest, path.name
        elif row in timed:  # an engine run that timed the row's backend: it must have won
            assert fastest == row, path.name
        else:
            before_hybrid.append(path.name)
    assert before_hybrid == ["h200_engine_throughput.csv"]
