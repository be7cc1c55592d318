"""The docs name tests that exist: every ``test_<file>.py::test_<name>`` a Markdown page of the repository names
(``docs/``, the README, ``bench/``) is a test function defined in that file, so a renamed or moved test cannot
leave a page pointing at nothing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PAGES = sorted({*REPO.glob("*.md"), *REPO.glob("docs/**/*.md"), *REPO.glob("bench/**/*.md")})
# A path ending in test_*.py (with or without its folders), "::", then the test's name ([param] ids are not part).
TEST_REFERENCE = re.compile(r"(?P<path>[\w./-]*?test_\w+\.py)::(?P<name>test_\w+)")


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")}


def named_tests() -> list[tuple[str, str, str]]:
    """(page, path as written, test name) for every test reference on every page."""
    found = []
    for page in PAGES:
        for match in TEST_REFERENCE.finditer(page.read_text(encoding="utf-8")):
            found.append((str(page.relative_to(REPO)), match["path"], match["name"]))
    return found


def resolve(path: str) -> list[Path]:
    """The test files a reference means: the path from the repository root, or (a bare file name) every file of
    that name under tests/."""
    direct = REPO / path
    if "/" in path:
        return [direct] if direct.is_file() else []
    return sorted((REPO / "tests").rglob(path))


def test_every_test_a_docs_page_names_exists():
    references = named_tests()
    assert len(references) > 50  # the pattern still finds the reliability tables' references
    missing = []
    for page, path, name in references:
        files = resolve(path)
        if len(files) != 1:
            missing.append(f"{page}: {path}::{name} ({'no such file' if not files else 'ambiguous file name'})")
        elif name not in defined_tests(files[0]):
            missing.append(f"{page}: {path}::{name} (no such test in {files[0].relative_to(REPO)})")
    assert not missing, "docs name tests that do not exist:\n" + "\n".join(missing)
