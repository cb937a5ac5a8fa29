"""CityLM's character-level tokenizer.

Characters, not subwords: the city language has a tiny alphabet, so every token is one
letter and a reader can see exactly which token the model produced at each step, which is
what the scheduling chapters draw. The alphabet is a constant written here (not learned
from data) so the shipped weights and any future data agree on what every id means.
"""

from __future__ import annotations

import string
from collections.abc import Iterable

BOS = "<bos>"
EOS = "<eos>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS)
BOS_ID, EOS_ID = 0, 1  # ids of the special tokens, fixed by their order above

# Punctuation first, then letters: "\n" separates country lines, ":" ends the country code,
# ", " separates cities, and ' . - occur inside folded city names (e.g. "St. John's").
ALPHABET: str = "\n ',-.:" + string.ascii_uppercase + string.ascii_lowercase


class Tokenizer:
    """Maps text to ids and back, one id per character plus ``<bos>`` and ``<eos>``.

    Ids ``0`` and ``1`` are ``<bos>`` and ``<eos>``; the characters of ``ALPHABET`` follow
    in order. There is no ``<pad>``: minisrv never pads, it packs requests into one flat
    batch instead.
    """

    def __init__(self) -> None:
        self._itos: list[str] = [*SPECIAL_TOKENS, *ALPHABET]
        self._stoi: dict[str, int] = {ch: i for i, ch in enumerate(ALPHABET, len(SPECIAL_TOKENS))}
        self.bos_id: int = BOS_ID
        self.eos_id: int = EOS_ID

    @property
    def vocab_size(self) -> int:
        """Number of distinct ids: the special tokens plus the alphabet."""
        return len(self._itos)

    @property
    def alphabet(self) -> str:
        """The characters the tokenizer accepts, in id order."""
        return ALPHABET

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Ids for ``text``, preceded by ``<bos>`` unless ``bos`` is false.

        Every character outside the alphabet is reported at once, with its position, so a
        user fixing a prompt sees all problems in one go.
        """
        unknown = [(pos, ch) for pos, ch in enumerate(text) if ch not in self._stoi]
        if unknown:
            listed = ", ".join(f"{ch!r} at position {pos}" for pos, ch in unknown)
            raise ValueError(
                f"text contains characters outside the CityLM alphabet: {listed} "
                "(fold accents first, e.g. with minisrv.data.fold_name)"
            )
        ids = [self._stoi[ch] for ch in text]
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text for ``ids``; special tokens are dropped unless ``skip_special`` is false."""
        pieces = []
        for i in ids:
            i = int(i)
            if i < len(SPECIAL_TOKENS) and skip_special:
                continue
            pieces.append(self.id_to_str(i))
        return "".join(pieces)

    def id_to_str(self, i: int) -> str:
        """The string for one id: its character, or ``"<bos>"``/``"<eos>"``."""
        if not 0 <= int(i) < self.vocab_size:
            raise ValueError(f"token id {i} is outside the vocabulary (0..{self.vocab_size - 1})")
        return self._itos[int(i)]

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"
