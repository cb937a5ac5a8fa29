"""The OpenAI wire format: request bodies, response bodies, stream chunks and errors.

Requests are validated by pydantic before anything reaches the engine, so a body with a
field of the wrong type is answered with HTTP 400 and never disturbs the running batch.
Field names and defaults follow OpenAI's API as SGLang and vLLM serve it (``max_tokens``
16 for completions, ``temperature`` 1.0, ``n`` 1); fields we do not know are ignored, as
those servers do. ``ignore_eos`` is the SGLang/vLLM extension that load generators use
to fix output lengths.

CityLM's chat template (``citylm_chat_prompt``) is deliberately plain: CityLM is a
completion model of country lines, so a conversation is one document, the concatenation
of every message's ``content`` in order (roles are not marked), and the assistant's reply
continues that text. ``[{"role": "user", "content": "FR:"}]`` therefore asks exactly what
the completion prompt ``"FR:"`` asks, and a multi-turn chat (``"FR:"``, the reply
``" Paris, Lyon\\n"``, then ``"JP:"``) reads as the document ``"FR: Paris, Lyon\\nJP:"``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "citylm_chat_prompt",
    "error_body",
    "new_id",
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampling(_Body):
    """The fields both endpoints share."""

    model: StrictStr | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = Field(1, ge=1, le=128)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    logprobs: StrictBool | StrictInt | None = None  # accepted only when off (not built yet)

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


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is the newer name."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def citylm_chat_prompt(messages: list[ChatMessage]) -> str:
    """CityLM's chat template: the messages' contents concatenated in order (see above)."""
    return "".join(message.content for message in messages)


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
