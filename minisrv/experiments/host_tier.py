"""The host-tier chapter's runs: chats on CityLM with and without the tier, long chats on the
simulated H100, the break-even between loading a prefix back and recomputing it, and a small
tree walked through an eviction and a load-back.

Each function builds fresh engines and returns plain results (DataFrames, named tuples);
``minisrv.viz.hosttier`` only draws them. Every CityLM run checks each output against the
request generated alone.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import pandas as pd

from minisrv.configs import H100, LLAMA3_8B, GPUSpec, ModelConfig
from minisrv.core import BatchResult
from minisrv.engine import Engine
from minisrv.experiments.radix import chat_workload
from minisrv.kv import NodeView
from minisrv.kv.events import TreeEvent
from minisrv.kv.hiradix import HiRadixCache
from minisrv.kv.host import HOST_POLICIES
from minisrv.kvsize import kv_bytes_per_token
from minisrv.sim import SimBackend
from minisrv.sim.backend import SimStep
from minisrv.sim.roofline import step_cost_from_totals
from minisrv.workloads import Workload

LONG_CONTEXT_8B = dataclasses.replace(LLAMA3_8B, name="LLaMA-3-8B, 128K context",
                                      max_seq_len=131072)
"""LLaMA-3-8B's shapes with LLaMA-3.1's 128K context: eight turns of up to 2,048 new tokens
outgrow LLaMA-3's 8K window, and the roofline depends on the shapes alone."""

__all__ = [
    "LONG_CONTEXT_8B",
    "TierLimits",
    "TierRun",
    "TierWalk",
    "break_even",
    "break_even_length",
    "chat_tier_run",
    "chat_tier_table",
    "copies_by_turn",
    "load_seconds",
    "long_chats",
    "prefill_seconds",
    "prefill_step_seconds",
    "sim_tier_limits",
    "sim_tier_run",
    "sim_tier_runs",
    "sim_tier_table",
    "tier_walk",
    "ttft_by_turn",
]


class TierRun(NamedTuple):
    """One serving run's figures (``chat_tier_run``, ``sim_tier_run``)."""

    hit_rate: float  # cached prompt tokens (device or host) / prompt tokens
    prefill_tokens: int  # prompt tokens computed
    host_hit_tokens: int  # prompt tokens found in the host tier
    loaded_tokens: int  # tokens copied back from it
    backed_up_tokens: int  # tokens copied to it
    identical: int  # outputs equal to the request alone (-1: not checked, the simulator)
    requests: int
    mean_ttft: float  # steps (CityLM) or seconds (simulated GPU)
    throughput: float  # output tokens per step or per second
    # tokens copied to the host while the tree served each request (its inserts; under
    # write_back the evictions made for it), in workload order
    copied: tuple[int, ...] = ()
    ttft: tuple[float, ...] = ()  # each request's time to first token, in workload order


class _Copies:
    """A tree listener that charges each copy to the host to the request whose operation made
    it (the tree's event tag, ``r<rid>``), so a run can say which requests' inserts gave a
    prefix the hit that got it copied."""

    def __init__(self, tree: Any) -> None:
        self.seen = 0
        self.by_tag: Counter[str] = Counter()
        if isinstance(tree, HiRadixCache):
            tree.listener = self

    def __call__(self, tree: HiRadixCache, event: TreeEvent) -> None:
        if tree.backed_up_tokens != self.seen:
            self.by_tag[event.tag] += tree.backed_up_tokens - self.seen
            self.seen = tree.backed_up_tokens


def _run(engine: Engine, workload: Workload) -> tuple[TierRun, list[Any]]:
    copies = _Copies(engine.tree)
    result = engine.run_workload(workload)
    stats, metrics = engine.stats, result.metrics
    backed = getattr(engine.tree, "backed_up_tokens", 0)
    run = TierRun(stats.hit_rate, stats.prefill_tokens, stats.host_hit_tokens,
                  stats.loaded_tokens, backed, -1, len(result.requests), metrics.mean_ttft,
                  metrics.throughput,
                  tuple(copies.by_tag[f"r{req.rid}"] for req in result.requests),
                  tuple(req.ttft for req in result.requests))
    return run, result.requests


def chat_tier_run(model: Any, tok: Any, capacity: int, host_tokens: int = 0,
                  policy: str = "write_through", sessions: int = 8, turns: int = 4,
                  built: dict | None = None, alone: dict | None = None) -> TierRun:
    """Chapter 04's chats (``chat_workload``) in a device pool of ``capacity`` tokens, with a
    host tier of ``host_tokens`` (0: none); every output checked against the request alone
    (``alone`` caches those by (prompt, max_new_tokens))."""
    built = {} if built is None else built
    alone = {} if alone is None else alone
    workload = chat_workload(model, tok, sessions, turns, built)
    options = {"host_cache_tokens": host_tokens, "host_cache_policy": policy}
    engine = Engine(model, kv_capacity=capacity, max_running=8, cache="radix", **options)
    run, reqs = _run(engine, workload)
    identical = 0
    for req in reqs:
        key = (tuple(req.prompt), req.params.max_new_tokens)
        if key not in alone:
            alone[key] = model.reference_generate(req.prompt, req.params.max_new_tokens)
        identical += list(req.output) == list(alone[key])
    return run._replace(identical=identical)


def chat_tier_table(model: Any, tok: Any, capacities: Sequence[int] = (250, 400),
                    host_tokens: int = 2000, policy: str = "write_through",
                    built: dict | None = None, alone: dict | None = None) -> pd.DataFrame:
    """Hit rate, prefilled and loaded tokens of the chats at each capacity, without and
    with a host tier of ``host_tokens``; ``outputs as alone`` counts the checked outputs."""
    rows = {}
    for capacity in capacities:
        for host in (0, host_tokens):
            run = chat_tier_run(model, tok, capacity, host, policy, built=built, alone=alone)
            rows[(capacity, host)] = {
                "hit rate": f"{run.hit_rate:.1%}", "prefilled": run.prefill_tokens,
                "loaded back": run.loaded_tokens,
                "outputs as alone": f"{run.identical}/{run.requests}"}
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.names = ["device pool", "host tier"]
    return table


def long_chats(sessions: int = 64, turns: int = 8, low: int = 512, high: int = 2048,
               output: int = 128, round_s: float = 4.0, seed: int = 0) -> Workload:
    """``sessions`` chats of ``turns`` turns for the simulated GPU: each turn adds a message
    of ``low``..``high`` tokens and the previous answer (``output`` tokens) to the history.

    Turn ``t`` of every chat arrives in round ``t`` (``round_s`` seconds apart), the chats
    spread evenly over the round, so a chat's history waits a whole round for its next turn
    while the 63 others pass through the pool. The answers in the history are fixed tokens
    (the simulator's own outputs are dummies), so what a turn reuses is its whole previous
    prompt.
    """
    rng = random.Random(seed)
    history = [[1] for _ in range(sessions)]
    prompts, arrivals = [], []
    for turn in range(turns):
        for chat in range(sessions):
            message = [rng.randrange(2, 32000) for _ in range(rng.randint(low, high))]
            prompt = history[chat] + message
            prompts.append(prompt)
            arrivals.append(turn * round_s + chat * round_s / sessions)
            history[chat] = prompt + [rng.randrange(2, 32000) for _ in range(output)]
    return Workload("long chats", prompts, [output] * len(prompts), arrivals,
                    f"{sessions} chats x {turns} turns of {low}-{high} new tokens")


class _SerialBackupSim(SimBackend):
    """A simulated GPU whose backups to the host hold up the next step as its load-backs do:
    the bound on what the copies ``SimBackend`` runs behind the steps could cost, for a link
    (or an eviction that waits on its copy) that does not overlap them."""

    def charge_host_copies(self, loaded: int, backed_up: int) -> None:
        """Both directions before the next step, one after the other."""
        super().charge_host_copies(loaded + backed_up, 0)


def _sim_engine(backend: SimBackend, host_tokens: int, policy: str, device_tokens: int,
                max_running: int, record_trace: bool = False) -> Engine:
    return Engine(backend, kv_capacity=device_tokens, max_running=max_running, cache="radix",
                  host_cache_tokens=host_tokens, host_cache_policy=policy,
                  chunked_prefill_size=8192, record_trace=record_trace)


def sim_tier_run(workload: Workload, host_tokens: int, policy: str = "write_through",
                 device_tokens: int = 200_000, cfg: ModelConfig = LONG_CONTEXT_8B,
                 gpu: GPUSpec = H100, max_running: int = 64,
                 serial_backups: bool = False) -> TierRun:
    """``workload`` on the simulated ``gpu`` serving ``cfg``: a device pool of
    ``device_tokens`` and a host tier of ``host_tokens``, load-backs charged at the host
    link's bandwidth (and backups too, before the next step, with ``serial_backups``)."""
    backend = (_SerialBackupSim if serial_backups else SimBackend)(cfg, gpu)
    engine = _sim_engine(backend, host_tokens, policy, device_tokens, max_running)
    return _run(engine, workload)[0]


class TierLimits(NamedTuple):
    """What holds a tiered run back (``sim_tier_limits``); means are over the clock."""
    mean_running: float  # requests computing in a step
    max_running: int
    kv_use: float  # device slots held by requests / the device pool
    busy_s: float  # clock time in steps
    load_s: float  # of it, load-backs over the host link
    prefill_rate: float  # prompt tokens computed per busy second
    mirrored: float  # host slots whose node is on the device too (a copy of device KV)


class _MirrorSim(SimBackend):
    """Every ``every`` steps, counts the host tokens whose node is on the device too,
    weighted by the clock (``tree`` is set once the engine exists)."""

    def __init__(self, cfg: ModelConfig, gpu: GPUSpec, every: int = 25) -> None:
        super().__init__(cfg, gpu)
        self.tree: Any = None
        self.every, self.steps, self.weighted, self.time = every, 0, 0.0, 0.0

    def compute(self, step: SimStep, resolve: Any = None, store: Any = None) -> BatchResult:
        result = super().compute(step, resolve, store)
        self.steps += 1
        if isinstance(self.tree, HiRadixCache) and self.steps % self.every == 0:
            both = sum(len(node.key) for node in self.tree.nodes()
                       if self.tree.tier_of(node) == "both")
            self.weighted += both * result.elapsed
            self.time += result.elapsed
        return result


def sim_tier_limits(workload: Workload, host_tokens: int, policy: str = "write_through",
                    device_tokens: int = 200_000, cfg: ModelConfig = LONG_CONTEXT_8B,
                    gpu: GPUSpec = H100, max_running: int = 64) -> TierLimits:
    """``sim_tier_run``'s run, traced: requests running at once, device pool use, time in
    load-backs, and host tokens mirroring KV still on the device."""
    backend = _MirrorSim(cfg, gpu)
    engine = _sim_engine(backend, host_tokens, policy, device_tokens, max_running, True)
    backend.tree = engine.tree
    trace = engine.run_workload(workload).trace
    busy = sum(step.duration for step in trace)
    return TierLimits(
        sum(step.batch_size * step.duration for step in trace) / busy, max_running,
        sum(step.kv_used * step.duration for step in trace) / busy / device_tokens, busy,
        backend.host_copy_seconds(engine.stats.loaded_tokens), engine.stats.prefill_tokens / busy,
        backend.weighted / backend.time if backend.time else 0.0)


def sim_tier_runs(workload: Workload, host_sizes: Sequence[int] = (0, 1_000_000, 4_000_000),
                  policies: Sequence[str] = HOST_POLICIES, **options: Any
                  ) -> dict[tuple[int, str], TierRun]:
    """``sim_tier_run`` per (host tier size, write policy); the policy means nothing without a
    tier, so size 0 is run once, under the first policy. Kept apart from the table so that the
    chapter's explorer reuses the runs rather than serving the chats again."""
    return {(size, policy): sim_tier_run(workload, size, policy, **options)
            for size in host_sizes for policy in (policies if size else policies[:1])}


def sim_tier_table(runs: Mapping[tuple[int, str], TierRun]) -> pd.DataFrame:
    """TTFT, throughput and hit rate of each run of ``sim_tier_runs``, one row per (host tier
    size, policy)."""
    rows = {(f"{size / 1e6:g}M" if size else "none", policy if size else "-"): {
        "hit rate": run.hit_rate, "mean TTFT (s)": run.mean_ttft,
        "output tok/s": run.throughput,
        "loaded (M tokens)": run.loaded_tokens / 1e6,
        "backed up (M tokens)": run.backed_up_tokens / 1e6} for (size, policy), run in runs.items()}
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.names = ["host tier", "policy"]
    return table


def _by_turn(values: Sequence[Any], sessions: int) -> dict[int, Sequence[Any]]:
    """``values`` in workload order, split by turn of ``long_chats`` (request ``i`` is turn
    ``i // sessions + 1``), whole turns only."""
    return {turn + 1: values[turn * sessions:(turn + 1) * sessions]
            for turn in range(len(values) // sessions)}


def copies_by_turn(run: TierRun, sessions: int = 64) -> pd.DataFrame:
    """Per turn of ``long_chats`` (request ``i`` is turn ``i // sessions + 1``): how many of
    its requests made copies to the host and how many tokens they copied (``TierRun.copied``).
    Under ``write_through_selective`` a request copies what its insert gave a second hit: the
    prefixes another request cached that were still on the device when it came."""
    rows = {turn: {"requests that copied": sum(1 for n in part if n), "tokens copied": sum(part)}
            for turn, part in _by_turn(run.copied, sessions).items()}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("turn").T


def ttft_by_turn(runs: Mapping[str, TierRun], sessions: int = 64) -> pd.DataFrame:
    """Mean time to first token per turn of ``long_chats`` (request ``i`` is turn
    ``i // sessions + 1``), one row per named run: on a saturated server the mean over a whole
    run depends on where the run stops, the per-turn means show how fast the queue grows."""
    rows = {name: {turn: sum(part) / sessions
                   for turn, part in _by_turn(run.ttft, sessions).items()}
            for name, run in runs.items()}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis(columns="turn")


def load_seconds(n: int, cfg: ModelConfig = LLAMA3_8B, gpu: GPUSpec = H100,
                 dtype_bytes: float = 2) -> float:
    """Copying ``n`` tokens' KV from host memory: 2 x layers x kv_heads x head_dim x bytes x
    n over the host link."""
    return n * kv_bytes_per_token(cfg, dtype_bytes) / gpu.host_bandwidth


def prefill_step_seconds(prompts: Sequence[tuple[int, int]], cfg: ModelConfig = LLAMA3_8B,
                         gpu: GPUSpec = H100, dtype_bytes: float = 2) -> float:
    """Roofline time of one step that prefills each ``(new, cached)`` of ``prompts``: ``new``
    tokens after ``cached`` ones of the same prompt."""
    new = sum(n for n, _ in prompts)
    attended = sum(n * c + n * (n + 1) // 2 for n, c in prompts)
    cached = sum(c for _, c in prompts)
    return step_cost_from_totals(cfg, gpu, new, attended, cached, dtype_bytes).time_s


def prefill_seconds(new: int, cached: int = 0, cfg: ModelConfig = LLAMA3_8B,
                    gpu: GPUSpec = H100, dtype_bytes: float = 2) -> float:
    """Roofline time of one prefill of ``new`` tokens after ``cached`` ones."""
    return prefill_step_seconds([(new, cached)], cfg, gpu, dtype_bytes)


def _costs(n: int, suffix: int, busy: int, cfg: ModelConfig,
           gpu: GPUSpec) -> tuple[float, float]:
    """(load + prefill, recompute) of a prompt of an ``n``-token prefix and ``suffix`` new
    tokens: what it adds to a step that already prefills ``busy`` tokens of other prompts
    (0: the prompt runs alone)."""
    others = [(busy, 0)] if busy else []
    base = prefill_step_seconds(others, cfg, gpu) if busy else 0.0
    load = load_seconds(n, cfg, gpu) + prefill_step_seconds([*others, (suffix, n)], cfg, gpu) - base
    recompute = prefill_step_seconds([*others, (n + suffix, 0)], cfg, gpu) - base
    return load, recompute


def break_even(lengths: Sequence[int] = (16, 64, 128, 256, 512, 1024, 4096, 16384),
               suffix: int = 64, cfg: ModelConfig = LLAMA3_8B,
               gpu: GPUSpec = H100, busy: int = 2048) -> pd.DataFrame:
    """A prompt of a ``n``-token prefix and ``suffix`` new tokens, its prefix either loaded
    from the host (copy, then a prefill of the suffix) or recomputed (a prefill of all):
    times in ms and how many times faster loading is (recompute over load + prefill: the
    suffix's prefill is paid either way), for the prompt alone and, in the last column, for
    the same prompt joining a step that already prefills ``busy`` tokens of other prompts,
    where each token it adds is charged at the compute-bound rate."""
    rows = {}
    for n in lengths:
        load, recompute = _costs(n, suffix, 0, cfg, gpu)
        busy_load, busy_recompute = _costs(n, suffix, busy, cfg, gpu)
        rows[n] = {"load + prefill (ms)": 1e3 * load, "recompute (ms)": 1e3 * recompute,
                   "recompute / (load + prefill)": recompute / load,
                   "same ratio, in a busy step": busy_recompute / busy_load}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("prefix tokens")


def break_even_length(suffix: int = 64, cfg: ModelConfig = LLAMA3_8B,
                      gpu: GPUSpec = H100, limit: int = 1 << 16, busy: int = 0) -> int:
    """The shortest prefix whose load-back beats recomputing it (``break_even``'s rule), for
    the prompt alone or, with ``busy``, in a step that prefills ``busy`` other tokens."""
    for n in range(1, limit):
        load, recompute = _costs(n, suffix, busy, cfg, gpu)
        if load < recompute:
            return n
    return limit


class TierWalk(NamedTuple):
    """The tree of a small engine at three moments, and what happened between them."""

    before: tuple[NodeView, ...]  # both chats cached on the device
    evicted: tuple[NodeView, ...]  # after a third request pushed chat A to the host
    loaded: tuple[NodeView, ...]  # after A's next turn loaded it back
    loaded_tokens: int  # what A's next turn copied back
    outputs_alone: bool  # every output equal to the request generated alone


def tier_walk(model: Any, tok: Any, policy: str = "write_through") -> TierWalk:
    """Two chats and an intruder through a 60-token pool with a host tier of 200 tokens:
    the tree with both chats, after the intruder evicts chat A's history to the host, and
    after A's second turn loads it back."""
    engine = Engine(model, kv_capacity=60, max_running=2, cache="radix",
                    host_cache_tokens=200, host_cache_policy=policy)
    tree = engine.tree
    checked = True

    def serve(text: str, n: int = 6) -> list[int]:
        nonlocal checked
        prompt = tok.encode(text)
        out = engine.generate([prompt], n)[0]
        checked &= out == model.reference_generate(prompt, n)
        return out

    a1 = serve("FR: Paris\nJP:")
    serve("IT: Rome\nDE:")
    before = tree.snapshot()
    serve("BR: Sao Paulo\nMX: Mexico\nIN:", 14)
    evicted = tree.snapshot()
    loaded = engine.stats.loaded_tokens
    serve("FR: Paris\nJP:" + tok.decode(a1) + "\nUS:")
    return TierWalk(before, evicted, tree.snapshot(), engine.stats.loaded_tokens - loaded,
                    checked)
