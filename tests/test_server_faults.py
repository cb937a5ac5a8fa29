"""The server under faults, against real ``minisrv serve`` subprocesses: a worker killed
under load (``--dp 1`` and ``--dp 2``), hostile bodies at the door, an API key, and
SIGTERM under 200 streams.

What must hold: a dead worker's in-flight requests end at once (an error event and
``[DONE]`` on a stream, a 503 otherwise), never hang, except those it had not taken from its
inbox yet, which another worker serves (only with no other worker up are they a 503 with
``Retry-After``); a worker that dies while idle costs no request; while no worker is up,
requests get 503 with ``Retry-After``; the worker restarts and serves the same tokens as
before; ``/health`` and ``/metrics`` say so. Shutdown never answers 500 and never cuts a stream
without an error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
from serving import expected, metrics, running_servers  # noqa: E402

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"prompt": "FR:", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


async def read_stream(c: httpx.AsyncClient, url: str, body: dict[str, Any],
                      started: asyncio.Event | None = None) -> dict[str, Any]:
    """POST a streaming ``body``; the status, every ``data:`` payload, and when it ended."""
    async with c.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                        headers=AUTH) as r:
        events: list[Any] = []
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "events": [], "end": time.monotonic(),
                    "body": r.text}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            if started is not None and len(events) == 1:
                started.set()
    return {"status": 200, "events": events, "end": time.monotonic()}


def error_of(events: list[Any]) -> dict[str, Any] | None:
    """The stream's error event, if it has one."""
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    return errors[0] if errors else None


def text_of(events: list[Any]) -> str:
    return "".join(e["choices"][0]["text"] for e in events
                   if isinstance(e, dict) and e.get("choices"))


def worker_pids(url: str) -> list[int]:
    return [w["pid"] for w in httpx.get(f"{url}/workers", headers=AUTH).json()["workers"]]


def wait_all_up(url: str, timeout: float = 120) -> list[dict[str, Any]]:
    """Wait until every worker is up; ``/workers``' list of them."""
    deadline = time.monotonic() + timeout
    while True:
        workers = httpx.get(f"{url}/workers").json()["workers"]
        if all(w["state"] == "up" for w in workers):
            return workers
        assert time.monotonic() < deadline, workers
        time.sleep(0.05)


def wait_status(url: str, status: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(f"{url}/workers").json()
        if health["status"] == status:
            return health
        time.sleep(0.05)
    raise AssertionError(f"/health never said {status!r}: {health}")


async def kill_under_load(url: str, n_streams: int, victim: int,
                          meanwhile: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Start ``n_streams`` long streams and one long non-streaming request, kill worker
    ``victim`` once every stream has its first event, and gather what each got; what
    ``meanwhile()`` (run in a thread just after the kill, while the streams go on) returns
    is under ``"meanwhile"``."""
    async with httpx.AsyncClient(timeout=60) as c:
        started = [asyncio.Event() for _ in range(n_streams)]
        streams = [asyncio.create_task(read_stream(c, url, LONG, s)) for s in started]
        whole = asyncio.create_task(c.post(f"{url}/v1/completions", json=LONG, headers=AUTH))
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
        pid = (await asyncio.to_thread(worker_pids, url))[victim]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        seen = None if meanwhile is None else await asyncio.to_thread(meanwhile)
        results = await asyncio.wait_for(asyncio.gather(*streams), 30)
        answer = await asyncio.wait_for(whole, 30)
        return {"killed": killed, "streams": results, "whole": answer, "pid": pid,
                "meanwhile": seen}


@pytest.fixture(scope="module")
def servers():
    """A ``--dp 1`` and a ``--dp 2`` server, and the server that
    ``test_sigterm_under_200_streams_...`` alone uses and stops, all started at once (the
    tests wait for one start, not two). The first two's KV pool holds ``kill_under_load``'s
    nine requests of 404 tokens at once, so every stream runs from its first step and the
    kill lands with all of them in flight (``serving``'s pool of 480 ran them one after
    another: the last stream's first token came after some 3000 tokens, 15 s on a loaded
    machine). The restart backoff is each test's wait for its restart: 1 s where a test
    meanwhile only asks for a 503 and /health, 2 s where worker 1 serves three requests."""
    pool = ("--kv-capacity", "4000", "--api-key", KEY)
    with running_servers((*pool, "--restart-backoff", "1", "--body-timeout", "1",
                          "--max-request-bytes", "65536"),
                         ("--dp", "2", *pool, "--restart-backoff", "2"),
                         ("--shutdown-timeout", "1", "--max-running", "200",
                          "--kv-capacity", "41000")) as started:
        yield [url for url, _ in started]


def test_a_killed_worker_fails_its_requests_at_once_and_comes_back(servers, citylm):
    url = servers[0]

    def while_down() -> tuple[httpx.Response, dict[str, str]]:
        """Once the death is seen, a request; it restarts only after the 1 s backoff."""
        while httpx.get(f"{url}/health").json() != {"status": "restarting"}:
            time.sleep(0.02)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "FR:"}, headers=AUTH,
                       timeout=5)
        return r, httpx.get(f"{url}/health").json()

    got = asyncio.run(kill_under_load(url, 8, 0, meanwhile=while_down))
    in_flight = 0
    for result in got["streams"]:  # each one complete, or ended by an error and [DONE]
        assert result["status"] == 200 and result["events"][-1] == "[DONE]"
        error = error_of(result["events"])
        if error is None:  # it had finished before the kill
            assert result["end"] < got["killed"]
            assert text_of(result["events"]) == expected(citylm, "FR:", 400, ignore_eos=True)[0]
            continue
        in_flight += 1
        assert error["code"] == 503 and result["end"] - got["killed"] < 2.0
    assert in_flight >= 1
    assert got["whole"].status_code in (200, 503)
    # no worker is up (it restarts after 1 s): 503 with Retry-After, never a hang
    r, health = got["meanwhile"]
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert health == {"status": "restarting"}
    health = wait_status(url, "ok")
    assert health["workers"][0]["restarts"] == 1 and health["workers"][0]["pid"] != got["pid"]
    r = httpx.post(f"{url}/v1/completions", headers=AUTH,
                   json={"prompt": "JP:", "max_tokens": 12, "temperature": 0})
    assert r.json()["choices"][0]["text"] == expected(citylm, "JP:", 12)[0]
    m = metrics(url)
    assert m["minisrv:num_workers_up"] == 1 and m["minisrv:num_running_reqs"] == 0
    assert m["minisrv:num_failed_reqs_total"] >= in_flight


def test_with_two_workers_the_survivor_serves_while_the_other_restarts(servers, citylm):
    url = servers[1]

    def while_restarting() -> tuple[list[str], str]:
        """Once worker 0 is seen dead, three requests; worker 0's state after them (it
        restarts only after the 2 s backoff, so they were served by worker 1)."""
        while httpx.get(f"{url}/workers").json()["workers"][0]["state"] != "restarting":
            time.sleep(0.02)
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        texts = [httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=30,
                            json={"prompt": text, "max_tokens": 8, "temperature": 0}
                            ).json()["choices"][0]["text"] for text in ("JP:", "DE:", "IT:")]
        return texts, httpx.get(f"{url}/workers").json()["workers"][0]["state"]

    got = asyncio.run(kill_under_load(url, 8, 0, meanwhile=while_restarting))
    failed = [r for r in got["streams"] if error_of(r["events"]) is not None]
    done = [r for r in got["streams"] if r not in failed]
    assert failed and all(r["end"] - got["killed"] < 2.0 for r in failed)
    assert all(error_of(r["events"])["code"] == 503 for r in failed)
    assert all(r["events"][-1] == "[DONE]" for r in got["streams"])
    assert all(text_of(r["events"]) == expected(citylm, "FR:", 400, ignore_eos=True)[0]
               for r in done)  # those worker 1 served (the router may send it none)
    # while worker 0 restarts, every new request goes to worker 1 and succeeds
    texts, state = got["meanwhile"]
    assert texts == [expected(citylm, text, 8)[0] for text in ("JP:", "DE:", "IT:")]
    assert state == "restarting"
    wait_all_up(url)
    assert metrics(url)["minisrv:num_workers_up"] == 2


async def kill_before_taken(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Stop every worker (SIGSTOP), post ``body``, and once a worker has it in its inbox
    (``/workers``' ``in_flight``), kill that worker and let the others go on: the kill lands
    before the worker took the request. The answer, and which worker died."""
    pids = await asyncio.to_thread(worker_pids, url)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as c:
            answer = asyncio.create_task(c.post(f"{url}/v1/completions", json=body))
            deadline = time.monotonic() + 30
            while not (holders := [w["index"] for w in
                                   (await c.get(f"{url}/workers")).json()["workers"]
                                   if w["in_flight"]]):
                assert time.monotonic() < deadline and not answer.done()
                await asyncio.sleep(0.02)
            [victim] = holders
            os.kill(pids[victim], signal.SIGKILL)
            for pid in pids:
                if pid != pids[victim]:
                    os.kill(pid, signal.SIGCONT)
            return {"answer": await asyncio.wait_for(answer, 30), "victim": victim,
                    "pid": pids[victim]}
    finally:  # never leave a stopped process behind, whatever the server did
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def test_a_request_its_worker_died_before_taking_is_served_by_the_other(servers, citylm):
    url = servers[1]
    wait_all_up(url)
    failed = metrics(url)["minisrv:num_failed_reqs_total"]
    got = asyncio.run(kill_before_taken(url, {"prompt": "DE:", "max_tokens": 12,
                                              "temperature": 0}))
    assert got["answer"].status_code == 200, got["answer"].text
    assert got["answer"].json()["choices"][0]["text"] == expected(citylm, "DE:", 12)[0]
    workers = httpx.get(f"{url}/workers").json()["workers"]
    assert [w["in_flight"] for w in workers] == [0, 0]  # the router's load moved with it
    assert metrics(url)["minisrv:num_failed_reqs_total"] == failed
    assert wait_all_up(url)[got["victim"]]["pid"] != got["pid"]


def test_a_worker_killed_while_idle_costs_no_request(servers, citylm):
    url = servers[1]
    pid = wait_all_up(url)[0]["pid"]
    failed = metrics(url)["minisrv:num_failed_reqs_total"]
    prompts = ["FR:", "JP:", "DE:", "IT:"] * 5
    os.kill(pid, signal.SIGKILL)
    for prompt in prompts:  # at once, one at a time: the first may race the death
        r = httpx.post(f"{url}/v1/completions", headers=AUTH,
                       json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected(citylm, prompt, 8)[0]
    assert metrics(url)["minisrv:num_failed_reqs_total"] == failed
    assert wait_all_up(url)[0]["pid"] != pid


def test_with_one_worker_a_request_it_never_took_is_a_503_until_it_is_back(servers, citylm):
    url = servers[0]
    wait_status(url, "ok")
    got = asyncio.run(kill_before_taken(url, {"prompt": "FR:", "max_tokens": 8}))
    r = got["answer"]  # nobody else could take it: retry
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert "died" in r.json()["error"]["message"]
    statuses, deadline = [], time.monotonic() + 120
    while not statuses or statuses[-1] != 200:
        assert time.monotonic() < deadline, statuses[-5:]
        r = httpx.post(f"{url}/v1/completions", headers=AUTH,
                       json={"prompt": "JP:", "max_tokens": 12, "temperature": 0})
        statuses.append(r.status_code)
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
            time.sleep(0.05)
    assert statuses[0] == 503 and set(statuses) == {503, 200}
    assert r.json()["choices"][0]["text"] == expected(citylm, "JP:", 12)[0]


def test_api_key_models_and_unsupported_fields(servers):
    url = servers[0]
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}
                     ).status_code == 401
    assert httpx.get(f"{url}/health").status_code in (200, 503)  # open to probes
    card = httpx.get(f"{url}/v1/models/citylm", headers=AUTH).json()
    assert card["id"] == "citylm" and card["object"] == "model"
    missing = httpx.get(f"{url}/v1/models/gpt-4o", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def raw_post(url: str, head: bytes, body: bytes = b"") -> tuple[bytes, float]:
    """Send a request's head and part of its body on a raw socket; the answer's first line
    and how long it took to come."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        start = time.monotonic()
        s.sendall(head + body)
        answer = s.recv(4096)
        return answer.split(b"\r\n", 1)[0], time.monotonic() - start


def test_an_oversized_body_is_a_413_before_it_is_read(servers):
    url = servers[0]
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 50000000\r\n\r\n")
    line, took = raw_post(url, head, b'{"prompt": "')
    assert b" 413 " in line and took < 1.0
    # a body that says nothing of its size (chunked) is cut off once it passes the limit
    r = httpx.post(f"{url}/v1/completions", headers=AUTH,
                   content=iter([b'{"prompt": "' + b"A" * 70000, b'"}']))
    assert r.status_code == 413 and "65536" in r.json()["error"]["message"]


def test_a_slow_body_times_out(servers):
    url = servers[0]
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n")
    line, _ = raw_post(url, head, b'{"prompt": ')  # and then nothing
    assert b" 408 " in line


def test_sigterm_under_200_streams_ends_every_one_and_answers_no_500(servers, citylm):
    url = servers[2]

    async def run() -> tuple[list[dict[str, Any]], list[int]]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(
                max_connections=300)) as c:
            body = {"prompt": "FR:", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
            started = [asyncio.Event() for _ in range(200)]
            streams = [asyncio.create_task(read_stream(c, url, body, s)) for s in started]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 120)
            os.kill(pid, signal.SIGTERM)
            await asyncio.sleep(0.2)
            late = []
            for _ in range(3):  # draining: refused with 503 (or no longer listening)
                try:
                    late.append((await c.post(f"{url}/v1/completions",
                                              json={"prompt": "FR:"})).status_code)
                except httpx.TransportError:
                    late.append(0)
            return await asyncio.gather(*streams), late

    pid = httpx.get(f"{url}/workers").json()["pid"]
    results, late = asyncio.run(run())
    for r in results:
        assert r["status"] == 200 and r["events"][-1] == "[DONE]"  # never a silent cut
        error = error_of(r["events"])
        if error is not None:
            assert error["code"] == 503
        else:  # it finished within the drain
            assert text_of(r["events"]) == expected(citylm, "FR:", 200, ignore_eos=True)[0]
    assert all(code in (0, 503) for code in late)

