"""``benchmarks/bench_vllm_cpu.py`` on minisrv's side (vLLM runs only in its own venv): the
workload is reproducible and in range, minisrv serves the random HF folder as that folder's
own ``generate`` does, and ``--breakdown`` accounts a run's time without changing it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bench_scripts import load

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bench():
    return load("bench_vllm_cpu")


@pytest.fixture(scope="module")
def folder(bench, tmp_path_factory) -> Path:
    """A random CityLM-sized HF Llama folder, as the benchmark writes it."""
    path = tmp_path_factory.mktemp("llama")
    bench.write_random_llama("citylm", path)
    return path


@pytest.fixture(scope="module")
def runner(bench, folder):
    """minisrv loaded on ``folder``, with 12 of the benchmark's requests."""
    prompts, limits = bench.make_requests(12, bench.shape("citylm")["vocab_size"])
    return bench.MinisrvRunner(folder, prompts, limits, max_running=4)


def test_the_workload_is_reproducible_and_in_range(bench) -> None:
    prompts, limits = bench.make_requests(256, 61)
    assert (prompts, limits) == bench.make_requests(256, 61)
    assert all(4 <= len(p) <= 32 and all(0 <= t < 61 for t in p) for p in prompts)
    assert all(2 <= m <= 64 for m in limits)
    with pytest.raises(ValueError, match="unknown size"):
        bench.shape("7b")


def test_minisrv_serves_the_folder_as_transformers_does(runner, folder) -> None:
    """Greedy, ``ignore_eos``: each request's tokens are the folder's own ``generate``'s
    (which never stops early once its end-of-sequence id is unset). The attention mask is
    passed: the prompts are random ids, and ``generate`` would mask the padding id in them."""
    import transformers

    served, seconds = runner.run()
    assert seconds > 0
    hf = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    hf.generation_config.eos_token_id = None
    for prompt, params, tokens in zip(runner.prompts, runner.params, served, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=params.max_new_tokens, pad_token_id=1)
        assert tokens == out[0, len(prompt):].tolist()


def test_the_breakdown_accounts_a_run_and_changes_nothing(runner) -> None:
    before, _ = runner.run()
    plain = runner.engine.backend.attn
    parts = runner.breakdown()
    assert runner.engine.backend.attn is plain  # the profiled wrapper is gone again
    assert parts["products"] > 0 and parts["attention"] > 0
    assert parts["products"] + parts["attention"] < parts["wall"]
    assert runner.run()[0] == before
