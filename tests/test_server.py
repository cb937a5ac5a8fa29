"""The HTTP server, end to end: a real ``minisrv serve`` subprocess on a free local port,
talked to with the official ``openai`` client (and raw ``httpx`` for malformed bodies).

Every generated reply is checked against ``model.reference_generate`` of the request alone;
the ``--dp`` server routes with the real cache-aware ``minisrv.router.Router``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from serving import (  # noqa: E402
    KV_CAPACITY,  # noqa: F401
    ROOT,
    expected,
    metrics,
    reference,
    running_servers,
    stop_servers,
)

from minisrv.sampling import SamplingParams  # noqa: E402
from minisrv.workloads import city_prompts  # noqa: E402

LAYOUTS = (("--dp", "2"), ("--engine-thread",))
"""The worker layouts other than the default that ``test_worker_layouts_...`` compares."""


@pytest.fixture(scope="module")
def started() -> Iterator[list[tuple[str, list[int]]]]:
    """The module's server (the default layout: one engine in its own process) and the
    ``LAYOUTS`` servers, all started at once: the tests wait for one start, not two."""
    with running_servers(("--max-running", "64"), *LAYOUTS) as started:
        yield started


@pytest.fixture(scope="module")
def server(started) -> str:
    return started[0][0]


@pytest.fixture(scope="module")
def client(server: str):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0) as c:
        yield c


# ------------------------------------------------------------------------------ replies
@pytest.mark.parametrize("text", ["FR:", "JP: Tokyo,", "US: New York, Los Angeles,"])
def test_completion_greedy_matches_reference(client, citylm, text):
    out = client.completions.create(model="citylm", prompt=text, max_tokens=24, temperature=0)
    want_text, want_finish = expected(citylm, text, 24)
    assert out.choices[0].text == want_text
    assert out.choices[0].finish_reason == want_finish
    assert out.usage.prompt_tokens == len(citylm[1].encode(text))


def test_sampled_completion_matches_reference_with_seed(client, citylm):
    out = client.completions.create(model="citylm", prompt="DE:", max_tokens=30,
                                    temperature=0.9, top_p=0.9, seed=7)
    assert (out.choices[0].text, out.choices[0].finish_reason) == expected(
        citylm, "DE:", 30, temperature=0.9, top_p=0.9, seed=7)


def test_completion_stream_with_usage(client, citylm):
    stream = client.completions.create(model="citylm", prompt="BR:", max_tokens=30,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    want_text, want_finish = expected(citylm, "BR:", 30)
    assert text == want_text
    assert finishes[-1] == want_finish and set(finishes[:-1]) == {None}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == 4
    assert usage.completion_tokens == len(citylm[0].reference_generate(
        citylm[1].encode("BR:"), 30))


def test_chat_matches_reference_streaming_and_not(client, citylm):
    messages = [{"role": "user", "content": "IT:"}]
    out = client.chat.completions.create(model="citylm", messages=messages, max_tokens=25,
                                         temperature=0)
    want_text, want_finish = expected(citylm, "IT:", 25)
    assert out.choices[0].message.content == want_text
    assert out.choices[0].finish_reason == want_finish
    stream = client.chat.completions.create(model="citylm", messages=messages, max_tokens=25,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_text
    assert chunks[-1].choices[0].finish_reason == want_finish


def test_multi_turn_chat_is_the_concatenated_document(client, citylm):
    messages = [{"role": "user", "content": "FR:"},
                {"role": "assistant", "content": " Paris, Marseille\n"},
                {"role": "user", "content": "ES:"}]
    out = client.chat.completions.create(model="citylm", messages=messages, max_tokens=20,
                                         temperature=0)
    assert out.choices[0].message.content == expected(
        citylm, "FR: Paris, Marseille\nES:", 20)[0]


def test_n_choices_and_stop_strings(client, citylm):
    out = client.completions.create(model="citylm", prompt="FR:", max_tokens=30, n=3,
                                    temperature=0, stop=[", M"])
    full, _ = expected(citylm, "FR:", 30)
    assert ", M" in full  # the greedy reply lists Marseille second
    assert [c.index for c in out.choices] == [0, 1, 2]
    for choice in out.choices:
        assert choice.text == full[: full.index(", M")]
        assert choice.finish_reason == "stop"
    stream = client.completions.create(model="citylm", prompt="FR:", max_tokens=30,
                                       temperature=0, stop=", M", stream=True)
    assert "".join(c.choices[0].text for c in stream) == full[: full.index(", M")]


def test_token_id_prompts_and_models(client, citylm, server):
    ids = citylm[1].encode("JP:")
    out = client.completions.create(model="citylm", prompt=ids, max_tokens=10, temperature=0)
    assert out.choices[0].text == expected(citylm, "JP:", 10)[0]
    assert [m.id for m in client.models.list().data] == ["citylm"]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


# ------------------------------------------------------------------------------ errors
BAD_BODIES = {
    "malformed JSON": b'{"prompt": "FR:", ',
    "missing prompt": {"max_tokens": 4},
    "empty prompt": {"prompt": ""},
    "wrong type": {"prompt": "FR:", "max_tokens": "four"},
    "max_tokens < 1": {"prompt": "FR:", "max_tokens": 0},
    "outside the alphabet": {"prompt": "FR: Besançon"},
    "longer than the context": {"prompt": "FR:", "max_tokens": 600},
    "longer than the KV pool": {"prompt": "A" * 470, "max_tokens": 16},
    "unknown model": {"model": "gpt-4o", "prompt": "FR:"},
    "unsupported top_k": {"prompt": "FR:", "top_k": 5},
    "logprobs over 20": {"prompt": "FR:", "logprobs": 21},
    "seed of 2**64": {"prompt": "FR:", "seed": 2**64, "temperature": 1.0},
    "seed of -2**63 - 1": {"prompt": "FR:", "seed": -(2**63) - 1, "temperature": 1.0},
    "id outside the vocabulary": {"prompt": [0, 999]},
    "negative id": {"prompt": [0, -1]},
    "infinite temperature": b'{"prompt": "FR:", "temperature": 1e999}',
    "best_of": {"prompt": "FR:", "best_of": 3},
    "suffix": {"prompt": "FR:", "suffix": " end"},
    "JSON on CityLM (no braces)": {"prompt": "FR:", "response_format": {"type": "json_object"}},
    "presence_penalty out of range": {"prompt": "FR:", "presence_penalty": 3},
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_request_is_a_json_400_and_the_server_keeps_serving(server, citylm, case):
    body = BAD_BODIES[case]
    url = f"{server}/v1/completions"
    # 60 s, not httpx's 5: deciding the CityLM JSON case compiles a grammar over the
    # vocabulary, which took over 5 s on a loaded two-core machine (the answer, not its
    # speed, is what this test checks)
    for stream in (False, True):
        if isinstance(body, bytes):
            r = httpx.post(url, content=body, headers={"content-type": "application/json"},
                           timeout=60)
        else:
            r = httpx.post(url, json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    ok = httpx.post(url, json={"prompt": "FR:", "max_tokens": 8, "temperature": 0},
                    timeout=60).json()
    assert ok["choices"][0]["text"] == expected(citylm, "FR:", 8)[0]


def test_requests_refused_at_the_door_leave_a_running_stream_intact(server, citylm):
    """An out-of-range seed and out-of-vocabulary ids are 400s while a stream runs beside
    them, and that stream ends with exactly its reference tokens."""
    url = f"{server}/v1/completions"
    body = {"prompt": "US:", "max_tokens": 120, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        lines = r.iter_lines()
        pieces = []
        for line in lines:
            if line.startswith("data: "):
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
                break
        for bad in ({"prompt": "FR:", "seed": 2**64, "temperature": 1.0},
                    {"prompt": [0, 999, 5, -3]}, {"prompt": "FR:", "seed": 2**70, "n": 2}):
            answer = httpx.post(url, json=bad)
            assert answer.status_code == 400, answer.text
            assert len(answer.json()["error"]["message"]) < 300
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    pieces += [json.loads(e)["choices"][0]["text"] for e in rest[:-1]]
    assert "".join(pieces) == expected(citylm, "US:", 120, ignore_eos=True)[0]


def test_a_huge_bad_prompt_is_answered_quickly_with_a_short_message(server):
    """Text the tokenizer refuses gives a bounded message (the first positions and a count),
    tokenized off the event loop: /health answers meanwhile."""
    text = "é" * 200_000
    answer = httpx.post(f"{server}/v1/completions", json={"prompt": text}, timeout=60)
    message = answer.json()["error"]["message"]
    assert answer.status_code == 400 and "199995 more" in message and len(message) < 400


def test_chat_content_parts_and_unsupported_fields(server, citylm):
    url = f"{server}/v1/chat/completions"
    parts = [{"type": "text", "text": "JP:"}, {"type": "text", "text": " Tokyo,"}]
    r = httpx.post(url, json={"messages": [{"role": "user", "content": parts}],
                              "max_tokens": 10, "temperature": 0})
    assert r.json()["choices"][0]["message"]["content"] == expected(citylm, "JP: Tokyo,",
                                                                    10)[0]
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    for body in ({"messages": [{"role": "user", "content": image}]},
                 {"messages": [{"role": "user", "content": "FR:"}], "tools": [
                     {"type": "function", "function": {"name": "f"}}]},
                 {"messages": [{"role": "user", "content": "FR:"}],
                  "response_format": {"type": "json_object"}},
                 {"messages": [{"role": "user", "content": "FR:"}], "top_logprobs": 21,
                  "logprobs": True}):
        r = httpx.post(url, json=body)
        assert r.status_code == 400 and r.json()["error"]["message"], body


def test_bad_chat_requests(server):
    url = f"{server}/v1/chat/completions"
    for body in ({"messages": []}, {"messages": [{"role": "user", "content": "é"}]},
                 {"messages": [{"role": "user", "content": ""}]},
                 {"messages": [{"role": "user", "content": "FR:"}], "temperature": "hot"}):
        r = httpx.post(url, json=body)
        assert r.status_code == 400 and "error" in r.json()


# ------------------------------------------------------------------------------ load
def test_200_concurrent_streams_get_their_offline_tokens(server, citylm):
    model, tok = citylm
    prompts = [tok.decode(p) for p in city_prompts(tok, 200, seed=3)]
    lengths = [1 + i % 6 for i in range(200)]
    want = {}
    for text, m in zip(prompts, lengths):
        if (text, m) not in want:
            want[text, m] = expected(citylm, text, m)

    async def one(c, text: str, m: int) -> tuple[str, str]:
        stream = await c.completions.create(model="citylm", prompt=text, max_tokens=m,
                                            temperature=0, stream=True)
        pieces, finish = [], None
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(pieces), finish

    async def run() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none",
                                      max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, t, m) for t, m in zip(prompts, lengths)))

    got = asyncio.run(run())
    assert got == [want[t, m] for t, m in zip(prompts, lengths)]
    after = metrics(server)
    assert after["minisrv:num_running_reqs"] == 0 and after["minisrv:token_usage"] == 0


async def give_up_while_running(server: str, body: dict) -> dict[str, float]:
    """Post ``body`` without streaming, wait until it runs, then close the connection."""
    async with httpx.AsyncClient(timeout=60) as c:
        task = asyncio.create_task(c.post(f"{server}/v1/completions", json=body))
        for _ in range(200):
            await asyncio.sleep(0.05)
            running = await asyncio.to_thread(metrics, server)
            if running["minisrv:num_running_reqs"] == 1:
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    return running


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_the_request_and_frees_its_kv(server, stream):
    before = metrics(server)["minisrv:num_aborted_reqs_total"]
    body = {"prompt": "FR:", "max_tokens": 400, "ignore_eos": True, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{server}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data:"):
                pass
            running = metrics(server)
    else:  # the client gives up waiting for the whole body
        running = asyncio.run(give_up_while_running(server, body))
    assert running["minisrv:num_running_reqs"] == 1
    assert running["minisrv:token_usage"] > 0
    for _ in range(200):  # bounded wait for the server to notice
        now = metrics(server)
        if now["minisrv:num_aborted_reqs_total"] > before:
            break
        time.sleep(0.05)
    assert now["minisrv:num_aborted_reqs_total"] == before + 1
    for _ in range(50):
        now = metrics(server)
        if now["minisrv:token_usage"] == 0:
            break
        time.sleep(0.05)
    assert now["minisrv:num_running_reqs"] == 0 and now["minisrv:token_usage"] == 0


def test_metrics_parse_and_name_every_series(server, client):
    for _ in range(2):  # the second finds the first's prompt cached, whatever ran before
        client.completions.create(model="citylm", prompt="FR:", max_tokens=5, temperature=0)
    text = httpx.get(f"{server}/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    for name in ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate",
                 "prompt_tokens", "generation_tokens", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert f"minisrv:{name}" in names
    values = metrics(server)
    assert values["minisrv:prompt_tokens_total"] >= 4
    assert values["minisrv:generation_tokens_total"] >= 5
    assert values["minisrv:time_to_first_token_seconds_count"] >= 1
    assert 0 < values["minisrv:cache_hit_rate"] < 1  # "FR:" was served before: cached


def test_bench_cli_prints_its_table(server, tmp_path):
    """The report on stdout; with --output-json and --output-details, each request's TTFT
    and send time too (``time.perf_counter()``, the clock a server on this machine reads)."""
    report = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "minisrv", "bench", "--base-url", server, "--num-prompts",
           "24", "--max-concurrency", "8", "--output-len", "2", "6", "--no-progress",
           "--output-json", str(report), "--output-details"]
    before = time.perf_counter()
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^Successful requests:\s+24\s*$", out.stdout, re.M), out.stdout
    for line in ("Output token throughput (tok/s):", "Median TTFT (ms):", "P99 ITL (ms):",
                 "Mean E2E Latency (ms):"):
        assert line in out.stdout
    details = json.loads(report.read_text())
    assert details["completed"] == 24 and len(details["ttfts_ms"]) == 24
    assert all(before < t < time.perf_counter() for t in details["sent"])


# ------------------------------------------------------------------------------ --dp
DP_PROMPTS = [f"{code}:" for code in ("FR", "JP", "US", "DE", "BR", "IN", "CN", "IT")]


def answers(url: str) -> list[str]:
    body = {"max_tokens": 12, "temperature": 0}
    return [httpx.post(f"{url}/v1/completions", json={**body, "prompt": p}).json()
            ["choices"][0]["text"] for p in DP_PROMPTS]


def test_worker_layouts_serve_the_same_tokens_and_stop_cleanly(started):
    """``--dp 2`` (two engines behind the router) and ``--engine-thread`` (the engine in a
    thread of the HTTP process) serve exactly what the default layout (one engine in its own
    process) serves. Until an engine is up /health says 503, never 200 (whether uvicorn
    answers before the engines are up depends on the machine's load, so a 503 need not be
    seen here: ``test_health_says_starting_until_the_engine_is_built_then_ok`` forces that
    order). Then SIGTERM stops both cleanly, their engine processes with them
    (``stops_cleanly``; both started with the module's server, see ``started``)."""
    (server, _), *layouts = started
    want = answers(server)
    for url, seen in layouts:
        assert seen[-1] == 200 and set(seen[:-1]) <= {503}
        assert answers(url) == want
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "A" * 470})
        assert r.status_code == 400 and "kv_capacity" in r.json()["error"]["message"]
    stop_servers([url for url, _ in layouts], stops_cleanly=True)


def test_cli_takes_one_engine_layout(capsys):
    """In this process: the flags are parsed before anything loads (the entry point itself
    runs as a command in the test below)."""
    from minisrv.server.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--engine-thread", "--engine-process"])
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_cli_sets_the_admission_order_and_refuses_it_with_chunked_prefill(capsys):
    """``--admission-order lock-round-first`` is the order the chapter on serving advises
    where the prefix cache matters; chunked prefill cuts admissions one at a time, so the
    engine refuses the pair, and the CLI says so in one line (exit 2), before loading."""
    from minisrv.server.cli import build_parser, main, server_config

    def order(*flags: str) -> str:
        return server_config(build_parser().parse_args(["serve", *flags])).engine.admission_order

    assert order() == "allocate-each"
    assert order("--admission-order", "lock-round-first") == "lock-round-first"
    for flags, says in ((["--admission-order", "lock-round-first",
                          "--chunked-prefill-size", "64"], "admission_order='allocate-each'"),
                        (["--admission-order", "nope"], "lock-round-first")):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", *flags])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and says in err and "Traceback" not in err


def test_cli_rejects_bad_engine_options_before_loading():
    cmd = [sys.executable, "-m", "minisrv", "serve", "--policy", "nope"]
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "policy" in out.stderr and "fcfs" in out.stderr


# ------------------------------------------------------------------------------ sampler
def test_completion_logprobs_are_the_log_softmax_of_the_reference_forward(server, citylm):
    model, tok = citylm
    body = {"prompt": "FR:", "max_tokens": 12, "temperature": 0, "logprobs": 3}
    choice = httpx.post(f"{server}/v1/completions", json=body).json()["choices"][0]
    tokens, logps = reference(model, tok.encode("FR:"), SamplingParams(12, logprobs=3))
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.id_to_str(t) for t in tokens]
    assert lp["token_logprobs"] == pytest.approx(logps, abs=1e-4)
    assert all(len(top) == 3 and max(top.values()) >= v - 1e-6
               for top, v in zip(lp["top_logprobs"], lp["token_logprobs"]))
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    plain = httpx.post(f"{server}/v1/completions", json={**body, "logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None  # computed only when asked


def test_the_openai_client_streams_logprobs(client, citylm):
    model, tok = citylm
    tokens, logps = reference(model, tok.encode("JP:"), SamplingParams(10, logprobs=2))
    stream = client.completions.create(model="citylm", prompt="JP:", max_tokens=10,
                                       temperature=0, logprobs=2, stream=True)
    got = [v for chunk in stream if chunk.choices and chunk.choices[0].logprobs
           for v in chunk.choices[0].logprobs.token_logprobs]
    assert got == pytest.approx(logps, abs=1e-4)
    chat = client.chat.completions.create(
        model="citylm", messages=[{"role": "user", "content": "JP:"}], max_tokens=10,
        temperature=0, logprobs=True, top_logprobs=2, stream=True)
    records = [r for chunk in chat if chunk.choices and chunk.choices[0].logprobs
               for r in chunk.choices[0].logprobs.content]
    assert [r.logprob for r in records] == pytest.approx(logps, abs=1e-4)
    assert [r.token for r in records] == [tok.id_to_str(t) for t in tokens]
    assert all(len(r.top_logprobs) == 2 for r in records)


def params_of(body: dict) -> SamplingParams:
    """The ``SamplingParams`` an OpenAI body's processor fields mean."""
    return SamplingParams(
        body["max_tokens"], temperature=body["temperature"], seed=body.get("seed"),
        presence_penalty=body.get("presence_penalty", 0.0),
        frequency_penalty=body.get("frequency_penalty", 0.0),
        repetition_penalty=body.get("repetition_penalty", 1.0),
        logit_bias=tuple(sorted((int(k), float(v))
                                for k, v in body.get("logit_bias", {}).items())),
        min_tokens=body.get("min_tokens", 0))


EOS_FIRST = {"logit_bias": {"1": 100}}  # <eos> at once, unless min_tokens holds it back


@pytest.mark.parametrize(("extra", "without"), [
    ({"presence_penalty": 2.0, "temperature": 0.9, "seed": 3},
     {"temperature": 0.9, "seed": 3}),
    ({"frequency_penalty": 1.2}, {}), ({"repetition_penalty": 1.6}, {}),
    ({"logit_bias": {"9": 30.0, "3": -100}}, {}),
    ({**EOS_FIRST, "min_tokens": 6}, EOS_FIRST)])
def test_each_penalty_equals_the_per_request_reference(server, citylm, extra, without):
    """Each processor, through the server, gives the reply of the per-request reference,
    and that reply differs from the one without it (so the test would see it ignored)."""
    model, tok = citylm
    prompt = tok.encode("FR:")
    body = {"prompt": "FR:", "max_tokens": 40, "temperature": 0, **extra}
    tokens, _ = reference(model, prompt, params_of(body))
    got = httpx.post(f"{server}/v1/completions", json=body).json()["choices"][0]
    assert got["text"] == tok.decode(tokens)
    plain, _ = reference(model, prompt, params_of({"max_tokens": 40, "temperature": 0,
                                                   **without}))
    assert tokens != plain
