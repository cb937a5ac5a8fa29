"""Workloads whose prompts share prefixes: what the prefix cache and cache-aware scheduling
are measured on.

The four serving patterns of the RadixAttention chapter (a shared system prompt, multi-turn
chat, few-shot groups, parallel sampling) as CityLM text, and the synthetic prefix forests
and interleaved few-shot groups of the cache-aware scheduling chapter, whose distinct-token
counts are known exactly so the optimal hit rate can be checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from minisrv.workloads import Workload, check_workload_args

if TYPE_CHECKING:
    from minisrv.tokenizer import Tokenizer

__all__ = [
    "PREFIX_WORKLOADS",
    "FOREST_SHAPE",
    "FOREST_LENGTHS",
    "shared_prompt_workload",
    "chat_sessions_workload",
    "few_shot_workload",
    "parallel_sampling_workload",
    "prefix_forest_workload",
    "few_shot_groups_workload",
]

PREFIX_WORKLOADS: tuple[str, ...] = (
    "shared-prompt", "chat-sessions", "few-shot", "parallel-sampling")


def shared_prompt_workload(
    tok: Tokenizer, n_users: int = 16, output_len: int = 16, arrival_every: float = 1.0,
    n_cities: int = 3,
) -> Workload:
    """Many users, one system prompt: the three-country few-shot header of
    ``patterns.system_prompt``, then each user's own question (a country code, followed by
    0-2 of its cities once the codes run out, so no two prompts are equal).
    """
    from minisrv.data import country_line
    from minisrv.patterns import USER_COUNTRIES, system_prompt

    check_workload_args(n_users, output_len, arrival_every)
    head = system_prompt(n_cities)
    prompts = []
    for i in range(n_users):
        code = USER_COUNTRIES[i % len(USER_COUNTRIES)]
        extra = (i // len(USER_COUNTRIES)) % 3
        question = f"{code}:" if extra == 0 else country_line(code, extra) + ","
        prompts.append(tok.encode(head + question))
    arrivals = [i * arrival_every for i in range(n_users)]
    return Workload("shared-prompt", prompts, [output_len] * n_users, arrivals,
                    f"{n_users} users sharing a {len(tok.encode(head))}-token system prompt")


def chat_sessions_workload(
    model, tok: Tokenizer, n_sessions: int = 8, n_turns: int = 4, max_answer_tokens: int = 10,
    turn_gap: float = 48.0, message_cities: int = 1,
) -> Workload:
    """``n_sessions`` independent chats of ``n_turns`` turns: turn ``t``'s prompt is turn
    ``t - 1``'s prompt + its answer + the user's new message.

    A message is one more example line (a country and ``message_cities`` of its cities; none
    when 0) and a question (a country code). Session ``s`` opens with its own line, so
    sessions share nothing but ``<bos>`` and all reuse comes from a session's own history.
    Answers are CityLM's greedy continuation (``model.reference_generate``), kept up to the
    last complete city and a newline, as in ``patterns.chat_turns``; a request's
    ``max_new_tokens`` is its answer's length. Every
    session's turn ``t`` arrives at step ``t * turn_gap``; request ``i`` is turn
    ``i // n_sessions`` of session ``i % n_sessions``.
    """
    from minisrv.data import SHOWCASE_COUNTRIES, country_line
    from minisrv.patterns import _complete_line

    check_workload_args(n_sessions)
    check_workload_args(n_turns, max_answer_tokens, turn_gap)
    if message_cities < 0:
        raise ValueError(f"message_cities must be >= 0, got {message_cities}")
    codes = SHOWCASE_COUNTRIES
    histories = [tok.encode(country_line(codes[s % len(codes)], 1) + "\n")
                 for s in range(n_sessions)]
    prompts: list[list[int]] = []
    outputs: list[int] = []
    arrivals: list[float] = []
    for turn in range(n_turns):
        for s in range(n_sessions):
            example = codes[(s + 1 + 3 * turn) % len(codes)]
            code = codes[(s + 2 + 3 * turn) % len(codes)]
            line = country_line(example, message_cities) + "\n" if message_cities else ""
            prompt = histories[s] + tok.encode(f"{line}{code}:", bos=False)
            generated = model.reference_generate(prompt, max_answer_tokens)
            finished = bool(generated) and generated[-1] == tok.eos_id
            answer = tok.encode(_complete_line(tok.decode(generated), finished), bos=False)
            prompts.append(prompt)
            outputs.append(len(answer))
            arrivals.append(turn * turn_gap)
            histories[s] = prompt + answer
    return Workload("chat-sessions", prompts, outputs, arrivals,
                    f"{n_sessions} chat sessions x {n_turns} turns")


def few_shot_workload(
    tok: Tokenizer, n_groups: int = 4, per_group: int = 8, output_len: int = 16,
    group_gap: float = 0.0, interleave: bool = False, n_cities: int = 3,
) -> Workload:
    """Few-shot prompting: each group's requests share the same two example lines and ask
    different countries. Requests come in waves ``group_gap`` steps apart: by default a wave
    is one whole group (its requests arrive together); with ``interleave`` a wave holds one
    request of every group, so the groups alternate.
    """
    from minisrv.data import SHOWCASE_COUNTRIES, country_line

    check_workload_args(n_groups)
    check_workload_args(per_group, output_len, max(group_gap, 1.0))
    codes = SHOWCASE_COUNTRIES
    rows: list[tuple[int, int, list[int]]] = []  # (group, member, prompt)
    for g in range(n_groups):
        shots = (codes[(2 * g) % len(codes)], codes[(2 * g + 1) % len(codes)])
        head = "".join(country_line(code, n_cities) + "\n" for code in shots)
        askable = [c for c in codes if c not in shots]
        for m in range(per_group):
            code = askable[m % len(askable)]
            extra = (m // len(askable)) % 3
            question = f"{code}:" if extra == 0 else country_line(code, extra) + ","
            rows.append((g, m, tok.encode(head + question)))
    if interleave:
        rows.sort(key=lambda row: (row[1], row[0]))
    prompts = [row[2] for row in rows]
    arrivals = [float(row[1] if interleave else row[0]) * group_gap for row in rows]
    order = "interleaved" if interleave else "group by group"
    return Workload("few-shot", prompts, [output_len] * len(rows), arrivals,
                    f"{n_groups} few-shot groups x {per_group} requests, {order}")


def parallel_sampling_workload(
    tok: Tokenizer, n_samples: int = 8, question: str = "JP:", output_len: int = 16,
) -> Workload:
    """One prompt (system prompt + ``question``) sent ``n_samples`` times at once, as when
    sampling several answers to pick the best."""
    from minisrv.patterns import parallel_samples

    check_workload_args(n_samples, output_len, 1.0)
    prompts = parallel_samples(tok, n_samples, question) if n_samples else []
    return Workload("parallel-sampling", prompts, [output_len] * n_samples, [0.0] * n_samples,
                    f"one prompt sampled {n_samples} times")


# ------------------------------------------------------------------------------------------
# Cache-aware scheduling: prefix forests and interleaved few-shot groups.

FOREST_SHAPE = (4, 4, 8)  # the lecture's forest: system prompts x example sets x questions
FOREST_LENGTHS = (59, 9, 12)  # tokens per level; 80 a request, 1,916 distinct of 10,240


def prefix_forest_workload(
    shape: Sequence[int] = FOREST_SHAPE, lengths: Sequence[int] = FOREST_LENGTHS,
    tok: Tokenizer | None = None, vocab_size: int = 32000, output_len: int = 16,
    arrival_every: float = 0.0, shuffle: bool = True, seed: int = 0,
) -> Workload:
    """A prefix tree of prompts: e.g. system prompts x example sets x questions.

    ``shape[d]`` nodes hang below each node of level ``d - 1``, each adding ``lengths[d]``
    tokens, and every leaf path is one prompt (``prod(shape)`` prompts of ``sum(lengths)``
    tokens). Siblings differ in their first token, so the tree holds exactly
    ``sum(prod(shape[:d+1]) * lengths[d])`` distinct tokens: the shape alone fixes
    ``optimal_hit_rate``. Tokens are random ids in ``[2, vocab_size)`` or, with ``tok``,
    CityLM text (country lines cut to length, siblings starting with different letters);
    text prompts start with ``<bos>``, which all share, so ``shape[0] - 1`` fewer are
    distinct. ``shuffle`` puts requests in a seeded random order, so
    arrival order is not already depth-first; request ``i`` arrives at ``i * arrival_every``.
    """
    if len(shape) != len(lengths) or not shape:
        raise ValueError(f"shape {tuple(shape)} and lengths {tuple(lengths)} need the same "
                         "number (>= 1) of levels")
    if min(shape) < 1 or min(lengths) < 1 + (tok is not None) or (
            tok is not None and len(lengths) > 1 and lengths[0] < 3):
        raise ValueError(f"every level needs >= 1 node and >= 1 token (with text: >= 2, and "
                         f"3 on a first level that has <bos> and a newline); got shape "
                         f"{tuple(shape)}, lengths {tuple(lengths)}")
    check_workload_args(0, output_len, arrival_every)
    rng = np.random.default_rng(seed)
    make = _text_segments if tok is not None else _id_segments
    paths: list[list[int]] = [[]]
    for depth, (width, length) in enumerate(zip(shape, lengths)):
        level = (depth == 0, depth == len(shape) - 1)
        paths = [path + seg for path in paths
                 for seg in make(rng, width, length, level, tok, vocab_size)]
    if shuffle:
        paths = [paths[i] for i in rng.permutation(len(paths))]
    n = len(paths)
    kind = "CityLM text" if tok is not None else "random ids"
    return Workload("prefix-forest", paths, [output_len] * n,
                    [i * arrival_every for i in range(n)],
                    f"prefix forest {' x '.join(map(str, shape))}, levels of "
                    f"{'/'.join(map(str, lengths))} tokens, {kind}, seed {seed}")


def _id_segments(rng: np.random.Generator, width: int, length: int, level: tuple[bool, bool],
                 tok: Tokenizer | None, vocab_size: int) -> list[list[int]]:
    """``width`` random runs of ``length`` ids whose first ids differ."""
    if width > vocab_size - 2:
        raise ValueError(f"{width} siblings need distinct first ids; vocab_size {vocab_size} "
                         "is too small")
    heads = rng.choice(np.arange(2, vocab_size), size=width, replace=False)
    tails = rng.integers(2, vocab_size, size=(width, length - 1))
    return [[int(h), *map(int, t)] for h, t in zip(heads, tails)]


def _text_segments(rng: np.random.Generator, width: int, length: int, level: tuple[bool, bool],
                   tok: Tokenizer | None, vocab_size: int) -> list[list[int]]:
    """``width`` runs of country lines cut to ``length`` tokens, starting with different
    letters; a first-level run starts with ``<bos>``, all but last-level runs end with a
    newline (so the next level starts a line)."""
    from minisrv.data import country_line, load_cities

    assert tok is not None
    codes = sorted(load_cities())
    letters = sorted({code[0] for code in codes})
    if width > len(letters):
        raise ValueError(f"text siblings must start with different letters; at most "
                         f"{len(letters)}, got {width}")
    first, last = level
    chars = length - (1 if first else 0) - (0 if last else 1)
    out = []
    for letter in rng.choice(letters, size=width, replace=False):
        lead = [c for c in codes if c[0] == letter]
        order = [lead[rng.integers(len(lead))], *rng.permutation(codes)]
        text = ""
        for code in order:
            text += country_line(str(code)) + "\n"
            if len(text) >= chars:
                break
        out.append(tok.encode(text[:chars] + ("" if last else "\n"), bos=first))
    return out


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
    from minisrv.data import SHOWCASE_COUNTRIES, country_line

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
    prompts = []
    for m in range(per_group):
        for header in headers:
            askable = [c for c in SHOWCASE_COUNTRIES if c + ":" not in header]
            code = askable[m % len(askable)]
            extra = (m // len(askable)) % 3
            question = f"{code}:" if extra == 0 else country_line(code, extra) + ","
            prompts.append(tok.encode(header + question))
    n = len(prompts)
    return Workload("few-shot-groups", prompts, [output_len] * n,
                    [float(i // max(n_groups, 1)) * arrival_every for i in range(n)],
                    f"{n_groups} few-shot groups x {per_group}, interleaved, headers "
                    f"{prefix_tokens} tokens in all")


def _pick_example_pair(target: int, used: set[str], rng: np.random.Generator
                       ) -> tuple[tuple[str, int], tuple[str, int]]:
    """Two unused showcase countries and city counts whose lines (each + newline) are
    exactly ``target`` characters; seeded choice among all that fit."""
    from minisrv.data import SHOWCASE_COUNTRIES, country_line, load_cities

    table = load_cities()
    lines = [(c, k, len(country_line(c, k)) + 1) for c in SHOWCASE_COUNTRIES if c not in used
             for k in range(1, len(table[c]) + 1)]
    fits = [(a[:2], b[:2]) for a in lines for b in lines
            if a[0] != b[0] and a[2] + b[2] == target]
    if not fits:
        raise ValueError(f"no two unused example lines make a {target}-token header; "
                         "use fewer groups or a prefix_tokens nearer 30-200 per group")
    return fits[int(rng.integers(len(fits)))]
