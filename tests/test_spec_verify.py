"""The check: greedy keeps the argmax prefix; the rejection rule samples the target exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minisrv.sampling import SamplingParams, make_generator, nucleus_probs, sample_next
from minisrv.spec import Draft, greedy_accept, rejection_accept, sample_probs, verify_batch

# Chi-square critical values at significance 0.001 (the seeds are fixed, so a pass is a
# pass on every machine; the level only says how unlikely a false alarm was to begin with).
# The draw counts are sized to that level and to the bugs the tests exist for: the draft's q
# kept without the rule, a rejection redrawn from p instead of max(0, p - q), the residual
# taken as max(0, q - p). Simulated (20,000 runs of each), every one of them fails the test
# at these counts with a probability above 0.9999 (as at twice the counts), and a correct
# rule fails it with a probability of about 0.001.
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458,
                 7: 24.322, 35: 66.619}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` against ``probs``, over cells with probs > 0."""
    live = probs > 0
    expected = probs[live] * counts.sum()
    stat = float((((counts[live] - expected) ** 2) / expected).sum())
    return stat, int(live.sum()) - 1


@given(st.lists(st.integers(0, 4), min_size=0, max_size=6), st.data())
def test_greedy_keeps_the_matching_prefix_and_one_target_token(draft: list[int], data) -> None:
    target = data.draw(st.lists(st.integers(0, 4), min_size=len(draft) + 1,
                                max_size=len(draft) + 1))
    kept = greedy_accept(target, draft)
    n = len(kept) - 1
    assert 0 <= n <= len(draft)
    assert kept[:n] == draft[:n] == target[:n]
    assert n == len(draft) or draft[n] != target[n]
    assert kept[n] == target[n]


def test_verify_batch_greedy_rows_are_checked_each_against_its_own_logits() -> None:
    torch.manual_seed(0)
    drafts = [Draft([3, 1]), Draft([]), Draft([2, 2, 2])]
    logits = torch.randn(3 + 1 + 4, 5, dtype=torch.float64)
    kept = verify_batch(logits, drafts, [SamplingParams()] * 3, [None] * 3)
    rows = [logits[0:3], logits[3:4], logits[4:8]]
    for row, draft, got in zip(rows, drafts, kept):
        assert got == greedy_accept(row.argmax(-1).tolist(), draft.tokens)
    # A draft equal to the argmax chain is accepted whole, plus the bonus token.
    chain = logits[4:8].argmax(-1).tolist()
    assert verify_batch(logits[4:8], [Draft(chain[:3])], [SamplingParams()], [None]) == [chain]


def test_sample_probs_is_sample_next_draw_for_draw() -> None:
    torch.manual_seed(1)
    params = SamplingParams(temperature=0.7, top_p=0.8, seed=5)
    g1, g2 = make_generator(params), make_generator(params)
    for _ in range(200):
        logits = torch.randn(11)
        assert sample_next(logits, params, g1) == sample_probs(
            nucleus_probs(logits, 0.7, 0.8), g2)


def _first_tokens(p_logits, q_probs, params, trials, seed, draft_token=None) -> torch.Tensor:
    """Counts of the first kept token over ``trials`` checks of a one-token draft."""
    vocab = p_logits.shape[-1]
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(trials):
        if q_probs is None:
            draft = Draft([draft_token])
        else:
            draft = Draft([sample_probs(q_probs, generator)], q_probs[None, :])
        kept = rejection_accept(p_logits, draft, params, generator)
        counts[kept[0]] += 1
    return counts


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.8, 0.9)])
def test_rejection_rule_samples_the_target_distribution(temperature: float, top_p: float):
    gen = torch.Generator().manual_seed(0)
    p_logits = torch.randn(2, 8, generator=gen, dtype=torch.float64) * 1.5
    q = nucleus_probs(torch.randn(8, generator=gen, dtype=torch.float64), temperature, top_p)
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=0)
    p = nucleus_probs(p_logits[0], temperature, top_p)
    counts = _first_tokens(p_logits, q, params, trials=6_000, seed=1)
    assert counts[p == 0].sum() == 0  # never a token outside the target's nucleus
    stat, dof = chi_square(counts, p)
    assert stat < CHI2_CRIT_001[dof]
    # The same test would catch the draft's own distribution leaking through.
    stat_q, _ = chi_square(counts, torch.where(p > 0, q, 0) / torch.where(p > 0, q, 0).sum())
    assert stat_q > CHI2_CRIT_001[dof]


def test_a_certain_guess_is_accepted_with_probability_p_and_the_output_is_p() -> None:
    gen = torch.Generator().manual_seed(2)
    p_logits = torch.randn(2, 8, generator=gen, dtype=torch.float64)
    params = SamplingParams(temperature=1.0, seed=0)
    p = nucleus_probs(p_logits[0], 1.0, 1.0)
    counts = _first_tokens(p_logits, None, params, trials=6_000, seed=3, draft_token=4)
    stat, dof = chi_square(counts, p)
    assert stat < CHI2_CRIT_001[dof]


def test_two_guesses_give_the_product_of_the_two_target_distributions() -> None:
    gen = torch.Generator().manual_seed(4)
    vocab = 6
    p_logits = torch.randn(3, vocab, generator=gen, dtype=torch.float64)
    q_rows = torch.softmax(torch.randn(2, vocab, generator=gen, dtype=torch.float64), -1)
    params = SamplingParams(temperature=1.0, seed=0)
    p0, p1 = (nucleus_probs(p_logits[i], 1.0, 1.0) for i in range(2))
    generator = torch.Generator().manual_seed(5)
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    for _ in range(7_500):
        draft = Draft([sample_probs(q_rows[0], generator), sample_probs(q_rows[1], generator)],
                      q_rows)
        kept = rejection_accept(p_logits, draft, params, generator)
        assert 1 <= len(kept) <= 3
        if len(kept) == 1:  # the second token comes from the next check: here, from p1
            kept.append(sample_next(p_logits[1], params, generator))
        counts[kept[0] * vocab + kept[1]] += 1
    stat, dof = chi_square(counts, torch.outer(p0, p1).flatten())
    assert stat < CHI2_CRIT_001[dof]


def test_a_requests_draws_depend_only_on_its_own_seed() -> None:
    torch.manual_seed(6)
    logits = torch.randn(3 + 2, 9, dtype=torch.float64)
    q = torch.softmax(torch.randn(2, 9, dtype=torch.float64), -1)
    mine = SamplingParams(temperature=1.0, seed=11)
    other = SamplingParams(temperature=0.5, seed=99)
    alone = verify_batch(logits[:3], [Draft([1, 2], q)], [mine], [make_generator(mine)])
    together = verify_batch(
        torch.cat([logits[3:], logits[:3]]), [Draft([4]), Draft([1, 2], q)],
        [other, mine], [make_generator(other), make_generator(mine)],
    )
    assert together[1] == alone[0]


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError, match="target predictions"):
        greedy_accept([1, 2], [1, 2])
    with pytest.raises(ValueError, match="sum"):
        verify_batch(torch.zeros(2, 4), [Draft([1, 2])], [SamplingParams()], [None])
    with pytest.raises(ValueError, match="generator"):
        verify_batch(torch.zeros(1, 4), [Draft([])], [SamplingParams(temperature=1.0)], [None])
    with pytest.raises(ValueError, match="probs"):
        Draft([1, 2], torch.zeros(3, 4))
    with pytest.raises(ValueError, match="vocabulary"):
        verify_batch(torch.zeros(2, 4), [Draft([4])], [SamplingParams()], [None])


def test_an_empty_draft_is_a_plain_decode_step() -> None:
    """A request without guesses gets exactly ``sample_batch``'s token, with the same draw."""
    from minisrv.sampling import sample_batch

    torch.manual_seed(7)
    logits = torch.randn(3, 10, dtype=torch.float64)
    params = [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.7, seed=3),
              SamplingParams(temperature=1.3, seed=4)]
    plain = sample_batch(logits, params, [make_generator(p) for p in params])
    checked = verify_batch(logits, [Draft([])] * 3, params, [make_generator(p) for p in params])
    assert checked == [[t] for t in plain]
