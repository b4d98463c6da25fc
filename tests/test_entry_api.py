"""handler.api as Lambda calls it, through Mangum, on a real PostgreSQL: every API event
in events/ (configured by events/env.json, as sam local does), with its status, body and
headers; and every event file of events/ has its test, through its entry point.

The custom resource is in test_entry_migrate.py, the scheduled report in
test_entry_report.py, secrets from Secrets Manager and SSM in test_entry_secrets.py.
"""

from __future__ import annotations

import importlib
import json
from datetime import UTC, datetime

import pytest
from kit import configure_function

import handler
from helpers import (
    EVENTS,
    UNREACHABLE_DATABASE,
    LambdaContext,
    app_row,
    env_json,
    history,
    insert_app,
    invoke_api,
    json_answer,
    load_event,
    table_digest,
    text_answer,
)

pytestmark = pytest.mark.usefixtures("lambda_container")

# The operators' hold, release and pause events: their own test walks each.
OPERATORS_EVENTS = "test_events_cover_the_routes.test_the_operators_events_answer_as_documented"
# Every file in events/ and the test (module.name) that invokes it through its entry point.
EVENT_TESTS = {
    "analysers-add.json": "test_entry_api.test_event_analysers_add",
    "analysers-list.json": "test_entry_api.test_event_analysers_list",
    "analysers-revoke.json": "test_entry_api.test_event_analysers_revoke",
    "hold-app.json": OPERATORS_EVENTS,
    "release-app.json": OPERATORS_EVENTS,
    "analysers-pause.json": OPERATORS_EVENTS,
    "analysers-resume.json": OPERATORS_EVENTS,
    "queue-pause.json": OPERATORS_EVENTS,
    "queue-resume.json": OPERATORS_EVENTS,
    "analysers-rotate.json": "test_entry_api.test_event_analysers_rotate",
    "operators-add.json": "test_entry_api.test_the_operators_events",
    "operators-list.json": "test_entry_api.test_the_operators_events",
    "operators-rotate.json": "test_entry_api.test_the_operators_events",
    "operators-revoke.json": "test_entry_api.test_the_operators_events",
    "add-app.json": "test_entry_api.test_event_add_app",
    "cfn-create.json": "test_entry_migrate.test_custom_resource_create_applies_the_ledger",
    "cfn-delete.json": "test_entry_migrate.test_custom_resource_delete_touches_no_database",
    "cfn-update.json": "test_entry_migrate.test_custom_resource_update_applies_pending_files",
    "env.json": "test_entry_api.test_event_env_json_configures_every_function",
    "get-app.json": "test_entry_api.test_event_get_app",
    "healthz-analyser.json": "test_entry_api.test_event_healthz_analyser",
    "healthz.json": "test_entry_api.test_event_healthz",
    "ping.json": "test_entry_api.test_event_ping",
    "queue-exact-app.json": "test_entry_api.test_event_queue_exact_app",
    "queue.json": "test_entry_api.test_event_queue",
    "report-failure.json": "test_entry_api.test_event_report_failure",
    "schedule.json": "test_entry_report.test_scheduled_report_log_and_metrics",
    "upload-analysis.json": "test_entry_api.test_event_upload_analysis",
}


@pytest.fixture
def api(database_url, monkeypatch):
    """Invoke handler.api with an event from events/ (optionally changed)."""
    configure_function(monkeypatch, "ApiFunction", database_url)
    return invoke_api


def test_every_event_file_has_its_test():
    assert sorted(path.name for path in EVENTS.glob("*.json")) == sorted(EVENT_TESTS)
    for target in EVENT_TESTS.values():
        module, _, test_name = target.rpartition(".")
        assert callable(getattr(importlib.import_module(module), test_name, None)), target


def test_event_env_json_configures_every_function(database_url, monkeypatch):
    # The API events carry the tokens env.json gives ApiFunction.
    api_env = env_json("ApiFunction")
    assert load_event("ping.json")["headers"]["authorization"] == (
        f"Bearer {api_env['UPLOAD_PASSWORD']}"
    )
    assert load_event("add-app.json")["headers"]["authorization"] == (
        f"Bearer {api_env['ADMIN_TOKEN']}"
    )
    # Its empty values mean "not set", and DB_* are unused next to DATABASE_URL.
    configure_function(monkeypatch, "ApiFunction", database_url)
    config = handler.settings()
    assert (config.upload_password, config.admin_token) == (
        "local-upload-password",
        "local-admin-token",
    )
    assert config.upload_password_secret is None and config.admin_token_secret is None
    assert config.db_host is None and config.db_secret_id is None
    # MigrationFunction and ReportFunction run with their env.json blocks.
    configure_function(monkeypatch, "MigrationFunction", database_url)
    assert handler.settings().upload_password is None
    create = {**load_event("cfn-create.json"), "ResponseURL": ""}
    assert handler.migrate(create, LambdaContext())["Status"] == "SUCCESS"
    configure_function(monkeypatch, "ReportFunction", database_url)
    status = handler.report(load_event("schedule.json"), LambdaContext())
    assert status["total"] == 0 and status["backlog_total"] == 0


def test_event_ping(api, sql):
    answer = api("ping.json")
    assert answer["statusCode"] == 200
    assert text_answer(answer) == "online"
    # Known by source address and User-Agent (no X-Analyser-Id in the event).
    assert sql.run(
        "SELECT analyser_id, source_address, user_agent, pings FROM analyser_heartbeats"
    ) == [["203.0.113.10 curl/7.88.1", "203.0.113.10", "curl/7.88.1", 1]]
    api("ping.json")
    assert sql.run("SELECT pings FROM analyser_heartbeats") == [[2]]

    wrong = api("ping.json", {"authorization": "Bearer local-admin-token"})
    assert wrong["statusCode"] == 401
    assert json_answer(wrong) == {"detail": "Please provide correct password."}
    assert wrong["headers"]["www-authenticate"] == "Bearer"
    assert sql.run("SELECT pings FROM analyser_heartbeats") == [[2]]


def test_event_queue(api, sql):
    insert_app(sql, "com.example.app", reviews="20")
    insert_app(sql, "com.example.other", reviews="3")

    first = api("queue.json")
    assert first["statusCode"] == 200
    assert text_answer(first) == "com.example.app"
    token = first["headers"]["x-analysis-claim-token"]
    assert len(token) >= 20
    row = app_row(sql, "com.example.app")
    assert (row["status"], row["claim_token"]) == ("processing", token)
    assert row["processing_started"] is not None

    second = api("queue.json")
    assert text_answer(second) == "com.example.other"
    assert second["headers"]["x-analysis-claim-token"] != token

    empty = api("queue.json")
    assert (empty["statusCode"], text_answer(empty)) == (200, "")
    assert "x-analysis-claim-token" not in empty["headers"]


def test_event_queue_exact_app(api, sql):
    insert_app(sql, "com.example.popular", reviews="999999")
    insert_app(sql, "com.example.app", reviews="1")

    answer = api("queue-exact-app.json")
    assert answer["statusCode"] == 200
    assert text_answer(answer) == "com.example.app"
    assert (
        app_row(sql, "com.example.app")["claim_token"]
        == (answer["headers"]["x-analysis-claim-token"])
    )
    assert app_row(sql, "com.example.popular")["status"] == "queued"
    # Now under a live lease: not a candidate, so exact-app mode answers empty.
    again = api("queue-exact-app.json")
    assert (again["statusCode"], text_answer(again)) == (200, "")
    assert "x-analysis-claim-token" not in again["headers"]


def test_event_upload_analysis(api, sql):
    event_body = json.loads(load_event("upload-analysis.json")["body"])
    unknown = api("upload-analysis.json")
    assert unknown["statusCode"] == 404
    assert json_answer(unknown) == {"detail": "unknown app com.example.app"}
    assert sql.run("SELECT count(*) FROM apps") == [[0]]

    insert_app(sql, "com.example.app", reviews="1234")
    assert text_answer(api("queue.json")) == "com.example.app"
    answer = api("upload-analysis.json")
    assert answer["statusCode"] == 200
    body = json_answer(answer)
    assert body["rowCount"] == 1
    (row,) = body["rows"]
    assert row["appid"] == "com.example.app"
    assert row["details"] == {
        "appId": "com.example.app",
        "title": "com.example.app",
        "reviews": "1234",
    }
    analysed = datetime.fromisoformat(row["analysed"])
    assert abs((datetime.now(UTC) - analysed).total_seconds()) < 60

    stored = app_row(sql, "com.example.app")
    assert (stored["status"], stored["analysisversion"]) == ("analysed", 4)
    assert stored["analysis"] == event_body
    assert stored["claim_token"] is None and stored["processing_started"] is None
    assert history(sql, "com.example.app") == [[event_body, 4, True]]


def test_event_report_failure(api, sql):
    insert_app(sql, "com.example.app")
    assert text_answer(api("queue.json")) == "com.example.app"
    answer = api("report-failure.json")
    assert answer["statusCode"] == 200
    body = json_answer(answer)
    assert body["rowCount"] == 1
    assert [row["appid"] for row in body["rows"]] == ["com.example.app"]

    stored = app_row(sql, "com.example.app")
    assert stored["status"] == "failed"
    assert (stored["failure_reason"], stored["failure_retryable"]) == ("app_not_found", False)
    assert stored["analysis"] == {
        "success": False,
        "logs": load_event("report-failure.json")["body"],
        "reason": "app_not_found",
        "retryable": False,
    }
    assert history(sql, "com.example.app")[0][1:] == [4, False]
    # Not retryable: never handed out again.
    assert text_answer(api("queue.json")) == ""


def test_event_add_app(api, sql):
    created = api("add-app.json")
    assert created["statusCode"] == 201
    body = json_answer(created)
    assert body["appId"] == "com.example.app"
    assert body["status"] == "queued"
    assert body["details"] == {"title": "Example", "reviews": "1234"}
    assert (body["analysis"], body["analysed"], body["analysisVersion"]) == (None, None, None)
    assert app_row(sql, "com.example.app")["status"] == "queued"

    existing = api("add-app.json")
    assert existing["statusCode"] == 200
    assert json_answer(existing) == body
    assert sql.run("SELECT count(*) FROM apps") == [[1]]

    # The analysers' token is not the admin token.
    before = table_digest(sql)
    analyser = api("add-app.json", {"authorization": "Bearer local-upload-password"})
    assert analyser["statusCode"] == 401
    assert json_answer(analyser) == {"detail": "Please provide correct password."}
    assert table_digest(sql) == before


def test_event_get_app(api, sql):
    missing = api("get-app.json")
    assert missing["statusCode"] == 404
    assert json_answer(missing) == {"detail": "unknown app com.example.app"}

    insert_app(sql, "com.example.app", reviews="5")
    insert_app(sql, "com.example.bigger", reviews="50")
    queued = api("get-app.json")
    assert queued["statusCode"] == 200
    body = json_answer(queued)
    assert body["appId"] == "com.example.app"
    assert body["status"] == "queued"
    assert body["queuePosition"] == 2
    assert body["details"] == {
        "appId": "com.example.app",
        "title": "com.example.app",
        "reviews": "5",
    }
    assert body["analysis"] is None and body["analysisVersion"] is None

    sql.run("DELETE FROM apps")
    insert_app(
        sql, "com.example.app", status="failed", reason="paid_app", retryable=False, version=4
    )
    failed = json_answer(api("get-app.json"))
    assert failed["status"] == "failed"
    assert failed["failure"] == {"reason": "paid_app", "retryable": False}
    assert "queuePosition" not in failed


def test_event_healthz(api, monkeypatch):
    answer = api("healthz.json")
    assert answer["statusCode"] == 200
    assert json_answer(answer) == {"status": "ok", "version": handler.package_version()}

    configure_function(monkeypatch, "ApiFunction", UNREACHABLE_DATABASE)
    down = api("healthz.json")
    assert down["statusCode"] == 503
    assert json_answer(down) == {"detail": "database unavailable, try again shortly"}


def test_event_healthz_analyser(api):
    before = api("healthz-analyser.json")
    assert before["statusCode"] == 503
    assert json_answer(before) == {
        "status": "offline",
        "minutesSinceLastPing": None,
        "analysersLastHour": 0,
    }

    assert api("ping.json")["statusCode"] == 200
    after = api("healthz-analyser.json")
    assert after["statusCode"] == 200
    assert json_answer(after) == {
        "status": "online",
        "minutesSinceLastPing": 0.0,
        "analysersLastHour": 1,
    }


# The four /analysers events, in the order an operator uses them: add pi-01, rotate its
# token (the old one working for the event's hour), list, revoke.


def test_event_analysers_add(api, sql):
    created = api("analysers-add.json")
    assert created["statusCode"] == 201
    body = json_answer(created)
    assert set(body) == {"name", "created", "token"} and body["name"] == "pi-01"
    assert api("ping.json", {"authorization": f"Bearer {body['token']}"})["statusCode"] == 200

    before = table_digest(sql)
    again = api("analysers-add.json")
    assert again["statusCode"] == 409
    assert json_answer(again) == {"detail": "an analyser named pi-01 exists"}
    upload_password = api("analysers-add.json", {"authorization": "Bearer local-upload-password"})
    assert upload_password["statusCode"] == 401
    assert table_digest(sql) == before


def test_event_analysers_rotate(api):
    assert api("analysers-rotate.json")["statusCode"] == 404
    old = json_answer(api("analysers-add.json"))["token"]
    rotated = api("analysers-rotate.json")
    assert rotated["statusCode"] == 200
    body = json_answer(rotated)
    assert body["name"] == "pi-01" and body["token"] != old
    valid_until = datetime.fromisoformat(body["previousTokenValidUntil"])
    rotated_at = datetime.fromisoformat(body["rotated"])
    assert (valid_until - rotated_at).total_seconds() == 3600  # the event's {"overlap": "1h"}
    for token in (old, body["token"]):
        assert api("ping.json", {"authorization": f"Bearer {token}"})["statusCode"] == 200


def test_event_analysers_list(api):
    assert json_answer(api("analysers-list.json")) == {"analysers": []}
    token = json_answer(api("analysers-add.json"))["token"]
    api("ping.json", {"authorization": f"Bearer {token}"})
    listed = api("analysers-list.json")
    assert listed["statusCode"] == 200
    (analyser,) = json_answer(listed)["analysers"]
    assert analyser["name"] == "pi-01" and analyser["online"] is True
    assert analyser["revoked"] is None and "token" not in analyser
    assert token not in listed["body"]


def test_the_operators_events(api, sql):
    """alice added (her token, once), rotated with the event's hour of overlap, listed
    (never a token), revoked: each as API Gateway sends it; then each refused as it must."""
    assert api("operators-rotate.json")["statusCode"] == 404
    added = api("operators-add.json")
    assert added["statusCode"] == 201
    token = json_answer(added)["token"]
    assert set(json_answer(added)) == {"name", "created", "readOnly", "token"}
    assert api("operators-add.json")["statusCode"] == 409
    rotated = json_answer(api("operators-rotate.json"))
    until = datetime.fromisoformat(rotated["previousTokenValidUntil"])
    assert (until - datetime.fromisoformat(rotated["rotated"])).total_seconds() == 3600
    for working in (token, rotated["token"]):
        answer = api("operators-list.json", {"authorization": f"Bearer {working}"})
        assert answer["statusCode"] == 200 and working not in answer["body"]
    (listed,) = json_answer(answer)["operators"]
    assert listed["name"] == "alice" and listed["revoked"] is None
    assert json_answer(api("operators-revoke.json"))["name"] == "alice"
    for gone in (token, rotated["token"]):
        assert api("operators-list.json", {"authorization": f"Bearer {gone}"})["statusCode"] == 401
    assert api("operators-rotate.json")["statusCode"] == 409
    assert sql.run("SELECT actor FROM operator_actions ORDER BY id") == [["admin token"]] * 3


def test_event_analysers_revoke(api):
    assert api("analysers-revoke.json")["statusCode"] == 404
    token = json_answer(api("analysers-add.json"))["token"]
    revoked = api("analysers-revoke.json")
    assert revoked["statusCode"] == 200
    assert json_answer(revoked)["name"] == "pi-01"
    assert api("ping.json", {"authorization": f"Bearer {token}"})["statusCode"] == 401
    assert api("analysers-rotate.json")["statusCode"] == 409
