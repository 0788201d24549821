"""Notebook 11's Build-it: check_date_grammar passes the given grammar and refuses grammars that admit
non-dates or refuse dates (the strings alone, through xgrammar's matcher; no model)."""

from __future__ import annotations

import pandas as pd
import pytest

from tests.notebook_cells import run_cells

pytest.importorskip("xgrammar")

LOOSE = r"""
root ::= year "-" month "-" day
year ::= [12] [0-9] [0-9] [0-9]
month ::= [01] [0-9]
day ::= [0-3] [0-9]
"""
NO_THIRTIES = r"""
root ::= [12] [0-9] [0-9] [0-9] "-" ("0" [1-9] | "1" [0-2]) "-" ("0" [1-9] | [12] [0-9])
"""
ANY_YEAR = r"""
root ::= [0-9]+ "-" ("0" [1-9] | "1" [0-2]) "-" ("0" [1-9] | [12] [0-9] | "3" [01])
"""
SLASHES_TOO = r"""
root ::= [12] [0-9] [0-9] [0-9] sep ("0" [1-9] | "1" [0-2]) sep ("0" [1-9] | [12] [0-9] | "3" [01])
sep ::= "-" | "/"
"""


@pytest.fixture(scope="module")
def notebook():
    return run_cells("11_structured_output_and_programs", "build-date-answer", "build-date-check", pd=pd)


def test_the_notebooks_grammar_passes(notebook):
    assert notebook["check_date_grammar"](notebook["DATE"]) is None


@pytest.mark.parametrize(
    "grammar, complaint",
    [
        (LOOSE, "not a valid date, yet admitted: 2024-13-01"),
        (NO_THIRTIES, "a valid date is refused: 1999-12-31"),
        (ANY_YEAR, "not a valid date, yet admitted: 24-01-01"),
        (SLASHES_TOO, "not a valid date, yet admitted: 2024/01/01"),
    ],
)
def test_a_wrong_grammar_fails_the_check(notebook, grammar, complaint):
    with pytest.raises(AssertionError, match=complaint):
        notebook["check_date_grammar"](grammar)
