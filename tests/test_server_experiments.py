"""The server chapter's tools: an in-process server the caller can look inside, streamed
events with timestamps, benches of several layouts, and their plot."""

from __future__ import annotations

import re
import statistics
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("fastapi")

from minisrv.engine import Engine  # noqa: E402
from minisrv.experiments.server import (  # noqa: E402
    Layout,
    bench_frame,
    bench_layouts,
    beyond_spread,
    open_server,
    read_metrics,
)
from minisrv.experiments.server_walk import (  # noqa: E402
    first_event_runs,
    first_token_parts,
    layout_hit_rates,
    slot_ranges,
    sse_frame,
    step_frame,
    step_totals,
    stream_completion,
    timed_steps,
    tree_event_frame,
    tree_path_frame,
    ttft_split,
    warm_up,
)
from minisrv.sampling import SamplingParams  # noqa: E402
from minisrv.server.bench import BenchRequest  # noqa: E402
from minisrv.server.config import EngineOptions  # noqa: E402
from minisrv.server.engine_loop import FINISHED_KEPT, EngineLoop  # noqa: E402
from minisrv.server.launch import running_server  # noqa: E402

OPTIONS = dict(device="cpu", threads=1, kv_capacity=600, max_running=8)


def expand(ranges: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, ranges.split(", ")):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


@given(st.lists(st.integers(0, 60), max_size=40))
def test_slot_ranges_spell_the_slots_in_order(slots):
    text = slot_ranges(slots)
    assert expand(text) == slots
    assert text.count(",") == sum(b != a + 1 for a, b in zip(slots, slots[1:]))


def test_sse_frame_quotes_each_chunk_s_text_and_leaves_out_done():
    events = [(1.04, {"choices": [{"text": " ", "finish_reason": None}]}),
              (2.0, {"choices": [{"text": "", "finish_reason": "length"}]}),
              (2.5, {"choices": []}), (3.0, "[DONE]")]
    frame = sse_frame(events)
    assert list(frame.columns) == ["t (ms)", "text"]
    assert frame["text"].tolist() == ["' '", "''", "''"]
    assert frame["t (ms)"].tolist() == [1.0, 2.0, 2.5]


def test_tree_frames_name_nodes_by_their_text_bos_included():
    from minisrv.kv.radix import RadixCache
    from minisrv.tokenizer import Tokenizer

    tok = Tokenizer()
    events = []
    tree = RadixCache(listener=lambda _, event: events.append(event))
    first, second = tok.encode("FR: Paris"), tok.encode("FR: Lyon")
    tree.insert(first, list(range(len(first))))
    tree.match_prefix(second, tag="r1")
    tree.insert(second, list(range(100, 100 + len(second))), tag="r1")
    mine = [e for e in events if e.tag == "r1"]
    frame = tree_event_frame(mine, tree, tok)
    assert frame["operation"].tolist() == ["match", "insert"]
    shared = repr("<bos>FR: ")  # <bos> and four characters: five tokens
    assert frame["path to"].tolist() == [shared, repr("Lyon")]
    assert frame["split off"].tolist() == [shared, ""]
    assert frame["new leaf"].tolist() == ["", repr("Lyon")]
    assert frame["tokens"].tolist() == [5, 9]
    assert frame["already cached"].tolist() == ["", 5]
    path = tree_path_frame(mine[-1].path, tree, tok)
    assert path["tokens"].tolist() == [5, 4]
    assert path["text"].tolist() == [shared, repr("Lyon")]
    assert path["KV slots"].tolist() == ["0-4", "105-108"]


def test_engine_options_may_ask_for_a_trace():
    assert EngineOptions().engine_args()["record_trace"] is False
    args = EngineOptions(engine_kwargs={"record_trace": True}).engine_args()
    assert args["record_trace"] is True


def test_engine_loop_remembers_a_bounded_number_of_finished_requests(model):
    done = threading.Event()
    finished: set[int] = set()

    def emit(events, snapshot):
        finished.update(e.key for e in events if e.finish)
        if len(finished) == FINISHED_KEPT + 3:
            done.set()

    loop = EngineLoop(Engine(model, kv_capacity=400, max_running=16, record_trace=False), emit)
    loop.start()
    try:
        for key in range(FINISHED_KEPT + 3):
            loop.submit(key, loop.make_request([0, 5 + key % 20], SamplingParams(2)))
        assert done.wait(60)
    finally:
        loop.stop()
    assert len(loop.finished) == FINISHED_KEPT
    assert all(r.finished and len(r.output) <= 2 for r in loop.finished)


@pytest.fixture(scope="module")
def server():
    options = EngineOptions(**OPTIONS, engine_kwargs={"record_trace": True})
    with open_server(Layout(options)) as (url, engines):
        yield url, engines


def test_stream_completion_times_every_event_and_matches_the_reference(server, citylm):
    url, engines = server
    model, tok = citylm
    events = stream_completion(url, {"prompt": "FR: Paris,", "max_tokens": 10,
                                     "temperature": 0})
    times = [t for t, _ in events]
    assert times == sorted(times) and times[0] > 0
    assert events[-1][1] == "[DONE]"
    chunks = [c for _, c in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text = "".join(c["choices"][0]["text"] for c in chunks)
    want = model.reference_generate(tok.encode("FR: Paris,"), 10)
    assert text == tok.decode(want)
    req = next(r for r in engines.loop.finished if r.prompt == tok.encode("FR: Paris,"))
    assert req.output == want
    assert any(req.rid in s.prefill for s in engines.loop.engine.trace)


def test_timed_steps_set_each_step_of_a_streamed_request_before_its_event(server, citylm):
    """The walk splits its first token's time with wall-clock stamps of the engine's steps
    (CityLM's engine clock counts steps): every step of the request is stamped, each event
    arrives after the step that computed its token ended, and the first event's time is the
    sum of its four parts: to the engine (until the engine loop took the request), queued,
    the prefill step, to the client. The stamping is undone after the block."""
    url, engines = server
    engine = engines.loop.engine
    _, tok = citylm
    with timed_steps(engine) as stamps:
        sse = stream_completion(url, {"prompt": "DE: Berlin,", "max_tokens": 6,
                                      "temperature": 0})
    assert "step" not in vars(engine)  # the class's method again
    req = next(r for r in engines.loop.finished if r.prompt == tok.encode("DE: Berlin,"))
    steps = [s.index for s in engine.trace if req.rid in s.prefill or req.rid in s.decode]
    assert len(steps) == 6 and set(steps) <= stamps.keys()
    parts = first_token_parts(sse, stamps, steps, req)
    assert min(parts.values()) >= 0
    total = parts["to engine"] + parts["queued"] + parts["prefill"] + parts["to client"]
    assert total == pytest.approx(sse[0][0], abs=1e-6)
    assert parts["step to event, longest"] >= parts["step to event"]
    with pytest.raises(ValueError, match="token events"):
        first_token_parts(sse, stamps, steps[:-1], req)


def test_first_event_runs_time_each_run_s_first_two_events_after_its_prefill(citylm):
    """The walk's request sent again and again to a server of its own: per run, its first
    and second events and the end of its first decode step, in ms after its prefill step
    ended (each event after the step that computed its token), and each run's text, the
    request's reference."""
    model, tok = citylm
    body = {"prompt": "FR: Paris,", "max_tokens": 4, "temperature": 0, "stream": True}
    runs, texts = first_event_runs(
        Layout(EngineOptions(**OPTIONS, engine_kwargs={"record_trace": True})), body, 3)
    assert list(runs.index) == [1, 2, 3]
    assert list(runs.columns) == ["first event", "next step ends", "second event"]
    assert (runs["first event"] > 0).all()
    assert (runs["second event"] > runs["next step ends"]).all()
    assert (runs["second event"] >= runs["first event"]).all()
    assert texts == [tok.decode(model.reference_generate(tok.encode("FR: Paris,"), 4))] * 3


def test_ttft_split_counts_the_queue_from_when_the_engine_loop_took_each_request(citylm):
    """Two places for four requests: the first two are prefilled at once, the last two wait
    through the first pair's three steps and are prefilled together. Step k is stamped from
    10 k s for k + 1 s; each request was sent at -1 s, taken by the loop at -0.5 s (the fourth,
    which arrives a step later, at 9 s) and read its first event 0.25 s after its prefill step
    ended. The queue counts from the loop's stamp, not from the start of the step the request
    arrived in; the four parts add up to the TTFT; an unstamped prefill step, or a request no
    engine loop took, is an error."""
    model, tok = citylm
    engine = Engine(model, kv_capacity=600, max_running=2, cache="radix", record_trace=True)
    reqs = engine.make_requests([tok.encode(p) for p in ("FR: Paris,", "DE:", "IT:", "ES:")],
                                3, arrival_steps=[0, 0, 0, 1])
    engine.serve(reqs)
    assert [s.prefill for s in engine.trace if s.prefill] == [(0, 1), (2, 3)]
    stamps = {s.index: (10.0 * s.index, 10.0 * s.index + s.index + 1) for s in engine.trace}
    sent = [-1.0] * 4
    with pytest.raises(ValueError, match="taken_at"):
        ttft_split(reqs, engine.trace, stamps, sent, [0.0] * 4)
    for r, taken in zip(reqs, (-0.5, -0.5, -0.5, 9.0)):
        r.taken_at = taken
    ends = [1.0, 1.0, 34.0, 34.0]  # the prefill steps' ends: step 0, and step 3 (30 + 4)
    parts = ttft_split(reqs, engine.trace, stamps, sent, [e + 0.25 for e in ends])
    assert parts["to engine"] == pytest.approx(1e3 * (0.5 * 3 + 10) / 4)
    assert parts["queued"] == pytest.approx(1e3 * (0.5 + 0.5 + 30.5 + 21) / 4)
    assert parts["prefill"] == pytest.approx(1e3 * (1 + 1 + 4 + 4) / 4)
    assert parts["to client"] == pytest.approx(250.0)
    ttft = statistics.fmean(e + 0.25 - s for e, s in zip(ends, sent))
    assert sum(parts[k] for k in ("to engine", "queued", "prefill", "to client")) == (
        pytest.approx(1e3 * ttft))
    assert parts["prefill batch"] == 2
    prompt_tokens = [len(r.prompt) - r.cached_prompt_tokens for r in reqs]
    assert parts["prefill tokens"] == pytest.approx(sum(prompt_tokens) / 2)
    with pytest.raises(ValueError, match="unstamped"):
        ttft_split(reqs, engine.trace, {k: v for k, v in stamps.items() if k != 3}, sent, ends)


def test_step_frame_and_totals_say_what_each_stamped_step_computed(citylm):
    """Two requests of 3 tokens prefilled in one step, then two decode steps of both: the
    frame has a row per stamped step (an unstamped one is left out) and the totals split the
    time into prefill and decode, with the requests per decode step."""
    model, tok = citylm
    engine = Engine(model, kv_capacity=600, max_running=2, cache="radix", record_trace=True)
    engine.generate([tok.encode("FR:"), tok.encode("DE:")], 3)
    stamps = {s.index: (0.01 * s.index, 0.01 * s.index + 0.002 * (1 + bool(s.prefill)))
              for s in engine.trace}
    frame = step_frame(engine.trace, stamps)
    assert list(frame["prefilled"]) == [2, 0, 0] and list(frame["decoded"]) == [0, 2, 2]
    assert frame["ms"].tolist() == pytest.approx([4.0, 2.0, 2.0])
    totals = step_totals(frame)
    assert totals["steps"] == 3 and totals["decode steps"] == 2
    assert totals["prompt tokens computed"] == engine.stats.prefill_tokens
    assert totals["prefill steps (ms)"] == pytest.approx(4.0)
    assert totals["decode steps (ms)"] == pytest.approx(4.0)
    assert totals["requests per decode step"] == 2
    assert len(step_frame(engine.trace, {0: stamps[0]})) == 1


def test_warm_up_runs_the_second_prompt_after_the_first_and_finds_its_prefix(citylm):
    """The warm-up prefills the walk's two shapes: the second prompt arrives a step later and
    finds the first's shared line in the tree, as in the timed walk after it."""
    model, tok = citylm
    first, second = tok.encode("FR: Paris, Lyon\nDE:"), tok.encode("FR: Paris, Lyon\nIT:")
    engine = warm_up(model, [first, second])
    assert engine.stats.finished == 2
    assert engine.stats.cached_prompt_tokens == len(first) - 3  # all but "DE:"


def test_layout_hit_rates_one_engine_per_part_and_the_arrival_gap(citylm):
    """Two groups of three requests sharing a line, fed one per step: split by group over two
    workers, each group's later two find its line; one worker finds that and the ``<bos>``
    of the second group's first; each request on a fresh worker of its own finds nothing.
    All at once, with room for all, no request finds another's (prefilled side by side)."""
    model, tok = citylm
    prompts = [tok.encode(f"{head}\n{tail}") for head in ("FR: Paris, Lyon", "DE: Berlin, Bonn")
               for tail in ("IT:", "ES:", "JP:")]
    layouts = {"one": ([range(6)], 8), "by group": ([range(3), range(3, 6)], 8),
               "alone": ([[i] for i in range(6)], 8)}
    hits, fed, served = layout_hit_rates(model, prompts, [2] * 6, layouts,
                                         {"all at once": 0, "one per step": 1})
    assert [len(fed["one per step", name]) for name in layouts] == [1, 2, 6]
    alone = [model.reference_generate(p, 2) for p in prompts]
    assert served.keys() == fed.keys() and all(out == alone for out in served.values())
    lines = sum(2 * len(tok.encode(head + "\n"))  # <bos> and the line, twice a group
                for head in ("FR: Paris, Lyon", "DE: Berlin, Bonn"))
    total = sum(map(len, prompts))
    assert hits.loc["one per step", "alone"] == 0
    assert hits.loc["one per step", "by group"] == pytest.approx(lines / total)
    assert hits.loc["one per step", "one"] == pytest.approx((lines + 1) / total)
    assert hits.loc["all at once", "one"] == 0
    assert fed["one per step", "one"][0].trace[0].start == 0


def test_stream_completion_reports_http_errors(server):
    url, _ = server
    with pytest.raises(RuntimeError, match="HTTP 400"):
        stream_completion(url, {"prompt": "", "max_tokens": 3})


def test_read_metrics_parses_the_servers_gauges(server):
    url, _ = server
    metrics = read_metrics(url)
    assert metrics["minisrv:num_running_reqs"] == 0
    assert "minisrv:cache_hit_rate" in metrics


def test_bench_layouts_serve_each_layout_and_tabulate_them(citylm):
    model, tok = citylm
    shared = "FR: Paris, Marseille, Lyon\nDE: Berlin, Hamburg, Munich\n"
    requests = [BenchRequest(shared + code, 4) for code in ("IT:", "ES:", "JP:", "US:")]
    layouts = {"radix": Layout(EngineOptions(**OPTIONS, engine_kwargs={"record_trace": True})),
               "none": Layout(EngineOptions(**OPTIONS, cache="none"))}
    runs = bench_layouts(layouts, requests, ignore_eos=False, max_concurrency=1)
    want = [tok.decode(model.reference_generate(tok.encode(r.prompt), 4)) for r in requests]
    for run in runs.values():
        assert run.result.completed == 4 and run.result.texts == want
    table = bench_frame(runs)
    assert list(table.index) == ["radix", "none"]
    assert table.loc["none", "hit rate"] == 0
    assert table.loc["radix", "hit rate"] > 0.5  # one at a time: all but the first share
    assert {"out tok/s", "ttft median (ms)", "e2e p99 (ms)"} <= set(table.columns)
    assert table["device busy (s)"].isna().all()  # a model's backend keeps no device time
    assert (table["duration (s)"] > 0).all()
    # the traced engine's bench steps, stamped: one request at a time, one token per step
    steps = runs["radix"].steps
    assert len(steps) == runs["radix"].result.output_tokens and (steps["ms"] > 0).all()
    assert (steps["prefilled"] == 1).sum() == 4 and steps["decoded"].max() == 1
    assert runs["none"].steps is None  # a server's engine keeps no trace by default


def test_running_server_reports_a_server_that_cannot_start():
    with pytest.raises(RuntimeError, match="stopped while starting") as failure:
        with running_server(["--policy", "nope"], startup_s=60):
            pass
    assert "nope" in str(failure.value)  # the CLI's own message comes back


def _repeated_runs():
    """Runs repeated three times (as ``sim_server_runs`` gives them), numbers chosen by hand."""
    import pandas as pd

    rows = []
    for repeat, (fast, slow) in enumerate([(300.0, 800.0), (250.0, 810.0), (600.0, 805.0)]):
        rows.append({"configuration": "LPM, radix", "repeat": repeat, "out tok/s": 1500.0,
                     "hit rate": 0.8, "ttft median (ms)": fast})
        rows.append({"configuration": "FCFS, radix", "repeat": repeat, "out tok/s": 600.0,
                     "hit rate": 0.0, "ttft median (ms)": slow})
    return pd.DataFrame(rows).set_index(["configuration", "repeat"]).sort_index()


def test_beyond_spread_asks_whether_the_ranges_of_two_configurations_overlap():
    repeated = _repeated_runs()
    assert beyond_spread(repeated, "ttft median (ms)", "LPM, radix", "FCFS, radix")
    assert not beyond_spread(repeated, "hit rate", "LPM, radix", "LPM, radix")
    shifted = repeated.copy()
    shifted.loc[("LPM, radix", 2), "ttft median (ms)"] = 801.0  # inside FCFS's 800-810
    assert not beyond_spread(shifted, "ttft median (ms)", "LPM, radix", "FCFS, radix")


def _rate_sweep():
    """Two configurations at three rates of a small prefix-heavy workload."""
    from minisrv.experiments.server import policy_rate_sweep, prefix_heavy_requests
    from minisrv.tokenizer import Tokenizer

    tok = Tokenizer()
    prompts = [tok.encode(r.prompt) for r in prefix_heavy_requests(groups=4, prefix_len=400,
                                                                  n=32)]
    configs = {"LPM, radix": {"policy": "lpm", "cache": "radix"},
               "FCFS, radix": {"policy": "fcfs", "cache": "radix"}}
    return policy_rate_sweep(prompts, 8, (4.0, 64.0, 512.0), configs, kv_capacity=2000)


def test_rate_sweep_reports_its_rounds_of_admission():
    """The page explains the hit rate of FCFS in SGLang's order by the size of its rounds (the
    requests prefilled in one step): at a low rate requests come alone, a burst fills rounds,
    and what a request prefilled alone found in the cache is reported on its own."""
    from minisrv.experiments.server import SIM_CONFIGS, policy_rate_sweep, prefix_heavy_requests
    from minisrv.tokenizer import Tokenizer

    tok = Tokenizer()
    prompts = [tok.encode(r.prompt) for r in prefix_heavy_requests(groups=4, prefix_len=400,
                                                                  n=32)]
    names = ("FCFS lock-first (SGLang)", "LPM")
    sweep = policy_rate_sweep(prompts, 8, (4.0, 512.0), {n: SIM_CONFIGS[n] for n in names},
                              kv_capacity=2000, max_running=16)
    assert (1 <= sweep["mean round"]).all()
    assert (sweep["mean round"] <= sweep["largest round"]).all()
    assert (sweep["largest round"] <= 16).all()
    assert (sweep.xs(4.0, level=1)["mean round"] < 1.5).all()  # the queue is nearly always empty
    assert (sweep.xs(512.0, level=1)["largest round"] > 4).all()  # a burst fills rounds
    # the pool holds all four 400-token prefixes: a request alone finds its group's
    assert (sweep.xs(4.0, level=1)["cached alone (max)"] > 400).all()
    assert (sweep["cached alone (max)"] <= max(map(len, prompts))).all()


def test_rate_sweep_queues_requests_as_the_rate_grows_and_goodput_counts_the_target():
    from minisrv.experiments.server_sweep import completion_rate, goodput, slo_attainment

    sweep = _rate_sweep()
    assert list(sweep.index.unique(level=0)) == ["LPM, radix", "FCFS, radix"]
    for name in ("LPM, radix", "FCFS, radix"):
        rows = sweep.xs(name, level=0)
        assert rows["ttft p99 (ms)"].is_monotonic_increasing  # same gaps, only squeezed
        assert rows.loc[512.0, "ttft median (ms)"] > 3 * rows.loc[4.0, "ttft median (ms)"]
        assert all(len(t) == 32 for t in rows["ttfts (ms)"])
    # at a low rate every request finds the server idle: both serve what is offered
    low = sweep.xs(4.0, level=1)["out tok/s"]
    assert low["LPM, radix"] == pytest.approx(low["FCFS, radix"], rel=0.05)
    everyone = goodput(sweep, 1e9)
    assert (everyone * sweep["duration (s)"]).round().eq(32).all()  # all met an endless target
    assert completion_rate(sweep).tolist() == pytest.approx(everyone.tolist())
    # a burst is drained after its last arrival: fewer completed per second than offered
    assert completion_rate(sweep).xs(512.0, level=1).lt(512.0).all()
    assert goodput(sweep, 0.0).eq(0).all()  # no TTFT is 0
    # the share that met a target is goodput over completion rate: the same requests counted
    for slo in (0.0, 50.0, 1e9):
        share = goodput(sweep, slo) / completion_rate(sweep)
        assert slo_attainment(sweep, slo).tolist() == pytest.approx(share.tolist())
    assert slo_attainment(sweep, 1e9).eq(1).all() and slo_attainment(sweep, 0.0).eq(0).all()
    with pytest.raises(ValueError, match="rates > 0"):
        from minisrv.experiments.server import policy_rate_sweep
        policy_rate_sweep([[1, 2]], 4, [0.0])


def test_the_rate_explorer_is_drawn_from_the_sweep_it_is_given():
    pytest.importorskip("matplotlib")
    from minisrv.experiments.server_sweep import goodput
    from minisrv.viz.server import plot_policy_rate_sweep, rate_explorer

    sweep = _rate_sweep()
    ex = rate_explorer(sweep, (20.0, 200.0), rate=64.0, ttft_slo_ms=200.0)
    assert ex.default == {"rate": 64.0, "ttft_slo_ms": 200.0}
    assert len(ex.states) == 3 * 2
    state = ex.metrics(rate=512.0, ttft_slo_ms=20.0)
    good = goodput(sweep, 20.0).xs(512.0, level=1)
    assert state["goodput LPM, radix"] == pytest.approx(good["LPM, radix"])
    assert state["ttft p99 FCFS, radix"] == sweep.loc[("FCFS, radix", 512.0), "ttft p99 (ms)"]
    fig = plot_policy_rate_sweep(sweep, 200.0)
    left, right = fig.axes
    assert len(left.lines) == 3 and len(right.lines) == 3  # two curves and the target / rate
    with pytest.raises(ValueError, match="policy_rate_sweep"):
        plot_policy_rate_sweep(sweep.drop(columns="ttfts (ms)"), 200.0)


def test_the_rate_figure_labels_each_point_with_its_rate_and_keeps_its_legend_off_the_axes():
    """A reader finds the explorer's chosen rate on the latency curve by its label, and no
    target line runs through the legend (at a 50 ms target it crossed a legend in the axes)."""
    pytest.importorskip("matplotlib")
    from minisrv.viz.server import plot_policy_rate_sweep

    sweep = _rate_sweep()
    fig = plot_policy_rate_sweep(sweep, 50.0)
    left, right = fig.axes
    labels = sorted(t.get_text() for t in left.texts)
    assert labels == sorted(["4", "64", "512"] * 2)  # every point of both curves
    assert left.get_legend() is None and right.get_legend() is None
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["LPM, radix", "FCFS, radix",
                                                                 "offered"]
    # where the curves' points coincide (the lowest rate) their marker shapes tell them apart
    shapes = [line.get_marker() for line in left.lines[:2]]
    assert len(set(shapes)) == 2 and shapes == [line.get_marker() for line in right.lines[:2]]
    assert [h.get_marker() for h in fig.legends[0].legend_handles[:2]] == shapes


def test_the_rate_figure_labels_the_lowest_middle_and_highest_rates_only():
    """With a label at each of seven rates, a saturated curve's last three stood in a column and
    other curves' labels sat under the chosen rate's ring: the figure labels three rates."""
    pytest.importorskip("matplotlib")
    from minisrv.viz.server import plot_policy_rate_sweep

    rates = (16.0, 32.0, 48.0, 64.0, 96.0, 128.0, 192.0)
    sweep = _curves_sweep(rates, {"LPM": ([100 * k for k in range(1, 8)], [20 * k for k in
                                                                           range(1, 8)])})
    left = plot_policy_rate_sweep(sweep, 200.0).axes[0]
    assert sorted(t.get_text() for t in left.texts) == ["16", "192", "64"]


def _curves_sweep(rates, curves):
    """A sweep table drawn by hand: per configuration, its throughput and TTFT p99 at each of
    ``rates`` (``curves[name] = (throughputs, p99s)``), the rest filled in consistently."""
    import pandas as pd

    return pd.DataFrame(
        [{"configuration": name, "rate": rate, "out tok/s": float(x), "ttft median (ms)": y / 2,
          "ttft p99 (ms)": float(y), "hit rate": 0.5, "ttfts (ms)": (y / 2, y),
          "duration (s)": 2 / rate}
         for name, (xs, ys) in curves.items() for rate, x, y in zip(rates, xs, ys)]
    ).set_index(["configuration", "rate"])


def test_the_rate_figure_keeps_the_labels_of_a_saturated_curve_apart():
    """A curve that stops growing puts its last points almost on top of each other (FCFS's
    96, 128 and 192 requests/s within 1% of one throughput, their TTFTs a fifth apart): their
    labels, all below right of their points, covered each other. Each label now takes the
    first place round its point that no earlier label covers."""
    pytest.importorskip("matplotlib")

    from minisrv.viz.server import plot_policy_rate_sweep

    rates = (16.0, 96.0, 128.0, 160.0, 192.0)
    curves = {"LPM, radix": ([250, 1400, 1700, 1850, 2000], [20, 40, 120, 250, 400]),
              "FCFS, radix": ([250, 665, 668, 669, 671], [30, 900, 1100, 1200, 1300])}
    sweep = _curves_sweep(rates, curves)
    fig = plot_policy_rate_sweep(sweep, 200.0)
    left = fig.axes[0]
    assert sorted(t.get_text() for t in left.texts) == sorted(["16", "128", "192"] * 2)
    fig.draw_without_rendering()
    boxes = [t.get_window_extent() for t in left.texts]
    assert not any(a.overlaps(b) for k, a in enumerate(boxes) for b in boxes[k + 1:])



def test_the_rate_figure_puts_no_rate_label_on_a_data_point():
    """A label took the first place that no earlier label covered, even where a point of
    another curve lay under it (on the page, the saturated curve's "64" and "192" sat on the
    points beside them). A third curve's point just below and right of the saturated curve's
    128 now pushes that label elsewhere: no visible label covers a marker."""
    pytest.importorskip("matplotlib")

    from minisrv.viz.server import plot_policy_rate_sweep

    rates = (16.0, 96.0, 128.0, 160.0, 192.0)
    curves = {"LPM, radix": ([250, 1400, 1700, 1850, 2000], [20, 40, 120, 250, 400]),
              "FCFS, radix": ([250, 665, 668, 669, 671], [30, 900, 1100, 1200, 1300]),
              "other": ([250, 500, 698, 900, 1000], [30, 60, 935, 300, 350])}
    fig = plot_policy_rate_sweep(_curves_sweep(rates, curves), 200.0)
    left = fig.axes[0]
    # a marker's size round its point
    for line in left.lines:
        if line.get_marker() in (None, "None", ""):
            continue
        half = line.get_markersize() * fig.dpi / 72 / 2
        for px, py in left.transData.transform(line.get_xydata()):
            for t in left.texts:
                box = t.get_window_extent()
                if t.get_visible():
                    assert not (box.x0 < px + half and px - half < box.x1
                                and box.y0 < py + half and py - half < box.y1), t.get_text()


def test_the_rate_explorer_s_caption_calls_a_tie_a_tie():
    """Where both policies meet the target for as many requests as each other, the caption said
    one of them "serves the most" beside two equal numbers."""
    pytest.importorskip("matplotlib")
    from minisrv.experiments.server_sweep import goodput
    from minisrv.viz.server import rate_explorer

    sweep = _rate_sweep()
    shown = goodput(sweep, 20.0).round(1).unstack(0)
    assert shown.nunique(axis=1).tolist() == [1, 1, 2]  # ties at 4 and 64 requests/s
    html = rate_explorer(sweep, (20.0,), rate=4.0, ttft_slo_ms=20.0).html
    assert "4 requests/s offered, TTFT target 20 ms:" in html
    assert html.count("both serve alike") == 2
    assert html.count("LPM, radix serves the most") == 1  # 512 requests/s


def test_the_rate_caption_calls_goodputs_within_five_percent_alike():
    """At 48 requests/s the caption said "LPM serves the most" for 46.6 against 45.6 requests/s
    meeting the target, a difference well inside the runs' spread; within 5% is now alike."""
    import pandas as pd

    from minisrv.viz.server import _verdict

    assert _verdict(pd.Series({"LPM": 46.6, "FCFS lock-first (SGLang)": 45.6})) == (
        "both serve alike (within 5%)")
    three = pd.Series({"FCFS allocate-each": 20.0, "FCFS lock-first (SGLang)": 45.6, "LPM": 46.6})
    assert _verdict(three) == "FCFS lock-first (SGLang) and LPM serve alike (within 5%), the most"
    assert _verdict(pd.Series({"FCFS allocate-each": 20.0, "LPM": 46.6})) == "LPM serves the most"


def test_the_rate_explorer_labels_the_ringed_point_with_its_rate():
    """The text promises a label on the chosen rate's point, but the figure labels only the
    lowest, middle and highest rates: a ring at another rate stood unnamed. Such a rate is now
    written once, beside its highest ring (one label per ring stacked up where the rings lie
    close); at a labelled rate the figure's own label suffices."""
    pytest.importorskip("matplotlib")
    from minisrv.experiments.server import policy_rate_sweep, prefix_heavy_requests
    from minisrv.tokenizer import Tokenizer
    from minisrv.viz.server import rate_explorer

    tok = Tokenizer()
    prompts = [tok.encode(r.prompt) for r in prefix_heavy_requests(groups=4, prefix_len=400,
                                                                  n=32)]
    configs = {"LPM": {"policy": "lpm", "cache": "radix"},
               "FCFS allocate-each": {"policy": "fcfs", "cache": "radix"}}
    sweep = policy_rate_sweep(prompts, 8, (4.0, 16.0, 64.0, 512.0), configs, kv_capacity=2000)
    html = rate_explorer(sweep, (20.0,), rate=16.0, ttft_slo_ms=20.0).html
    labels = re.findall(r'sans-serif;color:#[0-9a-f]{6}\\?">([0-9.]+)<', html)
    assert labels == ["16"]  # once, for both rings; 4, 64, 512 labelled by the figure


def test_the_rate_explorer_keeps_two_fcfs_orders_apart_and_names_them_as_its_legend_does():
    """With FCFS in minisrv's order and in SGLang's order both swept, the table's columns were
    named by the policy alone, so the two FCFS columns collided, and a tie of three read
    "both". Then the table shortened the names (``"FCFS"``) while the legend and the caption
    wrote them in full (``"FCFS, radix"``): a reader matched three names to three others. Now
    the table's row labels, the legend and the caption all use ``SIM_CONFIGS``' names."""
    pytest.importorskip("matplotlib")
    from minisrv.experiments.server import SIM_CONFIGS, policy_rate_sweep, prefix_heavy_requests
    from minisrv.tokenizer import Tokenizer
    from minisrv.viz.server import _rate_table, plot_policy_rate_sweep, rate_explorer

    tok = Tokenizer()
    prompts = [tok.encode(r.prompt) for r in prefix_heavy_requests(groups=4, prefix_len=400,
                                                                  n=32)]
    names = ("FCFS allocate-each", "FCFS lock-first (SGLang)", "LPM")
    sweep = policy_rate_sweep(prompts, 8, (4.0, 512.0), {n: SIM_CONFIGS[n] for n in names},
                              kv_capacity=2000)
    body = _rate_table(sweep, 4.0, 200.0).split("<tbody>")[1]
    for name in names:
        assert body.count(f">{name}</th>") == 1, name
    assert body.count("<tr") == 3  # the chosen rate's row of each
    legend = [t.get_text() for t in plot_policy_rate_sweep(sweep, 200.0).legends[0].get_texts()]
    assert legend == [*names, "offered"]
    html = rate_explorer(sweep, (200.0,), rate=4.0, ttft_slo_ms=200.0).html
    assert "all serve alike" in html and "both serve alike" not in html  # at 4 requests/s
    import html as html_text

    caption = html_text.unescape(html)
    assert all(re.search(rf"{re.escape(name)} \d", caption) for name in names)  # legend's names


def test_the_rate_figure_writes_one_label_where_the_curves_coincide():
    """At low rates the three configurations serve alike and their points lie on top of each
    other: nine labels (16, 32 and 48 three times) covered each other. Points of one rate that
    nearly coincide now share one grey label, and no two visible labels overlap."""
    pytest.importorskip("matplotlib")
    import numpy as np

    from minisrv.viz.server import plot_policy_rate_sweep
    from minisrv.viz.server_labels import _SAME_POINT_PX, SHARED_LABEL

    rates = (16.0, 32.0, 48.0, 96.0, 128.0, 192.0)
    curves = {"FCFS allocate-each": ([250, 500, 640, 670, 671, 672], [41, 163, 441, 1640, 1967,
                                                                        2294]),
              "FCFS lock-first (SGLang)": ([250, 501, 700, 1130, 1150, 1152],
                                           [41, 84, 183, 399, 701, 1027]),
              "LPM": ([250, 502, 730, 1390, 1690, 2100], [41, 96, 149, 686, 620, 681])}
    sweep = _curves_sweep(rates, curves)
    fig = plot_policy_rate_sweep(sweep, 200.0)
    left = fig.axes[0]
    fig.draw_without_rendering()
    shown = [t for t in left.texts if t.get_visible()]
    assert len(shown) < len(left.texts) == 3 * 3  # some points share a label
    assert [t.get_text() for t in shown].count("16") == 1  # the three 16s coincide
    assert all(t.get_color() == SHARED_LABEL for t in shown if t.get_text() == "16")
    boxes = [t.get_window_extent() for t in shown]
    assert not any(a.overlaps(b) for k, a in enumerate(boxes) for b in boxes[k + 1:])
    # every labelled point keeps a visible label of its rate, its own or one at its place
    to_px = left.transData.transform
    for t in left.texts:
        assert any(s.get_text() == t.get_text()
                   and np.hypot(*(to_px(s.xy) - to_px(t.xy))) < _SAME_POINT_PX for s in shown)


def test_the_rate_explorer_marks_the_chosen_rate_on_both_panels():
    """Each state lays marks over its target's one image: a ring round each policy's point of
    the rate on the latency curve (left), a line at the rate on the goodput panel (right). The
    rings sit on the points (they move right as the throughput grows), the line moves right
    with the rate on the right half of the image, and no state draws a second image."""
    pytest.importorskip("matplotlib")
    import json

    import pandas as pd

    from minisrv.viz.server import rate_explorer

    sweep = _rate_sweep()
    ex = rate_explorer(sweep, (200.0,), rate=64.0, ttft_slo_ms=200.0)
    assert ex.html.count("data:image/webp") == 1
    data = json.loads(ex.html.split('<script type="application/json">')[1]
                      .split("</script>")[0].replace("<\\/", "</"))
    rates = list(sweep.index.unique(level=1))
    rings, lines = {}, {}
    for rate, state in zip(rates, data["states"], strict=True):
        marks = data["parts"][state["parts"][1]]
        assert marks.endswith("</div>") and marks.count("border-radius:50%") == 2
        lefts = [float(x) for x in re.findall(r"left:([0-9.]+)%", marks)]
        tops = [float(x) for x in re.findall(r"top:([0-9.]+)%", marks)]
        assert len(lefts) == 3  # two rings, one line
        rings[rate], lines[rate] = list(zip(lefts[:2], tops[:2])), lefts[2]
    assert lines[4.0] < lines[64.0] < lines[512.0] < 100 and lines[4.0] > 50
    for k, name in enumerate(sweep.index.unique(level=0)):
        rows = sweep.xs(name, level=0)
        xs = pd.Series([rings[r][k][0] for r in rates])  # more throughput, further right
        assert xs.rank().tolist() == rows["out tok/s"].rank().tolist()
        assert all(0 < x < 50 for x in xs)  # on the left panel
        ys = pd.Series([rings[r][k][1] for r in rates])  # a higher p99, higher on the image
        assert ys.rank().tolist() == rows["ttft p99 (ms)"].rank(ascending=False).tolist()


def test_the_rate_explorer_s_table_holds_the_chosen_rate_s_rows():
    """Beside the marks on the figure, the table under it holds the chosen rate's rows, one per
    configuration (every rate's, 21 rows on the page, had the reader look for three)."""
    pytest.importorskip("matplotlib")
    from minisrv.experiments.server_sweep import goodput
    from minisrv.viz.server import _rate_table

    sweep = _rate_sweep()
    html = _rate_table(sweep, 64.0, 200.0)
    rows = html.split("<tbody>")[1].split("<tr")[1:]
    assert len(rows) == len(sweep.index.unique(level=0)) == 2
    at_64 = goodput(sweep, 200.0).xs(64.0, level=1)
    for row, (name, good) in zip(rows, at_64.items(), strict=True):
        assert f"<th>{name}</th>" in row and f"<td>{good:.1f}</td>" in row
    assert "at 64 req/s offered" in html and "TTFT &lt;= 200 ms" in html
    assert "completed (req/s)" in html  # beside goodput: behind the rate, or missing the target
    with pytest.raises(ValueError):
        _rate_table(sweep, 32.0, 200.0)  # not a rate of the sweep


def _timelines(rate: float = 64.0):
    from minisrv.experiments.server import prefix_heavy_requests, request_timelines
    from minisrv.tokenizer import Tokenizer

    tok = Tokenizer()
    prompts = [tok.encode(r.prompt) for r in prefix_heavy_requests(groups=4, prefix_len=400,
                                                                  n=32)]
    configs = {"LPM, radix": {"policy": "lpm", "cache": "radix"},
               "FCFS, radix": {"policy": "fcfs", "cache": "radix"}}
    return request_timelines(prompts, 8, rate, configs, kv_capacity=2000)


def test_request_timelines_are_the_sweep_s_point_request_by_request():
    """Same arrivals and engines as ``policy_rate_sweep``: each request's first token minus its
    arrival is the TTFT the sweep recorded, and its phases tile its latency."""
    sweep, timelines = _rate_sweep(), _timelines(64.0)
    for name in ("LPM, radix", "FCFS, radix"):
        rows = timelines.xs(name, level=0)
        assert list(rows.index) == list(range(32))
        ttft = rows["first token (ms)"] - rows["arrival (ms)"]
        assert ttft.tolist() == pytest.approx(list(sweep.loc[(name, 64.0), "ttfts (ms)"]))
        assert (rows["arrival (ms)"] <= rows["admitted (ms)"]).all()
        assert (rows["admitted (ms)"] < rows["first token (ms)"]).all()
        for _, row in rows.iterrows():
            times = row["token times (ms)"]
            assert len(times) == 8 and times[0] == row["first token (ms)"]
            assert times[-1] == row["finish (ms)"]
            assert len(row["prefill steps per gap"]) == 7
    # at a high rate FCFS queues, and some of its gaps hold other requests' prefill steps
    fcfs = _timelines(512.0).xs("FCFS, radix", level=0)
    assert (fcfs["admitted (ms)"] - fcfs["arrival (ms)"]).max() > 10.0
    assert any(sum(gaps) for gaps in fcfs["prefill steps per gap"])
    with pytest.raises(ValueError, match="rate > 0"):
        from minisrv.experiments.server import request_timelines
        request_timelines([[1, 2]], 4, 0.0)


def test_the_waterfall_draws_three_phases_per_request_that_sum_to_its_latency():
    pytest.importorskip("matplotlib")
    from minisrv.viz.server_waterfall import plot_request_waterfall

    timelines = _timelines(512.0)
    fig = plot_request_waterfall(timelines, [8, 9, 10])
    assert len(fig.axes) == 2
    for ax, name in zip(fig.axes, ("LPM, radix", "FCFS, radix"), strict=True):
        assert ax.get_title(loc="left").startswith(name)
        assert [t.get_text() for t in ax.get_yticklabels()] == ["r8", "r9", "r10"]
        bars = ax.patches
        assert len(bars) == 3 * 3
        rows = timelines.xs(name, level=0).loc[[8, 9, 10]]
        for y, (_, row) in enumerate(rows.iterrows()):
            mine = [b for b in bars if abs(b.get_y() + b.get_height() / 2 - y) < 1e-9]
            assert sum(b.get_width() for b in mine) == pytest.approx(
                row["finish (ms)"] - row["arrival (ms)"])
    # time counts from the first shown arrival, the same in both panels
    assert min(b.get_x() for ax in fig.axes for b in ax.patches) == pytest.approx(0.0)
    # each panel its own time axis, to its own last finish: FCFS's queue no longer squeezes
    # LPM's bars into a corner of a shared one
    ends = [max(b.get_x() + b.get_width() for b in ax.patches) for ax in fig.axes]
    for ax, end in zip(fig.axes, ends, strict=True):
        assert ax.get_xlim() == pytest.approx((0.0, 1.02 * end))
        assert ax.get_xlabel()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["queued", "prefill", "decode", "first token", "later token"]
    # the white tick's entry is drawn on the decode colour, where the ticks are seen
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    drawn = fig.legends[0].findobj(lambda a: isinstance(a, (Line2D, Rectangle)))
    ticks = [a for a in drawn if isinstance(a, Line2D) and a.get_marker() == "|"]
    assert [t.get_color() for t in ticks] == ["white"]
    decode = [a for a in drawn if isinstance(a, Rectangle)
              and a.get_facecolor() == fig.axes[0].patches[2].get_facecolor()]
    assert len(decode) == 2  # the decode entry and the bar under the tick


def test_policy_sweep_table_has_a_row_per_rate_and_three_columns_per_configuration():
    from minisrv.experiments.server_sweep import goodput, policy_sweep_table

    sweep = _rate_sweep()
    table = policy_sweep_table(sweep, 200.0)
    assert list(table.index) == ["4", "64", "512"]
    assert list(table.columns) == [f"{name} {column}" for column in
                                   ("out tok/s", "TTFT p99 (ms)", "goodput (req/s)")
                                   for name in ("LPM", "FCFS")]
    assert table.columns.name == "req/s offered"
    want = goodput(sweep, 200.0).loc[("FCFS, radix", 512.0)]
    assert table.loc["512", "FCFS goodput (req/s)"] == round(want)


def test_the_rate_widget_builds():
    pytest.importorskip("ipywidgets")
    from minisrv.viz.server import rate_widget

    rate, slo = rate_widget(_rate_sweep(), 64.0, 200.0).children[0].children
    assert rate.value == 64.0 and list(rate.options) == [4.0, 64.0, 512.0]
    assert slo.value == pytest.approx(200.0)


def test_spread_summary_and_plot_show_each_configuration_s_median_and_range():
    """Issue 38: the spread table had three sub-columns per metric and ran off the page; one
    cell per metric now holds the median and [min, max], and the figure draws the same. Where
    min and max read the same, the value alone (``0.00 [0.00, 0.00]`` wrapped its cell), and
    no-break spaces keep the others on one line."""
    pytest.importorskip("matplotlib")
    from minisrv.experiments.server import spread_summary
    from minisrv.viz.server import plot_spread

    repeated = _repeated_runs()
    table = spread_summary(repeated, {"ttft median (ms)": "{:,.0f}", "hit rate": "{:.2f}"})
    assert list(table.columns) == ["TTFT median (ms)", "hit rate"]
    assert table.columns.name == "configuration" and table.index.name is None
    assert table.loc["LPM, radix", "TTFT median (ms)"] == "300\u00a0[250,\u00a0600]"  # one line
    assert table.loc["FCFS, radix", "hit rate"] == "0.00"
    fig = plot_spread(repeated, {"ttft median (ms)": "TTFT (ms)", "hit rate": "hit rate"},
                      "title")
    ttft, hit = fig.axes
    assert [p.get_height() for p in ttft.patches] == [805.0, 300.0]  # FCFS, LPM medians
    assert hit.get_ylim() == (0, 1)
    with pytest.raises(ValueError, match="missing"):
        plot_spread(repeated, {"req/s": "requests"}, "title")


def test_the_request_sequence_has_a_lane_per_party_and_a_row_per_message():
    """The chapter's sequence diagram: every message becomes an arrow (or, within one lane, a
    box) in its own row; a message naming an unknown lane is refused."""
    pytest.importorskip("graphviz")
    from minisrv.viz.server import REQUEST_LANES, REQUEST_MESSAGES, request_sequence

    source = request_sequence().source
    for key, title in REQUEST_LANES:
        assert title.split("\n")[0] in source and f"{key}_0" in source
    keys = [key for key, _ in REQUEST_LANES]
    segments = 0
    for row, (src, dst, label) in enumerate(REQUEST_MESSAGES, start=1):
        if src == dst:
            continue
        # an arrow across several lanes is a straight chain of neighbours' edges, its label
        # and its head on the last one (a labelled edge that skips a lane is drawn kinked)
        a, b = keys.index(src), keys.index(dst)
        path = keys[a:b + 1] if a < b else keys[b:a + 1][::-1]
        for u, v in zip(path, path[1:]):
            attrs = re.search(rf"\b{u}_{row} -> {v}_{row} \[(.*?)\]$", source, re.S | re.M)[1]
            assert ("arrowhead=normal" in attrs) == (v == dst), attrs
            assert (label.split("\n")[0] in attrs) == (v == dst), attrs
            segments += 1
    assert segments > sum(m[0] != m[1] for m in REQUEST_MESSAGES)  # some arrow skips a lane
    assert source.count('constraint=false') == segments
    with pytest.raises(ValueError, match="names a lane"):
        request_sequence(messages=[("client", "nobody", "hello")])
