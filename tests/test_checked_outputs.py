"""The chapters' checked outputs print nothing that a machine's rounding can move.

nbval compares a cell tagged ``nbval-check-output`` character for character with its saved
output. A float32 error printed as ``8e-06`` is a fact about the CPU's kernels (which order
they sum in), not about the book, and another machine prints ``9e-06``. Such a cell prints a
verdict against a tolerance instead (``max error < 1e-04: True``); this test keeps it so.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))

# A float as Python's ``e`` format prints it (the exponent's sign always shown): 8e-06,
# 1.0e-05, 0.0e+00, 3.2E-7. Exact counts written by hand (8.03e9) carry no sign.
SMALL_SCI = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?[eE][-+]\d+)")
# ... allowed only as the bound of a tolerance: "< 1e-05", "<= 1e-5", "≤ 1e-5".
BOUND_BEFORE = re.compile(r"(<=?|≤)\s*$")
# A line that reports an error or a difference must state the verdict, not the digits.
ERROR_WORDS = re.compile(r"\b(error|errors|difference|differences|diff|deviation)\b", re.I)
DECIMAL = re.compile(r"\d\.\d")
VERDICT = re.compile(r"(<=?|≤)[^:]*:\s*(True|False)\b")


def checked_texts(path: Path) -> list[tuple[int, str]]:
    """(code cell index, text) for every output of the cells nbval compares."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    texts = []
    for index, cell in enumerate(code):
        if "nbval-check-output" not in cell.metadata.get("tags", []):
            continue
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                texts.append((index, out.text))
            elif "text/plain" in out.get("data", {}):
                texts.append((index, out.data["text/plain"]))
    return texts


def rounding_dependent_lines(text: str) -> list[str]:
    """The lines of one output that print a small float or an error's digits."""
    bad = []
    for line in text.splitlines():
        for match in SMALL_SCI.finditer(line):
            if not BOUND_BEFORE.search(line[: match.start()]):
                bad.append(line)
                break
        else:
            if ERROR_WORDS.search(line) and DECIMAL.search(line) and not VERDICT.search(line):
                bad.append(line)
    return bad


@pytest.mark.parametrize(
    "line",
    [
        "flat forward with per-request attention: max error 8e-06",
        "rows of the first request: max error 0.0e+00 (right up to rounding)",
        "max |logit difference| 3.2E-7",
        "rows of the second request: max error per row [1.95, 11.8]",
    ],
)
def test_the_scan_catches_printed_errors(line: str) -> None:
    assert rounding_dependent_lines(line) == [line]


@pytest.mark.parametrize(
    "line",
    [
        "flat forward with per-request attention: max error < 1e-04: True",
        "ragged vs padded attention: max |logit difference| < 1e-5: True",
        "loop attention: max |flat - separate| < 1e-13: True",
        "the weights, 8.03e9 parameters x 2 bytes: 16.06 GB",
        "memory time 4.83 ms, compute time 0.017 ms:",
    ],
)
def test_the_scan_lets_verdicts_and_exact_numbers_pass(line: str) -> None:
    assert rounding_dependent_lines(line) == []


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_checked_outputs_print_no_rounding_dependent_digits(path: Path) -> None:
    bad = [
        f"code cell {index}: {line}"
        for index, text in checked_texts(path)
        for line in rounding_dependent_lines(text)
    ]
    assert not bad, "print a verdict against a tolerance instead:\n" + "\n".join(bad)
