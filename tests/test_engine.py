"""The engine on a real (small, random, float64) CityLM: outputs, API, bad input.

The central promise: however requests are batched, each one's tokens equal
``reference_generate`` of that request alone, greedy or sampled.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisrv.engine import Engine
from minisrv.model import CityLM
from minisrv.runner import ModelBackend
from minisrv.sampling import SamplingParams
from minisrv.scheduler import MODES

VOCAB = 61


MODEL_SEED = 0  # the random CityLM of conftest's `model` fixture


def reference(model: CityLM, prompt: list[int], params: SamplingParams) -> list[int]:
    return model.reference_generate(
        prompt, params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
        seed=params.seed, ignore_eos=params.ignore_eos,
    )


prompts_st = st.lists(
    st.lists(st.integers(2, VOCAB - 1), min_size=0, max_size=6).map(lambda ids: [0, *ids]),
    min_size=1,
    max_size=6,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prompts=prompts_st,
    data=st.data(),
    mode=st.sampled_from(MODES),
    max_running=st.integers(1, 4),
)
def test_outputs_equal_each_request_alone(model, prompts, data, mode, max_running) -> None:
    n = len(prompts)
    lengths = data.draw(st.lists(st.integers(1, 12), min_size=n, max_size=n))
    arrivals = data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    engine = Engine(model, kv_capacity=200, max_running=max_running, mode=mode)
    outputs = engine.generate(prompts, lengths, arrival_steps=arrivals)
    params = [SamplingParams(max_new_tokens=m) for m in lengths]
    assert outputs == [reference(model, p, q) for p, q in zip(prompts, params, strict=True)]
    assert engine.stats.finished == n
    assert engine.backend.live_requests == 0 and engine.scheduler.admission.reserved == 0


@pytest.mark.parametrize("mode", MODES)
def test_sampled_outputs_equal_reference_with_the_same_seed(model, mode) -> None:
    prompts = [[0, 5, 6], [0, 7], [0, 9, 9, 9], [0, 3, 4, 5, 6], [0, 11]]
    sampling = [
        SamplingParams(max_new_tokens=10, temperature=t, top_p=p, seed=s, ignore_eos=e)
        for t, p, s, e in [(1.0, 1.0, 1, False), (0.7, 0.9, 2, True), (1.3, 0.5, 3, False),
                           (0.0, 1.0, None, False), (1.0, 1.0, 4, True)]
    ]
    engine = Engine(model, max_running=3, mode=mode)
    outputs = engine.generate(prompts, sampling=sampling)
    assert outputs == [reference(model, p, q) for p, q in zip(prompts, sampling, strict=True)]


def test_notes_trace_on_the_model(model) -> None:
    engine = Engine(model, max_running=2)
    outputs = engine.generate([[0, 5], [0, 6], [0, 7]], [3, 5, 3], arrival_steps=[0, 0, 2],
                              sampling=SamplingParams(ignore_eos=True))
    assert [len(o) for o in outputs] == [3, 5, 3]
    assert [(s.prefill, s.decode, s.paused, s.finished) for s in engine.trace] == [
        ((0, 1), (), (), ()),
        ((), (0, 1), (), ()),
        ((), (0, 1), (), (0,)),
        ((2,), (), (1,), ()),
        ((), (1, 2), (), ()),
        ((), (1, 2), (), (1, 2)),
    ]
    assert [s.cost for s in engine.trace] == [4, 2, 2, 2, 2, 2]  # tokens computed per step


def test_max_new_tokens_from_sampling_unless_given(model) -> None:
    engine = Engine(model)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    assert [len(o) for o in engine.generate([[0, 5]], sampling=params)] == [4]
    assert [len(o) for o in engine.generate([[0, 5]], 2, sampling=params)] == [2]
    assert [len(o) for o in engine.generate([[0, 5]], sampling=[params])] == [4]


def test_stream_delivers_each_token_to_its_prompt(model) -> None:
    engine = Engine(model, max_running=2)
    seen: dict[int, list[int]] = {}
    prompts = [[0, 5], [0, 6, 7], [0, 8]]
    outputs = engine.generate(
        prompts, [4, 6, 3], on_token=lambda i, t: seen.setdefault(i, []).append(t)
    )
    assert seen == dict(enumerate(outputs))


def test_empty_prompt_list_returns_nothing_and_changes_nothing(model) -> None:
    engine = Engine(model)
    assert engine.generate([]) == []
    assert engine.stats.steps == 0 and engine.trace == []


def test_arrival_steps_delay_admission(model) -> None:
    engine = Engine(model, max_running=4)
    reqs = engine.make_requests([[0, 5], [0, 6]], [2, 2], None, [0, 5])
    engine.serve(reqs)
    assert reqs[0].admitted_at == 0 and reqs[1].admitted_at == 5
    assert engine.stats.steps == 4  # no empty steps while idle


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_running": 0}, "max_running must be >= 1"),
        ({"mode": "chunked"}, "unknown mode 'chunked'; supported values: static, prefill-first"),
        ({"policy": "sjf"}, "unknown policy 'sjf'; supported values: fcfs, lpm, dfs-weight"),
        ({"cache": "lru"}, "unknown cache 'lru'; supported values: none, radix"),
        ({"overlap": "yes"}, "overlap must be True or False"),
        ({"kv_capacity": -5}, "kv_capacity must be >= 1"),
    ],
)
def test_bad_engine_options_are_refused(model, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Engine(model, **kwargs)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ({"prompts": [[0, 5]], "max_new_tokens": 0}, "max_new_tokens for prompt 0 must be >= 1"),
        ({"prompts": [[0, 5], [0]], "max_new_tokens": [3]}, "max_new_tokens has 1 entries for 2"),
        ({"prompts": [[0, 5], []]}, "prompt 1 is empty"),
        ({"prompts": ["abc"]}, "prompt 0 must be a list of token ids"),
        ({"prompts": [[0, 5.5]]}, "not a token id"),
        ({"prompts": [[0, 5], [0, 999]]}, "outside the vocabulary"),
        ({"prompts": [[0] * 90], "max_new_tokens": 10}, "exceeds the model context of 96"),
        ({"prompts": [[0, 5]], "max_new_tokens": 60}, "needs 2 prompt \\+ 60 new = 62 KV tokens"),
        ({"prompts": [[0, 5]], "arrival_steps": [-1]}, r"arrival_steps\[0\] must be in"),
        ({"prompts": [[0, 5]], "sampling": "greedy"}, "must be a SamplingParams"),
    ],
)
def test_bad_generate_input_is_refused_and_the_engine_still_serves(model, call, message) -> None:
    engine = Engine(model, kv_capacity=50, max_running=2)
    with pytest.raises(ValueError, match=message):
        engine.generate(**call)
    assert engine.stats.steps == 0 and engine.scheduler.idle
    assert engine.generate([[0, 5]], 3) == [model.reference_generate([0, 5], 3)]


def test_failing_stream_callback_leaves_the_engine_usable(model) -> None:
    engine = Engine(model, max_running=2)

    def explode(i: int, token: int) -> None:
        if i == 1:
            raise RuntimeError("client went away")

    with pytest.raises(RuntimeError, match="client went away"):
        engine.generate([[0, 5], [0, 6], [0, 7]], 5, on_token=explode)
    assert engine.scheduler.idle and engine.scheduler.admission.reserved == 0
    assert engine.backend.live_requests == 0
    assert engine.generate([[0, 8]], 4) == [model.reference_generate([0, 8], 4)]


def test_engine_wraps_a_model_in_a_model_backend(model) -> None:
    engine = Engine(model)
    assert isinstance(engine.backend, ModelBackend)
    assert (engine.kv_capacity, engine.max_running, engine.mode) == (4000, 8, "prefill-first")
    assert engine.stats.as_dict()["hit_rate"] == 0.0


def test_every_eos_id_of_the_model_ends_a_request_as_it_does_alone(model) -> None:
    prompts = [[0, 5, 9], [0, 7], [0, 3, 3, 4]]
    free = [model.reference_generate(p, 12, ignore_eos=True) for p in prompts]
    second = free[0][2]  # a token the first request really generates: make it a stop id
    saved = model.eos_ids
    try:
        model.eos_ids = (*saved, second)
        alone = [model.reference_generate(p, 12) for p in prompts]
        served = Engine(model, max_running=2).generate(prompts, 12)
    finally:
        model.eos_ids = saved
    assert served == alone and alone[0][-1] == second and len(alone[0]) <= 3


def test_retract_requeues_running_requests_and_keeps_their_tokens(model) -> None:
    """``Engine.retract`` frees a running request's KV and sends it to the head of the queue;
    it keeps its output and random generator, so it ends with the tokens it would have had."""
    engine = Engine(model, kv_capacity=400, max_running=4)
    greedy = engine.add_request([0, 5, 6], SamplingParams(30, ignore_eos=True))
    sampled = engine.add_request([0, 7, 8], SamplingParams(30, temperature=1.0, seed=3,
                                                           ignore_eos=True))
    for _ in range(6):
        engine.step()
    used = engine.scheduler.memory.kv.used_count
    engine.retract([sampled, greedy])
    assert engine.scheduler.memory.kv.used_count < used and not sampled.kv_len
    assert list(engine.scheduler.queues.waiting) == [sampled, greedy]
    engine.scheduler.check_integrity()
    while engine.step().record is not None:
        engine.scheduler.check_integrity()
    assert greedy.output == model.reference_generate([0, 5, 6], 30, ignore_eos=True)
    assert sampled.output == model.reference_generate([0, 7, 8], 30, temperature=1.0, seed=3,
                                                      ignore_eos=True)
    with pytest.raises(ValueError, match="blocking loop"):
        Engine(model, overlap=True).retract([])
