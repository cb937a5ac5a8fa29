"""The selective-batching chapter's oracle: each request generated alone."""

from __future__ import annotations

from minisrv.experiments.batching import alone_outputs
from minisrv.workloads import Workload, citylm_workload


def test_a_shared_prompt_is_generated_once_and_each_request_gets_its_own_length(citylm,
                                                                              monkeypatch):
    model, tok = citylm
    work = citylm_workload(tok, n=24, output_range=(1, 60), seed=0)
    # Italy's list ends at eos after 95 tokens: asked again for fewer and for more
    ended = tok.encode("IT:")
    full = model.reference_generate(ended, 120)
    assert full[-1] in model.eos_ids and len(full) < 120
    lens = [*work.output_lens, len(full) - 1, len(full), len(full) + 5, 120]
    work = Workload("mixed lengths", [*work.prompts, *[ended] * 4], lens, [0.0] * len(lens))
    assert len({tuple(p) for p in work.prompts}) < len(work)  # prompts repeat
    calls: list[int] = []
    generate = model.reference_generate

    def counted(prompt, n, **kwargs):
        calls.append(n)
        return generate(prompt, n, **kwargs)

    monkeypatch.setattr(model, "reference_generate", counted)
    got = alone_outputs(model, work)
    monkeypatch.undo()
    assert len(calls) == len({tuple(p) for p in work.prompts})
    assert got == [generate(p, n) for p, n in zip(work.prompts, work.output_lens)]
    assert got[-4:] == [full[:-1], full, full, full]
    past_eos = alone_outputs(model, work, ignore_eos=True)[-4:]
    assert past_eos == [generate(ended, n, ignore_eos=True) for n in lens[-4:]]
    assert len(past_eos[-1]) == 120 and past_eos[-1][:len(full)] == full


def test_known_runs_carry_over_and_are_regenerated_only_when_too_short(citylm,
                                                                      monkeypatch):
    """Workloads that share prompts (chapter 03's five) share their reference runs: a later
    call generates only prompts it has not seen, or seen with fewer tokens asked, and
    every output still equals that request generated alone."""
    model, tok = citylm
    first = citylm_workload(tok, n=12, output_range=(2, 20), seed=0)
    second = citylm_workload(tok, n=12, output_range=(2, 40), seed=1)
    calls: list[tuple[tuple[int, ...], int]] = []
    generate = model.reference_generate

    def counted(prompt, n, **kwargs):
        calls.append((tuple(prompt), n))
        return generate(prompt, n, **kwargs)

    known: dict = {}
    monkeypatch.setattr(model, "reference_generate", counted)
    alone_outputs(model, first, known=known)
    before = len(calls)
    got = alone_outputs(model, second, known=known)
    monkeypatch.undo()
    longest_first: dict[tuple[int, ...], int] = {}
    for p, n in zip(first.prompts, first.output_lens):
        longest_first[tuple(p)] = max(n, longest_first.get(tuple(p), 0))
    again = calls[before:]
    assert again  # the second workload asks for something new
    assert all(longest_first.get(p, 0) < n for p, n in again)  # nothing generated twice
    assert got == [generate(p, n) for p, n in zip(second.prompts, second.output_lens)]
    assert alone_outputs(model, second, ignore_eos=True, known=known) == [
        generate(p, n, ignore_eos=True) for p, n in zip(second.prompts, second.output_lens)]
