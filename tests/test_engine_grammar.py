"""Structured output through the engine: constrained requests batched with free ones.

The oracle is ``minisrv.grammar.reference.constrained_generate``: the request alone, the
same mask applied by hand at every position. A free request in the same batch gets exactly
its unconstrained tokens. The masks may be installed from a request thread while the engine
thread runs steps (the server's first constrained request): a step in flight keeps the
processors it started with, and requests racing a running engine still get their reference.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

pytest.importorskip("xgrammar")

from minisrv import Engine, SamplingParams, load_citylm  # noqa: E402
from minisrv.configs import CITYLM  # noqa: E402
from minisrv.grammar import citylm_vocabulary, compile_grammar  # noqa: E402
from minisrv.grammar.reference import constrained_generate  # noqa: E402
from minisrv.model import CityLM  # noqa: E402
from minisrv.runner.model_runner import ModelRunner  # noqa: E402
from minisrv.scheduler.overlap import short_switch_interval  # noqa: E402
from minisrv.server.engine_loop import EngineLoop  # noqa: E402
from minisrv.sim import SimBackend  # noqa: E402
from minisrv.tokenizer import Tokenizer  # noqa: E402

THREE_CITIES = r"( [A-Z][a-z]+,){3}"  # complete after the third comma: then only <eos>


@pytest.fixture(scope="module")
def citylm():
    return load_citylm("cpu")


_ALONE: dict[tuple, list[int]] = {}
"""The oracles' outputs, each computed once: the parameters of a test (cache and overlap, the
loop's options) and other tests ask for the same requests. Keyed by the model; the tokenizer
is CityLM's characters in every test."""


def reference(model, tok, prompt: str, regex: str, params: SamplingParams) -> list[int]:
    key = (model, prompt, regex, params)
    if key not in _ALONE:
        vocab = citylm_vocabulary(tok, size=model.config.vocab_size)
        _ALONE[key] = constrained_generate(model, tok.encode(prompt),
                                           compile_grammar(vocab, regex=regex), params).tokens
    return list(_ALONE[key])


def free_reference(model, tok, prompt: str, n: int, ignore_eos: bool = False) -> list[int]:
    """``model.reference_generate``: a free request alone."""
    key = (model, prompt, n, ignore_eos)
    if key not in _ALONE:
        _ALONE[key] = model.reference_generate(tok.encode(prompt), n, ignore_eos=ignore_eos)
    return list(_ALONE[key])


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
            assert tokens == free_reference(model, tok, prompt, p.max_new_tokens)
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


def test_masks_installed_during_a_step_apply_from_the_next(citylm) -> None:
    """A processor holds a step inside the sampler's masking while another thread installs
    the grammar masks (``Engine.grammars``, as a server's request thread does). The step in
    flight neither masks with them nor gives them its token; the next step does both. With
    the processors kept in a list changed in place, the held step went on into the new
    processor and handed it a token it had never masked."""
    model, tok = citylm
    inside, go_on = threading.Event(), threading.Event()

    def hold(logits, reqs):
        if not go_on.is_set():
            inside.set()
            go_on.wait(30)
        return logits

    engine = Engine(ModelRunner(model, logits_processors=[hold]), kv_capacity=200)
    engine.add_request(tok.encode("FR:"), SamplingParams(max_new_tokens=4))
    stepping = threading.Thread(target=engine.step)
    stepping.start()
    assert inside.wait(30)
    grammars = engine.grammars()
    followed: list[list[int]] = []
    grammars.accept = lambda reqs, tokens: followed.append(list(tokens))
    go_on.set()
    stepping.join(30)
    assert not stepping.is_alive() and followed == []
    engine.step()
    assert len(followed) == 1
    assert engine.backend.sampler.logits_processors == (hold, grammars)


def test_a_new_vocabulary_is_refused_while_constrained_requests_run(citylm) -> None:
    """Replacing the masks would drop the grammar states of requests already decoding."""
    model, tok = citylm
    vocab = citylm_vocabulary(tok, size=model.config.vocab_size)
    engine = Engine(model, kv_capacity=300)
    first = engine.grammars(vocab)
    engine.add_request(tok.encode("FR:"), SamplingParams(max_new_tokens=40, regex=THREE_CITIES))
    engine.step()
    with pytest.raises(ValueError, match="in flight"):
        engine.grammars(citylm_vocabulary(tok, size=model.config.vocab_size))
    assert engine.grammars() is first
    while not engine.idle:
        engine.step()
    assert engine.grammars(vocab) is not first  # nothing constrained in flight: replaced
    assert engine.backend.sampler.logits_processors == (engine.grammars(),)


class Replies:
    """An ``EngineLoop``'s ``emit``: each key's tokens and how it ended."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.ended: dict[int, str] = {}
        self.lock = threading.Lock()

    def __call__(self, events, snapshot) -> None:
        with self.lock:
            for event in events:
                self.tokens.setdefault(event.key, []).extend(event.tokens)
                if event.finish is not None or event.error is not None:
                    self.ended[event.key] = event.finish or f"error: {event.error}"

    def wait(self, keys: int, tokens: bool = False, timeout: float = 60.0) -> None:
        """Until ``keys`` requests ended (with ``tokens``: until ``keys`` streamed a token)."""
        deadline = time.monotonic() + timeout
        while len(self.tokens if tokens else self.ended) < keys:
            assert time.monotonic() < deadline, f"{keys} requests never got there"
            time.sleep(0.0005)


@pytest.mark.parametrize("options", [{}, {"overlap": True}, {"jump_forward": True}],
                         ids=["blocking", "overlap", "jump_forward"])
def test_grammar_requests_racing_a_running_engine_get_their_reference(citylm, options) -> None:
    """The server's threads, 5 times over on a fresh engine: while the engine thread streams
    free requests, four request threads at once send the first constrained requests, so the
    masks are built and installed while steps run (the GIL changing hands every few
    microseconds). Every reply is its reference: a constrained one its grammar's (greedy and
    sampled), a free one the model's own, and none is an error. A step that applied part of
    a set of processors, a second set built, or jump-forward set apart from its masks would
    show here as a reply off its reference; the exact interleaving of a step in flight is
    ``test_masks_installed_during_a_step_apply_from_the_next``'s."""
    model, tok = citylm
    free = [(p, SamplingParams(max_new_tokens=16, ignore_eos=True)) for p in ("DE:", "JP:")]
    constrained = [(p, SamplingParams(max_new_tokens=40, temperature=t, seed=s,
                                      regex=THREE_CITIES))
                   for p, t, s in (("FR:", 0.0, 0), ("IT:", 1.2, 1), ("ES:", 1.2, 2),
                                   ("FR:", 1.5, 3))]
    want = [free_reference(model, tok, p, sp.max_new_tokens, ignore_eos=True) for p, sp in free]
    want += [reference(model, tok, p, THREE_CITIES, sp) for p, sp in constrained]
    with short_switch_interval():
        for _ in range(5):
            engine = Engine(model, kv_capacity=800, max_running=8, **options)
            replies = Replies()
            loop = EngineLoop(engine, replies)
            loop.start()

            def send(key: int, prompt: str, params: SamplingParams, loop=loop) -> None:
                loop.submit(key, loop.make_request(tok.encode(prompt), params))

            for key, (prompt, params) in enumerate(free):
                send(key, prompt, params)
            senders = [threading.Thread(target=send, args=(key, prompt, params))
                       for key, (prompt, params) in enumerate(constrained, len(free))]
            replies.wait(1, tokens=True)  # the free requests are decoding
            for sender in senders:
                sender.start()
            for sender in senders:
                sender.join(30)
            replies.wait(len(want))
            loop.stop()
            assert [replies.tokens[key] for key in range(len(want))] == want
            assert all(not reason.startswith("error") for reason in replies.ended.values())
            engine.scheduler.check_integrity()
