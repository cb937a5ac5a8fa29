"""Structured output through the engine: constrained requests batched with free ones.

The oracle is ``minisrv.grammar.reference.constrained_generate``: the request alone, the
same mask applied by hand at every position. A free request in the same batch gets exactly
its unconstrained tokens.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("xgrammar")

from minisrv import Engine, SamplingParams, load_citylm  # noqa: E402
from minisrv.configs import CITYLM  # noqa: E402
from minisrv.grammar import citylm_vocabulary, compile_grammar  # noqa: E402
from minisrv.grammar.reference import constrained_generate  # noqa: E402
from minisrv.model import CityLM  # noqa: E402
from minisrv.sim import SimBackend  # noqa: E402
from minisrv.tokenizer import Tokenizer  # noqa: E402

THREE_CITIES = r"( [A-Z][a-z]+,){3}"  # complete after the third comma: then only <eos>


@pytest.fixture(scope="module")
def citylm():
    return load_citylm("cpu")


def reference(model, tok, prompt: str, regex: str, params: SamplingParams) -> list[int]:
    grammar = compile_grammar(citylm_vocabulary(tok, size=model.config.vocab_size), regex=regex)
    return constrained_generate(model, tok.encode(prompt), grammar, params).tokens


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("cache", ["none", "radix"])
def test_constrained_and_free_requests_share_batches(citylm, overlap: bool, cache: str) -> None:
    model, tok = citylm
    prompts = ["FR:", "JP:", "DE:", "FR:"]
    constrained = SamplingParams(max_new_tokens=40, regex=THREE_CITIES)
    free = SamplingParams(max_new_tokens=24)
    params = [constrained, free, constrained, free]
    engine = Engine(model, kv_capacity=600, max_running=4, cache=cache, overlap=overlap)
    out = engine.generate([tok.encode(p) for p in prompts], sampling=params)
    for prompt, p, tokens in zip(prompts, params, out):
        if p.grammar is None:
            assert tokens == model.reference_generate(tok.encode(prompt), p.max_new_tokens)
        else:
            assert tokens == reference(model, tok, prompt, THREE_CITIES, p)
            assert re.fullmatch(THREE_CITIES, tok.decode(tokens[:-1]))  # then <eos>
            assert tokens[-1] in model.eos_ids
    engine.scheduler.check_integrity()


@pytest.mark.parametrize("seed", range(6))
def test_sampled_constrained_outputs_follow_the_grammar(citylm, seed: int) -> None:
    model, tok = citylm
    params = SamplingParams(max_new_tokens=60, temperature=1.2, seed=seed, regex=THREE_CITIES)
    engine = Engine(model, kv_capacity=600, max_running=4)
    out = engine.generate([tok.encode("IT:"), tok.encode("ES:")], sampling=params)
    for prompt, tokens in zip(("IT:", "ES:"), out):
        assert tokens == reference(model, tok, prompt, THREE_CITIES, params)
        assert re.fullmatch(THREE_CITIES, tok.decode(tokens[:-1]))


def test_a_grammar_the_vocabulary_cannot_spell_is_refused_when_added(citylm) -> None:
    model, tok = citylm
    engine = Engine(model, kv_capacity=200)
    schema = '{"type": "object", "properties": {"city": {"type": "string"}}}'
    with pytest.raises(ValueError, match="needs"):
        engine.add_request(tok.encode("FR:"), SamplingParams(json_schema=schema))
    assert engine.idle  # nothing was queued
    assert engine.generate([tok.encode("FR:")], 8) == [model.reference_generate(
        tok.encode("FR:"), 8)]


def test_a_hand_built_model_without_a_tokenizer_needs_its_vocabulary_given() -> None:
    """``load_model`` gives the model its tokenizer; a model built by hand has none, so a
    constrained request is refused (nothing queued) with the call that fixes it, unless its
    vocabulary is CityLM's size (then CityLM's characters, as before)."""
    model = CityLM(CITYLM.with_(vocab_size=300, n_layers=1)).eval()
    assert model.tokenizer is None
    engine = Engine(model, kv_capacity=200)
    with pytest.raises(ValueError, match=r"\(300 tokens\) is not CityLM's and the model "
                                         r"carries no tokenizer.*engine\.grammars\("):
        engine.add_request([0, 5, 7], SamplingParams(regex="ab"))
    assert engine.idle
    model.tokenizer = object()  # not a tokenizer minisrv knows how ids spell text
    with pytest.raises(ValueError, match="no grammar vocabulary for a object"):
        Engine(model, kv_capacity=200).add_request([0, 5], SamplingParams(regex="ab"))

    tok = Tokenizer()
    citylm_sized = CityLM(CITYLM.with_(n_layers=1)).eval()
    assert citylm_sized.tokenizer is None
    params = SamplingParams(max_new_tokens=8, regex=" [A-Z]a,")
    out = Engine(citylm_sized, kv_capacity=200).generate([tok.encode("FR:")], sampling=params)
    assert out == [reference(citylm_sized, tok, "FR:", " [A-Z]a,", params)]
    assert re.fullmatch(" [A-Z]a,", tok.decode(out[0][:-1])) and out[0][-1] == tok.eos_id


def test_grammar_params_are_checked() -> None:
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(regex="a", ebnf='root ::= "a"')
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(regex="a", ignore_eos=True)
    with pytest.raises(ValueError, match="non-empty"):
        SamplingParams(regex="")
    with pytest.raises(ValueError, match="simulated GPU"):
        Engine(SimBackend()).add_request([0, 5], SamplingParams(regex="a"))
