"""The OpenAI wire format: request bodies, response bodies, stream chunks and errors.

Requests are validated by pydantic before anything reaches the engine, so a body with a
field of the wrong type is answered with HTTP 400 and never disturbs the running batch.
Field names and defaults follow OpenAI's API as SGLang and vLLM serve it (``max_tokens``
16 for completions, ``temperature`` 1.0, ``n`` 1); fields we do not know are ignored, as
those servers do, except the ones a client relies on and minisrv cannot honour yet
(``UNSUPPORTED``: ``best_of``, ``suffix``, ``tools``),
which are a 400, never silently dropped. ``ignore_eos``, ``min_tokens`` and
``repetition_penalty`` are the SGLang/vLLM extensions. A chat message's ``content`` is a
string or a list of text parts (``{"type": "text", "text": ...}``), joined in order.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

__all__ = [
    "MAX_TOP_LOGPROBS",
    "UNSUPPORTED",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ContentPart",
    "StreamOptions",
    "error_body",
    "new_id",
]

MAX_TOP_LOGPROBS = 20  # OpenAI's cap on top_logprobs (and on completions' logprobs)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampling(_Body):
    """The fields both endpoints share."""

    model: StrictStr | None = None
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = Field(1, ge=1, le=128)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    min_tokens: StrictInt = Field(0, ge=0)
    # Structured output: OpenAI's response_format, and SGLang's extra fields.
    response_format: Any = None
    regex: str | None = None
    ebnf: str | None = None
    # Refused when set (see UNSUPPORTED); declared so that a value is seen, not dropped.
    best_of: StrictInt | None = None
    suffix: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None

    def stop_strings(self) -> list[str]:
        """``stop`` as a list without empty strings (an empty stop would end at once)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a text prompt, a list of token ids, or a batch of either."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def top_logprobs_wanted(self) -> int | None:
        """Alternatives per token (None: no logprobs at all)."""
        return self.logprobs


class ContentPart(_Body):
    """One part of a chat message's content; only text parts are served."""

    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[ContentPart] | None = None

    def text(self) -> str:
        """The content as one string (text parts joined); ValueError for other parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        kinds = sorted({part.type for part in self.content if part.type != "text"})
        if kinds:
            raise ValueError(f"content parts of type {', '.join(map(repr, kinds))} are not "
                             "supported; minisrv serves text parts only")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is the newer name."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def top_logprobs_wanted(self) -> int | None:
        """Alternatives per token (None: no logprobs at all)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def new_id(prefix: str) -> str:
    """A response id in OpenAI's style, e.g. ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """``created`` timestamps are whole seconds since the epoch."""
    return int(time.time())


def error_body(message: str, param: str | None = None, code: int = 400,
               kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


UNSUPPORTED: dict[str, str] = {
    "best_of": "best_of is not supported; use n and pick on the client",
    "suffix": "suffix (insertion) is not supported by minisrv",
    "tools": "tools (function calling) are not supported by minisrv",
    "tool_choice": "tool_choice (function calling) is not supported by minisrv",
    "functions": "functions (function calling) are not supported by minisrv",
    "function_call": "function_call (function calling) is not supported by minisrv",
}
"""The fields a client relies on that minisrv cannot honour yet, and the 400's message."""


def unsupported_field(body: Any) -> str | None:
    """The first field of ``body`` set to something minisrv cannot honour, or None."""
    for name in UNSUPPORTED:
        value = getattr(body, name, None)
        if value is None or (name == "best_of" and value == 1):
            continue
        if name in ("tools", "functions") and value == []:
            continue
        if name in ("tool_choice", "function_call") and value in ("none", "auto"):
            continue
        return name
    return None
