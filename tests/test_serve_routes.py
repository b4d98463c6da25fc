"""Every route keeps `serve` fair: none does database work, or reads a secret, on the event
loop, where it would hold up every other client (docs/cli.md, "serve is fair").

The walk builds a request for every APIRoute in handler.app's route table from the route
and its OpenAPI document (its path parameters, its required query parameters, a body of
its documented media type, each credential its security takes), sends each to the app
served as `serve` serves it (a Runtime with worker threads), and records the thread of
every database call and secret read the service makes: one on the event loop's thread
fails the walk. A route added later is walked too; one the walk cannot build a request for
(CannotBuild), or whose request does not succeed, does no database work, or makes a
framework or the service log an error (route_walk.ErrorLogs), fails it. The same calls go
through handler.api as Lambda's runtime sends them. Each walk is shown failing for a
route that calls the database inline, and for one whose background task fails after its
200 was sent.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from fastapi.routing import APIRoute
from kit import ADMIN_TOKEN, UPLOAD_PASSWORD, configure_service
from route_walk import (
    APP_ID,
    Call,
    CannotBuild,
    ErrorLogs,
    Values,
    calls_for,
    route_table,
    routes_walked,
    status_problem,
)
from starlette.background import BackgroundTask

import handler
from helpers import LambdaContext, gateway_event, insert_app
from live import serving


class Recorder:
    """The thread of every database call and secret read the service makes: every
    statement goes through a SharedConnection's transaction, autocommit (run and records
    too) or raw_connection."""

    WATCHED = (
        (handler.SharedConnection, "transaction"),
        (handler.SharedConnection, "autocommit"),
        (handler.SharedConnection, "raw_connection"),
        (handler, "fetch_secret"),
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


def answer_problems(
    call: Call, status: int, text: str, seen: list[tuple[str, int]], logged: list[str]
) -> list[str]:
    """What is wrong with a call's answer: a 5xx, a 401 or an undocumented status, an
    error logged, or no database work done."""
    problems = status_problem(call, status, text)
    problems += [f"{call.label}: {line}" for line in logged]
    if not call.static and not any(what.startswith("SharedConnection") for what, _ in seen):
        problems.append(f"{call.label}: did no database work")
    return problems


def each_request_ended(app: FastAPI, ended: threading.Semaphore) -> Callable:
    """`app`, releasing `ended` once each HTTP request is done with, background tasks and
    all (the answer reaches the client before those run). An error that escapes the app
    is logged here, as uvicorn logs it ("Exception in ASGI application"), before the
    release: the walk then sees each request's logs before it sends the next."""

    async def app_with_an_end(scope, receive, send) -> None:
        try:
            await app(scope, receive, send)
        except Exception:
            logging.getLogger("uvicorn.error").exception("Exception in ASGI application")
        finally:
            if scope["type"] == "http":
                ended.release()

    return app_with_an_end


def walk(app: FastAPI, values: Values, monkeypatch) -> list[str]:
    """Serve `app` as `serve` does, send it calls_for(app), one at a time; what went
    wrong, one line per request (empty: every route is fair)."""
    calls = calls_for(app, values)
    recorder = Recorder(monkeypatch)
    ended = threading.Semaphore(0)
    problems = []
    # uvicorn configures its loggers when it starts, handlers and all: ErrorLogs after.
    with (
        serving(each_request_ended(app, ended)) as server,
        ErrorLogs() as logs,
        httpx.Client(base_url=server.url, timeout=60) as http,
    ):
        loop_thread = server.thread.ident
        recorder.take()
        logs.take()
        for call in calls:
            answer = http.request(
                call.method, call.path, params=call.params, headers=call.headers, content=call.body
            )
            assert ended.acquire(timeout=60), f"{call.label}: the request never ended"
            seen, logged = recorder.take(), logs.take()
            problems += answer_problems(call, answer.status_code, answer.text, seen, logged)
            on_loop = sorted({what for what, thread in seen if thread == loop_thread})
            if on_loop:
                problems.append(f"{call.label}: {', '.join(on_loop)} on the event loop")
    return problems


def walk_through_api(app: FastAPI, values: Values, monkeypatch) -> list[str]:
    """Send calls_for(app) to handler.api as Lambda's runtime calls it, `app` as the
    deployed app, with the Runtime of a Lambda container (no worker threads: a
    request's blocking work runs inline); what went wrong, one line per request."""
    calls = calls_for(app, values)
    recorder = Recorder(monkeypatch)
    monkeypatch.setattr(handler, "deployed_app", app)
    problems = []
    with ErrorLogs() as logs:
        for call in calls:
            headers = {name.lower(): value for name, value in call.headers.items()}
            event = gateway_event(
                call.method, call.path, urlencode(call.params), headers, call.body, base64_body=True
            )
            recorder.take()
            answer = handler.api(event, LambdaContext("analysis-queue-ApiFunction"))
            problems += answer_problems(
                call, answer["statusCode"], answer["body"], recorder.take(), logs.take()
            )
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
    assert routes_walked(calls) == route_table(handler.app)  # every route, none left out
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


def copy_with_a_failing_background_task() -> FastAPI:
    """handler.app's routes, and one that answers 200, then runs a background task that
    fails: an error only the log shows."""
    copy = copy_of_the_app()

    async def fails_late() -> None:
        raise RuntimeError("the background task failed after the answer")

    @copy.get("/probe/late")
    async def late() -> PlainTextResponse:
        await handler.blocking(lambda: handler.api_connection().run("SELECT 1"))
        return PlainTextResponse("ok", background=BackgroundTask(fails_late))

    return copy


def test_the_walks_catch_an_error_logged_after_the_answer_began(database_url, sql, monkeypatch):
    configure_service(monkeypatch, database_url)
    insert_app(sql, APP_ID)
    copy = copy_with_a_failing_background_task()

    # The app's own routes, walked beside it, answer as they should.
    values = Values(sql)
    through_api = walk_through_api(copy, values, monkeypatch)
    served = walk(copy, values, monkeypatch)
    late = "GET /probe/late (anyone):"
    assert through_api == [
        f"{late} analysis-queue logged 'unhandled error'",
        f"{late} mangum.http logged 'An error occurred running the application.'",
    ]
    assert served == [
        f"{late} analysis-queue logged 'unhandled error'",
        f"{late} uvicorn.error logged 'Exception in ASGI application'",
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
