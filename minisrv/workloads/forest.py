"""Prefix forests: prompts that form a tree of shared prefixes, what cache-aware scheduling
is measured on.

A forest's shape (system prompts x example sets x questions) fixes how many of its tokens
are distinct, so ``optimal_hit_rate`` can be checked against the exact count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from minisrv.train.data import country_line, load_cities
from minisrv.workloads.mixes import Workload, check_workload_args

if TYPE_CHECKING:
    from minisrv.tokenizer import Tokenizer

__all__ = ["FOREST_SHAPE", "FOREST_LENGTHS", "prefix_forest_workload"]

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
