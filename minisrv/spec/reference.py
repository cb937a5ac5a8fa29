"""``speculative_generate``: speculative decoding of ONE request, the oracle of the chapter.

The target runs its dense per-request forward (``CityLM.forward`` over a ``DenseKVCache``):
prefill, then checks of ``[last token] + draft``, each keeping 1..k+1 tokens and cutting
the rejected guesses' K/V off the cache. Greedy, its tokens equal
``CityLM.reference_generate``'s exactly; sampled, they follow the same distribution.
The batched engine must match it token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from minisrv.checks import check_int
from minisrv.model import CityLM
from minisrv.sampling import SamplingParams, make_generator, sample_next
from minisrv.spec.draft_model import truncate_dense
from minisrv.spec.drafter import Drafter
from minisrv.spec.verify import verify_batch


@dataclass
class SpecResult:
    """What one speculative generation produced, and how well the draft guessed.

    ``drafted[i]`` and ``accepted[i]`` are the guesses of check i and how many of them the
    target kept; each check also adds one token of the target's own, so
    ``len(tokens) == 1 + sum(accepted) + len(accepted)``. (A check cut short by an accepted
    eos guess counts that eos as its own token, so the identity always holds.)
    """

    tokens: list[int]
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted guesses over drafted guesses (0.0 when nothing was drafted)."""
        total = sum(self.drafted)
        return sum(self.accepted) / total if total else 0.0

    @property
    def tokens_per_check(self) -> float:
        """Mean tokens a check produced (accepted guesses + the target's own token)."""
        return (sum(self.accepted) + len(self.accepted)) / len(self.accepted) if self.accepted \
            else 0.0


def _cut_at_end(kept: list[int], room: int, eos_ids: Sequence[int], ignore_eos: bool) -> list[int]:
    """``kept`` without what lies past ``max_new_tokens`` (``room`` left) or past an eos."""
    kept = kept[:room]
    if not ignore_eos:
        for i, token in enumerate(kept):
            if token in eos_ids:
                return kept[: i + 1]
    return kept


@torch.inference_mode()
def speculative_generate(
    model: CityLM,
    drafter: Drafter,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    k: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    ignore_eos: bool = False,
) -> SpecResult:
    """Generate for one request with drafts of up to ``k`` tokens checked by ``model``.

    The same arguments and stop rules as ``reference_generate``. A check never drafts more
    than the tokens still allowed minus one, so nothing is computed past
    ``max_new_tokens``; the draft's state for this request is released at the end.
    """
    k = check_int("k", k, minimum=1)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                            top_p=top_p, seed=seed, ignore_eos=ignore_eos)
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids is empty: encode at least <bos>")
    if len(prompt) + max_new_tokens > model.config.max_seq_len:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"max_seq_len={model.config.max_seq_len}"
        )
    generator = make_generator(params)
    key = object()  # this call's private slot in the drafter's state
    cache = model.new_cache()
    logits = model(torch.tensor(prompt, dtype=torch.long, device=model.device), cache)
    result = SpecResult([sample_next(logits[-1], params, generator)])
    try:
        while len(result.tokens) < max_new_tokens and not (
            result.tokens[-1] in model.eos_ids and not ignore_eos
        ):
            room = max_new_tokens - len(result.tokens)
            draft = drafter.draft(prompt + result.tokens, min(k, room - 1), params, generator,
                                  key=key)
            entry = [result.tokens[-1], *draft.tokens]
            before = len(cache)
            logits = model(torch.tensor(entry, dtype=torch.long, device=model.device), cache)
            kept = verify_batch(logits, [draft], [params], [generator])[0]
            kept = _cut_at_end(kept, room, model.eos_ids, ignore_eos)
            truncate_dense(cache, before + len(kept))  # last token + accepted guesses
            result.drafted.append(len(draft))
            result.accepted.append(len(kept) - 1)
            result.tokens.extend(kept)
    finally:
        drafter.release(key)
    return result
