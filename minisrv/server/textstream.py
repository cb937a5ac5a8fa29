"""Detokenizing one reply as it streams: new text per token, stop strings, stop ids.

Each token's text is found by decoding the whole output so far and taking what is new, which
is right for any tokenizer (a subword can change how the previous one reads); a tokenizer
whose text only grows token by token (CityLM's characters) decodes each new id alone. A stop
string may straddle tokens, so while any is set the last ``len(longest stop) - 1``
characters are held back until the next token shows whether a stop begins there; the
stop string itself is never sent, as in OpenAI's API.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TextStream", "finish_reason"]


def finish_reason(engine_reason: str | None) -> str | None:
    """OpenAI's name for why a reply ended: ``<eos>`` is ``"stop"``, the limit ``"length"``."""
    return {"eos": "stop", "length": "length"}.get(engine_reason or "", engine_reason)


class TextStream:
    """The text of one reply, released piece by piece."""

    def __init__(self, codec: Any, stops: list[str], stop_ids: frozenset[int]) -> None:
        self.codec = codec
        self.stops = stops
        self.stop_ids = stop_ids
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.n_tokens = 0  # every token the engine produced, <eos> included
        self.finish: str | None = None

    def add(self, tokens: list[int]) -> str:
        """Take new tokens; return the text that may be sent now. Sets ``finish`` to
        ``"stop"`` when a stop id or stop string ends the reply."""
        if not self.stops and self.codec.prefix_stable:
            return self._add_plain(tokens)
        for token in tokens:
            if self.finish is not None:
                break
            self.n_tokens += 1
            if token in self.stop_ids:
                self.finish = "stop"
                break
            self.ids.append(token)
            if self.codec.prefix_stable:
                self.text += self.codec.decode([token])
            else:
                self.text = self.codec.decode(self.ids)
            self._cut_at_stop()
        end = len(self.text) if self.finish else len(self.text) - self.hold
        while end > self.sent and self.text[end - 1] == "\ufffd":  # half a UTF-8 character
            end -= 1
        return self._release(end)

    def _add_plain(self, tokens: list[int]) -> str:
        """``add`` without stop strings, for a tokenizer whose text only grows: the tokens
        up to the first stop id are decoded in one call and nothing is held back."""
        if self.finish is not None:
            return ""
        stop_ids = self.stop_ids
        end = next((i for i, token in enumerate(tokens) if token in stop_ids), None)
        new = tokens if end is None else tokens[:end]
        self.n_tokens += len(new) if end is None else end + 1
        if end is not None:
            self.finish = "stop"
        self.ids.extend(new)
        self.text += self.codec.decode(new)
        last = len(self.text)
        while last > self.sent and self.text[last - 1] == "\ufffd":  # half a UTF-8 character
            last -= 1
        return self._release(last)

    def close(self, reason: str | None) -> str:
        """The engine ended the reply: return the text still held back."""
        if self.finish is None:
            self.finish = finish_reason(reason)
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        if end <= self.sent:
            return ""
        piece = self.text[self.sent:end]
        self.sent = end
        return piece

    def _cut_at_stop(self) -> None:
        if not self.stops:
            return
        start = max(0, self.sent - self.hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.finish = "stop"
