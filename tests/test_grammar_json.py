"""Structured output on a vocabulary that can spell JSON: a tiny offline Llama folder with a
byte-level BPE (``minisrv.grammar.tiny_json``). Every output parses with strict
``json.loads`` (no raw control character in a string, even a length-bounded one) and
validates against its schema, sampled at many seeds and temperatures, with and without
jump-forward; the engine serves the loaded folder's constrained requests over its tokenizer
with no vocabulary given, and loading it does not need the grammar extra."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

pytest.importorskip("xgrammar")
pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")

from minisrv import Engine  # noqa: E402
from minisrv.grammar import GrammarState, compile_grammar, hf_vocabulary  # noqa: E402
from minisrv.grammar.compile import json_schema_ebnf  # noqa: E402
from minisrv.grammar.reference import constrained_generate  # noqa: E402
from minisrv.grammar.tiny_json import CITIES, write_json_llama  # noqa: E402
from minisrv.model import load_model  # noqa: E402
from minisrv.sampling import SamplingParams  # noqa: E402

RECORD = {
    "type": "object",
    "properties": {
        "city": {"enum": list(CITIES[:4])},
        "rank": {"type": "integer", "minimum": 1, "maximum": 99},
        "tag": {"type": "string", "maxLength": 6},
    },
    "required": ["city", "rank", "tag"],
    "additionalProperties": False,
}
LIST = {
    "type": "object",
    "properties": {
        "cities": {"type": "array", "items": {"enum": list(CITIES)}, "minItems": 1,
                   "maxItems": 3},
        "capital": {"type": "boolean"},
    },
    "required": ["cities", "capital"],
    "additionalProperties": False,
}



def strict_object(**properties: dict) -> dict:
    """A JSON object schema with exactly ``properties``, all required."""
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


# Strings with minLength or maxLength, which xgrammar 0.2.9 compiles to [^"\\\r\n]{m,n}:
# without minisrv's fix they hold raw control characters. Each schema is bounded, so every
# output ends within the token budget.
BOUNDED = {
    "maxLength": strict_object(city={"type": "string", "maxLength": 10},
                               rank={"type": "integer", "minimum": 0, "maximum": 999}),
    "minLength": strict_object(name={"type": "string", "minLength": 3, "maxLength": 12}),
    "pattern": strict_object(code={"type": "string", "pattern": "^[A-Z]{2}-[0-9]{1,3}$"},
                             note={"type": "string", "maxLength": 6}),
    "enum": strict_object(city={"enum": list(CITIES[:4])},
                          tag={"type": "string", "minLength": 1, "maxLength": 5}),
    "nested": strict_object(
        place=strict_object(city={"type": "string", "maxLength": 8},
                            tags={"type": "array", "items": {"type": "string", "maxLength": 4},
                                  "maxItems": 2}),
        stops={"type": "array", "maxItems": 2,
               "items": strict_object(name={"type": "string", "minLength": 1, "maxLength": 5})}),
}

PICK = r"(Paris|Rome|Oslo), [1-9][0-9]?"  # a regex on the same model: not JSON


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    """The tiny checkpoint folder (random weights, byte-level BPE)."""
    return write_json_llama(tmp_path_factory.mktemp("json_llama"))


@pytest.fixture(scope="module")
def checkpoint(folder):
    """The loaded tiny model, its tokenizer and their grammar vocabulary."""
    model, tokenizer = load_model(folder, "cpu")
    vocab = hf_vocabulary(tokenizer.hf, size=model.config.vocab_size, stop_ids=model.eos_ids)
    return model, tokenizer, vocab


def test_the_byte_level_vocabulary_spells_everything(checkpoint) -> None:
    model, tokenizer, vocab = checkpoint
    assert vocab.byte_complete and vocab.size == model.config.vocab_size
    assert vocab.stop_ids == model.eos_ids
    assert any(len(b) > 3 for b in vocab.token_bytes)  # merged tokens such as "city"


@pytest.mark.parametrize("schema", [RECORD, LIST], ids=["record", "list"])
@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.6])
@pytest.mark.parametrize("jump_forward", [False, True])
def test_outputs_parse_and_validate(checkpoint, schema, temperature, jump_forward) -> None:
    model, tokenizer, vocab = checkpoint
    grammar = compile_grammar(vocab, json_schema=schema)
    for seed in range(6 if temperature else 2):
        prompt = tokenizer.encode(["", '{"city": ', "rank"][seed % 3])
        params = SamplingParams(max_new_tokens=120, temperature=temperature, seed=seed)
        run = constrained_generate(model, prompt, grammar, params, jump_forward=jump_forward)
        assert run.tokens[-1] in model.eos_ids, "a bounded schema always finishes"
        value = json.loads(tokenizer.decode(run.tokens))
        jsonschema.validate(value, schema)
        if jump_forward:
            assert run.jumped > 0  # the keys and punctuation are fixed
            assert run.forwards == len(run.tokens) - run.jumped


def test_bounded_strings_hold_no_raw_control_character(checkpoint) -> None:
    """Every schema of ``BOUNDED``, greedy and sampled at seeds 0-4, batched in one engine:
    each output ends, parses with strict ``json.loads`` (RFC 8259 forbids a raw U+0000-U+001F
    in a string) and validates. Without the fix 18 of these 30 outputs held one."""
    model, tokenizer, _ = checkpoint
    runs = [(name, seed) for name in BOUNDED for seed in (None, *range(5))]
    params = [SamplingParams(max_new_tokens=150, json_schema=json.dumps(BOUNDED[name]),
                             temperature=0.0 if seed is None else 1.0, seed=seed or 0)
              for name, seed in runs]
    engine = Engine(model, kv_capacity=6000, max_running=len(runs))
    outs = engine.generate([tokenizer.encode("")] * len(runs), sampling=params)
    for (name, seed), tokens in zip(runs, outs, strict=True):
        assert tokens[-1] in model.eos_ids, (name, seed)
        text = tokenizer.decode(tokens)
        assert not re.search(r"[\x00-\x1f]", text), (name, seed, text)
        jsonschema.validate(json.loads(text), BOUNDED[name])


def test_xgrammar_bounded_strings_admit_control_characters() -> None:
    """The XGrammar behaviour that ``json_schema_ebnf`` works around: a bounded string of
    xgrammar's own grammar takes a raw control character (all but \\r and \\n); minisrv's
    takes none, and still takes the same text without it. Unbounded strings needed no fix,
    and their grammar is xgrammar's unchanged. When this test fails, xgrammar has fixed it:
    compile JSON schemas with ``compile_json_schema`` again and drop the rewrite."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    schema = json.dumps(BOUNDED["maxLength"])
    upstream = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    ours = xgr.Grammar.from_ebnf(json_schema_ebnf(schema))
    for code in range(0x20):
        text = '{"city": "a' + chr(code) + 'b", "rank": 7}'
        assert accepts(upstream, text) == (chr(code) not in "\r\n"), code
        assert not accepts(ours, text), code
    assert accepts(ours, '{"city": "a b", "rank": 7}')
    unbounded = json.dumps(strict_object(city={"type": "string"}, n={"type": "integer"}))
    assert json_schema_ebnf(unbounded) == str(
        xgr.Grammar.from_json_schema(unbounded, any_whitespace=False, strict_mode=True))


def test_jump_forward_fixes_the_keys(checkpoint) -> None:
    _, tokenizer, vocab = checkpoint
    state = GrammarState(compile_grammar(vocab, json_schema=RECORD))
    assert state.jump_forward_text() == '{"city": "'
    assert tokenizer.decode(state.jump_forward()) == '{"city": "'


def test_schema_key_order_does_not_matter_to_the_cache(checkpoint) -> None:
    _, _, vocab = checkpoint
    first = compile_grammar(vocab, json_schema=RECORD)
    reordered = json.dumps(dict(reversed(list(RECORD.items()))))
    assert compile_grammar(vocab, json_schema=reordered) is first


def test_an_unconstrained_random_model_writes_no_json(checkpoint) -> None:
    model, tokenizer, _ = checkpoint
    text = tokenizer.decode(model.reference_generate(tokenizer.encode(""), 40))
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_masked_logits_of_a_batch_row_match_the_state(checkpoint) -> None:
    model, tokenizer, vocab = checkpoint
    state = GrammarState(compile_grammar(vocab, json_schema=LIST))
    logits = model(torch.tensor(tokenizer.encode('{"cities": [')))[-1:].clone()
    from minisrv.grammar import GrammarLogitsProcessor

    GrammarLogitsProcessor(vocab.size)(logits, [state])
    assert torch.equal(torch.isfinite(logits[0]), state.allowed_mask())


def test_the_word_level_appendix_checkpoint_cannot_spell_json(tmp_path) -> None:
    from minisrv.experiments.gpu import write_tiny_llama

    model, tokenizer = load_model(write_tiny_llama(tmp_path), "cpu")
    vocab = hf_vocabulary(tokenizer.hf, size=model.config.vocab_size, stop_ids=model.eos_ids)
    assert not vocab.byte_complete
    with pytest.raises(ValueError, match="cannot spell JSON: it needs '{'"):
        compile_grammar(vocab, json_schema=RECORD)
    # Its words decode without the spaces between them: a space is what it lacks, not 'w'.
    with pytest.raises(ValueError, match="cannot spell") as err:
        compile_grammar(vocab, regex=r"(what|why) is")
    assert "' '" in str(err.value) and "'w'" not in str(err.value)
    assert compile_grammar(vocab, regex=r"(what|why)is").witness in ("whatis", "whyis")


@pytest.mark.parametrize("jump_forward", [False, True])
def test_an_engine_on_a_loaded_folder_needs_no_vocabulary_given(checkpoint, jump_forward) -> None:
    """``load_model(folder)`` then ``Engine(model)``: a JSON-schema and a regex request share
    batches with a free one, each equal to the request alone under its grammar."""
    model, tokenizer, vocab = checkpoint
    assert model.tokenizer is tokenizer
    prompts = [tokenizer.encode(t) for t in ("", '{"city": ', "", "rank", "")]
    params = [SamplingParams(max_new_tokens=80, json_schema=json.dumps(RECORD)),
              SamplingParams(max_new_tokens=80, temperature=1.2, seed=3,
                             json_schema=json.dumps(LIST)),
              SamplingParams(max_new_tokens=20, regex=PICK),
              SamplingParams(max_new_tokens=20, temperature=1.5, seed=5, regex=PICK),
              SamplingParams(max_new_tokens=12)]
    engine = Engine(model, kv_capacity=800, max_running=4, jump_forward=jump_forward)
    out = engine.generate(prompts, sampling=params)
    grammars = engine.grammars()
    assert grammars.vocab.size == model.config.vocab_size
    assert grammars.vocab.stop_ids == model.eos_ids
    assert grammars.vocab.token_bytes == vocab.token_bytes  # the tokenizer's own tokens
    for prompt, p, tokens in zip(prompts, params, out):
        if p.grammar is None:
            assert tokens == model.reference_generate(prompt, p.max_new_tokens)
            continue
        kind, text = p.grammar
        alone = constrained_generate(model, prompt, compile_grammar(vocab, **{kind: text}), p,
                                     jump_forward=jump_forward)
        assert tokens == alone.tokens
        assert tokens[-1] in model.eos_ids, "a bounded grammar always finishes"
        written = tokenizer.decode(tokens)
        if kind == "regex":
            assert re.fullmatch(PICK, written)
        else:
            jsonschema.validate(json.loads(written), json.loads(text))
    engine.scheduler.check_integrity()


def test_loading_a_folder_does_not_need_the_grammar_extra(folder, monkeypatch) -> None:
    """Without xgrammar the folder loads and serves free requests; only a constrained one
    is refused, naming the extra."""
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` now fails
    for name in [n for n in sys.modules if n.startswith("minisrv.grammar")]:
        monkeypatch.delitem(sys.modules, name)  # so nothing of it is imported already
    model, tokenizer = load_model(folder, "cpu")
    assert model.tokenizer is tokenizer
    engine = Engine(model, kv_capacity=200)
    with pytest.raises(ValueError, match=r"grammar extra"):
        engine.add_request(tokenizer.encode(""), SamplingParams(regex=PICK))
    assert engine.idle  # nothing was queued
    prompt = tokenizer.encode("rank")
    assert engine.generate([prompt], 8) == [model.reference_generate(prompt, 8)]
