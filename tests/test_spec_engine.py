"""Speculative decoding in the engine: each request's tokens are its own, whatever the draft.

Greedy, every request's output equals ``model.reference_generate`` of it alone, for both
drafts, k 1..6, every policy, the radix cache on and off, chunked prefill and retraction;
sampled, it equals ``speculative_generate`` with the same seed (the per-request draw order:
draft, then check, then the next draft). The books balance after every step: no KV slot
leaked (``check_integrity``), only accepted tokens held, every guess counted once.
(The rejection rule's chi-square tests are in ``test_spec_verify.py``.)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import cli_replies_are_alone

from minisrv.engine import POLICIES, Engine
from minisrv.sampling import SamplingParams
from minisrv.spec import Drafter, DraftModelDrafter, NgramDrafter, speculative_generate
from minisrv.workloads import city_prompts, shared_system_prompt

MAX_NEW = 30


@pytest.fixture(scope="module")
def draft_model() -> DraftModelDrafter:
    """The shipped draft, loaded once (each engine gets its own drafter over it)."""
    return DraftModelDrafter()


def drafter_of(name: str, draft_model: DraftModelDrafter) -> Drafter:
    return NgramDrafter() if name == "ngram" else DraftModelDrafter(draft_model.model)


@pytest.fixture(scope="module")
def workload(citylm):
    """City prompts and a shared system prompt, with each one's output alone."""
    model, tok = citylm
    prompts = city_prompts(tok, 5, seed=3) + shared_system_prompt(tok, 3)
    return prompts, [model.reference_generate(p, MAX_NEW) for p in prompts]


def check_books(engine: Engine, reqs=None, chunked: bool = False) -> None:
    """The counts add up: totals, per request, per step; nothing is left held.

    Every token is a sampled prefill's (a first admission or a re-admission after a
    retraction), a check's own, or an accepted guess; the KV of the other guesses was freed.
    """
    stats, trace = engine.stats, engine.trace
    assert 0 <= stats.accepted_tokens <= stats.draft_tokens
    assert stats.rejected_tokens == stats.draft_tokens - stats.accepted_tokens
    assert sum(r.drafted for r in trace) == stats.draft_tokens
    assert sum(r.accepted for r in trace) == stats.accepted_tokens
    for record in trace:
        assert record.drafted == sum(c[1] for c in record.checks)
        assert record.accepted == sum(c[2] for c in record.checks)
        assert all(0 <= a <= d <= engine.config.num_draft_tokens for _, d, a in record.checks)
        assert {c[0] for c in record.checks} <= set(record.decode)
    prefills = sum(len(r.prefill) for r in trace)
    checked = stats.decode_tokens + stats.accepted_tokens
    if chunked:  # a chunk that does not sample is a prefill entry too
        assert stats.generated_tokens <= prefills + checked
    else:
        assert stats.generated_tokens == prefills + checked
    if reqs is not None:
        assert stats.generated_tokens == sum(len(r.output) for r in reqs)
        assert sum(r.draft_tokens for r in reqs) == stats.draft_tokens
        assert sum(r.accepted_tokens for r in reqs) == stats.accepted_tokens
        assert all(r.accepted_tokens <= r.draft_tokens for r in reqs)
    assert engine.idle
    engine.scheduler.check_integrity()
    assert engine.scheduler.memory.kv.used_count == engine.tree.size_info().total  # only the cache


def run(engine: Engine, prompts, arrivals=None, max_new=MAX_NEW, sampling=None):
    """Generate and return the outputs, checking the books after every step (debug)."""
    reqs = engine.make_requests(prompts, max_new, sampling, arrivals)
    engine.serve(reqs)
    check_books(engine, reqs, chunked=engine.config.chunked_prefill_size is not None)
    return [r.output for r in reqs]


# ------------------------------------------------------------------------------ greedy
@pytest.mark.parametrize("name", ["ngram", "draft"])
@pytest.mark.parametrize("k", range(1, 7))
def test_greedy_equals_each_request_alone_for_both_drafts_and_every_k(
        citylm, workload, draft_model, name, k):
    model, _ = citylm
    prompts, want = workload
    engine = Engine(model, speculative=drafter_of(name, draft_model), num_draft_tokens=k,
                    max_running=4, debug=True)
    arrivals = [float(i % 3) * 2 for i in range(len(prompts))]  # mixed arrivals
    assert run(engine, prompts, arrivals) == want
    assert engine.stats.draft_tokens > 0
    if name == "draft":  # the shipped draft guesses CityLM well
        assert engine.stats.accepted_tokens > engine.stats.draft_tokens / 2


@pytest.mark.parametrize("cache", ["radix", "none"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_equals_alone_under_every_policy_and_cache(citylm, workload, draft_model,
                                                           policy, cache):
    model, _ = citylm
    prompts, want = workload
    for name in ("ngram", "draft"):
        engine = Engine(model, speculative=drafter_of(name, draft_model), num_draft_tokens=3,
                        policy=policy, cache=cache, seed=1, max_running=3, mode="mixed",
                        debug=True)
        assert run(engine, prompts, [0.0, 0.0, 1.0, 3.0, 3.0, 5.0, 6.0, 6.0]) == want
        if cache == "radix":
            assert engine.stats.cached_tokens > 0  # the system prompt was shared


def test_the_speculative_engine_counts_every_token_once(citylm, workload, draft_model):
    model, _ = citylm
    prompts, want = workload
    engine = Engine(model, speculative=drafter_of("draft", draft_model), num_draft_tokens=4,
                    max_running=8, debug=True)
    reqs = engine.make_requests(prompts, MAX_NEW)
    engine.serve(reqs)
    assert [r.output for r in reqs] == want
    check_books(engine, reqs)
    stats = engine.stats
    assert stats.retractions == 0  # every request's first token came from one prefill
    assert stats.generated_tokens == len(reqs) + stats.decode_tokens + stats.accepted_tokens
    steps = [r for r in engine.trace if r.decode]
    tokens_per_check = (stats.decode_tokens + stats.accepted_tokens) / stats.decode_tokens
    assert tokens_per_check > 2.0  # CityDraft at k = 4 keeps most guesses
    assert len(steps) < MAX_NEW  # fewer decode steps than tokens


def test_chunked_prefill_with_speculation(citylm, workload, draft_model):
    """A request still prefilling drafts nothing; from its first token on it is checked."""
    model, _ = citylm
    prompts, want = workload
    for mode in ("mixed", "prefill-first"):
        engine = Engine(model, speculative=drafter_of("draft", draft_model),
                        num_draft_tokens=4, chunked_prefill_size=16, max_running=4,
                        mode=mode, cache="radix", debug=True)
        assert run(engine, prompts) == want
        for record in engine.trace:
            assert not set(record.prefill) & {rid for rid, _, _ in record.checks}


def test_requests_with_processors_or_logprobs_decode_without_guesses(citylm, workload):
    """Penalties and logprobs need every row through the sampler: such a request drafts
    nothing and its tokens are the non-speculative engine's."""
    model, _ = citylm
    prompts, want = workload
    params = [SamplingParams(MAX_NEW, repetition_penalty=1.3), SamplingParams(MAX_NEW, logprobs=2),
              *[SamplingParams(MAX_NEW)] * (len(prompts) - 2)]
    plain = Engine(model, max_running=4).generate(prompts, sampling=params)
    engine = Engine(model, speculative="ngram", num_draft_tokens=3, max_running=4, debug=True)
    reqs = engine.make_requests(prompts, sampling=params)
    engine.serve(reqs)
    assert [r.output for r in reqs] == plain
    assert plain[2:] == want[2:]
    assert reqs[0].draft_tokens == reqs[1].draft_tokens == 0
    assert engine.stats.draft_tokens > 0


# ------------------------------------------------------------------------------ sampled
@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_sampled_outputs_equal_speculative_generate_with_the_same_seed(
        citylm, workload, draft_model, name):
    model, _ = citylm
    prompts, _ = workload
    k = 3
    params = [SamplingParams(MAX_NEW, temperature=t, top_p=p, seed=s)
              for s, (t, p) in enumerate([(1.0, 1.0), (0.8, 0.9), (1.3, 0.95), (0.5, 1.0)] * 2)]
    params = params[:len(prompts)]
    engine = Engine(model, speculative=drafter_of(name, draft_model), num_draft_tokens=k,
                    max_running=3, debug=True, cache="radix")
    out = run(engine, prompts, sampling=params)
    for prompt, p, got in zip(prompts, params, out, strict=True):
        want = speculative_generate(model, drafter_of(name, draft_model), prompt, MAX_NEW, k,
                                    temperature=p.temperature, top_p=p.top_p, seed=p.seed)
        assert got == want.tokens


# ------------------------------------------------------------------------------ workloads
class EchoDrafter(Drafter):
    """Guesses a request's true continuation (``answers``, by prompt), with every
    ``wrong``-th guess replaced: accepted runs, rejections and accepted eos guesses."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], wrong: int, vocab: int):
        self.answers, self.wrong, self.vocab = answers, wrong, vocab
        self.live: set[Hashable] = set()

    def propose(self, tokens: Sequence[int], k: int, *, key: Hashable = None) -> list[int]:
        for prompt, answer in self.answers.items():
            if tuple(tokens[:len(prompt)]) == prompt and list(
                    tokens[len(prompt):]) == answer[:len(tokens) - len(prompt)]:
                done = len(tokens) - len(prompt)
                self.live.add(key)
                guess = answer[done:done + k]
                return [(t + 1) % self.vocab if (done + j) % self.wrong == 0 else t
                        for j, t in enumerate(guess)]
        return []

    def release(self, key: Hashable) -> None:
        self.live.discard(key)


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 6))
    prompts = [draw(st.lists(st.integers(0, 60), min_size=1, max_size=10)) for _ in range(n)]
    max_new = [draw(st.integers(1, 16)) for _ in range(n)]
    arrivals = [float(draw(st.integers(0, 4))) for _ in range(n)]
    need = max(len(p) + m for p, m in zip(prompts, max_new))
    capacity = draw(st.integers(need, need + 12))
    return dict(prompts=prompts, max_new=max_new, arrivals=arrivals, kv_capacity=capacity,
                max_running=draw(st.integers(2, 4)), k=draw(st.integers(1, 6)),
                mode=draw(st.sampled_from(["prefill-first", "mixed", "static"])),
                cache=draw(st.sampled_from(["radix", "none"])),
                admission=draw(st.sampled_from(["budget", "reserve"])),
                wrong=draw(st.integers(1, 5)), chunk=draw(st.sampled_from([None, 8])),
                ratio=draw(st.sampled_from([0.7, 0.05])))  # 0.05: admits boldly, retracts


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(w=workloads())
def test_workloads_keep_tokens_and_books(model, w):
    """Random workloads on a random float64 model (early eos stops), small pools forcing
    retraction: tokens are each request's alone, integrity holds after every step, no slot
    or drafter state is left."""
    want = [model.reference_generate(p, m) for p, m in zip(w["prompts"], w["max_new"])]
    answers = {tuple(p): a for p, a in zip(w["prompts"], want)}
    drafter = EchoDrafter(answers, w["wrong"], model.config.vocab_size)
    if w["chunk"] is not None and w["mode"] == "static":
        w["chunk"] = None
    chunk = w["chunk"] if w["chunk"] is None else max(w["chunk"], w["max_running"])
    engine = Engine(model, speculative=drafter, num_draft_tokens=w["k"],
                    kv_capacity=w["kv_capacity"], max_running=w["max_running"], mode=w["mode"],
                    cache=w["cache"], admission=w["admission"], chunked_prefill_size=chunk,
                    new_token_ratio=w["ratio"], min_ratio=min(w["ratio"], 0.05), debug=True)
    assert run(engine, w["prompts"], w["arrivals"], w["max_new"]) == want
    assert drafter.live == set()  # released on finish and on retraction


def test_retraction_releases_the_draft_state_and_recomputes_exactly(citylm, draft_model):
    model, tok = citylm
    prompts = city_prompts(tok, 6, seed=5)
    want = [model.reference_generate(p, 40) for p in prompts]
    drafter = drafter_of("draft", draft_model)
    engine = Engine(model, speculative=drafter, num_draft_tokens=6, kv_capacity=150,
                    max_running=6, new_token_ratio=0.1, min_ratio=0.05, debug=True)
    assert run(engine, prompts, max_new=40) == want
    assert engine.stats.retractions > 0
    assert drafter._states == {}


# ------------------------------------------------------------------------------ options
def test_bad_options_are_clear_value_errors(citylm):
    model, _ = citylm
    with pytest.raises(ValueError, match="blocking loop"):
        Engine(model, speculative="ngram", overlap=True)
    with pytest.raises(ValueError, match="ngram, draft"):
        Engine(model, speculative="eagle")
    for k in (0, 17, 2.5):
        with pytest.raises(ValueError, match="num_draft_tokens"):
            Engine(model, speculative="ngram", num_draft_tokens=k)
    with pytest.raises(ValueError, match="Drafter"):
        Engine(model, speculative=42)
    from minisrv.sim import SimBackend

    with pytest.raises(ValueError, match="SimBackend"):
        Engine(SimBackend(), speculative="ngram")


def test_a_drafter_returning_too_many_guesses_is_refused(citylm):
    class Greedy(Drafter):
        def propose(self, tokens, k, *, key=None):
            return [1] * (k + 1)

    model, tok = citylm
    engine = Engine(model, speculative=Greedy(), num_draft_tokens=2)
    with pytest.raises(ValueError, match="at most 2"):
        engine.generate([tok.encode("FR:")], 8)
    assert engine.idle and engine.scheduler.memory.kv.used_count == 0


def test_a_draft_token_outside_the_vocabulary_is_refused(citylm):
    class Wild(Drafter):
        def propose(self, tokens, k, *, key=None):
            return [10_000]

    model, tok = citylm
    engine = Engine(model, speculative=Wild(), num_draft_tokens=2)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([tok.encode("FR:")], 8)
    assert engine.idle


def test_the_server_serves_speculatively(citylm):
    """``--speculative draft --num-draft-tokens 3`` reaches the engine; a greedy request
    through the server is the request alone."""
    pytest.importorskip("fastapi")
    model, tok = citylm
    config = cli_replies_are_alone(
        ["--speculative", "draft", "--num-draft-tokens", "3", "--max-running", "4",
         "--kv-capacity", "400"], ["FR: Paris, Marseille,", "JP:"], 20, model, tok)
    assert (config.engine.speculative, config.engine.num_draft_tokens) == ("draft", 3)


def test_drafts_reach_the_runner_as_one_check_per_request(citylm):
    """A traced step: the check's guesses, what was kept, the KV freed at once."""
    model, tok = citylm
    engine = Engine(model, speculative="draft", num_draft_tokens=4, debug=True)
    req = engine.add_request(tok.encode("FR: Paris,"), SamplingParams(24))
    engine.step()  # the prefill: the first token, no guesses
    assert engine.trace[-1].checks == ()
    held = req.kv_len
    out = engine.step()
    (rid, drafted, accepted), = out.record.checks
    assert (rid, drafted) == (req.rid, 4)
    assert len(out.tokens_of(req)) == accepted + 1
    assert req.kv_len == held + accepted + 1 == req.seq_len - 1
    assert out.record.drafted - out.record.accepted == 4 - accepted  # the KV freed


@pytest.mark.parametrize("attention", ["loop", "padded"])
def test_checks_under_each_attention_backend(citylm, workload, draft_model, attention):
    model, _ = citylm
    prompts, want = workload
    engine = Engine(model, speculative=drafter_of("draft", draft_model), num_draft_tokens=5,
                    attention=attention, max_running=8, debug=True)
    assert run(engine, prompts) == want
