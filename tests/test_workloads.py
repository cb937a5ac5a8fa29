"""Workload generators: seeded, shaped as documented, strict about bad parameters."""

from __future__ import annotations

import numpy as np
import pytest

from minisrv.tokenizer import Tokenizer
from minisrv.workloads import (
    Workload,
    arrival_times,
    citylm_workload,
    gpu_scale_workload,
    lecture_trace_workload,
    output_lengths,
)


def test_gpu_scale_workload_matches_the_notes_description() -> None:
    w = gpu_scale_workload()
    assert len(w) == 2000
    lens = np.array(w.prompt_lens)
    assert lens.min() >= 100 and lens.max() <= 1000
    assert 500 < lens.mean() < 600  # uniform 100-1000
    assert 185 < w.mean_output < 215  # "outputs averaging about 200"
    assert max(w.output_lens) <= 2000 and min(w.output_lens) >= 1
    gaps = np.diff(w.arrivals)
    assert w.arrivals[0] == 0 and (gaps >= 0).all()
    assert abs(gaps.mean() - 1 / 64) < 0.002  # Poisson at 64 requests per second


def test_workloads_are_reproducible_and_seed_dependent() -> None:
    a, b = gpu_scale_workload(n=50, seed=3), gpu_scale_workload(n=50, seed=3)
    assert a == b
    assert gpu_scale_workload(n=50, seed=4).output_lens != a.output_lens


def test_arrival_processes() -> None:
    assert arrival_times(4, 2.0, "fixed") == [0.0, 0.5, 1.0, 1.5]
    assert arrival_times(3, 5.0, "all-at-once") == [0.0, 0.0, 0.0]
    times = arrival_times(20000, 10.0, "poisson", np.random.default_rng(1))
    assert abs(np.diff(times).mean() - 0.1) < 0.003
    assert arrival_times(0, 1.0) == []


def test_output_length_spread() -> None:
    assert output_lengths(5, 40, cv=0) == [40] * 5
    rng = np.random.default_rng(0)
    exp = np.array(output_lengths(20000, 200, cv=1.0, rng=rng))
    assert abs(exp.mean() - 200) < 6 and abs(exp.std() / exp.mean() - 1) < 0.05
    assert max(output_lengths(1000, 200, cv=2.0, max_len=300)) == 300


def test_citylm_and_notes_workloads() -> None:
    tok = Tokenizer()
    w = citylm_workload(tok, n=16, output_range=(2, 40))
    assert len(w) == 16 and all(2 <= m <= 40 for m in w.output_lens)
    assert all(p[0] == tok.bos_id for p in w.prompts)
    assert tok.decode(w.prompts[0]).startswith("FR:")
    spaced = citylm_workload(tok, n=4, arrival_every=3)
    assert spaced.arrivals == [0, 3, 6, 9]
    trace = lecture_trace_workload(tok)
    assert trace.output_lens == [3, 5, 3] and trace.arrivals == [0, 0, 2]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: arrival_times(3, 0.0, "poisson"), "arrival rate must be > 0"),
        (lambda: arrival_times(3, 1.0, "bursty"), "unknown arrival process 'bursty'"),
        (lambda: arrival_times(-1, 1.0), "number of requests"),
        (lambda: output_lengths(3, 0.5), "mean output length must be >= 1"),
        (lambda: output_lengths(3, 10, cv=-1), "cv must be >= 0"),
        (lambda: gpu_scale_workload(n=3, prompt_range=(10, 5)), "prompt_range"),
        (lambda: citylm_workload(Tokenizer(), output_range=(0, 4)), "output_range"),
        (lambda: Workload("x", [[0]], [1, 2], [0.0]), "must match"),
    ],
)
def test_bad_parameters_are_refused(call, message) -> None:
    with pytest.raises(ValueError, match=message):
        call()
