"""The character tokenizer: fixed ids, lossless round trip, helpful errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minisrv.configs import CITYLM
from minisrv.tokenizer import ALPHABET, Tokenizer

TOK = Tokenizer()


@given(st.text(alphabet=ALPHABET, max_size=200))
def test_decode_inverts_encode(text: str) -> None:
    assert TOK.decode(TOK.encode(text)) == text
    assert TOK.decode(TOK.encode(text, bos=False)) == text


def test_special_ids_and_vocab() -> None:
    assert (TOK.bos_id, TOK.eos_id) == (0, 1)
    assert TOK.vocab_size == 2 + len(ALPHABET) == CITYLM.vocab_size
    assert TOK.id_to_str(TOK.bos_id) == "<bos>"
    assert TOK.id_to_str(TOK.eos_id) == "<eos>"


def test_encode_adds_bos_only_when_asked() -> None:
    ids = TOK.encode("FR:")
    assert ids[0] == TOK.bos_id and len(ids) == 4
    assert TOK.encode("FR:", bos=False) == ids[1:]


def test_every_character_has_its_own_id() -> None:
    ids = TOK.encode(ALPHABET, bos=False)
    assert len(set(ids)) == len(ALPHABET)
    assert "".join(TOK.id_to_str(i) for i in ids) == ALPHABET


def test_decode_can_keep_special_tokens() -> None:
    ids = [*TOK.encode("JP: Tokyo"), TOK.eos_id]
    assert TOK.decode(ids) == "JP: Tokyo"
    assert TOK.decode(ids, skip_special=False) == "<bos>JP: Tokyo<eos>"


def test_unknown_characters_are_named_with_their_positions() -> None:
    with pytest.raises(ValueError) as err:
        TOK.encode("FR: Orléans, Saint-Étienne")
    message = str(err.value)
    assert "'é' at position 7" in message
    assert "'É' at position 19" in message


def test_unknown_id_is_rejected() -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TOK.id_to_str(TOK.vocab_size)
