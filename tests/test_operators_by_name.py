"""Named operators (sql/035, docs/operations.md "Operators by name"), on the real database:

* added, listed, rotated and revoked from the CLI, the admin API and the report function,
  a token shown once and kept as its hash;
* every action and sign-in recorded under the operator's name, the admin token's as
  `admin token`;
* revocation and rotation at once, on the admin API and in the web view's sessions;
* a read-only operator refused (403, nothing changed) on every admin route that writes,
  found by walking the route table, so a route added later is held to it the day it is.
"""

from __future__ import annotations

import json
import os
from urllib.parse import urlencode

import pytest
from fastapi.routing import APIRoute
from kit import ADMIN, ADMIN_TOKEN, configure_service

import handler
from helpers import LambdaContext, call_api, call_cli, gateway_event, insert_app, table_digest

OPERATORS = "SELECT name, read_only, created_by, revoked IS NOT NULL FROM operators ORDER BY name"
RECORDS = "SELECT actor, action FROM operator_actions ORDER BY id"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def cli(database_url: str, *args: str):
    return call_cli(*args, env={**os.environ, "DATABASE_URL": database_url})


def add(name: str, read_only: bool = False) -> str:
    added = handler.add_operator(
        handler.api_connection(), handler.Operator("test", "t"), name, read_only
    )
    return added["token"]


def test_the_cli_adds_lists_rotates_and_revokes(client, sql, database_url):
    added = cli(database_url, "operators", "add", "alice")
    assert added.returncode == 0, added.stderr
    token = added.stdout.splitlines()[-1]
    assert token.startswith("aqo_") and len(token) == 4 + 43
    assert added.stdout.count(token) == 1 and token not in added.stderr
    reader = cli(database_url, "operators", "add", "bob", "--read-only")
    assert "Added read-only operator bob." in reader.stdout
    assert sql.run(OPERATORS) == [
        ["alice", False, "command line", False],
        ["bob", True, "command line", False],
    ]
    # The database keeps the hash only.
    stored = sql.run("SELECT token_hash FROM operators WHERE name = 'alice'")[0][0]
    assert bytes(stored) == handler.token_hash(token)

    listed = cli(database_url, "operators", "list")
    assert "alice: full, active" in listed.stdout and "bob: read-only, active" in listed.stdout
    assert token not in listed.stdout + listed.stderr
    assert cli(database_url, "operators", "add", "alice").returncode == 1  # exists
    assert cli(database_url, "operators", "add", "no spaces").returncode == 2

    assert client.get("/analysers", headers=bearer(token)).status_code == 200
    rotated = cli(database_url, "operators", "rotate", "alice", "--overlap", "1h")
    assert rotated.returncode == 0, rotated.stderr
    new = rotated.stdout.splitlines()[-1]
    assert "previous token works until" in rotated.stdout
    for working in (token, new):  # the overlap
        assert client.get("/analysers", headers=bearer(working)).status_code == 200

    revoked = cli(database_url, "operators", "revoke", "alice")
    assert revoked.returncode == 0 and "Revoked operator alice" in revoked.stdout
    for gone in (token, new):  # at once, both
        assert client.get("/analysers", headers=bearer(gone)).status_code == 401
    assert cli(database_url, "operators", "rotate", "alice").returncode == 1  # revoked
    assert cli(database_url, "operators", "revoke", "nobody").returncode == 1
    assert [row[1] for row in sql.run(RECORDS)] == [
        "add operator alice",
        "add read-only operator bob",
        "rotate operator alice",
        "revoke operator alice",
    ]


def test_an_action_is_recorded_under_the_operators_name(client, sql):
    token = add("alice")
    answer = client.post(
        "/apps", headers=bearer(token), json={"appId": "com.example.app", "details": {}}
    )
    assert answer.status_code == 201, answer.text
    assert client.post("/analysers", headers=ADMIN, json={"name": "pi-01"}).status_code == 201
    assert sql.run(RECORDS)[-2:] == [["alice", "add app"], ["admin token", "add analyser"]]
    # A full operator manages operators too, and is named as who added them.
    created = client.post("/operators", headers=bearer(token), json={"name": "carol"})
    assert created.status_code == 201 and created.json()["token"].startswith("aqo_")
    assert sql.run(OPERATORS)[-1] == ["carol", False, "alice", False]
    listed = client.get("/operators", headers=bearer(token)).json()["operators"]
    assert [row["name"] for row in listed] == ["alice", "carol"]
    assert "token" not in json.dumps(listed).lower().replace("previoustoken", "")


def admin_writes() -> list[APIRoute]:
    """Every route of the table that writes and takes the admin credential."""
    spec = handler.app.openapi()["paths"]
    writes = []
    for route in handler.app.routes:
        if not isinstance(route, APIRoute) or route.endpoint is handler.admin:
            continue
        for method in route.methods - {"GET", "HEAD"}:
            security = spec[route.path_format][method.lower()].get("security") or []
            if {"AdminToken": []} in security:
                writes.append((method, route.path_format))
    return writes


def test_a_read_only_operator_reads_and_every_admin_write_refuses_them(client, sql):
    insert_app(sql, "com.example.app")
    handler.add_analyser(handler.api_connection(), handler.Operator("t", "t"), "pi-01")
    token, full = add("reader", read_only=True), add("writer")
    assert client.get("/analysers", headers=bearer(token)).status_code == 200
    assert client.get("/operators", headers=bearer(token)).status_code == 200
    admin_view = client.get("/apps/com.example.app", headers=bearer(token)).json()
    assert "why" in admin_view  # the admin view of a public route: a read

    writes = admin_writes()
    assert len(writes) >= 13  # the walk finds the admin API's writes
    before = table_digest(sql), sql.run(OPERATORS), sql.run(RECORDS)
    for method, path in writes:
        url = path.replace("{appId}", "com.example.app").replace("{name}", "pi-01")
        answer = client.request(method, url, headers=bearer(token), json={})
        assert answer.status_code == 403, (method, path, answer.text)
        assert answer.json() == {"detail": "reader is a read-only operator: nothing was changed"}, (
            path
        )
    assert (table_digest(sql), sql.run(OPERATORS), sql.run(RECORDS)) == before
    # The same write by a full operator is made.
    assert client.post("/queue/pause", headers=bearer(full), json={}).status_code == 200


def test_an_unknown_or_revoked_operators_token_is_a_wrong_token(client):
    assert client.get("/analysers", headers=bearer(handler.new_operator_token())).status_code == 401
    token = add("alice")
    handler.revoke_operator(handler.api_connection(), handler.Operator("t", "t"), "alice")
    assert client.get("/analysers", headers=bearer(token)).status_code == 401
    # A public route stays public: the answer is the public one.
    assert client.get("/healthz", headers=bearer(token)).status_code == 200


# --------------------------------------------------------------------------- web view


def web_request(method, path, headers=None, body=None):
    event = gateway_event(method, path, headers=headers or {}, body=body)
    event["requestContext"]["http"]["sourceIp"] = "203.0.113.9"
    event["headers"].setdefault("x-forwarded-proto", "https")
    return call_api(event)


def web_sign_in(token: str):
    headers = {"sec-fetch-site": "same-origin", "content-type": "application/x-www-form-urlencoded"}
    return web_request("POST", "/admin/login", headers, urlencode({"token": token}))


def session_cookie(answer) -> dict[str, str]:
    assert answer["statusCode"] == 303, answer
    (cookie,) = answer["cookies"]
    return {"cookie": cookie.split(";")[0]}


def admin_token_imported() -> None:
    """The admin token's row (and so the web sessions' key) in the database, as a
    deployed stack has it (deploy.md's step 4)."""
    handler.import_credential(handler.api_connection(), handler.Operator("t", "t"), "admin-token")


def test_an_operator_signs_in_by_name_and_is_recorded_so(database_url, sql, monkeypatch):
    configure_service(monkeypatch, database_url, ADMIN_WEB="full")
    admin_token_imported()
    insert_app(sql, "com.example.app")
    token = add("alice")
    cookie = session_cookie(web_sign_in(token))
    page = web_request("GET", "/admin", cookie)
    assert page["statusCode"] == 200 and '<span id="who">alice</span>' in page["body"]
    assert 'data-mode="full"' in page["body"]
    write = {**cookie, "sec-fetch-site": "same-origin", "content-type": "application/json"}
    held = web_request("POST", "/admin/api/apps/com.example.app/hold", write, "{}")
    assert held["statusCode"] == 200, held
    assert sql.run(RECORDS)[-2:] == [["alice", "sign-in"], ["alice", "hold app"]]
    assert sql.run("SELECT operator FROM admin_sessions") == [["alice"]]
    # Who did what, newest first, from the web view's JSON.
    recent = json.loads(web_request("GET", "/admin/api/actions", cookie)["body"])
    assert [(x["actor"], x["action"], x["appId"]) for x in recent["actions"][:2]] == [
        ("alice", "hold app", "com.example.app"),
        ("alice", "sign-in", None),
    ]
    assert recent["next"] is None

    # A rotation ends the sessions they started; only the new token signs in again.
    rotated = handler.rotate_operator(
        handler.api_connection(), handler.Operator("t", "t"), "alice", 3600
    )
    assert web_request("GET", "/admin/api/status", cookie)["statusCode"] == 401
    assert web_sign_in(token)["statusCode"] == 401  # the old token: a bearer in its overlap only
    assert web_request("GET", "/admin/api/status", bearer(token))["statusCode"] == 200
    cookie = session_cookie(web_sign_in(rotated["token"]))
    assert web_request("GET", "/admin/api/status", cookie)["statusCode"] == 200
    # A revocation ends them at once.
    handler.revoke_operator(handler.api_connection(), handler.Operator("t", "t"), "alice")
    assert web_request("GET", "/admin/api/status", cookie)["statusCode"] == 401


def test_the_record_pages_newest_first(database_url, sql, monkeypatch):
    configure_service(monkeypatch, database_url, ADMIN_WEB="full")
    for number in range(handler.ACTIONS_PAGE_SIZE + 3):
        add(f"op-{number}")
    first = json.loads(web_request("GET", "/admin/api/actions", bearer(ADMIN_TOKEN))["body"])
    assert len(first["actions"]) == handler.ACTIONS_PAGE_SIZE and first["next"] is not None
    assert first["actions"][0]["action"] == f"add operator op-{handler.ACTIONS_PAGE_SIZE + 2}"
    query = f"before={first['next']}"
    event = gateway_event("GET", "/admin/api/actions", headers=bearer(ADMIN_TOKEN), query=query)
    rest = json.loads(call_api(event)["body"])
    assert [x["action"] for x in rest["actions"]] == [f"add operator op-{n}" for n in (2, 1, 0)]
    assert rest["next"] is None
    for bad in ("0", "-1", "x", "1e3", "9" * 16):
        event = gateway_event(
            "GET", "/admin/api/actions", headers=bearer(ADMIN_TOKEN), query=f"before={bad}"
        )
        assert call_api(event)["statusCode"] == 400, bad


def test_a_read_only_operator_gets_the_read_only_page_and_no_action(database_url, sql, monkeypatch):
    configure_service(monkeypatch, database_url, ADMIN_WEB="full")
    admin_token_imported()
    insert_app(sql, "com.example.app")
    cookie = session_cookie(web_sign_in(add("reader", read_only=True)))
    page = web_request("GET", "/admin", cookie)
    assert 'data-mode="read-only"' in page["body"]
    assert web_request("GET", "/admin/api/status", cookie)["statusCode"] == 200
    write = {**cookie, "sec-fetch-site": "same-origin", "content-type": "application/json"}
    before = table_digest(sql), sql.run(RECORDS)
    for method, path, _, who in handler.ADMIN_ROUTES:
        if who != "action":
            continue
        url = path.replace("{appId}", "com.example.app").replace("{name}", "reader")
        answer = web_request(method, url, write, "{}")
        assert answer["statusCode"] == 403, (path, answer)
    assert (table_digest(sql), sql.run(RECORDS)) == before
    assert sql.run(RECORDS)[-1] == ["reader", "sign-in"]
    # Signing out is no action: a read-only operator signs out.
    out = web_request("POST", "/admin/logout", write, "{}")
    assert out["statusCode"] == 200 and json.loads(out["body"]) == {"signedOut": True}


def test_an_operators_sign_in_never_sets_the_admin_token(database_url, sql, monkeypatch):
    """The cookies' key is kept in the admin token's row, which only someone presenting
    the admin token fills: before that, an operator's sign-in is answered 503 saying
    what to do, and writes nothing."""
    configure_service(monkeypatch, database_url, ADMIN_WEB="full")
    token = add("alice", read_only=True)
    refused = web_sign_in(token)
    assert refused["statusCode"] == 503 and "credentials import admin-token" in refused["body"]
    # Said on the sign-in page, its form beside it (not a JSON answer in the browser).
    assert refused["headers"]["content-type"].startswith("text/html")
    assert "Your token" in refused["body"] and 'class="error"' in refused["body"]
    assert sql.run("SELECT count(*) FROM service_credentials") == [[0]]
    assert sql.run("SELECT count(*) FROM admin_sessions") == [[0]]
    session_cookie(web_sign_in(ADMIN_TOKEN))  # the admin token's first sign-in fills it
    cookie = session_cookie(web_sign_in(token))
    assert web_request("GET", "/admin/api/status", cookie)["statusCode"] == 200


def test_a_sign_in_racing_a_rotation_starts_no_session(database_url, sql, monkeypatch):
    """A sign-in whose token was current when it was checked, but rotated away (with no
    overlap) before its session was written, starts none; and a session written just
    before a rotation ends with it."""
    configure_service(monkeypatch, database_url, ADMIN_WEB="full")
    session_cookie(web_sign_in(ADMIN_TOKEN))
    token = add("alice")
    operator = handler.Operator("t", "t")
    real_check = handler.sign_in_check

    def check_then_rotate(db, given, source):
        checked = real_check(db, given, source)
        handler.rotate_operator(handler.api_connection(), operator, "alice", 0)
        return checked

    monkeypatch.setattr(handler, "sign_in_check", check_then_rotate)
    assert web_sign_in(token)["statusCode"] == 401
    assert sql.run("SELECT count(*) FROM admin_sessions WHERE operator = 'alice'") == [[0]]
    monkeypatch.setattr(handler, "sign_in_check", real_check)
    fresh = handler.rotate_operator(handler.api_connection(), operator, "alice", 0)["token"]
    cookie = session_cookie(web_sign_in(fresh))
    handler.rotate_operator(handler.api_connection(), operator, "alice", 0)
    assert web_request("GET", "/admin/api/status", cookie)["statusCode"] == 401


def test_operator_names_are_refused_where_they_would_mislead(client, sql, database_url):
    add("alice")
    for name in (".", "..", "-rf", "sign-in", "Sign-In", "a b", "é", "x" * 65):
        answer = client.post("/operators", headers=ADMIN, json={"name": name})
        assert answer.status_code == 400, (name, answer.text)
    assert client.post("/operators", headers=ADMIN, json={"name": "Alice"}).status_code == 409
    for args in (("rotate", "."), ("revoke", ".."), ("revoke", "-rf")):
        assert cli(database_url, "operators", *args).returncode == 2, args
    assert [row[0] for row in sql.run(OPERATORS)] == ["alice"]


# --------------------------------------------------------------------------- a JWT authorizer


def with_claims(method: str, path: str, claims: dict | None, body: str | None = None) -> dict:
    """An HTTP API event as API Gateway sends it behind a JWT authorizer: the JWT in the
    Authorization header, the claims it verified in requestContext.authorizer."""
    headers = {"authorization": "Bearer eyJhbGciOiJSUzI1NiJ9.e30.c2ln"}
    if body is not None:
        headers["content-type"] = "application/json"
    event = gateway_event(method, path, headers=headers, body=body)
    if claims is not None:
        event["requestContext"]["authorizer"] = {"jwt": {"claims": claims, "scopes": None}}
    return event


def test_a_verified_identity_names_the_operator(database_url, sql, monkeypatch):
    """With OPERATOR_CLAIM, the claim API Gateway's authorizer verified names the named
    operator: their name in the record, read-only honoured, revocation at once; without
    a verified claim the JWT is just a wrong token."""
    configure_service(monkeypatch, database_url, OPERATOR_CLAIM="email")
    add("alice@example.org")
    add("rita@example.org", read_only=True)
    alice = {"email": "alice@example.org", "sub": "a1"}
    assert call_api(with_claims("GET", "/analysers", alice))["statusCode"] == 200
    paused = call_api(with_claims("POST", "/queue/pause", alice, "{}"))
    assert paused["statusCode"] == 200, paused
    assert sql.run(RECORDS)[-1] == ["alice@example.org", "pause queue"]
    rita = {"email": "rita@example.org"}
    assert call_api(with_claims("GET", "/operators", rita))["statusCode"] == 200
    assert call_api(with_claims("POST", "/queue/resume", rita, "{}"))["statusCode"] == 403
    for claims in (
        None,  # no authorizer: the JWT is no token of the service's
        {"sub": "a1"},  # the claim missing
        {"email": "mallory@example.org"},  # no such operator
        {"email": ["alice@example.org"]},  # not a name
        {"email": "alice@example.org\n"},
    ):
        answer = call_api(with_claims("GET", "/analysers", claims))
        assert answer["statusCode"] == 401, (claims, answer)
    handler.revoke_operator(
        handler.api_connection(), handler.Operator("t", "t"), "alice@example.org"
    )
    assert call_api(with_claims("GET", "/analysers", alice))["statusCode"] == 401
    # The web view's JSON takes the same identity.
    configure_service(monkeypatch, database_url, OPERATOR_CLAIM="email", ADMIN_WEB="full")
    assert call_api(with_claims("GET", "/admin/api/status", rita))["statusCode"] == 200


def test_without_the_setting_claims_are_not_read(database_url, monkeypatch, client):
    """OPERATOR_CLAIM unset, the default: claims name no one. And under `serve` no client
    can send claims at all: they are in no header."""
    configure_service(monkeypatch, database_url)
    add("alice@example.org")
    event = with_claims("GET", "/analysers", {"email": "alice@example.org"})
    assert call_api(event)["statusCode"] == 401
    configure_service(monkeypatch, database_url, OPERATOR_CLAIM="email")
    headers = {"Authorization": "Bearer x", "X-Claims": '{"email": "alice@example.org"}'}
    assert client.get("/analysers", headers=headers).status_code == 401


def test_a_malformed_operator_claim_setting_is_refused_by_name():
    with pytest.raises(handler.ConfigError, match="OPERATOR_CLAIM"):
        handler.load_settings({"OPERATOR_CLAIM": "e mail"})


# --------------------------------------------------------------------------- report


def test_the_report_function_manages_operators_and_never_logs_a_token(sql, capsys):
    added = handler.report({"command": "operators-add", "name": "alice"}, LambdaContext())
    token = added["token"]
    assert added["readOnly"] is False and token.startswith("aqo_")
    reader = handler.report(
        {"command": "operators-add", "name": "bob", "readOnly": True}, LambdaContext()
    )
    assert reader["readOnly"] is True
    rotated = handler.report(
        {"command": "operators-rotate", "name": "alice", "overlap": "0"}, LambdaContext()
    )
    listed = handler.report({"command": "operators-list"}, LambdaContext())["operators"]
    assert [(row["name"], row["readOnly"], row["createdBy"]) for row in listed] == [
        ("alice", False, "report function"),
        ("bob", True, "report function"),
    ]
    revoked = handler.report({"command": "operators-revoke", "name": "bob"}, LambdaContext())
    assert revoked["name"] == "bob" and revoked["revoked"]
    out = capsys.readouterr()
    for secret in (token, rotated["token"], reader["token"]):
        assert secret not in out.out + out.err
    for event in (
        {"command": "operators-add"},
        {"command": "operators-add", "name": "x", "readOnly": "yes"},
        {"command": "operators-add", "name": "no spaces"},
        {"command": "operators-rotate", "name": "alice", "overlap": "forever"},
        {"command": "operators-list", "name": "x"},
    ):
        with pytest.raises(handler.BadInput):
            handler.report(event, LambdaContext())
    with pytest.raises(handler.UnknownOperator):
        handler.report({"command": "operators-revoke", "name": "nobody"}, LambdaContext())
