"""Logprobs in OpenAI's two shapes: the completions API's four parallel lists, and chat's
list of token records (with each token's UTF-8 bytes).

The engine hands over, per generated token, ``(its logprob, [(id, logprob)] of the top
alternatives)``; a token's text is the tokenizer's ``id_to_str`` (special tokens named, as
``<eos>``), so the records line up with the tokens, not with the text a stop string cut.
"""

from __future__ import annotations

from typing import Any

from minisrv.sampling import TokenLogprobs

__all__ = ["chat_logprobs", "completion_logprobs"]

Entries = list[tuple[int, TokenLogprobs]]  # (token id, its logprobs) per token


def completion_logprobs(codec: Any, entries: Entries, offset: int = 0) -> dict[str, Any]:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; ``offset`` is where
    the first token's text starts in the reply."""
    tokens, values, tops, offsets = [], [], [], []
    for token, (value, top) in entries:
        text = codec.id_to_str(token)
        tokens.append(text)
        values.append(value)
        tops.append({codec.id_to_str(i): v for i, v in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(codec: Any, entries: Entries) -> dict[str, Any]:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``."""

    def record(token: int, value: float) -> dict[str, Any]:
        text = codec.id_to_str(token)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    content = []
    for token, (value, top) in entries:
        content.append({**record(token, value),
                        "top_logprobs": [record(i, v) for i, v in top]})
    return {"content": content}
