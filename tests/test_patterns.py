"""The overview's serving patterns and the repeated-prefill count."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minisrv.tokenizer import Tokenizer
from minisrv.workloads import (
    chat_turns,
    parallel_samples,
    repeated_prefill,
    shared_system_prompt,
    system_prompt,
)

TOK = Tokenizer()


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _brute_force(prompts, outputs):
    seen, total, repeated = [], 0, 0
    for i, prompt in enumerate(prompts):
        total += len(prompt)
        # a whole matched prompt still computes its last token, for the next token's logits
        repeated += min(max((_common_prefix(prompt, s) for s in seen), default=0),
                        max(len(prompt) - 1, 0))
        # the last sampled token has no KV: what a request computed ends one before it
        seen.append(list(prompt) + (list(outputs[i])[:-1] if outputs else []))
    return total, repeated


seqs = st.lists(st.lists(st.integers(0, 3), max_size=8), max_size=8)


@given(seqs, st.booleans())
def test_repeated_prefill_equals_longest_common_prefix_with_earlier_requests(prompts, with_out):
    outputs = [p[::-1] for p in prompts] if with_out else None
    assert tuple(repeated_prefill(prompts, outputs)) == _brute_force(prompts, outputs)


def test_repeated_prefill_rejects_mismatched_outputs() -> None:
    with pytest.raises(ValueError, match="2 outputs for 1 prompts"):
        repeated_prefill([[1]], [[1], [2]])


def test_shared_system_prompt_repeats_the_system_prompt_for_every_later_user() -> None:
    prompts = shared_system_prompt(TOK, 5)
    head = len(TOK.encode(system_prompt()))
    count = repeated_prefill(prompts)
    assert count.total == sum(map(len, prompts))
    assert count.repeated == 4 * head  # users 2..5 repeat exactly the system prompt


def test_parallel_samples_repeat_everything_after_the_first() -> None:
    prompts = parallel_samples(TOK, 4)
    # each repeat finds the whole prompt but computes its last token again, for its logits
    assert repeated_prefill(prompts).repeated == 3 * (len(prompts[0]) - 1)


def test_chat_turn_prompt_extends_the_previous_turn(citylm) -> None:
    model, tok = citylm
    prompts, answers = chat_turns(model, tok, 3)
    for k in range(1, 3):
        assert prompts[k][: len(prompts[k - 1]) + len(answers[k - 1])] == (
            prompts[k - 1] + answers[k - 1])
    count = repeated_prefill(prompts, answers)
    # each turn finds the previous turn's prompt and answer but the answer's last token
    assert count.repeated == sum(len(p) + len(a) - 1 for p, a in zip(prompts[:-1], answers[:-1]))


def test_the_last_sampled_token_is_not_counted_as_computed() -> None:
    """A follow-up that resends prompt + answer finds all of it but the answer's last token:
    that token was sampled, never fed through a forward pass, so it has no KV."""
    prompt, answer = [1, 2, 3], [4, 5]
    follow_up = prompt + answer + [6]
    assert repeated_prefill([prompt, follow_up], [answer, [7]]).repeated == 4
    assert repeated_prefill([prompt, follow_up], [[], [7]]).repeated == 3  # nothing sampled
    assert repeated_prefill([prompt, follow_up]).repeated == 3


def test_a_fully_matched_prompt_computes_its_last_token() -> None:
    """A prompt an earlier request computed whole still runs its last token: that forward
    pass yields the logits of the first new token (SGLang's match and ``KVManager.match``
    stop one token short). Four samples of a 6-token prompt repeat 3 x 5 of 24 tokens."""
    prompt = [1, 2, 3, 4, 5, 6]
    count = repeated_prefill([prompt] * 4)
    assert (count.total, count.repeated) == (24, 15)
    assert repeated_prefill([[1, 2, 3], [1, 2]]).repeated == 1  # a shorter prefix, whole


@pytest.mark.parametrize("bad", [0, -1])
def test_pattern_sizes_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match="n_users must be >= 1"):
        shared_system_prompt(TOK, bad)
