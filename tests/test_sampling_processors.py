"""The logits processors and logprobs: batched, exact, and equal to a per-request reference.

``process_logits`` (one scatter per kind over a step's rows) must equal ``process_row`` (one
request, plain loops) on every row; the engine, which batches requests with and without
processors together, must give each request the tokens of generating it alone with the
reference; logprobs are ``log_softmax`` of the model's own logits.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from serving import reference

from minisrv import Engine
from minisrv.sampling import (
    SamplingParams,
    make_generator,
    process_logits,
    process_row,
    sample_batch,
    sample_processed,
    token_logprobs,
)

VOCAB = 12
STOPS = (1,)


@st.composite
def rows(draw):
    """A row's params (some with processors), prompt and output."""
    params = SamplingParams(
        max_new_tokens=8,
        presence_penalty=draw(st.sampled_from([0.0, 0.5, -1.5])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.3, 2.0])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.7])),
        logit_bias=tuple(sorted(draw(st.dictionaries(st.integers(0, VOCAB - 1),
                                                     st.floats(-100, 100), max_size=3)).items())),
        min_tokens=draw(st.integers(0, 4)),
    )
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
    output = draw(st.lists(st.integers(0, VOCAB - 1), max_size=6))
    return params, prompt, output


@settings(max_examples=120, deadline=None)
@given(batch=st.lists(rows(), min_size=1, max_size=5), seed=st.integers(0, 1000))
def test_batched_processors_equal_the_per_request_reference(batch, seed):
    logits = torch.randn(len(batch), VOCAB, generator=torch.Generator().manual_seed(seed),
                         dtype=torch.float64)
    params = [p for p, _, _ in batch]
    got = process_logits(logits, params, [(pr, out) for _, pr, out in batch], STOPS)
    for i, (p, prompt, output) in enumerate(batch):
        want = process_row(logits[i], p, prompt, output, STOPS)
        assert torch.allclose(got[i], want, atol=1e-12), (p, prompt, output)
    assert torch.equal(logits, logits.clone())  # the input is left as it was


def test_each_processor_does_what_it_says():
    logits = torch.tensor([1.0, 2.0, -1.0, 0.5])
    out = process_row(logits, SamplingParams(repetition_penalty=2.0), [2], [1], STOPS)
    assert out.tolist() == [1.0, 1.0, -2.0, 0.5]  # seen tokens: 2/2 and -1*2
    out = process_row(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
                      [3], [1, 1, 0], STOPS)
    assert out.tolist() == [1.0 - 0.5 - 0.25, 2.0 - 1.0 - 0.25, -1.0, 0.5]
    out = process_row(logits, SamplingParams(logit_bias=((2, 10.0),)), [0], [], STOPS)
    assert out.tolist() == [1.0, 2.0, 9.0, 0.5]
    out = process_row(logits, SamplingParams(min_tokens=2), [0], [3], STOPS)
    assert out[1] == -math.inf and out[0] == 1.0
    assert process_row(logits, SamplingParams(min_tokens=2), [0], [3, 3], STOPS)[1] == 2.0


def test_no_processor_no_logprobs_is_sample_batch_exactly():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.9, seed=i) if i % 2 else SamplingParams()
              for i in range(4)]
    plain = sample_batch(logits, params, [make_generator(p) for p in params])
    tokens, logprobs = sample_processed(logits, params, [make_generator(p) for p in params],
                                        None, STOPS)
    assert tokens == plain and logprobs == [None] * 4


def test_token_logprobs_are_the_log_softmax_of_the_logits():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    got = token_logprobs(logits, [3, 5, 7], [2, None, 0])
    logp = torch.log_softmax(logits, dim=-1)
    chosen, top = got[0]
    assert chosen == pytest.approx(logp[0, 3].item(), abs=1e-6)
    ids = logp[0].argsort(descending=True)[:2].tolist()
    assert [i for i, _ in top] == ids
    assert [v for _, v in top] == pytest.approx(logp[0, ids].tolist(), abs=1e-6)
    assert got[1] is None and got[2] == (pytest.approx(logp[2, 7].item(), abs=1e-6), [])


def test_bad_processor_values_are_refused():
    for bad in (dict(repetition_penalty=0.0), dict(presence_penalty=math.inf),
                dict(min_tokens=-1), dict(logit_bias=((-1, 1.0),)),
                dict(logit_bias=((2, math.nan),)), dict(logprobs=-1), dict(seed=2**64),
                dict(temperature=math.inf)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


@pytest.mark.parametrize("mode", ["prefill-first", "mixed"])
def test_engine_batches_processed_requests_with_plain_ones_exactly(citylm, mode):
    model, tok = citylm
    prompts = [tok.encode(t) for t in ("FR:", "JP: Tokyo,", "US:", "DE:", "IT: Rome,")]
    params = [
        SamplingParams(30, presence_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(30, repetition_penalty=1.8, logprobs=3),
        SamplingParams(30, temperature=0.8, seed=7, frequency_penalty=1.0,
                       logit_bias=((tok.encode(",", bos=False)[0], -5.0),)),
        SamplingParams(30, min_tokens=25),
        SamplingParams(30, logprobs=0),
    ]
    engine = Engine(model, kv_capacity=600, max_running=5, mode=mode)
    got = engine.generate(prompts, sampling=params)
    for prompt, p, out in zip(prompts, params, got):
        assert out == reference(model, prompt, p)[0], p
    assert len(got[3]) >= 25
