"""Structured output over HTTP: ``response_format`` and SGLang's ``regex``, checked end to end.

On CityLM a regex over its alphabet is followed exactly (the reply equals the per-request
constrained reference) and JSON is refused with a 400 that names the character CityLM cannot
spell; on a tiny byte-level-BPE Llama folder the official ``openai`` client gets JSON that
parses with strict ``json.loads`` and validates against the schema it sent (or is an object,
for ``json_object``), greedy and sampled.
"""

from __future__ import annotations

import json
import re
import time

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from serving import cli_replies_are_alone  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from minisrv import SamplingParams, load_citylm  # noqa: E402
from minisrv.grammar import citylm_vocabulary, compile_grammar  # noqa: E402
from minisrv.grammar.reference import constrained_generate  # noqa: E402
from minisrv.grammar.tiny_json import write_json_llama  # noqa: E402
from minisrv.model import load_tokenizer  # noqa: E402
from minisrv.server.app import create_app  # noqa: E402
from minisrv.server.config import EngineOptions, model_name  # noqa: E402
from minisrv.server.worker import LocalEngine  # noqa: E402

CITIES3 = r"( [A-Z][a-z]+,){3}"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]},
                   "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}
BOUNDED = {  # a length-bounded string: raw control characters in it before minisrv's fix
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10},
                   "rank": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}


def serving(model: str) -> TestClient:
    options = EngineOptions(model=model, device="cpu", kv_capacity=400, max_running=4)
    client = TestClient(create_app(LocalEngine(options), load_tokenizer(model),
                                   model_name(model)))
    client.__enter__()
    for _ in range(600):
        if client.get("/health").status_code == 200:
            return client
        time.sleep(0.05)
    raise AssertionError("the server did not become healthy")


@pytest.fixture(scope="module")
def citylm_server():
    client = serving("citylm")
    yield client
    client.__exit__(None, None, None)


def test_a_regex_completion_is_the_constrained_reference(citylm_server) -> None:
    model, tok = load_citylm("cpu")
    grammar = compile_grammar(citylm_vocabulary(tok, size=model.config.vocab_size),
                              regex=CITIES3)
    for prompt in ("FR:", "JP:"):
        r = citylm_server.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": 40, "temperature": 0, "regex": CITIES3})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert re.fullmatch(CITIES3, text)
        want = constrained_generate(model, tok.encode(prompt), grammar,
                                    SamplingParams(max_new_tokens=40)).tokens
        assert text == tok.decode([t for t in want if t not in model.eos_ids])


def test_json_on_citylm_is_a_400_naming_what_it_cannot_spell(citylm_server) -> None:
    for body in ({"prompt": "FR:", "response_format": {"type": "json_object"}},
                 {"prompt": "FR:", "response_format": {"type": "json_schema",
                                                       "json_schema": {"schema": SCHEMA}}},
                 {"prompt": "FR:", "response_format": {"type": "yaml"}},
                 {"prompt": "FR:", "regex": "a", "ebnf": 'root ::= "a"'}):
        r = citylm_server.post("/v1/completions", json=body)
        assert r.status_code == 400, body
        assert r.json()["error"]["message"]
    r = citylm_server.post("/v1/completions", json={"prompt": "FR:", "response_format": {
        "type": "json_object"}})
    message = r.json()["error"]["message"]
    # It names what the request asked for (JSON) and what is missing, not the json_schema
    # field the server turns json_object into: the request sent no json_schema.
    assert "cannot spell JSON" in message and "'{'" in message, message
    assert "json_schema" not in message, message
    ok = citylm_server.post("/v1/completions", json={"prompt": "FR:", "max_tokens": 4})
    assert ok.status_code == 200  # the server keeps serving


def test_json_schema_strict_is_a_boolean_and_the_schema_is_enforced_either_way() -> None:
    """``json_schema.strict`` true, false or absent gives the same grammar (minisrv has no
    unconstrained mode); anything but a JSON boolean is a 400, as in OpenAI and SGLang."""
    from types import SimpleNamespace

    from minisrv.server.door import BadRequest, grammar_fields

    def fields(**spec):
        fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, **spec}}
        return grammar_fields(SimpleNamespace(response_format=fmt))

    want = {"json_schema": json.dumps(SCHEMA, sort_keys=True)}
    assert fields() == fields(strict=True) == fields(strict=False) == want
    for bad in ("true", 1, 0):
        with pytest.raises(BadRequest, match="strict must be true or false"):
            fields(strict=bad)


def test_the_openai_client_gets_strict_schema_valid_json(tmp_path) -> None:
    """``response_format`` json_schema (an enum, a bounded string), greedy and at seeds 0-4,
    and json_object at seeds 0-4 (greedy, the random model repeats itself inside a key
    without end): every reply ends, parses with strict ``json.loads`` and validates.
    Before the fix 4 of the 6 bounded-string replies held a raw control character."""
    from openai import OpenAI

    folder = str(write_json_llama(tmp_path / "json_llama"))
    client = serving(folder)
    formats = {"enum": SCHEMA, "bounded": BOUNDED, "object": {"type": "object"}}
    try:
        api = OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
        for name, schema in formats.items():
            fmt = ({"type": "json_object"} if name == "object" else
                   {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                           "strict": True}})
            for seed in (*range(5), *([None] if name != "object" else [])):
                out = api.chat.completions.create(
                    model=model_name(folder), messages=[{"role": "user", "content": "a city"}],
                    max_tokens=200, temperature=1.0 if seed is not None else 0.0, seed=seed,
                    response_format=fmt)
                assert out.choices[0].finish_reason == "stop", (name, seed)
                jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    finally:
        client.__exit__(None, None, None)


def test_a_chunked_prefill_server_gives_each_request_its_own_tokens() -> None:
    """``--chunked-prefill-size`` reaches the engine: prompts longer than the budget are
    prefilled in chunks, and every reply is still the request alone."""
    model, tok = load_citylm("cpu")
    config = cli_replies_are_alone(
        ["--chunked-prefill-size", "8", "--max-running", "4", "--kv-capacity", "400"],
        ["FR: Paris, Marseille,", "JP: Tokyo, Osaka, Nagoya,"], 12, model, tok)
    assert config.engine.chunked_prefill_size == 8
