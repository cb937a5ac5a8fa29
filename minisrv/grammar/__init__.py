"""Structured output: grammars (regex, JSON schema, EBNF) turned into token masks.

The engine-independent core of constrained decoding with xgrammar, the library SGLang and
vLLM use. ``Vocabulary`` describes what a tokenizer can spell (an engine builds it on first
use from the tokenizer its model carries: ``model_vocabulary``); ``compile_grammar``
compiles a grammar once per text and refuses one the vocabulary cannot spell; a
``GrammarState`` per request gives the next token's mask, advances on the accepted token and
names the text the grammar fixes next (jump-forward); ``GrammarLogitsProcessor`` masks a
whole step's logits in one batched operation. ``reference.constrained_generate`` is the
per-request oracle.

Needs the ``grammar`` extra (``pip install minisrv[grammar]``).
"""

from __future__ import annotations

from minisrv.grammar.compile import CompiledGrammar, compile_grammar
from minisrv.grammar.processor import GrammarLogitsProcessor
from minisrv.grammar.state import GrammarState
from minisrv.grammar.vocab import (
    Vocabulary,
    citylm_vocabulary,
    hf_vocabulary,
    model_vocabulary,
    tokenizer_vocabulary,
)

__all__ = [
    "CompiledGrammar",
    "GrammarLogitsProcessor",
    "GrammarState",
    "Vocabulary",
    "citylm_vocabulary",
    "compile_grammar",
    "hf_vocabulary",
    "model_vocabulary",
    "tokenizer_vocabulary",
]
