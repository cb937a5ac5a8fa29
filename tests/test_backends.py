"""The two real-model backends compute the same tokens as each request alone.

``PerRequestBackend`` (one forward per request) is the scheduler chapter's plain backend;
``ModelBackend`` (one flat forward over a KV pool) is the engine's default. A tight pool
forces retractions, and sampled requests must survive them with their random streams intact.
"""

from __future__ import annotations

import pytest

from minisrv.engine import Engine
from minisrv.runner import ModelBackend, PerRequestBackend
from minisrv.sampling import SamplingParams

MODEL_SEED = 1  # the random CityLM of conftest's `model` fixture


PROMPTS = [[0, 5, 6], [0, 7], [0, 8, 9, 10], [0, 11], [0, 12, 13], [0, 14]]


@pytest.mark.parametrize("backend_cls", [PerRequestBackend, ModelBackend])
@pytest.mark.parametrize("mode", ["prefill-first", "mixed", "static"])
def test_backend_matches_each_request_alone_under_retraction(model, backend_cls, mode) -> None:
    params = [SamplingParams(max_new_tokens=12, temperature=0.9, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    engine = Engine(backend_cls(model), kv_capacity=40, max_running=6, mode=mode)
    outputs = engine.generate(PROMPTS, sampling=params)
    for prompt, p, out in zip(PROMPTS, params, outputs):
        assert out == model.reference_generate(prompt, p.max_new_tokens, temperature=0.9,
                                               seed=p.seed, ignore_eos=True)
    if mode != "static":
        assert engine.stats.retractions > 0  # the 40-slot pool really was too small
    assert engine.scheduler.memory.kv.free_count == 40  # every slot returned


def test_per_request_backend_costs_prompt_tokens_for_prefill_and_one_per_decode(model) -> None:
    engine = Engine(PerRequestBackend(model), max_running=2)
    engine.generate([[0, 5, 6, 7]], sampling=SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert [s.cost for s in engine.trace] == [4, 1, 1]


def test_hit_rate_counts_each_prompt_once_despite_retractions(model) -> None:
    """The lecture's hit rate: cached prompt tokens / prompt tokens, first admissions only."""
    shared = [0, 5, 6, 7, 8, 9]
    prompts = [shared + [10 + i] for i in range(6)]
    engine = Engine(model, kv_capacity=48, max_running=6, cache="radix")
    engine.generate(prompts, sampling=SamplingParams(max_new_tokens=12, ignore_eos=True))
    stats = engine.stats
    assert stats.retractions > 0
    assert stats.prompt_tokens == sum(map(len, prompts))
    assert 0 < stats.hit_rate == stats.cached_prompt_tokens / stats.prompt_tokens <= 1
    assert stats.cached_tokens >= stats.cached_prompt_tokens  # re-admissions hit the cache too
