"""Schemathesis over the app's own OpenAPI schema: no generated request gets a 5xx, and
every answer is one the schema documents."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from kit import ADMIN, ANALYSER
from schemathesis.specs.openapi.checks import status_code_conformance

import handler
from helpers import insert_app, table_digest

schema = schemathesis.openapi.from_asgi("/openapi.json", handler.app)
# The operators' routes outside /analysers: they take the admin token.
ADMIN_PATHS = {
    "/apps",
    "/apps/{appId}/hold",
    "/apps/{appId}/release",
    "/queue/pause",
    "/queue/resume",
}


@schema.parametrize()
@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_no_server_errors(case, database_url, sql):
    # An app to act on and a recent ping, so that a 5xx can only be an error (503 is
    # /healthz/analyser's answer when no analyser pinged for an hour).
    if not sql.run("SELECT 1 FROM apps WHERE appid = 'com.example.app'"):
        insert_app(sql, "com.example.app")
    sql.run("INSERT INTO analyser_heartbeats (analyser_id) VALUES ('pi') ON CONFLICT DO NOTHING")
    auth = ADMIN if case.path in ADMIN_PATHS or case.path.startswith("/analysers") else ANALYSER
    response = case.call(headers={**(case.headers or {}), **auth})
    assert response.status_code < 500, (case.method, case.path, response.text)
    # Every answer it gets is one the schema documents for that route.
    case.validate_response(response, checks=[status_code_conformance])


def test_every_route_is_in_the_schema():
    paths = set(handler.app.openapi()["paths"])
    assert paths == {
        "/ping",
        "/queue",
        "/uploadAnalysis",
        "/reportAnalysisFailure",
        "/apps",
        "/apps/{appId}",
        "/healthz",
        "/healthz/analyser",
        "/analysers",
        "/analysers/{name}",
        "/analysers/{name}/rotate",
        "/analysers/{name}/pause",
        "/analysers/{name}/resume",
        "/apps/{appId}/hold",
        "/apps/{appId}/release",
        "/queue/pause",
        "/queue/resume",
        "/operators",
        "/operators/{name}",
        "/operators/{name}/rotate",
    }


def test_the_claim_token_is_in_the_schema():
    """GET /queue answers with the token; both result routes take it back, optionally."""
    paths = handler.app.openapi()["paths"]
    issued = paths["/queue"]["get"]["responses"]["200"]["headers"]["X-Analysis-Claim-Token"]
    assert issued["schema"] == {"type": "string", "format": "uuid"}
    assert "UUID" in issued["description"]
    for path in ("/uploadAnalysis", "/reportAnalysisFailure"):
        (returned,) = [
            p for p in paths[path]["post"]["parameters"] if p["name"] == "X-Analysis-Claim-Token"
        ]
        assert returned["in"] == "header"
        assert returned["required"] is False
        assert "409" in returned["description"]
        assert "without it" in returned["description"]
    # The header is documented where it is used, and nowhere else.
    elsewhere = [
        (path, method)
        for path, operations in paths.items()
        for method, operation in operations.items()
        if path not in ("/uploadAnalysis", "/reportAnalysisFailure")
        and any(p["name"] == "X-Analysis-Claim-Token" for p in operation.get("parameters", []))
    ]
    assert elsewhere == []


def test_the_error_answers_are_in_the_schema():
    """The answers docs/api.md lists, route by route, with their meaning."""
    paths = handler.app.openapi()["paths"]
    documented = {
        (method.upper(), path): sorted(operation["responses"])
        for path, operations in paths.items()
        for method, operation in operations.items()
    }
    results = ["200", "400", "401", "404", "409", "413", "415", "503"]
    # Every admin route that writes answers 403 to a read-only operator's token.
    rotate = ["200", "400", "401", "403", "404", "409", "413", "415", "503"]
    named_post = ["200", "400", "401", "403", "404", "413", "415", "503"]
    assert documented == {
        ("GET", "/ping"): ["200", "400", "401", "503"],
        ("GET", "/queue"): ["200", "400", "401", "503"],
        ("POST", "/uploadAnalysis"): results,
        ("POST", "/reportAnalysisFailure"): results,
        ("POST", "/apps"): ["200", "201", "400", "401", "403", "413", "415", "503"],
        ("GET", "/apps/{appId}"): ["200", "400", "404", "503"],
        ("GET", "/healthz"): ["200", "503"],
        ("GET", "/healthz/analyser"): ["200", "503"],
        ("GET", "/analysers"): ["200", "401", "503"],
        ("POST", "/analysers"): ["201", "400", "401", "403", "409", "413", "415", "503"],
        ("DELETE", "/analysers/{name}"): ["200", "400", "401", "403", "404", "503"],
        ("POST", "/analysers/{name}/rotate"): rotate,
        ("POST", "/analysers/{name}/pause"): named_post,
        ("POST", "/analysers/{name}/resume"): named_post,
        ("POST", "/apps/{appId}/hold"): named_post,
        ("POST", "/apps/{appId}/release"): named_post,
        ("POST", "/queue/pause"): ["200", "400", "401", "403", "413", "415", "503"],
        ("POST", "/queue/resume"): ["200", "400", "401", "403", "413", "415", "503"],
        ("GET", "/operators"): ["200", "401", "503"],
        ("POST", "/operators"): ["201", "400", "401", "403", "409", "413", "415", "503"],
        ("DELETE", "/operators/{name}"): ["200", "400", "401", "403", "404", "503"],
        ("POST", "/operators/{name}/rotate"): rotate,
    }
    conflict = paths["/uploadAnalysis"]["post"]["responses"]["409"]["description"]
    assert "stale X-Analysis-Claim-Token" in conflict and "newer analysisVersion" in conflict


# The operators' POST routes, each with a path that names something there (the app and
# the analyser the test adds).
OPERATOR_POSTS = (
    "/apps/com.example.app/hold",
    "/apps/com.example.app/release",
    "/queue/pause",
    "/queue/resume",
    "/analysers/pi-documented/pause",
    "/analysers/pi-documented/resume",
)


def test_a_body_an_operators_route_cannot_take_gets_a_documented_answer(client, sql):
    """Every operator's POST route, sent a body it cannot take (not JSON by its
    Content-Type; larger than MAX_BODY_BYTES), answers with a status its schema documents
    for it, and changes nothing."""
    insert_app(sql, "com.example.app")
    assert (
        client.post("/analysers", json={"name": "pi-documented"}, headers=ADMIN).status_code == 201
    )
    paths = handler.app.openapi()["paths"]
    before = operators_digest(sql)
    too_large = b"{" + b" " * handler.settings().max_body_bytes + b"}"
    undocumented = []
    for path in OPERATOR_POSTS:
        template = path.replace("com.example.app", "{appId}").replace("pi-documented", "{name}")
        documented = set(paths[template]["post"]["responses"])
        for label, body, content_type in (
            ("text", b"hold it", "text/plain"),
            ("too large", too_large, "application/json"),
        ):
            answer = client.post(
                path, content=body, headers={**ADMIN, "Content-Type": content_type}
            )
            if str(answer.status_code) not in documented:
                undocumented.append((path, label, answer.status_code))
    assert undocumented == []
    assert operators_digest(sql) == before


def operators_digest(sql) -> list:
    """What an operator's route could change: the apps and their history, the analysers,
    the queue's pause, the operators' record."""
    return [
        *table_digest(sql),
        sql.run("SELECT * FROM analysers ORDER BY name"),
        sql.run("SELECT * FROM queue_pause"),
        sql.run("SELECT act, action, outcome FROM operator_actions ORDER BY at, act"),
    ]
