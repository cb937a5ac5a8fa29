"""``minisrv serve --model sim``: the simulated H100 behind the real server, in a subprocess.

Its tokens are the simulator's dummies (deterministic, among CityLM's characters), its steps
last their roofline time; the tests check what comes back, never how long it took."""

from __future__ import annotations

import httpx
import pytest

from minisrv.engine import Engine
from minisrv.server.config import ServerConfig, model_context, simulated_pace
from minisrv.server.launch import running_server
from minisrv.sim import PacedBackend, SimBackend
from minisrv.sim.served import build_sim_engine
from minisrv.tokenizer import Tokenizer

TOK = Tokenizer()


def consecutive(text: str) -> bool:
    """The simulator's dummy tokens: each id one past the one before (among the characters)."""
    ids = TOK.encode(text, bos=False)
    span = len(TOK.alphabet)
    return all((b - a) % span == 1 for a, b in zip(ids, ids[1:]))


def test_sim_server_serves_greedy_tokens_and_metrics() -> None:
    with running_server(["--model", "sim:2", "--max-running", "4"]) as url:
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == "sim:2"
        body = {"model": "sim:2", "prompt": "FR:Paris", "max_tokens": 6, "temperature": 0}
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
        choice = first["choices"][0]
        assert choice["finish_reason"] == "length"
        assert first["usage"]["completion_tokens"] == 6
        assert len(choice["text"]) == 6 and set(choice["text"]) <= set(TOK.alphabet)
        assert consecutive(choice["text"]) and consecutive(again["choices"][0]["text"])
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "model": "sim:2", "messages": [{"role": "user", "content": "JP:"}], "max_tokens": 3})
        assert chat.status_code == 200
        assert chat.json()["usage"]["completion_tokens"] == 3
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert "minisrv:generation_tokens_total 15.0" in metrics
        assert "minisrv:cache_hit_rate" in metrics
        # the second identical prompt found its prefix cached
        assert "minisrv:cache_hit_rate 0.0" not in metrics


def test_simulated_pace_parses_the_model_name() -> None:
    assert simulated_pace("sim") == 1.0
    assert simulated_pace("sim:4") == 4.0
    assert simulated_pace("sim:0.5") == 0.5
    assert simulated_pace("citylm") is None
    assert simulated_pace("/models/simple") is None
    for bad in ("sim:0", "sim:-1", "sim:fast", "sim:inf", "sim:nan"):
        with pytest.raises(ValueError, match="PACE"):
            simulated_pace(bad)
    assert model_context("sim:3") == 8192  # LLaMA-3-8B's context, no config file read


def test_sim_engine_paces_steps_at_the_roofline_time() -> None:
    engine, limits = build_sim_engine(ServerConfig(model="sim:3"))
    backend = engine.backend
    assert isinstance(backend, PacedBackend) and backend.pace == 3.0
    assert limits["vocab_size"] == TOK.vocab_size and limits["max_context"] == 8192
    assert 0 < limits["kv_capacity"] <= 64 * 8192
    engine.generate([TOK.encode("FR:")], 2)
    assert backend.steps == 2
    # each step lasted 3 x its simulated time, which the engine's clock adds up
    assert backend.busy == pytest.approx(3 * engine.scheduler.clock, rel=1e-6)
    with pytest.raises(ValueError, match="simulated"):
        build_sim_engine(ServerConfig(model="citylm"))


def test_paced_backend_checks_its_pace_and_token_ids() -> None:
    for bad in (0, -1.0, float("inf"), True, "2"):
        with pytest.raises(ValueError, match="pace"):
            PacedBackend(SimBackend(), bad)
    with pytest.raises(ValueError, match="token_ids"):
        SimBackend(token_ids=range(3, 3))
    ids = range(2, 61)
    engine = Engine(SimBackend(token_ids=ids), kv_capacity=200, max_running=2)
    out = engine.generate([[0, 5, 6], [0, 7]], 5)
    assert all(t in ids for o in out for t in o)
