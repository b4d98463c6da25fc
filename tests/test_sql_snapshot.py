"""Every statement the service runs, in one place for review: tests/sql_snapshot/ holds one
file per SQL statement of handler.py (NAME.sql, its text exactly as sent to PostgreSQL:
the f-strings as evaluated at import, fragments spliced in). Which constants are
statements is tests/handler_sql.py's rule (sql_statements, which tests/test_layout.py
uses too); the fragments they are made of are in their statements, not files of their
own. A few statements are templates their
caller completes with `.format()` (REFETCH_WALK, REFETCH_LOCK, LEDGER_DROP_INDEX): their
files keep the placeholders.

A change to any statement's rendered text, a new statement or a removed one fails here
until the snapshot is written again and the change is reviewed in its diff:

    python3 tests/test_sql_snapshot.py --write
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kit import ROOT

import handler
from handler_sql import sql_statements

# Uses no PostgreSQL (conftest.py holds it to that): CI's second pass leaves it out.
pytestmark = pytest.mark.no_database

SNAPSHOT = ROOT / "tests" / "sql_snapshot"


def rendered() -> dict[str, str]:
    """Each statement's name and its text as handler.py sends it."""
    return {name: getattr(handler, name) for name in sorted(sql_statements())}


def on_disk(directory: Path = SNAPSHOT) -> dict[str, str]:
    return {
        path.stem: path.read_bytes().decode()
        for path in sorted(directory.glob("*.sql"))
        if path.is_file()
    }


def write(directory: Path = SNAPSHOT) -> None:
    directory.mkdir(exist_ok=True)
    statements = rendered()
    for path in directory.glob("*.sql"):
        if path.stem not in statements:
            path.unlink()
    for name, text in statements.items():
        (directory / f"{name}.sql").write_bytes(text.encode())


def test_the_statements_are_a_good_few():
    assert {"CLAIM_NEXT_APP", "REFETCH_APPLY", "LEDGER_CREATE"} <= set(rendered())
    assert all(isinstance(text, str) for text in rendered().values())


def test_every_statement_has_its_file():
    """No statement added or removed without its file (regenerate: see the docstring)."""
    assert sorted(on_disk()) == sorted(rendered())


def test_every_statement_is_as_snapshotted():
    """No statement's text changed without its file (regenerate: see the docstring)."""
    files = on_disk()
    changed = [name for name, text in rendered().items() if files.get(name) != text]
    assert changed == []


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python3 tests/test_sql_snapshot.py --write")
    write()
    print(f"wrote {len(rendered())} statements to {SNAPSHOT.relative_to(ROOT)}")
