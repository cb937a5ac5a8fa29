"""The engine with the radix cache: same tokens as without it and as each request alone,
fewer tokens prefilled when prompts share prefixes, and never a leaked or shared slot."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import prefix_sharing, prompts_of

from minisrv.configs import LLAMA3_8B
from minisrv.engine import Engine
from minisrv.request import FINISHED, Req
from minisrv.sampling import SamplingParams
from minisrv.scheduler import MODES, Scheduler
from minisrv.scheduler.config import ADMISSION_ORDERS
from minisrv.sim import SimBackend

MODEL_SEED = 2  # the random CityLM of conftest's `model` fixture


def tree_slots(sched: Scheduler) -> list[int]:
    return [v for node in sched.memory.tree.nodes()[1:] for v in node.value]


def check_pool(sched: Scheduler) -> None:
    """Every used slot is held by exactly one owner: the tree, or one running request; every
    used page is the tree's or holds a running request's tokens."""
    kv, tree = sched.memory.kv, sched.memory.tree
    cached = tree_slots(sched)
    own = [s for req in sched.queues.running for s in sched.memory.slots(req, req.cached_len)]
    assert len(cached) == tree.total_size()
    assert len(set(cached) | set(own)) == len(cached) + len(own)
    assert len({s // kv.page_size for s in (*cached, *own)}) * kv.page_size == kv.used_count
    for req in sched.queues.running:  # a running request's cached prefix is the tree's, locked
        assert set(sched.memory.slots(req, 0, req.cached_len)) <= set(cached)
        assert req.cache_node is not None
    assert all(not req.kv_len for req in sched.queues.waiting)


def serve_checked(engine: Engine, reqs: list[Req]) -> None:
    sched = engine.scheduler
    for req in reqs:
        sched.submit(req)
    while sched.step() is not None:
        check_pool(sched)
        sched.check_integrity()
    assert sched.memory.tree.protected_size() == 0  # everything unlocked once all finished
    assert sched.memory.kv.used_count == sched.memory.tree.total_size()  # only the tree holds slots
    sched.memory.tree.evict(sched.memory.tree.total_size())
    assert sched.memory.kv.used_count == 0


prefix_lists, workloads = prefix_sharing(max_prefix=12, max_suffix=6, max_new=16, max_arrival=6)


def evictions_of_locked_nodes(engine: Engine) -> list:
    """A list that fills with every node the tree evicts while a request held it locked."""
    locked: list = []

    def listen(tree, event) -> None:
        if event.op == "evict":
            locked.extend(view for view in event.evicted if view.lock_ref)

    engine.tree.listener = listen
    return locked


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefixes=prefix_lists, spec=workloads,
       slack=st.integers(0, 60), mode=st.sampled_from(MODES), max_running=st.integers(1, 6),
       order=st.sampled_from(ADMISSION_ORDERS))
def test_radix_outputs_equal_each_request_alone_and_no_slot_leaks(
    model, prefixes, spec, slack, mode, max_running, order
) -> None:
    """Under either ``admission_order`` (each admission allocating as it comes, or the round
    locked first, as SGLang): every slot owned once and all freed at the end
    (``serve_checked``), no locked node ever evicted, each request's tokens its own alone."""
    prompts = prompts_of(prefixes, spec)
    longest = max(len(p) + m for p, (_, _, m, _, _) in zip(prompts, spec))
    engine = Engine(model, kv_capacity=longest + slack, max_running=max_running, mode=mode,
                    cache="radix", admission_order=order)
    locked = evictions_of_locked_nodes(engine)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=e) for _, _, m, e, _ in spec]
    reqs = engine.make_requests(prompts, None, params, [a for *_, a in spec])
    serve_checked(engine, reqs)
    assert all(req.state == FINISHED for req in reqs)
    for req, prompt, (_, _, m, e, _) in zip(reqs, prompts, spec):
        assert req.output == model.reference_generate(prompt, m, ignore_eos=e)
    assert engine.backend.live_requests == 0
    assert locked == []


def test_cache_on_and_off_give_the_same_tokens_and_the_cache_prefills_less(model) -> None:
    head = list(range(10, 40))
    prompts = [[0, *head, 40 + i] for i in range(6)]
    outs, stats = {}, {}
    for cache in ("none", "radix"):
        engine = Engine(model, kv_capacity=400, max_running=2, cache=cache)
        outs[cache] = engine.generate(prompts, 8)
        stats[cache] = engine.stats
    assert outs["none"] == outs["radix"] == [model.reference_generate(p, 8) for p in prompts]
    assert stats["none"].cached_tokens == 0 and stats["none"].hit_rate == 0
    # the first two prefill together; the other four find <bos> + head (31 tokens) cached
    assert stats["radix"].cached_tokens == 4 * 31
    assert stats["radix"].prefill_tokens == stats["none"].prefill_tokens - 4 * 31
    assert stats["radix"].hit_rate == pytest.approx(4 * 31 / (6 * 32))


def test_a_prompt_seen_in_full_still_prefills_its_last_token(model) -> None:
    engine = Engine(model, kv_capacity=200, cache="radix")
    prompt = [0, 5, 6, 7, 8]
    first = engine.generate([prompt], 6)
    again = engine.generate([prompt], 6)
    assert first == again == [model.reference_generate(prompt, 6)]
    assert engine.stats.cached_tokens == 4  # all but the last prompt token
    follow = prompt + first[0][:-1] + [9]  # the next turn reuses prompt + answer
    engine.generate([follow], 3)
    assert engine.stats.cached_tokens == 4 + len(follow) - 1


def test_a_small_pool_evicts_old_prefixes_and_records_the_tree(model) -> None:
    from minisrv.viz.radix import TreeRecorder

    engine = Engine(model, kv_capacity=40, max_running=1, cache="radix")
    recorder = TreeRecorder(engine.tree)
    prompts = [[0, *range(2 + 10 * i, 12 + 10 * i)] for i in range(4)]
    outs = engine.generate(prompts, 6)
    assert outs == [model.reference_generate(p, 6) for p in prompts]
    assert engine.tree.total_size() <= 40
    events = [e.op for e in recorder.events]
    assert "evict" in events and "lock" in events and "insert" in events
    assert {e.label for e in recorder.events if e.op == "insert"} >= {"r0", "r3"}
    evicted = sum(e.length for e in recorder.events if e.op == "evict")
    assert engine.stats.evicted_tokens == evicted > 0
    engine.scheduler.check_integrity()


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 20), st.integers(1, 30)),
                     min_size=1, max_size=12),
       slack=st.integers(0, 60), mode=st.sampled_from(MODES),
       page_size=st.sampled_from([1, 4, 16]), cache=st.sampled_from(["radix", "blocks"]))
def test_the_simulator_with_the_cache_keeps_the_accounting(lens, slack, mode, page_size,
                                                           cache) -> None:
    """The simulated GPU runs the same scheduler, so its books hold in pages too, with the
    radix tree or vLLM's block cache."""
    prompts = [[7 + k] * 10 + [3] * p for k, p, _ in lens]
    capacity = max(len(p) + m for p, (_, _, m) in zip(prompts, lens)) + slack
    capacity += -capacity % page_size  # the longest request's pages fit
    engine = Engine(SimBackend(LLAMA3_8B), kv_capacity=capacity, max_running=4, mode=mode,
                    new_token_ratio=0.3, cache=cache, page_size=page_size)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for _, _, m in lens]
    reqs = engine.make_requests(prompts, None, params)
    serve_checked(engine, reqs)
    assert [len(r.output) for r in reqs] == [m for _, _, m in lens]


def test_unknown_cache_is_rejected(model) -> None:
    with pytest.raises(ValueError, match="cache"):
        Engine(model, cache="lru")


def test_a_shared_header_s_hits_buy_ttft_and_throughput_on_the_simulated_gpu() -> None:
    """The RadixAttention chapter's GPU-scale row: users of one 2,048-token header find it
    cached, and the prefill they skip shows as a shorter first token and more tokens/s."""
    from minisrv.experiments.radix import simulated_cache_table

    table = simulated_cache_table(n=120).to_dict("index")
    none, radix = table["none"], table["radix"]
    assert none["hit rate, paced"] == 0.0 and radix["hit rate, paced"] > 0.9
    # all at once, the first 64 share one prefill step and do not find each other's header
    assert none["hit rate, all at once"] == 0.0
    assert radix["hit rate, all at once"] < radix["hit rate, paced"]
    assert radix["mean TTFT (ms), paced"] < 0.5 * none["mean TTFT (ms), paced"]
    assert radix["output tok/s, all at once"] > none["output tok/s, all at once"]
