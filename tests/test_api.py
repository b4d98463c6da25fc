"""The analysers' HTTP contract and the operators' routes, through the ASGI app."""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil

import pytest
from expected_answers import comparable, readme_walkthrough, run_readme_walkthrough
from kit import ADMIN, ADMIN_TOKEN, ANALYSER, UPLOAD_PASSWORD, configure_service

import handler
from helpers import app_row, history, insert_app, table_digest
from live import serving

EXAMPLE_ANALYSIS = {
    "success": True,
    "analysis_source": "trackerscan-ios",
    "analysis_version": "4",
    "bundleID": "com.example.app",
    "version": "5.2.1",
    "trackers": {"Google Firebase Analytics": "Google"},
    "permissions": ["Camera"],
}


def upload(client, appid, body, version="4", headers=None, content_type="application/json"):
    return client.post(
        f"/uploadAnalysis?appId={appid}&analysisVersion={version}",
        content=body if isinstance(body, bytes) else json.dumps(body).encode(),
        headers={**ANALYSER, "Content-Type": content_type, **(headers or {})},
    )


def report_failure(client, appid, log: bytes, version="4", headers=None):
    return client.post(
        f"/reportAnalysisFailure?appId={appid}&analysisVersion={version}",
        content=log,
        headers={**ANALYSER, "Content-Type": "text/plain", **(headers or {})},
    )


def test_full_cycle_ping_queue_upload(client, sql):
    insert_app(sql, "com.example.app", reviews="10")

    ping = client.get("/ping", headers=ANALYSER)
    assert (ping.status_code, ping.text) == (200, "online")
    assert ping.headers["content-type"].startswith("text/plain")
    assert sql.run("SELECT count(*) FROM analyser_heartbeats") == [[1]]

    queued = client.get("/queue", headers=ANALYSER)
    assert queued.status_code == 200
    assert queued.text == "com.example.app"
    assert queued.headers["content-type"].startswith("text/plain")
    token = queued.headers["x-analysis-claim-token"]
    assert len(token) >= 20
    row = app_row(sql, "com.example.app")
    assert row["status"] == "processing" and row["processing_started"] is not None
    assert row["claim_token"] == token

    stored = upload(client, "com.example.app", EXAMPLE_ANALYSIS)
    assert stored.status_code == 200
    assert stored.headers["content-type"] == "application/json"
    body = stored.json()
    assert body["rowCount"] == 1
    assert [r["appid"] for r in body["rows"]] == ["com.example.app"]
    assert body["rows"][0]["details"]["appId"] == "com.example.app"
    assert body["rows"][0]["analysed"] is not None

    row = app_row(sql, "com.example.app")
    assert row["status"] == "analysed"
    assert row["analysis"] == EXAMPLE_ANALYSIS
    assert row["analysisversion"] == 4
    assert row["processing_started"] is None and row["claim_token"] is None
    assert history(sql, "com.example.app") == [[EXAMPLE_ANALYSIS, 4, True]]

    empty = client.get("/queue", headers=ANALYSER)
    assert (empty.status_code, empty.text) == (200, "")
    assert "x-analysis-claim-token" not in empty.headers


def test_full_cycle_queue_failure(client, sql):
    insert_app(sql, "com.example.missing")
    assert client.get("/queue", headers=ANALYSER).text == "com.example.missing"
    log = b"step 1\nERROR: app not found in the App Store\n\xff\xfe binary tail\x00"
    answer = report_failure(client, "com.example.missing", log)
    assert answer.status_code == 200
    assert answer.json()["rowCount"] == 1
    row = app_row(sql, "com.example.missing")
    assert row["status"] == "failed"
    assert (row["failure_reason"], row["failure_retryable"]) == ("app_not_found", False)
    assert row["analysis"]["success"] is False
    assert row["analysis"]["reason"] == "app_not_found"
    assert row["analysis"]["retryable"] is False
    assert "app not found" in row["analysis"]["logs"]
    assert "\ufffd" in row["analysis"]["logs"]  # invalid UTF-8 and NUL replaced
    assert history(sql, "com.example.missing")[0][2] is False
    # Not retryable: never handed out again.
    assert client.get("/queue", headers=ANALYSER).text == ""


def test_retryable_failure_is_classified_and_kept(client, sql):
    insert_app(sql, "com.example.flaky")
    client.get("/queue", headers=ANALYSER)
    answer = report_failure(client, "com.example.flaky", b"usb disconnected")
    assert answer.status_code == 200
    row = app_row(sql, "com.example.flaky")
    assert (row["failure_reason"], row["failure_retryable"]) == ("analysis_failed", True)


ROUTES = [
    ("GET", "/ping"),
    ("GET", "/queue"),
    ("POST", "/uploadAnalysis?appId=com.example.app&analysisVersion=4"),
    ("POST", "/reportAnalysisFailure?appId=com.example.app&analysisVersion=4"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Bearer wrong",
        f"Basic {UPLOAD_PASSWORD}",
        f"Bearer {ADMIN_TOKEN}",  # the admin token is not an analyser password
        f"Bearer {UPLOAD_PASSWORD}x",
        "Bearer ",
    ],
)
def test_analyser_routes_need_the_upload_password(client, sql, method, path, authorization):
    insert_app(sql, "com.example.app")
    before = table_digest(sql)
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    answer = client.request(method, path, headers=headers, content=b"{}")
    assert answer.status_code == 401
    assert answer.json() == {"detail": "Please provide correct password."}
    assert table_digest(sql) == before


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Bearer {UPLOAD_PASSWORD}"])
def test_adding_apps_needs_the_admin_token(client, sql, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    answer = client.post("/apps", json={"appId": "com.example.new"}, headers=headers)
    assert answer.status_code == 401
    assert sql.run("SELECT count(*) FROM apps") == [[0]]


# The operators' holds and pauses (docs/api.md): the admin token's routes.
OPERATOR_ROUTES = [
    "/apps/com.example.app/hold",
    "/apps/com.example.app/release",
    "/analysers/pi-kitchen/pause",
    "/analysers/pi-kitchen/resume",
    "/queue/pause",
    "/queue/resume",
]


def holds_and_pauses(sql) -> list:
    """What a hold or a pause changes: the apps' holds, the analysers' and the queue's
    pauses, the operators' record."""
    return [
        sql.run("SELECT appid, held_at, held_by, hold_reason FROM apps ORDER BY appid"),
        sql.run("SELECT name, paused_at, paused_by FROM analysers ORDER BY name"),
        sql.run("SELECT paused_at, paused_by, reason FROM queue_pause"),
        sql.run("SELECT count(*) FROM operator_actions"),
    ]


def add_pi_kitchen(sql) -> None:
    sql.run(
        "INSERT INTO analysers (name, token_hash) VALUES ('pi-kitchen', :hash)",
        hash=handler.token_hash("aqa_kitchen"),
    )


@pytest.mark.parametrize("path", OPERATOR_ROUTES)
@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong", f"Bearer {UPLOAD_PASSWORD}", "Bearer aqa_kitchen"]
)
def test_holds_and_pauses_need_the_admin_token(client, sql, path, authorization):
    insert_app(sql, "com.example.app")
    add_pi_kitchen(sql)
    if path.endswith(("release", "resume")):  # something to release or resume
        sql.run("UPDATE apps SET held_at = now(), held_by = 'ops'")
        sql.run("UPDATE analysers SET paused_at = now(), paused_by = 'ops'")
        sql.run("UPDATE queue_pause SET paused_at = now(), paused_by = 'ops'")
    before = holds_and_pauses(sql)
    headers = {} if authorization is None else {"Authorization": authorization}
    answer = client.post(path, headers=headers)
    assert answer.status_code == 401
    assert holds_and_pauses(sql) == before


@pytest.mark.parametrize(
    ("label", "path", "body", "status"),
    [
        ("unknown app", "/apps/com.example.nope/hold", b"", 404),
        ("unknown app to release", "/apps/com.example.nope/release", b"", 404),
        # Any text a stored bundle ID may hold is looked up (a row older than sql/003 keeps
        # an invalid one): no app has it, 404.
        ("no app has that text", "/apps/bad%20id/hold", b"", 404),
        ("longer than any stored bundle ID", "/apps/" + "a" * 1001 + "/hold", b"", 400),
        ("unknown analyser", "/analysers/pi-nope/pause", b"", 404),
        ("unknown analyser to resume", "/analysers/pi-nope/resume", b"", 404),
        ("reason not text", "/apps/com.example.app/hold", b'{"reason": 5}', 400),
        ("force not a boolean", "/apps/com.example.app/hold", b'{"force": "yes"}', 400),
        ("unknown member", "/apps/com.example.app/hold", b'{"reasons": "x"}', 400),
        ("not an object", "/apps/com.example.app/hold", b'["x"]', 400),
        ("not JSON", "/apps/com.example.app/hold", b"hold it", 400),
        ("reason too long", "/queue/pause", b'{"reason": "' + b"x" * 501 + b'"}', 400),
        ("reason with NUL", "/queue/pause", b'{"reason": "a\\u0000b"}', 400),
        ("a body to release", "/apps/com.example.app/release", b'{"reason": "x"}', 400),
        ("a body to resume", "/queue/resume", b'{"reason": "x"}', 400),
        ("a body to pause one", "/analysers/pi-kitchen/pause", b'{"reason": "x"}', 400),
    ],
)
def test_bad_holds_and_pauses_get_a_clear_4xx_and_change_nothing(
    client, sql, label, path, body, status
):
    insert_app(sql, "com.example.app")
    add_pi_kitchen(sql)
    before = holds_and_pauses(sql)
    answer = client.post(path, content=body, headers={**ADMIN, "Content-Type": "application/json"})
    assert answer.status_code == status, answer.text
    assert answer.json()["detail"]
    assert holds_and_pauses(sql) == before


def test_holds_and_pauses_answer_what_they_did(client, sql):
    """Each operator's route answers its outcome, and does nothing twice: a second hold,
    release, pause or resume changes nothing and is not recorded."""
    insert_app(sql, "com.Example.App")
    add_pi_kitchen(sql)
    steps = [
        ("/apps/COM.example.app/hold", {"reason": "check"}, "held"),
        ("/apps/com.example.app/hold", {}, "already_held"),
        ("/apps/com.example.app/release", None, "released"),
        ("/apps/com.example.app/release", None, "not_held"),
        ("/analysers/pi-kitchen/pause", None, "paused"),
        ("/analysers/pi-kitchen/pause", None, "unchanged"),
        ("/analysers/pi-kitchen/resume", None, "resumed"),
        ("/analysers/pi-kitchen/resume", None, "unchanged"),
        ("/queue/pause", {"reason": "upgrade"}, "paused"),
        ("/queue/pause", {"reason": "again"}, "unchanged"),
        ("/queue/resume", None, "resumed"),
        ("/queue/resume", None, "unchanged"),
    ]
    for path, body, outcome in steps:
        answer = (
            client.post(path, json=body, headers=ADMIN)
            if body is not None
            else (client.post(path, headers=ADMIN))
        )
        assert (answer.status_code, answer.json()["outcome"]) == (200, outcome), path
        assert answer.headers["cache-control"] == "no-store"
        if path.startswith("/apps/"):
            assert answer.json()["appId"] == "com.Example.App"  # the stored bundle ID
    recorded = sql.run(
        "SELECT action, app_id, analyser, outcome FROM operator_actions ORDER BY at, id"
    )
    assert [row[:3] for row in recorded] == [
        ["hold app", "com.Example.App", None],
        ["release app", "com.Example.App", None],
        ["pause analyser", None, "pi-kitchen"],
        ["resume analyser", None, "pi-kitchen"],
        ["pause queue", None, None],
        ["resume queue", None, None],
    ]
    # What each did, in the record: as the answer said it.
    assert [row[3] for row in recorded[2:4]] == ["paused", "resumed"]


def test_add_app_and_read_it_back(client, sql):
    created = client.post(
        "/apps", json={"appId": "com.Example.New", "details": {"reviews": "12"}}, headers=ADMIN
    )
    assert created.status_code == 201
    assert created.json()["appId"] == "com.Example.New"
    assert created.json()["status"] == "queued"
    again = client.post(
        "/apps", json={"appId": "COM.EXAMPLE.NEW", "details": {"reviews": "99"}}, headers=ADMIN
    )
    assert again.status_code == 200
    assert again.json()["appId"] == "com.Example.New"
    assert again.json()["details"]["reviews"] == "12"
    assert sql.run("SELECT count(*) FROM apps") == [[1]]

    view = client.get("/apps/com.example.new")
    assert view.status_code == 200
    assert view.json()["status"] == "queued"
    assert view.json()["queuePosition"] == 1


def test_app_view_shows_position_failure_and_analysis(client, sql):
    insert_app(sql, "com.example.popular", reviews="500")
    insert_app(sql, "com.example.quiet", reviews="5")
    insert_app(
        sql, "com.example.broken", status="failed", retryable=False, reason="paid_app", version=4
    )
    assert client.get("/apps/com.example.quiet").json()["queuePosition"] == 2
    assert client.get("/apps/com.example.popular").json()["queuePosition"] == 1
    failed = client.get("/apps/COM.EXAMPLE.BROKEN").json()
    assert failed["status"] == "failed"
    assert failed["failure"] == {"reason": "paid_app", "retryable": False}
    assert client.get("/apps/com.example.nothere").status_code == 404
    assert client.get("/apps/-bad").status_code == 400


def test_upload_for_unknown_app_is_404_and_creates_nothing(client, sql):
    answer = upload(client, "com.example.ghost", EXAMPLE_ANALYSIS)
    assert answer.status_code == 404
    assert sql.run("SELECT count(*) FROM apps") == [[0]]
    assert sql.run("SELECT count(*) FROM app_analyses") == [[0]]


def test_stale_claim_token_is_409_and_writes_nothing(client, sql):
    insert_app(sql, "com.example.app")
    first = client.get("/queue", headers=ANALYSER).headers["x-analysis-claim-token"]
    # The lease expires and another analyser takes the app over.
    sql.run("UPDATE apps SET processing_started = now() - interval '3 hours'")
    import handler

    handler.promote_due_apps(handler.api_connection(), handler.settings().policy, force=True)
    second = client.get("/queue", headers=ANALYSER)
    assert second.text == "com.example.app"
    before = table_digest(sql)
    late = upload(
        client, "com.example.app", EXAMPLE_ANALYSIS, headers={"X-Analysis-Claim-Token": first}
    )
    assert late.status_code == 409
    assert table_digest(sql) == before
    current = second.headers["x-analysis-claim-token"]
    ok = upload(
        client, "com.example.app", EXAMPLE_ANALYSIS, headers={"X-Analysis-Claim-Token": current}
    )
    assert ok.status_code == 200
    # Sent again (its reply was lost): the first answer again, nothing written.
    stored = table_digest(sql)
    replay = upload(
        client, "com.example.app", EXAMPLE_ANALYSIS, headers={"X-Analysis-Claim-Token": current}
    )
    assert (replay.status_code, replay.json()) == (200, ok.json())
    assert table_digest(sql) == stored
    # A token is good for one result only: another result with it changes nothing.
    other = upload(
        client, "com.example.app", {"success": True}, headers={"X-Analysis-Claim-Token": current}
    )
    assert other.status_code == 409
    assert "result is stored already" in other.json()["detail"]
    assert table_digest(sql) == stored


def test_upload_without_token_is_accepted_as_the_deployed_analysers_do(client, sql):
    insert_app(sql, "com.example.app")
    client.get("/queue", headers=ANALYSER)
    assert upload(client, "com.example.app", EXAMPLE_ANALYSIS).status_code == 200


def test_exact_app_mode(client, sql):
    insert_app(sql, "com.example.first", reviews="100")
    insert_app(sql, "com.example.second", reviews="1")
    insert_app(sql, "com.example.done", status="analysed", version=4, analysed=None)
    sql.run("UPDATE apps SET analysed = now() WHERE appid = 'com.example.done'")
    named = client.get("/queue?appId=COM.EXAMPLE.SECOND", headers=ANALYSER)
    assert named.text == "com.example.second"
    assert client.get("/queue?appId=com.example.done", headers=ANALYSER).text == ""
    assert client.get("/queue?appId=com.example.unknown", headers=ANALYSER).text == ""
    assert client.get("/queue", headers=ANALYSER).text == "com.example.first"


def test_health_routes(client, sql):
    assert client.get("/healthz").json() == {"status": "ok", "version": handler.package_version()}
    offline = client.get("/healthz/analyser")
    assert offline.status_code == 503
    client.get("/ping", headers={**ANALYSER, "X-Analyser-Id": "pi-1"})
    online = client.get("/healthz/analyser")
    assert online.status_code == 200
    assert online.json()["status"] == "online"
    sql.run("UPDATE analyser_heartbeats SET last_seen = now() - interval '61 minutes'")
    assert client.get("/healthz/analyser").status_code == 503


def test_ping_identity_per_analyser(client, sql):
    for analyser in ("pi-1", "pi-2", "pi-1"):
        client.get("/ping", headers={**ANALYSER, "X-Analyser-Id": analyser})
    client.get("/ping", headers={**ANALYSER, "User-Agent": "curl/8.0"})
    rows = sql.run("SELECT analyser_id, pings FROM analyser_heartbeats ORDER BY analyser_id")
    assert ["pi-1", 2] in rows and ["pi-2", 1] in rows
    assert any(r[0].endswith("curl/8.0") for r in rows)


BIG = 5_000_000


def _bad_requests():
    auth = ANALYSER
    json_type = {"Content-Type": "application/json"}
    text_type = {"Content-Type": "text/plain"}
    good_body = json.dumps(EXAMPLE_ANALYSIS).encode()
    up = "/uploadAnalysis"
    fail = "/reportAnalysisFailure"
    return [
        ("no appId", "POST", f"{up}?analysisVersion=4", json_type, good_body, 400),
        ("empty appId", "POST", f"{up}?appId=&analysisVersion=4", json_type, good_body, 400),
        (
            "appId with space",
            "POST",
            f"{up}?appId=a%20b&analysisVersion=4",
            json_type,
            good_body,
            400,
        ),
        (
            "appId ends with dot",
            "POST",
            f"{up}?appId=com.x.&analysisVersion=4",
            json_type,
            good_body,
            400,
        ),
        (
            "appId starts with dash",
            "POST",
            f"{up}?appId=-x&analysisVersion=4",
            json_type,
            good_body,
            400,
        ),
        (
            "appId too long",
            "POST",
            f"{up}?appId={'a' * 256}&analysisVersion=4",
            json_type,
            good_body,
            400,
        ),
        (
            "appId with SQL",
            "POST",
            f"{up}?appId=x%27%3BDROP%20TABLE%20apps--&analysisVersion=4",
            json_type,
            good_body,
            400,
        ),
        (
            "appId with shell",
            "POST",
            f"{up}?appId=%24(reboot)&analysisVersion=4",
            json_type,
            good_body,
            400,
        ),
        (
            "appId twice",
            "POST",
            f"{up}?appId=com.example.app&appId=com.other&analysisVersion=4",
            json_type,
            good_body,
            400,
        ),
        ("no version", "POST", f"{up}?appId=com.example.app", json_type, good_body, 400),
        (
            "version text",
            "POST",
            f"{up}?appId=com.example.app&analysisVersion=four",
            json_type,
            good_body,
            400,
        ),
        (
            "version negative",
            "POST",
            f"{up}?appId=com.example.app&analysisVersion=-1",
            json_type,
            good_body,
            400,
        ),
        (
            "version float",
            "POST",
            f"{up}?appId=com.example.app&analysisVersion=4.0",
            json_type,
            good_body,
            400,
        ),
        (
            "version huge",
            "POST",
            f"{up}?appId=com.example.app&analysisVersion=99999999999999999999",
            json_type,
            good_body,
            400,
        ),
        (
            "invalid JSON",
            "POST",
            f"{up}?appId=com.example.app&analysisVersion=4",
            json_type,
            b"{not json",
            400,
        ),
        (
            "JSON array",
            "POST",
            f"{up}?appId=com.example.app&analysisVersion=4",
            json_type,
            b"[1,2]",
            400,
        ),
        (
            "JSON NaN",
            "POST",
            f"{up}?appId=com.example.app&analysisVersion=4",
            json_type,
            b'{"x": NaN}',
            400,
        ),
        (
            "non-UTF-8 JSON",
            "POST",
            f"{up}?appId=com.example.app&analysisVersion=4",
            json_type,
            b'{"x": "\xff"}',
            400,
        ),
        (
            "JSON with NUL",
            "POST",
            f"{up}?appId=com.example.app&analysisVersion=4",
            json_type,
            b'{"x": "a\\u0000b"}',
            400,
        ),
        (
            "wrong content type",
            "POST",
            f"{up}?appId=com.example.app&analysisVersion=4",
            text_type,
            good_body,
            415,
        ),
        (
            "oversized upload",
            "POST",
            f"{up}?appId=com.example.app&analysisVersion=4",
            json_type,
            b" " * (BIG + 1),
            413,
        ),
        ("failure without appId", "POST", f"{fail}?analysisVersion=4", text_type, b"log", 400),
        (
            "failure bad version",
            "POST",
            f"{fail}?appId=com.example.app&analysisVersion=x",
            text_type,
            b"log",
            400,
        ),
        (
            "failure as JSON",
            "POST",
            f"{fail}?appId=com.example.app&analysisVersion=4",
            json_type,
            b"{}",
            415,
        ),
        (
            "oversized failure log",
            "POST",
            f"{fail}?appId=com.example.app&analysisVersion=4",
            text_type,
            b"x" * (BIG + 1),
            413,
        ),
        ("queue with bad appId", "GET", "/queue?appId=..", {}, b"", 400),
        ("wrong method on queue", "POST", "/queue", {}, b"", 405),
        (
            "wrong method on upload",
            "GET",
            f"{up}?appId=com.example.app&analysisVersion=4",
            {},
            b"",
            405,
        ),
        ("path case", "GET", "/QUEUE", {}, b"", 404),
        ("trailing slash", "GET", "/queue/", {}, b"", 404),
        ("unknown path", "GET", "/admin", {}, b"", 404),
        ("bad analyser id", "GET", "/ping", {"X-Analyser-Id": "a b;rm -rf"}, b"", 400),
        (
            "unknown claim token",
            "POST",
            f"{up}?appId=com.example.app&analysisVersion=4",
            {**json_type, "X-Analysis-Claim-Token": "a"},
            good_body,
            409,
        ),
        *[
            (label, "POST", f"{up}?{query}", json_type, good_body, 400)
            for label, query in (
                (
                    "analysisVersion twice",
                    "appId=com.example.app&analysisVersion=4&analysisVersion=5",
                ),
                ("appId not ASCII", "appId=com.ex%C3%A4mple&analysisVersion=4"),
                ("appId with NUL", "appId=com.example%00.app&analysisVersion=4"),
                ("appId with newline", "appId=com.example.app%0A&analysisVersion=4"),
                ("version with plus", "appId=com.example.app&analysisVersion=%2B4"),
                ("version with space", "appId=com.example.app&analysisVersion=%204"),
                ("version empty", "appId=com.example.app&analysisVersion="),
            )
        ],
        *[
            (
                label,
                "POST",
                f"{up}?appId=com.example.app&analysisVersion=4",
                headers,
                good_body,
                401,
            )
            for label, headers in (
                ("no token", {**json_type, "Authorization": None}),
                ("wrong token", {**json_type, "Authorization": "Bearer nope"}),
                (
                    "admin token on an analyser route",
                    {**json_type, "Authorization": f"Bearer {ADMIN_TOKEN}"},
                ),
                ("token without scheme", {**json_type, "Authorization": UPLOAD_PASSWORD}),
                ("oversized token", {**json_type, "Authorization": "Bearer " + "x" * 20_000}),
            )
        ],
        (
            "token in the query string",
            "GET",
            f"/queue?password={UPLOAD_PASSWORD}",
            {"Authorization": None},
            b"",
            401,
        ),
        ("oversized analyser id", "GET", "/ping", {"X-Analyser-Id": "a" * 10_000}, b"", 400),
        (
            "no content type",
            "POST",
            f"{up}?appId=com.example.app&analysisVersion=4",
            {},
            good_body,
            415,
        ),
        (
            "empty upload",
            "POST",
            f"{up}?appId=com.example.app&analysisVersion=4",
            json_type,
            b"",
            400,
        ),
        (
            "JSON nested too deep",
            "POST",
            f"{up}?appId=com.example.app&analysisVersion=4",
            json_type,
            b"[" * 100_000,
            400,
        ),
        (
            "failure with an oversized appId",
            "POST",
            f"{fail}?appId={'x' * 300}&analysisVersion=4",
            text_type,
            b"log",
            400,
        ),
        ("app lookup with SQL", "GET", "/apps/x'%20OR%201=1--", {}, b"", 400),
        ("delete an app", "DELETE", "/apps/com.example.app", {}, b"", 405),
    ], auth


BAD_REQUESTS, _AUTH = _bad_requests()


@pytest.mark.parametrize(
    ("label", "method", "path", "headers", "body", "status"),
    BAD_REQUESTS,
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_requests_get_a_clear_4xx_and_change_nothing(
    client, sql, label, method, path, headers, body, status
):
    insert_app(sql, "com.example.app")
    before = table_digest(sql)
    merged = {k: v for k, v in {**_AUTH, **headers}.items() if v is not None}
    answer = client.request(method, path, headers=merged, content=body)
    assert answer.status_code == status, answer.text
    if status not in (404, 405):
        assert answer.json()["detail"]
    assert table_digest(sql) == before


@pytest.mark.parametrize(
    ("label", "body", "status"),
    [
        ("not JSON", b"appId=x", 400),
        ("no appId", b'{"details": {}}', 400),
        ("appId not text", b'{"appId": 5}', 400),
        ("invalid appId", b'{"appId": "bad id"}', 400),
        ("details not object", b'{"appId": "com.x", "details": [1]}', 400),
    ],
)
def test_bad_add_app_requests(client, sql, label, body, status):
    answer = client.post(
        "/apps", content=body, headers={**ADMIN, "Content-Type": "application/json"}
    )
    assert answer.status_code == status
    assert sql.run("SELECT count(*) FROM apps") == [[0]]


def chunked_upload(size: int) -> list[bytes]:
    """An upload of exactly `size` bytes (a document the service stores), in three chunks."""
    document = json.dumps({"success": True, "bundleID": "com.example.app", "pad": ""})
    body = document[:-2] + "x" * (size - len(document)) + document[-2:]
    step = -(-size // 3)
    return [body[start : start + step].encode() for start in range(0, size, step)]


def asgi_request(path: str, headers: dict[str, str], chunks: list[bytes]) -> tuple[int, bytes]:
    """handler.app asked as an HTTP server asks it for a body sent with Transfer-Encoding:
    chunked: no Content-Length, each chunk an http.request message of its own. (status,
    body)"""
    path, _, query = path.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [
            (name.lower().encode(), value.encode())
            for name, value in {**headers, "Transfer-Encoding": "chunked"}.items()
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }
    messages = [{"type": "http.request", "body": chunk, "more_body": True} for chunk in chunks]
    messages.append({"type": "http.request", "body": b"", "more_body": False})
    status, body = [], []

    async def run() -> None:
        answered = asyncio.Event()

        async def receive() -> dict:
            if messages:
                return messages.pop(0)
            await answered.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body":
                body.append(message.get("body", b""))
                if not message.get("more_body"):
                    answered.set()

        await handler.app(scope, receive, send)

    asyncio.run(run())
    return status[0], b"".join(body)


def test_a_chunked_body_past_the_limit_is_413_and_stores_nothing(database_url, sql, monkeypatch):
    """Without a Content-Length the limit is the body's total: 180 (or 101) bytes in
    three chunks under MAX_BODY_BYTES=100 are a 413 that stores nothing, through the app
    (each chunk a message of its own) and under `serve` (uvicorn on loopback,
    Transfer-Encoding: chunked); 100 bytes in chunks are stored."""
    configure_service(monkeypatch, database_url, MAX_BODY_BYTES="100")
    insert_app(sql, "com.example.app")
    path = "/uploadAnalysis?appId=com.example.app&analysisVersion=4"
    headers = {**ANALYSER, "Content-Type": "application/json"}
    before = table_digest(sql)
    for size in (180, 101):
        status, body = asgi_request(path, headers, chunked_upload(size))
        assert (status, json.loads(body)) == (413, {"detail": "body larger than 100 bytes"})
        assert table_digest(sql) == before
    with serving(handler.app) as server:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        try:
            connection.request(
                "POST", path, body=iter(chunked_upload(180)), headers=headers, encode_chunked=True
            )
            answer = connection.getresponse()
            assert (answer.status, json.loads(answer.read())) == (
                413,
                {"detail": "body larger than 100 bytes"},
            )
        finally:
            connection.close()
    assert table_digest(sql) == before
    status, body = asgi_request(path, headers, chunked_upload(100))
    assert status == 200, body
    assert app_row(sql, "com.example.app")["status"] == "analysed"


def test_database_down_is_503_without_a_stack_trace(client, monkeypatch):
    import handler

    monkeypatch.setenv("DATABASE_URL", "postgresql://postgres@127.0.0.1:9/nothing")
    handler.use_runtime(None)
    for path in ("/queue", "/ping", "/healthz"):
        answer = client.get(path, headers=ANALYSER)
        assert answer.status_code == 503
        assert answer.json() == {"detail": "database unavailable, try again shortly"}


# --- the README's walkthrough ------------------------------------------------------------


def test_the_readme_walkthrough_answers_as_the_readme_shows(database_url, monkeypatch, tmp_path):
    """Every command of the README's curl walkthrough, run as written (in one shell, on the
    tokens `serve` uses when none are set), prints what the README shows. It needs curl,
    as the README's reader does: without it this fails, never skips."""
    assert shutil.which("curl"), "curl is not installed: the README's walkthrough needs it"
    import handler
    from live import LiveServer

    configure_service(
        monkeypatch,
        database_url,
        UPLOAD_PASSWORD="local-upload-password",
        ADMIN_TOKEN="local-admin-token",
    )
    steps = readme_walkthrough()
    assert len(steps) >= 7
    assert any("X-Analysis-Claim-Token: $TOKEN" in command for command, _ in steps)
    with LiveServer(handler.app) as server:
        ran = run_readme_walkthrough(server.port, tmp_path)
    for command, shown, printed in ran:
        assert comparable(printed) == comparable(shown), command


@pytest.mark.parametrize(
    ("headers", "path"),
    [
        ([("authorization", ADMIN["Authorization"]), ("authorization", "Bearer nope")], None),
        ([("authorization", "Bearer nope"), ("authorization", ADMIN["Authorization"])], None),
        (
            [
                ("authorization", ADMIN["Authorization"]),
                ("content-type", "application/json"),
                ("content-type", "text/plain"),
            ],
            None,
        ),
        ([("authorization", ADMIN["Authorization"]), ("authorization", "Bearer nope")], "admin"),
    ],
    ids=["token first", "token last", "content type twice", "web view's JSON"],
)
def test_a_header_given_twice_is_refused_before_it_is_read(client, sql, monkeypatch, headers, path):
    """Authorization or Content-Type given twice: 400 whichever comes first, and nothing
    changes (the queue stays running, nothing is recorded), on the API and the web view."""
    if path == "admin":
        monkeypatch.setenv("ADMIN_WEB", "full")
        handler.use_runtime(None)
    before = table_digest(sql)
    url = "/admin/api/queue/pause" if path == "admin" else "/queue/pause"
    answer = client.post(url, headers=headers, content=b'{"reason": "twice"}')
    assert answer.status_code == 400, answer.text
    assert "given more than once" in answer.json()["detail"]
    assert table_digest(sql) == before
    assert sql.run("SELECT paused_at FROM queue_pause") == [[None]]
