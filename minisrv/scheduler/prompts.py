"""The checks of ``Engine.generate``'s per-prompt arguments and of each request, at the
boundary.

A prompt is a non-empty list of token ids; ``max_new_tokens``, ``sampling`` and
``arrival_steps`` are one value for every prompt or one per prompt. Each bad value is a
``ValueError`` that names the prompt, before any request is queued. ``check_request``
refuses a request the scheduler could never serve (``Scheduler.check``), at submission.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from minisrv.checks import check_int, check_number, is_int
from minisrv.request import Req
from minisrv.sampling import SamplingParams

if TYPE_CHECKING:
    from minisrv.core import Backend
    from minisrv.scheduler.config import EngineConfig

__all__ = ["check_prompt", "check_request", "make_requests", "per_request", "per_request_arrivals",
           "per_request_params"]


def make_requests(prompts: Sequence[Sequence[int]], max_new_tokens: Any, sampling: Any,
                  arrival_steps: Sequence[float] | None, first_rid: int, now: float
                  ) -> list[Req]:
    """One checked ``Req`` per prompt (ids from ``first_rid``, arrivals from ``now``)."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts)}")
    n = len(prompts)
    clean = [check_prompt(i, p) for i, p in enumerate(prompts)]
    params = per_request_params(n, max_new_tokens, sampling)
    arrivals = per_request_arrivals(n, arrival_steps)
    return [Req(rid=first_rid + i, prompt=clean[i], params=params[i], arrival=now + arrivals[i])
            for i in range(n)]


def check_prompt(i: int, prompt: object) -> list[int]:
    if isinstance(prompt, str) or not isinstance(prompt, Sequence):
        raise ValueError(f"prompt {i} must be a list of token ids, got {type(prompt).__name__}")
    ids = list(prompt)
    if not ids:
        raise ValueError(f"prompt {i} is empty (encode at least <bos>)")
    if set(map(type, ids)) == {int}:  # the common case, checked in one C-level pass
        return ids
    for token in ids:
        if not is_int(token):
            raise ValueError(f"prompt {i} holds {token!r}, which is not a token id")
    return [int(token) for token in ids]


def per_request(n: int, name: str, value: Any) -> list[Any]:
    """``value`` repeated ``n`` times, or checked to hold exactly ``n`` entries."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def per_request_params(
    n: int,
    max_new_tokens: int | Sequence[int] | None,
    sampling: SamplingParams | Sequence[SamplingParams] | None,
) -> list[SamplingParams]:
    params = per_request(n, "sampling", sampling if sampling is not None else SamplingParams())
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling for prompt {i} must be a SamplingParams, got {p!r}")
    if max_new_tokens is None:
        return params
    lengths = per_request(n, "max_new_tokens", max_new_tokens)
    out = []
    for i, (p, m) in enumerate(zip(params, lengths, strict=True)):
        m = check_int(f"max_new_tokens for prompt {i}", m, minimum=1)
        out.append(p if p.max_new_tokens == m else replace(p, max_new_tokens=m))
    return out


def per_request_arrivals(n: int, arrival_steps: Sequence[float] | None) -> list[float]:
    if arrival_steps is None:
        return [0.0] * n
    if isinstance(arrival_steps, numbers.Real):
        raise ValueError("arrival_steps must hold one arrival per prompt")
    arrivals = per_request(n, "arrival_steps", arrival_steps)
    return [check_number(f"arrival_steps[{i}]", a, low=0.0) for i, a in enumerate(arrivals)]


def check_request(req: Req, config: EngineConfig, backend: Backend) -> None:
    """Raise ValueError if ``req`` could never be served under ``config`` by ``backend``.

    Checked at submission rather than at admission: a request that can never fit would
    otherwise sit at the head of the FCFS queue forever and block everyone behind it.
    """
    if not req.prompt:
        raise ValueError(f"request {req.rid}: the prompt is empty (it needs at least <bos>)")
    if not req.arrival >= 0:  # also rejects NaN
        raise ValueError(f"request {req.rid}: arrival must be >= 0, got {req.arrival}")
    if req.params.processed and config.overlap:
        raise ValueError(f"request {req.rid}: penalties, logit_bias and min_tokens read the "
                         "tokens so far, which the overlapped loop forms the next step "
                         "without; use overlap=False")
    limit = backend.max_context
    if limit is not None and req.kv_reservation > limit:
        raise ValueError(
            f"request {req.rid}: prompt of {req.prompt_len} tokens + max_new_tokens "
            f"{req.max_new_tokens} exceeds the model context of {limit} tokens"
        )
    vocab = backend.vocab_size
    if vocab is not None and not 0 <= min(req.prompt) <= max(req.prompt) < vocab:
        raise ValueError(
            f"request {req.rid}: prompt holds token ids outside the vocabulary (0..{vocab - 1})"
        )
    pages = -(-req.kv_reservation // config.page_size)  # a page is taken whole
    if pages > config.kv_capacity // config.page_size:
        raise ValueError(
            f"request {req.rid} needs {req.prompt_len} prompt + {req.max_new_tokens} new "
            f"= {req.kv_reservation} KV tokens but kv_capacity is {config.kv_capacity}: "
            "it could never be admitted"
        )
