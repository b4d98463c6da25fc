"""Every route keeps `serve` fair: none does database work, or reads a secret, on the event
loop, where it would hold up every other client (docs/cli.md, "serve is fair").

The walk builds a request for every APIRoute in handler.app's route table from the route
and its OpenAPI document (its path parameters, its required query parameters, a body of
its documented media type, each credential its security takes), sends each to the app
served as `serve` serves it (a Runtime with worker threads), and records the thread of
every database call and secret read the service makes: one on the event loop's thread
fails the walk. A route added later is walked too; one the walk cannot build a request for
(CannotBuild), or whose request does not succeed or does no database work, fails it. The
walk is shown failing for a route that calls the database inline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from fastapi.routing import APIRoute
from kit import ADMIN, ADMIN_TOKEN, ANALYSER, UPLOAD_PASSWORD, configure_service

import handler
from helpers import LambdaContext, gateway_event, insert_app
from live import serving

APP_ID = "com.example.walk"
NAMED = "walk-named"


class CannotBuild(Exception):
    """The walk does not know how to make a valid request for a route: teach Values."""


@dataclasses.dataclass
class Call:
    label: str
    method: str
    path: str
    params: dict[str, str]
    headers: dict[str, str]
    body: bytes | None
    documented: set[str]  # the statuses the route's OpenAPI document lists
    static: bool = False  # an answer of fixed text: no database work to look for


def admin_calls(values: Values) -> list[Call]:
    """A request for every route of the web view's table (handler.ADMIN_ROUTES: one
    dispatcher, outside the OpenAPI document): pages and reads with a signed-in session's
    cookie (its lookup is database work), writes with the bearer admin token, the
    sign-in with its form, as the page posts it."""
    cookie = handler.sign_in(handler.api_connection(), ADMIN_TOKEN, "203.0.113.1")
    session = {"Cookie": f"{handler.ADMIN_SESSION_COOKIE}={cookie}"}
    bodies = {
        "/admin/api/refetch": {"appIds": [APP_ID]},
        "/admin/api/analysers": {"name": f"{NAMED}-web"},
        "/admin/api/analysers/{name}/rotate": {"overlap": "1h"},
    }
    calls = []
    for method, path_format, _, who in handler.ADMIN_ROUTES:
        path = path_format.replace("{appId}", APP_ID)
        if "{name}" in path:
            path = path.replace("{name}", values.path("name"))
        headers: dict[str, str] = dict(ADMIN if who == "write" else session)
        body = None
        if path == "/admin/logout":  # a session of its own to end, from the page itself
            ending = handler.sign_in(handler.api_connection(), ADMIN_TOKEN, "203.0.113.1")
            headers = {
                "Cookie": f"{handler.ADMIN_SESSION_COOKIE}={ending}",
                "Sec-Fetch-Site": "same-origin",
            }
        if path == "/admin/login" and method == "POST":
            headers = {
                "Content-Type": "application/x-www-form-urlencoded",
                "Sec-Fetch-Site": "same-origin",
            }
            body = f"token={ADMIN_TOKEN}".encode()
        elif method == "POST":
            headers["Content-Type"] = "application/json"
            body = json.dumps(bodies.get(path_format, {})).encode()
        static = who == "anyone" and method == "GET"
        label = f"{method} {path_format} ({'anyone' if who == 'anyone' else 'admin'})"
        calls.append(Call(label, method, path, {}, headers, body, {"200", "201", "303"}, static))
    return calls


class Values:
    """What valid requests carry, by where a value goes and its name. The apps and
    analysers they name are in the database (an analyser per path parameter, since a
    DELETE revokes it)."""

    def __init__(self, sql):
        self.sql = sql
        self.made = 0
        self.named_token = handler.new_analyser_token()
        self._analyser(NAMED, self.named_token)

    def _analyser(self, name: str, token: str) -> None:
        self.sql.run(
            "INSERT INTO analysers (name, token_hash) VALUES (:name, :hash)",
            name=name,
            hash=handler.token_hash(token),
        )

    def _new_name(self) -> str:
        self.made += 1
        return f"walk-{self.made}"

    def path(self, name: str) -> str:
        if name == "appId":
            return APP_ID
        if name == "name":
            made = self._new_name()
            self._analyser(made, handler.new_analyser_token())
            return made
        raise CannotBuild(f"a value for the path parameter {name}")

    def query(self, name: str) -> str:
        known = {"appId": APP_ID, "analysisVersion": str(handler.QueuePolicy().analysis_version)}
        if name not in known:
            raise CannotBuild(f"a value for the query parameter {name}")
        return known[name]

    def field(self, name: str, schema: dict) -> Any:
        """A value for a JSON body's property."""
        if name == "appId":
            return APP_ID
        if name == "name":
            return self._new_name()  # a body names a new analyser
        if name == "overlap":
            return "1h"
        if schema.get("type") == "object" and not schema.get("required"):
            return {}
        raise CannotBuild(f"a value for the body's {name}")

    def credentials(self, scheme: str) -> list[tuple[str, dict[str, str]]]:
        if scheme == "AnalyserPassword":
            named = {"Authorization": f"Bearer {self.named_token}"}
            return [("shared password", ANALYSER), ("named analyser", named)]
        if scheme == "AdminToken":
            return [("admin", ADMIN)]
        raise CannotBuild(f"a credential of the security scheme {scheme}")


def json_instance(schema: dict, values: Values) -> dict:
    if schema.get("type") != "object":
        raise CannotBuild(f"a JSON body of schema {schema}")
    required = set(schema.get("required", ()))
    body = {}
    for name, property_schema in schema.get("properties", {}).items():
        try:
            body[name] = values.field(name, property_schema)
        except CannotBuild:
            if name in required:
                raise
    return body


def body_of(operation: dict, values: Values) -> tuple[dict[str, str], bytes | None]:
    """A body of the first media type the route documents (sent even when optional)."""
    request_body = operation.get("requestBody")
    if request_body is None:
        return {}, None
    media, content = next(iter(request_body["content"].items()))
    if media == "application/json":
        body = json_instance(content.get("schema", {}), values)
        return {"Content-Type": media}, json.dumps(body).encode()
    if media == "text/plain":
        return {"Content-Type": media}, b"walk: usb error"
    raise CannotBuild(f"a body of type {media}")


def calls_for(app: FastAPI, values: Values) -> list[Call]:
    """A request for every APIRoute of `app` and every credential it takes, in the route
    table's order."""
    spec = app.openapi()
    calls = []
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        if route.endpoint is handler.admin:  # the web view: its own table
            if route.path_format == "/admin":
                calls += admin_calls(values)
            continue
        for method in sorted(route.methods):
            where = f"{method} {route.path_format}"
            operation = spec["paths"].get(route.path_format, {}).get(method.lower())
            if operation is None:
                raise CannotBuild(f"{where}: not in the OpenAPI document")
            parameters = operation.get("parameters") or []
            documented = {p["name"] for p in parameters if p["in"] == "path"}
            if set(route.param_convertors) != documented:
                raise CannotBuild(f"{where}: undocumented path parameters")
            path = route.path_format
            params: dict[str, str] = {}
            for parameter in parameters:
                name = parameter["name"]
                if parameter["in"] == "path":
                    path = path.replace("{" + name + "}", values.path(name))
                elif parameter["in"] == "query" and parameter.get("required"):
                    params[name] = values.query(name)
                elif parameter.get("required"):
                    raise CannotBuild(f"{where}: the required {parameter['in']} {name}")
            headers, body = body_of(operation, values)
            alternatives = operation.get("security") or [{}]
            for alternative in alternatives:
                if len(alternative) > 1:
                    raise CannotBuild(f"{where}: a security requirement of several schemes")
                credentials = (
                    values.credentials(next(iter(alternative))) if alternative else [("anyone", {})]
                )
                for who, credential in credentials:
                    calls.append(
                        Call(
                            f"{where} ({who})",
                            method,
                            path,
                            params,
                            {**headers, **credential},
                            body,
                            set(operation.get("responses", {})),
                        )
                    )
    return calls


class Recorder:
    """The thread of every database call and secret read the service makes: every
    statement goes through a SharedConnection's transaction, autocommit (run and records
    too) or raw_connection."""

    WATCHED = (
        (handler.SharedConnection, "transaction"),
        (handler.SharedConnection, "autocommit"),
        (handler.SharedConnection, "raw_connection"),
        (handler, "fetch_secret"),
        (handler, "fetch_previous_secret"),
    )

    def __init__(self, monkeypatch):
        self.seen: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        for owner, name in self.WATCHED:
            self._watch(monkeypatch, owner, name)

    def _watch(self, monkeypatch, owner: Any, name: str) -> None:
        real = getattr(owner, name)
        what = f"{owner.__name__}.{name}"

        def watched(*args, **kwargs):
            with self._lock:
                self.seen.append((what, threading.get_ident()))
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, watched)

    def take(self) -> list[tuple[str, int]]:
        with self._lock:
            seen, self.seen = self.seen, []
        return seen


def answer_problems(call: Call, status: int, text: str, seen: list[tuple[str, int]]) -> list[str]:
    """What is wrong with a call's answer: a 5xx, a 401 or an undocumented status, or no
    database work done."""
    problems = []
    if status >= 500 or status == 401 or str(status) not in call.documented:
        problems.append(f"{call.label}: answered {status} {text[:200]}")
    if not call.static and not any(what.startswith("SharedConnection") for what, _ in seen):
        problems.append(f"{call.label}: did no database work")
    return problems


def walk(app: FastAPI, values: Values, monkeypatch) -> list[str]:
    """Serve `app` as `serve` does, send it calls_for(app), one at a time; what went
    wrong, one line per request (empty: every route is fair)."""
    calls = calls_for(app, values)
    recorder = Recorder(monkeypatch)
    problems = []
    with serving(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        loop_thread = server.thread.ident
        recorder.take()
        for call in calls:
            answer = http.request(
                call.method, call.path, params=call.params, headers=call.headers, content=call.body
            )
            seen = recorder.take()
            problems += answer_problems(call, answer.status_code, answer.text, seen)
            on_loop = sorted({what for what, thread in seen if thread == loop_thread})
            if on_loop:
                problems.append(f"{call.label}: {', '.join(on_loop)} on the event loop")
    return problems


def walk_through_api(app: FastAPI, values: Values, monkeypatch) -> list[str]:
    """Send calls_for(app) to handler.api as Lambda's runtime calls it, `app` as the
    deployed app, with the Runtime of a Lambda container (no worker threads: nothing a
    request does waits, and handler.answer_asgi steps it without a task); what went
    wrong, one line per request. A route that needs a task before it waits (anyio,
    asyncio.timeout) answers 500 here."""
    calls = calls_for(app, values)
    recorder = Recorder(monkeypatch)
    monkeypatch.setattr(handler, "deployed_app", app)
    problems = []
    for call in calls:
        headers = {name.lower(): value for name, value in call.headers.items()}
        event = gateway_event(
            call.method, call.path, urlencode(call.params), headers, call.body, base64_body=True
        )
        recorder.take()
        answer = handler.api(event, LambdaContext("analysis-queue-ApiFunction"))
        problems += answer_problems(call, answer["statusCode"], answer["body"], recorder.take())
    return problems


@pytest.fixture(params=["tokens in the environment", "tokens in Secrets Manager and SSM"])
def walkable(request, database_url, sql, monkeypatch) -> Values:
    """The database a walk needs (an app, a named analyser, a heartbeat), and the
    service's tokens set directly or read from the secret stores (moto)."""
    if request.param != "tokens in the environment":
        aws = request.getfixturevalue("aws")
        aws.client("secretsmanager").create_secret(Name="walk/upload", SecretString=UPLOAD_PASSWORD)
        aws.client("ssm").put_parameter(Name="/walk/admin", Value=ADMIN_TOKEN, Type="SecureString")
        configure_service(
            monkeypatch,
            database_url,
            UPLOAD_PASSWORD="",
            ADMIN_TOKEN="",
            UPLOAD_PASSWORD_SECRET="secretsmanager:walk/upload",
            ADMIN_TOKEN_SECRET="ssm:/walk/admin",
            ADMIN_WEB="full",
        )
    else:
        configure_service(monkeypatch, database_url, ADMIN_WEB="full")
    insert_app(sql, APP_ID)
    return Values(sql)


def test_no_route_does_database_work_on_the_event_loop(walkable, monkeypatch):
    calls = calls_for(handler.app, walkable)
    routes = {call.label.split(" (")[0] for call in calls}
    table = {
        f"{method} {route.path_format}"
        for route in handler.app.routes
        if isinstance(route, APIRoute) and route.endpoint is not handler.admin
        for method in route.methods
    } | {f"{method} {path}" for method, path, _, _ in handler.ADMIN_ROUTES}
    assert routes == table  # every route of the table, none left out
    assert walk(handler.app, walkable, monkeypatch) == []


def test_every_route_answers_through_handler_api(walkable, monkeypatch):
    assert handler.runtime().worker_pool() is None  # a Lambda container's Runtime
    assert walk_through_api(handler.app, walkable, monkeypatch) == []


def copy_of_the_app() -> FastAPI:
    """A new app with handler.app's routes and error handlers, for routes added to it."""
    copy = FastAPI(docs_url=None, redoc_url=None, redirect_slashes=False)
    copy.router.routes.extend(
        route
        for route in handler.app.routes
        if isinstance(route, APIRoute) and route.endpoint is not handler.admin
    )
    copy.exception_handlers.update(handler.app.exception_handlers)
    return copy


def test_the_walk_catches_a_route_that_calls_the_database_on_the_loop(
    database_url, sql, monkeypatch
):
    insert_app(sql, APP_ID)
    copy = copy_of_the_app()

    @copy.get("/probe/inline")
    async def inline() -> PlainTextResponse:
        handler.api_connection().run("SELECT 1")  # on the event loop: what the walk catches
        return PlainTextResponse("ok")

    @copy.get("/probe/blocking")
    async def handed_over() -> PlainTextResponse:
        await handler.blocking(lambda: handler.api_connection().run("SELECT 1"))
        return PlainTextResponse("ok")

    assert walk(copy, Values(sql), monkeypatch) == [
        "GET /probe/inline (anyone): SharedConnection.autocommit on the event loop"
    ]


def test_the_walk_through_handler_api_catches_a_route_that_needs_a_task(
    database_url, sql, monkeypatch
):
    configure_service(monkeypatch, database_url)
    insert_app(sql, APP_ID)
    copy = copy_of_the_app()

    @copy.get("/probe/timeout")
    async def timed() -> PlainTextResponse:
        async with asyncio.timeout(5):  # needs a task: there is none before a wait
            await handler.blocking(lambda: handler.api_connection().run("SELECT 1"))
        return PlainTextResponse("ok")

    # The app's own routes, walked beside it, answer as they should.
    assert walk_through_api(copy, Values(sql), monkeypatch) == [
        'GET /probe/timeout (anyone): answered 500 {"detail":"internal error"}',
        "GET /probe/timeout (anyone): did no database work",
    ]


def test_the_walk_refuses_a_route_it_cannot_build_a_request_for(database_url, sql):
    values = Values(sql)
    copy = copy_of_the_app()

    @copy.get(
        "/probe/{thing}",
        openapi_extra={
            "parameters": [
                {"name": "thing", "in": "path", "required": True, "schema": {"type": "string"}}
            ]
        },
    )
    async def unknown_parameter() -> PlainTextResponse:
        return PlainTextResponse("ok")

    with pytest.raises(CannotBuild, match="path parameter thing"):
        calls_for(copy, values)
    copy = copy_of_the_app()

    @copy.get("/probe/{undocumented}")
    async def undocumented_parameter() -> PlainTextResponse:
        return PlainTextResponse("ok")

    with pytest.raises(CannotBuild, match="undocumented path parameters"):
        calls_for(copy, values)
