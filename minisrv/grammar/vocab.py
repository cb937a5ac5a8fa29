"""What a tokenizer can spell, in the form xgrammar needs: a ``TokenizerInfo`` plus the
grammar cache that belongs to it (a compiled grammar is only valid for one vocabulary).

``tokenizer_vocabulary`` builds it from either of minisrv's tokenizers; ``model_vocabulary``
from the tokenizer a loaded model carries (``model.tokenizer``, set by ``load_model``), which
is what an engine uses, so a constrained request on a loaded checkpoint needs no vocabulary
from its caller."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import xgrammar as xgr

from minisrv.tokenizer import HFTokenizer, Tokenizer


class Vocabulary:
    """A tokenizer's tokens as xgrammar sees them, the compiler bound to them, and its cache.

    ``size`` is the width of the model's logits (it may exceed the tokenizer's own count:
    padding ids are then special tokens, never allowed by a mask). ``ordinary`` maps each
    other token id with text to its bytes: what a spelling may use. ``start_chars`` holds the
    ASCII characters some ordinary token begins with: a character outside it can never be
    written next, which is how ``compile_grammar`` names what is missing. ``byte_complete``
    is true when every one of the 256 bytes is a token, so any byte string can be spelled
    one byte at a time and no spelling check is needed.
    """

    def __init__(self, info: xgr.TokenizerInfo, name: str) -> None:
        self.info = info
        self.name = name
        self.size: int = info.vocab_size
        self.stop_ids: tuple[int, ...] = tuple(info.stop_token_ids)
        special = set(info.special_token_ids) | set(self.stop_ids)
        self.token_bytes: list[bytes] = list(info.decoded_vocab)
        self.ordinary: dict[int, bytes] = {i: b for i, b in enumerate(self.token_bytes)
                                           if b and i not in special}
        ordinary = list(self.ordinary.values())
        self.byte_complete: bool = len({b for b in ordinary if len(b) == 1}) == 256
        self.start_chars: frozenset[str] = frozenset(chr(b[0]) for b in ordinary if b[0] < 128)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.cache: dict[tuple[str, str], Any] = {}  # (kind, text) -> CompiledGrammar
        self.compiles = 0  # how many grammars were compiled (the cache test counts them)

    def __repr__(self) -> str:
        return f"Vocabulary({self.name}, size={self.size}, stop_ids={self.stop_ids})"


def citylm_vocabulary(tokenizer: Tokenizer | None = None, size: int | None = None,
                      stop_ids: tuple[int, ...] | None = None) -> Vocabulary:
    """CityLM's character vocabulary: one token per character (``VocabType.RAW``), ``<bos>``
    special (never allowed), ``<eos>`` the stop token that ends a finished grammar.

    ``size`` is the model's logits width when it exceeds the tokenizer's 61 ids;
    ``stop_ids`` the model's eos ids (default: ``<eos>``).
    """
    tok = tokenizer or Tokenizer()
    tokens = ["" if i == tok.bos_id else tok.id_to_str(i) for i in range(tok.vocab_size)]
    info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=size or tok.vocab_size,
                             stop_token_ids=list(stop_ids or (tok.eos_id,)))
    return Vocabulary(info, "citylm")


def hf_vocabulary(hf_tokenizer: Any, size: int | None = None,
                  stop_ids: tuple[int, ...] | None = None) -> Vocabulary:
    """A Hugging Face tokenizer's vocabulary (``TokenizerInfo.from_huggingface``), e.g. the
    ``.hf`` of a loaded folder's ``HFTokenizer``. ``size`` is the model's logits width;
    ``stop_ids`` the model's eos ids (default: the tokenizer's eos)."""
    kwargs: dict[str, Any] = {"vocab_size": size}
    if stop_ids:
        kwargs["stop_token_ids"] = list(stop_ids)
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, **kwargs)
    name = Path(getattr(hf_tokenizer, "name_or_path", "") or "").name
    return Vocabulary(info, name or type(hf_tokenizer).__name__)


def tokenizer_vocabulary(tokenizer: Tokenizer | HFTokenizer, size: int | None = None,
                         stop_ids: tuple[int, ...] | None = None) -> Vocabulary:
    """The vocabulary of either tokenizer ``load_model`` returns: CityLM's characters
    (``citylm_vocabulary``) or a Hugging Face tokenizer's (``hf_vocabulary`` of its ``.hf``).
    ``size`` is the model's logits width, ``stop_ids`` its eos ids. Anything else is a
    ValueError: what a grammar may write depends on exactly how ids spell text."""
    if isinstance(tokenizer, HFTokenizer):
        return hf_vocabulary(tokenizer.hf, size=size, stop_ids=stop_ids)
    if isinstance(tokenizer, Tokenizer):
        return citylm_vocabulary(tokenizer, size=size, stop_ids=stop_ids)
    raise ValueError(f"no grammar vocabulary for a {type(tokenizer).__name__}: give a "
                     "minisrv Tokenizer or HFTokenizer, or build the Vocabulary yourself")


def model_vocabulary(model: Any, size: int | None = None,
                     stop_ids: tuple[int, ...] | None = None) -> Vocabulary:
    """The vocabulary an engine serving ``model`` masks over, when none is given: that of the
    tokenizer the model carries (``model.tokenizer``, set by ``load_model``), over the
    model's logits width ``size`` and eos ids ``stop_ids``.

    A model built by hand carries none: it gets CityLM's characters if ``size`` is CityLM's,
    else a ValueError naming the fix, since a mask over the wrong tokens would be silently
    wrong.
    """
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None:
        return tokenizer_vocabulary(tokenizer, size=size, stop_ids=stop_ids)
    if size not in (None, Tokenizer().vocab_size):
        raise ValueError(f"this model's vocabulary ({size} tokens) is not CityLM's and the "
                         "model carries no tokenizer: load it with load_model, set "
                         "model.tokenizer, or give its Vocabulary, "
                         "engine.grammars(hf_vocabulary(...))")
    return citylm_vocabulary(size=size, stop_ids=stop_ids)
