"""The zero-downtime rules for ledger files, as a check of a file's SQL: `violations`
parses it with pglast, PostgreSQL's own parser, and names every statement that would
block the previous release's writes for long (the rules: tests/test_zero_downtime.py's
docstring, which holds the new ledger files to them). It asks `is_volatile` (the fixture
of that name, tests/conftest.py: PostgreSQL's own word) whether a function is volatile."""

from __future__ import annotations

from collections.abc import Callable

from pglast import ast, parse_sql
from pglast.enums import AlterTableType, ConstrType
from pglast.visitors import Visitor

import handler

REWRITING_TYPES = {"serial", "serial4", "bigserial", "serial8", "smallserial", "serial2"}


class _Functions(Visitor):
    def __init__(self) -> None:
        self.names: list[str] = []

    def visit_FuncCall(self, ancestors, node) -> None:
        self.names.append(node.funcname[-1].sval)


def _functions(node) -> list[str]:
    collector = _Functions()
    collector(node)
    return collector.names


def violations(text: str, is_volatile: Callable[[str], bool]) -> list[str]:
    """Every rule the file breaks, in words."""
    problems: list[str] = []
    statements = [raw.stmt for raw in parse_sql(text)]
    no_transaction = not handler.MigrationFile("f.sql", text, "").transactional
    if no_transaction and len(statements) != 1:
        problems.append(f"a no-transaction file holds one statement, not {len(statements)}")
    created = {s.relation.relname for s in statements if isinstance(s, ast.CreateStmt)}
    added_not_valid: set[str] = set()
    for statement in statements:
        if isinstance(statement, ast.DoStmt):
            problems.append("a DO block hides its statements from this check")
        if isinstance(statement, ast.IndexStmt):
            table = statement.relation.relname
            if table not in created and not statement.concurrent:
                problems.append(f"index {statement.idxname} on {table} is not built CONCURRENTLY")
            if no_transaction and not statement.if_not_exists:
                problems.append(f"index {statement.idxname}: a re-run needs IF NOT EXISTS")
        if not isinstance(statement, ast.AlterTableStmt):
            continue
        table = statement.relation.relname
        if table in created:
            continue
        for command in statement.cmds:
            kind = command.subtype
            if kind == AlterTableType.AT_AlterColumnType:
                problems.append(f"{table}.{command.name} changes type (rewrites {table})")
            elif kind == AlterTableType.AT_AddConstraint:
                problems += _constraint_problems(table, command.def_, added_not_valid)
            elif kind == AlterTableType.AT_ValidateConstraint and command.name in added_not_valid:
                problems.append(
                    f"{command.name} is validated in the file that adds it (under its lock)"
                )
            elif kind == AlterTableType.AT_AddColumn:
                problems += _column_problems(table, command.def_, is_volatile)
    return problems


def _constraint_problems(table: str, constraint, added_not_valid: set[str]) -> list[str]:
    if constraint.contype in (ConstrType.CONSTR_CHECK, ConstrType.CONSTR_FOREIGN):
        if not constraint.skip_validation:
            return [f"constraint {constraint.conname} on {table} is not added NOT VALID"]
        added_not_valid.add(constraint.conname)
    if constraint.contype in (ConstrType.CONSTR_UNIQUE, ConstrType.CONSTR_PRIMARY):
        if not constraint.indexname:
            return [f"constraint {constraint.conname} on {table} builds its index in place"]
    return []


def _column_problems(table: str, column, is_volatile: Callable[[str], bool]) -> list[str]:
    problems = []
    name = f"{table}.{column.colname}"
    type_name = column.typeName.names[-1].sval
    if type_name in REWRITING_TYPES:
        problems.append(f"{name} is {type_name}: a volatile default (nextval) rewrites {table}")
    for constraint in column.constraints or ():
        if constraint.contype == ConstrType.CONSTR_DEFAULT:
            volatile = [f for f in _functions(constraint.raw_expr) if is_volatile(f)]
            if volatile:
                problems.append(f"{name} defaults to volatile {', '.join(volatile)}()")
        elif constraint.contype == ConstrType.CONSTR_GENERATED:
            problems.append(f"{name} is a stored generated column (rewrites {table})")
        elif constraint.contype == ConstrType.CONSTR_IDENTITY:
            problems.append(f"{name} is an identity column (rewrites {table})")
        elif constraint.contype in (
            ConstrType.CONSTR_CHECK,
            ConstrType.CONSTR_FOREIGN,
            ConstrType.CONSTR_UNIQUE,
            ConstrType.CONSTR_PRIMARY,
        ):
            problems.append(f"{name} carries a constraint checked or indexed in place")
    return problems
