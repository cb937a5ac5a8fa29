"""``python -m minisrv.sim.served``: the simulated H100 behind the real server, in a subprocess.

Its tokens are the simulator's dummies (deterministic, among CityLM's characters), its steps
last their roofline time; the tests check what comes back, never how long it took."""

from __future__ import annotations

import httpx
import pandas as pd
import pytest
from serving import STARTUP_S

from minisrv.engine import Engine
from minisrv.experiments.server import (
    SIM_CONFIGS,
    beyond_spread,
    prefix_heavy_requests,
    sim_server_runs,
    spread,
)
from minisrv.server.config import ServerConfig
from minisrv.server.launch import running_server
from minisrv.sim import PacedBackend, SimBackend
from minisrv.sim.served import build_sim_engine, sim_config, simulated_pace
from minisrv.tokenizer import Tokenizer

TOK = Tokenizer()


def sim_server(*args: str):
    """``python -m minisrv.sim.served ARGS`` on a free port; its URL, once healthy."""
    return running_server(args, startup_s=STARTUP_S, module="minisrv.sim.served")


def consecutive(text: str) -> bool:
    """The simulator's dummy tokens: each id one past the one before (among the characters)."""
    ids = TOK.encode(text, bos=False)
    span = len(TOK.alphabet)
    return all((b - a) % span == 1 for a, b in zip(ids, ids[1:]))


def test_sim_server_serves_greedy_tokens_and_metrics() -> None:
    with sim_server("--model", "sim:2", "--max-running", "4") as url:
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
    config = sim_config(ServerConfig(model="sim:3"))
    assert config.builder is build_sim_engine
    assert config.request_limit() >= 64 * 8192  # from LLaMA-3-8B's context, no file read
    with pytest.raises(ValueError, match="simulated"):
        sim_config(ServerConfig(model="citylm"))


def test_sim_engine_paces_steps_at_the_roofline_time() -> None:
    engine, limits = build_sim_engine(ServerConfig(model="sim:3"))
    backend = engine.backend
    assert isinstance(backend, PacedBackend) and backend.pace == 3.0
    assert limits["vocab_size"] == TOK.vocab_size and limits["max_context"] == 8192
    assert 0 < limits["kv_capacity"] <= 64 * 8192
    engine.generate([TOK.encode("FR:")], 2)
    assert backend.steps == 2
    # each step lasted 3 x its simulated time, which the engine's clock adds up
    assert backend.busy == pytest.approx(3 * engine.scheduler.recorder.clock, rel=1e-6)
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


def test_prefix_heavy_requests_share_each_groups_prefix() -> None:
    reqs = prefix_heavy_requests(groups=3, prefix_len=50, n=7, output_len=4)
    assert len(reqs) == 7 and all(r.max_tokens == 4 for r in reqs)
    assert all(len(r.prompt) == 50 + 1 + 20 for r in reqs)
    heads = [r.prompt[:50] for r in reqs]
    assert heads[0] == heads[3] == heads[6] and len(set(heads)) == 3  # interleaved groups
    assert len({r.prompt for r in reqs}) == 7
    assert all(TOK.encode(r.prompt) for r in reqs)  # CityLM's characters only
    assert prefix_heavy_requests(groups=3, prefix_len=50, n=7) == prefix_heavy_requests(
        groups=3, prefix_len=50, n=7)  # seeded
    with pytest.raises(ValueError, match="groups"):
        prefix_heavy_requests(groups=0)


def test_sim_server_runs_serve_every_configuration_each_run() -> None:
    reqs = prefix_heavy_requests(groups=2, prefix_len=200, n=8, output_len=3)
    runs = sim_server_runs(reqs, runs=2, kv_capacity=3000, max_running=2)
    assert sorted(runs.index.get_level_values(0).unique()) == sorted(SIM_CONFIGS)
    assert sorted(runs.index.get_level_values(1).unique()) == [0, 1]
    assert (runs["completed"] == 8).all() and (runs["failed"] == 0).all()
    assert (runs.xs("FCFS no-cache", level=0)["hit rate"] == 0).all()
    assert (runs.xs("LPM", level=0)["hit rate"] > 0).all()  # later groups' turns hit
    # the simulated H100 was busy for part of each bench, never longer than the bench lasted
    assert (runs["device busy (s)"] > 0).all()
    assert (runs["device busy (s)"] < runs["duration (s)"]).all()
    table = spread(runs, ["out tok/s"])
    assert list(table.columns) == [("out tok/s", s) for s in ("median", "min", "max")]
    with pytest.raises(ValueError, match="runs"):
        sim_server_runs(reqs, runs=0)


def test_beyond_spread_needs_the_ranges_apart() -> None:
    index = pd.MultiIndex.from_product([["a", "b"], [0, 1, 2]])
    apart = pd.DataFrame({"x": [1.0, 2.0, 3.0, 5.0, 4.0, 6.0]}, index=index)
    assert beyond_spread(apart, "x", "a", "b") and beyond_spread(apart, "x", "b", "a")
    touching = pd.DataFrame({"x": [1.0, 2.0, 4.0, 4.0, 5.0, 6.0]}, index=index)
    assert not beyond_spread(touching, "x", "a", "b")
    table = spread(apart, ["x"])
    assert table.loc["a", ("x", "min")] == 1.0 and table.loc["b", ("x", "max")] == 6.0
    assert table.loc["b", ("x", "median")] == 5.0
