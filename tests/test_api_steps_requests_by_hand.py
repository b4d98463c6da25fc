"""handler.api steps a request's ASGI coroutine by hand (handler.answer_asgi) instead of
running it as a task on an event loop, as Mangum does; what it answers is what Mangum's
own run (mangum.protocols.HTTPCycle called on the app) answers, for every shape of app:
one that never waits (every request on Lambda), and ones that wait on the loop, on a
worker thread's future or on a queue, set context variables, ask for the running loop,
time out or are cancelled once they waited, or fail before or after their answer
started. Then the service itself: generated
requests through handler.api, against Mangum's own run of the same app, and a claim and
an upload under a Runtime with worker threads, whose requests do wait."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import configure_function
from mangum import Mangum
from mangum.protocols import HTTPCycle

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

CALLERS = contextvars.ContextVar("callers", default="the caller's")
WORKER = ThreadPoolExecutor(2, thread_name_prefix="test-worker")

# What a generated app does before it answers, in order.
STEPS = (
    "yield to the loop",
    "wait on a thread",
    "wait on a queue",
    "set a variable",
    "loop",
    "time out after a wait",
    "be cancelled after a wait",
)
ENDINGS = ("answer", "answer in chunks", "fail before the answer", "fail during the answer")


def scripted_app(steps: list[str], ending: str, status: int, seen: list):
    """An ASGI app that takes `steps`, then ends as `ending` says, answering with the
    request's body and what it saw of the running loop and the context."""

    async def app(scope, receive, send) -> None:
        request = await receive()
        for step in steps:
            if step == "yield to the loop":
                await asyncio.sleep(0)
            elif step == "wait on a thread":
                await asyncio.wrap_future(WORKER.submit(lambda: None))
            elif step == "wait on a queue":
                queue = asyncio.Queue()
                asyncio.get_running_loop().call_soon(queue.put_nowait, "item")
                assert await queue.get() == "item"
            elif step == "set a variable":
                CALLERS.set("the app's")
            elif step == "time out after a wait":  # the timeout cancels the app's own wait
                await asyncio.sleep(0)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0):
                        await asyncio.sleep(60)
            elif step == "be cancelled after a wait":  # the app ends with CancelledError
                await asyncio.sleep(0)
                asyncio.current_task().cancel()
                await asyncio.sleep(0)
            else:
                seen.append(asyncio.get_running_loop())
        if ending == "fail before the answer":
            raise RuntimeError("failed before the answer")
        await send({"type": "http.response.start", "status": status, "headers": [[b"a", b"1"]]})
        body = request["body"] + CALLERS.get().encode()
        if ending == "fail during the answer":
            raise RuntimeError("failed during the answer")
        if ending == "answer in chunks":
            await send({"type": "http.response.body", "body": body[:3], "more_body": True})
            body = body[3:]
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return app


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


@given(
    steps=st.lists(st.sampled_from(STEPS), max_size=6),
    ending=st.sampled_from(ENDINGS),
    status=st.integers(100, 599),
    body=st.binary(max_size=40),
)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_request_stepped_by_hand_answers_as_mangums_task(steps, ending, status, body):
    scope = {"type": "http", "method": "GET", "path": "/", "headers": []}
    seen_by_mangum: list = []
    with mangums_loop():
        expected = HTTPCycle(scope, body)(scripted_app(steps, ending, status, seen_by_mangum))
    seen: list = []
    answered = handler.answer_asgi(
        HTTPCycle(scope, body), scripted_app(steps, ending, status, seen)
    )

    assert answered == expected
    # The app ran in a context of its own, and the caller has no running loop after it.
    assert CALLERS.get() == "the caller's"
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()
    # The app saw a running loop at every step it took (as many as under Mangum: none
    # after a cancellation), waited or not: one loop, every time.
    cancelled = "be cancelled after a wait"
    taken = steps[: steps.index(cancelled)] if cancelled in steps else steps
    assert len(seen) == len(seen_by_mangum) == taken.count("loop")
    assert len(set(map(id, seen))) <= 1


def test_a_request_that_never_waits_needs_no_loop_turn():
    """Nothing of a request that never waits is left for the loop: the loop has not run
    (it would raise here if it were running, and run_until_complete would have started
    it), and the answer is complete."""
    ran: list = []

    async def app(scope, receive, send) -> None:
        ran.append(asyncio.get_running_loop().is_running())
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    answer = handler.answer_asgi(
        HTTPCycle({"type": "http", "method": "GET", "path": "/"}, b""), app
    )
    assert answer == {"status": 204, "headers": [], "body": b""}
    assert ran == [False]


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
    thread and the request waits for it: stepped by hand, then finished by a task."""
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
