"""The model draft: a small CityLM-shaped model that guesses with its own KV cache.

``DraftModelDrafter`` keeps one ``DenseKVCache`` per request together with the tokens it
holds. Each ``propose`` first cuts that cache back to the longest common prefix of what it
holds and the request's current tokens (the drafted tokens the target rejected fall off
here: that is the draft's roll-back), feeds the rest, then drafts k tokens one forward at
a time. So the draft is exact by construction: its cache always equals what a fresh
prefill of the same tokens would hold, and nobody has to tell it what was accepted.
``load_draft`` reads the shipped weights (``python -m minisrv.train --draft``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import torch

from minisrv.model import CityLM, DenseKVCache
from minisrv.model.loading import load_shipped
from minisrv.sampling import SamplingParams, nucleus_probs
from minisrv.spec.config import CITYDRAFT, DRAFT_META_FILE, DRAFT_WEIGHTS_FILE
from minisrv.spec.drafter import Draft, Drafter, check_draft_args
from minisrv.spec.verify import sample_probs
from minisrv.tokenizer import Tokenizer


def truncate_dense(cache: DenseKVCache, n: int) -> None:
    """Keep the first ``n`` tokens of ``cache`` (the rest are rejected guesses)."""
    if not 0 <= n <= len(cache):
        raise ValueError(f"cannot keep {n} tokens of a cache holding {len(cache)}")
    for layer in range(len(cache.keys)):
        if cache.keys[layer] is not None:
            cache.keys[layer] = cache.keys[layer][:n]
            cache.values[layer] = cache.values[layer][:n]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclasses.dataclass
class _DraftState:
    """One request's draft cache and the tokens whose K/V it holds (same length)."""

    cache: DenseKVCache
    tokens: list[int]


class DraftModelDrafter(Drafter):
    """Guesses from a small model (``load_draft()``'s by default), one cache per request."""

    def __init__(self, model: CityLM | None = None) -> None:
        self.model = model if model is not None else load_draft()[0]
        self._states: dict[Hashable, _DraftState] = {}

    def _logits_after(self, tokens: Sequence[int], key: Hashable) -> torch.Tensor:
        """The draft's next-token logits after ``tokens``, reusing and re-syncing its cache."""
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = _DraftState(self.model.new_cache(), [])
        keep = common_prefix(state.tokens, tokens)
        keep = min(keep, len(tokens) - 1)  # the last token is re-fed to get its logits
        truncate_dense(state.cache, keep)
        del state.tokens[keep:]
        new = [int(t) for t in tokens[keep:]]
        logits = self.model(torch.tensor(new, dtype=torch.long, device=self.model.device),
                            state.cache)
        state.tokens.extend(new)
        return logits[-1]

    def _feed(self, token: int, key: Hashable) -> torch.Tensor:
        """Logits after one more guessed token, whose K/V joins the request's draft cache."""
        state = self._states[key]
        logits = self.model(torch.tensor([token], dtype=torch.long, device=self.model.device),
                            state.cache)
        state.tokens.append(token)
        return logits[-1]

    def _room(self, tokens: Sequence[int], k: int) -> int:
        """``k``, cut so that the draft's cache never outgrows its ``max_seq_len``."""
        return max(0, min(k, self.model.config.max_seq_len - len(tokens) + 1))

    @torch.inference_mode()
    def propose(self, tokens: Sequence[int], k: int, *, key: Hashable = None) -> list[int]:
        """Up to ``k`` greedy guesses (fewer when the draft guesses an eos)."""
        k = self._room(tokens, check_draft_args(tokens, k))
        if k == 0:
            return []
        logits = self._logits_after(tokens, key)
        out: list[int] = []
        while True:
            out.append(int(torch.argmax(logits).item()))
            if len(out) == k or out[-1] in self.model.eos_ids:
                return out
            logits = self._feed(out[-1], key)

    @torch.inference_mode()
    def draft(
        self,
        tokens: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        *,
        key: Hashable = None,
    ) -> Draft:
        """Greedy: ``propose``. Sampling: each guess drawn from the draft's own nucleus
        distribution q (same temperature and top-p as the request) with the request's
        generator; the q rows come back for the rejection rule."""
        if params.greedy:
            return Draft(self.propose(tokens, k, key=key))
        if generator is None:
            raise ValueError("sampling with temperature > 0 needs a generator (make_generator)")
        k = self._room(tokens, check_draft_args(tokens, k))
        if k == 0:
            return Draft([])
        logits = self._logits_after(tokens, key)
        out: list[int] = []
        rows: list[torch.Tensor] = []
        while True:
            q = nucleus_probs(logits, params.temperature, params.top_p)
            rows.append(q)
            out.append(sample_probs(q, generator))
            if len(out) == k or out[-1] in self.model.eos_ids:
                return Draft(out, torch.stack(rows))
            logits = self._feed(out[-1], key)

    def release(self, key: Hashable) -> None:
        """Free request ``key``'s draft cache."""
        self._states.pop(key, None)

    def cached_tokens(self, key: Hashable) -> int:
        """Tokens whose K/V the draft holds for ``key`` (0 when none)."""
        state = self._states.get(key)
        return 0 if state is None else len(state.cache)

    def __repr__(self) -> str:
        return f"DraftModelDrafter({self.model.config.name}, {len(self._states)} requests)"


def load_draft(
    device: str | torch.device | None = None, dtype: torch.dtype = torch.float32
) -> tuple[CityLM, Tokenizer]:
    """The shipped draft model (eval mode) and its tokenizer, CityLM's.

    Read through ``importlib.resources`` like ``load_citylm``, so it works from a wheel.
    """
    return load_shipped(DRAFT_WEIGHTS_FILE, DRAFT_META_FILE, CITYDRAFT, device, dtype)

