"""Real ``minisrv serve`` subprocesses for the server tests, and what their replies must be.

``running_servers`` starts one server per layout on free local ports, all at once, and
always stops them; ``expected`` is a reply generated alone, offline (the oracle).
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from minisrv.sampling import SamplingParams, make_generator, process_row, sample_next

ROOT = Path(__file__).resolve().parents[1]
KV_CAPACITY = 480  # below CityLM's 512-token context, so "too long for the pool" is testable

_LAUNCH = """
import sys
from minisrv.server.cli import main
main(sys.argv[1:])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STARTUP_S = 120.0
"""How long a test waits for a server to become healthy. A CityLM server's start costs about
2 s of CPU over three processes (HTTP 0.5 s, the fork server 1.3 s, most of it importing
torch, the worker 0.15 s) and took 7 s at a load of 4 on 2 cores, 33 s at a load of 12 and
up to 53 s in a loaded ``make test``: 120 s (``launch.running_server``'s default too) is
over twice the slowest start seen, so only a server that hangs or dies fails it."""


_RUNNING: dict[str, subprocess.Popen] = {}
"""The server process at each URL that ``running_servers`` started and has not stopped."""


@contextmanager
def running_servers(*layouts: tuple[str, ...], startup_s: float = STARTUP_S,
                    stops_cleanly: bool = False) -> Iterator[list[tuple[str, list[int]]]]:
    """One server per layout (extra CLI arguments), each on a free local port, all started
    at once; yields each one's base URL and the /health codes seen while it started
    (refused connections not counted). Always stopped at the end (``stop_servers``, checking
    that each stopped cleanly if ``stops_cleanly`` and the block ended without an error);
    ``stop_servers`` may stop some of them before that."""
    procs, urls = [], []
    clean = False
    try:
        for args in layouts:
            port = _free_port()
            cmd = [sys.executable, "-c", _LAUNCH, "serve", "--host", "127.0.0.1", "--port",
                   str(port), "--threads", "1", "--kv-capacity", str(KV_CAPACITY), *args]
            procs.append(subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                          cwd=ROOT, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True))
            urls.append(f"http://127.0.0.1:{port}")
            _RUNNING[urls[-1]] = procs[-1]
        deadline = time.monotonic() + startup_s
        seen: list[list[int]] = [[] for _ in layouts]
        while any(not codes or codes[-1] != 200 for codes in seen):  # poll all in turn
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy in time")
            for proc, url, codes in zip(procs, urls, seen):
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}")
                if codes and codes[-1] == 200:
                    continue
                try:
                    codes.append(httpx.get(f"{url}/health", timeout=5).status_code)
                except httpx.TransportError:
                    pass
            time.sleep(0.05)
        yield list(zip(urls, seen))
        clean = stops_cleanly
    finally:
        stop_servers(urls, stops_cleanly=clean)


def stop_servers(urls: list[str], stops_cleanly: bool = False) -> None:
    """Stop the servers at ``urls`` that are still running (SIGTERM, then SIGKILL after
    30 s). With ``stops_cleanly``, check that each exited within the timeout, by uvicorn's
    graceful exit (which re-raises the signal it caught), with no traceback and no queue
    semaphore reported as leaked."""
    procs = {url: _RUNNING.pop(url) for url in urls if url in _RUNNING}
    for proc in procs.values():
        proc.terminate()
    timed_out = []
    for url, proc in procs.items():
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            timed_out.append(url)
            proc.kill()
            proc.wait(5)
    if stops_cleanly:
        assert timed_out == [], f"{timed_out} did not stop within 30 s of SIGTERM"
        for proc in procs.values():
            err = proc.stderr.read()
            assert proc.returncode in (0, -signal.SIGTERM), err[-2000:]
            assert "Traceback" not in err and "leaked" not in err, err[-2000:]


@functools.cache
def expected(citylm, text: str, max_tokens: int, **sampling) -> tuple[str, str]:
    """The reply text and finish reason of the request generated alone, offline; computed
    once per process (400 tokens of the reference cost over a second of CPU), so a test
    asks for it only where a reply is to be checked against it."""
    model, tok = citylm
    ids = model.reference_generate(tok.encode(text), max_tokens, **sampling)
    finish = "stop" if ids[-1] == tok.eos_id else "length"
    return tok.decode(ids), finish


def metrics(url: str) -> dict[str, float]:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return {s.name: s.value for family in families for s in family.samples}




def reference(model, prompt: list[int], params: SamplingParams) -> tuple[list[int], list]:
    """One request alone: a dense forward per token, ``process_row``, ``sample_next``; and
    the log_softmax of each step's raw logits."""
    generator = make_generator(params)
    cache = model.new_cache()
    with torch.inference_mode():
        logits = model(torch.tensor(prompt, device=model.device), cache)
        out, logps = [], []
        while True:
            row = process_row(logits[-1], params, prompt, out, model.eos_ids)
            token = sample_next(row, params, generator)
            logps.append(torch.log_softmax(logits[-1].float(), -1)[token].item())
            out.append(token)
            if (token in model.eos_ids and not params.ignore_eos) \
                    or len(out) == params.max_new_tokens:
                return out, logps
            logits = model(torch.tensor([token], device=model.device), cache)


def cli_replies_are_alone(argv: list[str], prompts: list[str], max_tokens: int, model, tok):
    """``minisrv serve ARGV``'s config served in this process (``LocalEngine`` behind the
    app): each greedy completion of ``prompts`` must be the request alone. Returns the
    config, for the caller to check what the flags set."""
    from starlette.testclient import TestClient

    from minisrv.model import load_tokenizer
    from minisrv.server.app import create_app
    from minisrv.server.cli import build_parser, server_config
    from minisrv.server.worker import LocalEngine

    config = server_config(build_parser().parse_args(["serve", *argv]))
    client = TestClient(create_app(LocalEngine(config), load_tokenizer("citylm"), "citylm"))
    with client:
        for _ in range(600):
            if client.get("/health").status_code == 200:
                break
            time.sleep(0.05)
        for prompt in prompts:
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0})
            want = model.reference_generate(tok.encode(prompt), max_tokens)
            assert r.json()["choices"][0]["text"] == tok.decode(
                [t for t in want if t not in model.eos_ids])
    return config
