"""Every value the service hands out is taken back by the route that takes it (docs/
queue.md, "Every act is one act"): a page's `next` as the next page's `after`, an app's
bundle ID by the routes that take an app, an analyser's name by the routes that take an
analyser, whatever rows the database holds. Generated databases hold the rows the old
server may have left (bundle IDs of any text, kept from before sql/003 under its NOT
VALID check: spaces, slashes, dots alone, letters of any script) beside valid ones, in
every state, and named analysers, some revoked.

The producers are every GET of the operators' routes (the web view's table, and the
APIRoutes only the admin token opens); the consumers are found in the same tables by
the parameter a value goes back into ({appId}, {name}, `after`, a body's appIds). A
route added to either table is walked the day it is added. A value given back must
never be answered 400 or 404 (not a value the route knows) nor 5xx.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import ADMIN, UPLOAD_PASSWORD, configure_service

import handler
from helpers import LambdaContext, gateway_event

pytestmark = pytest.mark.private_database  # drops the CHECK sql/003 added, as old rows are

BEARER = {name.lower(): value for name, value in ADMIN.items()}
# What each kind of value is called where it is handed out, and where it is taken back.
HANDED_OUT = {"appId": "appId", "name": "name"}
# A `name` is an analyser's, except on the named operators' routes (and where they are
# listed): an operator's, a kind of its own.
OPERATORS_PATH = "/operators"


def kind_on(path: str, kind: str) -> str:
    return "operator" if kind == "name" and path.startswith(OPERATORS_PATH) else kind


BODY_TAKES = {"appIds": "appId"}  # a JSON body's list of values of a kind


def send(method: str, path: str, query: str = "", body: Any = None) -> tuple[int, Any]:
    headers = dict(BEARER)
    if body is not None:
        headers["content-type"] = "application/json"
        body = json.dumps(body)
    answer = handler.api(
        gateway_event(method, path, query, headers, body),
        LambdaContext("analysis-queue-ApiFunction"),
    )
    text = answer["body"]
    try:
        return answer["statusCode"], json.loads(text)
    except ValueError:
        return answer["statusCode"], text


def operators_routes() -> list[tuple[str, str]]:
    """(method, path) of every route only an operator may use: the web view's table
    (but what anyone may ask for) and every APIRoute the admin token alone opens."""
    routes = [(m, p) for m, p, _, who in handler.ADMIN_ROUTES if who != "anyone"]
    spec = handler.app.openapi()
    for route in handler.app.routes:
        if not isinstance(route, APIRoute) or route.endpoint is handler.admin:
            continue
        for method in route.methods:
            operation = spec["paths"][route.path_format][method.lower()]
            if operation.get("security") == [{handler.ADMIN_SCHEME: []}]:
                routes.append((method, route.path_format))
    return routes


def values_in(document: Any, found: dict[str, set[str]], path: str = "") -> None:
    """Every string under a key of HANDED_OUT, anywhere in a JSON document `path` gave."""
    if isinstance(document, dict):
        for key, value in document.items():
            if key in HANDED_OUT and isinstance(value, str):
                found[kind_on(path, HANDED_OUT[key])].add(value)
            values_in(value, found, path)
    elif isinstance(document, list):
        for item in document:
            values_in(item, found, path)


def pages(path: str, query: dict[str, str]) -> tuple[list[Any], list[str]]:
    """Every page of a paged list, each `next` given back as `after`; (the pages, what
    went wrong)."""
    seen, problems, after = [], [], None  # the first page has no `after`
    for _ in range(1000):
        asked = query if after is None else {**query, "after": after}
        status, page = send("GET", path, urlencode(asked))
        if status != 200:
            problems.append(f"GET {path}?{query} after={after!r}: {status} {page}")
            break
        seen.append(page)
        if not isinstance(page, dict) or page.get("next") is None:
            break
        after = page["next"]
    return seen, problems


LIST_FILTERS = [{}, *({"state": state} for state in handler.APP_STATES)]
# What names the past, not what is: the record of actions keeps every app and name it
# ever named (append-only), so it hands out nothing to give back.
HISTORY = {"/admin/api/actions"}
# What describes the routes themselves: its "name"s are parameters', not analysers'.
DESCRIPTION = {"/admin/api/openapi.json"}


def walk(sql) -> list[str]:
    """Hand out every value every producer gives, and give each back to every consumer."""
    routes = operators_routes()
    found: dict[str, set[str]] = {kind: set() for kind in [*HANDED_OUT.values(), "operator"]}
    problems: list[str] = []
    listed: list[str] = []
    for method, path in routes:
        if method != "GET" or "{" in path or path in HISTORY | DESCRIPTION:
            continue
        if path == "/admin/api/apps":  # paged: every page, under every filter
            for query in LIST_FILTERS:
                got, wrong = pages(path, query)
                problems += wrong
                for page in got:
                    values_in(page, found)
                    if not query:
                        listed += [app["appId"] for app in page["apps"]]
            continue
        status, document = send("GET", path)
        if status >= 400:
            problems.append(f"GET {path}: {status}")
        values_in(document, found, path)
    everyone = [appid for (appid,) in sql.run("SELECT appid FROM apps")]
    if sorted(listed) != sorted(everyone):
        problems.append(f"the pages listed {sorted(listed)}, not every app {sorted(everyone)}")
    for method, path in routes:
        for kind in re.findall(r"\{(\w+)\}", path):
            for value in sorted(found.get(kind_on(path, kind), ())):
                filled = path.replace("{" + kind + "}", quote(value, safe=""))
                status, answer = send(method, filled, body={} if method == "POST" else None)
                if status in (400, 404) or status >= 500:
                    problems.append(f"{method} {path} with {kind} {value!r}: {status} {answer}")
        if method == "POST" and path == "/admin/api/refetch":
            for field, kind in BODY_TAKES.items():
                for value in sorted(found[kind]):
                    status, answer = send(method, path, body={field: [value]})
                    if status != 200 or value in answer.get("unknown", ()):
                        problems.append(f"{method} {path} {field} [{value!r}]: {status} {answer}")
    return problems


ODD_IDS = st.text(  # the empty one too: sql/003 names it
    alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\x00"),
    max_size=24,
)
VALID_IDS = st.from_regex(r"[a-z][a-z0-9]{0,6}\.[A-Za-z0-9.-]{0,10}[a-z0-9]", fullmatch=True)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    apps=st.lists(
        st.tuples(st.one_of(VALID_IDS, ODD_IDS), st.sampled_from(handler.APP_STATES)),
        max_size=12,
    ),
    analysers=st.lists(
        # Any name the table's CHECK takes (dots alone too: an older release's, or SQL's).
        st.tuples(st.from_regex(handler.STORED_ANALYSER_NAME, fullmatch=True), st.booleans()),
        max_size=4,
    ),
    operators=st.lists(
        # Any name sql/035's CHECK takes.
        st.tuples(st.from_regex(handler.OPERATOR_NAME, fullmatch=True), st.booleans()),
        max_size=3,
    ),
    page_size=st.integers(1, 4),
)
def test_every_value_handed_out_is_taken_back(
    database_url, sql, monkeypatch, apps, analysers, operators, page_size
):
    configure_service(monkeypatch, database_url, ADMIN_WEB="full")
    monkeypatch.setattr(handler, "APPS_PAGE_SIZE", page_size)  # pages of a few rows
    sql.run("ALTER TABLE apps DROP CONSTRAINT IF EXISTS apps_appid_valid")
    sql.run("DELETE FROM app_analyses")
    sql.run("DELETE FROM apps")
    sql.run("DELETE FROM analysers")
    sql.run("DELETE FROM operators")
    for appid, status in apps:
        invalid = not handler.is_valid_bundle_id(appid)
        status = "failed" if invalid else status  # as sql/003 left them
        sql.run(
            "INSERT INTO apps (appid, status, details, processing_started, analysis_claim_token,"
            " analysis, analysed, analysisversion, failure_reason, failure_retryable)"
            " SELECT :a, :s, jsonb_build_object('reviews', '3'),"
            " CASE WHEN :s = 'processing' THEN now() END,"
            " CASE WHEN :s = 'processing' THEN gen_random_uuid() END,"
            " CASE WHEN :s IN ('analysed', 'failed') THEN"
            "   jsonb_build_object('success', :s = 'analysed') END,"
            " CASE WHEN :s IN ('analysed', 'failed') THEN now() END,"
            " CASE WHEN :s IN ('analysed', 'failed') THEN 4 END,"
            " CASE WHEN :s = 'failed' THEN :reason END,"
            " CASE WHEN :s = 'failed' THEN NOT :invalid END"
            " ON CONFLICT DO NOTHING",
            a=appid,
            s=status,
            reason="invalid_bundle_id" if invalid else "analysis_failed",
            invalid=invalid,
        )
    for name, revoked in analysers:
        sql.run(
            "INSERT INTO analysers (name, token_hash, revoked) VALUES (:n, :h,"
            " CASE WHEN :r THEN now() END) ON CONFLICT DO NOTHING",
            n=name,
            h=handler.token_hash(handler.new_analyser_token()),
            r=revoked,
        )
    for name, revoked in operators:
        if name.lower() in handler.RESERVED_ACTORS:
            continue
        sql.run(
            "INSERT INTO operators (name, token_hash, read_only, created_by, revoked)"
            " VALUES (:n, :h, false, 'test', CASE WHEN :r THEN now() END) ON CONFLICT DO NOTHING",
            n=name,
            h=handler.token_hash(handler.new_operator_token()),
            r=revoked,
        )
    assert walk(sql) == []


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(apps=st.lists(st.tuples(st.one_of(VALID_IDS, ODD_IDS), st.integers(0, 10**6)), max_size=8))
def test_every_app_a_claim_hands_out_takes_its_result(database_url, sql, monkeypatch, apps):
    """The analysers' side: the bundle ID and the claim token GET /queue hands out are
    taken back by POST /uploadAnalysis, whatever else the table holds (an old row's bundle
    ID of any text is never handed out: sql/003 left it failed, for good)."""
    configure_service(monkeypatch, database_url)
    sql.run("ALTER TABLE apps DROP CONSTRAINT IF EXISTS apps_appid_valid")
    sql.run("DELETE FROM app_analyses")
    sql.run("DELETE FROM apps")
    for appid, reviews in apps:
        invalid = not handler.is_valid_bundle_id(appid)
        sql.run(
            "INSERT INTO apps (appid, details, status, analysis, analysed, analysisversion,"
            " failure_reason, failure_retryable)"
            " SELECT :a, jsonb_build_object('reviews', CAST(:r AS text)),"
            " CASE WHEN :invalid THEN 'failed' ELSE 'queued' END,"
            " CASE WHEN :invalid THEN '{\"success\": false}'::jsonb END,"
            " CASE WHEN :invalid THEN now() END, CASE WHEN :invalid THEN 4 END,"
            " CASE WHEN :invalid THEN 'invalid_bundle_id' END, CASE WHEN :invalid THEN false END"
            " ON CONFLICT DO NOTHING",
            a=appid,
            r=str(reviews),
            invalid=invalid,
        )
    ((queued,),) = sql.run("SELECT count(*) FROM apps WHERE status = 'queued'")
    analyser = {"authorization": f"Bearer {UPLOAD_PASSWORD}"}
    for _ in range(queued + 1):
        claimed = handler.api(
            gateway_event("GET", "/queue", "", analyser),
            LambdaContext("analysis-queue-ApiFunction"),
        )
        assert claimed["statusCode"] == 200, claimed
        if not claimed["body"]:
            break
        token = claimed["headers"][handler.CLAIM_TOKEN_HEADER.lower()]
        headers = {
            **analyser,
            "content-type": "application/json",
            handler.CLAIM_TOKEN_HEADER.lower(): token,
        }
        query = urlencode({"appId": claimed["body"], "analysisVersion": "4"})
        event = gateway_event("POST", "/uploadAnalysis", query, headers, '{"success": true}')
        stored = handler.api(event, LambdaContext("analysis-queue-ApiFunction"))
        assert stored["statusCode"] == 200, (claimed["body"], stored)
    ((left,),) = sql.run("SELECT count(*) FROM apps WHERE status = 'queued'")
    assert left == 0
