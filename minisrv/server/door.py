"""Checks at the door: everything an engine step could choke on is refused here, with a 400.

A request reaches an engine only once its prompt ids are in the vocabulary, its prompt and
reply fit the context and the KV pool, and its sampling parameters are ones the sampler
takes (a seed ``torch.Generator`` accepts, a finite temperature). So a bad request never
fails a step, and never fails the other requests sharing that step. Messages are bounded:
the first few offending positions and a count, however large the prompt.

Tokenizing a long text takes real time, so ``prompts_off_loop`` does it in a thread for
anything longer than ``INLINE_CHARS``, and the event loop keeps answering others meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, TypeVar

from minisrv.sampling import SamplingParams
from minisrv.server.protocol import UNSUPPORTED, unsupported_field
from minisrv.tokenizer import bounded_list

__all__ = ["INLINE_CHARS", "BadRequest", "chat_messages", "check_fits", "check_supported",
           "completion_prompts", "logit_bias", "off_loop", "room", "sampling_params"]

INLINE_CHARS = 4096  # texts up to this long are tokenized on the event loop (microseconds)

T = TypeVar("T")


class BadRequest(ValueError):
    """A request the server refuses; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, in a worker thread when ``size`` (characters) is above INLINE_CHARS."""
    if size > INLINE_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def check_supported(body: Any) -> None:
    """BadRequest for a field minisrv cannot honour (``protocol.UNSUPPORTED``)."""
    name = unsupported_field(body)
    if name is not None:
        raise BadRequest(UNSUPPORTED[name], name)
    if getattr(body, "echo", False) and body.top_logprobs_wanted is not None:
        raise BadRequest("echo with logprobs (the prompt's logprobs) is not supported; ask "
                         "for one or the other", "echo")


def logit_bias(body: Any, vocab: int | None) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as ``(id, bias)`` pairs; BadRequest for a key that is not a token id
    of the vocabulary or a bias outside [-100, 100] (OpenAI's range)."""
    pairs = []
    for key, bias in (body.logit_bias or {}).items():
        if not key.strip().isdigit() or (vocab is not None and int(key) >= vocab):
            raise BadRequest(f"logit_bias keys must be token ids in 0..{(vocab or 1) - 1}, "
                             f"got {key[:20]!r}", "logit_bias")
        if not -100 <= bias <= 100:
            raise BadRequest(f"logit_bias values must be in [-100, 100], got {bias}",
                             "logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def completion_prompts(codec: Any, prompt: Any) -> tuple[list[list[int]], list[str]]:
    """Token prompts (and their texts, for ``echo``) from any form ``prompt`` may take."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise BadRequest("prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    out, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise BadRequest("prompt is empty", "prompt")
            try:
                out.append(codec.encode(p))
            except ValueError as exc:
                raise BadRequest(str(exc), "prompt") from exc
            texts.append(p)
        else:
            if not p:
                raise BadRequest("prompt is an empty list of token ids", "prompt")
            out.append(list(p))
            texts.append("")  # decoded only if echoed, once the ids are known to be valid
    return out, texts


def chat_messages(body: Any) -> list[dict[str, str]]:
    """The chat's messages as plain ``{"role", "content"}`` dicts (text parts joined)."""
    try:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    except ValueError as exc:
        raise BadRequest(str(exc), "messages") from exc
    if not any(m["content"] for m in messages):
        raise BadRequest("the messages hold no text", "messages")
    return messages


def check_fits(prompt: list[int], max_tokens: int, limits: dict[str, Any]) -> None:
    """BadRequest unless every id is in the vocabulary and prompt + reply fit the context
    and the pool (the engine checks the same; here it costs no engine a thing)."""
    vocab = limits.get("vocab_size")
    if vocab is not None and not 0 <= min(prompt) <= max(prompt) < vocab:
        bad = ((pos, t) for pos, t in enumerate(prompt) if not 0 <= t < vocab)
        raise BadRequest(f"prompt holds token ids outside the vocabulary (0..{vocab - 1}): "
                         f"{bounded_list(f'{t} at position {pos}' for pos, t in bad)}",
                         "prompt")
    need = len(prompt) + max_tokens
    context = limits.get("max_context")
    if context is not None and need > context:
        raise BadRequest(f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} exceeds "
                         f"the model context of {context} tokens", "max_tokens")
    pool = limits.get("kv_capacity")
    if pool is not None and need > pool:
        raise BadRequest(f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} = {need} "
                         f"KV tokens exceeds the KV pool (kv_capacity) of {pool} tokens",
                         "max_tokens")


def room(limits: dict[str, Any], prompt: list[int]) -> int:
    """The reply length where none is given: up to the end of the context (as OpenAI's API
    allows), or of the pool if it is smaller. ``ServerConfig`` sizes the pool so that such
    requests do not throttle the batch (see ``minisrv.server.config``)."""
    bound = min(limits.get("max_context") or 1 << 30, limits.get("kv_capacity") or 1 << 30)
    return max(1, bound - len(prompt))  # a prompt that fills it all fails ``check_fits``


def sampling_params(body: Any, max_tokens: int, j: int,
                    vocab: int | None = None) -> SamplingParams:
    """The engine's ``SamplingParams`` for choice ``j`` of a request (seed + j, so that the
    ``n`` samples of one seeded request differ from each other and still repeat)."""
    temperature = body.temperature
    if body.top_k not in (None, -1, 0):
        if body.top_k != 1:
            raise BadRequest(f"top_k={body.top_k} is not supported: minisrv samples with "
                             "temperature and top_p; use top_k -1 or 0 (off) or 1 (greedy)",
                             "top_k")
        temperature = 0.0  # the single most likely token: greedy
    seed = None if body.seed is None else body.seed + j
    extras: dict[str, Any] = {}
    if hasattr(body, "min_tokens"):  # the processors and logprobs (an OpenAI body)
        if body.min_tokens > max_tokens:
            raise BadRequest(f"min_tokens {body.min_tokens} is more than max_tokens "
                             f"{max_tokens}", "min_tokens")
        extras = dict(presence_penalty=body.presence_penalty,
                      frequency_penalty=body.frequency_penalty,
                      repetition_penalty=body.repetition_penalty,
                      logit_bias=logit_bias(body, vocab), min_tokens=body.min_tokens,
                      logprobs=body.top_logprobs_wanted)
    extras.update(grammar_fields(body))
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=temperature,
                              top_p=body.top_p, seed=seed, ignore_eos=body.ignore_eos,
                              **extras)
    except ValueError as exc:
        raise BadRequest(str(exc), "seed" if "seed" in str(exc) else None) from exc


def grammar_fields(body: Any) -> dict[str, str]:
    """The grammar a body asks for, as ``SamplingParams`` fields: OpenAI's ``response_format``
    (``json_object``: any JSON object; ``json_schema``: its ``schema``) or SGLang's ``regex`` /
    ``ebnf``. A schema is enforced whether ``json_schema.strict`` is true or false, as in SGLang
    0.5.23 unless its chat template hands the format to the model (which minisrv's never does).
    The engine compiles it when the request reaches it (cached by text), so an invalid
    grammar, or one the model's vocabulary cannot spell, is a 400 there."""
    fields: dict[str, str] = {}
    fmt = getattr(body, "response_format", None)
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            fields["json_schema"] = '{"type": "object"}'
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise BadRequest("response_format json_schema needs a json_schema.schema object",
                                 "response_format")
            strict = spec.get("strict")
            if strict is not None and not isinstance(strict, bool):  # OpenAI's wire type
                raise BadRequest("response_format json_schema.strict must be true or false, "
                                 f"got {strict!r}", "response_format")
            fields["json_schema"] = json.dumps(schema, sort_keys=True)
        elif kind != "text":
            raise BadRequest("response_format type must be text, json_object or json_schema, "
                             f"got {kind!r}", "response_format")
    for name in ("regex", "ebnf"):
        if getattr(body, name, None) is not None:
            fields[name] = getattr(body, name)
    if len(fields) > 1:
        raise BadRequest(f"give one grammar, got {sorted(fields)}", "response_format")
    return fields
