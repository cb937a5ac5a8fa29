"""The host tier: evicted prefixes kept in host memory and loaded back.

Tokens equal each request generated alone in every loop, policy and with chunked prefill;
the two pools never leak or share a slot; the policies back up what they promise."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisrv.engine import Engine
from minisrv.kv import SlotAllocator
from minisrv.kv.hiradix import HiRadixCache
from minisrv.kv.host import HOST_POLICIES, HostPool
from minisrv.kv.manager import KVManager
from minisrv.request import FINISHED, Req
from minisrv.sampling import SamplingParams
from minisrv.scheduler import EngineConfig
from minisrv.sim import SimBackend


def chats(sessions: int = 4, turns: int = 3, seed: int = 0) -> list[list[list[int]]]:
    """Per session, each turn's new message (random ids); a turn's prompt is the history."""
    rng = random.Random(seed)
    return [[[rng.randrange(3, 60) for _ in range(rng.randrange(8, 16))] for _ in range(turns)]
            for _ in range(sessions)]


def serve_chats(engine: Engine, messages: list[list[list[int]]], new: int = 6
                ) -> list[tuple[list[int], list[int]]]:
    """Every session's turns, a turn's prompt its history plus its message; all sessions of
    one turn served together. Returns (prompt, output) of every request."""
    history = [[0] for _ in messages]
    served = []
    for turn in range(len(messages[0])):
        prompts = [history[s] + messages[s][turn] for s in range(len(messages))]
        params = SamplingParams(max_new_tokens=new, ignore_eos=True)
        reqs = engine.make_requests(prompts, None, params)
        engine.serve(reqs)
        engine.scheduler.check_integrity()
        for s, req in enumerate(reqs):
            assert req.state == FINISHED
            history[s] = prompts[s] + list(req.output)
            served.append((prompts[s], list(req.output)))
    return served


@pytest.mark.parametrize("policy", HOST_POLICIES)
@pytest.mark.parametrize("loop", ["blocking", "overlap", "chunked", "chunked-overlap"])
def test_outputs_equal_each_request_alone_with_the_host_tier(model, policy, loop) -> None:
    options = {"overlap": "overlap" in loop,
               "chunked_prefill_size": 16 if "chunked" in loop else None}
    engine = Engine(model, kv_capacity=90, max_running=4, cache="radix", debug=True,
                    host_cache_tokens=400, host_cache_policy=policy, **options)
    served = serve_chats(engine, chats())
    for prompt, output in served:
        assert output == model.reference_generate(prompt, 6, ignore_eos=True)
    stats = engine.stats
    assert stats.evicted_tokens > 0  # the device pool was too small for the chats
    assert stats.loaded_tokens > 0  # every policy copies histories before they are needed
    assert stats.loaded_tokens <= stats.host_hit_tokens
    assert stats.cached_prompt_tokens >= stats.loaded_tokens


def test_the_host_tier_raises_the_hit_rate_and_prefills_less(model) -> None:
    runs = {}
    for host in (0, 400):
        engine = Engine(model, kv_capacity=90, max_running=4, cache="radix",
                        host_cache_tokens=host)
        runs[host] = (serve_chats(engine, chats()), engine.stats)
    assert runs[0][0] == runs[400][0]  # the same tokens
    assert runs[400][1].hit_rate > runs[0][1].hit_rate
    assert runs[400][1].prefill_tokens < runs[0][1].prefill_tokens
    assert runs[0][1].loaded_tokens == runs[0][1].host_hit_tokens == 0


def test_retraction_and_abort_with_the_host_tier(model) -> None:
    engine = Engine(model, kv_capacity=60, max_running=4, cache="radix", debug=True,
                    host_cache_tokens=200, host_cache_policy="write_back")
    serve_chats(engine, chats(3, 2, seed=1))  # the tier holds the chats' prefixes
    prompts = [[0, *range(3, 20)], [0, *range(3, 14), 50], [0, *range(3, 25)]]
    reqs = engine.make_requests(prompts, 14)
    for req in reqs:
        engine.add_request(req, checked=True)
    engine.step()
    engine.retract(reqs[:1])
    engine.step()
    engine.abort(reqs[1:2])
    engine.run()
    engine.scheduler.check_integrity()
    assert reqs[2].output == model.reference_generate(prompts[2], 14)
    assert reqs[0].output == model.reference_generate(prompts[0], 14)


def test_speculative_truncation_with_the_host_tier(model) -> None:
    engine = Engine(model, kv_capacity=90, max_running=4, cache="radix", debug=True,
                    host_cache_tokens=300, speculative="ngram", num_draft_tokens=3)
    for prompt, output in serve_chats(engine, chats(3, 3, seed=2)):
        assert output == model.reference_generate(prompt, 6, ignore_eos=True)


# ------------------------------------------------------------------ the tree, both pools
def scripted(policy: str) -> HiRadixCache:
    """Two chats of three turns (4 tokens each) through a device pool of 20 slots and a host
    of 100: turn 2 hits turn 1's node once, turn 3 a second time; the last turn needs the
    device to evict the least recently used leaf (chat 0's third turn)."""
    device = SlotAllocator(20)
    tree = HiRadixCache(HostPool(100), policy, on_evict=device.free)
    for turn in range(3):
        for chat in (0, 1):
            tokens = [chat * 100 + t for t in range(4 * (turn + 1))]
            match = tree.match_prefix(tokens[:-1])
            tree.lock(match.node)
            need = len(tokens) - match.length
            if need > device.free_count:
                tree.evict(need - device.free_count)
            found = tree.match_host(match.node, tokens[:-1], match.length)
            fresh = device.alloc(need)
            node = match.node
            if found.length:
                node = tree.load(found, fresh[:found.length])
                tree.lock(node)
                tree.unlock(match.node)
            values = [*match.values, *fresh]
            already = tree.insert(tokens, values)
            device.free(values[match.length + found.length:already])
            tree.unlock(node)
            tree.check_tiers()
    return tree


def test_the_three_policies_back_up_what_they_promise() -> None:
    through, selective, back = (scripted(p) for p in HOST_POLICIES)
    # write_through: every node, when cached: 6 inserts of 4 new tokens each
    assert (through.backups, through.backed_up_tokens) == (6, 24)
    # selective (SGLang's count at insert): each node at the next turn's insert walking
    # through it, turn 1's at turn 2, turn 2's at turn 3; chat 0's third turn, evicted with
    # one count and no copy, is dropped (under a count at admission: turn 1's nodes only)
    assert (selective.backups, selective.backed_up_tokens) == (4, 16)
    assert [selective.tier_of(n) for n in selective.nodes()[1:]] == ["both"] * 4 + ["device"]
    # write_back: only the node the device evicted, which now lives on the host alone
    assert (back.backups, back.backed_up_tokens) == (1, 4)
    assert [back.tier_of(n) for n in back.nodes()[1:]].count("host") == 1
    assert [through.tier_of(n) for n in through.nodes()[1:]].count("both") == 5


def path_of(tree: HiRadixCache, node) -> tuple[int, ...]:
    """The tokens from the root down to the end of ``node``."""
    keys = []
    while node is not tree.root:
        keys.append(node.key)
        node = node.parent
    return tuple(token for key in reversed(keys) for token in key)


def depth_hits_tiers(tree: HiRadixCache) -> list[tuple[int, int, str]]:
    """(where the node ends, its hits, its tier) of every node but the root, by depth."""
    return sorted((len(path_of(tree, node)), node.hits, tree.tier_of(node))
                  for node in tree.nodes()[1:])


@pytest.mark.parametrize("chunk", [None, 4])
def test_a_request_counts_each_node_once_and_the_next_turn_once_more(model, chunk) -> None:
    """SGLang 0.5.23 counts a hit at every insert but only past what the same request
    inserted before (``inserted_len``): a request's prefill (each chunk of it) and its finish
    count each node once, so under ``write_through_selective`` nothing is copied until the
    next turn walks through its history, its second request."""
    engine = Engine(model, kv_capacity=90, max_running=4, cache="radix",
                    chunked_prefill_size=chunk, host_cache_tokens=400,
                    host_cache_policy="write_through_selective")
    tree = engine.scheduler.memory.tree
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompt = [1, *range(20, 32)]
    first, = engine.make_requests([prompt], None, params)
    engine.serve([first])
    rows = depth_hits_tiers(tree)
    assert {(hits, tier) for _, hits, tier in rows} == {(1, "device")}
    assert rows[-1][0] == len(prompt) + 5 and tree.backups == 0  # 6 sampled, 5 with KV
    assert first.inserted_len == 0  # reset when the request left
    history = [*prompt, *first.output]
    second, = engine.make_requests([[*history, 40, 41]], None, params)
    engine.serve([second])
    for end, hits, tier in depth_hits_tiers(tree):
        first_turns = end <= len(history) - 1  # what the first turn cached
        assert (hits, tier) == ((2, "both") if first_turns else (1, "device"))
    assert tree.backed_up_tokens == len(history) - 1


def test_an_insert_counts_only_what_lies_past_its_requests_earlier_inserts() -> None:
    """A node that ends within ``inserted_len`` was counted by the same request before; one
    that ends past it is counted, even if it starts within it (SGLang's ``node_end >
    inserted_len``)."""
    tree = HiRadixCache(HostPool(100), "write_through_selective")
    tree.insert(list(range(8)))
    tree.insert(list(range(12)), inserted_len=8)  # the same request, 4 tokens further
    assert depth_hits_tiers(tree) == [(8, 1, "device"), (12, 1, "device")]
    tree.insert(list(range(16)), inserted_len=10)  # [8, 12) ends past 10: counted again
    assert depth_hits_tiers(tree) == [(8, 1, "device"), (12, 2, "both"), (16, 1, "device")]


def test_a_two_tier_tree_reports_its_paths_as_node_ids_like_the_one_tier_tree() -> None:
    """A listener hears the same path for every operation from either tree: node ids from
    below the root down, for a lock as for a match or an insert (the drawings colour by them)."""
    from minisrv.kv import RadixCache

    heard: dict[str, list] = {"one": [], "two": []}
    for name, tree in (("one", RadixCache()), ("two", HiRadixCache(HostPool(100)))):
        tree.listener = lambda _tree, event, name=name: heard[name].append(
            (event.op, event.path, event.split, event.inserted))
        tree.insert(list(range(8)))
        match = tree.match_prefix([*range(4), 99])
        tree.lock(match.node)
        tree.insert([*range(4), 7, 7])
    assert heard["one"] == heard["two"]
    assert [op for op, *_ in heard["one"]] == ["insert", "match", "lock", "insert"]
    assert heard["one"][2][1] == heard["one"][1][1] and heard["one"][1][2] == heard["one"][1][1]


def test_a_split_keeps_the_count_and_a_dropped_node_takes_its_count_along() -> None:
    """A split (by a match or by another request's insert) gives the upper part the node's
    count; a node the device drops (no host copy) counts nothing any more: the same tokens
    cached again start at one. A host-only node an insert fills again is counted, as SGLang
    counts the node it restores from the request's fresh KV."""
    device = SlotAllocator(40)
    tree = HiRadixCache(HostPool(100), "write_through_selective", on_evict=device.free)
    prompt = list(range(10))
    tree.insert(prompt, device.alloc(10))
    tree.match_prefix(prompt[:4])  # splits at 4, counts nothing
    assert depth_hits_tiers(tree) == [(4, 1, "device"), (10, 1, "device")]
    other = [*prompt[:6], 90, 91]  # a second request: splits at 6, counts the path
    slots = device.alloc(8)
    already = tree.insert(other, slots)
    device.free(slots[:already])
    assert depth_hits_tiers(tree) == [(4, 2, "both"), (6, 2, "both"), (8, 1, "device"),
                                      (10, 1, "device")]
    tree.evict(40)  # the leaves had one count and no copy: dropped
    assert depth_hits_tiers(tree) == [(4, 2, "host"), (6, 2, "host")]
    slots = device.alloc(10)
    assert tree.insert(prompt, slots) == 0  # the host-only part is filled from these slots
    assert depth_hits_tiers(tree) == [(4, 3, "both"), (6, 3, "both"), (10, 1, "device")]
    tree.check_tiers()


def test_selective_copies_a_history_only_if_the_device_holds_it_until_the_next_turn() -> None:
    """With room on the device for every history, each turn's insert gives its chat's previous
    prompt the second hit and copies it, and the selective policy hits what ``write_through``
    hits; in a device pool too small for that, the histories are dropped with one hit and the
    tier stays nearly empty. Each copy is charged to the request whose insert made it."""
    from minisrv.experiments.host_tier import copies_by_turn, long_chats, sim_tier_run

    chats = long_chats(sessions=4, turns=3, low=64, high=128, output=16)
    first, second = chats.prompts[:4], chats.prompts[4:8]
    roomy, tight = (sim_tier_run(chats, 5000, "write_through_selective", device_tokens=size)
                    for size in (5000, 600))
    through = sim_tier_run(chats, 5000, "write_through", device_tokens=600)
    copies = copies_by_turn(roomy, sessions=4)
    assert list(copies.loc["requests that copied"]) == [1, 4, 4]  # <bos>, then every chat
    assert list(copies.loc["tokens copied"]) == [
        1, sum(len(p) - 1 for p in first), sum(len(b) - len(a) for a, b in zip(first, second))]
    assert roomy.hit_rate == through.hit_rate
    assert tight.hit_rate < through.hit_rate / 2
    assert sum(tight.copied) == tight.backed_up_tokens < roomy.backed_up_tokens


ops = st.lists(st.tuples(st.sampled_from(["admit", "finish", "evict", "evict_host"]),
                         st.integers(0, 5), st.integers(1, 12)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops=ops, policy=st.sampled_from(HOST_POLICIES), host=st.integers(4, 60),
       page_size=st.sampled_from([1, 4]))
def test_allocate_evict_load_free_keep_both_pools_consistent(ops, policy, host,
                                                             page_size) -> None:
    """Requests admitted (match, evict-to-host, load back, their prefill inserted in two
    chunks), finished (cached) and evicted in any order: no slot of either pool leaked or
    shared, no locked node evicted; in pages, both pools move whole pages; and no node has
    more hits than requests have inserted through it (a request counts a node once)."""
    memory = KVManager(SlotAllocator(48, page_size), "radix", HostPool(host, page_size=page_size),
                       policy)
    running: list[Req] = []
    covered: dict[int, tuple[int, ...]] = {}  # each request's longest insert
    rid = 0
    for op, seed, size in ops:
        if op == "admit":
            rng = random.Random(seed)
            prompt = [0, *(rng.randrange(1, 4) for _ in range(size))]
            req = Req(rid=rid, prompt=prompt, params=SamplingParams(max_new_tokens=2))
            rid += 1
            match = memory.match(req)
            if memory.allocate(req, match):
                running.append(req)
                half = (req.cached_len + req.kv_len) // 2
                memory.cache_unfinished(req, half)  # a first chunk, then the rest
                memory.cache_unfinished(req)
                covered[req.rid] = req.all_tokens
            else:
                memory.drop_match(req, match)
        elif op == "finish" and running:
            req = running.pop(seed % len(running))
            if memory.growth(req, 1) > memory.free_count and not memory.evict(1, "test"):
                memory.release(req)  # no room for its last token: retracted, as the engine would
            else:
                req.output.append(size % 4)
                memory.alloc_tokens(req, 1)
                covered[req.rid] = req.all_tokens
                memory.cache_finished(req)
        elif op == "evict":
            locked = [n for n in memory.tree.nodes()[1:] if n.lock_ref]
            memory.evict(size, "test")
            assert all(n.value and not n.removed for n in locked)
        elif op == "evict_host":
            memory.tree.evict_host(size)
        memory.check_integrity(running)
        memory.transfer()
        for node in memory.tree.nodes()[1:]:  # no request counts a node twice
            path = path_of(memory.tree, node)
            assert node.hits <= sum(run[:len(path)] == path for run in covered.values())
    for req in running:
        memory.release(req)
    memory.check_integrity([])
    memory.tree.evict(memory.tree.total_size())
    memory.tree.evict_host(host)
    assert memory.kv.used_count == 0 and memory.host.used_count == 0


# ------------------------------------------------------------------ options
@pytest.mark.parametrize("options, message", [
    ({"host_cache_tokens": -1}, "host_cache_tokens"),
    ({"host_cache_tokens": 1.5}, "host_cache_tokens"),
    ({"host_cache_policy": "lru"}, "host_cache_policy"),
    ({"host_cache_tokens": 100, "cache": "none"}, "cache='radix'"),
])
def test_bad_host_tier_options_are_a_clear_value_error(options, message) -> None:
    options = {"cache": "radix", **options}
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_the_simulated_gpu_charges_load_backs_at_host_bandwidth() -> None:
    from minisrv.configs import H100, LLAMA3_8B
    from minisrv.kvsize import kv_bytes_per_token

    prompt = list(range(1, 2001))
    durations = {}
    for host in (0, 20000):
        engine = Engine(SimBackend(), kv_capacity=3000, cache="radix", host_cache_tokens=host)
        engine.generate([prompt], 2)
        engine.scheduler.memory.evict(3000, "test")  # dropped, or moved to the host
        engine.generate([prompt], 1)
        durations[host] = engine.trace[-1].duration
        if host:
            assert engine.stats.loaded_tokens == engine.stats.host_hit_tokens == 1999
            copy = 1999 * kv_bytes_per_token(LLAMA3_8B, 2) / H100.host_bandwidth
            recompute = durations[0]
            # the loaded step computes one token, after the copy at 55 GB/s
            assert durations[host] > copy
            assert durations[host] - copy < recompute


# ------------------------------------------------------------------ the server
def test_the_server_flags_build_a_host_tier_and_metrics_report_it(citylm) -> None:
    from minisrv.server.cli import build_parser, server_config
    from minisrv.server.engine_loop import engine_snapshot
    from minisrv.server.metrics import ServerMetrics

    args = build_parser().parse_args(["serve", "--host-cache-tokens", "500",
                                      "--host-cache-policy", "write_back"])
    config = server_config(args)
    assert (config.engine.host_cache_tokens, config.engine.host_cache_policy) == (
        500, "write_back")
    assert server_config(build_parser().parse_args(["serve"])).engine.host_cache_tokens == 0
    for bad in (["--host-cache-tokens", "-5"], ["--host-cache-policy", "lru"]):
        with pytest.raises(ValueError, match="host_cache"):
            server_config(build_parser().parse_args(["serve", *bad]))
    model, _ = citylm
    engine = Engine(model, config.engine, kv_capacity=60, max_running=4)
    serve_chats(engine, chats(3, 2))
    snap = engine_snapshot(engine)
    assert snap["host_tokens"] == 500 and snap["host_used"] > 0
    assert snap["host_hit_tokens"] == engine.stats.host_hit_tokens > 0
    text = ServerMetrics(lambda: snap).render().decode()
    assert "minisrv:host_cache_tokens 500.0" in text
    assert f"minisrv:host_cache_used_tokens {snap['host_used']:.1f}" in text


@pytest.mark.parametrize("mode", ["static", "prefill-first", "mixed"])
@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_every_batching_mode_and_queue_policy_keeps_the_tokens_with_the_host_tier(
        model, mode, policy) -> None:
    """The tier changes where a prefix's KV comes from, never which tokens come out: each
    batching mode and queue order, the device pool too small for the chats."""
    engine = Engine(model, kv_capacity=90, max_running=4, cache="radix", debug=True,
                    mode=mode, policy=policy, host_cache_tokens=400)
    for prompt, output in serve_chats(engine, chats()):
        assert output == model.reference_generate(prompt, 6, ignore_eos=True)
    assert engine.stats.loaded_tokens > 0


def test_the_sim_table_is_shown_without_spurious_digits_under_one_header_row() -> None:
    import pandas as pd

    from minisrv.viz.hosttier import sim_table_view

    index = pd.MultiIndex.from_tuples([("none", "-"), ("1M", "write_back")],
                                      names=["host tier", "policy"])
    table = pd.DataFrame({"hit rate": [0.0381, 0.7772], "mean TTFT (s)": [14.2213, 3.7823],
                          "output tok/s": [758.903, 1335.2],
                          "loaded (M tokens)": [0.0, 2.3619],
                          "backed up (M tokens)": [0.0, 0.7504]}, index=index)
    shown = sim_table_view(table)
    assert shown.loc[("1M", "write_back")].tolist() == ["77.7%", "3.8", 1335, "2.36", "0.75"]
    assert shown.index.names == [None, None] and shown.columns.name == "host tier / policy"
    assert table.loc[("none", "-"), "output tok/s"] == 758.903  # the numbers unchanged


def test_the_size_explorer_draws_hit_rate_against_every_tier_size_and_policy() -> None:
    """Every state is a figure of the hit rate and backups of all the (size, policy) runs, its
    own ringed (not a one-row table); the runs are served once and reused, size 0 once for
    every policy, and the numbers are each run's own. The size control counts thousands."""
    pytest.importorskip("matplotlib")
    from minisrv.experiments.host_tier import long_chats, sim_tier_run
    from minisrv.viz.hosttier import host_size_explorer

    chats = long_chats(sessions=4, turns=3, low=64, high=128, output=16)
    options = {"device_tokens": 600}
    policies = ("write_through", "write_back")
    runs = {(0, "write_through"): sim_tier_run(chats, 0, **options),
            (2000, "write_back"): sim_tier_run(chats, 2000, "write_back", **options)}
    ex = host_size_explorer(chats, (0, 1000, 2000), policies, runs=runs, history_tokens=1500,
                            **options)
    assert ex.default == {"policy": "write_through", "size": 0}
    for (size, policy), run in runs.items():
        state = ex.metrics(policy=policy, size=size // 1000)
        assert (state["hit rate"], state["mean TTFT (s)"]) == (run.hit_rate, run.mean_ttft)
        assert state["backed up (tokens)"] == run.backed_up_tokens
    none = ex.metrics(policy="write_back", size=0)
    assert none["hit rate"] == ex.metrics(policy="write_through", size=0)["hit rate"]
    assert ex.metrics(policy="write_back", size=2)["hit rate"] > none["hit rate"]
    through = ex.metrics(policy="write_through", size=2)["backed up (tokens)"]
    assert ex.metrics(policy="write_back", size=2)["backed up (tokens)"] < through
    assert ex.html.count("data:image/webp") == 6 and "<table" not in ex.html
    one = host_size_explorer(chats, (0, 2000), ("write_back",), runs=runs, **options)
    assert one.default == {"size": 0}  # one policy: no menu
    assert one.metrics(size=2)["hit rate"] == runs[2000, "write_back"].hit_rate


def test_a_busy_step_makes_loading_back_win_from_the_first_tokens() -> None:
    """Alone, a short prompt's prefill is memory-bound and recomputing a short prefix is
    almost free, so loading wins only from a few hundred tokens; in a step that already
    prefills other prompts each recomputed token costs compute, which a copy of its KV
    undercuts from the first token. The busy column is each prompt's extra cost in that
    step, so it differs from the lone column exactly where the lone prefill is memory-bound."""
    from minisrv.experiments.host_tier import (
        break_even,
        break_even_length,
        prefill_seconds,
        prefill_step_seconds,
    )

    alone, busy = break_even_length(), break_even_length(busy=2048)
    assert 100 < alone < 1000 and busy < 16
    table = break_even(busy=2048)
    assert (table.loc[[16, 64, 128], "same ratio, in a busy step"] > 1).all()
    assert (table.loc[[16, 64, 128], "recompute / (load + prefill)"] < 1).all()
    assert table["same ratio, in a busy step"].is_monotonic_increasing
    assert prefill_step_seconds([(100, 20)]) == prefill_seconds(100, 20)
    both = prefill_step_seconds([(2048, 0), (100, 0)])
    assert both > prefill_seconds(2048)  # a compute-bound step grows with every token


def test_cached_length_counts_only_what_is_on_the_device() -> None:
    """A router reading this cache finds what a request would reuse without a load: the host
    copy of an evicted turn is not counted, and reading moves nothing between tiers."""
    tree = scripted("write_through")
    on_host_only = 0
    for chat in (0, 1):
        for turn in range(1, 4):
            tokens = [chat * 100 + t for t in range(4 * turn)]
            before = tree.snapshot()
            length = tree.cached_length(tokens)
            assert tree.snapshot() == before
            match = tree.match_prefix(tokens)
            assert length == match.length
            on_host_only += tree.host_match_length(match.node, tokens, match.length)
    assert on_host_only > 0  # the evicted turn was there to be miscounted

