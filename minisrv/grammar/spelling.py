"""Can a vocabulary spell a grammar? The check ``compile_grammar`` runs before accepting one.

CityLM's 61 characters have no digits, braces or double quotes, so a JSON schema compiled
against them would leave every request with an empty mask at its first token. The check
searches, depth first, for one complete text of the grammar made of the vocabulary's tokens
(a *witness*), trying the stop token first at every node and the other allowed tokens in id
order, for at most ``budget`` masks. Before that it tries a shortcut: a short text in single
ASCII characters (the probe vocabulary below, 101 tokens, where looking one character ahead
costs little), spelled in the vocabulary's tokens. On a 32,000-token vocabulary every mask of
the search costs milliseconds, and a free-text JSON field tried in id order ('a', 'aa', ...)
takes the whole budget there. Without a witness the grammar is refused, naming the
characters the grammar asked for, at the dead ends and the texts leading to them, that the
vocabulary lacks (found by replaying those texts on a probe vocabulary of every printable
ASCII character).

What it guarantees, exactly: a grammar that passes has at least one complete spelling in the
vocabulary (the witness, kept on the compiled grammar), so the first mask is never empty. It
does not prove that every prefix a model may choose can be completed (``Paris1|London``
passes through ``London``, yet a model that writes ``Paris`` is stuck); that rarer dead end
is caught at run time (the state then allows only the stop token and sets ``dead_end``). A
grammar whose depth-first spelling needs more than ``budget`` masks is refused too (as
undecided, naming the budget, where no character was missing on the search's way).
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from functools import lru_cache

import xgrammar as xgr

from minisrv.grammar.bits import allowed_ids
from minisrv.grammar.vocab import Vocabulary

SPELL_BUDGET = 4000
"""Masks the witness search may compute before it gives up (a few ms each at most)."""

DEPTH_CAP = 64
"""Tokens after which the first search pass backtracks."""

MAX_PROBES = 64
"""Texts replayed on the probe vocabulary to name what is missing."""

PROBE_CHARS = string.printable  # letters, digits, punctuation, space, \t \n \r \x0b \x0c


@dataclass
class Spelling:
    """The result of the search: a witness (token ids, stop token excluded) or the dead ends."""

    witness: list[int] | None
    dead_ends: list[list[int]] = field(default_factory=list)
    masks: int = 0
    out_of_budget: bool = False  # the search stopped at ``budget`` masks, not exhausted


def find_spelling(compiled: xgr.CompiledGrammar, vocab: Vocabulary,
                  budget: int = SPELL_BUDGET,
                  compile_probe: xgr.CompiledGrammar | None = None) -> Spelling:
    """Search for a complete text of ``compiled`` in ``vocab``'s tokens.

    With ``compile_probe`` (the grammar compiled for ``probe_vocabulary()``), first a short
    text in single ASCII characters (``probe_text``), spelled in ``vocab``'s tokens if it can
    be: one mask per probe character tried, where the search in ``vocab`` pays a mask of the
    whole vocabulary per token tried. Otherwise depth-first in ``vocab``'s tokens, with paths
    cut at ``DEPTH_CAP`` tokens (so a repetition tried first, like ``(ab)*`` in ``(ab)*c``,
    cannot swallow the search), then without the cut (for long fixed texts), each with half
    the budget."""
    if compile_probe is not None:
        text = probe_text(compile_probe)
        witness = None if text is None else spell_text(compiled, vocab, text)
        if witness is not None:
            return Spelling(witness, masks=1)
    first = _search(compiled, vocab, budget // 2, DEPTH_CAP)
    if first.witness is not None:
        return first
    second = _search(compiled, vocab, budget - budget // 2, None)
    second.dead_ends = first.dead_ends + second.dead_ends
    second.masks += first.masks
    second.out_of_budget = second.out_of_budget and first.out_of_budget
    return second


def _search(compiled: xgr.CompiledGrammar, vocab: Vocabulary, budget: int,
            depth_cap: int | None) -> Spelling:
    """One depth-first search, stop token first, children in id order."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab.size)
    stops = set(vocab.stop_ids)
    result = Spelling(None)
    path: list[int] = []
    stack: list[list[int]] = []  # per depth: the children still to try, reversed
    cut = False

    def expand() -> bool:
        """Push the children of the current node; True when it completes the grammar."""
        nonlocal cut
        matcher.fill_next_token_bitmask(bitmask)
        result.masks += 1
        ids = allowed_ids(bitmask[0], vocab.size)
        if any(i in stops for i in ids) or matcher.is_completed():
            return True
        children = [i for i in ids if i not in stops]
        if not children:
            result.dead_ends.append(list(path))
        if depth_cap is not None and len(path) >= depth_cap:
            cut, children = cut or bool(children), []
        stack.append(children[::-1])
        return False

    if expand():
        result.witness = []
        return result
    while stack and result.masks < budget:
        if not stack[-1]:
            stack.pop()
            if path:
                path.pop()
                matcher.rollback(1)
            continue
        token = stack[-1].pop()
        if not matcher.accept_token(token):  # the mask allowed it: cannot happen
            raise RuntimeError(f"xgrammar refused token {token} its own mask allowed")
        path.append(token)
        if expand():
            result.witness = list(path)
            return result
    result.out_of_budget = bool(stack) or cut
    if stack:  # out of budget: the path it was on tells what the grammar kept asking for
        result.dead_ends.extend(path[: len(path) - k] for k in range(min(8, len(path) + 1)))
    return result


def probe_text(compile_probe: xgr.CompiledGrammar, budget: int = SPELL_BUDGET) -> bytes | None:
    """A complete text of the grammar in printable ASCII (``compile_probe`` is the grammar
    compiled for ``probe_vocabulary()``), or ``None`` when none is found within ``budget``
    masks of that 101-token vocabulary.

    Depth first, and at each node the characters are tried in the order of how little the
    grammar allows after them: inside a free-text field a closing quote (after which only
    ``,`` or ``}`` may come) goes before another letter (after which almost anything may).
    A character after which the grammar allows exactly what it allowed at a node already on
    the path is tried last, as a likely loop (``\\`` then ``"`` inside a string)."""
    probe = probe_vocabulary()
    matcher = xgr.GrammarMatcher(compile_probe)
    bitmask = xgr.allocate_token_bitmask(1, probe.size)
    stops = set(probe.stop_ids)
    masks = 0

    def allowed() -> tuple[bytes, list[int]]:
        nonlocal masks
        matcher.fill_next_token_bitmask(bitmask)
        masks += 1
        return bitmask[0].numpy().tobytes(), allowed_ids(bitmask[0], probe.size)

    def ranked(seen: set[bytes], ids: list[int]) -> list[int]:
        """The node's characters, the most promising last (the stack pops from the end)."""
        keys = {}
        for i in ids:
            if i in stops or not matcher.accept_token(i):
                continue
            signature, after = allowed()
            matcher.rollback(1)
            done = any(j in stops for j in after) or matcher.is_terminated()
            keys[i] = (not done, signature in seen, len(after), i)
        return sorted(keys, key=keys.get, reverse=True)

    signature, ids = allowed()
    if any(i in stops for i in ids):
        return b""
    path: list[int] = []
    seen = [signature]
    stack = [ranked({signature}, ids)]
    while stack and masks < budget:
        if not stack[-1] or len(path) >= DEPTH_CAP:
            stack.pop()
            if path:
                path.pop()
                seen.pop()
                matcher.rollback(1)
            continue
        token = stack[-1].pop()
        matcher.accept_token(token)
        path.append(token)
        signature, ids = allowed()
        if any(i in stops for i in ids):
            return b"".join(probe.token_bytes[i] for i in path)
        seen.append(signature)
        stack.append(ranked(set(seen), ids))
    return None


def spell_text(compiled: xgr.CompiledGrammar, vocab: Vocabulary, text: bytes,
               budget: int = SPELL_BUDGET) -> list[int] | None:
    """Token ids of ``vocab`` that spell ``text`` and that ``compiled`` accepts one by one,
    ending where the grammar allows a stop token (longest tokens first, backtracking), or
    ``None`` when no such spelling is found within ``budget`` tokens tried."""
    by_bytes = _token_table(vocab)
    longest = max(map(len, by_bytes), default=0)
    matcher = xgr.GrammarMatcher(compiled)
    path: list[int] = []
    lengths = [min(longest, len(text))]  # per depth: the next token length to try
    tried = 0
    while lengths and tried < budget:
        at = sum(len(vocab.token_bytes[i]) for i in path)
        if at == len(text):
            bitmask = xgr.allocate_token_bitmask(1, vocab.size)
            matcher.fill_next_token_bitmask(bitmask)
            if matcher.is_terminated() or any(
                    i in vocab.stop_ids for i in allowed_ids(bitmask[0], vocab.size)):
                return path
        n = lengths[-1]
        if n == 0 or at == len(text):
            lengths.pop()
            if path:
                path.pop()
                matcher.rollback(1)
            continue
        lengths[-1] = n - 1
        token = by_bytes.get(text[at:at + n])
        if token is None:
            continue
        tried += 1
        if matcher.accept_token(token):
            path.append(token)
            lengths.append(min(longest, len(text) - at - n))
    return None


def _token_table(vocab: Vocabulary) -> dict[bytes, int]:
    """Each token text of ``vocab`` and the first ordinary token id that has it (a special
    token spelled like an ordinary one never shadows it: no mask allows it)."""
    table: dict[bytes, int] = {}
    for i, piece in vocab.ordinary.items():
        table.setdefault(piece, i)
    return table


@lru_cache(maxsize=1)
def probe_vocabulary() -> Vocabulary:
    """A vocabulary of every printable ASCII character, one token each, plus a stop token:
    what the grammar would have accepted where the real vocabulary had nothing."""
    info = xgr.TokenizerInfo(["</s>", *PROBE_CHARS], xgr.VocabType.RAW, stop_token_ids=[0])
    return Vocabulary(info, "probe")


def missing_chars(compile_probe: xgr.CompiledGrammar, vocab: Vocabulary,
                  dead_ends: list[list[int]]) -> list[str]:
    """Characters the grammar accepts after some dead end's text that ``vocab`` cannot spell
    (sorted); ``compile_probe`` is the same grammar compiled for ``probe_vocabulary()``."""
    probe = probe_vocabulary()
    bitmask = xgr.allocate_token_bitmask(1, probe.size)
    wanted: set[str] = set()
    for prefix in _with_ancestors(dead_ends, MAX_PROBES):
        matcher = xgr.GrammarMatcher(compile_probe)
        text = b"".join(vocab.token_bytes[i] for i in prefix)
        if not matcher.accept_string(text):
            continue
        matcher.fill_next_token_bitmask(bitmask)
        for i in allowed_ids(bitmask[0], probe.size):
            if i not in probe.stop_ids:
                wanted.add(PROBE_CHARS[i - 1])
    return sorted(wanted - vocab.start_chars)


def _with_ancestors(dead_ends: list[list[int]], limit: int) -> list[list[int]]:
    """The dead ends, then their prefixes nearest first (where the grammar may have asked
    for a missing character beside ones the vocabulary has), ``limit`` distinct at most."""
    seen: dict[tuple[int, ...], None] = {}
    longest = max((len(d) for d in dead_ends), default=0)
    for back in range(longest + 1):
        for d in dead_ends:
            if back <= len(d):
                seen.setdefault(tuple(d[: len(d) - back]))
                if len(seen) >= limit:
                    return [list(p) for p in seen]
    return [list(p) for p in seen]

