"""``benchmarks/bench_gpu.py`` cannot run without a GPU, but it must import, parse its
arguments, refuse clearly (exit 1) where torch sees no CUDA, and build its workload."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bench_scripts import load


@pytest.fixture(scope="module")
def bench():
    return load("bench_gpu")


def test_arguments_and_the_quick_run(bench) -> None:
    full = bench.parse_args([])
    assert (full.quick, full.seqs, full.repeats, full.context) == (False, 256, 20, 512)
    assert full.out == bench.MEASURED and full.out.name == "measured"
    quick = bench.parse_args(["--quick", "--repeats", "50", "--out", "/tmp/x"])
    assert (quick.seqs, quick.repeats, quick.out) == (32, 5, Path("/tmp/x"))
    with pytest.raises(SystemExit):
        bench.parse_args(["--context", "0"])


def test_it_refuses_to_run_without_cuda(bench, monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--quick"]) == 1
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and torch.__version__ in err


def test_the_nanovllm_workload_is_reproducible_and_in_range(bench) -> None:
    prompts, params = bench.nanovllm_workload(256, 100, 1024, 128256)
    again, _ = bench.nanovllm_workload(256, 100, 1024, 128256)
    assert prompts == again and len(prompts) == len(params) == 256
    assert all(100 <= len(p) <= 1024 and max(p) < 128256 for p in prompts)
    assert all(100 <= s.max_new_tokens <= 1024 and s.ignore_eos for s in params)


def test_its_decode_batch_runs_on_a_cpu_runner(bench) -> None:
    """The step-time table's batch (prefixes prefilled, one decode each) on a tiny model."""
    from minisrv.configs import CITYLM
    from minisrv.model import CityLM

    torch.manual_seed(0)
    model = CityLM(CITYLM.with_(n_layers=1, max_seq_len=32)).eval()
    for graphs_context in (16, 4):  # the static path, then a context past it: the flat path
        runner = bench.ModelRunner(model, "padded", static_decode=True, max_running=4,
                                   graph_context=graphs_context)
        runner.attach_kv(64)
        batch = bench.decode_batch(runner, 3, 12)
        assert [e.n_tokens for e in batch.entries] == [1, 1, 1]
        assert [e.end for e in batch.entries] == [12, 12, 12]
        assert (runner.prepare(batch).flat is None) == (graphs_context >= 12)
        assert len(runner.compute(runner.prepare(batch)).tokens) == 3


def test_hf_static_batches_left_pad_each_batch_to_its_longest(bench) -> None:
    prompts = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
    batches = list(bench.hf_static_batches(prompts, 3))
    assert [lo for lo, _, _ in batches] == [0, 3]
    _, ids, mask = batches[0]
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert batches[1][1].tolist() == [[11, 12, 13, 14]]


def test_the_hf_model_has_the_workload_models_shape(bench) -> None:
    """HF's Llama built from Llama-3.2-1B's config (on the meta device: no memory) has
    minisrv's parameter count for that shape, and no token ends its generations."""
    import transformers

    from minisrv.configs import LLAMA32_1B

    hf_config = bench.hf_llama_config(LLAMA32_1B)
    assert hf_config.eos_token_id is None and hf_config.head_dim == 64
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hf_config)
    assert sum(p.numel() for p in hf.parameters()) == 1_235_814_400


def test_every_row_names_the_triton_version(bench, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    label = bench.gpu_label()
    assert label["gpu"] == "NVIDIA H200" and label["triton"] == bench.triton_version()
    assert label["triton"] == "none" or label["triton"][0].isdigit()
    assert [attention for attention, _ in bench.STEP_VARIANTS].count("triton") == 1


def test_its_mixed_step_runs_on_a_cpu_runner_and_the_hybrid_splits_it(bench) -> None:
    """The mixed-step table's batch: one prompt, none of it cached, then decodes; the hybrid
    gives it one call of each kind, and every attention computes the same tokens."""
    from minisrv.configs import CITYLM
    from minisrv.model import CityLM

    torch.manual_seed(0)
    model = CityLM(CITYLM.with_(n_layers=1, max_seq_len=32)).eval()
    tokens = {}
    for attention in ("padded", "flex", "hybrid"):
        runner = bench.ModelRunner(model, attention, max_running=4)
        runner.attach_kv(64)
        batch = bench.mixed_batch(runner, 3, 12, 9)
        assert [(e.start, e.n_tokens) for e in batch.entries] == [(0, 9)] + [(11, 1)] * 3
        step = runner.prepare(batch)
        if attention == "hybrid":
            assert step.metadata.calls == ("flex", "padded")
        tokens[attention] = runner.compute(step).tokens
    assert tokens["flex"] == tokens["padded"] == tokens["hybrid"]
