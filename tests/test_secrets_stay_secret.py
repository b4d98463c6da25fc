"""Secrets stay secret, comparisons are constant-time, and the two tokens are distinct."""

from __future__ import annotations

import ast
import hmac
import logging
import re
from pathlib import Path

import pytest
from kit import ADMIN, ADMIN_TOKEN, ANALYSER, UPLOAD_PASSWORD, configure_service

import handler
from helpers import insert_app

# --- every secret comparison in handler.py, found in its source ---------------------------
# A secret is a value named like one (a token, a password, a signature, a digest or hash,
# a credential, a cookie, a session id, an identity), a value computed from one (by one of
# its methods, a conversion, or a function named like one), or an argument of text of a
# function named like one; where a secret is kept or how it is read (a setting naming a
# secret store's entry, a store's client or provider) is not.
# Comparing a secret with ==, !=, in or not in against anything but a literal takes time
# that depends on where the two first differ: only hmac.compare_digest may do it.
SECRET = re.compile(
    r"token|password|passwd|secret|signature|digest|hash|credential|cookie|session_id|identity",
    re.IGNORECASE,
)
REFERENCE = re.compile(r"reference|provider|client|_secret(_id)?$", re.IGNORECASE)
CONVERSIONS = {"bytes", "str", "bytearray", "memoryview"}
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
UNTIMED = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)


def secret_like(name: str) -> bool:
    return bool(SECRET.search(name)) and not REFERENCE.search(name)


def carries_secret(node: ast.AST, tainted: set[str]) -> bool:
    """Whether the value of `node` carries a secret (not the result of any function a
    secret is given to: judge_result(..., claim_token) is a verdict, not a token)."""
    if isinstance(node, ast.Name):
        return node.id in tainted or secret_like(node.id)
    if isinstance(node, ast.Attribute):
        return secret_like(node.attr) or carries_secret(node.value, tainted)
    if isinstance(node, ast.Subscript):
        key = node.slice
        named = isinstance(key, ast.Constant) and isinstance(key.value, str)
        return (named and secret_like(key.value)) or carries_secret(node.value, tainted)
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name):
            converted = node.func.id in CONVERSIONS
            return secret_like(node.func.id) or (
                converted and any(carries_secret(a, tainted) for a in node.args)
            )
        return carries_secret(node.func, tainted)
    return any(carries_secret(child, tainted) for child in ast.iter_child_nodes(node))


def own_nodes(scope: ast.AST) -> list[ast.AST]:
    """The nodes of a module or function, not those of the functions and classes in it."""
    found, stack = [], list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        found.append(node)
        if not isinstance(node, (*FUNCTIONS, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))
    return found


def secrets_in(scope: ast.AST) -> set[str]:
    """The names in `scope` that hold a secret: its arguments named like one (in a
    function named like one, every argument of text, bytes or a UUID but a reference),
    and whatever is assigned, unpacked or iterated from a secret, to a fixed point."""
    tainted: set[str] = set()
    if isinstance(scope, FUNCTIONS):
        arguments = scope.args
        whole = secret_like(getattr(scope, "name", ""))
        for argument in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
            kind = "" if argument.annotation is None else ast.unparse(argument.annotation)
            text = not kind or re.search(r"\b(str|bytes|UUID)\b", kind)
            if secret_like(argument.arg) or (whole and text and not REFERENCE.search(argument.arg)):
                tainted.add(argument.arg)
    nodes = own_nodes(scope)
    while True:
        before = len(tainted)
        for node in nodes:
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
                if node.value is not None and carries_secret(node.value, tainted):
                    for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                        tainted |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                if carries_secret(node.iter, tainted):
                    tainted |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
        if len(tainted) == before:
            return tainted


def literal(node: ast.AST) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(literal(element) for element in node.elts)
    return isinstance(node, ast.Constant)


def timed_comparison(compare: ast.Compare, tainted: set[str]) -> bool:
    """Whether `compare` puts a secret through ==, !=, in or not in against a value that
    is not a literal (a length, a type or a literal tells nothing of the secret's bytes)."""
    if not any(isinstance(op, UNTIMED) for op in compare.ops):
        return False
    operands = [compare.left, *compare.comparators]
    if sum(not literal(operand) for operand in operands) < 2:
        return False

    def exposed(operand: ast.AST) -> bool:
        measured = (
            isinstance(operand, ast.Call)
            and isinstance(operand.func, ast.Name)
            and operand.func.id in ("len", "type", "isinstance")
        )
        return not literal(operand) and not measured and carries_secret(operand, tainted)

    return any(exposed(operand) for operand in operands)


def scopes(tree: ast.Module) -> list[ast.AST]:
    return [tree, *(node for node in ast.walk(tree) if isinstance(node, FUNCTIONS))]


def secret_comparisons(tree: ast.Module) -> tuple[list[ast.Call], list[str]]:
    """(every compare_digest call, every secret compared any other way: line and text)."""
    constant_time, timed = [], []
    for scope in scopes(tree):
        tainted = secrets_in(scope)
        for node in own_nodes(scope):
            if isinstance(node, ast.Compare) and timed_comparison(node, tainted):
                timed.append(f"handler.py:{node.lineno}: {ast.unparse(node)}")
            callee = node.func if isinstance(node, ast.Call) else None
            if isinstance(callee, ast.Attribute) and callee.attr == "compare_digest":
                constant_time.append(node)
    return constant_time, timed


def handler_tree() -> ast.Module:
    return ast.parse(Path(handler.__file__).read_text())


def test_every_secret_comparison_in_handler_is_constant_time():
    """Every comparison of a secret in handler.py (found in its source, not listed here)
    is hmac.compare_digest: none is ==, !=, in or not in."""
    constant_time, timed = secret_comparisons(handler_tree())
    assert constant_time, "handler.py compares no secret in constant time?"
    assert timed == []


@pytest.mark.parametrize("operator", [ast.Eq, ast.NotEq])
def test_each_constant_time_comparison_made_plain_is_caught(operator):
    """The check above is shown catching each of handler.py's compare_digest calls turned
    into `a == b` (or `not a != b`), one at a time, in the source as it is now."""
    count = len(secret_comparisons(handler_tree())[0])
    for index in range(count):
        tree = handler_tree()
        call = secret_comparisons(tree)[0][index]
        plain = ast.Compare(left=call.args[0], ops=[operator()], comparators=[call.args[1]])
        if operator is ast.NotEq:
            plain = ast.UnaryOp(op=ast.Not(), operand=plain)
        for parent in ast.walk(tree):
            for field, value in ast.iter_fields(parent):
                if value is call:
                    setattr(parent, field, plain)
                elif isinstance(value, list) and any(item is call for item in value):
                    value[[item is call for item in value].index(True)] = plain
        constant_time, timed = secret_comparisons(ast.fix_missing_locations(tree))
        assert len(constant_time) == count - 1
        assert len(timed) == 1, (ast.unparse(call), timed)


def test_token_comparisons_are_constant_time(client, sql, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(handler.hmac, "compare_digest", spy)
    insert_app(sql, "com.example.app")
    # The shared password and the admin token are compared as hashes (sql/034: the
    # environment's value while the database holds none), the stored one first.
    hashed = handler.token_hash
    client.get("/ping", headers={"Authorization": "Bearer wrong"})
    assert calls[-1] == (hashed(UPLOAD_PASSWORD), hashed("wrong"))
    client.post("/apps", json={"appId": "com.x"}, headers=ANALYSER)
    assert calls[-1] == (hashed(ADMIN_TOKEN), hashed(UPLOAD_PASSWORD))
    handler.import_credential(
        handler.api_connection(), handler.Operator("t", "t"), "upload-password"
    )
    client.get("/ping", headers={"Authorization": "Bearer wrong"})
    assert calls[-1] == (hashed(UPLOAD_PASSWORD), hashed("wrong"))
    token = client.get("/queue", headers=ANALYSER).headers["x-analysis-claim-token"]
    client.post(
        "/uploadAnalysis?appId=com.example.app&analysisVersion=4",
        json={"success": True},
        headers={**ANALYSER, "X-Analysis-Claim-Token": "not-it"},
    )
    assert calls[-1] == (b"not-it", token.encode())


def test_tokens_are_not_interchangeable(client, sql):
    insert_app(sql, "com.example.app")
    assert client.get("/queue", headers=ADMIN).status_code == 401
    assert client.post("/apps", json={"appId": "com.x"}, headers=ANALYSER).status_code == 401
    assert client.get("/queue", headers=ANALYSER).status_code == 200
    assert client.post("/apps", json={"appId": "com.x"}, headers=ADMIN).status_code == 201


def test_database_password_never_reaches_logs_or_bodies(client, monkeypatch, capsys, caplog):
    password = "db-pass-7f3a9c"
    configure_service(monkeypatch, f"postgresql://queue:{password}@127.0.0.1:9/queue")
    caplog.set_level(logging.DEBUG)
    bodies = [
        client.get("/queue", headers=ANALYSER).text,
        client.get("/healthz").text,
        client.get("/apps/com.example.app").text,
    ]
    captured = capsys.readouterr()
    everything = "".join(bodies) + captured.out + captured.err + caplog.text
    assert "database unavailable" in everything
    assert password not in everything
    for secret in (UPLOAD_PASSWORD, ADMIN_TOKEN):
        assert secret not in everything
