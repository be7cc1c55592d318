"""docs/billing.md's table of every bundled instance type under every split rule is what the code computes."""

from __future__ import annotations

import re
from pathlib import Path

from services.billing.catalog import PriceCatalog
from services.billing.pricing import split_table

DOC = Path(__file__).resolve().parents[3] / "docs" / "billing.md"


def test_the_docs_split_table_is_the_codes():
    text = DOC.read_text()
    match = re.search(r"<!-- split-table:begin -->\n(.*?)<!-- split-table:end -->", text, re.S)
    assert match, "docs/billing.md has no split table"
    assert match.group(1) == split_table(PriceCatalog.load())


def test_every_bundled_instance_type_is_in_the_table_and_marginal_prices_the_priced_ones():
    catalog = PriceCatalog.load()
    table = split_table(catalog)
    for row in catalog.rows:
        assert f"| {row.instance_type} | {row.provider} {row.region} | {row.price_model} |" in table
    # Every bundled type has vCPU and memory counts and its provider's rates: none falls back to OpenCost's weights.
    assert "| weights |" not in table and "| gpu_fraction |" not in table
