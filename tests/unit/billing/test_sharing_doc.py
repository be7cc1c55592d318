"""docs/billing.md's worked example of the sharing methods is what the costing and sharing code compute, and every
column of it adds up to the bill."""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path

from services.billing.sharing_example import METHODS, example_table

DOC = Path(__file__).resolve().parents[3] / "docs" / "billing.md"


def doc_table() -> str:
    match = re.search(r"<!-- sharing-example:begin -->\n(.*?)\n<!-- sharing-example:end -->", DOC.read_text(), re.S)
    assert match, "docs/billing.md has no sharing example"
    return match.group(1)


def test_the_docs_sharing_example_is_the_codes():
    assert doc_table() == example_table()


def test_every_column_of_the_example_sums_to_the_bill_and_sharing_gives_the_pods_all_of_it():
    rows = [line.strip("|").split("|") for line in doc_table().splitlines()[2:]]
    cells = {row[0].strip(): [c.strip() for c in row[1:]] for row in rows}
    total = cells.pop("**TOTAL**")
    share = cells.pop("pods' part of the bill")
    assert len(total) == len(METHODS) and set(total) == {"10.000000"}  # 1 h at 10 USD/h
    for column in range(len(METHODS)):
        assert sum(Decimal(values[column]) for values in cells.values()) == Decimal(total[column])
    assert share == ["32 %", "100 %", "100 %", "100 %"]
    # The text's figures are the table's.
    text = DOC.read_text()
    for figure in ("2.40", "0.80", "3.60", "1.20", "2.20", "2.60", "0.916667", "1.083333"):
        assert figure in text
