"""Prefix groups: requests whose prompts are a shared prefix of their group + their own question.

One generator builds them all (``group_workload``): the routing chapter's random-id groups
(long document prefixes drawn by popularity, Poisson arrivals), the RadixAttention chapter's
shared system prompt (one group) and few-shot groups (two example lines per group, in waves),
and the cache-aware chapter's interleaved few-shot groups whose headers hold an exact number
of tokens. They differ only in where the prefixes and questions come from and in which order
the groups' requests arrive, so those are the generator's arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from minisrv.checks import check_int
from minisrv.train.data import SHOWCASE_COUNTRIES, country_line, load_cities
from minisrv.workloads.mixes import (
    Workload,
    arrival_times,
    check_workload_args,
    output_lengths,
)
from minisrv.workloads.patterns import USER_COUNTRIES, system_prompt

if TYPE_CHECKING:
    from minisrv.tokenizer import Tokenizer

__all__ = [
    "group_workload",
    "wave_order",
    "group_popularity",
    "prefix_groups_workload",
    "shared_prompt_workload",
    "few_shot_workload",
    "few_shot_groups_workload",
]

Question = Callable[[int, int, int], list[int]]
"""``question(i, group, member)``: request ``i``'s own tokens after its group's prefix;
``member`` counts the group's earlier requests (0 for its first)."""


def group_workload(
    name: str,
    prefixes: Sequence[Sequence[int]],
    groups: Sequence[int],
    question: Question,
    output_lens: Sequence[int],
    arrivals: Sequence[float],
    description: str,
) -> Workload:
    """The prefix-group generator: request ``i`` (in arrival order) belongs to group
    ``groups[i]`` and its prompt is ``prefixes[groups[i]]`` followed by ``question(i, g, m)``.

    Requests of one group share exactly their prefix (and whatever their questions share),
    which is what a prefix cache can reuse and what a cache-aware router must keep together.
    """
    members = [0] * len(prefixes)
    prompts = []
    for i, group in enumerate(groups):
        prompts.append([*prefixes[group], *question(i, group, members[group])])
        members[group] += 1
    return Workload(name, prompts, list(output_lens), list(arrivals), description)


def wave_order(n_groups: int, per_group: int, interleave: bool) -> list[int]:
    """Each request's group when ``per_group`` requests of ``n_groups`` groups arrive in
    waves: group by group (all of group 0 first), or interleaved (one of each group per
    wave, in group order)."""
    if interleave:
        return [g for _ in range(per_group) for g in range(n_groups)]
    return [g for g in range(n_groups) for _ in range(per_group)]


def group_popularity(n_groups: int, hot_share: float | None = None) -> np.ndarray:
    """Probability of each prefix group: uniform, or group 0 drawing ``hot_share`` of all
    requests and the others splitting the rest evenly (one hot system prompt)."""
    if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1:
        raise ValueError(f"n_groups must be an int >= 1, got {n_groups!r}")
    if hot_share is None:
        return np.full(n_groups, 1.0 / n_groups)
    if not 0 <= hot_share <= 1 or (n_groups == 1 and hot_share != 1):
        raise ValueError(f"hot_share must be in [0, 1] (1 with a single group), got {hot_share}")
    if n_groups == 1:
        return np.ones(1)
    probs = np.full(n_groups, (1.0 - hot_share) / (n_groups - 1))
    probs[0] = hot_share
    return probs


def prefix_groups_workload(
    n: int = 4000,
    n_groups: int = 16,
    prefix_len: int = 2000,
    question_range: tuple[int, int] = (20, 60),
    mean_output: float = 100,
    output_cv: float = 1.0,
    max_output: int = 1000,
    rate: float = 100.0,
    arrival: str = "poisson",
    hot_share: float | None = None,
    vocab_size: int = 128256,
    seed: int = 0,
) -> Workload:
    """Requests from ``n_groups`` prefix groups: each prompt is its group's shared
    ``prefix_len``-token prefix (a system prompt, a document, few-shot examples) followed by
    its own question of ``question_range`` tokens (inclusive). A request's group is drawn
    from ``group_popularity(n_groups, hot_share)``; outputs and arrivals as in
    ``gpu_scale_workload``. The routing chapter's workload: with several workers, only a
    router that sends a group to the same worker lets that worker's cache keep the prefix.
    """
    low, high = question_range
    if not 1 <= low <= high:
        raise ValueError(f"question_range must satisfy 1 <= low <= high, got {question_range}")
    check_int("prefix_len", prefix_len, minimum=0)
    check_workload_args(n)
    probs = group_popularity(n_groups, hot_share)
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(2, vocab_size, size=(n_groups, prefix_len)).tolist()
    groups = rng.choice(n_groups, size=n, p=probs).tolist()
    question_lens = rng.integers(low, high + 1, size=n)
    outputs = output_lengths(n, mean_output, output_cv, max_output, rng)
    arrivals = arrival_times(n, rate, arrival, rng)
    tokens = rng.integers(2, vocab_size, size=int(question_lens.sum())).tolist()
    bounds = np.concatenate([[0], np.cumsum(question_lens)]).tolist()
    skew = "uniform" if hot_share is None else f"group 0 drawing {hot_share:.0%}"
    description = (
        f"{n} requests from {n_groups} groups ({skew}) of {prefix_len}-token prefixes + "
        f"{low}-{high}-token questions, outputs gamma(mean {mean_output:g}, cv {output_cv:g}), "
        f"{arrival} arrivals" + ("" if arrival == "all-at-once" else f" at {rate:g}/s")
        + f", seed {seed}"
    )
    return group_workload("prefix-groups", prefixes, groups,
                          lambda i, g, m: tokens[bounds[i]:bounds[i + 1]],
                          outputs, arrivals, description)


def _country_question(askable: Sequence[str], member: int) -> str:
    """The ``member``-th question of a group: a country code, then (once the codes run out)
    the same codes followed by 1 or 2 of their cities, so no two questions are equal."""
    code = askable[member % len(askable)]
    extra = (member // len(askable)) % 3
    return f"{code}:" if extra == 0 else country_line(code, extra) + ","


def _text_question(tok: Tokenizer, askable: Sequence[str]) -> Question:
    """``question`` for text groups: the member's country question, without ``<bos>``."""
    return lambda i, g, m: tok.encode(_country_question(askable, m), bos=False)


def shared_prompt_workload(
    tok: Tokenizer, n_users: int = 16, output_len: int = 16, arrival_every: float = 1.0,
    n_cities: int = 3,
) -> Workload:
    """Many users, one system prompt: the three-country few-shot header of
    ``system_prompt``, then each user's own question (a country code, followed by
    0-2 of its cities once the codes run out, so no two prompts are equal). One group.
    """
    check_workload_args(n_users, output_len, arrival_every)
    head = tok.encode(system_prompt(n_cities))
    return group_workload("shared-prompt", [head], [0] * n_users,
                          _text_question(tok, USER_COUNTRIES), [output_len] * n_users,
                          [i * arrival_every for i in range(n_users)],
                          f"{n_users} users sharing a {len(head)}-token system prompt")


def few_shot_workload(
    tok: Tokenizer, n_groups: int = 4, per_group: int = 8, output_len: int = 16,
    group_gap: float = 0.0, interleave: bool = False, n_cities: int = 3,
) -> Workload:
    """Few-shot prompting: each group's requests share the same two example lines and ask
    different countries. Requests come in waves ``group_gap`` steps apart: by default a wave
    is one whole group (its requests arrive together); with ``interleave`` a wave holds one
    request of every group, so the groups alternate.
    """
    check_workload_args(n_groups)
    check_workload_args(per_group, output_len, max(group_gap, 1.0))
    codes = SHOWCASE_COUNTRIES
    shots = [(codes[(2 * g) % len(codes)], codes[(2 * g + 1) % len(codes)])
             for g in range(n_groups)]
    heads = [tok.encode("".join(country_line(code, n_cities) + "\n" for code in pair))
             for pair in shots]
    questions = [_text_question(tok, [c for c in codes if c not in pair]) for pair in shots]
    groups = wave_order(n_groups, per_group, interleave)
    waves = [i // n_groups if interleave else i // per_group for i in range(len(groups))]
    order = "interleaved" if interleave else "group by group"
    return group_workload("few-shot", heads, groups, lambda i, g, m: questions[g](i, g, m),
                          [output_len] * len(groups), [float(w) * group_gap for w in waves],
                          f"{n_groups} few-shot groups x {per_group} requests, {order}")


def few_shot_groups_workload(
    tok: Tokenizer, n_groups: int = 4, per_group: int = 8, prefix_tokens: int = 164,
    output_len: int = 16, arrival_every: float = 1.0, seed: int = 0,
) -> Workload:
    """``n_groups`` few-shot groups arriving interleaved, their headers ``prefix_tokens``
    distinct tokens in all (``<bos>`` included; the lecture: 4 groups, 164 tokens).

    Group ``g``'s header is two complete example lines of showcase countries, chosen so the
    headers split ``prefix_tokens - 1`` as evenly as possible; groups start with different
    letters, so their headers share only ``<bos>``. Questions ask other countries (a code,
    then 0-2 of its cities once the codes run out). Wave ``m`` (one request of each group,
    in group order) arrives at step ``m * arrival_every``.
    """
    check_workload_args(n_groups)
    check_workload_args(per_group, output_len, arrival_every)
    rng = np.random.default_rng(seed)
    chars = prefix_tokens - 1
    targets = [chars // n_groups + (g < chars % n_groups) for g in range(n_groups)]
    used: set[str] = set()
    headers: list[str] = []
    for target in targets:
        shots = _pick_example_pair(target, used, rng)
        used.update(code for code, _ in shots)
        used.update(c for c in SHOWCASE_COUNTRIES if c[0] == shots[0][0][0])  # first letter
        headers.append("".join(country_line(c, k) + "\n" for c, k in shots))
    questions = [_text_question(tok, [c for c in SHOWCASE_COUNTRIES if c + ":" not in header])
                 for header in headers]
    groups = wave_order(n_groups, per_group, interleave=True)
    return group_workload("few-shot-groups", [tok.encode(h) for h in headers], groups,
                          lambda i, g, m: questions[g](i, g, m), [output_len] * len(groups),
                          [float(i // max(n_groups, 1)) * arrival_every
                           for i in range(len(groups))],
                          f"{n_groups} few-shot groups x {per_group}, interleaved, headers "
                          f"{prefix_tokens} tokens in all")


def _pick_example_pair(target: int, used: set[str], rng: np.random.Generator
                       ) -> tuple[tuple[str, int], tuple[str, int]]:
    """Two unused showcase countries and city counts whose lines (each + newline) are
    exactly ``target`` characters; seeded choice among all that fit."""
    table = load_cities()
    lines = [(c, k, len(country_line(c, k)) + 1) for c in SHOWCASE_COUNTRIES if c not in used
             for k in range(1, len(table[c]) + 1)]
    fits = [(a[:2], b[:2]) for a in lines for b in lines
            if a[0] != b[0] and a[2] + b[2] == target]
    if not fits:
        raise ValueError(f"no two unused example lines make a {target}-token header; "
                         "use fewer groups or a prefix_tokens nearer 30-200 per group")
    return fits[int(rng.integers(len(fits)))]
