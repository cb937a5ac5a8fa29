"""The overlap chapter's measurements and trace: what the future map did, what the late stop
check wasted, and the blocking-vs-overlapped runs (their outputs, never their timings)."""

from __future__ import annotations

import pytest

from minisrv.engine import Engine
from minisrv.experiments.overlap import (
    LOOPS,
    model_gain,
    timed_gain,
    timed_window,
    waste_by_length,
)
from minisrv.scheduler import MODES
from minisrv.tokenizer import Tokenizer
from minisrv.viz.overlap import future_trace_frame

MODEL_SEED = 3
TOK = Tokenizer()
PROMPTS = [TOK.encode(p) for p in ("FR:", "JP:", "IT:", "DE:Be", "US:")]
LENGTHS = [3, 5, 3, 6, 2]
ARRIVALS = [0, 0, 2, 3, 3]


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_future_trace_links_each_placeholder_to_the_token_it_became(model, mode, skip) -> None:
    engine = Engine(model, max_running=2, mode=mode, overlap=True, skip_finishing_decode=skip)
    outputs = engine.generate(PROMPTS, LENGTHS, arrival_steps=ARRIVALS)
    assert outputs == [model.reference_generate(p, m) for p, m in zip(PROMPTS, LENGTHS)]
    steps, records = engine.loop.future_trace, engine.trace
    assert [s.index for s in steps] == [r.index for r in records]
    kept: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    previous: dict[int, tuple[int, int]] = {}  # rid -> (placeholder, token) of the last step
    for step, record in zip(steps, records):
        assert step.rids == record.prefill + record.decode
        assert all(f < 0 for f in step.futures) and len(set(step.futures)) == len(step.futures)
        for rid, given, token in zip(step.rids, step.inputs, step.tokens):
            if rid in record.decode and rid in previous:  # it computed in the step before
                placeholder, earlier = previous[rid]
                assert given == placeholder  # the CPU wrote a future id, not the token
            elif rid in record.decode:
                assert given == kept[rid][-1]  # its last token was known: a real id
            if rid not in step.discarded:
                kept[rid].append(token)
        previous = {rid: (f, t) for rid, f, t in zip(step.rids, step.futures, step.tokens)}
    assert [kept[i] for i in range(len(PROMPTS))] == outputs  # discarded = exactly the waste
    discarded = sum(len(s.discarded) for s in steps)
    assert discarded == engine.stats.late_stop_tokens
    late = sum(len(set(a.finished) & set(b.decode)) for a, b in zip(records, records[1:]))
    assert discarded == late


def test_future_trace_frame_shows_every_step(model) -> None:
    engine = Engine(model, max_running=2, overlap=True, skip_finishing_decode=False)
    engine.generate(PROMPTS[:3], LENGTHS[:3], arrival_steps=ARRIVALS[:3])
    frame = future_trace_frame(engine, TOK)
    assert list(frame.index) == [r.index for r in engine.trace]
    assert list(frame.columns) == ["batch", "decode input → resolved", "placeholders",
                                   "sampled", "finished", "discarded"]
    discarded = frame["discarded"].str.count(r"r\d+:\s").sum()
    assert discarded == engine.stats.late_stop_tokens > 0
    first = engine.trace[0]
    nbsp = "\u00a0"  # the batch cell never wraps between its words
    assert frame.loc[0, "batch"] == f"prefill{nbsp}" + nbsp.join(f"r{rid}" for rid in first.prefill)
    assert frame.loc[1, "decode input → resolved"].count(":\u00a0-") == len(engine.trace[1].decode)
    assert "'" in frame.loc[0, "sampled"]  # tokens as text with a tokenizer
    assert "'" not in future_trace_frame(engine).loc[0, "sampled"]  # ids without


def test_future_trace_is_kept_only_with_the_trace(model) -> None:
    engine = Engine(model, overlap=True, record_trace=False)
    engine.generate(PROMPTS[:2], 3)
    assert engine.loop.future_trace == []


def test_waste_is_one_token_per_finished_request(model) -> None:
    frame = waste_by_length(model, PROMPTS, [1, 3, 8], mode="mixed", max_running=8)
    assert list(frame.index) == [1, 3, 8]
    assert (frame["finished"] == len(PROMPTS)).all()
    assert (frame["wasted"] == len(PROMPTS)).all()
    assert (frame["wasted, skip_finishing_decode"] == 0).all()  # every finish is by length
    assert list(frame["useful tokens"]) == [len(PROMPTS) * n for n in (1, 3, 8)]
    assert frame["waste %"].to_numpy() == pytest.approx(frame["formula 1/L %"].to_numpy())
    assert frame["outputs identical"].all()
    with pytest.raises(ValueError, match="lengths"):
        waste_by_length(model, PROMPTS, [])
    with pytest.raises(ValueError, match="output length"):
        waste_by_length(model, PROMPTS, [0])


def test_timed_gain_reports_both_loops_lane_by_lane() -> None:
    frame = timed_gain(shares=(0.5,), device_ms=1.0, running=8, output_len=4, steps=3,
                       warmup=1, repeats=1)
    assert list(frame.index) == [50.0]
    row = frame.loc[50.0]
    assert row["outputs identical"]
    assert 0 < row["host %"] < 100
    assert row["device ms"] >= 1.0  # the device step is never below device_ms
    assert 1 <= row["predicted gain"] <= 2  # (device + host) / max(device, host)
    assert row["measured gain"] == pytest.approx(row["overlapped tok/s"] / row["blocking tok/s"])
    assert row["measured / predicted"] == pytest.approx(
        row["measured gain"] / row["predicted gain"])
    for bad in ((0.0,), (1.0,), (-0.2,), ()):
        with pytest.raises(ValueError, match="share"):
            timed_gain(shares=bad, repeats=1)
    for name, value in (("repeats", 0), ("running", 0), ("device_ms", 0), ("device_ms", True)):
        with pytest.raises(ValueError, match=name):
            timed_gain(**{name: value})


def test_a_probe_slowed_by_load_never_sizes_a_queue_that_runs_dry(monkeypatch) -> None:
    """When load slows the probes of the long queue, the host's time per waiting request
    looks huge and the queue for a share falls to its least: that least must still feed
    the probes that measure it (CI once saw "13 waiting requests run dry")."""
    import minisrv.experiments.overlap as overlap

    real = overlap.timed_window

    def loaded(waiting, *args, **kwargs):
        window = real(waiting, *args, **kwargs)
        return window._replace(wall=window.wall + 1.0) if waiting > 1000 else window

    monkeypatch.setattr(overlap, "timed_window", loaded)
    frame = overlap.timed_gain(shares=(0.5,), device_ms=1.0, running=8, output_len=4,
                               steps=3, warmup=1, repeats=1)
    assert frame.loc[50.0, "waiting"] >= (1 + 5 + 2) * 8 // 4


@pytest.mark.parametrize("overlap", [False, True])
def testtimed_window_keeps_the_batch_full(overlap) -> None:
    """Every timed step decodes the whole batch: as many requests join as finish."""
    window = timed_window(40, 1e-4, overlap, running=8, output_len=4, warmup=1, steps=6)
    assert window.tokens == 8
    assert window.busy >= 1e-4 and window.wall >= window.busy
    assert window.outputs and all(1 <= len(out) <= 4 for out in window.outputs.values())
    assert all(t >= 0 for out in window.outputs.values() for t in out)  # no placeholder left
    with pytest.raises(ValueError, match="run dry"):
        timed_window(4, 1e-4, overlap, running=8, output_len=4, warmup=1, steps=6)


def test_model_gain_checks_every_loop_against_each_request_alone(model) -> None:
    frame = model_gain(model, PROMPTS, LENGTHS, repeats=2, mode="mixed", max_running=4)
    assert list(frame.index) == list(LOOPS)
    assert frame["outputs identical to each request alone"].all()
    assert frame.loc["blocking", "gain"] == 1.0
    # fastest against fastest always lies within the gains of single turns
    assert (frame["gain, lowest run"] <= frame["gain"] + 1e-12).all()
    assert (frame["gain"] <= frame["gain, highest run"] + 1e-12).all()
    assert frame.loc["blocking", "late-stop tokens"] == 0
    assert frame.loc["overlapped", "late-stop tokens"] == len(PROMPTS)  # mixed: all decode
    assert frame.loc["overlapped, skip_finishing_decode", "late-stop tokens"] <= len(PROMPTS)


def test_timed_backend_spins_as_long_as_told() -> None:
    import math

    from minisrv.sim import SimBackend, TimedBackend

    for bad in (-1e-3, True, "0"):
        with pytest.raises(ValueError, match="spin"):
            TimedBackend(SimBackend(), 1e-3, spin=bad)
    spinner = TimedBackend(SimBackend(), 2e-3, spin=math.inf)  # never asleep
    engine = Engine(spinner, kv_capacity=100, max_running=2)
    assert engine.generate([[0, 5], [0, 6, 7]], 3) == Engine(
        SimBackend(), kv_capacity=100, max_running=2).generate([[0, 5], [0, 6, 7]], 3)
    assert spinner.busy >= spinner.steps * 2e-3 and spinner.waited > 0


def test_model_gain_takes_the_callers_reference_and_warm_up(model, monkeypatch) -> None:
    """A page that has each request generated alone already passes it in (and its warm
    model): nothing is generated again, and a wrong reference still fails the check."""
    reference = [model.reference_generate(p, m) for p, m in zip(PROMPTS, LENGTHS)]
    calls: list[int] = []
    generate = model.reference_generate
    monkeypatch.setattr(model, "reference_generate",
                        lambda *a, **k: calls.append(1) or generate(*a, **k))
    frame = model_gain(model, PROMPTS, LENGTHS, repeats=1, reference=reference,
                       warm_up=False, mode="mixed", max_running=4)
    assert not calls
    assert frame["outputs identical to each request alone"].all()
    wrong = [out[:-1] + [(out[-1] + 1) % 50] for out in reference]
    frame = model_gain(model, PROMPTS, LENGTHS, repeats=1, reference=wrong, warm_up=False)
    assert not frame["outputs identical to each request alone"].any()
    with pytest.raises(ValueError, match="reference"):
        model_gain(model, PROMPTS, LENGTHS, reference=reference[:-1])
