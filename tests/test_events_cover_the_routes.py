"""events/ holds an event for every route of the API but the web view's (docs/local-lambda.md
and docs/cli.md say so): a walk of handler.app's route table fails when a route has none,
or an event names a route the app no longer has. Each API event is its route, as API
Gateway's HTTP API (payload 2.0) sends it. The operators' hold, release and pause events
run through `python3 handler.py invoke api EVENT` (handler.main in this process, with
events/env.json's ApiFunction settings, as sam local runs them) and answer what
docs/local-lambda.md's table says, then change nothing when sent again.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from fastapi.routing import APIRoute

import handler
from helpers import EVENTS, app_row, call_cli, env_json, insert_app, load_event
from markdown_pages import DOCS, table_column

pytestmark = pytest.mark.usefixtures("lambda_container")

# The operators' routes of issue 36, in the order one database goes through them (after
# add-app.json's app and analysers-add.json's analyser), and what each answers when sent
# a second time: it changes nothing and says so.
OPERATOR_EVENTS = {
    "hold-app.json": "already_held",
    "release-app.json": "not_held",
    "analysers-pause.json": "unchanged",
    "analysers-resume.json": "unchanged",
    "queue-pause.json": "unchanged",
    "queue-resume.json": "unchanged",
}


def api_routes() -> set[str]:
    """The API's routes as HTTP API route keys (`METHOD /path`): handler.app's table, the
    web view's /admin apart (its paths go to one dispatcher). /openapi.json is no APIRoute:
    the template routes it nowhere (the catch-all's 404)."""
    return {
        f"{method} {route.path_format}"
        for route in handler.app.routes
        if isinstance(route, APIRoute)
        and not (route.path == "/admin" or route.path.startswith("/admin/"))
        for method in route.methods
        if method != "HEAD"
    }


def api_events() -> dict[str, dict]:
    """The HTTP API events of events/, by file name."""
    events = {path.name: load_event(path.name) for path in sorted(EVENTS.glob("*.json"))}
    return {name: event for name, event in events.items() if "requestContext" in event}


def documented_answers() -> dict[str, str]:
    """docs/local-lambda.md's event table: file name -> its "what it is" cell."""
    page = (DOCS / "local-lambda.md").read_text()
    names = table_column(page, "## The event files")
    cells = table_column(page, "## The event files", 2)
    return dict(zip(names, cells, strict=True))


def test_every_api_route_has_an_event():
    routes = api_routes()
    covered = {event["routeKey"] for event in api_events().values()}
    assert routes - covered == set(), "routes with no event in events/"
    assert covered - routes == set(), "events of routes the app does not have"
    # The operators' events below are each of a route of its own, all in the table.
    operator_routes = {load_event(name)["routeKey"] for name in OPERATOR_EVENTS}
    assert operator_routes <= routes and len(operator_routes) == len(OPERATOR_EVENTS)


@pytest.mark.parametrize("name", sorted(api_events()))
def test_each_api_event_is_its_route_as_the_http_api_sends_it(name):
    event = api_events()[name]
    route = event["routeKey"]
    method, _, template = route.partition(" ")
    assert event["version"] == "2.0"
    context = event["requestContext"]
    assert context["routeKey"] == route and context["stage"] == "$default"
    assert (context["http"]["method"], context["http"]["path"]) == (method, event["rawPath"])
    pattern = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(template))
    match = re.fullmatch(pattern, event["rawPath"])
    assert match, (event["rawPath"], template)
    assert event.get("pathParameters", {}) == match.groupdict()
    headers = event["headers"]
    assert all(key == key.lower() for key in headers)
    if "body" in event:
        assert int(headers["content-length"]) == len(event["body"].encode())
        if headers["content-type"] == "application/json":
            json.loads(event["body"])
    else:
        assert "content-length" not in headers and "content-type" not in headers


@pytest.mark.parametrize("name", sorted(OPERATOR_EVENTS))
def test_the_operators_events_carry_the_admin_token_as_the_others_do(name):
    admin = load_event("add-app.json")["headers"]["authorization"]
    assert admin == f"Bearer {env_json('ApiFunction')['ADMIN_TOKEN']}"
    assert load_event(name)["headers"]["authorization"] == admin


def invoke_api(database_url: str, name: str) -> tuple[int, dict]:
    """`python3 handler.py invoke api events/NAME` configured as sam local configures the
    ApiFunction (events/env.json), on database_url: its exit code and the answer."""
    api_env = {**env_json("ApiFunction"), "DATABASE_URL": database_url}
    done = call_cli("invoke", "api", f"events/{name}", env={**os.environ, **api_env})
    return done.returncode, json.loads(done.stdout.splitlines()[-1])


def test_the_operators_events_answer_as_documented(database_url, sql):
    documented = documented_answers()
    insert_app(sql, "com.example.app")
    code, added = invoke_api(database_url, "analysers-add.json")
    assert (code, added["statusCode"]) == (0, 201), added

    def paused(what: str) -> bool:
        query = {
            "analyser": "SELECT paused_at IS NOT NULL FROM analysers WHERE name = 'pi-01'",
            "queue": "SELECT coalesce(bool_or(paused_at IS NOT NULL), false) FROM queue_pause",
        }[what]
        ((found,),) = sql.run(query)
        return found

    for name in OPERATOR_EVENTS:
        found = re.search(r"\b(\d{3}), outcome (\w+)", documented[name])
        assert found, f"docs/local-lambda.md gives no answer for {name}: {documented[name]}"
        status, outcome = int(found.group(1)), found.group(2)
        code, answer = invoke_api(database_url, name)
        assert (code, answer["statusCode"]) == (0, status), answer
        body = json.loads(answer["body"])
        assert body["outcome"] == outcome, (name, body)
        assert answer["headers"]["cache-control"] == "no-store"
        sent = load_event(name).get("body")
        if name == "hold-app.json":
            ((held_at, held_by, reason),) = sql.run(
                "SELECT held_at, held_by, hold_reason FROM apps WHERE appid = 'com.example.app'"
            )
            assert body["reason"] == reason == json.loads(sent)["reason"]
            assert held_at is not None and body["heldBy"] == held_by
        elif name == "release-app.json":
            assert app_row(sql, "com.example.app")["held_at"] is None
        elif name.startswith("analysers-"):
            assert body["name"] == "pi-01"
            assert body["paused"] is paused("analyser") is (name == "analysers-pause.json")
        else:
            assert body["paused"] is paused("queue") is (name == "queue-pause.json")
            if name == "queue-pause.json":
                assert body["reason"] == json.loads(sent)["reason"]

    # Each again, at once after itself: nothing changes, and the answer says so.
    for name, unchanged in OPERATOR_EVENTS.items():
        first_code, first = invoke_api(database_url, name)
        code, again = invoke_api(database_url, name)
        assert (first_code, code, first["statusCode"], again["statusCode"]) == (0, 0, 200, 200)
        assert json.loads(again["body"])["outcome"] == unchanged, (name, again)
