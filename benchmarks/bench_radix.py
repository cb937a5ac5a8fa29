"""The radix tree against a naive token-by-token trie, on one trace, in one process.

A trace of requests with shared prefixes (system prompts, multi-turn histories, unique
questions) is replayed twice: each request does ``match_prefix(prompt)`` then
``insert(prompt + output)``, first on ``RadixCache`` and then on a plain trie with one dict
node per token (the obvious first implementation). Both must agree on every match length;
the script prints operations per second and their ratio, then the radix tree's speed with a
capacity that forces LRU eviction (which the naive trie cannot do without a scan).

Then the same trace goes through each prefix cache as the engine uses it: a request matches
its prompt without the last token (whose logits must be computed), then inserts prompt +
output. The table gives matches per second and the tokens hit: the radix tree and vLLM's
block-hash cache (``BlockCache``) at page sizes 1 and 16 (vLLM's default block), and SGLang's
own radix tree at pages 1 and 16 where ``sglang`` imports.

    python benchmarks/bench_radix.py [--requests 10000] [--seed 0]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from minisrv.kv import BlockCache, RadixCache

VOCAB = 128


class NaiveTrie:
    """One node per token: ``{token: [child dict, value]}``. Match and insert walk token by
    token, so every cached token costs a dict lookup and a Python loop iteration."""

    def __init__(self) -> None:
        self.root: dict[int, list[Any]] = {}

    def match_prefix(self, tokens: list[int]) -> tuple[int, list[Any]]:
        node, values = self.root, []
        for t in tokens:
            entry = node.get(t)
            if entry is None:
                break
            values.append(entry[1])
            node = entry[0]
        return len(values), values

    def insert(self, tokens: list[int], values: list[Any]) -> int:
        node, cached = self.root, 0
        for i, t in enumerate(tokens):
            entry = node.get(t)
            if entry is None:
                entry = node[t] = [{}, values[i]]
            elif cached == i:
                cached += 1
            node = entry[0]
        return cached


def make_trace(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """``n`` (prompt, output) pairs: 40 system prompts of 150-400 tokens shared by many
    users; a third of the requests continue an earlier conversation (its prompt + output +
    a new question); the rest are fresh questions of 20-80 tokens. Outputs are 10-60 tokens.
    """
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB, rng.integers(150, 401)).tolist() for _ in range(40)]
    trace: list[tuple[list[int], list[int]]] = []
    for _ in range(n):
        if trace and rng.random() < 1 / 3:
            prev_prompt, prev_out = trace[int(rng.integers(max(0, len(trace) - 200),
                                                           len(trace)))]
            prompt = prev_prompt + prev_out + rng.integers(0, VOCAB, 20).tolist()
            if len(prompt) > 2000:
                prompt = systems[int(rng.integers(40))] + rng.integers(0, VOCAB, 40).tolist()
        else:
            question = rng.integers(0, VOCAB, rng.integers(20, 81)).tolist()
            prompt = systems[int(rng.integers(40))] + question
        trace.append((prompt, rng.integers(0, VOCAB, rng.integers(10, 61)).tolist()))
    return trace


def replay(cache: Any, trace: list[tuple[list[int], list[int]]], desc: str,
           capacity: int | None = None) -> tuple[float, list[int]]:
    """Seconds to match and insert every request; the match lengths, for cross-checking."""
    lengths: list[int] = []
    slot = 0
    start = time.perf_counter()
    for prompt, output in tqdm(trace, desc=desc, mininterval=1.0):
        lengths.append(cache.match_prefix(prompt)[0])
        full = prompt + output
        values = list(range(slot, slot + len(full)))
        slot += len(full)
        if capacity is not None:
            over = cache.total_size() + len(full) - capacity
            if over > 0:
                cache.evict(over)
        cache.insert(full, values)
    return time.perf_counter() - start, lengths


class SGLangTree:
    """SGLang's ``RadixCache`` (0.5's parameter objects) behind ``match_prefix`` / ``insert``,
    with tensors of slot ids as its values. Its simulated mode has no allocator to give
    evicted slots back to, so it runs only without a capacity."""

    def __init__(self, page_size: int) -> None:
        import torch
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixCache as SGLangRadixCache
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self.torch, self.key = torch, RadixKey
        self.params = MatchPrefixParams, InsertParams
        self.tree = SGLangRadixCache.create_simulated(page_size=page_size)

    def match_prefix(self, tokens: list[int]) -> tuple[int, Any]:
        found = self.tree.match_prefix(self.params[0](key=self.key(tokens)))
        return len(found.device_indices), found.last_device_node

    def insert(self, tokens: list[int], values: list[int]) -> int:
        done = self.tree.insert(self.params[1](key=self.key(tokens),
                                               value=self.torch.tensor(values)))
        return done.prefix_len


def caches() -> list[tuple[str, Any]]:
    """(name, a maker of a fresh cache) for every cache compared; SGLang's where it imports."""
    out: list[tuple[str, Any]] = [("radix tree, page 1", RadixCache),
                                  ("radix tree, page 16", lambda: RadixCache(page_size=16)),
                                  ("blocks, page 1", lambda: BlockCache(1)),
                                  ("blocks, page 16", lambda: BlockCache(16))]
    try:
        SGLangTree(1)
    except ImportError as error:
        print(f"SGLang's tree left out: {error}")
    else:
        out += [(f"SGLang radix, page {p}", lambda p=p: SGLangTree(p)) for p in (1, 16)]
    return out


def serve(cache: Any, trace: list[tuple[list[int], list[int]]], desc: str,
          capacity: int | None = None) -> tuple[float, int]:
    """Seconds spent matching each prompt but its last token, and the tokens those matches
    hit, when every request then inserts prompt + output (slot ids as values), first
    evicting what a cache of ``capacity`` tokens must."""
    hit, seconds, slot = 0, 0.0, 0
    for prompt, output in tqdm(trace, desc=desc, mininterval=1.0):
        start = time.perf_counter()
        hit += cache.match_prefix(prompt[:-1])[0]
        seconds += time.perf_counter() - start
        full = prompt + output
        if capacity is not None and (over := cache.total_size() + len(full) - capacity) > 0:
            cache.evict(over)
        cache.insert(full, list(range(slot, slot + len(full))))
        slot += len(full)
    return seconds, hit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    trace = make_trace(args.requests, args.seed)
    tokens = sum(len(p) + len(o) for p, o in trace)
    print(f"trace: {len(trace)} requests, {tokens:,} prompt + output tokens")
    ops = 2 * len(trace)  # one match and one insert per request

    radix_s, radix_len = replay(RadixCache(), trace, "radix tree")
    naive_s, naive_len = replay(NaiveTrie(), trace, "naive trie")
    if radix_len != naive_len:
        raise SystemExit("match lengths differ between the radix tree and the naive trie")
    hit = sum(radix_len) / sum(len(p) for p, _ in trace)
    print(f"match lengths agree; unlimited-cache hit rate {hit:.1%}")
    print(f"radix tree : {ops / radix_s:>10,.0f} ops/s ({radix_s:.2f} s)")
    print(f"naive trie : {ops / naive_s:>10,.0f} ops/s ({naive_s:.2f} s)")
    print(f"ratio      : {naive_s / radix_s:.1f}x faster with the radix tree")

    capacity = 20_000
    evict_s, evict_len = replay(RadixCache(), trace, "radix + LRU", capacity=capacity)
    hit = sum(evict_len) / sum(len(p) for p, _ in trace)
    print(f"radix tree, capacity {capacity:,} tokens with LRU eviction: "
          f"{ops / evict_s:,.0f} ops/s, hit rate {hit:.1%}")

    prompts = sum(len(p) for p, _ in trace)
    print(f"\n{'cache':<22} {'matches/s':>10} {'hit tokens':>11} {'hit rate':>9} "
          f"{'at ' + format(capacity, ',') + ' tokens':>17}")
    for name, make in caches():
        seconds, hit_tokens = serve(make(), trace, name)
        small = "" if isinstance(make(), SGLangTree) else \
            f"{serve(make(), trace, f'{name}, {capacity:,}', capacity)[1] / prompts:.1%}"
        print(f"{name:<22} {len(trace) / seconds:>10,.0f} {hit_tokens:>11,} "
              f"{hit_tokens / prompts:>9.1%} {small:>17}")


if __name__ == "__main__":
    main()
