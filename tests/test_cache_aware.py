"""The cache-aware chapter's experiment runners (minisrv.experiments.cache_aware) and their
drawings."""

from __future__ import annotations

import itertools

import matplotlib
import pytest

from minisrv.experiments import cache_aware as ca
from minisrv.scheduler import optimal_hit_rate
from minisrv.workloads import Workload, prefix_forest_workload

matplotlib.use("Agg")

MODEL_SEED = 4  # the random CityLM of conftest's `model` fixture


def group_workload(n_groups: int = 3, per_group: int = 4) -> tuple[Workload, list[str]]:
    """Groups of prompts sharing a 34-token head, all waiting at once, group by group."""
    prompts, labels = [], []
    for g in range(n_groups):
        head = [0, *[2 + 10 * g + (k % 9) for k in range(33)]]
        for m in range(per_group):
            prompts.append([*head, 40 + m])
            labels.append(f"g{g}.{m}")
    n = len(prompts)
    return Workload("groups", prompts, [4] * n, [0.0] * n), labels


def test_policy_table_checks_tokens_and_lpm_with_the_check_beats_fcfs(model) -> None:
    work, _ = group_workload()
    reference = ca.reference_outputs(model, work)
    table = ca.policy_table(model, work, {"fcfs": {"policy": "fcfs"},
                                          "lpm": {"policy": "lpm"}},
                            reference, kv_capacity=1000, max_running=4)
    assert list(table["outputs identical"]) == ["12/12", "12/12"]
    assert table.loc["lpm", "hit rate"] > table.loc["fcfs", "hit rate"]
    assert table.loc["lpm", "prefill tokens"] < table.loc["fcfs", "prefill tokens"]
    assert {"mean wait (steps)", "p99 wait (steps)", "max wait (steps)",
            "retractions"} <= set(table.columns)


def test_admission_rounds_add_up_to_the_engine_hit_rate(model) -> None:
    work, labels = group_workload()
    for policy, check in (("fcfs", False), ("lpm", True)):
        rounds = ca.admission_rounds(work.prompts, labels, policy,
                                     in_batch_prefix_check=check, batch=4)
        engine_run = ca.run_policy(model, work, policy, in_batch_prefix_check=check,
                                   kv_capacity=1000, max_running=4)
        assert rounds["prompt tokens"].sum() == sum(map(len, work.prompts))
        assert rounds["cached tokens"].sum() == engine_run.stats.cached_prompt_tokens
        admitted = " ".join(rounds["admitted"]).replace("*", "").split()
        assert sorted(admitted) == sorted(labels)  # each request admitted exactly once
    lpm = ca.admission_rounds(work.prompts, labels, "lpm", batch=4)
    assert lpm.loc[1, "admitted"].split()[:3] == ["g0.0", "g1.0", "g2.0"]  # one per group
    # 9 deferred in round 1; the one a spare place admitted is starred, 8 are left waiting
    assert lpm.loc[1, "admitted"].count("*") == 1
    assert lpm.loc[1, "deferred, left waiting"] == 8


def test_request_and_group_tables_read_the_run(model) -> None:
    work, _ = group_workload(n_groups=2, per_group=3)
    run = ca.run_policy(model, work, "fcfs", kv_capacity=1000, max_running=2)
    table = ca.request_table(run.result)
    assert list(table["wait"]) == [r.admitted_at - r.arrival for r in run.result.requests]
    groups = ca.group_table(run.result, [0, 0, 0, 1, 1, 1])
    assert list(groups["requests"]) == [3, 3]
    assert groups["max wait (steps)"].max() == run.result.metrics.max_wait


def test_forest_sweep_lpm_and_dfs_reach_the_optimum_at_the_longest_request() -> None:
    prompts = prefix_forest_workload((2, 3, 4), (20, 5, 6), seed=3).prompts
    longest = max(map(len, prompts)) + 1
    table = ca.forest_sweep(prompts, [longest, 10 * longest])
    best = optimal_hit_rate(prompts)
    assert table.loc[longest, "lpm"] == pytest.approx(best)
    assert table.loc[longest, "dfs-weight"] == pytest.approx(best)
    assert table.loc[longest, "random"] < best
    assert table.loc[10 * longest, "fcfs"] == pytest.approx(best)  # the whole tree fits
    assert (table["optimal"] == best).all()


def test_scheduling_cost_shape_and_bad_input() -> None:
    prompts = prefix_forest_workload((2, 2, 8), (5, 5, 5), seed=0).prompts
    table = ca.scheduling_cost(prompts, [4, 8], cached=4, repeats=1)
    assert list(table.index) == [4, 8]
    assert list(table.columns) == ["fcfs", "lpm", "dfs-weight"]
    assert (table >= 0).all().all()
    with pytest.raises(ValueError, match="prompts"):
        ca.scheduling_cost(prompts, [100], cached=4)


def test_prefix_stream_workload_groups_and_hot_share() -> None:
    work = ca.prefix_stream_workload(n=400, n_groups=4, prefix_len=30, question_len=5,
                                     output_len=3, rate=10, hot_share=0.75, seed=1)
    heads = [tuple(p[:30]) for p in work.prompts]
    assert len(set(heads)) == 4 and all(len(p) == 35 for p in work.prompts)
    hot = max(set(heads), key=heads.count)
    assert heads.count(hot) / len(heads) == pytest.approx(0.75, abs=0.06)
    assert work.arrivals == sorted(work.arrivals)
    with pytest.raises(ValueError, match="hot_share"):
        ca.prefix_stream_workload(n=4, hot_share=1.5)
    with pytest.raises(ValueError, match="n_groups"):
        ca.prefix_stream_workload(n=4, n_groups=0)


def test_gpu_policy_table_lpm_keeps_prefixes_a_tight_pool_cannot_hold_under_fcfs() -> None:
    stream = ca.prefix_stream_workload(n=120, n_groups=6, prefix_len=1000, question_len=50,
                                       output_len=20, rate=40)
    table = ca.gpu_policy_table(stream, kv_capacity=6000, max_running=32)
    assert table.loc["lpm", "hit rate"] > table.loc["fcfs", "hit rate"]
    assert set(table.columns) >= {"throughput (tok/s)", "max wait (s)", "mean latency (s)"}
    assert table["throughput (tok/s)"].dtype.kind == "i"  # whole tokens per second
    assert (table["max wait (s)"] == table["max wait (s)"].round(3)).all()


def test_drawings_have_titles_labels_and_legends() -> None:
    from minisrv.viz import policy as pv

    prompts = prefix_forest_workload((2, 2, 2), (6, 4, 4), seed=0).prompts
    sweep = ca.forest_sweep(prompts, [15, 60])
    cost = ca.scheduling_cost(prompts, [2, 4], repeats=1)
    figures = [pv.plot_forest_sweep(sweep, 15), pv.plot_scheduling_cost(cost)]
    for fig in figures:
        ax = fig.axes[0]
        assert ax.get_title(loc="left") and ax.get_xlabel() and ax.get_ylabel()
        assert fig.legends and ax.get_legend() is None and ax.get_xscale() == "log"
        png, meta = fig._repr_png_()
        assert png.startswith(b"\x89PNG") and meta == {"width": 750}


def test_comparison_drawings_from_tables(model) -> None:
    from minisrv.viz import policy as pv

    work, _ = group_workload(n_groups=2, per_group=2)
    table = ca.policy_table(model, work, {"fcfs": {"policy": "fcfs"}, "lpm": {"policy": "lpm"}},
                            kv_capacity=500, max_running=2)
    sweep = ca.capacity_table(model, work, [80, 500], max_running=2)
    assert list(sweep.columns.get_level_values(1).unique()) == ["fcfs", "lpm"]
    for fig in (pv.plot_policy_comparison(table), pv.plot_capacity_table(sweep)):
        assert fig._suptitle is not None and fig._suptitle.get_text()
        for ax in fig.axes:
            assert ax.get_title(loc="left") and ax.get_xlabel() and ax.get_ylabel()
        assert fig.legends and all(ax.get_legend() is None for ax in fig.axes)  # off the data
    scaled = pv.plot_policy_comparison(table, tops=(1000, 40))  # an explorer's common scale
    assert [ax.get_ylim() for ax in scaled.axes] == [(0, 100), (0, 1050), (0, 42)]


def test_a_capacity_sweep_takes_the_runs_it_is_given(model, monkeypatch) -> None:
    """Chapter 05's pool sweep passes the runs its first sweep made: those pools are not
    served again, and the table is the one a fresh sweep gives."""
    work, _ = group_workload(n_groups=2, per_group=2)
    reference = ca.reference_outputs(model, work)
    fresh = ca.capacity_table(model, work, [80, 120], reference=reference, max_running=2)
    kept: dict = {}
    ca.capacity_table(model, work, [120], reference=reference, runs=kept, max_running=2)
    first = dict(kept)
    served = []
    run_policy = ca.run_policy
    monkeypatch.setattr(ca, "run_policy", lambda *a, **k: served.append(k["kv_capacity"])
                        or run_policy(*a, **k))
    again = ca.capacity_table(model, work, [80, 120], reference=reference, runs=kept,
                              max_running=2)
    assert served == [80, 80]  # fcfs and lpm at 80; both runs at 120 were given
    assert all(kept[key] is run for key, run in first.items())
    assert again.equals(fresh)


def test_the_policy_explorer_states_are_the_experiment_against_fcfs(model, monkeypatch) -> None:
    from minisrv.tokenizer import Tokenizer
    from minisrv.viz import policy as pv

    scales = []  # every state's figure is drawn to the largest prefill and wait of them all
    draw = pv.plot_policy_comparison
    monkeypatch.setattr(pv, "plot_policy_comparison",
                        lambda table, title, tops: scales.append(tops) or draw(table, title, tops))
    tok = Tokenizer()
    work = ca.interleaved_groups(tok, n_groups=2)
    reference = ca.reference_outputs(model, work)
    kept: dict = {}  # the chapter's capacity sweep keeps its runs; the explorer draws them
    ca.capacity_table(model, work, [120], reference=reference, runs=kept)
    assert sorted(kept) == [("fcfs", 120), ("lpm", 120)]
    ex = pv.policy_explorer(model, tok, policies=("lpm",), kv_capacity=120, n_groups=2,
                            capacities=(120, 400), gaps=(1.0, 4.0), reference=reference,
                            runs=kept)
    assert ex.default == {"capacity": 120, "gap": 1.0}  # one policy: no policy control
    for capacity, gap in itertools.product((120, 400), (1.0, 4.0)):
        table = ca.few_shot_experiment(model, tok, ("fcfs", "lpm"), kv_capacity=capacity,
                                       arrival_every=gap, n_groups=2, reference=reference)
        state = ex.metrics(capacity=capacity, gap=gap)
        for side, row in (("FCFS", "fcfs"), ("policy", "lpm")):
            for name in ("hit rate", "prefill tokens", "mean wait (steps)", "max wait (steps)"):
                assert state[f"{side} {name}"] == table.loc[row, name]
        assert state["requests checked"] == 2 * 16
    states = [ex.metrics(capacity=c, gap=g) for c, g in itertools.product((120, 400), (1.0, 4.0))]
    top = {name: max(s[f"{side} {name}"] for s in states for side in ("FCFS", "policy"))
           for name in ("prefill tokens", "max wait (steps)")}
    assert set(scales) == {(top["prefill tokens"], top["max wait (steps)"])}
    # the gap moves the arrivals: the waits of a spaced stream are not those of a dense one
    assert (ex.metrics(capacity=400, gap=4.0)["FCFS max wait (steps)"]
            != ex.metrics(capacity=400, gap=1.0)["FCFS max wait (steps)"])
    both = pv.policy_explorer(model, tok, policies=("lpm", "random"), kv_capacity=400,
                              n_groups=2, capacities=(400,), gaps=(1.0,), reference=reference)
    assert both.default == {"policy": "lpm", "capacity": 400, "gap": 1.0}
    assert both.metrics(policy="lpm", capacity=400, gap=1.0) == ex.metrics(capacity=400, gap=1.0)


def test_the_policy_explorer_refuses_fcfs_and_a_reference_of_another_workload(model) -> None:
    from minisrv.tokenizer import Tokenizer
    from minisrv.viz import policy as pv

    tok = Tokenizer()
    with pytest.raises(ValueError, match="not FCFS itself"):
        pv.policy_explorer(model, tok, policies=("fcfs", "lpm"))
    with pytest.raises(ValueError, match="reference holds 3 outputs for 16 requests"):
        pv.policy_explorer(model, tok, n_groups=2, reference=[[1], [2], [3]])
    other = ca.interleaved_groups(tok, n_groups=3)
    unchecked = ca.run_policy(model, other, "lpm", kv_capacity=400)
    with pytest.raises(ValueError, match="did not serve interleaved_groups"):
        pv.policy_explorer(model, tok, n_groups=2, runs={("lpm", 400): unchecked})
    spaced = ca.interleaved_groups(tok, n_groups=2, arrival_every=4.0)  # other arrivals
    checked = ca.run_policy(model, spaced, "lpm", kv_capacity=400,
                            reference=ca.reference_outputs(model, spaced))
    assert checked.identical == len(spaced)
    with pytest.raises(ValueError, match="did not serve interleaved_groups"):
        pv.policy_explorer(model, tok, n_groups=2, runs={("lpm", 400): checked})


def test_the_explorer_caption_states_the_hit_rates_as_a_finding() -> None:
    """"LPM hits +0.0 points against FCFS" read as a verdict; the caption says what each hit."""
    from minisrv.viz.policy import _hit_finding

    assert _hit_finding("LPM", 0.5, 0.5) == ("LPM and FCFS hit the same share of prompt tokens, "
                                              "50.0%.")
    assert _hit_finding("LPM", 0.763, 0.05) == ("LPM hits 76.3% of prompt tokens, FCFS "
                                                 "(minisrv's admission order) 5.0%: "
                                                 "71.3 points more. In SGLang's order, which "
                                                 "locks a round's prefixes first, FCFS can hit "
                                                 "far more in a tight pool (the capacity table "
                                                 "has both orders).")
    assert _hit_finding("LPM", 0.60, 0.71).endswith("11.0 points fewer.")
