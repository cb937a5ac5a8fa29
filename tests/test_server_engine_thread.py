"""A hung engine thread (``--engine-thread``): its requests end with a 503 once
``--worker-timeout`` has passed, and a new engine serves the same tokens as before.

The engine's ``step`` is made to block (as a kernel that never returns would) on the first
step after ``hang`` is set; the watchdog must notice the stopped heartbeat, end the request
in flight, drop whatever the abandoned thread sends if it comes back, and start a new
engine. An idle engine (no request in flight) is never taken for a hung one.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

pytest.importorskip("fastapi")
from starlette.testclient import TestClient  # noqa: E402

from minisrv.model import load_tokenizer  # noqa: E402
from minisrv.server.app import create_app  # noqa: E402
from minisrv.server.cli import build_parser, server_config  # noqa: E402
from minisrv.server.worker import LocalEngine, build_engine  # noqa: E402

TIMEOUT = 1.0  # --worker-timeout


def wait_healthy(client: TestClient, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, client.get("/health").json()
        time.sleep(0.05)


def test_health_says_starting_until_the_engine_is_built_then_ok(citylm) -> None:
    """/health answers 503 ``starting`` (and a request a 503 with Retry-After) for as long as
    the engine is being built, and 200 once it is: the builder is held on an event, so the
    order is forced rather than left to how fast the machine loads a model."""
    built = threading.Event()

    def builder(config):
        built.wait(60)
        return build_engine(dataclasses.replace(config, builder=None))

    args = build_parser().parse_args(["serve", "--engine-thread"])
    engines = LocalEngine(dataclasses.replace(server_config(args), builder=builder))
    with TestClient(create_app(engines, load_tokenizer("citylm"), "citylm")) as client:
        for _ in range(3):
            r = client.get("/health")
            assert r.status_code == 503 and r.json() == {"status": "starting"}
            time.sleep(0.05)
        r = client.post("/v1/completions", json={"prompt": "FR:", "max_tokens": 2})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        built.set()
        wait_healthy(client)
        assert client.get("/health").json() == {"status": "ok"}


def test_a_hung_engine_thread_fails_its_request_and_a_new_engine_serves(citylm) -> None:
    model, tok = citylm
    hang, release = threading.Event(), threading.Event()

    def builder(config):
        engine, limits = build_engine(dataclasses.replace(config, builder=None))
        step = engine.step

        def hanging_step():
            if hang.is_set():  # only the first engine's first step after hang.set()
                hang.clear()
                release.wait(60)
            return step()

        engine.step = hanging_step
        return engine, limits

    args = build_parser().parse_args(["serve", "--engine-thread",
                                      "--worker-timeout", str(TIMEOUT)])
    engines = LocalEngine(dataclasses.replace(server_config(args), builder=builder))
    body = {"prompt": "FR:", "max_tokens": 12, "temperature": 0}
    want = model.reference_generate(tok.encode("FR:"), 12)
    text = tok.decode([t for t in want if t not in model.eos_ids])
    with TestClient(create_app(engines, load_tokenizer("citylm"), "citylm")) as client:
        wait_healthy(client)
        # idle for longer than the timeout and two of the watchdog's looks (every TIMEOUT / 4):
        # not hung
        time.sleep(TIMEOUT + 0.5)
        assert engines.restarts == 0
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == text

        hang.set()
        start = time.monotonic()
        failed = client.post("/v1/completions", json=body)
        assert failed.status_code == 503
        assert "no progress" in failed.json()["error"]["message"]
        assert time.monotonic() - start < TIMEOUT + 2.0
        assert engines.restarts == 1

        wait_healthy(client)
        assert client.get("/workers").json()["workers"][0]["restarts"] == 1
        release.set()  # the abandoned thread finishes its step: nobody hears it
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == text
        assert engines.restarts == 1
