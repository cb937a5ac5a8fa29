"""What a step hands the device: ``StepInputs``, built by ``ModelRunner.prepare`` (or, for a
batch holding speculative checks, by ``runner/speculative.py``'s ``prepare_checks``), and the
tokens an entry feeds (``entry_tokens``).

Both preparers build the same record from the same entries, so it lives here, below both,
rather than in the runner that one of them extends (the runner imports the checks' code; the
checks' code importing the runner back would be a cycle).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from minisrv.model.flat import FlatBatch
from minisrv.request import Req
from minisrv.runner.table_batch import TableBatch
from minisrv.sampling import SamplingParams

__all__ = ["StepInputs", "entry_tokens"]


class StepInputs(NamedTuple):
    """One step as the device reads it (``ModelRunner.prepare``)."""

    flat: FlatBatch | TableBatch | None  # ids (futures < 0), positions, write slots; None: padded
    metadata: Any  # the attention backend's, built before layer 0 (padded: a PaddedDecode)
    has_futures: bool  # some input id is a future id, to resolve on the device
    sample_rows: torch.Tensor  # rows of the flat batch whose logits are sampled
    samples: tuple[bool, ...]  # per entry: whether it samples a token
    reqs: list[Req]  # the sampling entries' requests (for the logits processors)
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    histories: list[tuple[list[int], list[int]]] | None  # for penalties (Sampler.histories)
    checks: Any = None  # speculative checks (runner.speculative.Checks); None: none


def entry_tokens(req: Req, start: int, end: int) -> list[int]:
    """``req``'s tokens ``start .. end - 1`` of prompt + output, without joining the two."""
    n = req.prompt_len
    if start >= n:
        return req.output[start - n:end - n]
    if end <= n:
        return req.prompt[start:end]
    return [*req.prompt[start:], *req.output[:end - n]]
