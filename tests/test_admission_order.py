"""When a step's admissions get their KV (``admission_order``): each as it is admitted
(minisrv's default), or after the whole round has matched and locked its prefixes, as
SGLang's ``PrefillAdder`` and ``prepare_for_extend`` do. The order changes which prefixes
survive, never the tokens: on the server chapter's round-robin workload the later requests
of a round keep their prefixes. (That no slot leaks and no locked node is evicted under
either order, on random workloads: ``test_engine_radix.py``.)"""

from __future__ import annotations

import pytest

from minisrv.configs import LLAMA3_8B
from minisrv.engine import Engine
from minisrv.sampling import SamplingParams
from minisrv.scheduler.config import ADMISSION_ORDERS
from minisrv.sim import SimBackend


def test_a_round_s_later_requests_keep_the_prefixes_the_default_order_evicts(model) -> None:
    """The server chapter's workload made small: four groups of 20-token prefixes, their
    requests round-robin, in a pool that runs three uncached requests at once. Allocating
    request by request evicts, for each admission, the prefix the next one would have
    matched, so every request after the first three finds only ``<bos>``; locking the round
    first keeps them. The tokens stay each request's alone under both."""
    heads = [[0, *[10 + g] * 20] for g in range(4)]
    prompts = [[*heads[k % 4], 30 + k, 31] for k in range(16)]
    cached = {}
    for order in ADMISSION_ORDERS:
        engine = Engine(model, kv_capacity=80, max_running=8, cache="radix",
                        admission_order=order)
        outs = engine.generate(prompts, sampling=SamplingParams(max_new_tokens=2,
                                                                ignore_eos=True))
        assert outs == [model.reference_generate(p, 2, ignore_eos=True) for p in prompts]
        cached[order] = engine.stats.cached_prompt_tokens
    assert cached["allocate-each"] == len(prompts) - 80 // (23 + 2)  # <bos>, after round one
    assert cached["lock-round-first"] > 10 * cached["allocate-each"]


def test_on_the_server_chapter_s_workload_the_round_s_order_hits_far_more() -> None:
    """The page's 64 requests in 8 round-robin groups of 800-token prefixes, in a pool of
    6,000 slots, under FCFS on the simulated H100: allocating each admission evicts the
    prefix the next request needs, so only ``<bos>`` is ever found; locking the round first
    finds most of each later prompt, and the same 64 requests take less simulated time."""
    from minisrv.experiments.server import prefix_heavy_requests
    from minisrv.tokenizer import Tokenizer

    tok = Tokenizer()
    prompts = [tok.encode(r.prompt) for r in prefix_heavy_requests()]
    runs = {}
    for order in ADMISSION_ORDERS:
        engine = Engine(SimBackend(LLAMA3_8B), kv_capacity=6000, max_running=16, cache="radix",
                        policy="fcfs", admission_order=order)
        engine.generate(prompts, 16)
        runs[order] = engine
    old, new = runs["allocate-each"], runs["lock-round-first"]
    assert old.stats.cached_prompt_tokens < len(prompts)  # <bos> at most, for each request
    assert new.stats.cached_prompt_tokens > old.stats.prompt_tokens / 2
    assert new.stats.hit_rate > 0.5 > 0.01 > old.stats.hit_rate
    assert new.clock < old.clock


def test_the_round_s_order_refuses_chunked_prefill_and_unknown_orders(model) -> None:
    with pytest.raises(ValueError, match="admission_order"):
        Engine(model, cache="radix", admission_order="lock-round-first",
               chunked_prefill_size=64)
    with pytest.raises(ValueError, match="admission_order"):
        Engine(model, cache="radix", admission_order="lock-first")
