"""The docs as the tests read them: README.md and docs/*.md, and the text a reader sees
of a page (tests/test_docs.py, tests/test_docs_match_code.py)."""

from __future__ import annotations

import re

import handler

ROOT = handler.HERE
DOCS = ROOT / "docs"

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
INDENTED_CODE = re.compile(r"^(?: {4}|\t).*$", re.MULTILINE)


def prose(markdown: str) -> str:
    """The text a reader sees as Markdown, without code blocks (fenced or indented),
    where `#` and `](` mean nothing."""
    return INDENTED_CODE.sub("", FENCE.sub("", markdown))


def table_column(markdown: str, after: str, column: int = 0) -> list[str]:
    """One column of the first table after the line `after`, cells without backticks."""
    section = markdown.split(f"\n{after}\n", 1)[1]
    rows = re.search(r"^\|.*?(?=\n\n|\Z)", section, re.MULTILINE | re.DOTALL).group(0)
    cells = [row.strip("|").split(" | ")[column].strip() for row in rows.splitlines()[2:]]
    return [cell.replace("`", "") for cell in cells]
