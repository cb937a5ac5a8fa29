"""The server's parts without HTTP: streaming text, request parsing, the engine loop
thread, and serving a local Hugging Face Llama folder (its extra stop ids included).

Every reply is compared with ``reference_generate`` of the request alone.
"""

from __future__ import annotations

import math
import threading
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")

from minisrv import Engine  # noqa: E402
from minisrv.sampling import SamplingParams  # noqa: E402
from minisrv.server.app import BadRequest, completion_prompts, sampling_params  # noqa: E402
from minisrv.server.engine_loop import EngineLoop  # noqa: E402
from minisrv.server.messages import TokenEvent  # noqa: E402
from minisrv.server.textstream import TextStream  # noqa: E402
from minisrv.tokenizer import ALPHABET, Tokenizer  # noqa: E402

TOK = Tokenizer()


class WholeDecodeCodec(Tokenizer):
    """CityLM's tokenizer, but decoded the general way (whole output each time)."""

    def __init__(self) -> None:
        super().__init__()
        self.prefix_stable = False


def first_stop_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """Oracle: generation ends at the first character after which some stop string has
    appeared; the reply is the text before that stop's earliest start."""
    for end in range(1, len(text) + 1):
        hits = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


# ------------------------------------------------------------------------------ TextStream
@settings(max_examples=150, deadline=None)
@given(
    chars=st.lists(st.sampled_from(ALPHABET[:12]), max_size=40),
    stops=st.lists(st.text(alphabet=ALPHABET[:12], min_size=1, max_size=3), max_size=3),
    cuts=st.lists(st.integers(1, 4), min_size=40, max_size=40),
    whole=st.booleans(),
)
def test_text_stream_releases_exactly_the_text_before_the_first_stop(chars, stops, cuts, whole):
    ids = TOK.encode("".join(chars), bos=False)
    codec = (WholeDecodeCodec if whole else Tokenizer)()
    stream = TextStream(codec, stops, frozenset())
    pieces, pos, step = [], 0, 0
    while pos < len(ids) and stream.finish is None:
        pieces.append(stream.add(ids[pos:pos + cuts[step]]))
        pos += cuts[step]
        step += 1
    if stream.finish is None:
        pieces.append(stream.close("length"))
    want, stopped = first_stop_cut("".join(chars), stops)
    assert "".join(pieces) == want
    assert stream.finish == ("stop" if stopped else "length")


def test_text_stream_stop_ids_and_eos():
    stream = TextStream(TOK, [], frozenset({TOK.encode(",", bos=False)[0]}))
    assert stream.add(TOK.encode(" Paris, Lyon", bos=False)) == " Paris"
    assert stream.finish == "stop" and stream.n_tokens == 7
    eos = TextStream(TOK, [], frozenset())
    assert eos.add([*TOK.encode(" Lyon", bos=False), TOK.eos_id]) == " Lyon"
    assert eos.close("eos") == "" and eos.finish == "stop"


# ------------------------------------------------------------------------------ parsing
def test_completion_prompts_take_every_openai_form():
    codec = TOK
    assert completion_prompts(codec, "FR:") == ([TOK.encode("FR:")], ["FR:"])
    assert completion_prompts(codec, ["FR:", "JP:"])[0] == [TOK.encode("FR:"), TOK.encode("JP:")]
    assert completion_prompts(codec, [0, 5, 6])[0] == [[0, 5, 6]]
    assert completion_prompts(codec, [[0, 5], [0, 6]])[0] == [[0, 5], [0, 6]]
    for bad in ("", [], [""], [[]], "FR: Besançon"):
        with pytest.raises(BadRequest):
            completion_prompts(codec, bad)


def test_sampling_params_map_top_k_and_seeds():
    body = SimpleNamespace(temperature=0.8, top_p=0.9, top_k=None, seed=5, ignore_eos=False)
    assert sampling_params(body, 7, 2) == SamplingParams(7, 0.8, 0.9, 7, False)
    assert sampling_params(SimpleNamespace(**{**vars(body), "top_k": 1}), 7, 0).greedy
    assert not sampling_params(SimpleNamespace(**{**vars(body), "top_k": -1}), 7, 0).greedy
    with pytest.raises(BadRequest, match="top_k"):
        sampling_params(SimpleNamespace(**{**vars(body), "top_k": 5}), 7, 0)


# ------------------------------------------------------------------------------ engine loop
class Collector:
    """Gathers what an EngineLoop emits (from its thread)."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.finish: dict[int, str] = {}
        self.errors: dict[int, str] = {}
        self.snapshots: list[dict[str, float]] = []
        self.lock = threading.Lock()

    def __call__(self, events, snapshot) -> None:
        with self.lock:
            for e in events:
                self.tokens.setdefault(e.key, []).extend(e.tokens)
                if e.finish:
                    self.finish[e.key] = e.finish
                if e.error:
                    self.errors[e.key] = e.error
            self.snapshots.append(snapshot)

    def wait(self, condition, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, "the engine loop did not get there in time"
            time.sleep(0.005)


@pytest.fixture
def loop_and_events(model):
    events = Collector()
    engine = Engine(model, kv_capacity=300, max_running=4, cache="radix", record_trace=False)
    loop = EngineLoop(engine, events)
    loop.start()
    yield loop, events
    loop.stop()
    assert not loop._thread.is_alive()


def test_engine_loop_streams_every_request_its_reference_tokens(loop_and_events, model):
    loop, events = loop_and_events
    prompts = [[0, *range(2 + i, 8 + i)] for i in range(10)]
    params = [SamplingParams(max_new_tokens=3 + i % 7, temperature=0.7 * (i % 2), seed=i)
              for i in range(10)]
    for key, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(key, loop.make_request(prompt, p))
        time.sleep(0.002 * (key % 3))  # arrivals spread over the running steps
    events.wait(lambda: len(events.finish) == 10)
    for key, (prompt, p) in enumerate(zip(prompts, params)):
        want = model.reference_generate(prompt, p.max_new_tokens, temperature=p.temperature,
                                        seed=p.seed)
        assert events.tokens[key] == want
        assert events.finish[key] == ("eos" if want[-1] == model.eos_id else "length")
    assert events.snapshots[-1]["running"] == 0 and events.snapshots[-1]["token_usage"] == 0


def test_engine_loop_stamps_when_it_takes_a_request_in(loop_and_events, model):
    """The loop stamps each request with the moment it took it from its inbox
    (``time.perf_counter()``), between the submit and its prefill: the engine's own clock,
    in steps, cannot tell how long a request took to reach the engine, nor how long it then
    queued. A request added to the engine directly carries no stamp."""
    loop, events = loop_and_events
    req = loop.make_request([0, 5, 6, 7], SamplingParams(max_new_tokens=3))
    assert req.taken_at is None
    before = time.perf_counter()
    loop.submit(7, req)
    events.wait(lambda: 7 in events.finish)
    assert before <= req.taken_at <= time.perf_counter()
    assert Engine(model, kv_capacity=50, max_running=1).add_request([0, 5]).taken_at is None


def test_engine_loop_abort_frees_the_kv(loop_and_events):
    loop, events = loop_and_events
    loop.submit(1, loop.make_request([0, 5, 6, 7], SamplingParams(80, ignore_eos=True)))
    events.wait(lambda: len(events.tokens.get(1, [])) >= 2)
    loop.abort(1)
    events.wait(lambda: events.snapshots[-1]["running"] == 0)
    assert events.snapshots[-1]["token_usage"] == 0 and 1 not in events.finish
    sched = loop.engine.scheduler
    assert sched.idle and sched.memory.kv.used_count == loop.engine.tree.evictable_size()


def test_engine_loop_refuses_what_it_could_never_serve(loop_and_events, model):
    """The engine's own checks, run as the loop adds the request: a 400 error event, and
    the loop serves the next request as before."""
    loop, events = loop_and_events
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match="empty"):
        loop.make_request([], SamplingParams(2))
    loop.submit(1, loop.make_request([0] * 90, SamplingParams(10)))
    loop.submit(2, loop.make_request([0, vocab], SamplingParams(2)))
    loop.submit(3, loop.make_request([0, 5, 6], SamplingParams(4)))
    events.wait(lambda: {1, 2} <= set(events.errors) and 3 in events.finish)
    assert "context" in events.errors[1] and "vocab" in events.errors[2]
    assert events.tokens[3] == model.reference_generate([0, 5, 6], 4)
    assert not events.tokens[1] and not events.tokens[2]


def test_engine_loop_survives_a_failing_step(loop_and_events, model, monkeypatch):
    loop, events = loop_and_events
    backend = loop.engine.scheduler.backend
    real_run = backend.run
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device lost")
        return real_run(batch)

    monkeypatch.setattr(backend, "run", flaky)
    loop.submit(1, loop.make_request([0, 5, 6], SamplingParams(4)))
    events.wait(lambda: 1 in events.errors)
    assert "device lost" in events.errors[1]
    loop.submit(2, loop.make_request([0, 5, 6], SamplingParams(4)))
    events.wait(lambda: 2 in events.finish)
    assert events.tokens[2] == model.reference_generate([0, 5, 6], 4)


def test_engine_loop_beats_while_it_waits_and_between_steps(model):
    """The watchdog's heartbeat: an idle loop keeps beating (it is waiting, not hung), and a
    busy one beats at least once per step."""
    events = Collector()
    engine = Engine(model, kv_capacity=300, max_running=4, record_trace=False)
    beats: list[int] = []
    loop = EngineLoop(engine, events, lambda: beats.append(engine.stats.steps), 0.01)
    with pytest.raises(ValueError, match="beat_every"):
        EngineLoop(engine, events, beats.append, 0)
    loop.start()
    try:
        events.wait(lambda: len(beats) >= 5)
        assert set(beats) == {0}  # five beats without a single step: idle
        loop.submit(1, loop.make_request([0, 5, 6], SamplingParams(20, ignore_eos=True)))
        events.wait(lambda: 1 in events.finish)
    finally:
        loop.stop()
    steps = engine.stats.steps
    assert steps >= 20 and set(range(steps)) <= set(beats)  # a beat before every step


@pytest.mark.parametrize("mode", ["prefill-first", "mixed"])
def test_a_step_that_raises_for_one_request_ends_that_request_only(model, mode):
    """The request admitted into the failing step fails; the ones already running are
    retracted, prefilled again and end with exactly their reference tokens (a seeded,
    sampled one too: it keeps its random generator)."""
    events = Collector()
    engine = Engine(model, kv_capacity=300, max_running=4, mode=mode, record_trace=False)
    backend = engine.scheduler.backend
    real_run = backend.run
    poison = [0, 9, 9, 9]
    sampled = SamplingParams(40, temperature=1.0, seed=7, ignore_eos=True)

    def choking(batch):
        if any(req.prompt == poison for req in batch.reqs):
            raise RuntimeError("cannot serve this one")
        return real_run(batch)

    backend.run = choking
    loop = EngineLoop(engine, events)
    loop.start()
    try:
        loop.submit(1, loop.make_request([0, 5, 6], SamplingParams(40, ignore_eos=True)))
        loop.submit(3, loop.make_request([0, 7, 8], sampled))
        events.wait(lambda: min(len(events.tokens.get(k, [])) for k in (1, 3)) >= 3)
        loop.submit(2, loop.make_request(poison, SamplingParams(4)))
        events.wait(lambda: {1, 3} <= set(events.finish) and 2 in events.errors)
    finally:
        loop.stop()
    assert "cannot serve this one" in events.errors[2] and 2 not in events.finish
    assert events.tokens[1] == model.reference_generate([0, 5, 6], 40, ignore_eos=True)
    assert events.tokens[3] == model.reference_generate([0, 7, 8], 40, temperature=1.0,
                                                        seed=7, ignore_eos=True)
    engine.scheduler.check_integrity()
    assert engine.scheduler.idle


# ------------------------------------------------------------------------------ HF folder
def hf_folder(tmp_path, extra_stop: int | None = None):
    """A random HF Llama saved with a word-level tokenizer (one word ``tN`` per id)."""
    import torch
    import transformers
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers

    vocab = {"<bos>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, 40)}}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>")
    eos = [1] if extra_stop is None else [1, extra_stop]
    cfg = transformers.LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=0.2, bos_token_id=0, eos_token_id=eos)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


def test_hf_folder_is_served_with_all_its_stop_ids(tmp_path):
    import torch
    from starlette.testclient import TestClient

    from minisrv.model import load_model, load_tokenizer
    from minisrv.server.app import create_app
    from minisrv.server.config import EngineOptions, model_name
    from minisrv.server.worker import LocalEngine

    plain, _ = load_model(str(hf_folder(tmp_path / "plain")), "cpu", torch.float32)
    prompt_ids = [5, 9, 13]
    alone = plain.reference_generate(prompt_ids, 12)
    extra = next(t for t in alone[2:] if t != 1)  # a token greedy decoding will produce
    folder = hf_folder(tmp_path / "two-eos", extra)
    model, codec = load_model(str(folder), "cpu", torch.float32)
    assert model.eos_id == 1 and codec.stop_ids == {1, extra}
    # same weights (same seed); the model itself now stops on every eos id of the folder
    assert model.reference_generate(prompt_ids, 12) == alone[: alone.index(extra) + 1]
    kept = alone[: alone.index(extra)]
    want = codec.decode(kept)

    options = EngineOptions(model=str(folder), device="cpu", kv_capacity=200, max_running=4)
    assert load_tokenizer(str(folder)).stop_ids == codec.stop_ids
    app = create_app(LocalEngine(options), load_tokenizer(str(folder)), model_name(str(folder)))
    with TestClient(app) as client:
        for _ in range(400):
            if client.get("/health").status_code == 200:
                break
            time.sleep(0.05)
        text = " ".join(f"t{i}" for i in prompt_ids)
        out = client.post("/v1/completions", json={"prompt": text, "max_tokens": 12,
                                                   "temperature": 0, "model": "two-eos"})
        choice = out.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (want, "stop")
        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": text}], "max_tokens": 12,
            "temperature": 0})
        assert chat.json()["choices"][0]["message"]["content"] == want


# ------------------------------------------------------------------------------ bench
def test_bench_requests_are_text_prompts_of_each_workload():
    from minisrv.server.bench import BENCH_WORKLOADS, bench_requests

    for workload in BENCH_WORKLOADS:
        reqs = bench_requests(workload, 20, seed=1, output_range=(3, 5))
        assert len(reqs) == 20 and all(3 <= r.max_tokens <= 5 for r in reqs)
        assert all(TOK.encode(r.prompt)[0] == TOK.bos_id for r in reqs)
    shared = bench_requests("shared-prompt", 4)
    head = shared[0].prompt[: shared[0].prompt.rindex("\n") + 1]
    assert head and all(r.prompt.startswith(head) for r in shared)
    with pytest.raises(ValueError, match="workload"):
        bench_requests("sharegpt", 4)
    with pytest.raises(ValueError, match="num_prompts"):
        bench_requests("citylm", 0)


def test_bench_summary_statistics_and_table():
    from minisrv.server.bench import RequestResult, _summarize, parse_goodput

    results = [RequestResult(True, ttft=0.1 * i, itls=[0.01 * i], e2e=0.5 * i,
                             prompt_tokens=4, output_tokens=2, sent=7.0 + i) for i in range(1, 5)]
    results.append(RequestResult(False, error="HTTP 400"))
    out = _summarize(results, duration=2.0)
    assert (out.completed, out.failed, out.output_tokens) == (4, 1, 8)
    assert out.output_throughput == 4.0 and out.request_throughput == 2.0
    assert out.latency_ms["ttft"]["mean"] == pytest.approx(250.0)
    assert out.latency_ms["e2e"]["median"] == pytest.approx(1250.0)
    assert out.latency_ms["itl"]["p99"] == pytest.approx(39.7)
    assert "Mean TTFT (ms):" in out.table() and out.errors == ["HTTP 400"]
    # each request's TTFT, in the order sent, nan for the failed one, out of the JSON report
    assert out.ttfts_ms[:4] == pytest.approx([100.0, 200.0, 300.0, 400.0])
    assert math.isnan(out.ttfts_ms[4]) and "ttfts_ms" not in out.as_dict()
    # --output-details: each request's TTFT, send time and text as well, in the order sent
    details = out.as_dict(details=True)
    assert details["sent"] == [8.0, 9.0, 10.0, 11.0, 0.0] and len(details["ttfts_ms"]) == 5
    assert details.keys() - out.as_dict().keys() == {"texts", "errors", "ttfts_ms", "sent"}
    # goodput: ttft 100..400 ms, tpot = e2e - ttft (2 tokens) = 400i ms; e2e 500i ms
    slo = _summarize(results, duration=2.0, slo_ms={"ttft": 250.0, "tpot": 900.0})
    assert slo.goodput == 1.0 and "Request goodput" in slo.table()  # i = 1, 2 meet both
    assert _summarize(results, 2.0, {"e2el": 1500.0}).goodput == 1.5
    assert parse_goodput(["ttft:200", "tpot:50"]) == {"ttft": 200.0, "tpot": 50.0}
    with pytest.raises(ValueError):
        parse_goodput(["itl:5"])


@pytest.mark.parametrize("chat", [False, True])
def test_events_that_arrive_together_go_out_in_one_write(chat):
    """Items already queued when the handler runs are written at once, and the bytes are the
    same events, in the same order and with OpenAI's field order, as one write per item."""
    import asyncio
    import json

    from minisrv.server.responses import Call

    class NoFrontend:
        def abort(self, reply, disconnected=False):
            pass

    def call() -> Call:
        streams = {0: TextStream(TOK, [], frozenset())}
        body = SimpleNamespace(include_usage=True, n=1)
        return Call(NoFrontend(), streams, {0: None}, chat, "citylm", body, 3, None)

    ids = TOK.encode("Paris", bos=False)
    items = [(0, TokenEvent(0, ids[:1])), (0, TokenEvent(0, ids[1:3])),
             (0, TokenEvent(0, ids[3:], "length"))]

    async def all_queued(c: Call) -> list[str]:
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        return [w async for w in c.sse([], queue)]

    async def one_at_a_time(c: Call) -> list[str]:
        queue: asyncio.Queue = asyncio.Queue()
        stream = c.sse([], queue)
        out = [await anext(stream)] if chat else []  # chat opens with a role chunk
        for item in items:
            queue.put_nowait(item)
            out.append(await anext(stream))
        return out + [w async for w in stream]

    together, apart = call(), call()
    apart.id, apart.created = together.id, together.created
    at_once = asyncio.run(all_queued(together))
    one_by_one = asyncio.run(one_at_a_time(apart))
    assert len(at_once) == (2 if chat else 1)
    assert len(one_by_one) == len(items) + (1 if chat else 0)
    assert "".join(at_once) == "".join(one_by_one)
    events = [e for e in "".join(at_once).split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert [list(c) for c in chunks[:-1]] == [["id", "object", "created", "model", "choices"]] * (
        len(chunks) - 1)
    text = "".join(c["choices"][0]["delta"].get("content", "") if chat else
                   c["choices"][0]["text"] for c in chunks[:-1])
    assert text == "Paris"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(ids)


# ------------------------------------------------------------------------------ defaults
def test_the_default_pool_runs_64_chats_without_max_tokens_together():
    """``ServerConfig`` sizes the KV pool from the model: 64 requests that may each run to
    the end of the context (a chat without ``max_tokens``) are admitted in one step."""
    from minisrv.server.config import EngineOptions, ServerConfig
    from minisrv.server.door import room
    from minisrv.server.worker import build_engine

    config = ServerConfig(threads=1, device="cpu")
    assert config.auto_kv and config.engine.max_running == 64
    assert not EngineOptions(kv_capacity=2000).auto_kv
    engine, limits = build_engine(config)
    assert limits["kv_capacity"] >= 64 * limits["max_context"]
    prompts = [TOK.encode(f"{c}:") for c in ("FR", "JP", "US", "DE") * 16]
    reqs = engine.make_requests(prompts, [room(limits, p) for p in prompts])
    for req in reqs:
        engine.scheduler.submit(req)
    engine.scheduler.step()
    assert len(engine.scheduler.queues.running) == 64


def test_router_takes_dead_workers_out_and_back():
    from minisrv.router import Router

    router = Router(3, "cache-aware")
    prompt = [0, 5, 6, 7, 8]
    home = router.route(prompt)
    router.mark_down(home)
    picks = {router.route(prompt) for _ in range(6)}
    assert home not in picks
    assert router.tree.sizes[home] == 0  # its cache died with it
    for policy in ("round-robin", "random", "least-load"):
        other = Router(3, policy)
        other.mark_down(1)
        assert 1 not in {other.route([0, i]) for i in range(9)}
    router.mark_up(home)
    for w in (0, 1, 2):
        router.mark_down(w)
    with pytest.raises(ValueError, match="no worker"):
        router.route(prompt)


def test_a_request_a_dead_worker_never_took_is_rerouted_off_its_load_and_tree():
    from minisrv.router import Router

    router = Router(3, "cache-aware")
    prompt = [0, 5, 6, 7, 8]
    home = router.route(prompt)
    router.mark_down(home)
    moved = router.reroute(prompt, home)
    assert moved != home and router.up[moved]
    assert router.loads[home] == 0 and router.loads[moved] == 1
    assert router.tree.match(prompt) == (len(prompt), (moved,))
    router.finish(moved)
    assert router.loads == [0, 0, 0]
    # with nobody up it refuses and changes nothing: the request still counts where it was
    again = router.route(prompt)
    for w in (0, 1, 2):
        router.mark_down(w)
    with pytest.raises(ValueError, match="no worker"):
        router.reroute(prompt, again)
    assert router.loads[again] == 1


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_loop_delivers_each_tokens_logprobs(citylm, overlap):
    """Logprobs travel with their tokens in both loops (the overlapped one computes them on
    its device thread, a step ahead of the tokens' delivery)."""
    from serving import reference

    model, tok = citylm
    events = Collector()
    logprobs: dict[int, list] = {}

    def collect(batch, snapshot):
        for e in batch:
            if e.logprobs is not None:
                logprobs.setdefault(e.key, []).extend(e.logprobs)
        events(batch, snapshot)

    loop = EngineLoop(Engine(model, kv_capacity=300, max_running=4, overlap=overlap), collect)
    loop.start()
    try:
        prompts = [tok.encode(t) for t in ("FR:", "JP:", "US:")]
        for key, prompt in enumerate(prompts):
            loop.submit(key, loop.make_request(prompt, SamplingParams(
                12, logprobs=2 if key != 1 else None)))
        events.wait(lambda: len(events.finish) == 3)
    finally:
        loop.stop()
    assert 1 not in logprobs
    for key in (0, 2):
        tokens, logps = reference(model, prompts[key], SamplingParams(12))
        assert events.tokens[key] == tokens
        assert [v for v, _ in logprobs[key]] == pytest.approx(logps, abs=1e-5)
        assert all(len(top) == 2 and top[0][1] >= v - 1e-6 for v, top in logprobs[key])


def test_worker_timeout_is_a_flag_with_a_checked_value():
    from minisrv.server.cli import build_parser, server_config
    from minisrv.server.config import ServerConfig
    from minisrv.server.worker import beat_interval

    args = build_parser().parse_args(["serve", "--worker-timeout", "2.5"])
    assert server_config(args).worker_timeout == 2.5
    assert ServerConfig().worker_timeout == 30.0
    for bad in (-1.0, float("nan"), True, "30"):
        with pytest.raises(ValueError, match="worker_timeout"):
            ServerConfig(worker_timeout=bad)
    # an idle loop beats several times per timeout, never slower than once a second
    assert beat_interval(2.0) == 0.5 and beat_interval(30.0) == 1.0 and beat_interval(0) == 1.0


def test_workers_come_from_a_fork_server_that_has_loaded_the_engine(monkeypatch):
    """On Linux a worker (and each restart) is forked from a fresh interpreter that has
    imported torch and the engine once, never from the threaded server process; macOS and
    Windows spawn a fresh interpreter per worker. A simulated engine's fork server imports
    its builder's module instead of the model's (no torch)."""
    import sys
    from multiprocessing import forkserver

    from minisrv.server.config import ServerConfig
    from minisrv.server.dataparallel import worker_context
    from minisrv.sim.served import sim_config

    ctx = worker_context(ServerConfig())
    assert ctx.get_start_method() == "forkserver"
    assert set(forkserver._forkserver._preload_modules) == {
        "minisrv.server.worker", "minisrv.engine", "minisrv.model"}
    worker_context(sim_config(ServerConfig(model="sim")))
    assert set(forkserver._forkserver._preload_modules) == {
        "minisrv.server.worker", "minisrv.engine", "minisrv.sim.served"}
    for platform in ("darwin", "win32"):
        monkeypatch.setattr(sys, "platform", platform)
        assert worker_context(ServerConfig()).get_start_method() == "spawn"
