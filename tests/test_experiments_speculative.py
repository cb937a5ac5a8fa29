"""The speculative-decoding chapter's experiments: what they return and what they check."""

from __future__ import annotations

import math

import pytest
import torch

from minisrv.configs import CITYLM, H100, LLAMA3_8B, LLAMA32_1B
from minisrv.experiments.speculative import (
    CheckRow,
    acceptance_sweep,
    breakeven_table,
    check_trace,
    chi2_critical,
    drafters,
    sampling_check,
    spec_workloads,
    speedup_frame,
)
from minisrv.model import CityLM
from minisrv.sim.speedup import breakeven_batch, max_speculative_requests, speculative_speedup
from minisrv.spec import NgramDrafter, load_draft
from minisrv.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def draft_model() -> CityLM:
    return load_draft("cpu")[0]


def test_the_sweep_is_exact_and_counts_forwards(citylm, draft_model) -> None:
    model, tok = citylm
    workloads = {"few": [tok.encode("FR:"), tok.encode("JP: Tokyo,")]}
    sweep = acceptance_sweep(model, workloads, drafters(draft_model), ks=(1, 3),
                             max_new_tokens=20)
    assert len(sweep) == 4 and sweep["identical"].all()
    assert ((sweep["acceptance"] >= 0) & (sweep["acceptance"] <= 1)).all()
    # Each check yields 1..k+1 tokens; the forwards are one prefill per request plus the
    # checks, and the tokens the same as 20 plain forwards per request minus the ones saved.
    assert (sweep["tokens_per_check"] >= 1).all()
    assert (sweep["tokens_per_check"] <= sweep["k"] + 1).all()
    assert (sweep["plain_forwards"] == 40).all()
    assert (sweep["forwards"] <= sweep["plain_forwards"] + 2).all()
    drafted = sweep[sweep["draft"] == "CityDraft"].set_index("k")
    assert drafted.loc[3, "forwards"] < drafted.loc[1, "forwards"]  # longer drafts, fewer checks


def test_the_sweeps_engine_gives_each_request_the_checks_of_it_alone(citylm, draft_model):
    """The sweep serves a k's requests together and reads their checks from the engine's
    trace, a draft's guesses remembered across k (longest first): each request's tokens,
    guesses and kept guesses are those of ``speculative_generate``, the request alone."""
    from minisrv.experiments.speculative import _GuessesOnce, _served_checks
    from minisrv.spec import speculative_generate

    model, tok = citylm
    prompts = [tok.encode("FR:"), tok.encode("JP: Tokyo,"),
               tok.encode("DE: Berlin, Hamburg\nFR: Paris, Lyon\nDE: Berlin,")]
    for drafter in drafters(draft_model).values():
        once = _GuessesOnce(drafter)
        for k in (4, 1):
            served = _served_checks(model, prompts, once, k, 20)
            alone = [speculative_generate(model, drafter, p, 20, k) for p in prompts]
            assert served == alone
            assert sum(d for r in served for d in r.drafted) > 0


def test_the_workloads_are_city_prompts_and_the_repeat_holds_its_answer(citylm) -> None:
    model, tok = citylm
    work = spec_workloads(model, tok)
    assert list(work) == ["city prompts", "shared system prompt", "chat turns",
                          "answer in the prompt"]
    assert len(work["city prompts"]) == 14
    again = tok.decode(work["answer in the prompt"][0])
    assert again.endswith("FR:") and again.count("FR:") == 2


def test_a_trace_adds_up_to_the_generated_tokens(citylm, draft_model) -> None:
    model, tok = citylm
    prompt = tok.encode("DE:")
    for drafter in drafters(draft_model).values():
        rows = check_trace(model, drafter, prompt, 30, 4)
        alone = model.reference_generate(prompt, 30)
        tokens = [alone[0]]
        for row in rows:
            assert isinstance(row, CheckRow) and row.last == tokens[-1]
            assert row.cached == len(prompt) + len(tokens) - 1
            assert row.written - row.freed == row.accepted + 1  # fed token + kept guesses
            tokens += [*row.draft[: row.accepted], row.own]
        assert tokens == alone


def test_the_rejection_rule_gives_the_targets_distribution(citylm, draft_model) -> None:
    model, tok = citylm
    check = sampling_check(model, draft_model, tok.encode(""), n=6000, seed=1)
    assert int(check.counts.sum()) == 6000 and 0 < check.accepted < 6000
    stat, dof = check.chi2()
    assert stat < chi2_critical(dof)
    assert check.distance(check.p) < 0.04 < check.distance(check.q)


def test_the_chi2_test_rejects_the_drafts_distribution(citylm, draft_model) -> None:
    """The same statistic fires when the kept tokens follow q: the test can fail."""
    model, tok = citylm
    check = sampling_check(model, draft_model, tok.encode(""), n=3000)
    as_q = check._replace(counts=torch.round(check.q * 3000))
    stat, dof = as_q.chi2()
    assert stat > chi2_critical(dof)


@pytest.mark.parametrize(("dof", "exact", "rel"),
                         [(5, 20.515, 0.02), (10, 29.588, 0.01), (25, 52.620, 0.01)])
def test_chi2_critical_is_close_to_the_tables(dof: int, exact: float, rel: float) -> None:
    assert chi2_critical(dof) == pytest.approx(exact, rel=rel)


def test_speedup_frame_and_breakeven_agree_with_speedup() -> None:
    frame = speedup_frame(0.7, ks=(2, 8), batches=(1, 64, 512), contexts=(256,))
    assert len(frame) == 6
    row = frame[(frame["k"] == 8) & (frame["batch"] == 512)].iloc[0]
    assert row["speedup"] == speculative_speedup(LLAMA3_8B, H100, 512, 256, 8, 0.7)
    table = breakeven_table(0.7, ks=(1, 8), contexts=(256, 1024),
                            drafts={"free": None, "1B": LLAMA32_1B})
    assert table.loc[("free", 256), "k = 8"] == breakeven_batch(LLAMA3_8B, H100, 256, 8, 0.7)
    assert table.loc[("1B", 1024), "k = 8"] < table.loc[("1B", 1024), "fits in memory"]
    for c in (256, 1024):  # the draft's weights and KV leave room for fewer requests
        assert table.loc[("free", c), "fits in memory"] == max_speculative_requests(
            LLAMA3_8B, H100, c)
        assert table.loc[("1B", c), "fits in memory"] == max_speculative_requests(
            LLAMA3_8B, H100, c, LLAMA32_1B) < table.loc[("free", c), "fits in memory"]
    assert table.loc[("free", 1024)].isna()["k = 1"]  # pays at every batch that fits
    never = breakeven_table(0.0, ks=(2,), contexts=(256,))
    assert never.iloc[0]["k = 2"] == 0  # no guess ever accepted: a check only costs
    from minisrv.viz.speculative import breakeven_shown

    shown = breakeven_shown(table)
    assert shown.loc[("free", 1024), "k = 1"] == "never"  # what the page prints for <NA>
    assert shown.loc[("free", 256), "k = 8"] == table.loc[("free", 256), "k = 8"]
    assert shown.columns.name == "draft / context"


def test_bad_arguments_raise_clearly(citylm) -> None:
    model, tok = citylm
    with pytest.raises(ValueError, match="max_new_tokens"):
        acceptance_sweep(model, {"x": [tok.encode("FR:")]}, {"n": NgramDrafter()},
                         max_new_tokens=0)
    with pytest.raises(ValueError, match="n must be"):
        sampling_check(model, model, tok.encode(""), n=0)
    with pytest.raises(ValueError, match="dof"):
        chi2_critical(0)
    assert math.isfinite(chi2_critical(1))
    assert Tokenizer().vocab_size == CITYLM.vocab_size


def test_the_engine_serves_the_same_tokens_in_fewer_steps(citylm, draft_model) -> None:
    from minisrv.experiments.speculative import engine_table, serve_speculative
    from minisrv.spec import DraftModelDrafter
    from minisrv.viz.speculative import check_table

    model, tok = citylm
    prompts = [tok.encode("FR:"), tok.encode("JP: Tokyo,"), tok.encode("DE:")]
    runs = {"plain": serve_speculative(model, prompts, None, max_new_tokens=20),
            "CityDraft": serve_speculative(model, prompts, DraftModelDrafter(draft_model),
                                           k=4, max_new_tokens=20)}
    table = engine_table(runs)
    assert table["equals alone"].all() and (table["tokens"] == 60).all()
    assert all(run.seconds > 0 for run in runs.values())  # engine.run() was timed
    assert table.loc["CityDraft", "steps"] < table.loc["plain", "steps"] == 20
    assert table.loc["CityDraft", "KV freed"] == (table.loc["CityDraft", "guesses"]
                                                  - table.loc["CityDraft", "kept"])
    step = runs["CityDraft"].engine.trace[1]
    checks = check_table(step)
    assert len(checks) == 3 and (checks["KV written"] - checks["KV freed"]
                                 == checks["tokens gained"]).all()


def test_the_speedup_explorer_holds_the_roofline_of_each_state() -> None:
    pytest.importorskip("matplotlib")
    from minisrv.sim.sizing import max_concurrent_requests
    from minisrv.sim.speedup import expected_tokens_per_check
    from minisrv.viz.speculative import speedup_at, speedup_explorer

    ex = speedup_explorer(acceptance=0.7, acceptances=(0.5, 0.7), batches=(1, 256, 512))
    assert ex.default == {"acceptance": 0.7, "batch": 1}  # the chapter's figure, a lone request
    assert len(ex.states) == 6
    for a in (0.5, 0.7):
        frame = speedup_frame(a, ks=range(1, 9), batches=(256,))
        state = ex.metrics(acceptance=a, batch=256)
        for row in frame.itertuples():
            assert state[f"speedup_{row.context}_k{row.k}"] == row.speedup
            assert state[f"tokens_per_check_k{row.k}"] == expected_tokens_per_check(a, row.k)
    alone = ex.metrics(acceptance=0.7, batch=1)  # memory-bound: the formula's tokens
    assert alone["speedup_256_k8"] == pytest.approx(expected_tokens_per_check(0.7, 8), rel=1e-3)
    assert max_concurrent_requests(LLAMA3_8B, H100, 1024) < 512
    busy = ex.metrics(acceptance=0.7, batch=512)  # 512 requests of 1,024 tokens do not fit
    assert "speedup_1024_k1" not in busy and busy["speedup_256_k1"] > 1 > busy["speedup_256_k8"]
    table = speedup_at(0.7, 512)
    assert table[1024].isna().all() and table[256].notna().all()
    assert list(table.index) == list(range(1, 9))


def test_the_speedup_figure_marks_the_tables_batch() -> None:
    """The explorer's batch slider moves a dashed line on both panels (it once changed only
    the table under a figure shared by every batch); the legend's first row is the k's."""
    pytest.importorskip("matplotlib")
    from minisrv.viz.speculative import plot_speedup

    frame = speedup_frame(0.7, ks=(1, 2, 4, 8), batches=(1, 64, 1024))
    fig = plot_speedup(frame, 0.7, batch=64)
    for ax in fig.axes:
        assert [64, 64] in [list(line.get_xdata()) for line in ax.get_lines()]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[::2] == ["k = 1", "k = 2", "k = 4", "k = 8"]  # column by column: row one
    assert "the table's batch" in labels
    unmarked = plot_speedup(frame, 0.7)
    assert "the table's batch" not in [t.get_text() for t in unmarked.legends[0].get_texts()]


def test_the_speedup_widget_builds() -> None:
    pytest.importorskip("ipywidgets")
    from minisrv.viz.speculative import speedup_widget

    sliders = speedup_widget(0.7, 1).children[0].children
    assert [s.description for s in sliders] == ["per-guess acceptance a", "batch (requests)"]
    assert (sliders[0].value, sliders[1].value) == (0.7, 1)
