"""handler.api answers what Mangum's own run of the deployed app answers (Mangum(app,
lifespan="off") called with the event): generated refused and public requests through
the service, status, headers and body alike; and a claim and an upload under a Runtime
with worker threads (as under `serve`), whose requests wait on those threads. handler.api
reads the event once (an event Mangum cannot read is a 400: tests/test_api.py), then runs
the request as Mangum does, HTTPCycle(scope, body)(app), on the calling thread's loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import configure_function
from mangum import Mangum

import handler
from helpers import (
    LambdaContext,
    app_row,
    env_json,
    gateway_event,
    insert_app,
    load_event,
    table_digest,
    text_answer,
)

pytestmark = pytest.mark.usefixtures("lambda_container")


@contextlib.contextmanager
def mangums_loop():
    """The loop Mangum's HTTPCycle asks asyncio for (get_event_loop), set while it runs."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        yield
    finally:
        asyncio.set_event_loop(None)
        loop.close()


# --- the service -----------------------------------------------------------------------

PATHS = (
    "/queue",
    "/ping",
    "/uploadAnalysis",
    "/reportAnalysisFailure",
    "/apps",
    "/apps/com.example.app",
    "/apps/com.example.none",
    "/apps/%E2%80%AE",
    "/healthz",
    "/healthz/analyser",
    "/analysers",
    "/analysers/pi",
    "/analysers/pi/rotate",
    "/openapi.json",
    "/nowhere",
    "/queue/",
)
ADMIN = {"authorization": f"Bearer {env_json('ApiFunction')['ADMIN_TOKEN']}"}
ANALYSER = {"authorization": f"Bearer {env_json('ApiFunction')['UPLOAD_PASSWORD']}"}
REFUSED = (
    {},
    {"authorization": "Bearer wrong"},
    {"authorization": "Basic cGk6cGk="},
    {"authorization": "Bearer"},
    {"authorization": ADMIN["authorization"]},
)


@given(
    method=st.sampled_from(("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS")),
    path=st.sampled_from(PATHS),
    query=st.sampled_from(("", "appId=com.example.app", "x=%FF", "appId=&appId=")),
    headers=st.sampled_from(REFUSED),
    body=st.sampled_from((None, "", "{}", '{"appId": "com.example.app"}', "\x00")),
)
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_the_service_answers_as_through_mangum(
    database_url, sql, monkeypatch, method, path, query, headers, body
):
    """Requests that change nothing (no token the route takes: every write is refused;
    the public reads) answer through handler.api exactly as Mangum's own run of the same
    app answers them: status, headers and body."""
    configure_function(monkeypatch, "ApiFunction", database_url)
    if not sql.run("SELECT 1 FROM apps WHERE appid = 'com.example.app'"):
        insert_app(sql, "com.example.app")
    if method != "GET":  # the admin's token reads, and writes nothing
        headers = {key: value for key, value in headers.items() if value != ADMIN["authorization"]}
    event = gateway_event(method, path, query, headers, body)
    before = table_digest(sql)

    answered = handler.api(json.loads(json.dumps(event)), LambdaContext())
    with mangums_loop():
        expected = Mangum(handler.deployed_app, lifespan="off")(event, LambdaContext())

    assert answered == expected
    assert table_digest(sql) == before


def test_a_claim_and_an_upload_that_wait_on_worker_threads(database_url, sql, monkeypatch):
    """Under a Runtime with worker threads, `blocking` hands the database work to a
    thread and the request waits for it on the calling thread's event loop."""
    configure_function(monkeypatch, "ApiFunction", database_url)
    handler.use_runtime(handler.Runtime(handler.load_settings(), worker_threads=2))
    insert_app(sql, "com.example.app", reviews="20")

    claim = handler.api(gateway_event("GET", "/queue", headers=ANALYSER), LambdaContext())
    assert (claim["statusCode"], text_answer(claim)) == (200, "com.example.app")
    token = claim["headers"]["x-analysis-claim-token"]
    assert app_row(sql, "com.example.app")["claim_token"] == token

    upload = load_event("upload-analysis.json")
    upload["headers"]["x-analysis-claim-token"] = token
    stored = handler.api(upload, LambdaContext())
    assert stored["statusCode"] == 200, stored
    assert app_row(sql, "com.example.app")["status"] == "analysed"


def test_api_answers_from_a_thread_whose_loop_was_unset(database_url, monkeypatch):
    """Mangum runs a request on the calling thread's current event loop: a new thread
    has none, and asyncio.run unsets the one a thread had when it ends. handler.api
    answers from both."""
    configure_function(monkeypatch, "ApiFunction", database_url)
    answers = []

    def ping_twice() -> None:
        answers.append(handler.api(gateway_event("GET", "/healthz"), LambdaContext()))
        asyncio.run(asyncio.sleep(0))  # a thread's asyncio.run: no current loop after it
        answers.append(handler.api(gateway_event("GET", "/healthz"), LambdaContext()))

    thread = threading.Thread(target=ping_twice)
    thread.start()
    thread.join(timeout=60)
    assert [answer["statusCode"] for answer in answers] == [200, 200]
