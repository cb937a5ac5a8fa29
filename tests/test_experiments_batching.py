"""The selective-batching chapter's oracle: each request generated alone."""

from __future__ import annotations

import math

from minisrv.experiments.batching import alone_outputs, run_pool
from minisrv.workloads import Workload, citylm_workload


def _count_generations(model, monkeypatch):
    """Make ``model.reference_generate`` record the length of every run it is asked for;
    returns that record and the original method."""
    calls: list[int] = []
    generate = model.reference_generate

    def counted(prompt, n, **kwargs):
        calls.append(n)
        return generate(prompt, n, **kwargs)

    monkeypatch.setattr(model, "reference_generate", counted)
    return calls, generate


def test_a_shared_prompt_is_generated_once_and_each_request_gets_its_own_length(citylm,
                                                                              monkeypatch):
    model, tok = citylm
    # 16 requests: France's prompt comes twice, asked for 52 and 59 tokens (a shared prompt
    # that stops at its length; Italy's four below stop at eos). 24 only repeated two more
    # prompts the same way, at half as much again to generate.
    work = citylm_workload(tok, n=16, output_range=(1, 60), seed=0)
    # Italy's list ends at eos after 95 tokens: asked again for fewer and for more
    ended = tok.encode("IT:")
    full = model.reference_generate(ended, 120)
    assert full[-1] in model.eos_ids and len(full) < 120
    lens = [*work.output_lens, len(full) - 1, len(full), len(full) + 5, 120]
    work = Workload("mixed lengths", [*work.prompts, *[ended] * 4], lens, [0.0] * len(lens))
    assert len({tuple(p) for p in work.prompts}) < len(work)  # prompts repeat
    france = tok.encode("FR: Paris, Marseille,")
    assert sorted(n for p, n in zip(work.prompts, lens) if p == france) == [52, 59]
    calls, generate = _count_generations(model, monkeypatch)
    known: dict = {}  # a fresh dict: nothing remembered yet
    got = alone_outputs(model, work, known=known)
    monkeypatch.undo()
    assert len(calls) == len({tuple(p) for p in work.prompts})
    assert got == [generate(p, n) for p, n in zip(work.prompts, work.output_lens)]
    assert got[-4:] == [full[:-1], full, full, full]
    # past eos, Italy's four requests (the other prompts' runs past eos are asserted
    # nowhere), with the runs above remembered: none that stopped at eos may serve them
    italy = Workload("Italy past eos", [ended] * 4, lens[-4:], [0.0] * 4)
    past_eos = alone_outputs(model, italy, ignore_eos=True, known=known)
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


def test_alone_outputs_remembers_per_model_without_known(citylm, monkeypatch):
    """Left without ``known``, a second call for the same workload generates nothing again:
    the page's calls share the model's own runs without passing a dict around."""
    model, tok = citylm
    work = citylm_workload(tok, n=6, output_range=(2, 12), seed=3)
    first = alone_outputs(model, work)
    calls, generate = _count_generations(model, monkeypatch)
    again = alone_outputs(model, work)
    monkeypatch.undo()
    assert calls == [] and again == first
    assert first == [generate(p, n) for p, n in zip(work.prompts, work.output_lens)]


def test_admission_ledgers_add_up_and_recording_changes_nothing(citylm):
    """Every recorded decision of a run in a tight pool is SGLang's budget, line by line:
    the pool is what running requests hold plus what is free, the budget is free less the
    ratio times their remaining limits, and each candidate is admitted exactly when its
    prompt plus limit fits in what is left, the first refusal ending the decision. Every
    admission the engine made is in the ledgers, and recording does not change the run."""
    model, tok = citylm
    work = citylm_workload(tok, n=12, output_range=(10, 60), seed=0)
    ref = alone_outputs(model, work)
    plain = run_pool(model, work, ref, capacity=100, ratio=0.7, decay=0.01, max_running=6)
    run = run_pool(model, work, ref, capacity=100, ratio=0.7, decay=0.01, max_running=6,
                   record=True)
    assert not plain.admissions and run.outputs == plain.outputs == ref
    assert run.engine.stats.steps == plain.engine.stats.steps
    assert run.engine.stats.retractions > 0  # a pool tight enough to retract
    admitted = 0
    for decision in run.admissions:
        assert decision.capacity == 100 == decision.held + decision.free
        assert math.isclose(decision.budget, decision.free - decision.ratio * decision.remaining)
        left = decision.budget
        for k, cand in enumerate(decision.candidates):
            assert cand["need"] == cand["prompt"] + cand["limit"]
            assert math.isclose(cand["left"], left)
            assert cand["admitted"] == (cand["need"] <= left)
            assert cand["admitted"] or k == len(decision.candidates) - 1  # a refusal ends it
            left -= cand["need"] if cand["admitted"] else 0
        admitted += sum(cand["admitted"] for cand in decision.candidates)
    assert admitted == len(work) + run.engine.stats.retractions  # every admission, once
    assert any(not d.candidates[-1]["admitted"] for d in run.admissions if d.candidates)
