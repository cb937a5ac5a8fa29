"""Compiling a grammar once per (kind, text) for a vocabulary, refusing what it cannot spell.

Compilation builds xgrammar's per-state token-mask cache over the whole vocabulary: tens of
milliseconds for a JSON schema, far longer than a decode step, so the engine must do it once
per grammar text (the cache here) and off its step loop. Bad input is a ``ValueError``
naming the problem: an invalid regex, schema or EBNF, characters the vocabulary lacks, or a
spelling search that ran out of its budget before it could decide (``spelling``).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from minisrv.grammar.spelling import find_spelling, missing_chars, probe_vocabulary
from minisrv.grammar.vocab import Vocabulary

KINDS = ("regex", "json_schema", "ebnf")
# What a refusal calls the grammar. JSON is named as JSON, not by the field that carried it:
# the server turns OpenAI's response_format json_object into json_schema {"type": "object"},
# and a message naming "json_schema" answered a request that never sent one.
WHAT = {"regex": "this regex", "json_schema": "JSON", "ebnf": "this EBNF grammar"}
_LOCK = threading.Lock()  # the engine compiles from a worker thread; one compile at a time
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] [^\s]+:\d+: (Check failed: .*? is false: )?")


@dataclass(frozen=True)
class CompiledGrammar:
    """One compiled grammar: what it was (``kind``, ``text``), xgrammar's compiled form, and
    the vocabulary it belongs to. ``witness`` is one complete text the vocabulary can spell
    (``None`` when the vocabulary is byte-complete and no search was needed)."""

    kind: str
    text: str
    compiled: xgr.CompiledGrammar
    vocab: Vocabulary
    witness: str | None

    def __repr__(self) -> str:
        return f"CompiledGrammar({self.kind}={self.text[:40]!r}, vocab={self.vocab.name})"


def compile_grammar(vocab: Vocabulary, *, regex: str | None = None,
                    json_schema: str | dict[str, Any] | None = None,
                    ebnf: str | None = None) -> CompiledGrammar:
    """The compiled grammar for exactly one of ``regex``, ``json_schema`` (text or dict) or
    ``ebnf`` (xgrammar's GBNF, rule ``root``), from ``vocab``'s cache when compiled before.

    JSON schemas compile strictly (no properties beyond the schema's) with compact
    separators and no free whitespace, so a model cannot pad its answer with spaces forever.
    Raises ``ValueError`` for an invalid grammar and for one the vocabulary cannot spell.
    """
    given = {k: v for k, v in zip(KINDS, (regex, json_schema, ebnf)) if v is not None}
    if len(given) != 1:
        raise ValueError(f"give exactly one of regex, json_schema, ebnf; got {sorted(given)}")
    kind, value = next(iter(given.items()))
    text = _grammar_text(kind, value)
    key = (kind, text)
    with _LOCK:
        if key not in vocab.cache:
            vocab.cache[key] = _compile_checked(vocab, kind, text)
            vocab.compiles += 1
        return vocab.cache[key]


def _grammar_text(kind: str, value: Any) -> str:
    """The cache key's text: a JSON schema normalised (sorted keys), so equal schemas share."""
    if kind != "json_schema":
        if not isinstance(value, str) or not value:
            raise ValueError(f"{kind} must be a non-empty string, got {value!r}")
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"json_schema is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"json_schema must be a JSON object, got {type(value).__name__}")
    return json.dumps(value, sort_keys=True)


def _xgr_compile(compiler: xgr.GrammarCompiler, kind: str, text: str) -> xgr.CompiledGrammar:
    """xgrammar's compile of one grammar, its errors turned into ``ValueError``s."""
    try:
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "ebnf":
            return compiler.compile_grammar(text)
        return compiler.compile_grammar(json_schema_ebnf(text))
    except (RuntimeError, xgr.InvalidJSONError) as err:
        message = _XGR_PREFIX.sub("", str(err).strip().splitlines()[0])
        raise ValueError(f"invalid {kind}: {message}") from None


def json_schema_ebnf(schema: str) -> str:
    r"""The EBNF that a JSON schema compiles to: xgrammar's own (strict, compact separators,
    no free whitespace), with the raw control characters U+0000-U+001F taken out.

    XGrammar 0.2.9 writes the characters of a string with ``minLength`` or ``maxLength`` as
    ``[^"\\\r\n]``, which admits U+0000-U+001F (its unbounded strings exclude them), so a
    bounded string could hold a raw control character: RFC 8259 (section 7) forbids that,
    and strict ``json.loads`` rejects it. Compact JSON holds no raw control character at all
    (in a string it must be escaped; between values only whitespace could be one, and there
    is none), so every negated character class of the grammar is made to exclude the range.
    Positive classes stay: the only ones holding a control character are the whitespace of
    a lookahead, which compact output never meets, and a ``pattern`` string is xgrammar's
    ``Regex(..., json_string=true)``, which excludes the range already. Once xgrammar's
    bounded strings exclude it (``test_xgrammar_bounded_strings_admit_control_characters``
    then fails), this goes and ``compile_json_schema`` compiles the schema again.
    """
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    return _QUOTED_OR_CLASS.sub(_exclude_controls, str(grammar))


# A quoted literal (a Regex("...") argument too) or a character class of xgrammar's EBNF.
_QUOTED_OR_CLASS = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]')
_CONTROLS = r"\0-\x1f"  # U+0000-U+001F in that syntax


def _exclude_controls(match: re.Match[str]) -> str:
    """A negated class ``[^...]`` made to exclude U+0000-U+001F; anything else as it was."""
    item = match.group()
    if not item.startswith("[^") or item.startswith("[^" + _CONTROLS):
        return item
    return "[^" + _CONTROLS + item[2:]


def _compile_checked(vocab: Vocabulary, kind: str, text: str) -> CompiledGrammar:
    """Compile, then search for a spelling in the vocabulary (see ``spelling``)."""
    compiled = _xgr_compile(vocab.compiler, kind, text)
    if vocab.byte_complete:
        return CompiledGrammar(kind, text, compiled, vocab, None)
    probe = _xgr_compile(probe_vocabulary().compiler, kind, text)
    spelling = find_spelling(compiled, vocab, compile_probe=probe)
    if spelling.witness is not None:
        witness = b"".join(vocab.token_bytes[i] for i in spelling.witness)
        return CompiledGrammar(kind, text, compiled, vocab, witness.decode("utf-8", "replace"))
    missing = missing_chars(probe, vocab, spelling.dead_ends)
    if spelling.out_of_budget and not missing:
        # The search stopped on one path (a free-text field tried in token-id order can take
        # the whole budget) and no character was missing on it: the cause is the budget.
        raise ValueError(
            f"undecided whether the {vocab.name} vocabulary can spell {WHAT[kind]}: no "
            f"complete text found within the search budget ({spelling.masks} masks), and the "
            f"vocabulary has every character the grammar asked for on the way"
        )
    named = ", ".join(repr(c) for c in missing) if missing else "characters outside ASCII"
    raise ValueError(
        f"the {vocab.name} vocabulary cannot spell {WHAT[kind]}: it needs {named}, which no "
        f"token of the vocabulary provides"
        + (" (no spelling found within the search budget)" if spelling.out_of_budget else "")
    )
