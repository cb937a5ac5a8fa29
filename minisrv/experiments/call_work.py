"""What each attention call computes and copies for one step, counted from the requests'
lengths alone (the GPU appendix's work table and its step-mix explorer).

A step is a list of ``(cached, new)`` per request, prefills first as the scheduler lists
them. Per head and layer, each call is counted by what sets its cost on a GPU:

* the padded call (``minisrv.runner.attention.padded``): its groups (decodes apart from
  prefills, ``group_bounds``), each padded to its longest new-token run and longest context;
  it computes every padded score and copies every padded key;
* the ragged call (``flex_attention`` over the block mask of ``ragged_tiles``): every tile it
  touches is computed whole (128 x 128 scores); it copies each request's keys once; and
  each query tile's programs walk its key tiles one after another, so the query tile that
  walks the most sets the time (the appendix's recorded ragged decode steps followed it);
* the hybrid (``minisrv.runner.attention.hybrid``): the prefills' ragged call plus the
  decodes' padded call.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from minisrv.model.attention_metadata import group_bounds
from minisrv.model.ragged import FLEX_BLOCK_SIZE, ragged_tiles

__all__ = ["CallWork", "attention_work", "hybrid_work", "ms_per_key_tile", "needed_work",
           "padded_work", "ragged_work"]

Step = Sequence[tuple[int, int]]  # (cached, new) per request


class CallWork(NamedTuple):
    """One call's work on a step, per head and layer."""

    scores: int  # query x key pairs computed
    keys: int  # keys copied out of the pool before attending
    walk: int  # key tiles the busiest query tile walks in turn (0: not a tiled call)

    def __add__(self, other: tuple[int, ...]) -> CallWork:  # type: ignore[override]
        """Two calls of one step: their scores and keys add up, and they run one after the
        other, so their walks add up too."""
        return CallWork(*(a + b for a, b in zip(self, other, strict=True)))


NO_WORK = CallWork(0, 0, 0)


def needed_work(step: Step) -> CallWork:
    """What the requests need: each new token's scores against its own visible keys, and
    every key once (what the ragged call copies); no tiles walked."""
    return CallWork(sum(n * c + n * (n + 1) // 2 for c, n in step),
                    sum(c + n for c, n in step), 0)


def padded_work(step: Step) -> CallWork:
    """The padded call's groups, each padded to its longest new-token run and context."""
    new = [n for _, n in step]
    ends = [c + n for c, n in step]
    scores = keys = 0
    for lo, hi in itertools.pairwise(group_bounds(new) if step else [0]):
        s_max = max(ends[lo:hi])
        scores += (hi - lo) * max(new[lo:hi]) * s_max
        keys += (hi - lo) * s_max
    return CallWork(scores, keys, 0)


def ragged_work(step: Step, tile: int = FLEX_BLOCK_SIZE) -> CallWork:
    """The ragged call's touched tiles, every key once, and its busiest query tile's walk."""
    if not step:
        return NO_WORK
    partial, full = ragged_tiles([n for _, n in step], [c for c, _ in step], tile)
    touched = partial | full
    return CallWork(int(touched.sum()) * tile * tile, sum(c + n for c, n in step),
                    int(touched.sum(1).max()))


def hybrid_work(step: Step, tile: int = FLEX_BLOCK_SIZE) -> CallWork:
    """The prefills through the ragged call, the decodes (one new token) through the padded."""
    return (ragged_work([r for r in step if r[1] > 1], tile)
            + padded_work([r for r in step if r[1] == 1]))


def attention_work(step: Step, tile: int = FLEX_BLOCK_SIZE) -> dict[str, int]:
    """The work table's column for ``step``: each call's scores, keys copied and walk, and
    the scores and keys the requests need."""
    calls = {"padded groups": padded_work(step), "ragged tiles": ragged_work(step, tile),
             "hybrid": hybrid_work(step, tile)}
    needed = needed_work(step)
    return {**{f"scores, {name}": work.scores for name, work in calls.items()},
            "scores needed": needed.scores,
            "keys needed": needed.keys,  # all copied by the ragged call
            **{f"keys copied, {name}": work.keys for name, work in calls.items()
               if name != "ragged tiles"},
            "key tiles walked, ragged call": calls["ragged tiles"].walk,
            "key tiles walked, hybrid": calls["hybrid"].walk}


def ms_per_key_tile(ragged_ms: Mapping[int, float], context: int,
                    batches: Sequence[int] = (32, 64, 128)) -> float:
    """A key tile's cost in a recorded sweep of ragged decode steps (batch -> ms, every
    request at ``context``): the least-squares slope through 0 of the step's time against
    its busiest walk, over ``batches``, each one query tile whose walk sets the step (above
    the host's floor of the smaller batches)."""
    walks = {b: ragged_work([(context, 1)] * b).walk for b in batches}
    return (sum(ragged_ms[b] * walks[b] for b in batches)
            / sum(walk * walk for walk in walks.values()))
