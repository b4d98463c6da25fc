"""The operators' web view (/admin) through the Lambda entry point, as API Gateway calls
it: off means 404 everywhere; sign-in sets a signed HttpOnly, SameSite=Strict cookie and
never shows the token; a write by cookie must come from the page itself; read-only
refuses every action; sign-ins are rate-limited per address; every answer carries the
security headers; every action is recorded; and for any app, the "why" agrees with the
queue's rule and with what a claim hands out. (The pages themselves, in a browser:
tests/test_web_view_in_a_browser.py.)"""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime, timedelta
from urllib.parse import urlencode

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kit import ADMIN_TOKEN, UPLOAD_PASSWORD, configure_service

import handler
from helpers import call_api, gateway_event, insert_app, table_digest
from queue_model import App, claimable_by_name

SAME_ORIGIN = {"sec-fetch-site": "same-origin"}
BEARER = {"authorization": f"Bearer {ADMIN_TOKEN}"}
JSON = {"content-type": "application/json"}


@pytest.fixture
def web(database_url, monkeypatch):
    """The web view on (full), and a way to change its mode."""

    def mode(value: str, **extra: str) -> None:
        configure_service(monkeypatch, database_url, ADMIN_WEB=value, **extra)

    mode("full")
    return mode


def request(method, path, headers=None, body=None, source="203.0.113.9", query=""):
    event = gateway_event(method, path, query=query, headers=headers or {}, body=body)
    event["requestContext"]["http"]["sourceIp"] = source
    event["headers"].setdefault("x-forwarded-proto", "https")
    return call_api(event)


def sign_in(token=ADMIN_TOKEN, source="203.0.113.9", headers=SAME_ORIGIN):
    return request(
        "POST",
        "/admin/login",
        {**headers, "content-type": "application/x-www-form-urlencoded"},
        urlencode({"token": token}),
        source=source,
    )


def set_cookie(answer) -> str | None:
    """The answer's Set-Cookie (payload 2.0 carries it in `cookies`)."""
    (cookie,) = answer.get("cookies") or [None]
    return cookie


def cookie_of(answer) -> str:
    return set_cookie(answer).split(";")[0]


def signed_in() -> dict[str, str]:
    answer = sign_in()
    assert answer["statusCode"] == 303, answer
    return {"cookie": cookie_of(answer)}


def body(answer):
    return json.loads(answer["body"])


def actions(sql):
    return sql.run("SELECT actor, source, action, app_id, analyser, outcome FROM operator_actions")


def test_off_is_404_for_every_admin_path_and_method(web):
    web("off")
    for method, path, *_ in handler.ADMIN_ROUTES:
        path = path.replace("{appId}", "com.example.app").replace("{name}", "pi-01")
        for headers in ({}, BEARER):
            answer = request(method, path, {**headers, **SAME_ORIGIN, **JSON}, "{}")
            assert answer["statusCode"] == 404, (method, path)
            assert answer["headers"]["x-frame-options"] == "DENY"
    assert request("GET", "/admin/anything/else")["statusCode"] == 404
    assert request("GET", "/admin")["statusCode"] == 404
    for method in ("TRACE", "PROPFIND"):  # a method no /admin route takes: 404 too
        answer = request(method, "/admin/static/admin.js")
        assert answer["statusCode"] == 404 and "allow" not in answer["headers"], answer


def test_the_default_is_off(database_url, monkeypatch):
    configure_service(monkeypatch, database_url)
    assert handler.settings().admin_web == "off"
    assert request("GET", "/admin/login")["statusCode"] == 404


def test_a_mode_that_does_not_exist_is_refused_by_name(database_url, monkeypatch):
    with pytest.raises(handler.ConfigError, match="ADMIN_WEB must be one of"):
        handler.load_settings({"ADMIN_WEB": "on", "DATABASE_URL": database_url})


def test_every_admin_answer_carries_the_security_headers(web, sql):
    cookie = signed_in()
    answers = [request("GET", "/admin/login"), request("GET", "/admin/nothing-here")]
    # Refused before any route runs: a method no route takes.
    answers += [request("TRACE", "/admin/static/admin.js"), request("PROPFIND", "/admin")]
    assert [answer["statusCode"] for answer in answers[2:]] == [405, 405], answers[2:]
    for method, path, *_ in handler.ADMIN_ROUTES:
        path = path.replace("{appId}", "com.example.app").replace("{name}", "pi-01")
        answers.append(request(method, path, {**cookie, **SAME_ORIGIN, **JSON}, "{}"))
        answers.append(request(method, path))  # signed out: 401, 303 or the asset
    for answer in answers:
        for name, value in handler.ADMIN_HEADERS.items():
            assert answer["headers"][name.lower()] == value, (name, answer)
    csp = handler.ADMIN_HEADERS["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp


@pytest.mark.parametrize("site", ["same-site", "cross-site", "none"])
def test_data_read_by_cookie_from_another_page_is_refused(web, sql, site):
    """Sec-Fetch-Site other than same-origin on a read of data by cookie: 403 (another
    port of the same host gets the SameSite cookie sent). The pages themselves, a read
    with no such header (not a browser) and a bearer token's read are answered."""
    cookie = signed_in()
    for path in ("/admin/api/status", "/admin/api/history", "/admin/api/apps"):
        refused = request("GET", path, {**cookie, "sec-fetch-site": site})
        assert refused["statusCode"] == 403, (path, refused)
        assert "own pages" in body(refused)["detail"]
        assert request("GET", path, {**cookie, **SAME_ORIGIN})["statusCode"] == 200
        assert request("GET", path, cookie)["statusCode"] == 200
        assert request("GET", path, {**BEARER, "sec-fetch-site": site})["statusCode"] == 200
    # A page reached by a link from elsewhere is served (its data then read same-origin).
    assert request("GET", "/admin", {**cookie, "sec-fetch-site": site})["statusCode"] == 200


def test_a_header_given_twice_is_refused_with_the_security_headers(web, client):
    """Refused before the route runs (the whole request's headers are read first), and
    answered as every /admin answer is; an HTTP API joins repeated headers, so this is
    `serve`'s case."""
    twice = [("authorization", f"Bearer {ADMIN_TOKEN}"), ("authorization", "Bearer other")]
    answer = client.get("/admin/api/history", headers=twice)
    assert answer.status_code == 400 and "more than once" in answer.json()["detail"]
    for name, value in handler.ADMIN_HEADERS.items():
        assert answer.headers[name] == value, name
    # Outside /admin, as before: no page's headers on an API answer.
    answer = client.get("/analysers", headers=twice)
    assert answer.status_code == 400 and "content-security-policy" not in answer.headers


def test_sign_in_sets_a_session_cookie_and_never_shows_the_token(web, sql):
    form = request("GET", "/admin/login")
    assert form["statusCode"] == 200
    assert 'name="token"' in form["body"] and 'method="post"' in form["body"]
    answer = sign_in()
    assert answer["statusCode"] == 303
    assert answer["headers"]["location"] == "/admin"
    attributes = [part.strip() for part in set_cookie(answer).split(";")]
    assert {"HttpOnly", "SameSite=Strict", "Path=/admin", "Secure"} <= set(attributes)
    assert f"Max-Age={handler.ADMIN_SESSION_HOURS * 3600}" in attributes
    assert ADMIN_TOKEN not in json.dumps(answer)
    (row,) = actions(sql)
    assert row[0].startswith("admin token, session ") and row[2] == "sign-in"
    # The page a session sees carries no token either.
    page = request("GET", "/admin", {"cookie": cookie_of(answer)})
    assert page["statusCode"] == 200 and ADMIN_TOKEN not in page["body"]


def test_the_cookie_is_secure_only_over_https(web):
    event = gateway_event(
        "POST",
        "/admin/login",
        headers={**SAME_ORIGIN, "content-type": "application/x-www-form-urlencoded"},
        body=urlencode({"token": ADMIN_TOKEN}),
    )
    event["headers"]["x-forwarded-proto"] = "http"
    assert "Secure" not in set_cookie(call_api(event))


def test_a_wrong_token_is_refused_and_recorded_and_no_cookie_is_set(web, sql):
    answer = sign_in("not-the-token")
    assert answer["statusCode"] == 401
    assert set_cookie(answer) is None
    assert "not-the-token" not in answer["body"]
    assert actions(sql) == [["sign-in", "203.0.113.9", "sign-in refused", None, None, None]]


def test_sign_in_must_come_from_the_sign_in_page(web, sql):
    for headers in ({}, {"sec-fetch-site": "cross-site"}, {"sec-fetch-site": "same-site"}):
        answer = sign_in(headers=headers)
        assert answer["statusCode"] == 403
        assert set_cookie(answer) is None
    assert actions(sql) == []


def test_a_token_in_the_url_signs_no_one_in(web):
    answer = request("GET", "/admin/login", query=urlencode({"token": ADMIN_TOKEN}))
    assert answer["statusCode"] == 200 and set_cookie(answer) is None
    assert request("GET", "/admin/api/status", query=f"token={ADMIN_TOKEN}")["statusCode"] == 401


def test_refused_sign_ins_are_limited_per_address(web, sql):
    for _ in range(handler.SIGN_IN_REFUSALS_ALLOWED):
        assert sign_in("wrong", source="198.51.100.7")["statusCode"] == 401
    # Past the limit even the right token is answered 429: the limit says nothing of it.
    limited = sign_in(source="198.51.100.7")
    assert limited["statusCode"] == 429
    assert int(limited["headers"]["retry-after"]) == handler.SIGN_IN_WINDOW_MINUTES * 60
    assert set_cookie(limited) is None
    # Another address is not limited.
    assert sign_in(source="198.51.100.8")["statusCode"] == 303


def test_pages_send_a_signed_out_browser_to_the_sign_in_page(web):
    for path in ("/admin", "/admin/apps", "/admin/apps/com.example.app", "/admin/analysers"):
        answer = request("GET", path)
        assert answer["statusCode"] == 303 and answer["headers"]["location"] == "/admin/login"
    answer = request("GET", "/admin/api/status")
    assert answer["statusCode"] == 401


def test_sign_out_ends_the_session_for_good(web, sql):
    cookie = signed_in()
    assert request("GET", "/admin/api/status", cookie)["statusCode"] == 200
    out = request("POST", "/admin/logout", {**cookie, **SAME_ORIGIN, **JSON}, "{}")
    assert out["statusCode"] == 200 and "Max-Age=0" in set_cookie(out)
    # The same cookie, kept by someone who copied it, opens nothing now.
    assert request("GET", "/admin/api/status", cookie)["statusCode"] == 401
    assert [row[2] for row in actions(sql)] == ["sign-in", "sign-out"]


def test_rotating_the_admin_token_ends_every_session(web):
    cookie = signed_in()
    # The first sign-in put the admin token in the database: a new value in the
    # environment changes nothing now (the database's hash decides), a rotation does.
    web("full", ADMIN_TOKEN="a-new-admin-token")
    assert request("GET", "/admin/api/status", cookie)["statusCode"] == 200
    handler.rotate_credential(
        handler.api_connection(), handler.Operator("t", "t"), "admin-token", 0
    )
    assert request("GET", "/admin/api/status", cookie)["statusCode"] == 401
    assert request("GET", "/admin", cookie)["statusCode"] == 303


def test_a_session_past_its_hours_or_with_a_forged_signature_opens_nothing(web, sql):
    cookie = signed_in()
    name, _, value = cookie["cookie"].partition("=")
    session_id, _, signature = value.partition(".")
    forged = {"cookie": f"{name}={session_id}.{'0' * len(signature)}"}
    assert request("GET", "/admin/api/status", forged)["statusCode"] == 401
    assert request("GET", "/admin/api/status", cookie)["statusCode"] == 200
    sql.run("UPDATE admin_sessions SET expires = now() - interval '1 second'")
    assert request("GET", "/admin/api/status", cookie)["statusCode"] == 401


def test_a_write_by_cookie_must_come_from_the_page_itself(web, sql):
    insert_app(sql, "com.example.app", status="failed", retryable=True)
    cookie = signed_in()
    before = table_digest(sql)
    refetch = json.dumps({"appIds": ["com.example.app"], "force": False})
    for headers, status in (
        ({**JSON}, 403),  # no Sec-Fetch-Site: fail closed
        ({**JSON, "sec-fetch-site": "cross-site"}, 403),
        ({**JSON, "sec-fetch-site": "same-site"}, 403),  # another port of this host
        ({**JSON, "sec-fetch-site": "none"}, 403),
        ({**JSON, "sec-fetch-site": "same-origin,cross-site"}, 403),  # two, as API GW joins
        ({**SAME_ORIGIN, "content-type": "application/x-www-form-urlencoded"}, 415),
        ({**SAME_ORIGIN, "content-type": "text/plain"}, 415),
    ):
        answer = request("POST", "/admin/api/refetch", {**cookie, **headers}, refetch)
        assert answer["statusCode"] == status, headers
    assert table_digest(sql) == before
    assert [row[2] for row in actions(sql)] == ["sign-in"]
    # From the page itself, it is done.
    done = request("POST", "/admin/api/refetch", {**cookie, **SAME_ORIGIN, **JSON}, refetch)
    assert done["statusCode"] == 200 and body(done)["outcomes"]["queued"] == 1


def test_the_bearer_token_needs_no_page(web, sql):
    insert_app(sql, "com.example.app", status="failed", retryable=True)
    answer = request(
        "POST",
        "/admin/api/refetch",
        {**BEARER, **JSON},
        json.dumps({"appIds": ["com.example.app"]}),
    )
    assert answer["statusCode"] == 200
    assert actions(sql) == [
        ["admin token", "203.0.113.9", "refetch", "com.example.app", None, "queued"]
    ]
    wrong = {"authorization": "Bearer wrong"}
    assert request("GET", "/admin/api/status", wrong)["statusCode"] == 401
    upload = {"authorization": f"Bearer {UPLOAD_PASSWORD}"}
    assert request("GET", "/admin/api/status", upload)["statusCode"] == 401


def test_read_only_shows_everything_and_refuses_every_action(web, sql):
    insert_app(sql, "com.example.app", status="failed", retryable=True)
    web("read-only")
    cookie = signed_in()
    page = request("GET", "/admin", cookie)
    assert 'data-mode="read-only"' in page["body"]
    for path in ("/admin/api/status", "/admin/api/apps", "/admin/api/analysers"):
        assert request("GET", path, cookie)["statusCode"] == 200, path
    before = table_digest(sql)
    writes = [
        ("/admin/api/refetch", {"appIds": ["com.example.app"], "force": True}),
        ("/admin/api/analysers", {"name": "pi-01"}),
        ("/admin/api/analysers/pi-01/rotate", {}),
        ("/admin/api/analysers/pi-01/revoke", {}),
        ("/admin/api/analysers/pi-01/pause", {}),
        ("/admin/api/analysers/pi-01/resume", {}),
        ("/admin/api/apps/com.example.app/hold", {"reason": "read-only", "force": True}),
        ("/admin/api/apps/com.example.app/release", {}),
        ("/admin/api/queue/pause", {"reason": "read-only"}),
        ("/admin/api/queue/resume", {}),
    ]
    # Every write of the web view's table is one of them.
    assert {path for path, _ in writes} >= {
        path.replace("{appId}", "com.example.app").replace("{name}", "pi-01")
        for method, path, _, who in handler.ADMIN_ROUTES
        if who == "action"
    }
    for path, sent in writes:
        for auth in (cookie, BEARER):
            answer = request("POST", path, {**auth, **SAME_ORIGIN, **JSON}, json.dumps(sent))
            assert answer["statusCode"] == 403, (path, auth)
    assert table_digest(sql) == before
    assert sql.run("SELECT count(*) FROM analysers") == [[0]]
    # Signing out is no action: it works in read-only too.
    out = request("POST", "/admin/logout", {**cookie, **SAME_ORIGIN, **JSON}, "{}")
    assert out["statusCode"] == 200


def test_what_clients_wrote_comes_back_as_json_text_only(web, sql):
    hostile = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=1</script>'
    insert_app(sql, "com.example.app", status="failed", retryable=False, reason=hostile)
    sql.run("UPDATE apps SET details = jsonb_build_object('title', CAST(:t AS text))", t=hostile)
    answer = request("GET", "/admin/api/apps/com.example.app", BEARER)
    assert answer["headers"]["content-type"] == "application/json"
    assert answer["headers"]["x-content-type-options"] == "nosniff"
    story = body(answer)
    assert story["app"]["details"]["title"] == hostile and story["failureReason"] == hostile
    # The pages are the one static shell: nothing a client wrote is ever in their HTML.
    for path in ("/admin", "/admin/apps/com.example.app", "/admin/apps"):
        page = request("GET", path, BEARER, query="q=com")
        assert "onerror" not in page["body"]
        assert re.findall(r"<script[^>]*>", page["body"]) == [
            '<script src="/admin/static/vendor/uPlot.iife.min.js" defer>',
            '<script src="/admin/static/admin.js" defer>',
        ]
    # Text into the page as text: the page's script and the charts' library (which writes
    # its titles and series' names, the analysers', with textContent) alike.
    for name in ("admin.js", "vendor/uPlot.iife.min.js"):
        script = handler.web_file(name)
        assert "innerHTML" not in script and "insertAdjacentHTML" not in script, name


def test_a_bulk_refetch_takes_at_most_its_limit_per_click_and_records_each_app(web, sql):
    sql.run(
        "INSERT INTO apps (appid, details, status, failure_reason, failure_retryable,"
        " analysis, analysed, analysisversion)"
        " SELECT 'com.example.a' || i, '{}'::jsonb, 'failed', 'analysis_failed', true,"
        " '{\"success\": false}'::jsonb, now(), 4 FROM generate_series(1, :n) i",
        n=handler.BULK_REFETCH_LIMIT + 5,
    )
    insert_app(sql, "com.example.other", status="failed", retryable=True, reason="paid_app")
    click = json.dumps({"filter": {"state": "failed", "reason": "analysis_failed"}})
    first = body(request("POST", "/admin/api/refetch", {**BEARER, **JSON}, click))
    assert first["selected"] == handler.BULK_REFETCH_LIMIT and first["more"] is True
    second = body(request("POST", "/admin/api/refetch", {**BEARER, **JSON}, click))
    assert second["selected"] == 5 and second["more"] is False
    assert sql.run("SELECT status, count(*) FROM apps GROUP BY 1 ORDER BY 1") == [
        ["failed", 1],
        ["queued", handler.BULK_REFETCH_LIMIT + 5],
    ]
    assert sql.run(
        "SELECT count(DISTINCT app_id), min(outcome), max(outcome) FROM operator_actions"
    ) == [[handler.BULK_REFETCH_LIMIT + 5, "queued", "queued"]]
    story = body(request("GET", "/admin/api/apps/com.example.a7", BEARER))
    assert [(a["action"], a["outcome"]) for a in story["actions"]] == [("refetch", "queued")]
    # Only failures are refetched by filter.
    wide = json.dumps({"filter": {"state": "analysed"}})
    assert request("POST", "/admin/api/refetch", {**BEARER, **JSON}, wide)["statusCode"] == 400


def test_analysers_are_added_rotated_and_revoked_and_each_is_recorded(web, sql):
    cookie = {**signed_in(), **SAME_ORIGIN, **JSON}
    added = request("POST", "/admin/api/analysers", cookie, json.dumps({"name": "pi-01"}))
    assert added["statusCode"] == 201 and body(added)["token"].startswith("aqa_")
    listed = request("GET", "/admin/api/analysers", cookie)
    assert body(added)["token"] not in listed["body"]
    rotated = request("POST", "/admin/api/analysers/pi-01/rotate", cookie, '{"overlap": "1h"}')
    assert rotated["statusCode"] == 200 and body(rotated)["token"] != body(added)["token"]
    revoked = request("POST", "/admin/api/analysers/pi-01/revoke", cookie, "{}")
    assert revoked["statusCode"] == 200
    again = request("POST", "/admin/api/analysers/pi-01/rotate", cookie, "{}")
    assert again["statusCode"] == 409
    assert [(row[2], row[4]) for row in actions(sql)] == [
        ("sign-in", None),
        ("add analyser", "pi-01"),
        ("rotate analyser", "pi-01"),
        ("revoke analyser", "pi-01"),
    ]


def test_the_apps_list_pages_by_keyset_and_filters_by_prefix_in_any_case(web, sql):
    for name in ("com.B.one", "com.a.two", "coma.three", "com.c", "org.x"):
        insert_app(sql, name)
    seen, after = [], ""
    while True:
        query = urlencode({"q": "COM.", "after": after})
        page = body(request("GET", "/admin/api/apps", BEARER, query=query))
        seen += [app["appId"] for app in page["apps"]]
        if page["next"] is None:
            break
        after = page["next"]
    assert seen == ["com.a.two", "com.B.one", "com.c"]
    # `after` is a position, not a bundle ID (class 6 of docs/queue.md's rule): any text
    # a row's key may be is taken back; a NUL no row can hold, nor a repeated parameter.
    for bad in ("state=lost", "reason=Bad%20Reason", "q=%3Cscript%3E", "after=%00", "q=a&q=b"):
        assert request("GET", "/admin/api/apps", BEARER, query=bad)["statusCode"] == 400, bad


def test_the_overview_is_the_queue_status_document_counted_at_most_once_a_minute(web, sql):
    insert_app(sql, "com.example.app")
    first = body(request("GET", "/admin/api/status", BEARER))
    expected = handler.queue_status(handler.api_connection(), handler.settings().policy)
    assert first["status"] == json.loads(json.dumps(expected.document()))
    insert_app(sql, "com.example.other")
    assert body(request("GET", "/admin/api/status", BEARER)) == first  # cached, and dated
    handler.runtime().clock.advance(handler.STATUS_MAX_AGE_SECONDS + 1)
    assert body(request("GET", "/admin/api/status", BEARER))["status"]["total"] == 2


# -- why: generated apps, each read against the rule (the model) and a claim

NOW_SLACK = timedelta(minutes=5)  # the rows' times are set this far from any edge
POLICY = handler.QueuePolicy()


def near_an_edge(minutes: int) -> bool:
    """Whether a time `minutes` from now is within NOW_SLACK of a cutoff of the rule, or
    of now (where a moment between two reads could flip it): apps() makes none."""
    age = -timedelta(minutes=minutes)
    edges = [timedelta(0), timedelta(minutes=POLICY.processing_timeout_minutes)]
    edges.append(timedelta(days=POLICY.stale_days))
    return any(abs(age - edge) < NOW_SLACK for edge in edges)


def near_its_retry(minutes: int) -> bool:
    """Whether a retryable failure `minutes` from now is within NOW_SLACK of its retry
    (RETRY_BACKOFF's first step: insert_app's failure is the first in a row)."""
    return abs(timedelta(minutes=-minutes, seconds=-POLICY.retry_backoff[0])) < NOW_SLACK


@st.composite
def apps(draw):
    status = draw(st.sampled_from(["queued", "processing", "analysed", "failed"]))
    minutes = st.integers(min_value=-400 * 24 * 60, max_value=30).filter(
        lambda m: not near_an_edge(m)
    )
    version = draw(st.sampled_from([None, 1, 3, 4, 5]))
    retryable = draw(st.booleans()) if status == "failed" else None
    started = analysed = None
    if status == "processing":
        started = draw(minutes)
    if status in ("analysed", "failed"):
        analysed = draw(minutes.filter(lambda m: not (retryable and near_its_retry(m))))
    return {
        "status": status,
        "version": version if status in ("analysed", "failed") else None,
        "started": started,
        "analysed": analysed,
        "attempts": draw(st.integers(min_value=0, max_value=4)),
        "retryable": retryable,
    }


def at(minutes: int | None, now: datetime) -> datetime | None:
    return None if minutes is None else now + timedelta(minutes=minutes)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(app=apps())
# Found by this test: a live lease that is the app's last (its back-off follows, not a
# hand-out), and each held state once.
@example(
    app={
        "status": "processing",
        "version": None,
        "started": -5,
        "analysed": None,
        "attempts": 3,
        "retryable": None,
    }
)
@example(
    app={
        "status": "failed",
        "version": 4,
        "started": None,
        "analysed": -60,
        "attempts": 0,
        "retryable": False,
    }
)
@example(
    app={
        "status": "analysed",
        "version": 5,
        "started": None,
        "analysed": -9999,
        "attempts": 0,
        "retryable": None,
    }
)
@example(
    app={
        "status": "analysed",
        "version": 3,
        "started": None,
        "analysed": -60,
        "attempts": 0,
        "retryable": None,
    }
)
@example(
    app={
        "status": "processing",
        "version": None,
        "started": -600,
        "analysed": None,
        "attempts": 3,
        "retryable": None,
    }
)
def test_why_agrees_with_the_rule_and_with_what_a_claim_hands_out(web, sql, app):
    sql.run("DELETE FROM apps")
    now = datetime.now(UTC)
    times = [app[part] for part in ("started", "analysed") if app[part] is not None]
    assert not any(near_an_edge(minutes) for minutes in times), app  # the examples too
    assert not (app["retryable"] and near_its_retry(app["analysed"])), app
    insert_app(
        sql,
        "com.example.app",
        status=app["status"],
        version=app["version"],
        processing_started=at(app["started"], now),
        analysed=at(app["analysed"], now),
        retryable=app["retryable"],
    )
    sql.run("UPDATE apps SET lease_attempts = :n", n=app["attempts"])
    model = App(
        appid="com.example.app",
        reviews=0,
        added=now,
        status=app["status"],
        version=app["version"],
        analysed=at(app["analysed"], now),
        started=at(app["started"], now),
        attempts=app["attempts"],
        retryable=app["retryable"],
        streak=1 if app["status"] == "failed" else 0,  # insert_app's failures in a row
    )
    why = body(request("GET", "/admin/api/apps/com.example.app", BEARER))["why"]
    # Handed out now: a candidate by the rule's upper tiers, or a retry that is due (the
    # lowest tier, which a claim of this app by name reaches as well).
    assert why["candidate"] == claimable_by_name(model, POLICY, now), (app, why)
    assert (why["held"] is None) == why["candidate"]
    if why["from"] is not None:  # when it will be one: a moment after, by the model
        then = datetime.fromisoformat(why["from"])
        assert not claimable_by_name(model, POLICY, then - NOW_SLACK), (app, why)
        assert claimable_by_name(model, POLICY, then + NOW_SLACK), (app, why)
    # And a claim of that app (exact-app mode) hands it out exactly when it is one.
    claim = request(
        "GET",
        "/queue",
        {"authorization": f"Bearer {UPLOAD_PASSWORD}"},
        query="appId=com.example.app",
    )
    assert (claim["body"] == "com.example.app") == why["candidate"], (app, why, claim)


def test_a_bulk_filter_it_cannot_read_is_refused_never_widened(web, sql):
    insert_app(sql, "com.example.paid", status="failed", retryable=False, reason="paid_app")
    insert_app(sql, "com.example.lost", status="failed", retryable=True)
    before = table_digest(sql)
    for where in (
        {"state": "failed", "reason": 5},
        {"state": "failed", "reason": ["paid_app"]},
        {"state": "failed", "reasons": "paid_app"},
        {"state": "failed", "q": {"prefix": "com"}},
        {"reason": "paid_app"},
        "failed",
    ):
        click = json.dumps({"filter": where})
        answer = request("POST", "/admin/api/refetch", {**BEARER, **JSON}, click)
        assert answer["statusCode"] == 400, where
    assert table_digest(sql) == before
    click = json.dumps({"filter": {"state": "failed", "reason": "paid_app", "q": None}})
    done = body(request("POST", "/admin/api/refetch", {**BEARER, **JSON}, click))
    assert done["selected"] == 1 and done["more"] is False


@pytest.mark.private_database  # drops the CHECK that sql/003 added
def test_an_app_with_a_bundle_id_from_before_the_checks_still_has_its_page(web, sql):
    sql.run("ALTER TABLE apps DROP CONSTRAINT IF EXISTS apps_appid_valid")
    odd = "not a bundle id!"
    insert_app(sql, odd, status="failed", retryable=False, reason="invalid_bundle_id")
    story = request("GET", "/admin/api/apps/" + odd, BEARER)
    assert story["statusCode"] == 200, story
    assert body(story)["why"]["held"] == "non_retryable"
    before = table_digest(sql)
    # Listed under the filter, never selected by it (an invalid bundle ID can never be
    # queued again); named, as its page's button names it, it is said to be invalid.
    click = json.dumps({"filter": {"state": "failed"}})
    done = body(request("POST", "/admin/api/refetch", {**BEARER, **JSON}, click))
    assert done["selected"] == 0
    click = json.dumps({"appIds": [odd]})
    done = body(request("POST", "/admin/api/refetch", {**BEARER, **JSON}, click))
    assert done["invalid"] == [odd] and done["selected"] == 0
    assert table_digest(sql) == before


@given(name=st.text(alphabet="abz09._:@-", min_size=1, max_size=64))
def test_an_analyser_name_is_one_every_url_keeps_as_written(name):
    """The names the rule takes are those a URL path keeps as written ("." and ".." are
    segments a browser or proxy folds away, so their routes could never be reached)."""
    import httpx

    kept = httpx.URL(f"http://host/admin/api/analysers/{name}/revoke").path
    try:
        handler.checked_analyser_name(name)
        accepted = True
    except handler.BadInput:
        accepted = False
    assert accepted == (kept == f"/admin/api/analysers/{name}/revoke")


def test_answers_that_carry_a_token_or_the_admin_view_are_never_stored(web, sql):
    insert_app(sql, "com.example.app")
    added = request("POST", "/analysers", {**BEARER, **JSON}, '{"name": "pi-01"}')
    rotated = request("POST", "/analysers/pi-01/rotate", {**BEARER, **JSON}, "{}")
    admin_view = request("GET", "/apps/com.example.app", BEARER)
    public_view = request("GET", "/apps/com.example.app")
    for answer in (added, rotated, admin_view):
        assert answer["headers"]["cache-control"] == "no-store", answer
    assert admin_view["headers"]["vary"] == public_view["headers"]["vary"] == "Authorization"
    assert "cache-control" not in public_view["headers"]


def test_a_refetch_names_at_most_its_limit_of_apps(web, sql):
    many = json.dumps({"appIds": ["a"] * (handler.BULK_REFETCH_LIMIT + 1)})
    answer = request("POST", "/admin/api/refetch", {**BEARER, **JSON}, many)
    assert answer["statusCode"] == 400 and "at most" in body(answer)["detail"]
    twice = json.dumps({"appIds": ["com.example.none", "com.example.none"]})
    assert body(request("POST", "/admin/api/refetch", {**BEARER, **JSON}, twice))["unknown"] == [
        "com.example.none"
    ]


def test_the_priority_report_from_a_laptop_is_the_clis(web, sql):
    insert_app(sql, "com.example.small", reviews="3")
    insert_app(sql, "com.example.big", reviews="300")
    insert_app(sql, "com.example.done", status="analysed", version=4, analysed=datetime.now(UTC))
    answer = body(request("GET", "/admin/api/priority", BEARER, query="limit=5"))
    expected = handler.priority_report(handler.api_connection(), handler.settings().policy, 5)
    assert answer["apps"] == json.loads(json.dumps(expected))
    assert [app["appid"] for app in answer["apps"]] == ["com.example.big", "com.example.small"]
    for bad in ("limit=0", "limit=1001", "limit=-1", "limit=x"):
        assert request("GET", "/admin/api/priority", BEARER, query=bad)["statusCode"] == 400


GUARDED_POSTS = [
    path for method, path, _, who in handler.ADMIN_ROUTES if method == "POST" and who != "anyone"
]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(GUARDED_POSTS),
    credentials=st.sampled_from(
        [
            {},
            {"authorization": "Bearer not-the-token"},
            {"authorization": "Basic eA=="},
            {"cookie": "analysis_queue_admin=forged.value", **SAME_ORIGIN},
            {"cookie": "analysis_queue_admin=", "sec-fetch-site": "cross-site"},
        ]
    ),
)
def test_a_write_nobody_signed_is_refused_before_its_body_is_read(web, path, credentials):
    """The body of an /admin write, up to MAX_BODY_BYTES, is read only once its sender
    is known: serve would otherwise hold a stranger's upload in memory, however slowly
    it came."""
    concrete = path.replace("{name}", "pi-1").replace("{appId}", "com.example.app")
    read: list[dict] = []
    sent: list[dict] = []

    async def receive() -> dict:
        read.append({})
        return {"type": "http.request", "body": b'{"appIds": []}', "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"host", b"queue.example"), (b"content-type", b"application/json")]
    headers += [(name.encode(), value.encode()) for name, value in credentials.items()]
    scope = {
        "type": "http", "method": "POST", "path": concrete, "raw_path": concrete.encode(),
        "query_string": b"", "headers": headers, "client": ("203.0.113.9", 1),
        "server": ("queue.example", 443), "scheme": "https", "http_version": "1.1",
        "root_path": "", "asgi": {"version": "3.0"},
    }  # fmt: skip
    # A loop of its own, never the thread's current one: asyncio.run would leave the
    # thread without one, and Mangum (every later handler.api call) asks for it.
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(handler.app(scope, receive, send))
    finally:
        loop.close()
    assert sent[0]["status"] in (401, 403), (path, credentials, sent[0]["status"])
    assert read == []
