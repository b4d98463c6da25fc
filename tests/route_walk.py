"""A valid request for every route of the service: every APIRoute in handler.app's table
(built from the route and its OpenAPI document: its path parameters, its required query
parameters, a body of its documented media type, each credential its security takes) and
every route of the web view's own table (handler.ADMIN_ROUTES). The walks of tests/
test_serve_routes.py, tests/test_lambda_runtime.py (Python 3.12, the built package) and
tests/test_every_act_is_one_act.py send them, so a route added later is walked the day it
is added; one the builder cannot make a request for raises CannotBuild. A walk fails on
a 5xx, a 401 or a status the route does not document, and on an error a framework or
the service logs, even after the answer began (ErrorLogs): one that runs after a 200 was
sent (a background task's) is seen only there."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from kit import ADMIN, ADMIN_TOKEN, ANALYSER

import handler

APP_ID = "com.example.walk"
NAMED = "walk-named"


# Where the frameworks and the service log an error: Mangum's run of a request, uvicorn
# and Starlette (beside the root, which a logger that propagates reaches), the service's
# Powertools logger.
LOGGERS = ("", "mangum", "uvicorn", "uvicorn.error", "starlette", "fastapi", "analysis-queue")


class ErrorLogs(logging.Handler):
    """Every record at ERROR or above logged while it is open, by any of LOGGERS."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not any(seen is record for seen in self.records):  # one logger's, then its parent's
            self.records.append(record)

    def take(self) -> list[str]:
        """The messages logged since the last take, each with its logger's name."""
        taken, self.records = self.records, []
        return [f"{record.name} logged {record.getMessage()[:200]!r}" for record in taken]

    def __enter__(self) -> ErrorLogs:
        for name in LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(self)


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


def route_table(app: FastAPI) -> set[str]:
    """ "METHOD path" for every route of app's table and of the web view's own."""
    return {
        f"{method} {route.path_format}"
        for route in app.routes
        if isinstance(route, APIRoute) and route.endpoint is not handler.admin
        for method in route.methods
    } | {f"{method} {path}" for method, path, _, _ in handler.ADMIN_ROUTES}


def routes_walked(calls: list[Call]) -> set[str]:
    """ "METHOD path" of every route the calls reach (route_table's form)."""
    return {call.label.split(" (")[0] for call in calls}


def status_problem(call: Call, status: int, text: str) -> list[str]:
    """A 5xx, a 401 or a status the call's route does not document, as a problem line."""
    if status >= 500 or status == 401 or str(status) not in call.documented:
        return [f"{call.label}: answered {status} {text[:200]}"]
    return []


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
        headers: dict[str, str] = dict(ADMIN if who in ("write", "action") else session)
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
    """What valid requests carry, by where a value goes and its name. The apps,
    analysers and operators they name are in the database (an analyser and an operator
    per path parameter, since a DELETE revokes it). The admin routes are walked with the
    admin token and with a full named operator's token."""

    def __init__(self, sql):
        self.sql = sql
        self.made = 0
        self.named_token = handler.new_analyser_token()
        self._analyser(NAMED, self.named_token)
        self.operator_token = handler.new_operator_token()
        self._operator(NAMED, self.operator_token)

    def _analyser(self, name: str, token: str) -> None:
        self.sql.run(
            "INSERT INTO analysers (name, token_hash) VALUES (:name, :hash)",
            name=name,
            hash=handler.token_hash(token),
        )

    def _operator(self, name: str, token: str) -> None:
        self.sql.run(
            "INSERT INTO operators (name, token_hash, read_only, created_by)"
            " VALUES (:name, :hash, false, 'walk')",
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
            self._operator(made, handler.new_operator_token())
            return made
        raise CannotBuild(f"a value for the path parameter {name}")

    def query(self, name: str) -> str:
        known = {"appId": APP_ID, "analysisVersion": str(handler.QueuePolicy().analysis_version)}
        if name not in known:
            raise CannotBuild(f"a value for the query parameter {name}")
        return known[name]

    def field(self, name: str, schema: dict) -> Any:
        """A value for a JSON body's property."""
        if name == "appId":  # a body names a new app (POST /apps adds it)
            self.made += 1
            return f"{APP_ID}.new{self.made}"
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
            operator = {"Authorization": f"Bearer {self.operator_token}"}
            return [("admin", ADMIN), ("named operator", operator)]
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
