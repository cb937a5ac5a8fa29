"""Jump-forward in the engine: the tokens a grammar forces are appended without a step.

On CityLM (one character per token) the text equals masking alone (the per-request
``constrained_generate`` without jump-forward), greedy and sampled: each forced token
skips the uniform draw its masked step would have made. The steps saved are counted per
request, per step and in total; free requests sharing the batch get their own tokens.
"""

from __future__ import annotations

import pytest

pytest.importorskip("xgrammar")

from minisrv import Engine, SamplingParams  # noqa: E402
from minisrv.grammar import citylm_vocabulary, compile_grammar  # noqa: E402
from minisrv.grammar.reference import constrained_generate  # noqa: E402

THREE_CITIES = r"( [A-Z][a-z]+,){3}"
FIXED = r" (Paris|Lyon|Lille), (Paris|Lyon|Lille)\. Done\."  # long forced stretches
PROMPTS = ["FR:", "JP:", "DE:", "FR: Paris,", "IT:"]


def grammar_of(model, tok, regex: str):
    return compile_grammar(citylm_vocabulary(tok, size=model.config.vocab_size), regex=regex)


def mixed_params() -> list[SamplingParams]:
    return [SamplingParams(40, regex=FIXED), SamplingParams(40, regex=THREE_CITIES,
                                                            temperature=0.9, seed=3),
            SamplingParams(20), SamplingParams(40, regex=FIXED, temperature=1.0, seed=5),
            SamplingParams(12, temperature=0.8, seed=9)]


def expected(model, tok, prompts, params):
    """Masking alone (constrained requests) or the request alone (free ones), and the
    steps jump-forward saves for each (the oracle's ``jumped``)."""
    out, saved = [], []
    for prompt, p in zip(prompts, params, strict=True):
        ids = tok.encode(prompt)
        if p.regex is None:
            out.append(model.reference_generate(ids, p.max_new_tokens, temperature=p.temperature,
                                                top_p=p.top_p, seed=p.seed,
                                                ignore_eos=p.ignore_eos))
            saved.append(0)
            continue
        grammar = grammar_of(model, tok, p.regex)
        out.append(constrained_generate(model, ids, grammar, p).tokens)
        saved.append(constrained_generate(model, ids, grammar, p, jump_forward=True).jumped)
    return out, saved


def check_jumps(engine: Engine, reqs, saved) -> None:
    stats = engine.stats
    assert [r.jump_forward_tokens for r in reqs] == saved
    assert stats.jump_forward_tokens == sum(saved) == sum(r.jumped for r in engine.trace)
    assert stats.generated_tokens == sum(len(r.output) for r in reqs)
    assert engine.idle
    engine.scheduler.check_integrity()
    assert engine.scheduler.memory.kv.used_count == engine.tree.size_info().total


def serve_like_alone(engine: Engine, tok, prompts, params, **options) -> list:
    """Serve ``prompts`` on ``engine``: every request gets the tokens it gets alone
    (``expected``), and the jumps add up (``check_jumps``). The requests, for more checks."""
    want, saved = expected(engine.backend.model, tok, prompts, params)
    reqs = engine.make_requests([tok.encode(p) for p in prompts], sampling=params, **options)
    engine.serve(reqs)
    assert [r.output for r in reqs] == want  # free ones: exactly their own tokens
    check_jumps(engine, reqs, saved)
    return reqs


@pytest.mark.parametrize("cache", ["none", "radix"])
@pytest.mark.parametrize("mode", ["prefill-first", "mixed"])
def test_jump_forward_equals_masking_alone_in_a_mixed_batch(citylm, cache, mode):
    model, tok = citylm
    params = mixed_params()
    want, saved = expected(model, tok, PROMPTS, params)
    assert sum(saved) > 0
    engine = Engine(model, jump_forward=True, cache=cache, mode=mode, max_running=3,
                    debug=True)
    reqs = engine.make_requests([tok.encode(p) for p in PROMPTS], sampling=params,
                                arrival_steps=[0, 0, 1, 2, 2])
    engine.serve(reqs)
    assert [r.output for r in reqs] == want  # free ones: exactly their own tokens
    check_jumps(engine, reqs, saved)
    plain = Engine(model, cache=cache, mode=mode, max_running=3)
    assert plain.generate([tok.encode(p) for p in PROMPTS], sampling=params) == want
    assert engine.stats.steps < plain.stats.steps  # the saved steps are steps


def test_greedy_fixed_text_is_jumped_and_streamed(citylm):
    model, tok = citylm
    engine = Engine(model, jump_forward=True, debug=True)
    req = engine.add_request(tok.encode("FR:"), SamplingParams(40, regex=FIXED))
    streamed = []
    while (out := engine.step()).record is not None:
        streamed += out.tokens_of(req)
    assert streamed == req.output
    assert tok.decode(req.output[:-1]).endswith(". Done.")
    assert req.jump_forward_tokens >= len(". Done.")
    assert engine.stats.steps == len(req.output) - req.jump_forward_tokens


def test_jump_forward_with_chunked_prefill_and_retraction(citylm):
    model, tok = citylm
    prompts = [*PROMPTS, "GB: London, Leeds,", "ES:", "US:"]
    params = [*mixed_params(), SamplingParams(40, regex=FIXED),
              *[SamplingParams(40, ignore_eos=True)] * 2]
    engine = Engine(model, jump_forward=True, chunked_prefill_size=6, max_running=4,
                    kv_capacity=70, new_token_ratio=0.05, min_ratio=0.01, cache="radix",
                    mode="mixed", debug=True)
    serve_like_alone(engine, tok, prompts, params)
    assert engine.stats.retractions > 0


def test_jump_forward_with_speculative_free_requests(citylm):
    """Constrained requests jump, free ones are checked speculatively, in one batch."""
    model, tok = citylm
    engine = Engine(model, jump_forward=True, speculative="draft", num_draft_tokens=3,
                    max_running=5, debug=True)
    serve_like_alone(engine, tok, PROMPTS, mixed_params())
    assert engine.stats.accepted_tokens > 0


def test_jump_forward_off_changes_nothing(citylm):
    model, tok = citylm
    engine = Engine(model, debug=True)
    req = engine.add_request(tok.encode("FR:"), SamplingParams(40, regex=FIXED))
    engine.run()
    assert req.jump_forward_tokens == engine.stats.jump_forward_tokens == 0
    assert engine.stats.steps == len(req.output)


def test_jump_forward_refuses_the_overlapped_loop(citylm):
    model, _ = citylm
    with pytest.raises(ValueError, match="jump_forward needs the blocking loop"):
        Engine(model, jump_forward=True, overlap=True)
    with pytest.raises(ValueError, match="jump_forward must be True or False"):
        Engine(model, jump_forward=1)


def test_the_server_flag_reaches_the_engine():
    from minisrv.server.cli import build_parser, server_config

    assert server_config(build_parser().parse_args(["serve", "--jump-forward"])).engine.jump_forward
    assert not server_config(build_parser().parse_args(["serve"])).engine.jump_forward
