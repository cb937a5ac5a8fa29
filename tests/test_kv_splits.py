"""The split-KV decode kernel's piece count, importable where triton is not.

Chapter 09 counts the programs the kernel launches from ``kv_splits``; the Colab check runs
it on a CPU-only torch, which ships no triton, so the count must not import it.
"""

from __future__ import annotations

import ast
import inspect

import torch

from minisrv.runner.attention import splits
from minisrv.runner.attention.splits import DEFAULT_MAX_SPLITS, SPLIT_TOKENS, kv_splits


def test_pieces_are_one_per_256_context_tokens_from_1_to_the_cap() -> None:
    contexts = torch.tensor([1, SPLIT_TOKENS, SPLIT_TOKENS + 1, 2048, 100_000])
    assert kv_splits(contexts).tolist() == [1, 1, 2, 8, DEFAULT_MAX_SPLITS]
    assert kv_splits(contexts, max_splits=3).tolist() == [1, 1, 2, 3, 3]
    assert kv_splits(contexts).dtype == torch.int32


def test_the_count_imports_no_triton() -> None:
    tree = ast.parse(inspect.getsource(splits))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported == {"__future__", "torch"}
