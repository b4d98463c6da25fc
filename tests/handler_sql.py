"""What the tests read of handler.py's SQL: which module constants are statements
(tests/test_layout.py holds each in its first caller's chapter; tests/test_sql_snapshot.py
keeps their rendered text)."""

from __future__ import annotations

import ast
import re

from kit import ROOT

SOURCE = (ROOT / "handler.py").read_text()
SQL_STATEMENT = re.compile(
    r"\s*(SELECT|WITH|INSERT|UPDATE|DELETE|CREATE|ALTER|DROP|VACUUM|SET)\b", re.IGNORECASE
)
UPPER_CASE = re.compile(r"[A-Z][A-Z0-9_]*")


def _opening_text(value: ast.expr, texts: dict[str, str]) -> str | None:
    """How a constant's string begins, read from its code: a literal, an f-string's
    literal head, or `TEMPLATE.format(...)` of another such constant; None: no string."""
    if isinstance(value, ast.Constant):
        return value.value if isinstance(value.value, str) else None
    if isinstance(value, ast.JoinedStr):
        head = value.values[0] if value.values else None
        return head.value if isinstance(head, ast.Constant) else ""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
        template = value.func.value
        if value.func.attr == "format" and isinstance(template, ast.Name):
            return texts.get(template.id)
    return None


def string_constants(source: str) -> tuple[dict[str, ast.Assign], dict[str, str]]:
    """The module's UPPER_CASE string constants, and how each one's string begins."""
    texts: dict[str, str] = {}
    strings: dict[str, ast.Assign] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and UPPER_CASE.fullmatch(target.id):
                text = _opening_text(node.value, texts)
                if text is not None:
                    texts[target.id] = text
                    strings[target.id] = node
    return strings, texts


def sql_statements(source: str = SOURCE) -> dict[str, ast.Assign]:
    """The module's SQL statements: an UPPER_CASE name assigned a string, an f-string or a
    `.format()` of one, that begins with a statement's keyword (SELECT, WITH, INSERT,
    UPDATE, DELETE, CREATE, ALTER, DROP, VACUUM, SET)."""
    strings, texts = string_constants(source)
    return {name: node for name, node in strings.items() if SQL_STATEMENT.match(texts[name])}
