"""A worker that is alive but makes no progress, against real ``minisrv serve`` subprocesses
(``--dp 1`` and ``--dp 2``): the worker is stopped (SIGSTOP) under load.

What must hold: an idle worker is never taken for a hung one; a stopped worker with
requests in flight is killed once ``--worker-timeout`` has passed, and its requests end
then (an error event and ``[DONE]`` on a stream, a 503 otherwise), within the timeout and
2 s; it is taken out of the router (the other worker keeps serving), restarted, and serves
the same tokens as before when it is back; ``/health`` says so at every stage.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
from serving import expected, metrics, running_servers  # noqa: E402
from test_server_faults import error_of, read_stream, text_of, wait_status  # noqa: E402

TIMEOUT = 1.0  # --worker-timeout of the servers under test (each test waits it out once)
PROMPTS = ["FR:", "JP:", "DE:", "IT:"]
"""The long streams: no shared prefix, so ``--dp 2``'s router spreads them and the long
request by load, two or three to each worker (each finished stream's 400-token reference
costs a second of CPU: four streams, not eight, keep one on each worker)."""
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}


@functools.cache
def reference(citylm, prompt: str, max_tokens: int) -> str:
    """The greedy reply to ``prompt`` generated alone (``ignore_eos``), computed once."""
    return expected(citylm, prompt, max_tokens, ignore_eos=True)[0]


def workers(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/workers").json()["workers"]


@pytest.fixture(scope="module")
def servers():
    """A ``--dp 1`` and a ``--dp 2`` server with a worker timeout of ``TIMEOUT``, left idle
    for longer than that and five of the watchdog's looks (every 0.1 s) once up (each test
    then checks that nobody was killed meanwhile)."""
    common = ("--worker-timeout", str(TIMEOUT), "--restart-backoff", "2",
              "--kv-capacity", "4000")
    with running_servers(common, ("--dp", "2", *common)) as started:
        urls = [url for url, _ in started]
        before = {url: workers(url) for url in urls}
        time.sleep(TIMEOUT + 0.5)
        yield urls, before


async def stop_under_load(url: str, victim: int) -> dict[str, Any]:
    """Long streams (one per prompt) and one long non-streaming request; once every stream
    has its first token, stop worker ``victim`` and gather what each request got."""
    async with httpx.AsyncClient(timeout=60) as c:
        started = [asyncio.Event() for _ in PROMPTS]
        streams = [asyncio.create_task(read_stream(c, url, {"prompt": p, **LONG}, s))
                   for p, s in zip(PROMPTS, started)]

        async def whole() -> tuple[httpx.Response, float]:
            r = await c.post(f"{url}/v1/completions", json={"prompt": "GB:", **LONG})
            return r, time.monotonic()

        single = asyncio.create_task(whole())
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
        pid = (await asyncio.to_thread(workers, url))[victim]["pid"]
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            during = None
            for ending in asyncio.as_completed(streams, timeout=30):
                if error_of((await ending)["events"]) is not None:  # the first one failed:
                    during = await asyncio.to_thread(look, url)  # the worker is restarting
                    break
            results = await asyncio.wait_for(asyncio.gather(*streams), 30)
            answer, answered = await asyncio.wait_for(single, 30)
        finally:  # never leave a stopped process behind, whatever the server did
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return {"stopped": stopped, "streams": results, "whole": answer,
                "whole_end": answered, "pid": pid, "during": during}


def look(url: str) -> dict[str, Any]:
    """/health, each worker's state and a new request's answer, at one moment."""
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "FR:", "max_tokens": 12,
                                                  "temperature": 0, "ignore_eos": True})
    return {"health": httpx.get(f"{url}/health").json(),
            "states": [w["state"] for w in workers(url)], "answer": r}


def check_ends(got: dict[str, Any], citylm) -> tuple[int, int]:
    """Every stream either finished with its reference text or ended, within the timeout
    and 2 s of the stop, with a 503 error event naming the hang and ``[DONE]``; returns
    (failed, finished)."""
    failed = finished = 0
    for prompt, result in zip(PROMPTS, got["streams"]):
        assert result["status"] == 200 and result["events"][-1] == "[DONE]"
        error = error_of(result["events"])
        if error is None:
            assert text_of(result["events"]) == reference(citylm, prompt, 400)
            finished += 1
            continue
        failed += 1
        assert error["code"] == 503 and "no progress" in error["message"]
        assert result["end"] - got["stopped"] < TIMEOUT + 2.0
    return failed, finished


def check_served_again(url: str, citylm) -> None:
    for prompt in ("JP:", "DE:"):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 12,
                                                      "temperature": 0, "ignore_eos": True})
        assert r.json()["choices"][0]["text"] == reference(citylm, prompt, 12)


def test_a_stopped_worker_is_killed_after_the_timeout_and_restarted(servers, citylm):
    (url, _), before = servers
    assert [(w["pid"], w["restarts"], w["state"]) for w in workers(url)] == [
        (before[url][0]["pid"], 0, "up")]  # idle past the timeout: never taken for hung
    got = asyncio.run(stop_under_load(url, 0))
    failed, _ = check_ends(got, citylm)
    assert failed >= 1
    assert got["whole"].status_code == 503 and int(got["whole"].headers["retry-after"]) >= 1
    assert got["whole_end"] - got["stopped"] < TIMEOUT + 2.0
    # the worker restarts 2 s after it was killed: meanwhile 503 with Retry-After
    during = got["during"]
    r = during["answer"]
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert during["health"] == {"status": "restarting"} and during["states"] == ["restarting"]
    health = wait_status(url, "ok")
    assert health["workers"][0]["restarts"] == 1 and health["workers"][0]["pid"] != got["pid"]
    check_served_again(url, citylm)
    m = metrics(url)
    assert m["minisrv:num_workers_up"] == 1 and m["minisrv:num_running_reqs"] == 0
    assert m["minisrv:num_failed_reqs_total"] >= failed + 1


def test_with_two_workers_the_other_serves_while_the_stopped_one_restarts(servers, citylm):
    (_, url), before = servers
    assert [(w["pid"], w["restarts"], w["state"]) for w in workers(url)] == [
        (w["pid"], 0, "up") for w in before[url]]  # idle past the timeout: nobody killed
    got = asyncio.run(stop_under_load(url, 0))
    failed, finished = check_ends(got, citylm)
    assert failed >= 1 and finished >= 1  # the requests of worker 1 ran to their end
    whole = got["whole"]
    assert whole.status_code == 503 or whole.json()["choices"][0]["text"] == reference(
        citylm, "GB:", 400)
    # while worker 0 restarts, the server is up and worker 1 takes every new request
    during = got["during"]
    assert during["health"] == {"status": "ok"} and during["states"] == ["restarting", "up"]
    assert during["answer"].json()["choices"][0]["text"] == reference(citylm, "FR:", 12)
    deadline = time.monotonic() + 120
    while workers(url)[0]["state"] != "up":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert workers(url)[0]["restarts"] == 1 and workers(url)[1]["restarts"] == 0
    assert metrics(url)["minisrv:num_workers_up"] == 2
    check_served_again(url, citylm)
