"""Hostile input, generated: no answer is a 500, a 4xx changes nothing, and the process
that answered still hands out the oracle's app afterwards.

Requests are drawn from hostile text (lone UTF-16 surrogates, NUL, control characters,
non-ASCII, percent-escapes of invalid UTF-8), deeply nested and extreme JSON, numbers that
parse but cannot be stored, odd headers and bodies, base64 that is not. They go through
handler.api as API Gateway events (the Lambda entry point), and byte-level requests go
through uvicorn (the local server). A second property: anything the service accepts can
be finished (an app that can be added can be claimed, and its upload and its failure
report are stored).
"""

from __future__ import annotations

import itertools
import json
import socket
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import ADMIN_TOKEN, UPLOAD_PASSWORD

import handler
from helpers import (
    app_row,
    call_api,
    gateway_event,
    insert_app,
    oracle_order,
    table_digest,
)
from live import LiveServer

POLICY = handler.QueuePolicy()
ANALYSER = {"authorization": f"Bearer {UPLOAD_PASSWORD}"}
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
# The database persists across a test's examples (each example checks what it changed).
PERSISTENT_DATABASE = settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)


# --- strategies ----------------------------------------------------------------------

PIECES = [
    "\x00",
    "\ud800",
    "\udfff",
    "\udc80abc",
    "é",
    "\u2028",
    "\x7f",
    "\x1b[31m",
    "\t",
    "\r\n",
    "💥",
    "\ufffd",
    "%00",
    "%ED%A0%80",
    "%FF",
    "../",
    "'",
    '"',
    "\\",
    " ",
    "com.example.app",
    "a" * 300,
]
hostile_text = st.lists(
    st.one_of(
        st.sampled_from(PIECES),
        st.text(st.characters(exclude_categories=()), max_size=6),
    ),
    max_size=5,
).map("".join)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    hostile_text,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(hostile_text, inner, max_size=4)
    ),
    max_leaves=12,
)


def nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


RAW_JSON = [
    '{"x": 1e400}',
    '{"x": -1e400}',
    '{"x": NaN}',
    '{"x": Infinity}',
    '{"x": ' + "9" * 5000 + "}",
    '{"x": ' + "9" * 4000 + "}",
    '{"reviews": "' + "9" * 5000 + '"}',
    '{"k\\u0000": 1}',
    '{"\\ud800": 1}',
    '{"v": "\\udfff"}',
    nested(63),
    nested(64),
    nested(65),
    nested(100_000),
    "[" * 5000,
    "",
    "null",
    "[]",
    '"text"',
    "{",
    "\xff\xfe",
]


@st.composite
def json_bodies(draw) -> bytes:
    choice = draw(st.integers(0, 2))
    if choice == 0:
        return json.dumps(draw(json_values)).encode()
    if choice == 1:
        return json.dumps({"success": True, "data": draw(json_values)}).encode()
    return draw(st.sampled_from(RAW_JSON)).encode("utf-8", "surrogatepass")


def query_value(text: str) -> str:
    return quote(text, safe="", errors="surrogatepass")


HOSTILE_HEADER_VALUES = st.one_of(hostile_text, st.sampled_from(["²", "9" * 5000, "1", ""]))
MUTATIONS = (
    "app_id",
    "version",
    "auth",
    "user-agent",
    "x-analyser-id",
    "x-analysis-claim-token",
    "content-length",
    "content-type",
    "host",
    "base64",
    "path",
    "source",
    "query",
    "shape",
)

# Fields of the event that API Gateway itself fills in, set to what it never sends: the
# entry point must still answer (400), not raise.
BROKEN_SHAPES = [
    ("headers", "user-agent", 7),
    ("headers", "x-analyser-id", ["a"]),
    ("", "headers", None),
    ("", "headers", ["a"]),
    ("", "body", {"success": True}),
    ("", "body", 7),
    ("", "rawQueryString", None),
    ("", "rawQueryString", 7),
    ("requestContext", "http", None),
    ("", "requestContext", None),
    ("", "version", "1.0"),
    ("", "version", None),
]


@st.composite
def hostile_events(draw) -> dict:
    """A valid request to a route, with up to two of its parts made hostile (so that the
    hostile part reaches the code that reads it)."""
    mutations = set(draw(st.lists(st.sampled_from(MUTATIONS), max_size=2)))
    app_id = draw(st.sampled_from(["top.app", "com.example.app", "nope.app"]))
    if "app_id" in mutations:
        app_id = draw(hostile_text)
    encoded = draw(st.sampled_from([query_value(app_id), app_id]))
    version = draw(hostile_text) if "version" in mutations else "4"
    headers = dict(ANALYSER)
    if "auth" in mutations:
        headers["authorization"] = "Bearer " + draw(hostile_text)
    for name in ("user-agent", "x-analyser-id", "x-analysis-claim-token", "content-length"):
        if name in mutations:
            headers[name] = draw(HOSTILE_HEADER_VALUES)
    route = draw(st.integers(0, 8))
    method, path, query, body = "GET", "/ping", "", None
    if route == 1:
        path, query = "/queue", draw(st.sampled_from(["", f"appId={encoded}"]))
    elif route in (2, 3):
        method = "POST"
        path = "/uploadAnalysis" if route == 2 else "/reportAnalysisFailure"
        query = f"appId={encoded}&analysisVersion={query_value(version)}"
        headers["content-type"] = "application/json" if route == 2 else "text/plain"
        body = draw(json_bodies()) if route == 2 else draw(st.binary(max_size=200))
    elif route == 4:
        method, path = "POST", "/apps"
        headers = {**headers, **ADMIN, "content-type": "application/json"}
        new_app = draw(hostile_text) if "app_id" in mutations else "new.app"
        details = draw(st.one_of(json_values, st.dictionaries(st.just("reviews"), json_values)))
        body = draw(
            st.one_of(
                st.just(json.dumps({"appId": new_app, "details": details}).encode()),
                json_bodies(),
            )
        )
    elif route == 5:
        path = "/apps/" + encoded
    elif route == 6:
        path = draw(st.sampled_from(["/healthz", "/healthz/analyser"]))
    elif route == 8:  # an operator's hold, release or pause, with a body of any kind
        method = "POST"
        name = query_value(draw(hostile_text)) if "app_id" in mutations else "pi-none"
        path = draw(
            st.sampled_from(
                [
                    f"/apps/{encoded}/hold",
                    f"/apps/{encoded}/release",
                    f"/analysers/{name}/pause",
                    f"/analysers/{name}/resume",
                    "/queue/pause",
                    "/queue/resume",
                ]
            )
        )
        headers = {**headers, **ADMIN, "content-type": "application/json"}
        members = st.dictionaries(
            st.sampled_from(["reason", "force", "appId", "reason\x00"]), json_values, max_size=3
        )
        body = draw(
            st.one_of(
                st.just(b""),
                json_bodies(),
                members.map(lambda value: json.dumps(value).encode()),
                hostile_text.map(
                    lambda text: json.dumps({"reason": text}).encode("utf-8", "surrogatepass")
                ),
            )
        )
    if "content-type" in mutations:
        headers["content-type"] = draw(hostile_text)
    if "host" in mutations:
        headers["host"] = draw(st.sampled_from(["a:b", "h\ud800", "example.com:99999999999"]))
    if "path" in mutations:
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "G\x00T"]))
        path = "/" + draw(hostile_text)
    base64_body = draw(st.booleans())
    event = gateway_event(method, path, query, headers, body, base64_body=base64_body)
    if "base64" in mutations:
        event["isBase64Encoded"] = True
        event["body"] = draw(st.sampled_from(["not base64!", "\ud800", "YQ", "=" * 7]))
    if "source" in mutations:
        event["requestContext"]["http"]["sourceIp"] = draw(hostile_text)
    if "query" in mutations:  # a misspelt or extra parameter
        name = draw(st.sampled_from(["appid", "AppId", "analysisversion", "x", "appId[]"]))
        extra = f"{name}={query_value(draw(hostile_text))}"
        event["rawQueryString"] = f"{event['rawQueryString']}&{extra}".lstrip("&")
    if "shape" in mutations:
        parent, field, value = draw(st.sampled_from(BROKEN_SHAPES))
        (event[parent] if parent else event)[field] = value
    return event


# --- the property ---------------------------------------------------------------------


def seed_queue(sql) -> None:
    """Queued apps of every popularity, and rows in the other states, none of them a
    candidate except the queued ones, so that each claim can be put back."""
    sql.run(
        """INSERT INTO apps (appid, details, added)
           SELECT 'queued' || n || '.app', jsonb_build_object('reviews', (n * 37) % 101),
                  now() - make_interval(mins => n)
           FROM generate_series(1, 150) AS n"""
    )
    insert_app(sql, "top.app", reviews=10**6)
    insert_app(sql, "com.example.app", status="analysed", version=4, analysed=None)
    sql.run("UPDATE apps SET analysed = now() WHERE appid = 'com.example.app'")


def claim_matches_oracle(sql) -> None:
    """A /queue from the same process returns the oracle's first candidate; the claimed
    app is put back as it was, so the supply lasts."""
    expected = oracle_order(sql, POLICY)
    answer = call_api(gateway_event("GET", "/queue", headers=ANALYSER))
    assert answer["statusCode"] == 200, answer
    assert answer["body"] == (expected[0] if expected else "")
    if answer["body"]:
        sql.run(
            """UPDATE apps SET status = 'queued', processing_started = NULL,
                   analysis_claim_token = NULL, due = false WHERE appid = :appid""",
            appid=answer["body"],
        )


@PERSISTENT_DATABASE
@given(event=hostile_events())
def test_generated_requests_never_get_a_500_and_a_4xx_changes_nothing(database_url, sql, event):
    if not sql.run("SELECT 1 FROM apps LIMIT 1"):
        seed_queue(sql)
    before = operators_digest(sql)
    answer = call_api(event)
    assert answer["statusCode"] < 500, (event, answer)
    if 400 <= answer["statusCode"] < 500:
        assert operators_digest(sql) == before, (event, answer)
        # The database's own refusal is a last resort; the input checks name the field.
        assert "cannot be stored" not in answer["body"], (event, answer)
    # An operator's hold or pause that was taken is lifted, so that the supply lasts.
    sql.run("UPDATE apps SET held_at = NULL, held_by = NULL, hold_reason = NULL")
    sql.run("UPDATE queue_pause SET paused_at = NULL, paused_by = NULL, reason = NULL")
    claim_matches_oracle(sql)


def operators_digest(sql) -> list:
    """table_digest, and what an operator's request could change besides: the queue's
    pause, the analysers' pauses, the operators' record."""
    return [
        *table_digest(sql),
        sql.run("SELECT * FROM queue_pause"),
        sql.run("SELECT name, paused_at, paused_by FROM analysers ORDER BY name"),
        sql.run("SELECT count(*) FROM operator_actions"),
    ]


# --- anything accepted can be finished ---------------------------------------------------

bundle_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9.-]{0,20}[A-Za-z0-9-]", fullmatch=True)
serial = itertools.count()


@PERSISTENT_DATABASE
@given(
    app_id=bundle_ids,
    details=st.dictionaries(
        st.one_of(st.just("reviews"), hostile_text),
        st.one_of(json_values, st.text("0123456789", min_size=1, max_size=30)),
    ),
    analysis=st.one_of(json_bodies(), st.builds(lambda v: json.dumps(v).encode(), json_values)),
    log=st.binary(max_size=300),
)
def test_anything_accepted_can_be_claimed_and_finished(
    database_url, sql, app_id, details, analysis, log
):
    app_id = f"{app_id}.n{next(serial)}"
    added = call_api(
        gateway_event(
            "POST",
            "/apps",
            headers={**ADMIN, "content-type": "application/json"},
            body=json.dumps({"appId": app_id, "details": details}).encode(),
        )
    )
    assert added["statusCode"] in (201, 400), added
    if added["statusCode"] == 400:
        assert app_row(sql, app_id) is None
        return
    claimed = call_api(gateway_event("GET", "/queue", f"appId={app_id}", headers=ANALYSER))
    assert (claimed["statusCode"], claimed["body"]) == (200, app_id)
    token = claimed["headers"][handler.CLAIM_TOKEN_HEADER.lower()]
    target = f"appId={app_id}&analysisVersion=4"
    uploaded = call_api(
        gateway_event(
            "POST",
            "/uploadAnalysis",
            target,
            headers={
                **ANALYSER,
                "content-type": "application/json",
                "x-analysis-claim-token": token,
            },
            body=analysis,
        )
    )
    assert uploaded["statusCode"] in (200, 400), uploaded
    if uploaded["statusCode"] == 200:
        assert app_row(sql, app_id)["status"] in ("analysed", "failed")
    else:
        assert app_row(sql, app_id)["status"] == "processing"
    failed = call_api(
        gateway_event(
            "POST",
            "/reportAnalysisFailure",
            target,
            headers={**ANALYSER, "content-type": "text/plain"},
            body=log,
            base64_body=True,
        )
    )
    if uploaded["statusCode"] == 200:
        # The claim has its result: a failure report without the token cannot replace it
        # (docs/queue.md, "Results"), and changes nothing.
        before = app_row(sql, app_id)
        assert failed["statusCode"] == 409, failed
        assert app_row(sql, app_id) == before
        expected = before["status"]
    else:
        assert failed["statusCode"] == 200, failed
        expected = "failed"
    assert app_row(sql, app_id)["status"] == expected
    shown = call_api(gateway_event("GET", f"/apps/{app_id}"))
    assert shown["statusCode"] == 200
    assert json.loads(shown["body"])["status"] == expected


# --- the local server, byte by byte -------------------------------------------------------

UPLOAD = b"/uploadAnalysis?appId=top.app&analysisVersion=4"
# (path, a header that route reads, with a value it must refuse)
RAW_HEADERS = [
    (b"/ping", b"User-Agent: caf\xc3\xa9"),
    (b"/ping", b"User-Agent: a\x01b"),
    (b"/ping", b"User-Agent: \xff\xfe"),
    (b"/ping", b"X-Analyser-Id: pi\xe2\x80\x8b1"),
    (b"/ping", b"X-Analyser-Id: pi 1"),
    (UPLOAD, b"X-Analysis-Claim-Token: tok\xc3\xa9n"),
    (UPLOAD, b"X-Analysis-Claim-Token: a\x7fb"),
    (UPLOAD, b"Content-Length: \xc2\xb2"),
]


@pytest.mark.parametrize(("path", "header"), RAW_HEADERS, ids=repr)
def test_bytes_in_headers_through_uvicorn(database_url, sql, path, header):
    insert_app(sql, "top.app", reviews=5)
    sql.run("UPDATE apps SET status = 'processing', processing_started = now()")
    before = table_digest(sql)
    method = b"POST" if path == UPLOAD else b"GET"
    length = b"Content-Length: 2\r\n" if method == b"POST" and b"Length" not in header else b""
    request = b"".join(
        [
            method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n",
            b"Authorization: Bearer " + UPLOAD_PASSWORD.encode() + b"\r\n",
            b"Content-Type: application/json\r\n",
            header + b"\r\n" + length + b"\r\n",
            b"{}" if method == b"POST" else b"",
        ]
    )
    with LiveServer(handler.app) as server:
        with socket.create_connection(("127.0.0.1", server.port), 10) as conn:
            conn.sendall(request)
            reply = b""
            while chunk := conn.recv(65536):
                reply += chunk
    status = int(reply.split(b" ", 2)[1])
    assert 400 <= status < 500, reply
    assert table_digest(sql) == before


# --- what an attack from outside found (each a class, each generated above too) -----------


@pytest.mark.parametrize(
    ("body", "named", "why"),
    [
        # 1e308 is 5 characters sent, 309 written out: a thousand of them grow past the
        # document's bound (the walk meets the last first).
        ('{"x": [' + ",".join(["1e308"] * 1000) + "]}", "the analysis.x[", "bytes longer"),
        ('{"a": {"b": [1, 2, 1e1001]}}', "the analysis.a.b[2]", "exponent beyond"),
        ('{"a": {"b": [1, 2, -1E-1001]}}', "the analysis.a.b[2]", "exponent beyond"),
        ('{"n": 1.' + "1" * 5000 + "}", "the analysis.n", "more than 4300 characters"),
    ],
)
def test_numbers_postgresql_cannot_store_or_would_write_far_longer_are_refused(
    database_url, sql, body, named, why
):
    insert_app(sql, "top.app", status="processing")
    before = table_digest(sql)
    answer = call_api(
        gateway_event(
            "POST",
            "/uploadAnalysis",
            "appId=top.app&analysisVersion=4",
            headers={**ANALYSER, "content-type": "application/json"},
            body=body.encode(),
        )
    )
    assert answer["statusCode"] == 400
    detail = json.loads(answer["body"])["detail"]
    assert detail.startswith(named) and why in detail, detail
    assert table_digest(sql) == before


@pytest.mark.parametrize("reviews", [1e20, 1e300, "1" * 21, 10**21])
def test_a_review_count_is_bounded_as_postgresql_writes_it(database_url, sql, reviews):
    answer = call_api(
        gateway_event(
            "POST",
            "/apps",
            headers={**ADMIN, "content-type": "application/json"},
            body=json.dumps({"appId": "rev.app", "details": {"reviews": reviews}}).encode(),
        )
    )
    assert answer["statusCode"] == 400
    assert "details.reviews" in json.loads(answer["body"])["detail"]
    assert app_row(sql, "rev.app") is None


@pytest.mark.parametrize("parent,field,value", BROKEN_SHAPES)
def test_an_event_api_gateway_never_sends_gets_a_400(database_url, sql, parent, field, value):
    event = gateway_event("GET", "/ping", headers=ANALYSER)
    (event[parent] if parent else event)[field] = value
    answer = call_api(event)
    assert answer["statusCode"] == 400, answer
    assert sql.run("SELECT count(*) FROM analyser_heartbeats") == [[0]]


@pytest.mark.parametrize("source", ["\ud800", "\x00", "a\x7fb", "é", "1" * 200])
def test_a_source_address_that_is_not_text_gets_a_400(database_url, sql, source):
    event = gateway_event("GET", "/ping", headers=ANALYSER)
    event["requestContext"]["http"]["sourceIp"] = source
    answer = call_api(event)
    assert answer["statusCode"] == 400
    assert "source address" in json.loads(answer["body"])["detail"]
    assert sql.run("SELECT count(*) FROM analyser_heartbeats") == [[0]]


@pytest.mark.parametrize(
    "query",
    ["appid=top.app", "AppId=top.app", "appId=top.app&x=1"],
)
def test_a_misspelt_parameter_of_queue_does_not_hand_out_another_app(database_url, sql, query):
    insert_app(sql, "top.app", reviews=1)
    insert_app(sql, "other.app", reviews=9)
    answer = call_api(gateway_event("GET", "/queue", query, headers=ANALYSER))
    assert answer["statusCode"] == 400
    assert "unknown query parameter" in json.loads(answer["body"])["detail"]
    assert app_row(sql, "other.app")["status"] == "queued"
