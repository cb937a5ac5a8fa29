"""Structured output on CityLM's character vocabulary: grammars as token masks.

Every constrained output matches its grammar across seeds and temperatures; greedy output
equals an independent re-derivation (full forward each step, boolean mask); jump-forward
writes the same tokens with fewer forwards; the batched processor equals per-row masking
and leaves free rows bit-for-bit unchanged; a grammar CityLM cannot spell is refused at
compile time, naming the missing characters; each grammar compiles once.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("xgrammar")

from minisrv.grammar import (  # noqa: E402
    GrammarLogitsProcessor,
    GrammarState,
    citylm_vocabulary,
    compile_grammar,
)
from minisrv.grammar.reference import constrained_generate  # noqa: E402
from minisrv.model import load_citylm  # noqa: E402
from minisrv.sampling import SamplingParams  # noqa: E402
from minisrv.tokenizer import ALPHABET, Tokenizer  # noqa: E402

THREE_CITIES = r"[A-Z][a-z]{1,11}(, [A-Z][a-z]{1,11}){2}\."
RECORDS = r"([A-Z]{2}: [A-Z][a-z]{1,11}\n){1,3}"
EBNF = r'''root ::= "Cities: " city (", " city)? (", " city)? "."
city ::= [A-Z] [a-z] [a-z]? [a-z]? [a-z]? [a-z]? [a-z]? [a-z]?'''
EBNF_AS_REGEX = r"Cities: [A-Z][a-z]{1,7}(, [A-Z][a-z]{1,7}){0,2}\."
GRAMMARS = [("regex", THREE_CITIES, THREE_CITIES), ("regex", RECORDS, RECORDS),
            ("ebnf", EBNF, EBNF_AS_REGEX)]
PROMPTS = ["FR:", "JP: Tokyo, ", "\n"]
TOK = Tokenizer()


@pytest.fixture(scope="module")
def citylm64():
    """The trained CityLM in float64: jump-forward feeds several tokens per forward, and
    float64 keeps those logits equal to one-at-a-time ones far below any argmax gap."""
    return load_citylm("cpu", torch.float64)[0]


@pytest.fixture(scope="module")
def vocab():
    return citylm_vocabulary()


def grammar(vocab, kind: str, text: str):
    return compile_grammar(vocab, **{kind: text})


@pytest.fixture(scope="module")
def greedy64(citylm64, vocab):
    """Greedy constrained generation on the float64 CityLM, each (grammar, prompt) generated
    once: the independent-reference test and jump-forward's plain run at temperature 0 ask
    for the same ones (greedy draws nothing, so the seed does not matter)."""
    runs = {}

    def generate(kind: str, text: str, prompt: str):
        if (kind, text, prompt) not in runs:
            runs[kind, text, prompt] = constrained_generate(
                citylm64, TOK.encode(prompt), grammar(vocab, kind, text),
                SamplingParams(max_new_tokens=64))
        return runs[kind, text, prompt]

    return generate


@pytest.mark.parametrize(("kind", "text", "pattern"), GRAMMARS)
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.5])
def test_outputs_match_their_grammar(citylm, vocab, kind, text, pattern, temperature) -> None:
    model, _ = citylm
    g = grammar(vocab, kind, text)
    for seed in range(4 if temperature else 1):
        for prompt in PROMPTS:
            params = SamplingParams(max_new_tokens=64, temperature=temperature, seed=seed,
                                    top_p=0.9 if seed % 2 else 1.0)
            out = constrained_generate(model, TOK.encode(prompt), g, params).tokens
            assert out[-1] == TOK.eos_id, "a bounded grammar always finishes"
            assert re.fullmatch(pattern, TOK.decode(out)), TOK.decode(out)


def independent_greedy(model, prompt: list[int], g, n: int) -> list[int]:
    """Greedy under the grammar without the KV cache, the processor or xgrammar's kernel:
    the full sequence through the model each step, the boolean mask applied by hand."""
    state, ids, out = GrammarState(g), list(prompt), []
    while len(out) < n and not state.is_terminated:
        logits = model(torch.tensor(ids))[-1]
        token = int(logits.masked_fill(~state.allowed_mask(), float("-inf")).argmax())
        state.accept(token)
        ids.append(token)
        out.append(token)
    return out


@pytest.mark.parametrize(("kind", "text", "pattern"), GRAMMARS)
def test_greedy_equals_an_independent_reference(citylm64, vocab, greedy64, kind, text,
                                                pattern) -> None:
    g = grammar(vocab, kind, text)
    for prompt in PROMPTS:
        ours = greedy64(kind, text, prompt).tokens
        assert ours == independent_greedy(citylm64, TOK.encode(prompt), g, 64)


def test_without_a_grammar_citylm_does_not_follow_the_format(citylm) -> None:
    model, _ = citylm
    free = TOK.decode(model.reference_generate(TOK.encode("FR:"), 40))
    assert not re.fullmatch(THREE_CITIES, free)


@pytest.mark.parametrize(("kind", "text", "pattern"), GRAMMARS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_jump_forward_writes_the_same_tokens(citylm64, vocab, greedy64, kind, text, pattern,
                                             temperature) -> None:
    g = grammar(vocab, kind, text)
    saved = 0
    for seed, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_new_tokens=64, temperature=temperature, seed=seed)
        plain = (constrained_generate(citylm64, TOK.encode(prompt), g, params) if temperature
                 else greedy64(kind, text, prompt))
        jumped = constrained_generate(citylm64, TOK.encode(prompt), g, params,
                                      jump_forward=True)
        assert jumped.tokens == plain.tokens
        assert plain.jumped == 0 and plain.forwards == len(plain.tokens)
        assert jumped.forwards == plain.forwards - jumped.jumped
        saved += jumped.jumped
    assert saved > 0  # every grammar here fixes ", " or ": " or "Cities: " somewhere


def test_jump_forward_names_the_fixed_text(vocab) -> None:
    state = GrammarState(grammar(vocab, "ebnf", EBNF))
    assert state.jump_forward_text() == "Cities: "
    assert state.jump_forward() == TOK.encode("Cities: ", bos=False)
    assert state.accepted == []  # jump_forward only looks
    state.accept_all(state.jump_forward())
    assert state.jump_forward() == []  # a city's first letter is free


def states_at_random_points(vocab, rows: int, seed: int) -> list[GrammarState | None]:
    """Constrained states a random number of allowed tokens in, with free rows between."""
    gen = torch.Generator().manual_seed(seed)
    kinds = [GRAMMARS[i % 3] for i in range(rows)]
    states: list[GrammarState | None] = []
    for i, (kind, text, _) in enumerate(kinds):
        if i % 3 == 1:
            states.append(None)
            continue
        state = GrammarState(grammar(vocab, kind, text))
        for _ in range(int(torch.randint(0, 12, (), generator=gen))):
            allowed = torch.nonzero(state.allowed_mask()).flatten()
            token = int(allowed[torch.randint(len(allowed), (), generator=gen)])
            if token == TOK.eos_id:
                break
            state.accept(token)
        states.append(state)
    return states


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 24])
def test_batched_processor_equals_per_row_masks(vocab, dtype, rows) -> None:
    states = states_at_random_points(vocab, rows, seed=rows)
    logits = torch.randn(rows, vocab.size, generator=torch.Generator().manual_seed(0))
    logits = logits.to(dtype)
    expected = logits.clone()
    for i, state in enumerate(states):
        if state is not None:
            expected[i] = expected[i].masked_fill(~state.allowed_mask(), float("-inf"))
    processor = GrammarLogitsProcessor(vocab.size)
    before = logits.clone()
    assert processor(logits, states) is logits
    assert torch.equal(logits, expected)
    for i, state in enumerate(states):
        if state is None:  # free rows: the very same bits
            assert torch.equal(as_bits(logits[i]), as_bits(before[i]))


def test_one_processor_across_steps_of_changing_batches(vocab) -> None:
    processor = GrammarLogitsProcessor(vocab.size)  # its bitmask buffer is reused
    for step, rows in enumerate([24, 1, 7, 30]):
        states = states_at_random_points(vocab, rows, seed=100 + step)
        logits = torch.randn(rows, vocab.size, generator=torch.Generator().manual_seed(step))
        expected = logits.clone()
        for i, state in enumerate(states):
            if state is not None:
                expected[i] = expected[i].masked_fill(~state.allowed_mask(), float("-inf"))
        assert torch.equal(processor(logits, states), expected)


def as_bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so equality means bit-for-bit (NaN and -0.0 too)."""
    return x.view({torch.bfloat16: torch.int16, torch.float32: torch.int32,
                   torch.float64: torch.int64}[x.dtype])


def test_a_mixed_batch_gives_free_rows_their_unconstrained_tokens(citylm, vocab) -> None:
    model, _ = citylm
    logits = model(torch.tensor(TOK.encode("FR: Paris, Lyon")))[-3:].clone()
    free = logits.clone()
    states = [None, GrammarState(grammar(vocab, "regex", r"[0-9a-z]*\.")), None]
    GrammarLogitsProcessor(vocab.size)(logits, states)
    assert torch.equal(logits[0], free[0]) and torch.equal(logits[2], free[2])
    assert not torch.equal(logits[1], free[1])
    allowed = set(ALPHABET[26 + 7:]) | {"."}  # the lowercase letters and the full stop
    finite = {TOK.id_to_str(i) for i in torch.isfinite(logits[1]).nonzero().flatten().tolist()}
    assert finite == allowed


def test_processor_checks_its_input(vocab) -> None:
    processor = GrammarLogitsProcessor(vocab.size)
    state = GrammarState(grammar(vocab, "regex", THREE_CITIES))
    with pytest.raises(ValueError, match="one state per row"):
        processor(torch.zeros(2, vocab.size), [state])
    with pytest.raises(ValueError, match="columns"):
        processor(torch.zeros(1, vocab.size + 3), [state])
    untouched = torch.zeros(2, vocab.size)
    processor(untouched, [None, None])
    assert torch.equal(untouched, torch.zeros(2, vocab.size))
    done = GrammarState(grammar(vocab, "regex", "Rome"))
    done.accept_all([*TOK.encode("Rome", bos=False), TOK.eos_id])
    assert done.is_terminated
    with pytest.raises(ValueError, match="terminated"):
        processor(torch.zeros(2, vocab.size), [state, done])
    late = torch.zeros(2, vocab.size)  # the overlapped loop's one-step-late finished row
    GrammarLogitsProcessor(vocab.size, skip_terminated=True)(late, [state, done])
    assert torch.equal(late[1], torch.zeros(vocab.size)) and torch.isinf(late[0]).any()


@pytest.mark.parametrize(
    ("kwargs", "missing"),
    [({"json_schema": {"type": "object", "properties": {"rank": {"type": "integer"}}}},
      ["'{'"]),
     ({"json_schema": {"type": "integer"}}, ["'0'", "'1'", "'9'"]),  # CityLM has '-'

     ({"regex": r"Paris [0-9]+"}, ["'0'", "'5'", "'9'"]),
     ({"ebnf": 'root ::= "City: " [A-Z]+ "!"'}, ["'!'"])],
)
def test_a_grammar_citylm_cannot_spell_is_refused_naming_what_is_missing(kwargs,
                                                                          missing) -> None:
    vocab = citylm_vocabulary()
    with pytest.raises(ValueError, match="cannot spell") as err:
        compile_grammar(vocab, **kwargs)
    for char in missing:
        assert char in str(err.value)
    assert vocab.compiles == 0 and vocab.cache == {}  # nothing half-compiled kept


def letters_vocabulary(*extra: str):
    """Printable ASCII and every two-letter word, plus ``extra`` tokens: every character a
    free-text field asks for, in a vocabulary of 777 tokens and more."""
    import itertools
    import string

    import xgrammar as xgr

    from minisrv.grammar.vocab import Vocabulary

    words = ["".join(p) for p in itertools.product(string.ascii_lowercase, repeat=2)]
    info = xgr.TokenizerInfo(["</s>", *string.printable, *words, *extra], xgr.VocabType.RAW,
                             stop_token_ids=[0])
    return Vocabulary(info, "letters")


def test_a_free_text_field_is_spelled_from_a_short_ascii_text() -> None:
    """The witness comes from the ASCII probe (a closing quote tried before another letter),
    spelled in the vocabulary's tokens: found at once where the search in token-id order
    ('a', 'aa', ...) runs out of budget (test below)."""
    vocab = letters_vocabulary()
    witness = compile_grammar(vocab, regex=r'\{"n": "[a-z]+"\}').witness
    assert re.fullmatch(r'\{"n": "[a-z]+"\}', witness)
    schema = {"type": "object", "required": ["name", "tags"],
              "properties": {"name": {"type": "string"},
                             "tags": {"type": "array", "items": {"type": "string"}}}}
    answer = json.loads(compile_grammar(vocab, json_schema=schema).witness)
    assert set(answer) == {"name", "tags"} and isinstance(answer["name"], str)
    assert isinstance(answer["tags"], list)


def test_a_search_out_of_budget_is_refused_as_undecided_not_as_missing_characters() -> None:
    """A free-text field tried in token-id order ('a', 'aa', ...) swallows the witness search's
    budget on a vocabulary that has every character the grammar needs (here the probe cannot
    help: the grammar ends in 'é', outside ASCII); the refusal must say that, not name
    "characters outside ASCII" it does not need (review 54)."""
    vocab = letters_vocabulary("é")
    with pytest.raises(ValueError, match="undecided whether the letters vocabulary can spell "
                       "this regex: no complete text found within the search budget") as err:
        compile_grammar(vocab, regex=r'\{"n": "[a-z]+"\}é')
    assert "outside ASCII" not in str(err.value) and "cannot spell" not in str(err.value)
    assert "has every character" in str(err.value)
    assert vocab.cache == {}


def test_spellable_grammars_pass_with_a_witness(vocab) -> None:
    for kind, text, pattern in GRAMMARS:
        witness = grammar(vocab, kind, text).witness
        assert witness is not None and re.fullmatch(pattern, witness)
    assert grammar(vocab, "regex", "Paris1|London").witness == "London"  # one path spells
    assert grammar(vocab, "regex", "(ab)*c").witness.endswith("c")  # a loop is not a trap
    assert len(grammar(vocab, "regex", "[a-z]{300}").witness) == 300


def test_a_dead_end_at_run_time_ends_the_request(vocab) -> None:
    state = GrammarState(grammar(vocab, "regex", "Paris1|London"))
    state.accept_all(TOK.encode("Paris", bos=False))
    assert state.allowed_mask().nonzero().flatten().tolist() == [TOK.eos_id]
    assert state.dead_end
    state.accept(TOK.eos_id)
    assert state.is_terminated


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [({"regex": "[A-Z"}, "invalid regex.*Unclosed"),
     ({"json_schema": "{not json"}, "not valid JSON"),
     ({"json_schema": {"type": "objec"}}, "invalid json_schema.*objec"),
     ({"json_schema": [1, 2]}, "JSON object"),
     ({"ebnf": 'root ::= "a" |'}, "invalid ebnf"),
     ({"regex": ""}, "non-empty"),
     ({}, "exactly one"),
     ({"regex": "a", "ebnf": 'root ::= "a"'}, "exactly one")],
)
def test_invalid_grammars_are_value_errors_naming_the_problem(vocab, kwargs, problem) -> None:
    with pytest.raises(ValueError, match=problem):
        compile_grammar(vocab, **kwargs)


def test_each_grammar_compiles_once() -> None:
    vocab = citylm_vocabulary()
    first = compile_grammar(vocab, regex=THREE_CITIES)
    assert compile_grammar(vocab, regex=THREE_CITIES) is first
    compile_grammar(vocab, ebnf=EBNF)
    schema = {"type": "string", "enum": ["Rome"]}
    with pytest.raises(ValueError):  # CityLM has no double quote
        compile_grammar(vocab, json_schema=schema)
    assert vocab.compiles == 2 and len(vocab.cache) == 2
    assert compile_grammar(vocab, regex=THREE_CITIES + "?") is not first
    assert vocab.compiles == 3


def test_accept_refuses_a_forbidden_token_and_keeps_the_state(vocab) -> None:
    state = GrammarState(grammar(vocab, "regex", THREE_CITIES))
    state.accept_all(TOK.encode("Rome", bos=False))
    before = state.allowed_mask()
    with pytest.raises(ValueError, match="not allowed"):
        state.accept(TOK.encode("X", bos=False)[0])
    assert torch.equal(state.allowed_mask(), before) and len(state.accepted) == 4
    with pytest.raises(ValueError, match="roll back"):
        state.rollback(5)


@settings(max_examples=40, deadline=None)
@given(choices=st.lists(st.integers(0, 10_000), max_size=30), back=st.integers(0, 30))
def test_rollback_restores_every_earlier_mask(choices: list[int], back: int) -> None:
    vocab = citylm_vocabulary()
    state = GrammarState(compile_grammar(vocab, regex=RECORDS))
    masks = [state.allowed_mask()]
    for choice in choices:
        allowed = state.allowed_mask().nonzero().flatten().tolist()
        state.accept(allowed[choice % len(allowed)])
        if state.is_terminated:
            break
        masks.append(state.allowed_mask())
    terminated = state.is_terminated
    n = min(back, len(state.accepted))
    state.rollback(n)
    # rolling back any token, the terminating one first, reopens the grammar; none leaves it
    assert state.is_terminated == (terminated and n == 0)
    if not state.is_terminated:
        assert torch.equal(state.allowed_mask(), masks[len(state.accepted)])


def test_padded_logits_never_allow_the_padding_ids() -> None:
    vocab = citylm_vocabulary(size=64)  # a model whose logits are padded past 61 ids
    state = GrammarState(compile_grammar(vocab, regex=r"[a-z:]+"))
    logits = torch.zeros(1, 64)
    GrammarLogitsProcessor(64)(logits, [state])
    assert torch.isinf(logits[0, TOK.vocab_size:]).all()
    assert torch.isinf(logits[0, TOK.bos_id]) and torch.isinf(logits[0, TOK.eos_id])
    assert int(torch.isfinite(logits).sum()) == 27  # the 26 lowercase letters and ':'
